"""Rank the backends that can run by the medians recorded for this GPU class, per phase.

A backend's score is its worst ratio to the fastest runnable backend over the phase's recorded shapes
(on each shape every backend counts at its fastest measured page size, unless the user fixed one). Scores within
2% of the best are ties (one median each, often from different runs, cannot order them); ties go to the backend
measured on more shapes, then to the caller's order (SGLang's). Backends with no
measurement come after every measured one, in the caller's order. Only recorded numbers are used.

Where the record holds whole-engine medians for the phase (`sglx bench one-batch`: shapes labelled "engine ..."),
those decide first: a backend's score is its worst ratio over the engine shapes, ties (TIE_MARGIN) go to the
better kernel score, and backends the engine never ran follow the ones it did. Why: a kernel's median leaves out
what the engine adds around it (H200, session 28: FlashInfer's prefill kernel is 1.24x faster than triton's on
B4 4k, but the engine graphs only triton's short prefills, so a 512-token prompt took 24.0 ms against 12.6; the
trtllm_mha decode kernel is fastest at B1 ctx 4096, yet the engine's batch-1 step was 5-9% slower with it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sglx.attention.measured.record import Measurement, Record, engine_shape


@dataclass(frozen=True)
class ShapeResult:
    """One backend on one recorded shape: its median, and the fastest runnable backend's there."""

    shape: str
    page_size: int
    kv_cache_dtype: str
    ms: float
    ratio: float
    best: str
    best_ms: float
    source: str
    date: str
    device: str


@dataclass(frozen=True)
class Ranked:
    backend: str
    worst_ratio: float
    shapes: tuple[ShapeResult, ...]
    missing: tuple[str, ...]  # the phase's recorded shapes this backend was not measured on
    engine_ratio: float | None = None  # worst ratio over the engine shapes (None: the engine never ran it)


@dataclass(frozen=True)
class PhaseRanking:
    phase: str
    gpu_class: str
    origin: str
    basis: str  # what was compared: KV dtype, page size, fallbacks
    ranked: tuple[Ranked, ...]  # measured, runnable, best first
    unmeasured: tuple[str, ...]  # runnable but never measured here, in the caller's order

    @property
    def pick(self) -> str | None:
        if self.ranked:
            return self.ranked[0].backend
        return self.unmeasured[0] if self.unmeasured else None

    def lines(self) -> list[str]:
        """The ranking in words, with every number's source (doctor and the selection's evidence)."""
        head = f"{self.phase}: {self.basis} [{self.origin}]"
        out = [head]
        for r in self.ranked:
            parts = [f"{s.shape} page {s.page_size}: {s.ms:.4f} ms" +
                     (" (fastest)" if s.ratio == 1.0 else f" = {s.ratio:.3f}x {s.best} {s.best_ms:.4f} ms") +
                     f" [{s.source}, {s.date}, {s.device}]" for s in r.shapes]
            engine = "" if r.engine_ratio is None else f"in the engine worst {r.engine_ratio:.3f}x, "
            text = f"  {r.backend}: {engine}worst {r.worst_ratio:.3f}x of the fastest; " + "; ".join(parts)
            if r.missing:
                text += f"; not measured on {', '.join(r.missing)}"
            out.append(text)
        if self.unmeasured:
            out.append("  never measured here, after the measured ones in SGLang's order: "
                       + ", ".join(self.unmeasured))
        return out


# One median per backend, often from different runs, does not resolve a 2% difference; and the record holds few
# shapes, so a near-tie should not hand the default to a backend with a known gap on shapes not recorded.
TIE_MARGIN = 0.02


def _ties_broken(ranked: list[Ranked], score: Callable[[Ranked], float], tie_key: Callable[[Ranked], tuple]
                 ) -> list[Ranked]:
    """Best score first; the backends within TIE_MARGIN of the best are a tie, ordered by tie_key."""
    ranked = sorted(ranked, key=lambda r: (score(r), tie_key(r)))
    if not ranked:
        return ranked
    cut = score(ranked[0]) * (1.0 + TIE_MARGIN)
    return sorted((r for r in ranked if score(r) <= cut), key=tie_key) + [r for r in ranked if score(r) > cut]


def _latest(entries: list[Measurement]) -> Measurement:
    return max(entries, key=lambda e: e.date)


def _phase_entries(record: Record, kind: str, phase: str, kv_cache_dtype: str,
                   runnable: Sequence[str]) -> tuple[list[Measurement], str]:
    """The phase's medians of `runnable` backends at this KV dtype, or at 16-bit KV ("auto") when this dtype
    was never measured for the phase; and the dtype used."""
    pool = [e for e in record.entries if e.kind == kind and e.phase == phase and e.backend in runnable]
    if kv_cache_dtype != "auto" and not any(e.kv_cache_dtype == kv_cache_dtype for e in pool) and pool:
        kv_cache_dtype = "auto"
    return [e for e in pool if e.kv_cache_dtype == kv_cache_dtype], kv_cache_dtype


