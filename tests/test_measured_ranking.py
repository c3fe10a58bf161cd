"""The ranking rule of auto-selection by measurement (sglx.attention.measured.ranking) on small made-up records:
the engine's medians first, ties by the kernels' score, backends the engine never ran after the ones it did."""

from __future__ import annotations

import pytest

from sglx.attention.measured.ranking import rank_phase
from sglx.attention.measured.record import Measurement, Record

KERNEL, ENGINE = "B1 H32/8 D128 ctx 4096", "engine llama B1 512+32 step"


def record(*rows: tuple[str, str, int, float]) -> Record:
    """(shape, backend, page size, median ms) decode rows of one made-up GPU class."""
    return Record("sm90-test", "test", tuple(
        Measurement("mha", "decode", shape, page, "auto", backend, ms, "made up", "2026-11-29", "NVIDIA Test")
        for shape, backend, page, ms in rows))


def order(rec: Record, page: int | None = None, runnable=("a", "b", "c")) -> list[str]:
    ranking = rank_phase(rec, "mha", "decode", "auto", page, list(runnable), ["a", "b", "c"])
    return [r.backend for r in ranking.ranked]


def test_kernels_only_rank_by_worst_ratio() -> None:
    assert order(record((KERNEL, "a", 1, 1.2), (KERNEL, "b", 1, 1.0))) == ["b", "a"]


def test_the_engine_outranks_faster_kernels() -> None:
    """b has the faster kernel, a the faster engine step: a first, and the why carries both scores."""
    rec = record((KERNEL, "a", 1, 1.2), (KERNEL, "b", 1, 1.0), (ENGINE, "a", 1, 4.2), (ENGINE, "b", 1, 4.5))
    ranking = rank_phase(rec, "mha", "decode", "auto", None, ["a", "b"], ["a", "b"])
    assert [r.backend for r in ranking.ranked] == ["a", "b"]
    top = ranking.ranked[0]
    assert top.engine_ratio == 1.0 and top.worst_ratio == pytest.approx(1.2)
    assert ranking.ranked[1].engine_ratio == pytest.approx(4.5 / 4.2)
    assert "the engine's medians first" in ranking.basis


def test_engine_ties_go_to_the_better_kernel() -> None:
    """Within 2% in the engine (one median each cannot order them), the kernels decide."""
    rec = record((KERNEL, "a", 1, 1.2), (KERNEL, "b", 1, 1.0), (ENGINE, "a", 1, 4.20), (ENGINE, "b", 1, 4.25))
    assert order(rec) == ["b", "a"]


def test_backends_the_engine_never_ran_come_after() -> None:
    """c has the fastest kernel but no engine run: after every backend the engine ran, however slow."""
    rec = record((KERNEL, "a", 1, 1.2), (KERNEL, "b", 1, 1.1), (KERNEL, "c", 1, 0.5), (ENGINE, "a", 1, 4.2),
                 (ENGINE, "b", 1, 6.0))
    assert order(rec) == ["a", "b", "c"]
    assert order(rec, runnable=("b", "c")) == ["b", "c"]  # a missing: b is still the engine's
    assert order(rec, runnable=("c",)) == ["c"]  # no engine run among those that run: the kernels


def test_a_fixed_page_size_keeps_the_engine_medians_of_other_pages() -> None:
    """Kernels at the asked page size only; the engine's medians at any page size (graphs and host work do not
    depend on it)."""
    rec = record((KERNEL, "a", 16, 1.2), (KERNEL, "b", 16, 1.0), (KERNEL, "b", 64, 0.9), (ENGINE, "a", 1, 4.2),
                 (ENGINE, "b", 64, 4.6))
    ranking = rank_phase(rec, "mha", "decode", "auto", 16, ["a", "b"], ["a", "b"])
    assert [r.backend for r in ranking.ranked] == ["a", "b"]
    assert {s.page_size for s in ranking.ranked[1].shapes} == {16, 64}  # b's kernel at 16, its engine at 64
