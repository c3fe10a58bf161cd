"""`sglx bench attention`: sglx's LLM attention backends x phase x shapes, checked, then timed against baselines.

For each case (phase, batch, heads, head dim, context or prefix+new, page size, dtype, KV dtype) the
inputs sit on a scattered paged pool (attention_inputs.py). Every backend's output is first compared
with a float64 reference; only a correct result is timed (median of many runs, caches flushed, see
timing.py). Baselines run in the same process on the same numbers: SDPA on contiguous KV (cuDNN on
CUDA) and, when `flashinfer` imports, FlashInfer's paged wrappers. Ratios are time / baseline time
(below 1 = faster than the baseline). Prefill reports TFLOP/s (causal FLOPs), decode the GB/s of
K/V read.

`cuda_graph` (`--cuda-graph`, CUDA only): decode calls are captured in a CUDA graph and timed as its replays, the
way the engine runs decode steps: sglx backends through their own graph hooks (capture, then the per-step replay
hook, whose time is the row's `metadata_ms`), the baselines as called. Why: eagerly, a call that launches in less
time than its host side takes is timed as host time (at batch 1 triton's Python launch path took 0.04-0.08 ms
against a 7.5-12 us kernel, H200, session 27), and auto-selection ranks by these medians.

Defaults depend on the device: on a GPU the issue's suite (decode B=64, 32/8 heads, head dim 128,
context 4096, pages 1 and 16, bf16 and fp8 KV; prefill B=4, 32 heads, 4096 new tokens, and 512 new
on a 4096 prefix), on a CPU tiny shapes in float32 so a CI run takes seconds.
"""

from __future__ import annotations

import platform as py_platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from sglx.attention.llm.base import BackendContext, LayerSpec
from sglx.attention.registry import all_backends, availability, find
from sglx.attention.request import AttentionRequest
from sglx.bench.attention_baselines import PreparedRun, flashinfer_module, flashinfer_paged, sdpa_contiguous
from sglx.bench.attention_inputs import DTYPES, TOLERANCE, AttentionCase, CaseInputs, make_inputs, max_abs_error
from sglx.bench.timing import Timing, TimingBudget, cuda_graphed, median_ms
from sglx.errors import SglxError
from sglx.llm.forward_batch import ForwardBatch, ForwardMode
from sglx.llm.kv_cache import KV_CACHE_DTYPE_CHOICES

PHASES = ("decode", "prefill")


@dataclass(frozen=True)
class PhaseDefaults:
    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int
    shapes: tuple[tuple[int, int], ...]  # (prefix, new); decode: (context - 1, 1)
    page_sizes: tuple[int, ...]
    kv_cache_dtypes: tuple[str, ...]
    dtype: str


DEFAULTS = {
    ("cuda", "decode"): PhaseDefaults(64, 32, 8, 128, ((4095, 1),), (1, 16), ("auto", "fp8_e4m3"), "bfloat16"),
    ("cuda", "prefill"): PhaseDefaults(4, 32, 32, 128, ((0, 4096), (4096, 512)), (16,), ("auto",), "bfloat16"),
    ("cpu", "decode"): PhaseDefaults(2, 4, 2, 64, ((63, 1),), (1, 16), ("auto",), "float32"),
    ("cpu", "prefill"): PhaseDefaults(2, 4, 4, 64, ((0, 32), (32, 8)), (16,), ("auto",), "float32"),
}


