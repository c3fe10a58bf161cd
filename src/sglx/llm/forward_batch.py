"""One model step's inputs, shared by the model and the attention backend of every layer."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sglx.attention.llm.base import AttentionBackend
    from sglx.llm.kv_cache import ReqToTokenPool, TokenKVPool
    from sglx.llm.mla_kv_cache import MLATokenKVPool


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill, possibly on top of a cached prefix
    DECODE = "decode"  # one new token per request
    MIXED = "mixed"  # extends and decodes in one step; backends treat decodes as extends of length 1
    IDLE = "idle"

    @property
    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE

    @property
    def is_extend(self) -> bool:
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED)


@dataclass
class ForwardBatch:
    """Tensors the backends read; `seq_lens` count every token of a request after this step.

    For EXTEND/MIXED, request i contributes `extend_seq_lens[i]` new tokens placed after
    `extend_prefix_lens[i]` tokens already in the KV cache; for DECODE it contributes one token.
    The `*_cpu` lists mirror the tensors so metadata can be planned without device syncs.
    """

    mode: ForwardMode
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    req_pool_indices: torch.Tensor  # [bs] rows of req_to_token
    seq_lens: torch.Tensor  # [bs]
    out_cache_loc: torch.Tensor  # [num_tokens] KV slots where this step's K/V are written
    req_to_token_pool: ReqToTokenPool
    token_kv_pool: TokenKVPool | MLATokenKVPool  # per-head K/V, or one latent per token for MLA models
    attn_backend: AttentionBackend | None = None
    seq_lens_cpu: list[int] = field(default_factory=list)
    extend_seq_lens_cpu: list[int] = field(default_factory=list)
    extend_prefix_lens_cpu: list[int] = field(default_factory=list)
    return_all_logits: bool = False  # logits for every token (parity tests) instead of each request's last
    # a prefill graph's static index of the one real request's last token (its padding request gets no logits)
    last_token_index: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if not self.seq_lens_cpu:
            self.seq_lens_cpu = [int(x) for x in self.seq_lens.tolist()]
        if self.mode.is_extend and not self.extend_seq_lens_cpu:
            raise ValueError("an EXTEND/MIXED batch needs extend_seq_lens_cpu")
        if self.mode.is_extend and not self.extend_prefix_lens_cpu:
            self.extend_prefix_lens_cpu = [s - e for s, e in zip(self.seq_lens_cpu, self.extend_seq_lens_cpu)]

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def last_token_indices(self) -> torch.Tensor:
        """Index (into this step's tokens) of each request's last token: where its next-token logits come from."""
        if self.last_token_index is not None:
            return self.last_token_index
        if self.mode.is_decode:
            return torch.arange(self.batch_size, device=self.input_ids.device)
        # non_blocking: a blocking host-to-device copy would wait for the device (overlap scheduling)
        ends = torch.tensor(self.extend_seq_lens_cpu).to(self.input_ids.device, non_blocking=True).cumsum(0)
        return ends - 1
