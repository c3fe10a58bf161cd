"""Auto-selection by measurement on Hopper (issue 12 item 7, issue 14 item 5), on fake H100 and H200 snapshots.

The reference for "fastest" is the raw JSON under benchmarks/results: the packaged record must be exactly what
the builder makes of those files (so every number has a source), and on every recorded shape auto's pick must
be within 5% of the fastest recorded backend that can run, computed here straight from the record's entries.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import pytest

from sglx.attention.measured.__main__ import main as record_main
from sglx.attention.measured.build import build_record, measurements
from sglx.attention.measured.record import RECORDS_ENV, engine_shape, gpu_class
from sglx.attention.registry import availability, find
from sglx.attention.request import AttentionRequest
from sglx.attention.selection import LLMBackendArgs, LLMSelection, ModelTraits, select_llm
from sglx.doctor import build_report, render
from sglx.platform import PlatformSnapshot, fake

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
# (raw report, date for reports that carry none): what the packaged sm90-h100 record is built from
SOURCES = (("bench_attention_h100_final.json", None), ("bench_flashinfer_trtllm_decode_h100.json", None),
           ("bench_fa4_llm_h100_run1.json", "2026-11-23"), ("mla_decode_h100_session4_sweep.json", "2026-11-23"),
           ("bench_attention_prefill_h100_s6.json", None), ("bench_attention_decode_b1_h100_s6.json", None),
           ("mla_decode_b64_h100_s6.json", "2026-11-23 17:41:00"), ("bench_attention_decode_b64_h100_s7.json", None))
R27 = "s27/call8/", "s27/call9/"
# what the packaged sm90-h200 record is built from: session 27's prefill and batch-64 decode (call 8, eager, with
# the fp8 rows) and its decode as CUDA-graph replays (call 9: newest medians win, so they replace call 8's)
SOURCES_H200 = ((R27[0] + "attention_prefill_h200.json", None), (R27[0] + "attention_decode_b64_h200.json", None),
                (R27[1] + "attention_decode_b1_graph_h200.json", None),
                (R27[1] + "attention_decode_b64_graph_h200.json", None),
                # session 28: batch-1 decode at 512 keys (graphs), and the engine (`sglx bench one-batch`,
                # Llama-3.1-8B bs1 / bs64) with auto's kernel pick, triton, flashinfer and trtllm_mha
                ("s28/call3/attention_decode_b1_ctx512_graph_h200.json", None),
                *((f"s28/call{c}/one_batch_{model}_bs{bs}_{b}_r1.json", None)
                  for c, model, names in ((1, "llama-3.1-8b", ("auto", "triton")),
                                          (5, "llama-3.1-8b", ("auto", "flashinfer", "trtllm_mha")))
                  for bs in (1, 64) for b in names),
                # session 29 (after its GPU test passed, s29/call1/mla_tests.txt): DeepSeek-V2-Lite one-batch
                # (MLA, page 1) with flashinfer, triton and the flashinfer-prefill + triton-decode pair
                *((f"s29/call4/one_batch_deepseek-v2-lite_bs{bs}_{b}_r{r}.json", None)
                  for bs, reps in ((1, (1, 2)), (64, (1,))) for b in ("flashinfer", "triton", "flashinfer+triton")
                  for r in reps),
                # session 30 (after tests/gpu/test_mla_gpu.py -k "prefill_graphs or 576_latent" passed,
                # s30/call4/mla_tests.txt): batch 1 with triton MLA's prefill graphs, and the pair again
                *((f"s30/call4/one_batch_deepseek-v2-lite_bs1_{b}_r{r}.json", None)
                  for b in ("triton", "flashinfer+triton") for r in (1, 2)))
H100 = "NVIDIA H100 80GB HBM3"
H200 = "NVIDIA H200"
GPUS = {"sm90-h100": H100, "sm90-h200": H200}
LENT_H100_PACKAGES = ("flashinfer", "flash_attn.cute", "triton")  # what the lent H100 can carry (no fa3)
MHA = ModelTraits(head_dim=128, dtype="bfloat16")
MLA = ModelTraits(mla=True, head_dim=576, dtype="bfloat16")


@pytest.fixture(autouse=True)
def _packaged_records(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RECORDS_ENV, raising=False)


def h100(packages: tuple[str, ...] = LENT_H100_PACKAGES, gpu: str = H100) -> PlatformSnapshot:
    return fake("cuda", gpu=gpu, capability=(9, 0), cuda="13.0", packages=packages)


def packaged(cls: str = "sm90-h100") -> dict:
    return json.loads((resources.files("sglx.attention.measured") / f"{cls}.json").read_text())


def entries_for(kind: str, phase: str, shape: str, kv: str, page: int | None = None,
                cls: str = "sm90-h100") -> list[dict]:
    return [e for e in packaged(cls)["entries"] if (e["kind"], e["phase"], e["shape"], e["kv_cache_dtype"]) ==
            (kind, phase, shape, kv) and (page is None or e["page_size"] == page)]


def runs(snap: PlatformSnapshot, kind: str, name: str, page: int | None, kv: str) -> bool:
    spec = find(name, "llm", kind)  # type: ignore[arg-type]
    req = AttentionRequest(kind=kind, dtype="bfloat16", head_dim=576 if kind == "mla" else 128,  # type: ignore[arg-type]
                           page_size=page, kv_cache_dtype=kv)
    return spec is not None and availability(spec, snap, req).ok


def picked(sel: LLMSelection, phase: str) -> str:
    return sel.decode if phase == "decode" else sel.prefill


@pytest.mark.parametrize(("cls", "sources", "names"), [
    ("sm90-h100", SOURCES, {"triton", "torch_native", "flashinfer", "trtllm_mha", "fa4"}),
    ("sm90-h200", SOURCES_H200, {"triton", "flashinfer", "trtllm_mha"}),  # no FA4 carried in session 27
])
def test_record_is_exactly_the_raw_results(cls: str, sources: tuple, names: set[str]) -> None:
    """Every median in a packaged record comes from a raw result file (nothing typed in, nothing left out)."""
    reports = [(json.loads((RESULTS / name).read_text()), f"benchmarks/results/{name}", date) for name, date in sources]
    assert build_record(cls, reports) == packaged(cls)
    assert {e["backend"] for e in packaged(cls)["entries"]} == names  # sglx backends, no baselines
    assert all(e["source"] and e["date"] and e["device"] == GPUS[cls] for e in packaged(cls)["entries"])


def test_record_ships_with_the_package() -> None:
    """pyproject's package data takes every JSON under src/sglx, the records among them."""
    section = (ROOT / "pyproject.toml").read_text().split("[tool.setuptools.package-data]", 1)[1]
    assert '"**/*.json"' in section.split("\n[", 1)[0]
    for cls in GPUS:
        assert (ROOT / "src" / "sglx" / "attention" / "measured" / f"{cls}.json").is_file()


