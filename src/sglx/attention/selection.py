"""Which attention backend runs: pure functions of (platform snapshot, model traits, user request).

Explicit choices are validated and never rewritten; auto selection follows SGLang's documented rules
but only among backends whose requirements hold here, and records why every other candidate lost. On a GPU
class with a measured record (attention/measured/), auto ranks each phase by the recorded medians instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, replace

from sglx.attention.measured.ranking import TIE_MARGIN, PhaseRanking, global_worst_ratio, rank_phase
from sglx.attention.measured.record import Record, engine_shape, gpu_class, record_for
from sglx.attention.registry import (
    BackendSpec,
    all_backends,
    availability,
    backend_names,
    find,
)
from sglx.attention.request import AttentionRequest, Family, Kind, Phase
from sglx.attention.requirements import CudaAtLeast, device_name
from sglx.errors import BackendUnavailableError
from sglx.platform import PlatformSnapshot

HOPPER_FA3_CUDA = CudaAtLeast((12, 3))


@dataclass(frozen=True)
class ModelTraits:
    """What selection needs to know about a model."""

    mla: bool = False
    head_dim: int | None = None
    dtype: str | None = None
    sliding_window: bool = False
    multimodal: bool = False

    @property
    def kind(self) -> Kind:
        return "mla" if self.mla else "mha"


@dataclass(frozen=True)
class LLMBackendArgs:
    """The user's attention-related flags, exactly as given (None = not given)."""

    attention_backend: str | None = None
    prefill_attention_backend: str | None = None
    decode_attention_backend: str | None = None
    page_size: int | None = None
    kv_cache_dtype: str = "auto"
    spec_topk: int | None = None


@dataclass(frozen=True)
class Considered:
    name: str
    ok: bool
    reasons: tuple[str, ...]


@dataclass(frozen=True)
class LLMSelection:
    prefill: str
    decode: str
    page_size: int
    source: str  # "explicit" | "auto" | "mixed"
    why: str
    considered: tuple[Considered, ...] = ()
    measured: tuple[PhaseRanking, ...] = ()  # the recorded medians behind an auto pick, per auto phase

    @property
    def hybrid(self) -> bool:
        return self.prefill != self.decode

    @property
    def label(self) -> str:
        return f"hybrid (prefill={self.prefill}, decode={self.decode})" if self.hybrid else self.decode


@dataclass(frozen=True)
class DiffusionSelection:
    backend: str
    source: str  # "forced" | "cli" | "auto"
    why: str
    considered: tuple[Considered, ...] = ()


def _kind_label(kind: Kind) -> str:
    return {"mha": "an MHA model", "mla": "an MLA model", "dit": "a diffusion model"}[kind]


def runnable(snap: PlatformSnapshot, req: AttentionRequest) -> tuple[str, ...]:
    """Names of the backends of req's family and kind that would run here."""
    return tuple(s.name for s in all_backends(req.family, req.kind) if availability(s, snap, req).ok)


def _resolve(name: str, family: Family, kind: Kind, flag: str) -> BackendSpec:
    spec = find(name, family, kind)
    if spec is not None:
        return spec
    other_kind = {"mha": "mla", "mla": "mha"}.get(kind)
    if other_kind and find(name, family, other_kind) is not None:  # type: ignore[arg-type]
        choices = ", ".join(backend_names(family, kind))
        raise BackendUnavailableError(
            f"{flag} {name}: {name} has no {kind.upper()} implementation, and this is {_kind_label(kind)}. "
            f"{kind.upper()} backends: {choices}."
        )
    choices = ", ".join(backend_names(family, kind))
    other_family: Family = "diffusion" if family == "llm" else "llm"
    if any(find(name, other_family, k) is not None for k in ("mha", "mla", "dit")):  # type: ignore[arg-type]
        raise BackendUnavailableError(
            f"{flag} {name}: {name} is {'a diffusion' if other_family == 'diffusion' else 'an LLM'} attention "
            f"backend, and this is {_kind_label(kind)}. Choose one of: {choices}."
        )
    raise BackendUnavailableError(f"{flag} {name}: unknown attention backend. Choose one of: {choices}.")


