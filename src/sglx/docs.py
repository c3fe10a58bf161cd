"""Generate docs/backends.md from the backend registry, so the published support matrix cannot drift.

`python -m sglx.docs` rewrites the file; `python -m sglx.docs --check` exits 1 when it is stale (CI runs
this through tests/test_docs.py). Everything here is computed from the declarations in
`sglx.attention.{llm,diffusion}_backends` and from the selection functions run on fake snapshots,
and the output depends on nothing about the machine that generates it.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sglx.attention.measured.record import engine_shape, record_for
from sglx.attention.registry import (
    BackendSpec,
    DiffusionFeatures,
    LLMFeatures,
    PageSizeRule,
    all_backends,
    availability,
)
from sglx.attention.request import AttentionRequest, Kind
from sglx.attention.requirements import (
    AnyVariant,
    CapabilityIn,
    Explained,
    OnlyOn,
    OnPlatform,
    Requirement,
    device_name,
)
from sglx.attention.selection import (  # _auto_rule_reasons: the auto-only conditions (fa3 needs CUDA >= 12.3)
    LLMBackendArgs,
    ModelTraits,
    _auto_rule_reasons,
    diffusion_auto_candidates,
    llm_auto_candidates,
    select_diffusion,
    select_llm,
)
from sglx.errors import BackendUnavailableError
from sglx.platform import DEVICE_KINDS, KERNEL_PACKAGES, PlatformSnapshot, fake

GENERATE_COMMAND = "python -m sglx.docs"
DEFAULT_RELATIVE_PATH = Path("docs") / "backends.md"


# ---------------------------------------------------------------- formatting helpers


SHORT_DEVICE_NAMES = {"cuda": "CUDA", "rocm": "ROCm", "mps": "MPS", "npu": "NPU", "xpu": "XPU", "cpu": "CPU"}


def yn(value: bool) -> str:
    return "Y" if value else "N"


def cell(text: Any) -> str:
    """One table cell: pipes escaped and newlines folded, so a reason or note never breaks the table."""
    return str(text).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ").strip() or "-"


def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    """A GitHub-flavoured markdown table; every row must have as many cells as the header."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"table row has {len(row)} cells, header has {len(header)}: {row!r}")
        lines.append("| " + " | ".join(cell(c) for c in row) + " |")
    return lines


def or_list(items: Sequence[Any]) -> str:
    words = [str(i) for i in items]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def sm(major: int, minor: int | None) -> str:
    """SM90 / SM100 for one capability, SM10x for a whole major (the notation NVIDIA docs use)."""
    return f"SM{major}{minor}" if minor is not None else f"SM{major}x"


def describe_requirement(req: Requirement) -> str:
    """The registry's own description, except GPU-capability sets, written as SM90 / SM10x like Capability's."""
    if isinstance(req, CapabilityIn):
        return ", ".join(sm(major, minor) for major, minor in req.allowed)
    if isinstance(req, OnlyOn):
        return f"{describe_requirement(req.inner)} (on {'/'.join(device_name(k) for k in req.kinds)})"
    if isinstance(req, Explained):
        return describe_requirement(req.inner)
    if isinstance(req, AnyVariant):
        return "one of: " + "; ".join(
            f"{v.name} ({', '.join(describe_requirement(r) for r in v.requires)})" for v in req.variants)
    return req.describe()


def requirements_text(spec: BackendSpec) -> str:
    """Requirements other than the platform, which has its own column."""
    parts = [describe_requirement(r) for r in spec.requires if not isinstance(r, OnPlatform)]
    if spec.decode_requires:  # a prefill that runs more widely than the decode
        parts.append("decode: " + ", ".join(describe_requirement(r) for r in spec.decode_requires))
    return "; ".join(parts) or "none"


def platforms_text(spec: BackendSpec) -> str:
    return ", ".join(device_name(k) for k in spec.platforms)


def page_rule_text(rule: PageSizeRule) -> str:
    sizes = ", ".join(map(str, rule.sizes))
    return f"{sizes} on {describe_requirement(rule.on)}" if rule.on is not None else sizes


def page_sizes_cell(feats: LLMFeatures) -> str:
    """Native page sizes: a fixed list when the kernel demands one (or lists one), else Y (any) / N (gathered)."""
    if feats.page_sizes is not None:
        text = page_rule_text(feats.page_sizes)
        return f"{text}; any elsewhere" if feats.page_sizes.on is not None else text
    note = getattr(feats, "native_sizes_note", None)  # listed native sizes that are not enforced
    return note if note is not None else yn(feats.native_paging)


