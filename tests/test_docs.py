"""docs/backends.md is generated from the registry: it must be current, valid markdown, and say true things."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sglx import docs
from sglx.attention.registry import LLMFeatures, all_backends

DOC = Path(__file__).resolve().parents[1] / "docs" / "backends.md"


@pytest.fixture(scope="module")
def text() -> str:
    return docs.render()


def tables_under(text: str, heading: str) -> list[list[dict[str, str]]]:
    """Every markdown table between `heading` and the next heading of the same or higher level."""
    level = heading.split(" ")[0]
    lines = text.splitlines()
    start = lines.index(heading) + 1
    section = []
    for line in lines[start:]:
        if re.match(rf"#{{1,{len(level)}}} ", line):
            break
        section.append(line)
    tables, current = [], []
    for line in [*section, ""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            tables.append(current)
            current = []
    parsed = []
    for rows in tables:
        header = split_row(rows[0])
        parsed.append([dict(zip(header, split_row(r), strict=True)) for r in rows[2:]])
    return parsed


def split_row(line: str) -> list[str]:
    cells = re.split(r"(?<!\\)\|", line.strip())[1:-1]
    return [c.strip().replace("\\|", "|") for c in cells]


def row(table: list[dict[str, str]], backend: str) -> dict[str, str]:
    matches = [r for r in table if r["backend"] == f"`{backend}`"]
    assert len(matches) == 1, f"{backend} rows: {matches}"
    return matches[0]


def test_committed_docs_are_current(text: str) -> None:
    committed = DOC.read_text(encoding="utf-8") if DOC.is_file() else ""
    assert committed == text, "docs/backends.md is stale: run python -m sglx.docs"


def test_check_command_reports_stale_and_fresh(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "backends.md"
    assert docs.main(["--check", "--output", str(out)]) == 1
    assert "run python -m sglx.docs" in capsys.readouterr().err
    assert docs.main(["--output", str(out)]) == 0
    assert docs.main(["--check", "--output", str(out)]) == 0
    out.write_text(out.read_text(encoding="utf-8").replace("| `fa4` |", "| `fa5` |", 1), encoding="utf-8")
    assert docs.main(["--check", "--output", str(out)]) == 1
    err = capsys.readouterr().err
    assert "stale" in err and "run python -m sglx.docs" in err and "fa5" in err


def test_render_does_not_look_at_this_machine(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    import sglx.platform

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("docs must not depend on the machine that generates them")

    monkeypatch.setattr(sglx.platform, "current", refuse)
    assert docs.render() == text
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text), "no dates in generated docs"


def test_every_table_is_valid_github_markdown(text: str) -> None:
    lines = text.splitlines()
    blocks: list[list[str]] = []
    for i, line in enumerate(lines):
        if line.startswith("|") and (i == 0 or not lines[i - 1].startswith("|")):
            assert lines[i - 1] == "", f"table must follow a blank line: {line}"
            blocks.append([])
        if line.startswith("|"):
            blocks[-1].append(line)
    assert len(blocks) >= 5
    for block in blocks:
        width = len(split_row(block[0]))
        assert re.fullmatch(r"\|(---\|)+", block[1]) and block[1].count("|") == width + 1, block[:2]
        for line in block[2:]:
            assert line.endswith(" |") and len(split_row(line)) == width, line


def test_mha_matrix_spot_checks(text: str) -> None:
    (mha,) = tables_under(text, "## LLM attention backends: MHA")
    assert len(mha) == len(all_backends("llm", "mha"))
    assert "128 on SM90" in row(mha, "fa4")["page size > 1 (native page sizes)"]
    assert row(mha, "trtllm_mha")["page size > 1 (native page sizes)"] == "16, 32, 64"
    torch_native = row(mha, "torch_native")
    assert torch_native["implemented in sglx"] == "Y" and "CPU" in torch_native["platforms"]
    assert torch_native["CUDA graphs"] == "N"
    fa3_needs = "SM80-SM90; `flash_attn_interface` or `sgl_kernel`; dtype fp16/bf16"
    assert row(mha, "fa3")["requirements"].startswith(fa3_needs)
    assert row(mha, "fa4")["implemented in sglx"] == "Y" and row(mha, "fa4")["CUDA graphs"] == "Y"
    assert row(mha, "intel_amx")["platforms"] == "CPU"


def test_declared_rows_match_sglang_published_matrix(text: str) -> None:
    """For backends sglx only declares, the rows are SGLang's published matrix (independent reference)."""
    published_mha = {  # page size, FP8 KV, FP4 KV, topk=1, topk>1, sliding window, multimodal
        "flashinfer": ("Y", "Y", "N", "Y", "Y", "Y", "N"),
        "fa3": ("Y", "Y", "N", "Y", "Y", "Y", "Y"),
        "fa4": ("128 on SM90; any elsewhere", "N", "Y", "Y", "Y", "N", "Y"),
        "trtllm_mha": ("16, 32, 64", "Y", "Y", "Y", "N", "Y", "N"),
        "wave": ("Y", "N", "N", "N", "N", "N", "N"),
        "ascend": ("128", "N", "N", "Y", "N", "Y", "Y"),
    }
    published_mla = {  # page size, FP8 KV, FP4 KV, chunked prefix cache, topk=1, topk>1
        "flashinfer": ("1", "N", "Y", "Y", "Y", "N"),
        "flashmla": ("64", "Y", "Y", "Y", "Y", "N"),
        "cutlass_mla": ("128", "Y", "Y", "Y", "Y", "N"),
        "trtllm_mla": ("32, 64", "Y", "Y", "Y", "Y", "N"),
        "fa3": ("Y", "N", "N", "Y", "Y", "page_size=1 only"),
    }
    (mha,) = tables_under(text, "## LLM attention backends: MHA")
    (mla,) = tables_under(text, "## LLM attention backends: MLA")
    page = "page size > 1 (native page sizes)"
    checked = 0
    for name, want in published_mha.items():
        r = row(mha, name)
        if r["implemented in sglx"] == "Y":
            continue  # sglx's own implementation may do more than SGLang's kernel
        got = (r[page], r["FP8 KV"], r["FP4 KV"], r["spec topk=1"], r["spec topk>1"], r["sliding window"],
               r["multimodal"])
        assert got == want, name
        checked += 1
    for name, want in published_mla.items():
        r = row(mla, name)
        if r["implemented in sglx"] == "Y":
            continue
        got = (r[page], r["FP8 KV"], r["FP4 KV"], r["chunked prefix cache"], r["spec topk=1"], r["spec topk>1"])
        assert got == want, name
        checked += 1
    assert checked >= 5


