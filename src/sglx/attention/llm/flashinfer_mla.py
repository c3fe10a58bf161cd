"""flashinfer MLA: FlashInfer's paged MLA kernel (`flashinfer.mla.BatchMLAPagedAttentionWrapper`) over the latent pool.

The absorbed form for every phase, as SGLang's FlashInfer MLA backend runs it: q_nope W_UK and q_pe against
the cached [c_kv, k_pe] rows, c_kv as the value, W_UV after; extend steps plan the same wrapper causally
(FlashInfer aligns a request's queries with the END of its keys, so new tokens see the cached prefix).
FlashInfer MLA pages one token per page, so a pool slot is a page and `req_to_token` slots are its page
indices; the pool's [slots, 1, 576] buffer is viewed as ckv [pages, 1, 512] and kpe [pages, 1, 64]
(no copy). One plan per step, made at the first layer (every layer shares heads, dims and scale).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglx.attention.llm.base import BackendContext
from sglx.attention.llm.mla_base import MLAAttentionBackend, MLALayerSpec, MLAProjections, absorb_q, apply_uv
from sglx.attention.llm.torch_native import gather_kv_indices
from sglx.errors import BackendUnavailableError
from sglx.llm.forward_batch import ForwardBatch

WORKSPACE_BYTES = 128 << 20  # FlashInfer's float workspace (its examples' size)


@dataclass
class _Plan:
    qo_indptr: torch.Tensor  # [bs + 1] int32
    kv_indptr: torch.Tensor  # [bs + 1] int32
    kv_indices: torch.Tensor  # slots = pages (page size 1), int32
    kv_lens: torch.Tensor  # [bs] int32
    causal: bool
    planned: tuple | None = None  # (heads, ckv, kpe, scale, dtype) the wrapper was planned for


class FlashInferMLABackend(MLAAttentionBackend):
    name = "flashinfer"
    supports_cuda_graph = False

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        if ctx.page_size != 1:
            raise BackendUnavailableError(f"FlashInfer MLA needs --page-size 1, got {ctx.page_size}")
        from flashinfer.mla import BatchMLAPagedAttentionWrapper

        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=ctx.device)
        self.wrapper = BatchMLAPagedAttentionWrapper(self.workspace)
        self.plan: _Plan | None = None

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        device = self.ctx.device
        indptr, indices = gather_kv_indices(batch)
        lens = batch.seq_lens_cpu
        q_lens = [1] * batch.batch_size if batch.mode.is_decode else batch.extend_seq_lens_cpu
        qo = [0]
        for n in q_lens:
            qo.append(qo[-1] + n)
        self.plan = _Plan(
            qo_indptr=torch.tensor(qo, dtype=torch.int32, device=device),
            kv_indptr=torch.tensor(indptr, dtype=torch.int32, device=device),
            kv_indices=indices.to(device=device, dtype=torch.int32),
            kv_lens=torch.tensor(lens, dtype=torch.int32, device=device),
            causal=not batch.mode.is_decode,
        )

    def _ensure_planned(self, layer: MLALayerSpec, dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
        plan = self.plan
        assert plan is not None, "init_forward_metadata(batch) must run first"
        key = (layer.num_heads, layer.kv_lora_rank, layer.qk_rope_head_dim, layer.scaling, dtype, kv_dtype)
        if plan.planned != key:
            self.wrapper.plan(plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.kv_lens, layer.num_heads,
                              layer.kv_lora_rank, layer.qk_rope_head_dim, 1, plan.causal, layer.scaling, dtype,
                              kv_dtype)
            plan.planned = key

    def _attend(self, q_nope: torch.Tensor, q_pe: torch.Tensor, layer: MLALayerSpec, proj: MLAProjections,
                batch: ForwardBatch) -> torch.Tensor:
        buf = batch.token_kv_pool.kv_buffer[layer.layer_id]  # type: ignore[union-attr]  # [slots, 1, R + DR]
        q_abs = absorb_q(q_nope, proj).contiguous()
        self._ensure_planned(layer, q_abs.dtype, buf.dtype)
        o_latent = self.wrapper.run(q_abs, q_pe.contiguous(), buf[..., :layer.kv_lora_rank],
                                    buf[..., layer.kv_lora_rank:])
        return apply_uv(o_latent, proj)

    def forward_mla_extend(self, q_nope: torch.Tensor, q_pe: torch.Tensor, layer: MLALayerSpec,
                           proj: MLAProjections, batch: ForwardBatch) -> torch.Tensor:
        return self._attend(q_nope, q_pe, layer, proj, batch)

    def forward_mla_decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, layer: MLALayerSpec,
                           proj: MLAProjections, batch: ForwardBatch) -> torch.Tensor:
        return self._attend(q_nope, q_pe, layer, proj, batch)
