"""Tensor-parallel building blocks (Megatron-style, as SGLang's): column/row-parallel linears, vocab-parallel
embedding and LM head, and the rules for which slice of each full checkpoint tensor a rank keeps.

A rank holds `num_heads / tp` query heads and, for its q heads, `num_kv_heads / tp` KV heads (or one KV
head, replicated, when there are fewer KV heads than ranks). Column-parallel layers (qkv, gate/up) split
their output features and need no communication; row-parallel layers (o_proj, down_proj) split their
input features and all-reduce their partial sums; the embedding and LM head split the vocabulary. With
tp size 1 every class behaves exactly like its single-device counterpart (no collective is issued).

The model being built reads the rank's `TensorParallel` from `current_tp()` (set by the model runner
around model construction with `use_tp`), so model classes keep their `cls(config)` signature; each layer
keeps a reference to it for its forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from sglx.errors import SglxError
from sglx.llm.layers.linear import Linear, linear

if TYPE_CHECKING:
    from sglx.distributed.group import DistContext
    from sglx.llm.model_config import ModelConfig


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in the tensor-parallel group; `size == 1` means no parallelism (no collectives)."""

    rank: int = 0
    size: int = 1
    dist: DistContext | None = None

    def split(self, total: int) -> tuple[int, int]:
        """(start, length) of this rank's even share of `total` features (total % size == 0)."""
        if total % self.size:
            raise SglxError(f"{total} features do not split evenly over tensor-parallel size {self.size}")
        n = total // self.size
        return self.rank * n, n

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """(first KV head, count) this rank keeps: an even share, or the one KV head its q heads read when
        there are fewer KV heads than ranks (that head is then replicated on size / num_kv_heads ranks)."""
        if num_kv_heads >= self.size:
            return self.split(num_kv_heads)
        return self.rank * num_kv_heads // self.size, 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1 and self.dist is not None:
            self.dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.size > 1 and self.dist is not None:
            return self.dist.all_gather(x, dim)
        return x


_SINGLE = TensorParallel()
_current: TensorParallel = _SINGLE


def current_tp() -> TensorParallel:
    """The tensor-parallel group the model under construction belongs to (size 1 outside `use_tp`)."""
    return _current


@contextlib.contextmanager
def use_tp(tp: TensorParallel | None) -> Iterator[TensorParallel]:
    """Build models inside this block to shard them for `tp` (None: single device)."""
    global _current
    previous, _current = _current, tp or _SINGLE
    try:
        yield _current
    finally:
        _current = previous


def check_tp_supported(config: ModelConfig, tp_size: int) -> None:
    """One SglxError line when `config` cannot be split over `tp_size` ranks (heads, KV heads, MLP, MLA)."""
    if tp_size == 1:
        return
    what = f"--tp-size {tp_size} for {config.architecture}"
    if config.mla is not None or config.architecture.startswith("Deepseek"):
        raise SglxError(f"{what}: tensor parallelism is not supported for MLA/MoE (DeepSeek) models yet; "
                        "run them with --tp-size 1")
    if config.num_heads % tp_size:
        raise SglxError(f"{what}: the model's {config.num_heads} attention heads do not split over {tp_size} "
                        f"ranks; use a tp size that divides {config.num_heads}")
    kv = config.num_kv_heads
    if kv % tp_size and tp_size % kv:
        raise SglxError(f"{what}: {kv} KV heads can be neither split over nor replicated on {tp_size} ranks; "
                        f"use a tp size that divides {kv} or a multiple of it that divides {config.num_heads}")
    if config.intermediate_size % tp_size:
        raise SglxError(f"{what}: the MLP's {config.intermediate_size} features do not split over {tp_size} "
                        "ranks; use a tp size that divides them")