def test_diffusion_platform_matrix(text: str) -> None:
    (dit,) = tables_under(text, "## Diffusion attention backends: platforms")
    sdpa = row(dit, "torch_sdpa")
    assert all(sdpa[k] == "Y" for k in ("CUDA", "ROCm", "MPS", "NPU", "CPU"))
    fa = row(dit, "fa")
    assert fa["aliases"] == "`fa3`, `fa4`"
    assert (fa["CUDA"], fa["ROCm"], fa["MPS"], fa["NPU"], fa["CPU"]) == ("Y", "Y", "N", "N", "N")
    assert "SM80+ (on CUDA)" in fa["requirements"]
    aiter = row(dit, "aiter")
    assert (aiter["CUDA"], aiter["ROCm"]) == ("N", "Y")
    assert row(dit, "sage_attn")["requirements"].startswith("SM80, SM86, SM89, SM90, SM120")


def test_config_parameter_tables(text: str) -> None:
    (vmoba,) = tables_under(text, "### `vmoba_attn` (diffusion)")
    params = {r["parameter"]: r for r in vmoba}
    assert params["`moba_threshold`"]["default"] == "`0.25`"
    assert params["`moba_threshold`"]["type"] == "`float`"
    assert params["`spatial_chunk_size`"]["type"] == "`list[int]`"
    assert params["`moba_select_mode`"]["default"] == '`"threshold"`'
    (sta,) = tables_under(text, "### `sliding_tile_attn` (diffusion)")
    required = {r["parameter"]: r["required"] for r in sta}
    assert required["`mask_strategy_file_path`"] == "Y" and required["`sta_mode`"] == "N"
    assert "### `torch_sdpa`" not in text  # no table for a backend without parameters