def _recorded_shapes() -> list[tuple[str, str, str, str, int, str]]:
    """The kernels' shapes (`sglx bench attention`); the engine's are tested by test_auto_is_the_engines_fastest."""
    return sorted({(cls, e["kind"], e["phase"], e["shape"], e["page_size"], e["kv_cache_dtype"])
                   for cls in GPUS for e in packaged(cls)["entries"] if not engine_shape(e["shape"])})


def accurate_fp8(kind: str, times: dict[str, float], kv: str) -> dict[str, float]:
    """With fp8 KV, auto ranks only the backends that read per-token scales and page natively (registry), where
    any runs: the per-layer-scale ones lose recall (85-88.5% against 98.5%), so 5% is measured among the rest."""
    if not kv.startswith("fp8"):
        return times
    keep = {n: ms for n, ms in times.items() if (spec := find(n, "llm", kind)) is not None
            and spec.features.fp8_per_token_scales and spec.features.native_paging}
    return keep or times


# (kind, phase, shape, page size, KV dtype) where auto's pick has no median at that page size -> (pick, the page
# size whose median stands in). Empty since session 7 recorded flashinfer's B64 decode at page 128 (0.3738 ms,
# 1.016x fa4's 0.3681 in the same run, bench_attention_decode_b64_h100_s7.json).
UNMEASURED_PICKS: dict[tuple, tuple[str, int]] = {}
# (gpu class, kind, phase, shape, page size, KV dtype) where no backend that runs at this page size is within 5% of
# the fastest on every shape of its phase, so auto's pick (the lowest worst ratio) misses 5% on one of them. On the
# H200 at page 16: flashinfer decodes B1 ctx 4096 in 0.0204 ms against trtllm_mha's 0.0186 (1.095x), but trtllm_mha
# decodes B64 in 0.2956 against triton's 0.2527 (1.17x) and triton B1 in 0.0220 (1.18x): flashinfer's worst
# (1.095x) is the smallest.
PAGE_OVER_5PCT: dict[tuple, float] = {}
# The same, where the record holds the engine's medians, which rank first (ranking.py): on the H200 (session 28) the
# engine ran triton fastest in both phases (batch-1 step 4.21-4.28 ms against flashinfer 4.48, trtllm_mha 4.56;
# 512-token prefill 12.2-12.3 against 27.7-28.8: only triton's short prefills replay CUDA graphs), so auto takes
# triton everywhere and misses 5% on these kernel shapes: the per-shape criterion and the engine disagree.
_H200 = ("sm90-h200", "mha")
ENGINE_OVER_5PCT = {
    (*_H200, "decode", "B1 H32/8 D128 ctx 32768", 64, "auto"): 1.08,  # trtllm_mha 0.0509 ms, triton 0.0546
    (*_H200, "decode", "B1 H32/8 D128 ctx 4096", 1, "auto"): 1.08,  # flashinfer 0.0204, triton 0.0219
    (*_H200, "decode", "B1 H32/8 D128 ctx 4096", 16, "auto"): 1.19,  # trtllm_mha 0.0186, triton 0.0220
    (*_H200, "decode", "B1 H32/8 D128 ctx 4096", 64, "auto"): 1.22,  # trtllm_mha 0.0181, triton 0.0220
    (*_H200, "decode", "B1 H32/8 D128 ctx 4096", 128, "auto"): 1.09,  # flashinfer 0.0202, triton 0.0220
    **{(*_H200, "prefill", shape, page, "auto"): bound for shape, bounds in (
        ("B4 H32/32 D128 0+4096 causal", ((16, 1.26), (64, 1.27), (128, 1.23))),  # FlashInfer's FA3 template
        ("B4 H32/32 D128 4096+512 causal", ((16, 1.24), (64, 1.25), (128, 1.21)))) for page, bound in bounds},
}