def _explicit(spec: BackendSpec, snap: PlatformSnapshot, req: AttentionRequest, flag: str) -> None:
    """Raise the one error type, listing the reasons and what would run, when an explicit choice can't run."""
    avail = availability(spec, snap, req)
    if avail.ok:
        return
    alternatives = runnable(snap, req)
    lines = [f"{flag} {spec.name} cannot run here:"]
    lines += [f"  - {r}" for r in avail.reasons]
    if alternatives:
        lines.append(f"Backends that would run here: {', '.join(alternatives)} (e.g. {flag} {alternatives[0]}).")
    else:
        lines.append(f"No {spec.kind.upper()} attention backend can run here for this request.")
    raise BackendUnavailableError("\n".join(lines))


def llm_auto_candidates(snap: PlatformSnapshot, kind: Kind) -> tuple[tuple[str, str], ...]:
    """SGLang's auto-selection order for this platform, each with the rule that put it there."""
    cc = snap.capability
    out: list[tuple[str, str]] = []
    if snap.device_kind == "cuda":
        if cc is not None and cc[0] == 9:
            out.append(("fa3", "Hopper defaults to fa3 (with CUDA >= 12.3)"))
        elif cc is not None and cc[0] == 10:
            name = "trtllm_mla" if kind == "mla" else "trtllm_mha"
            out.append((name, f"Blackwell (SM{cc[0]}{cc[1]}) defaults to {name}"))
        if kind == "mha":
            out.append(("flashinfer", "other CUDA GPUs default to flashinfer when it is installed"))
            out.append(("triton", "triton is the portable fallback on CUDA"))
            out.append(("torch_native", "torch_native runs everywhere"))
        else:
            if cc is not None and cc[0] == 9:  # the guide's fa3 absent: the fastest MLA measured on Hopper
                out.append(("flashinfer", "without fa3, Hopper takes FlashInfer MLA, the fastest MLA decode measured "
                                          "on an H100 (docs/benchmarks.md)"))
            out.append(("triton", "MLA falls back to triton"))
            out.append(("torch_native", "torch_native (MLA reference) runs everywhere"))
    elif snap.device_kind == "rocm":
        if kind == "mha":
            out += [("aiter", "ROCm defaults to aiter"), ("triton", "triton runs on ROCm"),
                    ("torch_native", "torch_native runs everywhere")]
        else:
            out.append(("triton", "MLA on ROCm uses triton"))
            out.append(("torch_native", "torch_native (MLA reference) runs everywhere"))
    elif snap.device_kind == "npu":
        out.append(("ascend", "Ascend NPUs default to ascend"))
        out.append(("torch_native", "torch_native runs everywhere"))
    elif snap.device_kind == "xpu":
        if kind == "mha":
            out += [("intel_xpu", "Intel XPU defaults to intel_xpu"), ("triton", "triton runs on XPU"),
                    ("torch_native", "torch_native runs everywhere")]
        else:
            out.append(("triton", "MLA on XPU uses triton"))
            out.append(("torch_native", "torch_native (MLA reference) runs everywhere"))
    else:
        out.append(("torch_native", f"{device_name(snap.device_kind)} defaults to torch_native"))
    return tuple(out)


def _auto_rule_reasons(name: str, snap: PlatformSnapshot) -> list[str]:
    """Conditions of an auto rule beyond the backend's own requirements (Hopper's CUDA >= 12.3 for fa3)."""
    if name == "fa3" and snap.capability is not None and snap.capability[0] == 9:
        reason = HOPPER_FA3_CUDA.check(snap, AttentionRequest())
        return [f"auto picks fa3 on Hopper only with CUDA >= 12.3 ({reason})"] if reason else []
    return []


def _page_sizes_text(spec: BackendSpec, snap: PlatformSnapshot) -> str:
    rule = spec.page_size_rule(snap)
    return f"{spec.name} needs --page-size {', '.join(map(str, rule.sizes))}" if rule else f"{spec.name}: any"


