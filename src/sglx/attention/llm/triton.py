"""triton: sglx's own Triton kernels behind the paged backend contract; runs on any CUDA/ROCm GPU.

Per step it builds CSR `kv_indptr`/`kv_indices` on the device (one Triton launch) and sizes the
decode split scratch once; every layer reuses them. K/V of the step are stored by a Triton kernel
before attention, and attention reads every key from the pool, so results equal `torch_native`'s
(fp8 KV included). Decode is CUDA-graph capturable: the metadata lives in static buffers
(`_GraphState`) and its build (one kernel over the graph's static req_pool_indices/seq_lens) is
captured INTO the graph by `init_forward_metadata_in_graph`, so a replay only copies inputs and
launches; nothing here reads device values back to the host. fp8 pools with per-token scales
(`TokenKVPool.per_token_scales`): queries are rotated into the pool's key basis (one small matmul per
layer) and the kernels apply each key's scales in registers. A captured graph
fixes the decode grid, so its number of KV splits is chosen for the longest possible context; each
request still splits only its own length (short requests leave the extra programs idle).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglx.attention.kernels.common import interpreted, num_sms
from sglx.attention.kernels.decode_attention import (
    DecodeConfig,
    choose_num_kv_splits,
    decode_attention,
    semaphore_count,
)
from sglx.attention.kernels.extend_attention import ExtendConfig, extend_attention
from sglx.attention.kernels.kv_indices import build_kv_metadata
from sglx.attention.llm.base import AttentionBackend, BackendContext, LayerSpec
from sglx.attention.llm.kv_store import store_step_kv
from sglx.errors import BackendUnavailableError
from sglx.llm.forward_batch import ForwardBatch


@dataclass
class _Metadata:
    """One step's plan; under CUDA graphs its tensors are views of `_GraphState`'s static buffers."""

    kv_indptr: torch.Tensor  # [bs + 1] int32
    kv_indices: torch.Tensor  # [sum(seq_lens)] int32 slots
    qo_indptr: torch.Tensor | None = None  # extend: [bs + 1] int32
    max_extend_len: int = 0
    prefix_tokens: int = 0  # extend: cached keys of the whole batch (picks the kernel's tile shape)
    mid_o: torch.Tensor | None = None  # decode: [bs, Hq, splits, Dv] float32
    mid_lse: torch.Tensor | None = None  # decode: [bs, Hq, splits] float32
    semaphores: torch.Tensor | None = None  # decode: int32 zeros for the in-kernel split merge


@dataclass
class _GraphState:
    """Static decode metadata for every captured batch size: addresses a graph keeps between replays."""

    kv_indptr: torch.Tensor  # [max_bs + 1] int32
    kv_indices: torch.Tensor  # [max_bs * max_context] int32
    mid_o: torch.Tensor  # flat float32 scratch, viewed per bucket as [bs, Hq, splits, Dv]
    mid_lse: torch.Tensor  # flat float32 scratch, viewed per bucket as [bs, Hq, splits]
    semaphores: torch.Tensor  # int32 zeros for the in-kernel split merge (every launch leaves them zero)
    max_context: int
    metas: dict[int, _Metadata]
    inputs: dict[int, tuple[torch.Tensor, torch.Tensor]]  # bs -> the graph's static (req_pool_indices, seq_lens)


@dataclass
class _PrefillGraphState:
    """Static metadata of the prefill graphs (two requests: the real one, then padding); shared by buckets."""

    kv_indptr: torch.Tensor  # [3] int32
    kv_indices: torch.Tensor  # [max_context + max_tokens] int32
    metas: dict[int, _Metadata]  # bucket -> its metadata (views of the buffers above)
    inputs: tuple[torch.Tensor, torch.Tensor]  # the runner's static (req_pool_indices, seq_lens)


class TritonBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graph = True
    lends_pool_slots = True
    supports_prefill_cuda_graph = True
    kv_scales_per_token = True

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        self.interpret = interpreted()
        if ctx.device.type == "cpu" and not self.interpret:
            raise BackendUnavailableError(
                "attention backend triton was asked for on CPU: its kernels need a CUDA or ROCm GPU "
                "(or TRITON_INTERPRET=1 for testing); use --attention-backend torch_native on this machine"
            )
        self.decode_config = DecodeConfig()  # launch parameters; benchmarks may swap in others
        self.extend_config = ExtendConfig()
        self.v_head_dim = ctx.token_kv_pool.v_head_dim
        self.meta: _Metadata | None = None
        self.graph: _GraphState | None = None
        self.prefill_graph: _PrefillGraphState | None = None
        self._semaphores = torch.zeros(0, dtype=torch.int32, device=ctx.device)  # eager decode; grown on demand

    def _eager_semaphores(self, bs: int) -> torch.Tensor:
        need = semaphore_count(bs, self.ctx.num_q_heads, self.ctx.num_kv_heads)
        if self._semaphores.numel() < need:
            self._semaphores = torch.zeros(max(need, 2 * self._semaphores.numel()), dtype=torch.int32,
                                           device=self.ctx.device)
        return self._semaphores

    # ------------------------------------------------------------------ metadata
    def _indices(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.ctx.device
        bs = batch.batch_size
        kv_indptr = torch.empty(bs + 1, dtype=torch.int32, device=device)
        kv_indices = torch.empty(sum(batch.seq_lens_cpu), dtype=torch.int32, device=device)
        build_kv_metadata(batch.req_to_token_pool.req_to_token, batch.req_pool_indices.to(device),
                          batch.seq_lens.to(device), kv_indptr, kv_indices)
        return kv_indptr, kv_indices

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        kv_indptr, kv_indices = self._indices(batch)
        meta = _Metadata(kv_indptr, kv_indices)
        bs = batch.batch_size
        if batch.mode.is_decode:
            splits = self._graph_splits(bs, max(batch.seq_lens_cpu, default=0))  # the same policy as the graphs
            meta.mid_o = torch.empty((bs, self.ctx.num_q_heads, splits, self.v_head_dim), dtype=torch.float32,
                                     device=self.ctx.device)
            meta.mid_lse = torch.empty((bs, self.ctx.num_q_heads, splits), dtype=torch.float32,
                                       device=self.ctx.device)
            meta.semaphores = self._eager_semaphores(bs)
        else:
            lens = batch.extend_seq_lens_cpu
            indptr = [0]
            for n in lens:
                indptr.append(indptr[-1] + n)
            # non_blocking: a blocking host-to-device copy would make the host wait for the step in flight
            meta.qo_indptr = torch.tensor(indptr, dtype=torch.int32).to(self.ctx.device, non_blocking=True)
            meta.max_extend_len = max(lens, default=0)
            meta.prefix_tokens = sum(batch.extend_prefix_lens_cpu or [])
        self.meta = meta

    def _programs_per_split(self) -> int:
        """Decode stage-1 programs per request and KV split (one per KV head here): sizes the split count."""
        return self.ctx.num_kv_heads

    # ------------------------------------------------------------------ CUDA graphs (decode only)
    def _graph_splits(self, bs: int, max_context: int) -> int:
        return choose_num_kv_splits(bs, self._programs_per_split(), max_context, num_sms(self.ctx.device),
                                    self.decode_config)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        device = self.ctx.device
        max_context = self.ctx.req_to_token_pool.max_context_len
        rows = max(bs * self._graph_splits(bs, max_context) for bs in range(1, max_bs + 1))
        hq = self.ctx.num_q_heads
        self.graph = _GraphState(
            kv_indptr=torch.zeros(max_bs + 1, dtype=torch.int32, device=device),
            kv_indices=torch.zeros(max_bs * max_context, dtype=torch.int32, device=device),
            mid_o=torch.empty(rows * hq * self.v_head_dim, dtype=torch.float32, device=device),
            mid_lse=torch.empty(rows * hq, dtype=torch.float32, device=device),
            semaphores=torch.zeros(semaphore_count(max_bs, hq, self.ctx.num_kv_heads), dtype=torch.int32,
                                   device=device),
            max_context=max_context, metas={}, inputs={})

    def init_forward_metadata_capture_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                                 seq_lens: torch.Tensor) -> None:
        g = self.graph
        assert g is not None, "init_cuda_graph_state must run first"
        splits = self._graph_splits(bs, g.max_context)
        hq, dv = self.ctx.num_q_heads, self.v_head_dim
        meta = _Metadata(g.kv_indptr[:bs + 1], g.kv_indices,
                         mid_o=g.mid_o[:bs * hq * splits * dv].view(bs, hq, splits, dv),
                         mid_lse=g.mid_lse[:bs * hq * splits].view(bs, hq, splits), semaphores=g.semaphores)
        g.metas[bs] = meta
        g.inputs[bs] = (req_pool_indices, seq_lens)
        self.meta = meta

    def init_forward_metadata_in_graph(self, bs: int) -> None:
        """kv_indptr/kv_indices from the static inputs: captured into the graph, so every replay rebuilds them."""
        g = self.graph
        assert g is not None and bs in g.inputs, f"no graph metadata was set up for batch size {bs}"
        req_pool_indices, seq_lens = g.inputs[bs]
        build_kv_metadata(self.ctx.req_to_token_pool.req_to_token, req_pool_indices, seq_lens, g.kv_indptr[:bs + 1],
                          g.kv_indices)
        self.meta = g.metas[bs]

    def init_forward_metadata_replay_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                                seq_lens: torch.Tensor, seq_lens_cpu: list[int]) -> None:
        # nothing to launch: the graph rebuilds the indices from the buffers the runner just filled
        assert self.graph is not None and bs in self.graph.metas, f"no graph was captured for batch size {bs}"
        self.meta = self.graph.metas[bs]

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1  # a padded request attends to one key: slot 0 of the padding page

    # ------------------------------------------------------------------ CUDA graphs (short prefills)
    def init_prefill_graph_state(self, buckets: list[int], qo_indptr: torch.Tensor, req_pool_indices: torch.Tensor,
                                 seq_lens: torch.Tensor) -> None:
        max_context = self.ctx.req_to_token_pool.max_context_len
        kv_indptr = torch.zeros(3, dtype=torch.int32, device=self.ctx.device)
        kv_indices = torch.zeros(max_context + max(buckets), dtype=torch.int32, device=self.ctx.device)
        # max_extend_len = bucket: programs past a request's rows exit at once; prefix 0 picks the tile
        # shape measured best for mostly-new keys (a radix hit still runs correctly, with the other shape)
        metas = {b: _Metadata(kv_indptr, kv_indices, qo_indptr=qo_indptr, max_extend_len=b, prefix_tokens=0)
                 for b in buckets}
        self.prefill_graph = _PrefillGraphState(kv_indptr, kv_indices, metas, (req_pool_indices, seq_lens))

    def init_prefill_metadata_in_graph(self, bucket: int) -> None:
        g = self.prefill_graph
        assert g is not None and bucket in g.metas, f"no prefill graph for {bucket} tokens"
        build_kv_metadata(self.ctx.req_to_token_pool.req_to_token, *g.inputs, g.kv_indptr, g.kv_indices)
        self.meta = g.metas[bucket]

    def init_prefill_metadata_replay(self, bucket: int) -> None:
        g = self.prefill_graph
        assert g is not None and bucket in g.metas, f"no prefill graph for {bucket} tokens"
        self.meta = g.metas[bucket]

    # ------------------------------------------------------------------ attention
    def _save(self, k: torch.Tensor, v: torch.Tensor, layer: LayerSpec, batch: ForwardBatch) -> None:
        store_step_kv(k, v, layer, batch, kernel_on_cpu=True)  # CPU tensors: the kernel under the interpreter

    def _kernel_args(self, layer: LayerSpec, batch: ForwardBatch) -> dict:
        pool = batch.token_kv_pool
        return dict(sliding_window=layer.sliding_window, logit_cap=layer.logit_cap,
                    k_scale=pool.k_scale[layer.layer_id], v_scale=pool.v_scale[layer.layer_id],
                    fp8_dtype=pool.fp8_dtype, interpret=self.interpret)

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: LayerSpec,
                       batch: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor:
        if save_kv_cache:
            self._save(k, v, layer, batch)
        meta = self.meta
        assert meta is not None and meta.qo_indptr is not None, "init_forward_metadata(batch) must run first"
        pool = batch.token_kv_pool
        q = pool.rotate_query(q.reshape(q.shape[0], layer.num_q_heads, layer.head_dim))
        out = q.new_empty((q.shape[0], layer.num_q_heads, self.v_head_dim))
        return extend_attention(
            q, pool.k_buffer[layer.layer_id], pool.v_buffer[layer.layer_id], out, meta.qo_indptr,
            meta.kv_indptr, meta.kv_indices, meta.max_extend_len, layer.scaling, config=self.extend_config,
            k_ext=k, v_ext=v, prefix_tokens=meta.prefix_tokens, **self._kernel_args(layer, batch))

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: LayerSpec,
                       batch: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor:
        if save_kv_cache:
            self._save(k, v, layer, batch)
        meta = self.meta
        assert meta is not None and meta.mid_o is not None and meta.mid_lse is not None, \
            "init_forward_metadata(batch) must run first"
        pool = batch.token_kv_pool
        q = pool.rotate_query(q.reshape(q.shape[0], layer.num_q_heads, layer.head_dim))
        out = q.new_empty((q.shape[0], layer.num_q_heads, self.v_head_dim))
        return decode_attention(
            q, pool.k_buffer[layer.layer_id], pool.v_buffer[layer.layer_id], out, meta.kv_indptr, meta.kv_indices,
            meta.mid_o, meta.mid_lse, layer.scaling, config=self.decode_config, semaphores=meta.semaphores,
            page_size=pool.page_size, **self._kernel_args(layer, batch))