@pytest.mark.parametrize(("cls", "kind", "phase", "shape", "page", "kv"), _recorded_shapes())
def test_auto_within_5pct_of_the_fastest_recorded_on_each_shape(cls, kind, phase, shape, page, kv) -> None:  # type: ignore[no-untyped-def]
    """Asked at a recorded shape's page size and KV dtype, auto lands on a backend measured there, within 5% of
    the fastest recorded backend that can run here (or, for the one listed gap, its median at another page size
    is within 5%; or, where PAGE_OVER_5PCT says why, within its bound)."""
    snap = h100(gpu=GPUS[cls])
    sel = select_llm(snap, MLA if kind == "mla" else MHA, LLMBackendArgs(page_size=page, kv_cache_dtype=kv))
    times = {e["backend"]: e["median_ms"] for e in sorted(entries_for(kind, phase, shape, kv, page, cls),
                                                          key=lambda e: e["date"])}  # newest run of a backend wins
    runnable = accurate_fp8(kind, {name: ms for name, ms in times.items() if runs(snap, kind, name, page, kv)}, kv)
    pick = picked(sel, phase)
    gap = UNMEASURED_PICKS.get((kind, phase, shape, page, kv)) if cls == "sm90-h100" else None
    if gap is None:
        assert pick in runnable, (pick, runnable)
        key = (cls, kind, phase, shape, page, kv)
        bound = PAGE_OVER_5PCT.get(key, ENGINE_OVER_5PCT.get(key, 1.05))
        assert runnable[pick] <= bound * min(runnable.values()), (pick, runnable)
        assert bound == 1.05 or runnable[pick] > 1.05 * min(runnable.values()), "a stale *OVER_5PCT entry"
    else:
        assert pick == gap[0] and pick not in runnable, (pick, runnable)
        stand_in = entries_for(kind, phase, shape, kv, gap[1])
        assert min(e["median_ms"] for e in stand_in if e["backend"] == pick) <= 1.05 * min(runnable.values())
    assert sel.source == "auto" and sel.page_size == page and sel.measured


