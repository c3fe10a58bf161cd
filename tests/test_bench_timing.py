"""sglx.bench.timing.checked_us_in_graph: the launch sweeps' rule that a config is timed only after its output is
checked, and that a failing config becomes a row, not an exception."""

from __future__ import annotations

import pytest
import torch

from sglx.bench import timing


@pytest.fixture
def timed_calls(monkeypatch: pytest.MonkeyPatch) -> list:
    """per_call_us_in_graph replaced (CUDA graphs need a GPU): records what would have been timed."""
    calls: list = []

    def fake(call, n, device):
        calls.append(n)
        return 7.5
    monkeypatch.setattr(timing, "per_call_us_in_graph", fake)
    return calls


def test_a_correct_config_is_timed(timed_calls: list) -> None:
    want = torch.ones(3, dtype=torch.float64)
    row = timing.checked_us_in_graph(lambda i: torch.ones(3, dtype=torch.bfloat16) * 1.001, 4, want, 2e-2,
                                     torch.device("cpu"))
    assert row["us_per_call"] == 7.5 and row["max_abs_error"] < 2e-2 and "error" not in row
    assert timed_calls == [4]


def test_a_wrong_config_is_reported_and_not_timed(timed_calls: list) -> None:
    row = timing.checked_us_in_graph(lambda i: torch.zeros(3), 4, torch.ones(3), 2e-2, torch.device("cpu"))
    assert row == {"max_abs_error": 1.0, "error": "max abs error 1: not timed"}
    assert timed_calls == []


def test_a_config_that_raises_becomes_an_error_row(timed_calls: list) -> None:
    def broken(i: int) -> torch.Tensor:
        raise RuntimeError("out of resources: shared memory")
    row = timing.checked_us_in_graph(broken, 4, torch.ones(3), 2e-2, torch.device("cpu"))
    assert row == {"error": "RuntimeError: out of resources: shared memory"}
    assert timed_calls == []