def topk_gt1_cell(value: bool | str) -> str:
    return value if isinstance(value, str) else yn(value)


def default_text(value: Any) -> str:
    return "-" if value is None else f"`{json.dumps(value)}`"


# ---------------------------------------------------------------- sections


def intro() -> list[str]:
    return [
        "# Attention backends",
        "",
        "<!-- GENERATED FILE: do not edit by hand. -->",
        f"This file is generated by `{GENERATE_COMMAND}` from sglx's backend registry "
        "(`src/sglx/attention/llm_backends.py` and `src/sglx/attention/diffusion_backends.py`), which is the "
        "single source of truth: selection, `sglx doctor`, error messages and this page are all computed from it. "
        f"To change this page, change a declaration and run `{GENERATE_COMMAND}`; "
        f"`{GENERATE_COMMAND} --check` (run by the tests) fails when the page is stale.",
        "",
        "Y = supported, N = not supported. For a backend sglx implements, the row states what sglx's own "
        "implementation supports; for a backend sglx only declares (\"implemented in sglx\" = N), the row is "
        "SGLang's published support matrix, and `sglx` reports it as \"not implemented in sglx yet\", never as "
        "usable. Run `sglx doctor` to see which backends work on your machine and why the others don't.",
        "",
    ]


def llm_matrix(kind: Kind) -> list[str]:
    title = "LLM attention backends: MHA" if kind == "mha" else "LLM attention backends: MLA"
    common = ["backend", "implemented in sglx", "platforms", "requirements", "page size > 1 (native page sizes)",
              "FP8 KV", "FP4 KV", "spec topk=1", "spec topk>1"]
    extra = ["sliding window", "multimodal"] if kind == "mha" else ["chunked prefix cache"]
    rows = []
    for spec in all_backends("llm", kind):
        f = spec.features
        assert isinstance(f, LLMFeatures)
        row = [f"`{spec.name}`", yn(spec.implemented), platforms_text(spec), requirements_text(spec),
               page_sizes_cell(f), yn(f.fp8_kv), yn(f.fp4_kv), yn(f.spec_topk1), topk_gt1_cell(f.spec_topk_gt1)]
        row += [yn(f.sliding_window), yn(f.multimodal)] if kind == "mha" else [yn(f.chunked_prefix_cache)]
        rows.append([*row, yn(f.cuda_graph)])
    legend = ("Page size > 1: Y = the kernel pages the KV cache natively at any page size; a list = the only "
              "page sizes the kernel accepts; N = KV is gathered token by token (any `--page-size` works, "
              "but paging is not native).")
    return [f"## {title}", "", legend, "", *table([*common, *extra, "CUDA graphs"], rows), ""]


def diffusion_matrix() -> list[str]:
    kinds = list(DEVICE_KINDS)
    header = ["backend", "aliases", "implemented in sglx", *(SHORT_DEVICE_NAMES.get(k, k) for k in kinds),
              "requirements", "ring attention", "notes"]
    rows = []
    for spec in all_backends("diffusion"):
        f = spec.features
        notes = f.notes if isinstance(f, DiffusionFeatures) else ""
        ring = f.ring_attention if isinstance(f, DiffusionFeatures) and spec.implemented else "-"
        aliases = ", ".join(f"`{a}`" for a in spec.aliases) or "-"
        rows.append([f"`{spec.name}`", aliases, yn(spec.implemented), *(yn(k in spec.platforms) for k in kinds),
                     requirements_text(spec), ring, notes])
    return ["## Diffusion attention backends: platforms", "", *table(header, rows), ""]


def config_tables() -> list[str]:
    out = [
        "## Backend config parameters",
        "",
        "Passed with `--attention-backend-config` (a JSON/YAML file path, a JSON string, or `k=v,k=v` pairs) "
        "and validated against these declarations: an unknown key, a wrong type or a missing required key is "
        "an error naming the key.",
        "",
    ]
    for spec in all_backends():
        if not spec.config:
            continue
        rows = [[f"`{p.name}`", f"`{p.type}`", yn(p.required), default_text(p.default), p.description]
                for p in spec.config]
        out += [f"### `{spec.name}` ({spec.family})", "",
                *table(["parameter", "type", "required", "default", "description"], rows), ""]
    return out