# (gpu class, kv cache dtype) -> (prefill, decode, page size) with no page size given, on the lent GPUs' packages
DEFAULT_PICKS = {("sm90-h100", "auto"): ("fa4", "flashinfer", 128), ("sm90-h100", "fp8_e4m3"): ("triton", "triton", 1),
                 ("sm90-h200", "auto"): ("triton", "triton", 1),  # the engine's fastest (ENGINE_OVER_5PCT)
                 ("sm90-h200", "fp8_e4m3"): ("triton", "triton", 1)}
# (gpu class, kv, phase, shape) -> how far (x the fastest at any page size) the default pair may be, and why: one
# page size serves both phases, and no pair is within 5% everywhere. H100: trtllm_mha decodes B1 ctx 4096 fastest
# (0.0193 ms; flashinfer 0.0213) but needs a page size of at most 64, where prefill with a 4k prefix is 1.21x fa4's
# at 128. H200: the engine's fastest (triton at page 1, ENGINE_OVER_5PCT) against the kernels' fastest anywhere.
OVER_5PCT = {("sm90-h100", "auto", "decode", "B1 H32/8 D128 ctx 4096"): 1.11,
             ("sm90-h200", "auto", "decode", "B1 H32/8 D128 ctx 4096"): 1.22,  # trtllm_mha 0.0181 ms at page 64
             ("sm90-h200", "auto", "decode", "B1 H32/8 D128 ctx 32768"): 1.07,  # trtllm_mha 0.0509
             ("sm90-h200", "auto", "prefill", "B4 H32/32 D128 0+4096 causal"): 1.26,  # trtllm_mha 0.9542
             ("sm90-h200", "auto", "prefill", "B4 H32/32 D128 4096+512 causal"): 1.25}  # trtllm_mha 0.2909


@pytest.mark.parametrize(("cls", "kv"), list(DEFAULT_PICKS))
def test_auto_without_a_page_size(cls: str, kv: str) -> None:
    """auto also picks the page size; on each recorded shape its pick is within 5% of the fastest recorded (at any
    page size), except where OVER_5PCT says why not."""
    snap = h100(gpu=GPUS[cls])
    sel = select_llm(snap, MHA, LLMBackendArgs(kv_cache_dtype=kv))
    assert (sel.prefill, sel.decode, sel.page_size) == DEFAULT_PICKS[(cls, kv)]
    gaps = set()
    for phase in ("decode", "prefill"):
        shapes = {e["shape"] for e in packaged(cls)["entries"] if e["kind"] == "mha" and e["phase"] == phase}
        for shape in shapes:
            rows = entries_for("mha", phase, shape, kv, cls=cls) or entries_for("mha", phase, shape, "auto", cls=cls)
            best: dict[str, float] = {}
            for e in rows:
                if runs(snap, "mha", e["backend"], None, kv):
                    best[e["backend"]] = min(best.get(e["backend"], e["median_ms"]), e["median_ms"])
            best = accurate_fp8("mha", best, kv)
            pick = picked(sel, phase)
            if pick not in best:
                gaps.add((phase, shape, pick))
            else:
                bound = OVER_5PCT.get((cls, kv, phase, shape), 1.05)
                assert best[pick] <= bound * min(best.values()), (phase, shape, best)
                assert bound == 1.05 or best[pick] > 1.05 * min(best.values()), "a stale OVER_5PCT entry"
    assert gaps == set()