@dataclass(frozen=True)
class AttentionBenchConfig:
    """What to run; None / empty fields take the device's defaults for each phase (DEFAULTS)."""

    backends: tuple[str, ...] = ()  # empty: every implemented LLM backend usable here
    phases: tuple[str, ...] = PHASES
    batch_size: int | None = None
    num_q_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    context_lens: tuple[int, ...] = ()  # decode: keys per request, the new token included
    prefill_shapes: tuple[tuple[int, int], ...] = ()  # (cached prefix, new tokens)
    page_sizes: tuple[int, ...] = ()
    dtype: str | None = None
    kv_cache_dtypes: tuple[str, ...] = ()
    device: str = "auto"
    baselines: bool = True
    warmup_ms: float | None = None
    rep_ms: float | None = None
    seed: int = 0
    cuda_graph: bool = False  # decode calls timed as CUDA graph replays (see the module docstring)

    def __post_init__(self) -> None:
        problems = []
        for phase in self.phases:
            if phase not in PHASES:
                problems.append(f"--phase {phase}: choose decode or prefill")
        for flag, value in (("--batch-size", self.batch_size), ("--num-q-heads", self.num_q_heads),
                            ("--num-kv-heads", self.num_kv_heads), ("--head-dim", self.head_dim)):
            if value is not None and value < 1:
                problems.append(f"{flag} {value}: must be >= 1")
        for c in self.context_lens:
            if c < 1:
                problems.append(f"--context-len {c}: must be >= 1")
        for prefix, new in self.prefill_shapes:
            if prefix < 0 or new < 1:
                problems.append(f"--prefill-shape {prefix}:{new}: needs PREFIX >= 0 and NEW >= 1")
        for p in self.page_sizes:
            if p < 1:
                problems.append(f"--page-size {p}: must be >= 1")
        if self.dtype is not None and self.dtype not in DTYPES:
            problems.append(f"--dtype {self.dtype}: choose one of {', '.join(DTYPES)}")
        for kv in self.kv_cache_dtypes:
            if kv not in KV_CACHE_DTYPE_CHOICES:
                problems.append(f"--kv-cache-dtype {kv}: choose one of {', '.join(KV_CACHE_DTYPE_CHOICES)}")
        q, kv = self.num_q_heads, self.num_kv_heads
        if q is not None and kv is not None and q % kv:
            problems.append(f"--num-q-heads {q} is not a multiple of --num-kv-heads {kv}")
        if problems:
            raise SglxError("invalid benchmark options:\n" + "\n".join(f"  - {p}" for p in problems))

    def cases(self, device: torch.device) -> list[AttentionCase]:
        kind = "cuda" if device.type == "cuda" else "cpu"
        out = []
        for phase in self.phases:
            d = DEFAULTS[(kind, phase)]
            q_heads = self.num_q_heads or d.q_heads
            kv_heads = self.num_kv_heads or (min(d.kv_heads, q_heads) if q_heads % min(d.kv_heads, q_heads) == 0
                                             else q_heads)
            if phase == "decode":
                shapes = tuple((c - 1, 1) for c in self.context_lens) or d.shapes
            else:
                shapes = self.prefill_shapes or d.shapes
            for prefix, new in shapes:
                for page in self.page_sizes or d.page_sizes:
                    for kv in self.kv_cache_dtypes or d.kv_cache_dtypes:
                        out.append(AttentionCase(phase, self.batch_size or d.batch, q_heads, kv_heads,
                                                 self.head_dim or d.head_dim, prefix + new, new, page,
                                                 self.dtype or d.dtype, kv))
        return out

    def budget(self, device: torch.device) -> TimingBudget:
        cpu = device.type != "cuda"
        return TimingBudget(warmup_ms=self.warmup_ms if self.warmup_ms is not None else (5.0 if cpu else 25.0),
                            rep_ms=self.rep_ms if self.rep_ms is not None else (20.0 if cpu else 100.0),
                            min_runs=3 if cpu else 10, max_runs=50 if cpu else 1000)


def _request(case: AttentionCase) -> AttentionRequest:
    return AttentionRequest(family="llm", kind="mha", dtype=case.dtype, head_dim=case.head_dim,
                            page_size=case.page_size, kv_cache_dtype=case.kv_cache_dtype)


def resolve_backends(names: tuple[str, ...], snap: Any) -> list[str]:
    """Explicit names, checked to exist and be implemented; empty: every implemented LLM MHA backend usable here.

    An explicit backend that cannot run a case gets a "skipped" row saying why; a default one is
    left out silently when it cannot run on this machine at all.
    """
    if not names:
        return [s.name for s in all_backends("llm", "mha")
                if s.implemented and availability(s, snap, AttentionRequest(family="llm", kind="mha")).ok]
    out = []
    for name in names:
        spec = find(name, "llm", "mha")
        if spec is None:
            known = ", ".join(s.name for s in all_backends("llm", "mha"))
            raise SglxError(f"--backend {name}: no such LLM attention backend (known: {known})")
        if not spec.implemented:
            implemented = ", ".join(s.name for s in all_backends("llm", "mha") if s.implemented)
            raise SglxError(f"--backend {name}: declared but not implemented in sglx yet; benchmark one of "
                            f"{implemented}")
        out.append(spec.name)
    return out


