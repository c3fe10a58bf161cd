"""flashinfer MLA: FlashInfer's paged MLA kernel (`flashinfer.mla.BatchMLAPagedAttentionWrapper`) over the latent pool.

The absorbed form for every phase, as SGLang's FlashInfer MLA backend runs it: q_nope W_UK and q_pe against
the cached [c_kv, k_pe] rows, c_kv as the value, W_UV after; extend steps plan the same wrapper causally
(FlashInfer aligns a request's queries with the END of its keys, so new tokens see the cached prefix).
FlashInfer MLA pages one token per page, so a pool slot is a page and `req_to_token` slots are its page
indices; the pool's [slots, 1, 576] buffer is viewed as ckv [pages, 1, 512] and kpe [pages, 1, 64]
(no copy). One plan per step, made at the first layer (every layer shares heads, dims and scale).

CUDA graphs (decode): one wrapper per captured batch size on static index buffers (`use_cuda_graph=True`),
as SGLang does. FlashInfer's plan is host work (it schedules the split-KV work from the host-side
lengths) and cannot be captured, so the replay hook plans each step before the graph replays: it builds
the slot list on the device (one launch), hands FlashInfer host-side lengths (no device-to-host sync),
and the captured kernels read the new schedule from the wrapper's workspace.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglx.attention.kernels.kv_indices import build_kv_metadata
from sglx.attention.llm.base import BackendContext
from sglx.attention.llm.mla_base import MLAAttentionBackend, MLALayerSpec, MLAProjections, absorb_q, apply_uv
from sglx.attention.llm.plan_fence import PlanFence
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
    wrapper: object  # the BatchMLAPagedAttentionWrapper this step runs on
    planned: tuple | None = None  # (heads, ckv, kpe, scale, dtype) the wrapper was planned for


@dataclass
class _GraphState:
    """Static buffers of the captured decode graphs (one wrapper per batch size, one shared workspace)."""

    qo_indptr: torch.Tensor  # [max_bs + 1] int32, 0..max_bs (one query per request)
    kv_indptr: torch.Tensor  # [max_bs + 1] int32 (the wrappers' buffer)
    kv_indices: torch.Tensor  # [max_bs * max_context] int32 (the wrappers' buffer)
    kv_lens: torch.Tensor  # [max_bs] int32 (the wrappers' buffer)
    scratch_indptr: torch.Tensor  # where each step's slot list is built before plan() copies it in
    scratch_indices: torch.Tensor
    wrappers: dict[int, object]
    plans: dict[int, _Plan]
    key: tuple | None = None  # the layer key the graphs were planned for (set by the warm-up before capture)


class FlashInferMLABackend(MLAAttentionBackend):
    name = "flashinfer"
    supports_cuda_graph = True

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        if ctx.page_size != 1:
            raise BackendUnavailableError(f"FlashInfer MLA needs --page-size 1, got {ctx.page_size}")
        from flashinfer.mla import BatchMLAPagedAttentionWrapper

        self._wrapper_class = BatchMLAPagedAttentionWrapper
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=ctx.device)
        self.wrapper = BatchMLAPagedAttentionWrapper(self.workspace)
        self.plan_fence = PlanFence(ctx.device)  # plans reuse a pinned buffer: safe under overlap scheduling
        self.plan: _Plan | None = None
        self.graph: _GraphState | None = None

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
            wrapper=self.wrapper,
        )

    def _ensure_planned(self, layer: MLALayerSpec, dtype: torch.dtype, kv_dtype: torch.dtype) -> _Plan:
        plan = self.plan
        assert plan is not None, "init_forward_metadata(batch) must run first"
        key = (layer.num_heads, layer.kv_lora_rank, layer.qk_rope_head_dim, layer.scaling, dtype, kv_dtype)
        if plan.planned != key:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("FlashInfer MLA cannot plan inside a CUDA-graph capture: the warm-up plans first")
            self._run_plan(plan, key)
            if self.graph is not None and plan.wrapper is not self.wrapper:  # a graph bucket's warm-up
                self.graph.key = key
        return plan

    def _run_plan(self, plan: _Plan, key: tuple) -> None:
        heads, ckv, kpe, scale, dtype, kv_dtype = key
        self.plan_fence.before()  # the previous step's staged copy out of the shared pinned buffer must be done
        plan.wrapper.plan(plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.kv_lens, heads, ckv, kpe, 1,  # type: ignore[attr-defined]
                          plan.causal, scale, dtype, kv_dtype)
        plan.planned = key
        self.plan_fence.after()

    # ------------------------------------------------------------------ CUDA graphs (decode only)
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        device = self.ctx.device
        max_context = self.ctx.req_to_token_pool.max_context_len

        def ints(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int32, device=device)

        self.graph = _GraphState(
            qo_indptr=torch.arange(max_bs + 1, dtype=torch.int32, device=device), kv_indptr=ints(max_bs + 1),
            kv_indices=ints(max_bs * max_context), kv_lens=ints(max_bs), scratch_indptr=ints(max_bs + 1),
            scratch_indices=ints(max_bs * max_context), wrappers={}, plans={})

    def _graph_plan(self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                    seq_lens_cpu: list[int]) -> _Plan:
        """The bucket's plan inputs for this step: slots built on the device, lengths from the host."""
        g = self.graph
        assert g is not None, "init_cuda_graph_state must run first"
        build_kv_metadata(self.ctx.req_to_token_pool.req_to_token, req_pool_indices, seq_lens,
                          g.scratch_indptr[:bs + 1], g.scratch_indices)
        indptr = [0]
        for n in seq_lens_cpu:
            indptr.append(indptr[-1] + n)
        plan = g.plans[bs]
        plan.qo_indptr = torch.arange(bs + 1, dtype=torch.int32)
        plan.kv_indptr = torch.tensor(indptr, dtype=torch.int32)
        plan.kv_lens = torch.tensor(seq_lens_cpu, dtype=torch.int32)
        plan.kv_indices = g.scratch_indices[:indptr[-1]]
        plan.planned = None
        return plan

    def init_forward_metadata_capture_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                                 seq_lens: torch.Tensor) -> None:
        g = self.graph
        assert g is not None, "init_cuda_graph_state must run first"
        wrapper = self._wrapper_class(self.workspace, use_cuda_graph=True, qo_indptr=g.qo_indptr[:bs + 1],
                                      kv_indptr=g.kv_indptr[:bs + 1], kv_indices=g.kv_indices,
                                      kv_len_arr=g.kv_lens[:bs])
        g.wrappers[bs] = wrapper
        empty = torch.zeros(0, dtype=torch.int32)
        g.plans[bs] = _Plan(empty, empty, empty, empty, causal=False, wrapper=wrapper)
        fill = self.get_cuda_graph_seq_len_fill_value()
        self.plan = self._graph_plan(bs, req_pool_indices, seq_lens, [fill] * bs)  # the warm-up plans it

    def init_forward_metadata_replay_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                                seq_lens: torch.Tensor, seq_lens_cpu: list[int]) -> None:
        g = self.graph
        assert g is not None and bs in g.plans and g.key is not None, f"no graph was captured for batch size {bs}"
        plan = self._graph_plan(bs, req_pool_indices, seq_lens, seq_lens_cpu)
        self._run_plan(plan, g.key)
        self.plan = plan

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1  # a padded request attends to one key: slot 0 of the padding page

    def _attend(self, q_nope: torch.Tensor, q_pe: torch.Tensor, layer: MLALayerSpec, proj: MLAProjections,
                batch: ForwardBatch) -> torch.Tensor:
        buf = batch.token_kv_pool.kv_buffer[layer.layer_id]  # type: ignore[union-attr]  # [slots, 1, R + DR]
        q_abs = absorb_q(q_nope, proj, kernel=True).contiguous()
        plan = self._ensure_planned(layer, q_abs.dtype, buf.dtype)
        o_latent = plan.wrapper.run(q_abs, q_pe.contiguous(), buf[..., :layer.kv_lora_rank],  # type: ignore[attr-defined]
                                    buf[..., layer.kv_lora_rank:])
        return apply_uv(o_latent, proj, o_latent.new_empty((o_latent.shape[0], layer.num_heads, layer.v_head_dim)),
                        kernel=True)

    def forward_mla_extend(self, q_nope: torch.Tensor, q_pe: torch.Tensor, layer: MLALayerSpec,
                           proj: MLAProjections, batch: ForwardBatch) -> torch.Tensor:
        return self._attend(q_nope, q_pe, layer, proj, batch)

    def forward_mla_decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, layer: MLALayerSpec,
                           proj: MLAProjections, batch: ForwardBatch) -> torch.Tensor:
        return self._attend(q_nope, q_pe, layer, proj, batch)