@pytest.mark.parametrize(("kind", "page"), [*(("mha", p) for p in (None, 1, 16, 64, 128)), ("mla", None),
                                           ("mla", 1)])
@pytest.mark.parametrize("packages", [LENT_H100_PACKAGES, ("flashinfer", "triton"), ("flashinfer",)])
def test_auto_is_the_engines_fastest(kind: str, page: int | None, packages: tuple[str, ...]) -> None:
    """Where the record holds the engine's medians (sm90-h200: Llama-3.1-8B, and DeepSeek-V2-Lite for MLA at page 1,
    the page MLA's flashinfer takes), auto's pick is within 5% of the engine's fastest runnable backend on every
    engine shape it was measured on (at any page size: the engine's gaps are graphs and host work, not the page),
    and a backend the engine ran comes before one it did not."""
    snap = h100(packages, gpu=H200)
    sel = select_llm(snap, MLA if kind == "mla" else MHA, LLMBackendArgs(page_size=page))
    for phase in ("decode", "prefill"):
        rows = [e for e in packaged("sm90-h200")["entries"] if e["phase"] == phase and engine_shape(e["shape"])
                and e["kind"] == kind and runs(snap, kind, e["backend"], page, "auto")]
        assert rows, phase
        pick = picked(sel, phase)
        for shape in {e["shape"] for e in rows}:
            best: dict[str, float] = {}
            for e in sorted((e for e in rows if e["shape"] == shape), key=lambda e: e["date"]):
                best[e["backend"]] = e["median_ms"]  # newest run of a backend wins
            assert pick in best, (phase, shape, pick, best)
            assert best[pick] <= 1.05 * min(best.values()), (phase, shape, pick, best)
    if "triton" in packages and kind == "mha":
        assert (sel.prefill, sel.decode) == ("triton", "triton")
        assert "in the engine worst 1.000x" in sel.why
    if "triton" in packages and kind == "mla":  # triton MLA's 512-token prefill replays a graph: 16 ms against 45
        assert (sel.prefill, sel.decode, sel.page_size) == ("triton", "triton", 1)


def test_one_batch_reports_become_engine_shapes() -> None:
    """`sglx bench one-batch --json` reports: each batch size gives a decode-step median (the decode backend's) and a
    prefill median (the prefill backend's), labelled as engine shapes, with the report's page size and KV dtype."""
    source = "benchmarks/results/s28/call1/one_batch_llama-3.1-8b_bs1_auto_r1.json"
    found = measurements(json.loads((ROOT / source).read_text()), source)
    assert [(m.phase, m.shape, m.backend, m.page_size) for m in found] == [
        ("decode", "engine llama-3.1-8b B1 512+32 step", "trtllm_mha", 64),
        ("prefill", "engine llama-3.1-8b B1 512-token prefill", "flashinfer", 64)]
    assert found[0].median_ms == pytest.approx(4.590726999992967) and found[1].median_ms == pytest.approx(27.662306,
                                                                                                          rel=1e-6)
    assert "prefill CUDA graphs off" in found[1].note and "CUDA graphs on" in found[0].note


def test_mla_on_hopper_takes_flashinfer_measured_fastest() -> None:
    sel = select_llm(h100(), MLA, LLMBackendArgs())
    assert (sel.prefill, sel.decode, sel.page_size) == ("flashinfer", "flashinfer", 1)
    decode = next(r for r in sel.measured if r.phase == "decode")
    assert [r.backend for r in decode.ranked] == ["flashinfer", "triton"]
    assert decode.ranked[1].worst_ratio == pytest.approx(2.1292187247455407)  # session 6's default launch
    prefill = next(r for r in sel.measured if r.phase == "prefill")
    assert not prefill.ranked and "SGLang's order" in prefill.basis  # no MLA prefill was measured
    no_fi = select_llm(h100(("flash_attn.cute", "triton")), MLA, LLMBackendArgs())
    assert (no_fi.prefill, no_fi.decode) == ("triton", "triton")