def rank_phase(record: Record, kind: str, phase: str, kv_cache_dtype: str, page_size: int | None,
               runnable: Sequence[str], sglang_order: Sequence[str]) -> PhaseRanking:
    """Order the `runnable` backends for one phase by the record (see the module docstring); an unmeasured one
    follows only if SGLang's auto order (`sglang_order`) names it."""
    pool, kv = _phase_entries(record, kind, phase, kv_cache_dtype, runnable)
    notes: list[str] = []
    if kv != kv_cache_dtype:
        notes.append(f"no {kv_cache_dtype} KV {phase} measured here, so the 16-bit KV (auto) medians rank it")
    if page_size is not None and pool:
        at_size = [e for e in pool if e.page_size == page_size]
        if at_size:
            # the engine's medians count at any page size: what they add over the kernels (graphs, host work,
            # fused stores) does not depend on it
            pool = at_size + [e for e in pool if e.page_size != page_size and engine_shape(e.shape)]
            notes.append(f"page size {page_size}")
        else:
            notes.append(f"nothing measured at page size {page_size}, so every measured page size counts")
    elif pool:
        notes.append("each backend at its fastest measured page size")
    # (shape, backend) -> the fastest page size's entry, the newest run where one page size ran twice
    by_page: dict[tuple[str, str, int], list[Measurement]] = {}
    for e in pool:
        by_page.setdefault((e.shape, e.backend, e.page_size), []).append(e)
    best_entry: dict[tuple[str, str], Measurement] = {}
    for (shape, backend, _), entries in by_page.items():
        e = _latest(entries)
        held = best_entry.get((shape, backend))
        if held is None or e.median_ms < held.median_ms:
            best_entry[(shape, backend)] = e
    shapes = list(dict.fromkeys(e.shape for e in pool))
    fastest = {s: min((e for (sh, _), e in best_entry.items() if sh == s), key=lambda e: e.median_ms)
               for s in shapes}
    order = {name: i for i, name in enumerate(dict.fromkeys([*sglang_order, *runnable]))}
    ranked = []
    for backend in dict.fromkeys(e.backend for e in pool):
        results = tuple(
            ShapeResult(s, e.page_size, e.kv_cache_dtype, e.median_ms, e.median_ms / fastest[s].median_ms,
                        fastest[s].backend, fastest[s].median_ms, e.source, e.date, e.device)
            for s in shapes if (e := best_entry.get((s, backend))) is not None)
        missing = tuple(s for s in shapes if (s, backend) not in best_entry)
        engine = [r.ratio for r in results if engine_shape(r.shape)]
        ranked.append(Ranked(backend, max(r.ratio for r in results), results, missing,
                             max(engine) if engine else None))
    if any(r.engine_ratio is not None for r in ranked):
        notes.append("the engine's medians first")
        ran = _ties_broken([r for r in ranked if r.engine_ratio is not None], lambda r: r.engine_ratio,
                           lambda r: (r.worst_ratio, order[r.backend]))
        rest = sorted((r for r in ranked if r.engine_ratio is None), key=lambda r: (r.worst_ratio, order[r.backend]))
        ranked = ran + rest
    else:  # ties: broader coverage, then SGLang's order
        ranked = _ties_broken(ranked, lambda r: r.worst_ratio, lambda r: (-len(r.shapes), order[r.backend]))
    measured = {r.backend for r in ranked}
    unmeasured = tuple(b for b in sglang_order if b in runnable and b not in measured)
    basis = (f"ranked by the medians recorded for {record.gpu_class} ({'; '.join(notes)})" if ranked
             else f"no {kind.upper()} {phase} is recorded for {record.gpu_class} among the backends that run, "
                  "so SGLang's order")
    return PhaseRanking(phase, record.gpu_class, record.origin, basis, tuple(ranked), unmeasured)


def global_worst_ratio(record: Record, kind: str, phase: str, kv_cache_dtype: str, backend: str, page_size: int,
                       runnable: Sequence[str]) -> float | None:
    """`backend` at `page_size` against the fastest runnable backend at ANY page size, worst over the phase's
    recorded shapes where it was measured at that page size (None: measured on none of them).

    Why: prefill and decode share one page size, so a pick that is fastest at its own page size can still
    cost the other phase a slower page size; comparing both against the unconstrained best shows the cost."""
    pool, _ = _phase_entries(record, kind, phase, kv_cache_dtype, runnable)
    best: dict[str, float] = {}
    for e in pool:
        best[e.shape] = min(best.get(e.shape, float("inf")), e.median_ms)
    mine: dict[str, list[Measurement]] = {}
    for e in pool:
        if e.backend == backend and e.page_size == page_size:
            mine.setdefault(e.shape, []).append(e)
    ratios = [_latest(entries).median_ms / best[shape] for shape, entries in mine.items()]
    return max(ratios) if ratios else None