def _prepare_backend(name: str, case: AttentionCase, inputs: CaseInputs, device: torch.device,
                     graph: bool = False) -> tuple[PreparedRun, Callable[[], object]]:
    spec = find(name, "llm", "mha")
    assert spec is not None
    dtype = DTYPES[case.dtype]
    ctx = BackendContext(device, dtype, case.q_heads, case.kv_heads, case.head_dim, case.page_size,
                         inputs.req_to_token_pool, inputs.token_kv_pool)
    backend = spec.load()(ctx)
    b, n = case.batch, case.new
    seq_lens = [case.kv_len] * b
    decode = case.phase == "decode"
    batch = ForwardBatch(
        mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
        input_ids=torch.zeros(b * n, dtype=torch.long, device=device),
        positions=(torch.arange(n, device=device) + case.prefix).repeat(b),
        req_pool_indices=torch.arange(1, b + 1, device=device), seq_lens=torch.tensor(seq_lens, device=device),
        out_cache_loc=inputs.slots[:, case.prefix:].reshape(-1), req_to_token_pool=inputs.req_to_token_pool,
        token_kv_pool=inputs.token_kv_pool, seq_lens_cpu=seq_lens,
        extend_seq_lens_cpu=[] if decode else [n] * b, extend_prefix_lens_cpu=[] if decode else [case.prefix] * b)
    batch.attn_backend = backend
    layer = LayerSpec(0, case.q_heads, case.kv_heads, case.head_dim, case.scale)

    def call() -> torch.Tensor:  # K/V of the step are already in the pool: time attention alone
        return backend.forward(inputs.q, inputs.k_new, inputs.v_new, layer, batch, save_kv_cache=False)

    if graph:
        return _graphed_backend(backend, batch, call, name, case)

    def metadata() -> None:
        backend.init_forward_metadata(batch)

    metadata()
    return PreparedRun(name, "sglx", call, case.kv_cache_dtype, keep=[backend, batch]), metadata


def _graphed_backend(backend: Any, batch: ForwardBatch, call: Callable[[], torch.Tensor], name: str,
                     case: AttentionCase) -> tuple[PreparedRun, Callable[[], object]]:
    """A decode call captured as the engine's CUDA graph runner captures a step: the backend's graph state and
    capture hook on the batch's (static) request rows and lengths, then the replay hook. The step's metadata work
    (the replay hook, and the device work the engine captures ahead of the layers) runs outside the captured call,
    as eager metadata does: in a step it is paid once for all layers. Returned as the metadata step."""
    if not backend.supports_cuda_graph:
        raise SglxError(f"{name} does not run in CUDA graphs")
    b = case.batch
    backend.init_cuda_graph_state(b, b)
    backend.init_forward_metadata_capture_cuda_graph(b, batch.req_pool_indices, batch.seq_lens)

    def metadata() -> None:
        backend.init_forward_metadata_replay_cuda_graph(b, batch.req_pool_indices, batch.seq_lens,
                                                        list(batch.seq_lens_cpu))
        backend.init_forward_metadata_in_graph(b)

    metadata()
    replay = cuda_graphed(call)
    metadata()  # after the capture, as each engine step does before its replay
    return PreparedRun(name, "sglx", replay, case.kv_cache_dtype, detail="CUDA graph replay",
                       keep=[backend, batch]), metadata


def _graphed_baseline(run: PreparedRun) -> PreparedRun:
    """A baseline's call captured (within its context) and timed as graph replays."""
    with run.context():
        replay = cuda_graphed(run.fn)
    detail = f"{run.detail}; CUDA graph replay" if run.detail else "CUDA graph replay"
    return replace(run, fn=replay, detail=detail)