def _page_conflict(spec: BackendSpec, fixed: tuple[tuple[str, BackendSpec], ...], snap: PlatformSnapshot,
                   req: AttentionRequest) -> list[str]:
    """Why an auto candidate cannot share one page size with the backend the user fixed for the other phase."""
    rule = spec.page_size_rule(snap)
    if req.page_size is not None or rule is None:
        return []
    reasons = []
    for flag, other in fixed:
        other_rule = other.page_size_rule(snap)
        if other_rule is not None and not set(rule.sizes) & set(other_rule.sizes):
            reasons.append(f"{_page_sizes_text(spec, snap)} but {flag} {other.name} needs "
                           f"--page-size {', '.join(map(str, other_rule.sizes))}; the phases share one KV pool")
    return reasons


FP8_ACCURACY_FIRST = ("fp8 KV: auto puts backends with per-token scales first (embedded-model recall 98.5% against "
                      "85-88.5% with one scale per layer; docs/benchmarks.md)")


def _per_token_scales(name: str, kind: Kind) -> bool:
    """Reads fp8 KV with per-token scales and pages natively (torch_native's gathers are a reference, never a
    speed pick on a GPU, so the preference does not hand it the default)."""
    spec = find(name, "llm", kind)
    features = spec.features if spec is not None else None
    return bool(getattr(features, "fp8_per_token_scales", False) and getattr(features, "native_paging", False))


def _accuracy_first(names: list[str], req: AttentionRequest) -> list[str]:
    """With fp8 KV, the backends that read per-token scales go first (stable): auto never trades accuracy for
    speed; a user who wants the per-layer-scale kernels names them."""
    if not str(req.kv_cache_dtype).startswith("fp8"):
        return names
    return sorted(names, key=lambda n: not _per_token_scales(n, req.kind))


def _auto_llm(
    snap: PlatformSnapshot, req: AttentionRequest, fixed: tuple[tuple[str, BackendSpec], ...] = ()
) -> tuple[str, str, tuple[Considered, ...]]:
    """First auto candidate that runs here (and agrees on page size with a phase the user fixed)."""
    considered: list[Considered] = []
    rules = dict(llm_auto_candidates(snap, req.kind))
    ordered = _accuracy_first(list(rules), req)
    if ordered != list(rules):
        rules = {n: f"{rules[n]}; {FP8_ACCURACY_FIRST}" for n in ordered}
    for name, rule in rules.items():
        spec = find(name, "llm", req.kind)
        if spec is None:
            continue
        reasons = [*_auto_rule_reasons(name, snap), *availability(spec, snap, req).reasons,
                   *_page_conflict(spec, fixed, snap, req)]
        considered.append(Considered(name, not reasons, tuple(reasons)))
        if not reasons:
            return name, rule, tuple(considered)
    raise _nothing_runs(snap, req, considered)


def _nothing_runs(snap: PlatformSnapshot, req: AttentionRequest,
                  considered: list[Considered]) -> BackendUnavailableError:
    lines = [f"no attention backend for {_kind_label(req.kind)} can run on this "
             f"{device_name(snap.device_kind)} machine:"]
    lines += [f"  - {c.name}: {'; '.join(c.reasons)}" for c in considered]
    if not considered:
        lines.append(f"  - sglx has no {req.kind.upper()} backend for {device_name(snap.device_kind)}")
    return BackendUnavailableError("\n".join(lines))


