"""fa4 MLA: FlashAttention 4 (`flash_attn.cute.flash_attn_varlen_func`) over the latent pool (DeepSeek-V2/V3).

Prefill / extend (SM90 and SM100) takes the non-absorbed form, as SGLang's FlashAttention MLA prefill does:
each request's latents, cached prefix and new tokens alike, are read from the pool in position order and
expanded per head to K = [c W_UK^T, k_pe] (dn + dr wide: 192 for DeepSeek) and V = c W_UV^T (dv: 128);
one ragged call per group of requests attends the step's queries over them (`cu_seqlens_q` /
`cu_seqlens_k`, causal with queries aligned to the END of their keys, so new tokens see the prefix).
Requests are taken in groups whose expansion stays under `max_expanded_bytes`, as triton MLA does.

Decode (SM100) takes the absorbed form FA4's MLA kernels implement,
O = softmax(scale * (q_pe k_pe^T + (q_nope W_UK) c^T)) c, then O W_UV^T: `q` = q_pe, `qv` = q_nope W_UK,
and the pool's [slots, 1, 576] rows viewed as pages, k = k_pe (the last 64) and v = c_kv (the first 512),
read through the page table at any page size (TMA at 128, cp.async otherwise). flash-attn-4 4.0.0b36
asserts Blackwell for `qv`, so on Hopper this backend serves prefill only (`decode_requires` in the
registry refuses it for decode before weights load). Decode runs `num_splits=1`: the split heuristic's
scratch is sized per call, which was never verified under graph capture. Decode CUDA graphs refill the
page table and lengths inside the graph, as the MHA fa backends do (`fa_paged.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import torch

from sglx.attention.llm.base import BackendContext
from sglx.attention.llm.fa_metadata import cu_seqlens
from sglx.attention.llm.fa_paged import MAX_HEAD_DIM, PagedFlashBackend, first_tensor
from sglx.attention.llm.mla_base import (
    MLAAttentionBackend,
    MLALayerSpec,
    MLAProjections,
    absorb_q,
    apply_uv,
    expand_latent,
    expanded_key_bytes,
    expansion_groups,
)
from sglx.attention.llm.torch_native import gather_kv_indices
from sglx.attention.optional_kernels import load_kernel
from sglx.errors import BackendUnavailableError
from sglx.llm.forward_batch import ForwardBatch

ABSORBED_LATENT = (512, 64)  # (kv_lora_rank, qk_rope_head_dim): the only latent FA4's MLA kernels take


def absorbed_decode_here(device: torch.device) -> bool:
    """Whether FA4's absorbed MLA kernels run on this device (4.0.0b36: SM100 / SM110, Blackwell)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] in (10, 11)


@dataclass
class _ExtendPlan:
    """One extend step's keys: every request's pool slots in position order, and its query / key offsets."""

    q_indptr: list[int]
    kv_indptr: list[int]
    kv_slots: torch.Tensor  # [sum(seq_lens)] int64, on the device
    seq_lens: list[int]
    q_lens: list[int]
    groups: dict[int, list[tuple[range, torch.Tensor, torch.Tensor]]] = field(default_factory=dict)


