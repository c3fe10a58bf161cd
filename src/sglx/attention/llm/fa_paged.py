"""What fa3 and fa4 share: the paged-KV view of the pool, metadata, K/V stores and CUDA-graph hooks.

Both kernels attend over the cache only: a step first stores its K/V (Triton store, or the rotary
kernel with the store folded in), then one kernel call per layer reads prefix and new keys through
the page table (`fa_metadata.py`), causal with queries aligned to the end of each request's keys.
Subclasses load their kernel and make that one call (`_attend`); everything else lives here, so the
two backends cannot drift apart in how they address the pool.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from sglx.attention.llm.base import AttentionBackend, BackendContext, LayerSpec
from sglx.attention.llm.fa_metadata import FlashGraphState, FlashMetadata, build_flash_metadata
from sglx.attention.llm.kv_store import store_step_kv
from sglx.errors import BackendUnavailableError
from sglx.llm.forward_batch import ForwardBatch

KERNEL_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


class PagedFlashBackend(AttentionBackend):
    """Base of the FlashAttention backends; `_attend` is the kernel call, `_check_page_size` its page rule."""

    supports_cuda_graph = True
    lends_pool_slots = True
    instead: ClassVar[str] = "--attention-backend triton"  # what errors suggest in its place

    def __init__(self, ctx: BackendContext, kernel: Any = None) -> None:
        super().__init__(ctx)
        self._check_context(ctx)
        self.kernel = kernel if kernel is not None else self._load_kernel()
        self.meta: FlashMetadata | None = None
        self.graph: FlashGraphState | None = None

    # ------------------------------------------------------------------ construction checks
    def _fail(self, what: str, instead: str | None = None) -> BackendUnavailableError:
        return BackendUnavailableError(f"attention backend {self.name}: {what}; use {instead or self.instead}")

    def _check_gpu_and_dtype(self, ctx: BackendContext) -> None:
        """The FlashAttention kernels run on NVIDIA GPUs in float16 / bfloat16 only."""
        if ctx.device.type != "cuda":
            raise self._fail(f"runs on NVIDIA GPUs only, and the device is {ctx.device.type}")
        if ctx.dtype not in KERNEL_DTYPES:
            raise self._fail(f"takes float16 or bfloat16, and the model runs in {ctx.dtype} (--dtype bfloat16)")

    def _check_context(self, ctx: BackendContext) -> None:
        pool = ctx.token_kv_pool
        self._check_gpu_and_dtype(ctx)
        if getattr(pool, "is_fp8", False):
            raise self._fail(f"reads the KV cache in the model dtype, and --kv-cache-dtype is {pool.kv_cache_dtype}")
        if ctx.head_dim > MAX_HEAD_DIM or ctx.head_dim % 8 or pool.v_head_dim % 8:
            raise self._fail(f"takes head dims up to {MAX_HEAD_DIM} in multiples of 8, and this model has "
                             f"{ctx.head_dim}")
        self._check_page_size(ctx)

    def _check_page_size(self, ctx: BackendContext) -> None:
        """Raise when the kernel cannot read pages of ctx.page_size here (default: any size works)."""

    def _load_kernel(self) -> Any:
        raise NotImplementedError

    # ------------------------------------------------------------------ metadata
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self.meta = build_flash_metadata(batch, self.ctx.page_size, self.ctx.device)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.graph = FlashGraphState.allocate(max_bs, self.ctx.req_to_token_pool.max_context_len, self.ctx.page_size,
                                              self.ctx.device)

    def init_forward_metadata_capture_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                                 seq_lens: torch.Tensor) -> None:
        assert self.graph is not None, "init_cuda_graph_state must run first"
        self.meta = self.graph.capture(bs, req_pool_indices, seq_lens)

    def init_forward_metadata_in_graph(self, bs: int) -> None:
        """Page table and lengths from the graph's static inputs: captured, so each replay rebuilds them."""
        assert self.graph is not None and bs in self.graph.inputs, f"no graph metadata was set up for batch size {bs}"
        self.meta = self.graph.fill(bs, self.ctx.req_to_token_pool.req_to_token)

    def init_forward_metadata_replay_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                                seq_lens: torch.Tensor, seq_lens_cpu: list[int]) -> None:
        assert self.graph is not None and bs in self.graph.metas, f"no graph was captured for batch size {bs}"
        self.meta = self.graph.metas[bs]  # nothing to launch: the graph refills its buffers itself

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1  # a padded request attends to one key of the padding page

    # ------------------------------------------------------------------ K/V stores
    def _save(self, k: torch.Tensor, v: torch.Tensor, layer: LayerSpec, batch: ForwardBatch) -> None:
        store_step_kv(k, v, layer, batch)

    # ------------------------------------------------------------------ attention
    def paged_cache(self, layer: LayerSpec, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V buffers as [num_pages + 1, page_size, Hkv, D] views (no copy)."""
        pool = batch.token_kv_pool
        ps = self.ctx.page_size
        k = pool.k_buffer[layer.layer_id]
        v = pool.v_buffer[layer.layer_id]
        return k.view(-1, ps, *k.shape[1:]), v.view(-1, ps, *v.shape[1:])

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: LayerSpec,
                       batch: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor:
        if save_kv_cache:
            self._save(k, v, layer, batch)
        assert self.meta is not None and self.meta.cu_seqlens_q is not None, \
            "init_forward_metadata(batch) must run first"
        q = q.reshape(q.shape[0], layer.num_q_heads, layer.head_dim).contiguous()
        return self._attend(q, layer, batch, self.meta, decode=False)

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: LayerSpec,
                       batch: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor:
        if save_kv_cache:
            self._save(k, v, layer, batch)
        assert self.meta is not None, "init_forward_metadata(batch) must run first"
        q = q.reshape(q.shape[0], layer.num_q_heads, layer.head_dim).contiguous()
        return self._attend(q, layer, batch, self.meta, decode=True)

    def _attend(self, q: torch.Tensor, layer: LayerSpec, batch: ForwardBatch, meta: FlashMetadata,
                decode: bool) -> torch.Tensor:
        """q [T, Hq, D] (decode: T = bs) -> out [T, Hq, Dv] over the cache, causal, bottom-right aligned."""
        raise NotImplementedError


def first_tensor(result: Any) -> torch.Tensor:
    """Kernels return out or (out, lse, ...) depending on the build: the output either way."""
    return result[0] if isinstance(result, (tuple, list)) else result