@pytest.mark.parametrize(("packages", "args", "expected"), [
    pytest.param(("flashinfer", "triton"), LLMBackendArgs(), ("flashinfer", "trtllm_mha", 64), id="no-fa4"),
    pytest.param(("flash_attn.cute", "triton"), LLMBackendArgs(kv_cache_dtype="fp8_e4m3"), ("triton", "triton", 1),
                 id="fp8-no-flashinfer"),
    pytest.param(("triton",), LLMBackendArgs(), ("triton", "triton", 1), id="triton-only"),
    pytest.param(("flashinfer", "triton"), LLMBackendArgs(page_size=64), ("flashinfer", "trtllm_mha", 64),
                 id="page64"),
])
def test_when_the_fastest_is_missing_the_next_measured_wins(packages, args, expected) -> None:  # type: ignore[no-untyped-def]
    """Without fa4 (the flashinfer wheel brings trtllm_mha), decode goes to trtllm_mha (worst 1.028x: fastest at
    B1, 1.028x flashinfer at B64) and prefill to flashinfer (a 2% tie with trtllm_mha: SGLang's order); with
    flashinfer missing too, triton, measured, before anything unmeasured."""
    sel = select_llm(h100(packages), MHA, args)
    assert (sel.prefill, sel.decode, sel.page_size) == expected
    assert sel.source == "auto" and "measured on sm90-h100" in sel.why


@pytest.mark.parametrize(("args", "expected"), [
    pytest.param(LLMBackendArgs(attention_backend="triton"), ("triton", "triton", 1, "explicit"), id="both"),
    pytest.param(LLMBackendArgs(attention_backend="flashinfer", page_size=16), ("flashinfer", "flashinfer", 16,
                                                                                "explicit"), id="flashinfer"),
    pytest.param(LLMBackendArgs(decode_attention_backend="trtllm_mha"), ("flashinfer", "trtllm_mha", 64, "mixed"),
                 id="decode-fixed-prefill-avoids-fa4-page-128"),
    pytest.param(LLMBackendArgs(prefill_attention_backend="triton"), ("triton", "trtllm_mha", 64, "mixed"),
                 id="prefill-fixed"),
])
def test_explicit_flags_win(args: LLMBackendArgs, expected: tuple) -> None:
    sel = select_llm(h100(), MHA, args)
    assert (sel.prefill, sel.decode, sel.page_size, sel.source) == expected
    if expected[3] == "explicit":
        assert not sel.measured
    else:
        assert [r.phase for r in sel.measured] == ["prefill" if args.decode_attention_backend else "decode"]


def test_without_a_record_sglang_order_and_it_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    h800 = select_llm(h100(gpu="NVIDIA H800"), MHA, LLMBackendArgs())
    assert (h800.prefill, h800.decode, h800.measured) == ("flashinfer", "flashinfer", ())  # fa3 not installed
    assert "no measured record for sm90-h800, so SGLang's order" in h800.why
    monkeypatch.setenv(RECORDS_ENV, "off")
    off = select_llm(h100(), MHA, LLMBackendArgs())
    assert (off.prefill, off.decode, off.measured) == ("flashinfer", "flashinfer", ())
    assert "no measured record for sm90-h100" in off.why