def auto_rows(text: str, platform: str) -> list[dict[str, str]]:
    (rows,) = tables_under(text, f"### {platform}")
    return rows


def first(rows: list[dict[str, str]], model: str) -> str:
    return next(r["candidate"] for r in rows if r["model"] == model and r["#"] == "1")


def test_auto_selection_follows_the_seed_rules(text: str) -> None:
    h100 = auto_rows(text, "NVIDIA H100 (SM90), CUDA 12.4")
    assert first(h100, "MHA") == "`fa3`" and first(h100, "MLA") == "`fa3`" and first(h100, "diffusion") == "`fa`"
    b200 = auto_rows(text, "NVIDIA B200 (SM100), CUDA 12.8")
    assert first(b200, "MHA") == "`trtllm_mha`" and first(b200, "MLA") == "`trtllm_mla`"
    assert first(auto_rows(text, "NVIDIA A100 (SM80), CUDA 12.4"), "MHA") == "`flashinfer`"
    assert first(auto_rows(text, "NVIDIA RTX 5090 (SM120), CUDA 12.8"), "MHA") == "`flashinfer`"
    mi300 = auto_rows(text, "AMD MI300X (ROCm)")
    assert first(mi300, "MHA") == "`aiter`" and first(mi300, "diffusion") == "`fa`"
    assert first(auto_rows(text, "Huawei Ascend NPU"), "MHA") == "`ascend`"
    assert first(auto_rows(text, "Intel XPU"), "MHA") == "`intel_xpu`"
    for plat in ("Apple MPS", "CPU only"):
        rows = auto_rows(text, plat)
        assert first(rows, "MHA") == "`torch_native`" and first(rows, "diffusion") == "`torch_sdpa`"
    old_cuda = auto_rows(text, "NVIDIA H100 (SM90), CUDA 12.2")
    fa3 = next(r for r in old_cuda if r["model"] == "MHA" and r["candidate"] == "`fa3`")
    assert fa3["runs today"].startswith("N:") and "CUDA >= 12.3" in fa3["runs today"]
    # torch_native / torch_sdpa are implemented and run everywhere, so auto always lands somewhere.
    assert text.count("Auto picks: MHA `") == len(docs.EXAMPLE_PLATFORMS)
    assert "diffusion `torch_sdpa`." in text.split("### CPU only")[1]


def test_page_size_constraints_come_from_the_features(text: str) -> None:
    section = text.split("## Page-size constraints")[1].split("\n## ")[0]
    bullets = [line for line in section.splitlines() if line.startswith("- ")]
    constrained = [s for s in all_backends("llm") if isinstance(s.features, LLMFeatures) and s.features.page_sizes]
    assert len(bullets) == len(constrained)
    assert "- `fa4` (MHA): `--page-size 128` on SM90 (any page size elsewhere)" in bullets
    assert "- `trtllm_mha` (MHA): `--page-size 16, 32 or 64`" in bullets
    assert "- `flashmla` (MLA): `--page-size 64`" in bullets
    assert "- `trtllm_mla` (MLA): `--page-size 32 or 64`" in bullets


def test_intro_says_generated_and_how(text: str) -> None:
    head = text.split("\n## ")[0]
    assert "generated by `python -m sglx.docs`" in head and "single source of truth" in head


def test_the_readme_lists_every_environment_variable_the_code_reads() -> None:
    """README's "Environment switches" table names exactly the SGLX_* variables src/ reads (as string literals)."""
    root = Path(__file__).resolve().parents[1]
    read = {m for p in (root / "src").rglob("*.py") for m in re.findall(r"[\"'](SGLX_[A-Z0-9_]+)[\"']", p.read_text())}
    readme = (root / "README.md").read_text()
    section = readme[readme.index("### Environment switches"):]
    section = section[:section.index("\n\n", section.index("| variable"))]
    listed = set(re.findall(r"^\| `(SGLX_[A-Z0-9_]+)` \|", section, flags=re.M))
    assert len(read) >= 10 and listed == read
