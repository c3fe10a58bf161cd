"""The single source of truth for every attention backend sglx knows.

Each backend is declared once (in `llm_backends.py` / `diffusion_backends.py`) with its requirements,
its support-matrix features, its config parameters and a lazily imported factory. Selection, `doctor`,
CLI validation, error messages and `docs/backends.md` are all computed from these declarations.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from sglx.attention.request import AttentionRequest, Family, Kind
from sglx.attention.requirements import AnyVariant, Requirement, Variant, platforms_of
from sglx.platform import PlatformSnapshot

NOT_IMPLEMENTED = "not implemented in sglx yet"


@dataclass(frozen=True)
class PageSizeRule:
    """Page sizes a backend's kernel accepts; `on` restricts the rule to some GPUs (FA4 on SM90)."""

    sizes: tuple[int, ...]
    on: Requirement | None = None

    def applies(self, snap: PlatformSnapshot | None) -> bool:
        if self.on is None or snap is None:
            return self.on is None
        # `on` names GPUs (compute capabilities), whose checks pass vacuously elsewhere: a CPU is not an SM90
        return snap.capability is not None and self.on.check(snap, AttentionRequest()) is None

    def describe(self) -> str:
        sizes = ", ".join(map(str, self.sizes))
        return f"{sizes} on {self.on.describe()}" if self.on else sizes


@dataclass(frozen=True)
class LLMFeatures:
    """One row of the LLM support matrix (MHA or MLA)."""

    native_paging: bool
    fp8_kv: bool
    fp4_kv: bool
    spec_topk1: bool
    spec_topk_gt1: bool | str  # True, False, or "page_size=1 only"
    sliding_window: bool = False
    multimodal: bool = False
    chunked_prefix_cache: bool = False
    page_sizes: PageSizeRule | None = None  # None: any page size (emulated when not native)
    cuda_graph: bool = False
    # fp8 KV read with a scale per token and head (what keeps accuracy), not one per layer; auto prefers these
    fp8_per_token_scales: bool = False
    # fp8 KV with some layers kept in the model dtype (--kv-cache-dtype-skip-layers): the backend reads each layer's
    # KV in its own dtype (AttentionBackend.kv_dtype_per_layer, which the engine checks)
    fp8_kv_dtype_per_layer: bool = False
    # Native page sizes the matrix lists for a kernel that can still emulate others (shown, not enforced).
    native_sizes_note: str | None = None

    def native_page_sizes(self) -> str:
        if self.page_sizes is not None:
            return self.page_sizes.describe()
        if self.native_sizes_note is not None:
            return self.native_sizes_note
        return "any" if self.native_paging else "n/a (emulated)"


@dataclass(frozen=True)
class DiffusionFeatures:
    sparse: bool = False
    needs_grid: bool = False  # needs the latent (T, H, W) token grid
    notes: str = ""
    # Max |error| vs float64 that checks accept in fp16/bf16, when wider than exact kernels' (quantized kernels).
    check_tolerance: float | None = None
    # The backend's kernel also returns the softmax log-sum-exp (`forward_dense_with_lse`): ring attention
    # (--ring-degree > 1) runs each ring step on it and merges the partial results by their LSE.
    lse: bool = False

    @property
    def ring_attention(self) -> str:
        """What ring attention does with this backend (docs/backends.md and doctor show it)."""
        if self.sparse:
            return "N: refused (the sparse pattern needs the whole sequence; use --ulysses-degree)"
        if self.lse:
            return "Y: each ring step on this backend's kernel (it returns the LSE)"
        return "fallback: ring steps on PyTorch SDPA's LSE kernels (this kernel returns no LSE)"


@dataclass(frozen=True)
class ConfigParam:
    """One `--attention-backend-config` key: its type is one of str, int, float, bool, list[int]."""

    name: str
    type: str
    description: str
    default: Any = None
    required: bool = False
    choices: tuple[str, ...] = ()  # a str parameter's allowed values (empty: any text)


@dataclass(frozen=True)
class BackendSpec:
    name: str
    family: Family
    kind: Kind
    title: str
    summary: str
    features: LLMFeatures | DiffusionFeatures
    requires: tuple[Requirement, ...] = ()
    aliases: tuple[str, ...] = ()
    config: tuple[ConfigParam, ...] = ()
    factory: str | None = None  # "module:attr", imported only when chosen; None = not implemented yet
    notes: str = ""
    # What serving decode needs beyond `requires`: a backend whose decode kernel is narrower than its prefill
    # (fa4 MLA: the absorbed kernels are Blackwell-only) still runs prefill where only these fail.
    decode_requires: tuple[Requirement, ...] = ()

    @property
    def implemented(self) -> bool:
        return self.factory is not None

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.family, self.kind, self.name)

    @property
    def platforms(self) -> tuple[str, ...]:
        return platforms_of(self.requires)

    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    def load(self) -> Any:
        """Import the implementation only now, so optional kernel packages stay unimported until chosen."""
        if self.factory is None:
            raise RuntimeError(f"attention backend {self.name!r} is {NOT_IMPLEMENTED}")
        module, _, attr = self.factory.partition(":")
        return getattr(importlib.import_module(module), attr)

    def page_size_rule(self, snap: PlatformSnapshot | None) -> PageSizeRule | None:
        if not isinstance(self.features, LLMFeatures) or self.features.page_sizes is None:
            return None
        rule = self.features.page_sizes
        return rule if rule.applies(snap) else None


@dataclass(frozen=True)
class Availability:
    ok: bool
    reasons: tuple[str, ...] = ()