def test_a_user_records_their_own_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`python -m sglx.attention.measured` turns a bench report into a record SGLX_ATTENTION_RECORDS points at."""
    report = json.loads((RESULTS / "bench_attention_h100_final.json").read_text())
    report["environment"]["device_name"] = "NVIDIA H200"  # a made-up H200 report: triton's rows only
    for case in report["cases"]:
        case["rows"] = [r for r in case["rows"] if r["backend"] != "torch_native"]
    src = tmp_path / "h200.json"
    src.write_text(json.dumps(report))
    assert record_main([str(src), "--gpu-class", "sm90-h200", "--output", str(tmp_path / "sm90-h200.json")]) == 0
    assert record_main([str(src), "--gpu-class", "sm90-h100", "--output", str(tmp_path / "x.json")]) == 2
    nested = tmp_path / "new" / "dir" / "sm90-h200.json"  # a missing folder is made, not a traceback
    assert record_main([str(src), "--gpu-class", "sm90-h200", "--output", str(nested)]) == 0 and nested.is_file()
    (tmp_path / "a_file").write_text("")
    assert record_main([str(src), "--gpu-class", "sm90-h200", "--output", str(tmp_path / "a_file" / "x.json")]) == 2
    monkeypatch.setenv(RECORDS_ENV, str(tmp_path))
    sel = select_llm(h100(gpu="NVIDIA H200"), MHA, LLMBackendArgs())
    assert (sel.prefill, sel.decode) == ("triton", "triton")  # measured beats SGLang's flashinfer, unmeasured
    assert str(tmp_path / "sm90-h200.json") in sel.why


@pytest.mark.parametrize(("gpu", "cc", "expected"), [
    ("NVIDIA H100 80GB HBM3", (9, 0), "sm90-h100"), ("NVIDIA H100 PCIe", (9, 0), "sm90-h100"),
    ("NVIDIA H200", (9, 0), "sm90-h200"), ("NVIDIA A100-SXM4-80GB", (8, 0), "sm80-a100"),
])
def test_gpu_class(gpu: str, cc: tuple[int, int], expected: str) -> None:
    assert gpu_class(fake("cuda", gpu=gpu, capability=cc, cuda="12.4")) == expected
    assert gpu_class(fake("cpu")) is None


def test_doctor_explains_the_pick() -> None:
    from rich.console import Console

    report = build_report(h100(), "llm")
    assert report["machine"]["gpu_class"] == "sm90-h100"
    mha = next(s for s in report["sections"] if s["kind"] == "mha")["auto"]
    assert mha["backend"] == "hybrid (prefill=fa4, decode=flashinfer)" and "measured on sm90-h100" in mha["why"]
    decode = next(m for m in mha["measured"] if m["phase"] == "decode")
    # prefill picks first (fa4 needs page 128, which rules trtllm_mha out of decode); fa4 decodes B1 4.6-5x slower
    assert [r["backend"] for r in decode["ranked"]] == ["flashinfer", "triton", "fa4", "torch_native"]
    assert decode["ranked"][0]["shapes"][0]["source"] == "benchmarks/results/bench_attention_decode_b1_h100_s6.json"
    assert "prefill chosen first" in mha["why"]
    json.dumps(report)
    console = Console(width=400, record=True)
    render(report, console)
    text = console.export_text()
    assert "fa4: worst 1.004x of the fastest; B4 H32/32 D128 0+4096 causal page 128: 0.9603 ms" in text
    assert "flashinfer: worst 1.011x" in text and "bench_attention_decode_b64_h100_s7.json" in text
    assert "fa4: worst 5.043x of the fastest" in text
    assert "triton: worst 2.129x of the fastest; B64 H128 latent 512+64 ctx 4096 page 1: 0.3301 ms" in text


def test_fp8_auto_keeps_accuracy_and_says_what_it_costs() -> None:
    """trtllm_mha's fp8 decode is the fastest recorded (0.213 ms vs triton 0.230 at page 64) but reads one scale
    per layer; auto takes triton (per-token scales) and says why; naming trtllm_mha still gets it."""
    sel = select_llm(h100(), MHA, LLMBackendArgs(kv_cache_dtype="fp8_e4m3", page_size=64))
    assert (sel.prefill, sel.decode) == ("triton", "triton")
    assert "per-token scales first" in sel.why or any("per-token scales first" in r.basis for r in sel.measured)
    named = select_llm(h100(), MHA, LLMBackendArgs(kv_cache_dtype="fp8_e4m3", page_size=64,
                                                   decode_attention_backend="trtllm_mha"))
    assert named.decode == "trtllm_mha"