def _measure(run: PreparedRun, case: AttentionCase, inputs: CaseInputs, device: torch.device,
             budget: TimingBudget) -> dict[str, Any]:
    """Check against the float64 reference, then time (a wrong result is reported, not timed)."""
    row: dict[str, Any] = {"backend": run.name, "kind": run.key, "kv_cache_dtype_read": run.kv_cache_dtype}
    if run.detail:
        row["detail"] = run.detail
    tol = TOLERANCE[case.dtype]
    try:
        with run.context():
            out = run.fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            err = max_abs_error(run.as_rows(out), inputs.reference)
            row.update(max_abs_err=err, tolerance=tol, ok=err <= tol)
            if not row["ok"]:
                row["error"] = f"max |out - float64 reference| = {err:.3g} > {tol:g}: wrong result, not timed"
                return row
            timing: Timing = median_ms(run.fn, device, budget)
    except Exception as exc:  # a backend or baseline that cannot run this case is a result, not a crash
        row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:300])
        return row
    row.update(median_ms=timing.median_ms, min_ms=timing.min_ms, max_ms=timing.max_ms, runs=timing.runs)
    if case.phase == "prefill":
        row["tflops"] = case.flops() / (timing.median_ms * 1e-3) / 1e12
    else:
        kv = "auto" if run.kv_cache_dtype == "auto" else case.kv_cache_dtype
        row["gb_per_s"] = case.kv_bytes(kv) / (timing.median_ms * 1e-3) / 1e9
    return row