def _auto_measured(
    snap: PlatformSnapshot, req: AttentionRequest, record: Record, fixed: tuple[tuple[str, BackendSpec], ...],
    phases: tuple[str, ...],
) -> tuple[dict[str, str], str, tuple[Considered, ...], tuple[PhaseRanking, ...]]:
    """Per auto phase, the runnable backend the record ranks first (decode first: its page size binds prefill)."""
    sglang = [name for name, _ in llm_auto_candidates(snap, req.kind)]
    recorded = [e.backend for e in record.entries if e.kind == req.kind]
    picks: dict[str, str] = {}
    rankings: list[PhaseRanking] = []
    considered: dict[str, Considered] = {}
    for phase in phases:
        runs_here = []
        for name in dict.fromkeys([*sglang, *recorded]):
            spec = find(name, "llm", req.kind)
            if spec is None:
                continue
            reasons = [*_auto_rule_reasons(name, snap), *availability(spec, snap, replace(req, phase=phase)).reasons,
                       *_page_conflict(spec, fixed, snap, req)]
            merged = tuple(dict.fromkeys([*(considered[name].reasons if name in considered else ()), *reasons]))
            considered[name] = Considered(name, not merged, merged)
            if not reasons:
                runs_here.append(name)
        accurate = [n for n in runs_here if _per_token_scales(n, req.kind)]
        if str(req.kv_cache_dtype).startswith("fp8") and accurate:
            ranking = rank_phase(record, req.kind, phase, req.kv_cache_dtype, req.page_size, accurate, sglang)
            ranking = replace(ranking, basis=f"{ranking.basis}; {FP8_ACCURACY_FIRST}")
        else:
            ranking = rank_phase(record, req.kind, phase, req.kv_cache_dtype, req.page_size, runs_here, sglang)
        if ranking.pick is None:
            raise _nothing_runs(snap, req, list(considered.values()))
        picks[phase] = ranking.pick
        rankings.append(ranking)
        fixed = (*fixed, (f"the auto {phase} pick", find(ranking.pick, "llm", req.kind)))  # type: ignore[arg-type]
    parts = []
    for r in rankings:
        top = r.ranked[0] if r.ranked else None
        if top is not None and top.engine_ratio is not None:
            engine = sum(engine_shape(s.shape) for s in top.shapes)
            kernels = [s.ratio for s in top.shapes if not engine_shape(s.shape)]
            alone = (f"; kernels alone worst {max(kernels):.3f}x over {len(kernels)} shapes" if kernels else "")
            parts.append(f"{r.phase} {r.pick} (in the engine worst {top.engine_ratio:.3f}x of the fastest runnable "
                         f"backend over {engine} recorded engine shapes{alone})")
        elif top is not None:
            parts.append(f"{r.phase} {r.pick} (worst {top.worst_ratio:.3f}x of the fastest runnable backend over "
                         f"{len(top.shapes)} of {len(top.shapes) + len(top.missing)} recorded shapes)")
        else:
            parts.append(f"{r.phase} {r.pick} (nothing recorded for this phase runs: SGLang's order)")
    why = f"measured on {record.gpu_class} ({record.origin}): " + "; ".join(parts)
    return picks, why, tuple(considered.values()), tuple(rankings)


def _joint_score(snap: PlatformSnapshot, req: AttentionRequest, record: Record, picks: dict[str, str],
                 runnable: list[str]) -> float:
    """Both phases' picks at the page size they share, each against the fastest `runnable` backend at any page
    size: the worse phase's worst ratio (inf when a pick has no measurement at that page size)."""
    specs = [s for s in (find(name, "llm", req.kind) for name in picks.values()) if s is not None]
    try:
        page = _page_size(specs, snap, None)
    except BackendUnavailableError:
        return float("inf")
    scores = [global_worst_ratio(record, req.kind, phase, req.kv_cache_dtype, name, page, runnable)
              for phase, name in picks.items()]
    return max((s if s is not None else float("inf")) for s in scores)


def _auto_measured_joint(
    snap: PlatformSnapshot, req: AttentionRequest, record: Record, fixed: tuple[tuple[str, BackendSpec], ...],
    phases: tuple[str, ...],
) -> tuple[dict[str, str], str, tuple[Considered, ...], tuple[PhaseRanking, ...]]:
    """Both phases auto and no page size given: whichever phase picks first binds the other's page size, so
    try decode first and prefill first and keep the pair whose worse phase is nearer its unconstrained best
    (decode first on a tie within the ranking's margin)."""
    first = _auto_measured(snap, req, record, fixed, phases)
    if req.page_size is not None or len(phases) < 2:
        return first
    try:
        second = _auto_measured(snap, req, record, fixed, tuple(reversed(phases)))
    except BackendUnavailableError:
        return first
    if second[0] == first[0]:
        return first
    # a backend ruled out only by the other phase's pick still sets the bar: either order could have had it
    runnable = list(dict.fromkeys(c.name for c in (*first[2], *second[2]) if c.ok))
    a, b = (_joint_score(snap, req, record, first[0], runnable), _joint_score(snap, req, record, second[0], runnable))
    if b * (1.0 + TIE_MARGIN) < a:
        why = (f"{second[1]}; {phases[-1]} chosen first: its page size costs the other phase less (worst "
               f"{b:.3f}x of the fastest at any page size, against {a:.3f}x with {phases[0]} first)")
        return second[0], why, second[2], second[3]
    return first