_REGISTRY: dict[tuple[str, str, str], BackendSpec] = {}
_LOADED = False


def register(spec: BackendSpec) -> BackendSpec:
    """Add one backend declaration; names (and aliases) must be unique within a family and kind."""
    for other in _REGISTRY.values():
        if (other.family, other.kind) == (spec.family, spec.kind) and set(other.names()) & set(spec.names()):
            raise ValueError(f"backend name clash: {spec.name} vs {other.name} ({spec.family}/{spec.kind})")
    _REGISTRY[spec.key] = spec
    return spec


def _ensure_loaded() -> None:
    global _LOADED
    if not _LOADED:
        _LOADED = True
        importlib.import_module("sglx.attention.llm_backends")
        importlib.import_module("sglx.attention.diffusion_backends")


def all_backends(family: Family | None = None, kind: Kind | None = None) -> tuple[BackendSpec, ...]:
    _ensure_loaded()
    return tuple(
        s for s in _REGISTRY.values() if (family is None or s.family == family) and (kind is None or s.kind == kind)
    )


def backend_names(family: Family, kind: Kind | None = None) -> tuple[str, ...]:
    """Every accepted name (aliases too) in declaration order, for CLI choices and completions."""
    names: list[str] = []
    for spec in all_backends(family, kind):
        names.extend(n for n in spec.names() if n not in names)
    return tuple(names)


def find(name: str, family: Family, kind: Kind) -> BackendSpec | None:
    """Look up a backend by name or alias (case-insensitive); None when unknown."""
    wanted = name.strip().lower()
    for spec in all_backends(family, kind):
        if wanted in spec.names():
            return spec
    return None


def iter_feature_reasons(spec: BackendSpec, snap: PlatformSnapshot, req: AttentionRequest) -> Iterator[str]:
    """Reasons the request asks for something this backend's features do not offer."""
    feats = spec.features
    if not isinstance(feats, LLMFeatures):
        return
    if req.fp8_kv and not feats.fp8_kv:
        yield f"fp8 KV cache (--kv-cache-dtype {req.kv_cache_dtype}) is not supported by {spec.name}"
    if req.fp4_kv and not feats.fp4_kv:
        yield f"fp4 KV cache (--kv-cache-dtype {req.kv_cache_dtype}) is not supported by {spec.name}"
    if req.sliding_window and not feats.sliding_window:
        yield f"the model uses sliding-window attention, which {spec.name} does not support"
    if req.multimodal and not feats.multimodal:
        yield f"multimodal attention is not supported by {spec.name}"
    if req.spec_topk is not None:
        if req.spec_topk <= 1 and not feats.spec_topk1:
            yield f"speculative decoding (topk=1) is not supported by {spec.name}"
        if req.spec_topk > 1 and feats.spec_topk_gt1 is False:
            yield f"speculative decoding with topk>1 is not supported by {spec.name}"
        if req.spec_topk > 1 and isinstance(feats.spec_topk_gt1, str) and (req.page_size or 1) != 1:
            yield f"speculative decoding with topk>1 on {spec.name} needs --page-size 1"
    rule = spec.page_size_rule(snap)
    if rule is not None and req.page_size is not None and req.page_size not in rule.sizes:
        allowed = ", ".join(map(str, rule.sizes))
        where = f" on {snap.gpu_name}" if rule.on is not None else ""
        yield f"page size {req.page_size} is not supported: {spec.name} needs --page-size {allowed}{where}"


def availability(spec: BackendSpec, snap: PlatformSnapshot, req: AttentionRequest | None = None) -> Availability:
    """Whether `spec` can run on `snap` for `req`, with every reason it cannot (never just the first)."""
    req = req or AttentionRequest(family=spec.family, kind=spec.kind)
    reasons: list[str] = []
    if not spec.implemented:
        reasons.append(NOT_IMPLEMENTED)
    reasons.extend(r for r in (q.check(snap, req) for q in spec.requires) if r)
    reasons.extend(iter_feature_reasons(spec, snap, req))
    if req.phase != "prefill":
        decode = [f"its decode {r}" for r in (q.check(snap, req) for q in spec.decode_requires) if r]
        if decode and not reasons and req.phase is None:  # say what does run
            decode.append(f"its prefill runs here: --prefill-attention-backend {spec.name} with another "
                          "--decode-attention-backend")
        reasons.extend(decode)
    return Availability(ok=not reasons, reasons=tuple(reasons))


def prefill_only(spec: BackendSpec, snap: PlatformSnapshot, req: AttentionRequest | None = None) -> bool:
    """Whether only the prefill phase of `spec` runs here (its decode needs what this machine lacks)."""
    req = req or AttentionRequest(family=spec.family, kind=spec.kind)
    return (not availability(spec, snap, replace(req, phase=None)).ok
            and availability(spec, snap, replace(req, phase="prefill")).ok)


def chosen_variant(spec: BackendSpec, snap: PlatformSnapshot, req: AttentionRequest | None = None) -> Variant | None:
    """The kernel a backend with several (fa: FA3, FA4, FA2) runs here; None without variants or when none runs."""
    req = req or AttentionRequest(family=spec.family, kind=spec.kind)
    for r in spec.requires:
        if isinstance(r, AnyVariant):
            return r.chosen(snap, req)
    return None


__all__ = [
    "NOT_IMPLEMENTED",
    "Availability",
    "BackendSpec",
    "ConfigParam",
    "DiffusionFeatures",
    "LLMFeatures",
    "PageSizeRule",
    "all_backends",
    "availability",
    "chosen_variant",
    "backend_names",
    "find",
    "prefill_only",
    "register",
]