def padded_vocab(vocab_size: int, tp_size: int) -> int:
    """The vocabulary rounded up to a multiple of the tp size (the pad rows are zero and never win)."""
    return -(-vocab_size // tp_size) * tp_size


class ColumnParallelLinear(nn.Linear):
    """y = x W^T with W's output rows split across ranks; `parts` are the logical blocks fused into W
    (q, k, v or gate, up), each given as (full size, (start, length) kept by this rank)."""

    def __init__(self, in_features: int, parts: Sequence[tuple[int, tuple[int, int]]], bias: bool,
                 tp: TensorParallel) -> None:
        self.parts = [tuple(p) for p in parts]
        super().__init__(in_features, sum(length for _, (_, length) in self.parts), bias=bias)
        self.tp = tp

    @classmethod
    def even(cls, in_features: int, part_sizes: Sequence[int], bias: bool, tp: TensorParallel
             ) -> ColumnParallelLinear:
        """Every part split evenly over the ranks."""
        return cls(in_features, [(n, tp.split(n)) for n in part_sizes], bias, tp)

    def local_sizes(self) -> list[int]:
        return [length for _, (_, length) in self.parts]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, skinny=False)

    def load_part(self, leaf: str, part: int, tensor: torch.Tensor) -> None:
        """Copy this rank's rows of part `part` of the full checkpoint tensor (weight or bias)."""
        full, (start, length) = self.parts[part]
        if tensor.shape[0] != full:
            raise ValueError(f"expected {full} rows, got {tuple(tensor.shape)}")
        offset = sum(self.local_sizes()[:part])
        dest = getattr(self, leaf).narrow(0, offset, length)
        with torch.no_grad():
            dest.copy_(tensor.narrow(0, start, length))


class RowParallelLinear(Linear):
    """y = sum over ranks of x_r W_r^T (+ bias once): W's input columns split, outputs all-reduced."""

    def __init__(self, full_in_features: int, out_features: int, bias: bool, tp: TensorParallel, *,
                 skinny: bool = False) -> None:
        start, length = tp.split(full_in_features)
        super().__init__(length, out_features, bias=bias, skinny=skinny)
        self.tp = tp
        self.in_slice = (start, length)
        self.full_in_features = full_in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp.rank == 0 else None  # added by one rank only, so the sum holds it once
        return self.tp.all_reduce(linear(x, self.weight, bias, self.skinny))

    def load_part(self, leaf: str, part: int, tensor: torch.Tensor) -> None:
        with torch.no_grad():
            if leaf == "bias":
                self.bias.copy_(tensor)
            else:
                if tensor.shape[1] != self.full_in_features:
                    raise ValueError(f"expected {self.full_in_features} columns, got {tuple(tensor.shape)}")
                self.weight.copy_(tensor.narrow(1, *self.in_slice))


class VocabParallelEmbedding(nn.Embedding):
    """Each rank holds a contiguous block of the (padded) vocabulary; lookups outside it give zero rows and
    an all-reduce adds the owning rank's row. Also the LM head's weight layout (see `lm_logits`)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        start, length = tp.split(padded_vocab(vocab_size, tp.size))
        super().__init__(length, hidden_size)
        self.tp = tp
        self.vocab_size = vocab_size
        self.vocab_start = start
        self.vocab_rows = max(0, min(length, vocab_size - start))  # real (not pad) rows held here

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)

    def load_part(self, leaf: str, part: int, tensor: torch.Tensor) -> None:
        if tensor.shape[0] != self.vocab_size:
            raise ValueError(f"expected {self.vocab_size} rows, got {tuple(tensor.shape)}")
        with torch.no_grad():
            self.weight.zero_()
            self.weight.narrow(0, 0, self.vocab_rows).copy_(tensor.narrow(0, self.vocab_start, self.vocab_rows))


class ParallelLMHead(VocabParallelEmbedding):
    """The untied LM head: same vocabulary split as the embedding; logits come from `lm_logits`."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # pragma: no cover - use lm_logits
        raise RuntimeError("ParallelLMHead is applied through lm_logits(hidden, head.weight, tp, vocab_size)")


def lm_logits(hidden: torch.Tensor, weight: torch.Tensor, tp: TensorParallel, vocab_size: int) -> torch.Tensor:
    """Full-vocabulary logits [T, vocab] on every rank: each rank's vocab block, gathered in rank order."""
    local = linear(hidden, weight)
    if tp.size == 1:
        return local
    return tp.all_gather(local, dim=-1)[..., :vocab_size]