def _no_record_note(snap: PlatformSnapshot) -> str:
    cls = gpu_class(snap)
    return f"; no measured record for {cls}, so SGLang's order" if cls else ""


def _page_size(specs: list[BackendSpec], snap: PlatformSnapshot, requested: int | None) -> int:
    """The page size every chosen backend accepts: the user's (validated earlier) or one the rules allow."""
    if requested is not None:
        return requested
    allowed: set[int] | None = None
    for spec in specs:
        rule = spec.page_size_rule(snap)
        if rule is not None:
            allowed = set(rule.sizes) if allowed is None else allowed & set(rule.sizes)
    if allowed is None:
        return 1
    if not allowed:
        needs = "; ".join(_page_sizes_text(s, snap) for s in specs)
        raise BackendUnavailableError(
            f"prefill and decode share one KV pool, but their page sizes do not overlap ({needs}); "
            "pick backends that agree on a page size."
        )
    return max(allowed)


def _phase_served(flag: str, phase_flags: dict[str, str | None]) -> Phase | None:
    """The phase a backend named by `flag` (or picked by auto) serves: a phase flag its own, --attention-backend and
    auto whichever phase no phase flag took (None: both)."""
    if flag in phase_flags:
        return "prefill" if flag == "--prefill-attention-backend" else "decode"
    free = [p for p in ("prefill", "decode") if not phase_flags[f"--{p}-attention-backend"]]
    return free[0] if len(free) == 1 else None  # type: ignore[return-value]


def select_llm(snap: PlatformSnapshot, traits: ModelTraits, args: LLMBackendArgs) -> LLMSelection:
    """Prefill and decode backends plus the page size, or BackendUnavailableError with reasons."""
    if args.page_size is not None and args.page_size < 1:
        raise BackendUnavailableError(f"--page-size {args.page_size}: the page size must be a positive integer.")
    req = AttentionRequest(
        family="llm", kind=traits.kind, dtype=traits.dtype, head_dim=traits.head_dim, page_size=args.page_size,
        kv_cache_dtype=args.kv_cache_dtype, sliding_window=traits.sliding_window, spec_topk=args.spec_topk,
        multimodal=traits.multimodal,
    )
    explicit: dict[str, tuple[BackendSpec, str]] = {}
    phase_flags = {"--prefill-attention-backend": args.prefill_attention_backend,
                   "--decode-attention-backend": args.decode_attention_backend}
    for flag, value in (("--attention-backend", args.attention_backend), *phase_flags.items()):
        if value:
            spec = _resolve(value, "llm", traits.kind, flag)
            _explicit(spec, snap, replace(req, phase=_phase_served(flag, phase_flags)), flag)
            explicit[flag] = (spec, flag)
    considered: tuple[Considered, ...] = ()
    measured: tuple[PhaseRanking, ...] = ()
    picks: dict[str, str] = {}
    base = explicit.get("--attention-backend")
    base_name = base[0].name if base else None
    why = f"--attention-backend {base_name}" if base_name else ""
    need_auto = base is None and not (
        "--prefill-attention-backend" in explicit and "--decode-attention-backend" in explicit
    )
    if need_auto:
        fixed = tuple((flag, spec) for flag, (spec, _) in explicit.items() if flag != "--attention-backend")
        record = record_for(snap)
        if record is None:
            base_name, why, considered = _auto_llm(snap, replace(req, phase=_phase_served("auto", phase_flags)),
                                                   fixed)
            why += _no_record_note(snap)
        else:
            phases = tuple(p for p in ("decode", "prefill") if f"--{p}-attention-backend" not in explicit)
            picks, why, considered, measured = _auto_measured_joint(snap, req, record, fixed, phases)
    prefill = explicit.get("--prefill-attention-backend", (None,))[0]
    decode = explicit.get("--decode-attention-backend", (None,))[0]
    prefill = prefill.name if prefill else picks.get("prefill", base_name)
    decode = decode.name if decode else picks.get("decode", base_name)
    assert prefill is not None and decode is not None  # one of the branches above always sets them
    specs = [s for s in (find(prefill, "llm", traits.kind), find(decode, "llm", traits.kind)) if s is not None]
    page = _page_size(specs, snap, args.page_size)
    source = "auto" if need_auto and not explicit else ("explicit" if not need_auto else "mixed")
    if "--prefill-attention-backend" in explicit or "--decode-attention-backend" in explicit:
        parts = [f"{f} {s.name}" for f, (s, _) in explicit.items() if f != "--attention-backend"]
        why = f"{why}; " if why else ""
        why += ", ".join(parts) + ("; the other phase inherits" if len(parts) == 1 else "")
    return LLMSelection(prefill, decode, page, source, why, considered, measured)