def run_case(case: AttentionCase, backends: list[str], device: torch.device, config: AttentionBenchConfig,
             flashinfer: object | None, snap: Any) -> dict[str, Any]:
    budget = config.budget(device)
    inputs = make_inputs(case, device, config.seed)
    graph = config.cuda_graph and case.phase == "decode"
    rows: list[dict[str, Any]] = []
    if config.baselines:
        baselines: list[tuple[str, Callable[..., PreparedRun], tuple]] = [("sdpa", sdpa_contiguous, ())]
        if flashinfer is not None:
            baselines.append(("flashinfer", flashinfer_paged, (flashinfer,)))
        for key, make, extra in baselines:
            try:
                run = make(case, inputs, *extra)
                if graph:
                    run = _graphed_baseline(run)
            except Exception as exc:  # plan() refused (dtype, head dim, page size), or no capture: record why
                rows.append({"backend": key, "kind": key, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]})
            else:
                rows.append(_measure(run, case, inputs, device, budget))
    base = {r["kind"]: r["median_ms"] for r in rows if r.get("median_ms")}
    for name in backends:
        spec = find(name, "llm", "mha")
        assert spec is not None
        avail = availability(spec, snap, _request(case))
        if not avail.ok:
            rows.append({"backend": name, "kind": "sglx", "skipped": "; ".join(avail.reasons)})
            continue
        try:
            run, metadata = _prepare_backend(name, case, inputs, device, graph)
        except Exception as exc:
            rows.append({"backend": name, "kind": "sglx", "ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        row = _measure(run, case, inputs, device, budget)
        if row.get("median_ms"):
            row["metadata_ms"] = median_ms(metadata, device, budget).median_ms
            row["time_ratio"] = {k: row["median_ms"] / v for k, v in base.items()}
        rows.append(row)
        del run, metadata
    del inputs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"case": case.to_dict(), "label": case.label(), "rows": rows}


def _environment(device: torch.device, fi_version: str | None) -> dict[str, Any]:
    env: dict[str, Any] = {"device": device.type, "torch": torch.__version__, "python": py_platform.python_version(),
                           "flashinfer": fi_version, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(device_name=props.name, sms=props.multi_processor_count, cuda=torch.version.cuda,
                   cudnn=torch.backends.cudnn.version())
    else:
        env["device_name"] = py_platform.processor() or py_platform.machine()
    return env


def summarize(cases: list[dict[str, Any]]) -> dict[str, float]:
    """fp8 over bf16 decode time of each backend and page size (the issue's fp8 target), when both ran."""
    times: dict[tuple[str, int, int, str], float] = {}
    for c in cases:
        if c["case"]["phase"] != "decode":
            continue
        for r in c["rows"]:
            if r.get("kind") == "sglx" and r.get("median_ms"):
                key = (r["backend"], c["case"]["page_size"], c["case"]["context"], c["case"]["kv_cache_dtype"])
                times[key] = r["median_ms"]
    out = {}
    for (backend, page, ctx, kv), ms in times.items():
        native = times.get((backend, page, ctx, "auto"))
        if kv != "auto" and native:
            out[f"{backend} decode ctx {ctx} page {page}: {kv} / native KV time"] = ms / native
    return out


def run_attention_bench(config: AttentionBenchConfig,
                        progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    from sglx.llm.model_runner import resolve_device, snapshot_for

    device = resolve_device(config.device)
    if config.cuda_graph and device.type != "cuda":
        raise SglxError(f"--cuda-graph times decode as CUDA graph replays and needs a CUDA device; this run is on "
                        f"{device.type} (leave --cuda-graph out)")
    snap = snapshot_for(device)
    backends = resolve_backends(config.backends, snap)
    fi, fi_info = (None, "not tried on CPU")
    if config.baselines and device.type == "cuda":
        fi, fi_info = flashinfer_module()
    cases = config.cases(device)
    results = []
    for i, case in enumerate(cases):
        if progress is not None:
            progress(f"[{i + 1}/{len(cases)}] {case.phase} {case.label()} page {case.page_size} "
                     f"{case.dtype} kv {case.kv_cache_dtype}")
        with torch.inference_mode():
            results.append(run_case(case, backends, device, config, fi, snap))
    budget = config.budget(device)
    timing = ("CUDA events per run, 256 MB L2 flush before each, median" if device.type == "cuda"
              else "wall clock per run, median")
    if config.cuda_graph:
        timing += "; decode calls captured in a CUDA graph and timed as its replays"
    return {
        "environment": _environment(device, fi_info if fi is not None else None),
        "flashinfer": fi_info,
        "timing": f"{timing}; warm-up {budget.warmup_ms:g} ms, about {budget.rep_ms:g} ms of runs "
                  f"({budget.min_runs}-{budget.max_runs})",
        "ratio": "time / baseline time in the same run (below 1 = faster than the baseline)",
        "config": asdict(config),
        "cases": results,
        "summary": summarize(results),
        "failed": [f"{c['label']} page {c['case']['page_size']} kv {c['case']['kv_cache_dtype']}: "
                   f"{r['backend']}: {r['error']}"
                   for c in results for r in c["rows"] if r.get("kind") == "sglx" and r.get("error")],
    }


def report_table(report: dict[str, Any]) -> Any:
    from rich.table import Table

    env = report["environment"]
    table = Table(title=f"sglx bench attention on {env.get('device_name') or env['device']} "
                        f"(torch {env['torch']}, triton {env.get('triton')}, flashinfer {env.get('flashinfer')})",
                  title_justify="left")
    for col, justify in (("phase", "left"), ("shape", "left"), ("page", "right"), ("dtype / kv", "left"),
                         ("backend", "left"), ("max |err|", "right"), ("median ms", "right"),
                         ("TFLOP/s | GB/s", "right"), ("/ SDPA", "right"), ("/ FlashInfer", "right")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for c in report["cases"]:
        case = c["case"]
        first = True
        for r in c["rows"]:
            ratio = r.get("time_ratio", {})
            if r.get("skipped"):
                cells = [f"[dim]skipped: {r['skipped']}[/]", "", "", "", ""]
            elif r.get("error"):
                err = f"{r['max_abs_err']:.1e}" if r.get("max_abs_err") is not None else ""
                cells = [err, f"[red]{r['error'][:60]}[/]", "", "", ""]
            else:
                rate = f"{r['tflops']:.4g}" if "tflops" in r else f"{r['gb_per_s']:.4g}"
                cells = [f"{r['max_abs_err']:.1e}", f"{r['median_ms']:.4f}", rate,
                         f"{ratio['sdpa']:.2f}x" if "sdpa" in ratio else "",
                         f"{ratio['flashinfer']:.2f}x" if "flashinfer" in ratio else ""]
            name = r["backend"] if r.get("kind") == "sglx" else f"[dim]{r['backend']}[/]"
            table.add_row(case["phase"] if first else "", c["label"] if first else "",
                          str(case["page_size"]) if first else "",
                          f"{case['dtype']} / {case['kv_cache_dtype']}" if first else "", name, *cells)
            first = False
        table.add_section()
    return table