# ---------------------------------------------------------------- auto selection


@dataclass(frozen=True)
class ExamplePlatform:
    """A machine the auto-selection rules are shown for; the snapshot is fake, so the text is reproducible."""

    label: str
    device_kind: str
    gpu: str | None = None
    capability: tuple[int, int] | None = None
    cuda: str | None = None

    def snapshot(self, with_packages: bool) -> PlatformSnapshot:
        packages = [p.module for p in KERNEL_PACKAGES] if with_packages else []
        return fake(self.device_kind, gpu=self.gpu, capability=self.capability, cuda=self.cuda, packages=packages)


EXAMPLE_PLATFORMS: tuple[ExamplePlatform, ...] = (
    ExamplePlatform("NVIDIA H100 (SM90), CUDA 12.4", "cuda", "NVIDIA H100 80GB HBM3", (9, 0), "12.4"),
    ExamplePlatform("NVIDIA H100 (SM90), CUDA 12.2", "cuda", "NVIDIA H100 80GB HBM3", (9, 0), "12.2"),
    ExamplePlatform("NVIDIA H200 (SM90), CUDA 13.0", "cuda", "NVIDIA H200", (9, 0), "13.0"),
    ExamplePlatform("NVIDIA B200 (SM100), CUDA 12.8", "cuda", "NVIDIA B200", (10, 0), "12.8"),
    ExamplePlatform("NVIDIA A100 (SM80), CUDA 12.4", "cuda", "NVIDIA A100-SXM4-80GB", (8, 0), "12.4"),
    ExamplePlatform("NVIDIA RTX 5090 (SM120), CUDA 12.8", "cuda", "NVIDIA GeForce RTX 5090", (12, 0), "12.8"),
    ExamplePlatform("AMD MI300X (ROCm)", "rocm", "AMD Instinct MI300X", (9, 4)),
    ExamplePlatform("Huawei Ascend NPU", "npu", "Ascend910B"),
    ExamplePlatform("Intel XPU", "xpu", "Intel Data Center GPU Max 1550"),
    ExamplePlatform("Apple MPS", "mps", "Apple M3 Max"),
    ExamplePlatform("CPU only", "cpu"),
)


def _status(reasons: Sequence[str]) -> str:
    return "Y" if not reasons else "N: " + "; ".join(reasons)


def _llm_rows(snap: PlatformSnapshot, kind: Kind) -> tuple[list[list[str]], str]:
    """Candidate rows for one LLM kind, and what auto picks, on a snapshot with every kernel package installed."""
    try:
        picked = f"`{select_llm(snap, ModelTraits(mla=kind == 'mla'), LLMBackendArgs()).label}`"
    except BackendUnavailableError:
        picked = "nothing (sglx cannot serve this model kind here yet)"
    rows = []
    for i, (name, rule) in enumerate(llm_auto_candidates(snap, kind), start=1):
        spec = next(s for s in all_backends("llm", kind) if s.name == name)
        reasons = [*_auto_rule_reasons(name, snap), *availability(spec, snap, AttentionRequest(kind=kind)).reasons]
        rows.append([kind.upper(), str(i), f"`{name}`", rule, _status(reasons)])
    if not rows:
        rows.append([kind.upper(), "-", "-", f"sglx has no {kind.upper()} auto rule for this platform", "-"])
    return rows, picked


def _diffusion_rows(snap: PlatformSnapshot) -> tuple[list[list[str]], str]:
    sel = select_diffusion(snap)
    rows = []
    for i, (name, rule) in enumerate(diffusion_auto_candidates(snap), start=1):
        spec = next(s for s in all_backends("diffusion") if s.name == name)
        reasons = availability(spec, snap).reasons
        rows.append(["diffusion", str(i), f"`{name}`", rule, _status(reasons)])
    return rows, f"`{sel.backend}`"