# ---------------------------------------------------------------- diffusion

_FORCED: list[str | None] = [None]


def global_force_attn_backend(name: str | None) -> None:
    """Force every diffusion attention layer onto one backend (None clears it); beats the CLI and auto."""
    spec = None if name is None else find(name, "diffusion", "dit")
    if name is not None and spec is None:
        choices = ", ".join(backend_names("diffusion"))
        raise BackendUnavailableError(f"unknown diffusion attention backend {name!r}. Choose one of: {choices}.")
    _FORCED[0] = spec.name if spec is not None else None  # aliases (fa3, fa4) normalize to fa


def forced_attn_backend() -> str | None:
    return _FORCED[0]


@contextlib.contextmanager
def global_force_attn_backend_context_manager(name: str | None) -> Iterator[None]:
    """Force a diffusion backend inside a `with` block, restoring the previous choice afterwards."""
    previous = _FORCED[0]
    global_force_attn_backend(name)
    try:
        yield
    finally:
        _FORCED[0] = previous


def diffusion_auto_candidates(snap: PlatformSnapshot) -> tuple[tuple[str, str], ...]:
    if snap.device_kind == "cuda":
        return (("fa", "CUDA prefers FlashAttention (SM80+, fp16/bf16, supported head size, installed)"),
                ("torch_sdpa", "torch_sdpa is the fallback on CUDA"))
    if snap.device_kind == "rocm":
        return (("fa", "ROCm uses FlashAttention when available"), ("torch_sdpa", "torch_sdpa is the fallback"))
    return (("torch_sdpa", f"{device_name(snap.device_kind)} always uses torch_sdpa"),)


def select_diffusion(
    snap: PlatformSnapshot,
    req: AttentionRequest | None = None,
    cli_backend: str | None = None,
) -> DiffusionSelection:
    """Forced backend > --attention-backend > auto; aliases fa3/fa4 normalize to fa."""
    req = replace(req or AttentionRequest(), family="diffusion", kind="dit")
    for source, name, flag in (("forced", _FORCED[0], "global_force_attn_backend"),
                               ("cli", cli_backend, "--attention-backend")):
        if name:
            spec = _resolve(name, "diffusion", "dit", flag)
            _explicit(spec, snap, req, flag)
            return DiffusionSelection(spec.name, source, f"{flag}({name})" if source == "forced" else f"{flag} {name}")
    considered: list[Considered] = []
    for name, rule in diffusion_auto_candidates(snap):
        spec = find(name, "diffusion", "dit")
        assert spec is not None
        avail = availability(spec, snap, req)
        considered.append(Considered(name, avail.ok, avail.reasons))
        if avail.ok:
            return DiffusionSelection(name, "auto", rule, tuple(considered))
    lines = ["no diffusion attention backend can run here:"]
    lines += [f"  - {c.name}: {'; '.join(c.reasons)}" for c in considered]
    raise BackendUnavailableError("\n".join(lines))
