"""Sampler: filters against a per-row reference, penalties against HF's processor, seeds, empirical law."""

from __future__ import annotations

import pytest
import torch

from sglx.errors import SglxError
from sglx.llm.sampling import SamplingParams, apply_penalties, filtered_probs, make_generator, sample


def _reference_filter(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                      min_p: float) -> torch.Tensor:
    probs = torch.softmax(logits.double() / temperature, -1)
    order = sorted(range(len(probs)), key=lambda i: -float(probs[i]))
    keep, mass = [], 0.0
    for rank, i in enumerate(order):
        if rank > 0 and (top_k > 0 and rank >= top_k or mass >= top_p - 1e-12
                         or probs[i] < min_p * probs[order[0]]):
            continue
        keep.append(i)
        mass += float(probs[i])
    out = torch.zeros_like(probs)
    out[keep] = probs[keep]
    return out / out.sum()


@pytest.mark.parametrize(("temperature", "top_k", "top_p", "min_p"), [
    (1.0, -1, 1.0, 0.0), (0.7, 3, 1.0, 0.0), (1.3, -1, 0.6, 0.0), (1.0, -1, 1.0, 0.2), (0.5, 5, 0.8, 0.05),
])
def test_filters_match_reference(temperature: float, top_k: int, top_p: float, min_p: float) -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 17) * 2
    n = logits.shape[0]
    got = filtered_probs(logits, torch.full((n,), temperature), torch.full((n,), top_k),
                         torch.full((n,), top_p), torch.full((n,), min_p))
    for row in range(n):
        ref = _reference_filter(logits[row], temperature, top_k, top_p, min_p)
        torch.testing.assert_close(got[row].double(), ref, atol=1e-6, rtol=1e-5)


def test_greedy_is_argmax_and_ignores_generators() -> None:
    logits = torch.tensor([[0.1, 3.0, -1.0], [5.0, 0.0, 4.9]])
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=1, temperature=2.0)]
    assert sample(logits, params, [None, None], [[], []], [[], []]) == [1, 0]


def test_precomputed_greedy_ids_are_used_only_without_penalties() -> None:
    """The decode graph's argmax stands in for logits.argmax, but a penalty changes the winner."""
    logits = torch.tensor([[0.1, 3.0, -1.0], [5.0, 0.0, 4.9]])
    marker = torch.tensor([2, 2])  # not the argmax: shows which source was read
    greedy = [SamplingParams(temperature=0.0)] * 2
    assert sample(logits, greedy, [None, None], [[], []], [[], []], greedy_ids=marker) == [2, 2]
    penalized = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, repetition_penalty=2.0)]
    assert sample(logits, penalized, [None, None], [[], []], [[1], [0]], greedy_ids=torch.tensor([0, 0])) == [1, 2]


def test_seeded_sampling_is_independent_of_batch_composition() -> None:
    torch.manual_seed(1)
    steps = [torch.randn(3, 50) for _ in range(20)]
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=123)

    def run(rows: list[int], seeds: list[int]) -> list[list[int]]:
        gens = [make_generator(s, "cpu") for s in seeds]
        outs: list[list[int]] = [[] for _ in rows]
        for logits in steps:
            toks = sample(logits[rows], [p] * len(rows), gens, [[] for _ in rows], outs)
            for o, t in zip(outs, toks):
                o.append(t)
        return outs

    alone = run([1], [123])[0]
    batched = run([0, 1, 2], [7, 123, 9])
    assert batched[1] == alone
    assert run([1], [124])[0] != alone


def test_empirical_distribution_follows_softmax() -> None:
    logits = torch.tensor([[1.0, 0.0, -1.0, 0.5]])
    p = SamplingParams(temperature=0.8)
    gen = make_generator(0, "cpu")
    n = 4000
    counts = torch.zeros(4)
    for _ in range(n):
        counts[sample(logits, [p], [gen], [[]], [[]])[0]] += 1
    expect = torch.softmax(logits[0] / 0.8, -1)
    assert torch.allclose(counts / n, expect, atol=0.03), (counts / n, expect)


def test_repetition_penalty_matches_transformers() -> None:
    from transformers import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(2)
    logits = torch.randn(1, 30)
    prompt, output = [1, 4, 4, 7], [9, 1, 12]
    ref = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + output]), logits.clone())
    got = apply_penalties(logits[0].clone(), SamplingParams(repetition_penalty=1.3), prompt, output)
    torch.testing.assert_close(got, ref[0])


def test_frequency_and_presence_penalties_follow_openai_formula() -> None:
    logits = torch.zeros(6)
    got = apply_penalties(logits.clone(), SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
                          [5, 5], [1, 1, 1, 3])
    expect = torch.tensor([0.0, -(3 * 0.5 + 0.25), 0.0, -(0.5 + 0.25), 0.0, 0.0])  # prompt tokens not penalized
    torch.testing.assert_close(got, expect)


def test_invalid_params_are_user_errors() -> None:
    with pytest.raises(SglxError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(SglxError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(SglxError, match="unknown sampling parameter"):
        SamplingParams.from_any({"max_tokens": 3})
    assert SamplingParams(stop="x").stop == ("x",)