def auto_selection() -> list[str]:
    out = [
        "## Auto-selection",
        "",
        "Without `--attention-backend` (or `--prefill-attention-backend` / `--decode-attention-backend` for LLMs; "
        "`global_force_attn_backend(...)` for diffusion), sglx tries the candidates below in order and takes the "
        "first whose requirements hold on the machine and for the request; every candidate passed over is "
        "reported with its reason (`sglx doctor` shows them for your machine). An explicit choice is never "
        "rewritten: if it cannot run, sglx stops with the reasons and the backends that would run.",
        "",
        "The lists below are computed by `sglx.attention.selection` on fake snapshots of each machine with "
        "every kernel package installed; \"runs today\" is what sglx would do on that machine now, so a "
        "backend that is only declared shows N until sglx implements it.",
        "",
    ]
    for plat in EXAMPLE_PLATFORMS:
        snap = plat.snapshot(with_packages=True)
        mha, mha_pick = _llm_rows(snap, "mha")
        mla, mla_pick = _llm_rows(snap, "mla")
        dit, dit_pick = _diffusion_rows(snap)
        out += [f"### {plat.label}", "",
                *table(["model", "#", "candidate", "rule", "runs today"], [*mha, *mla, *dit]), "",
                f"Auto picks: MHA {mha_pick}; MLA {mla_pick}; diffusion {dit_pick}.", ""]
        record = record_for(snap)
        if record is not None:
            engine = any(engine_shape(e.shape) for e in record.entries)
            out += [f"This GPU class ({record.gpu_class}) has a measured record (`{record.origin}`): auto ranks "
                    "each LLM phase by its recorded medians" + (
                        " (the whole engine's, from `sglx bench one-batch`, before the kernels')" if engine else "")
                    + ", and the order above only places the backends never measured there, after the measured "
                    "ones (docs/benchmarks.md, \"Auto-selection by measurement\"; `sglx doctor` shows the numbers).",
                    ""]
    return out


def page_size_constraints() -> list[str]:
    out = [
        "## Page-size constraints",
        "",
        "Kernels that page the KV cache natively accept only these `--page-size` values. An explicit "
        "`--page-size` that a chosen backend rejects is an error naming the allowed sizes, never a silent "
        "rewrite; without `--page-size`, sglx uses a size every chosen backend accepts.",
        "",
    ]
    for spec in all_backends("llm"):
        assert isinstance(spec.features, LLMFeatures)
        rule = spec.features.page_sizes
        if rule is None:
            continue
        sizes = or_list(rule.sizes)
        where = f" on {describe_requirement(rule.on)} (any page size elsewhere)" if rule.on is not None else ""
        out.append(f"- `{spec.name}` ({spec.kind.upper()}): `--page-size {sizes}`{where}")
    return [*out, ""]


def backend_notes() -> list[str]:
    out = ["## Backend summaries", ""]
    for spec in all_backends():
        label = {"mha": "LLM MHA", "mla": "LLM MLA", "dit": "diffusion"}[spec.kind]
        line = f"- `{spec.name}` ({label}, {spec.title}): {spec.summary}"
        if spec.notes:
            line += f" {spec.notes}"
        out.append(line)
    return [*out, ""]


def render() -> str:
    """The whole of docs/backends.md."""
    lines = [*intro(), *llm_matrix("mha"), *llm_matrix("mla"), *diffusion_matrix(), *config_tables(),
             *auto_selection(), *page_size_constraints(), *backend_notes()]
    while lines and lines[-1] == "":
        lines.pop()
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- command


def default_path() -> Path:
    """docs/backends.md of the source checkout when running from one (editable install), else under cwd."""
    root = Path(__file__).resolve().parents[2]
    base = root if (root / "pyproject.toml").is_file() else Path.cwd()
    return base / DEFAULT_RELATIVE_PATH


def check(path: Path, expected: str) -> str | None:
    """None when `path` holds `expected`, else a message saying what differs and how to fix it."""
    if not path.is_file():
        return f"{path} does not exist: run {GENERATE_COMMAND}"
    actual = path.read_text(encoding="utf-8")
    if actual == expected:
        return None
    diff = list(difflib.unified_diff(actual.splitlines(), expected.splitlines(), "on disk", "generated",
                                     lineterm="", n=0))
    shown = "\n".join(diff[:40]) + ("\n..." if len(diff) > 40 else "")
    return f"{path} is stale (the registry changed): run {GENERATE_COMMAND}\n{shown}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=GENERATE_COMMAND, description="Generate docs/backends.md from the registry.")
    parser.add_argument("--check", action="store_true", help="exit 1 if the file on disk is stale; write nothing")
    parser.add_argument("--output", type=Path, default=None, help="file to write/check (default: docs/backends.md)")
    args = parser.parse_args(argv)
    path = args.output or default_path()
    text = render()
    if args.check:
        problem = check(path, text)
        if problem:
            print(problem, file=sys.stderr)
            return 1
        print(f"{path} is up to date")
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        print(f"{path} already up to date")
    else:
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