class FA4MLABackend(MLAAttentionBackend, PagedFlashBackend):
    """MLA entry points from MLAAttentionBackend; kernel loading, page-table metadata and decode graph hooks from
    PagedFlashBackend (the MHA fa backends' base), whose MHA entry points MLAAttentionBackend refuses."""

    name = "fa4"
    supports_cuda_graph = True
    instead = "--attention-backend triton"
    max_expanded_bytes = 1 << 30  # per-head K/V expanded at once (more requests: more calls)

    def __init__(self, ctx: BackendContext, kernel: Any = None, absorbed_decode: bool | None = None) -> None:
        super().__init__(ctx, kernel)
        self.absorbed_decode = absorbed_decode_here(ctx.device) if absorbed_decode is None else absorbed_decode
        self.extend_plan: _ExtendPlan | None = None

    # ------------------------------------------------------------------ construction checks
    def _check_context(self, ctx: BackendContext) -> None:
        pool = ctx.token_kv_pool
        self._check_gpu_and_dtype(ctx)
        if getattr(pool, "fp8_dtype", None) is not None:
            raise self._fail(f"reads latents in the model dtype, and --kv-cache-dtype is {pool.kv_cache_dtype}")

    def _load_kernel(self) -> Any:
        return load_kernel("flash_attn.cute", "flash_attn_varlen_func", "fa4", self.instead)

    # ------------------------------------------------------------------ metadata
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if batch.mode.is_decode:
            self.extend_plan = None
            super().init_forward_metadata(batch)  # the page table and lengths (fa_metadata.py)
            return
        kv_indptr, kv_slots = gather_kv_indices(batch)
        q_lens = list(batch.extend_seq_lens_cpu)
        q_indptr = list(accumulate(q_lens, initial=0))
        self.extend_plan = _ExtendPlan(q_indptr, kv_indptr, kv_slots.to(self.ctx.device), list(batch.seq_lens_cpu),
                                       q_lens)

    def _groups(self, plan: _ExtendPlan, layer: MLALayerSpec, elem: int
                ) -> list[tuple[range, torch.Tensor, torch.Tensor]]:
        """The step's request groups with their cu_seqlens_q / cu_seqlens_k (built once a step: every layer has the
        same heads and dims)."""
        per_key = expanded_key_bytes(layer, elem)
        if per_key not in plan.groups:
            device = self.ctx.device
            plan.groups[per_key] = [
                (g, cu_seqlens(plan.q_lens[g.start:g.stop], device), cu_seqlens(plan.seq_lens[g.start:g.stop], device))
                for g in expansion_groups(plan.seq_lens, layer, elem, self.max_expanded_bytes)]
        return plan.groups[per_key]

    # ------------------------------------------------------------------ attention
    def forward_mla_extend(self, q_nope: torch.Tensor, q_pe: torch.Tensor, layer: MLALayerSpec,
                           proj: MLAProjections, batch: ForwardBatch) -> torch.Tensor:
        plan = self.extend_plan
        assert plan is not None, "init_forward_metadata(batch) must run first"
        qk_dim = layer.qk_nope_head_dim + layer.qk_rope_head_dim
        if qk_dim > MAX_HEAD_DIM or qk_dim % 8 or layer.v_head_dim % 8:
            raise self._fail(f"takes head dims up to {MAX_HEAD_DIM} in multiples of 8, and this MLA model's "
                             f"query/key head dim is {qk_dim} with value head dim {layer.v_head_dim}")
        q = torch.cat([q_nope, q_pe], dim=-1)  # [T, H, dn + dr], contiguous
        out = q.new_empty((q.shape[0], layer.num_heads, layer.v_head_dim))
        pool = batch.token_kv_pool
        for group, cu_q, cu_k in self._groups(plan, layer, q.element_size()):
            q_lo, q_hi = plan.q_indptr[group.start], plan.q_indptr[group.stop]
            if q_hi == q_lo:
                continue
            slots = plan.kv_slots[plan.kv_indptr[group.start]:plan.kv_indptr[group.stop]]
            latent = pool.get_latent(layer.layer_id, slots, q.dtype)  # type: ignore[union-attr]
            keys, values = expand_latent(latent, proj, layer)
            res = self.kernel(q[q_lo:q_hi], keys.contiguous(), values.contiguous(), cu_seqlens_q=cu_q,
                              cu_seqlens_k=cu_k, max_seqlen_q=max(plan.q_lens[group.start:group.stop]),
                              max_seqlen_k=max(plan.seq_lens[group.start:group.stop]), softmax_scale=layer.scaling,
                              causal=True)
            out[q_lo:q_hi] = first_tensor(res)
        return out

    def forward_mla_decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, layer: MLALayerSpec,
                           proj: MLAProjections, batch: ForwardBatch) -> torch.Tensor:
        if not self.absorbed_decode:
            raise BackendUnavailableError(
                "attention backend fa4 (MLA): its decode needs flash-attn-4's absorbed MLA kernels, which run on "
                "Blackwell (SM100) only; use --prefill-attention-backend fa4 --decode-attention-backend triton")
        if (layer.kv_lora_rank, layer.qk_rope_head_dim) != ABSORBED_LATENT:
            raise self._fail(f"decodes latents of {ABSORBED_LATENT[0]} + {ABSORBED_LATENT[1]} only, and this "
                             f"model's are {layer.kv_lora_rank} + {layer.qk_rope_head_dim}",
                             "--decode-attention-backend triton")
        meta = self.meta
        assert meta is not None, "init_forward_metadata(batch) must run first"
        bs, heads, r = q_nope.shape[0], layer.num_heads, layer.kv_lora_rank
        rows = batch.token_kv_pool.kv_buffer[layer.layer_id]  # type: ignore[union-attr]  # [slots, 1, r + dr]
        pages = rows.view(-1, self.ctx.page_size, 1, rows.shape[-1])  # no copy
        q_abs = absorb_q(q_nope, proj, kernel=True)  # [bs, H, r]
        res = self.kernel(q_pe.reshape(bs, 1, heads, layer.qk_rope_head_dim).contiguous(), pages[..., r:],
                          pages[..., :r], qv=q_abs.reshape(bs, 1, heads, r).contiguous(), seqused_k=meta.seq_lens,
                          page_table=meta.page_table, softmax_scale=layer.scaling, causal=True, num_splits=1)
        o_latent = first_tensor(res).view(bs, heads, r)
        return apply_uv(o_latent, proj, o_latent.new_empty((bs, heads, layer.v_head_dim)), kernel=True)
