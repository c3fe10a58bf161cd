"""Interpreted cases (TRITON_INTERPRET=1): the ascending top-k kernel VSA picks key blocks with, against torch.topk
(the same set, listed ascending), with disallowed columns, negative scores, and ties at the k-th score."""

from __future__ import annotations

import os

import pytest
import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/test_sparse_backends.py"

from sglx.attention.kernels.topk_rows import kernel_serves, topk_ascending  # noqa: E402


def _want(scores: torch.Tensor, k: int, allowed: torch.Tensor) -> torch.Tensor:
    masked = scores.masked_fill(~allowed, float("-inf"))
    return masked.topk(k, dim=-1).indices.sort(-1).values.to(torch.int32)


@pytest.mark.parametrize(("rows", "cols", "k"), [(1, 1, 1), (3, 37, 5), (8, 300, 38), (2, 1080, 135)])
def test_matches_torch_topk(rows, cols, k):
    g = torch.Generator().manual_seed(cols)
    scores = torch.randn(2, rows, cols, generator=g) * 10 - 3  # negatives and positives
    allowed = torch.ones(cols, dtype=torch.bool)
    assert kernel_serves(scores)
    assert torch.equal(topk_ascending(scores, k, allowed), _want(scores, k, allowed))


def test_disallowed_columns_are_never_picked():
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(4, 50, generator=g)
    allowed = torch.rand(50, generator=g) < 0.6
    scores[:, ~allowed] += 100.0  # the best scores sit in disallowed columns (text blocks)
    k = int(allowed.sum()) - 2
    got = topk_ascending(scores, k, allowed)
    assert torch.equal(got, _want(scores, k, allowed))
    assert allowed[got.long()].all()


def test_ties_at_the_kth_score_keep_the_lowest_columns():
    scores = torch.tensor([[0.5, 2.0, 1.0, 1.0, -1.0, 1.0, 3.0, 1.0]])
    got = topk_ascending(scores, 4, torch.ones(8, dtype=torch.bool))
    assert got.tolist() == [[1, 2, 3, 6]]  # 3.0, 2.0 and the first two of the four 1.0s
    zeros = torch.tensor([[0.0, -0.0, 0.0, 0.0]])
    assert topk_ascending(zeros, 2, torch.ones(4, dtype=torch.bool)).tolist() == [[0, 2]]  # -0.0 ranks below 0.0
