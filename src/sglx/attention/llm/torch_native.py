"""torch_native: the reference paged backend, PyTorch SDPA over K/V gathered through `req_to_token`.

Correct for any page size, sliding window, logit soft-cap and fp8 KV on every device; prefix tokens
are read from the cache, never recomputed. Not tuned for speed and not CUDA-graph capturable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from sglx.attention.llm.base import AttentionBackend, LayerSpec
from sglx.llm.forward_batch import ForwardBatch


@dataclass
class _Metadata:
    kv_indptr: list[int]
    kv_indices: torch.Tensor  # [sum(seq_lens)] slots, request after request
    qo_indptr: list[int]
    prefix_lens: list[int]
    decode_slots: torch.Tensor | None = None  # [bs, max_len], padded with slot 0
    decode_valid: torch.Tensor | None = None  # [bs, max_len] bool
    decode_key_pos: torch.Tensor | None = None  # [1, max_len]


def gather_kv_indices(batch: ForwardBatch) -> tuple[list[int], torch.Tensor]:
    """CSR (indptr, indices) of every request's KV slots, read from req_to_token."""
    rows = batch.req_pool_indices.tolist()
    table = batch.req_to_token_pool.req_to_token
    indptr = [0]
    parts = []
    for row, length in zip(rows, batch.seq_lens_cpu):
        parts.append(table[row, :length])
        indptr.append(indptr[-1] + length)
    indices = torch.cat(parts).long() if parts else torch.zeros(0, dtype=torch.long, device=table.device)
    return indptr, indices


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, layer: LayerSpec) -> torch.Tensor:
    """q [..., Hq, Lq, D], k/v [..., Hkv, Lk, D], mask broadcastable to [..., Hq, Lq, Lk] (True = attend)."""
    group = layer.num_q_heads // layer.num_kv_heads
    if group > 1:
        k = k.repeat_interleave(group, dim=-3)
        v = v.repeat_interleave(group, dim=-3)
    if layer.logit_cap > 0:
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * layer.scaling
        scores = layer.logit_cap * torch.tanh(scores / layer.logit_cap)
        scores = scores.masked_fill(~mask, float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype)
    # cuDNN re-plans for every new sequence length (100+ ms per decode step on an 8B model): keep it out.
    with sdpa_kernel(_SDPA_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=layer.scaling)


def step_metadata(batch: ForwardBatch) -> _Metadata:
    """Key slots and query ranges of one step, and for decode the padded per-request slot table.

    Shared by the MHA and MLA torch_native backends (MLA reads latents at the same slots).
    """
    indptr, indices = gather_kv_indices(batch)
    if batch.mode.is_decode:
        qo_indptr = list(range(batch.batch_size + 1))
        prefix = [s - 1 for s in batch.seq_lens_cpu]
    else:
        qo_indptr = [0]
        for n in batch.extend_seq_lens_cpu:
            qo_indptr.append(qo_indptr[-1] + n)
        prefix = list(batch.extend_prefix_lens_cpu)
    meta = _Metadata(indptr, indices, qo_indptr, prefix)
    if batch.mode.is_decode and batch.batch_size:
        device = indices.device
        max_len = max(batch.seq_lens_cpu)
        lens = torch.tensor(batch.seq_lens_cpu, device=device)
        pos = torch.arange(max_len, device=device)[None, :]
        valid = pos < lens[:, None]
        slots = torch.zeros((batch.batch_size, max_len), dtype=torch.long, device=device)
        slots[valid] = indices
        meta.decode_slots, meta.decode_valid, meta.decode_key_pos = slots, valid, pos
    return meta


_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class TorchNativeBackend(AttentionBackend):
    name = "torch_native"
    supports_cuda_graph = False
    kv_scales_per_token = True
    kv_dtype_per_layer = True  # reads through TokenKVPool.get_kv, which decodes each layer in its own dtype

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self.meta = step_metadata(batch)

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: LayerSpec,
                       batch: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor:
        if save_kv_cache:
            self.save_kv(k, v, layer, batch)
        meta = self.meta
        pool = batch.token_kv_pool
        out = torch.empty_like(q)
        for i in range(batch.batch_size):
            q_lo, q_hi = meta.qo_indptr[i], meta.qo_indptr[i + 1]
            if q_hi == q_lo:
                continue
            slots = meta.kv_indices[meta.kv_indptr[i]:meta.kv_indptr[i + 1]]
            keys, values = pool.get_kv(layer.layer_id, slots, q.dtype)
            q_pos = torch.arange(q_hi - q_lo, device=q.device) + meta.prefix_lens[i]
            k_pos = torch.arange(slots.numel(), device=q.device)
            mask = k_pos[None, :] <= q_pos[:, None]
            if layer.sliding_window:
                mask &= k_pos[None, :] > q_pos[:, None] - layer.sliding_window
            o = attend(q[q_lo:q_hi].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), mask, layer)
            out[q_lo:q_hi] = o.transpose(0, 1)
        return out

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: LayerSpec,
                       batch: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor:
        if save_kv_cache:
            self.save_kv(k, v, layer, batch)
        meta = self.meta
        assert meta.decode_slots is not None and meta.decode_valid is not None and meta.decode_key_pos is not None
        bs, max_len = meta.decode_slots.shape
        keys, values = batch.token_kv_pool.get_kv(layer.layer_id, meta.decode_slots.reshape(-1), q.dtype)
        keys = keys.view(bs, max_len, layer.num_kv_heads, -1).transpose(1, 2)
        values = values.view(bs, max_len, layer.num_kv_heads, -1).transpose(1, 2)
        mask = meta.decode_valid
        if layer.sliding_window:
            last = torch.tensor(batch.seq_lens_cpu, device=q.device)[:, None] - 1
            mask = mask & (meta.decode_key_pos > last - layer.sliding_window)
        o = attend(q.unsqueeze(2), keys, values, mask[:, None, None, :], layer)  # [bs, Hq, 1, D]
        return o.squeeze(2)
