"""flashinfer: FlashInfer's paged prefill and decode kernels over sglx's KV pool, for MHA/GQA models.

The pool keeps one `[slots, Hkv, D]` buffer per layer for K and one for V, with `slot = page * page_size +
offset` (allocator.py), so `buffer.view(-1, page_size, Hkv, D)` IS FlashInfer's NHD paged layout for
that page size: no copy, every page size native (fp8 pools: the uint8 bits viewed as their fp8 dtype).
Page tables come from `req_to_token` (kernels/page_table.py).

Prefill, chosen per step:
- no request has a cached prefix: `BatchPrefillWithRaggedKVCacheWrapper` over this step's own K/V,
  which are contiguous tensors already (dense loads; on Hopper FlashInfer's FA3 template);
- otherwise (prefix hits, chunked prefill, MIXED steps): `BatchPrefillWithPagedKVCacheWrapper`, causal,
  over prefix + new tokens, which `forward` has just stored in the pool. One kernel and one plan per step;
  the ragged-new + paged-prefix split that SGLang runs needs two kernels and a state merge for the same
  result, and the prefix part reads the same pages either way.
Decode: `BatchDecodeWithPagedKVCacheWrapper`, on tensor cores when that wins (GQA groups >= 4, fp8 KV).
fp8 KV: one K and one V scale per layer, FlashInfer's contract: the checkpoint's k_scale/v_scale, else (the
default, `--kv-cache-scales auto`) scales computed from the first prefill batch over rotated keys, then frozen
(`TokenKVPool.calibrate_static_scales`; queries on the paged paths are rotated the same way, `paged_query`),
or 1.0 with `--kv-cache-scales one`. A pool set up for per-token scales is switched to calibrated static ones
when the backend is built (before anything is stored). Layers the pool keeps in the model dtype
(`--kv-cache-dtype-skip-layers`) are a layer kind of their own: their own plans, pages read as the model dtype.

Plans are made once per step in `init_forward_metadata`, one per distinct layer kind (sliding window,
soft cap, scale: Qwen2 / Mistral style models mix windowed and full layers); a kind is learned the first
time a layer of it runs (that step plans it on the spot). CUDA graphs (decode): one graph-mode wrapper
per captured batch size over fixed page-table buffers; the page table is rebuilt INSIDE the graph from
its static inputs, and the replay hook re-plans on the host from `seq_lens_cpu` (FlashInfer's plan
needs host lengths and cannot be captured), as SGLang does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from sglx.attention.kernels.page_table import build_page_table, page_table_torch, paged_lengths
from sglx.attention.llm.base import AttentionBackend, BackendContext, LayerSpec
from sglx.attention.llm.kv_store import store_step_kv
from sglx.attention.llm.plan_fence import PlanFence
from sglx.errors import BackendUnavailableError
from sglx.llm.forward_batch import ForwardBatch

WORKSPACE_BYTES = 128 << 20  # FlashInfer's float workspace (split-KV partial outputs), its documented size
SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


def import_flashinfer(backend: str) -> Any:
    """The flashinfer module, or a one-line error that says why not and what runs instead."""
    try:
        import flashinfer
        import flashinfer.decode  # noqa: F401  (the wrappers and TRT-LLM decode live here)
    except (ImportError, OSError, RuntimeError) as exc:
        raise BackendUnavailableError(
            f"attention backend {backend} needs the flashinfer package, which does not import here "
            f"({type(exc).__name__}: {exc}); pip install 'sglx[flashinfer]', or use --attention-backend triton"
        ) from exc
    return flashinfer


def window_left(layer: LayerSpec) -> int:
    """FlashInfer's inclusive left window: a window of W keys (i - W < j <= i) is window_left W - 1; -1 = none."""
    return layer.sliding_window - 1 if layer.sliding_window else -1


def use_tensor_core_decode(num_q_heads: int, num_kv_heads: int, kv_dtype: torch.dtype) -> bool:
    """Tensor-core (prefill-template) decode: a GQA group of >= 4 query heads fills an MMA tile, and fp8 KV
    needs the conversion path only the tensor-core kernel has fast; SGLang's rule for its flashinfer backend."""
    if kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return True
    return num_q_heads // num_kv_heads >= 4


def check_context(backend: str, ctx: BackendContext) -> None:
    """Device, dtype and head dims FlashInfer's kernels are built for; one clear line otherwise."""
    if ctx.device.type != "cuda":
        raise BackendUnavailableError(
            f"attention backend {backend} runs on CUDA GPUs only; this device is {ctx.device.type} "
            "(use --attention-backend torch_native or flex_attention here)")
    if ctx.dtype not in SUPPORTED_DTYPES:
        raise BackendUnavailableError(
            f"attention backend {backend} needs --dtype float16 or bfloat16, got {ctx.dtype} "
            "(use --attention-backend triton for float32)")
    if ctx.head_dim not in SUPPORTED_HEAD_DIMS:
        raise BackendUnavailableError(
            f"attention backend {backend} supports head dims {', '.join(map(str, SUPPORTED_HEAD_DIMS))}, "
            f"this model has {ctx.head_dim} (use --attention-backend triton)")


GraphPlanKey = tuple[int, int, int, int, int]  # (q heads, kv heads, head dim, page size, window_left)


def remember_graph_plan(wrapper: Any, key: GraphPlanKey) -> None:
    """Mark a graph-mode decode wrapper as fully planned once for `key`; later replays may take the cheap re-plan."""
    wrapper._sglx_graph_plan_key = key


def replan_graph_decode(wrapper: Any, indptr_host: torch.Tensor, seq_lens_cpu: list[int], key: GraphPlanKey) -> bool:
    """Re-plan a captured tensor-core decode for new lengths with FlashInfer's planner alone; False: do a full plan.

    Why: `BatchDecodeWithPagedKVCacheWrapper.plan` costs ~0.6 ms of host time at batch 64 on every replayed step
    (H100 profile, session 11): Python `max()` over a tensor, three pageable host-to-device copies of indptr /
    last-page / indices that the graph rebuilds on the device anyway, module lookups. Of all that a replay needs
    only the work lists its captured kernels read from the int workspace: `_cached_module.plan(...)` with the
    arguments `plan` itself passes in CUDA-graph mode (FlashInfer 0.5.x; the same call SGLang's fast decode plan
    makes). Anything else (another key, CUDA-core decode, a wrapper never fully planned) takes the full plan.
    """
    if (getattr(wrapper, "_sglx_graph_plan_key", None) != key or not getattr(wrapper, "use_tensor_cores", False)
            or not getattr(wrapper, "is_cuda_graph_enabled", False) or not hasattr(wrapper, "_cached_module")):
        return False
    q_heads, kv_heads, head_dim, page_size, window_left = key
    bs = len(seq_lens_cpu)
    wrapper._plan_info = wrapper._cached_module.plan(
        wrapper._float_workspace_buffer, wrapper._int_workspace_buffer, wrapper._pin_memory_int_workspace_buffer,
        torch.arange(bs + 1, dtype=torch.int32), indptr_host, torch.tensor(seq_lens_cpu, dtype=torch.int32),
        bs, bs, q_heads, kv_heads, page_size, True, head_dim, head_dim, False, window_left, -1, False, 0)
    wrapper._max_kv_len = max(seq_lens_cpu)
    return True


def paged_query(pool: Any, q: torch.Tensor, strided_ok: bool = False) -> torch.Tensor:
    """q [T, Hq, D] for a kernel that reads keys from the pool: in the pool's key basis when it stores keys
    rotated (`TokenKVPool.rotate_query`: (q @ R) . (k @ R) = q . k), contiguous. The ragged prefill path reads
    this step's own (unrotated) K and takes q as it is. strided_ok: the kernel reads q through its token and
    head strides (FlashInfer's decode kernels, both kinds, do), so a view of the fused qkv output with unit
    last stride goes in as it is: no copy (79 us a step in a bs64 Llama-3.1-8B decode, H100 profile)."""
    rotate = getattr(pool, "rotate_query", None)
    q = rotate(q) if rotate is not None else q
    return q if strided_ok and q.stride(-1) == 1 else q.contiguous()


def layer_scales(pool: Any, layer_id: int) -> tuple[float | None, float | None]:
    """The layer's per-tensor K/V dequantization scales for fp8 pools (None: 1.0, nothing to apply)."""
    if not getattr(pool, "is_fp8", False):
        return None, None
    out: list[float | None] = []
    for name in ("k_scale", "v_scale"):
        scale = getattr(pool, name)[layer_id]
        if isinstance(scale, torch.Tensor):
            if scale.numel() != 1:
                raise BackendUnavailableError(
                    f"FlashInfer applies one {name} per layer, but the KV pool holds {scale.numel()} (per-head "
                    "scales); use --attention-backend triton for per-head fp8 scales")
            scale = float(scale)
        out.append(None if scale == 1.0 else float(scale))
    return out[0], out[1]


@dataclass(frozen=True)
class LayerKind:
    """What a plan fixes besides the batch: layers that share these share one plan per step (the KV dtype too:
    fp8 pools may keep some layers in the model dtype, `TokenKVPool.keep_unquantized`)."""

    window_left: int
    logit_cap: float
    scaling: float
    kv_dtype: torch.dtype | None = None  # None: the backend's pool-wide KV dtype

    @staticmethod
    def of(layer: LayerSpec, kv_dtype: torch.dtype | None = None) -> LayerKind:
        return LayerKind(window_left(layer), float(layer.logit_cap or 0.0), float(layer.scaling), kv_dtype)


@dataclass
class StepMeta:
    """One step's page table and plans; `graph_bs` set when it belongs to a captured decode batch size."""

    phase: str  # "decode" | "ragged" | "paged"
    qo_indptr: torch.Tensor  # host int32 [bs + 1]
    kv_indptr: torch.Tensor  # host int32 [bs + 1]: pages (paged/decode) or tokens (ragged)
    last_page_len: torch.Tensor | None  # host int32 [bs]
    indices: torch.Tensor | None  # device int32 pages (CSR)
    graph_bs: int | None = None
    planned: set[LayerKind] = field(default_factory=set)
    seq_lens_cpu: list[int] | None = None  # a graph replay's lengths (its cheap re-plan needs them)


@dataclass
class GraphState:
    """Fixed page-table buffers every captured decode graph reads, and its wrappers per (batch size, kind)."""

    indptr: torch.Tensor  # [max_bs + 1] int32
    indices: torch.Tensor  # [max_bs * max_pages] int32
    last_page_len: torch.Tensor  # [max_bs] int32
    inputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    metas: dict[int, StepMeta] = field(default_factory=dict)
    wrappers: dict[tuple[int, LayerKind], Any] = field(default_factory=dict)


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"
    supports_cuda_graph = True
    lends_pool_slots = True
    kv_dtype_per_layer = True  # plans per KV dtype: fp8 pools with layers kept in the model dtype

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        self.fi = import_flashinfer(self.name)
        check_context(self.name, ctx)
        pool = ctx.token_kv_pool
        if getattr(pool, "per_token_scales", False):
            # FlashInfer and XQA apply one K and one V scale per layer (vLLM's and SGLang's fp8 contract): the pool,
            # still empty at backend construction, gets the engine's default for such backends instead: static
            # scales calibrated from the first prefill over rotated keys (--kv-cache-scales auto)
            pool.calibrate_static_scales(rotate_keys=True)
        self.page_size = ctx.page_size
        self.kv_dtype: torch.dtype = getattr(pool, "fp8_dtype", None) or ctx.dtype
        self.v_head_dim = getattr(pool, "v_head_dim", ctx.head_dim)
        choice = ctx.config.get("decode_tensor_cores", "auto")
        self.tensor_core_decode = (choice == "on" or choice == "auto" and use_tensor_core_decode(
            ctx.num_q_heads, ctx.num_kv_heads, self.kv_dtype))
        # FA3 (Hopper) prefill reads q and KV of one dtype; paged prefill over fp8 KV runs FlashInfer's FA2 template
        self.prefill_backend = "fa2" if self.kv_dtype != ctx.dtype else "auto"
        # fp8 pools may keep some layers in the model dtype (--kv-cache-dtype-skip-layers): those get plans of their own
        self.unquantized_layers: frozenset[int] = frozenset(getattr(pool, "unquantized_layers", ()))
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=ctx.device)
        self.kinds: list[LayerKind] = []  # every layer kind seen so far, planned each step
        self.wrappers: dict[tuple[str, LayerKind], Any] = {}
        self.meta: StepMeta | None = None
        self.graph: GraphState | None = None
        self.plan_fence = PlanFence(ctx.device)  # plans reuse a pinned buffer: safe under overlap scheduling

    # ------------------------------------------------------------------ metadata
    def _device_page_table(self, batch: ForwardBatch, indptr_host: list[int]) -> torch.Tensor:
        r2t = batch.req_to_token_pool.req_to_token
        if r2t.device.type == "cpu":  # stand-in tests on CPU: the same table by plain indexing
            return page_table_torch(r2t, batch.req_pool_indices, batch.seq_lens_cpu, self.page_size)[1]
        indices = torch.empty(indptr_host[-1], dtype=torch.int32, device=r2t.device)
        bs = batch.batch_size
        scratch = torch.empty(2 * bs + 1, dtype=torch.int32, device=r2t.device)  # device indptr/last: unused here
        build_page_table(r2t, batch.req_pool_indices.to(r2t.device), batch.seq_lens.to(r2t.device), self.page_size,
                         indices, scratch[:bs + 1], scratch[bs + 1:])
        return indices

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        bs = batch.batch_size
        i32 = torch.int32
        if batch.mode.is_decode:
            phase = "decode"
            q_lens = [1] * bs
        else:
            q_lens = list(batch.extend_seq_lens_cpu)
            phase = "paged" if any(batch.extend_prefix_lens_cpu) else "ragged"
        qo = [0]
        for n in q_lens:
            qo.append(qo[-1] + n)
        qo_indptr = torch.tensor(qo, dtype=i32)
        if phase == "ragged":
            meta = StepMeta(phase, qo_indptr, qo_indptr, None, None)
        else:
            indptr, last = paged_lengths(batch.seq_lens_cpu, self.page_size)
            meta = StepMeta(phase, qo_indptr, torch.tensor(indptr, dtype=i32), torch.tensor(last, dtype=i32),
                            self._device_page_table(batch, indptr))
        self.meta = meta
        for kind in self.kinds:
            self._plan(meta, kind)

    def layer_kv_dtype(self, layer_id: int) -> torch.dtype:
        """The dtype FlashInfer reads layer `layer_id`'s pages as: the pool's fp8 format, or the model dtype for a
        layer the pool keeps unquantized."""
        return self.ctx.dtype if layer_id in self.unquantized_layers else self.kv_dtype

    def _new_wrapper(self, phase: str, graph_bs: int | None = None, kv_dtype: torch.dtype | None = None) -> Any:
        fi, ws = self.fi, self.workspace
        if phase == "ragged":
            return fi.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")  # this step's K/V: q's dtype, FA3 on Hopper
        if phase == "paged":
            backend = self.prefill_backend if kv_dtype in (None, self.kv_dtype) else "auto"
            return fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
        if graph_bs is None:
            return fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=self.tensor_core_decode)
        g = self.graph
        assert g is not None
        return fi.BatchDecodeWithPagedKVCacheWrapper(
            ws, "NHD", use_cuda_graph=True, use_tensor_cores=self.tensor_core_decode,
            paged_kv_indptr_buffer=g.indptr[:graph_bs + 1], paged_kv_indices_buffer=g.indices,
            paged_kv_last_page_len_buffer=g.last_page_len[:graph_bs])

    def _wrapper(self, meta: StepMeta, kind: LayerKind) -> Any:
        if meta.graph_bs is not None:
            g = self.graph
            assert g is not None
            key = (meta.graph_bs, kind)
            if key not in g.wrappers:
                g.wrappers[key] = self._new_wrapper("decode", meta.graph_bs)
            return g.wrappers[key]
        if (meta.phase, kind) not in self.wrappers:
            self.wrappers[(meta.phase, kind)] = self._new_wrapper(meta.phase, kv_dtype=kind.kv_dtype)
        return self.wrappers[(meta.phase, kind)]

    def _plan(self, meta: StepMeta, kind: LayerKind) -> None:
        ctx = self.ctx
        wrapper = self._wrapper(meta, kind)
        if not meta.planned:  # the step's first plan: the previous step's staged copy must be done
            self.plan_fence.before()
        common = dict(window_left=kind.window_left, logits_soft_cap=kind.logit_cap, sm_scale=kind.scaling,
                      q_data_type=ctx.dtype)
        kv_dtype = kind.kv_dtype or self.kv_dtype
        if meta.phase == "ragged":
            wrapper.plan(meta.qo_indptr, meta.kv_indptr, ctx.num_q_heads, ctx.num_kv_heads, ctx.head_dim,
                         head_dim_vo=self.v_head_dim, causal=True, kv_data_type=ctx.dtype, **common)
        elif meta.phase == "paged":
            wrapper.plan(meta.qo_indptr, meta.kv_indptr, meta.indices, meta.last_page_len, ctx.num_q_heads,
                         ctx.num_kv_heads, ctx.head_dim, self.page_size, head_dim_vo=self.v_head_dim, causal=True,
                         kv_data_type=kv_dtype, **common)
        elif meta.graph_bs is not None and meta.seq_lens_cpu is not None and replan_graph_decode(
                wrapper, meta.kv_indptr, meta.seq_lens_cpu, (ctx.num_q_heads, ctx.num_kv_heads, ctx.head_dim,
                                                             self.page_size, kind.window_left)):
            pass  # a replay: the work lists re-planned without the wrapper's per-call Python (see there)
        else:
            indices = meta.indices
            if meta.graph_bs is not None:  # the graph's own kernel fills the fixed indices buffer
                indices = meta.indices[:0]
            wrapper.plan(meta.kv_indptr, indices, meta.last_page_len, ctx.num_q_heads, ctx.num_kv_heads,
                         ctx.head_dim, self.page_size, kv_data_type=kv_dtype, **common)
            if meta.graph_bs is not None:
                remember_graph_plan(wrapper, (ctx.num_q_heads, ctx.num_kv_heads, ctx.head_dim, self.page_size,
                                              kind.window_left))
        meta.planned.add(kind)
        self.plan_fence.after()

    def _planned_wrapper(self, layer: LayerSpec) -> Any:
        meta = self.meta
        assert meta is not None, "init_forward_metadata(batch) must run first"
        kind = LayerKind.of(layer, self.ctx.dtype if layer.layer_id in self.unquantized_layers else None)
        if kind not in self.kinds:
            self.kinds.append(kind)
        if kind not in meta.planned:
            self._plan(meta, kind)
        return self._wrapper(meta, kind)

    # ------------------------------------------------------------------ KV store
    def _store(self, k: torch.Tensor, v: torch.Tensor, layer: LayerSpec, batch: ForwardBatch) -> None:
        """This step's K/V into the pool: sglx's Triton store kernel on GPUs (fp8 encode included)."""
        store_step_kv(k, v, layer, batch)

    def paged_kv(self, layer: LayerSpec, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V buffers as FlashInfer NHD pages [pages, page_size, Hkv, D] (views, no copy)."""
        pool = batch.token_kv_pool
        k, v = pool.k_buffer[layer.layer_id], pool.v_buffer[layer.layer_id]
        kv_dtype = self.layer_kv_dtype(layer.layer_id)
        if kv_dtype != k.dtype:
            k, v = k.view(kv_dtype), v.view(kv_dtype)
        ps = self.page_size
        return k.view(-1, ps, *k.shape[1:]), v.view(-1, ps, *v.shape[1:])

    # ------------------------------------------------------------------ attention
    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: LayerSpec,
                       batch: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor:
        if save_kv_cache:
            self._store(k, v, layer, batch)
        wrapper = self._planned_wrapper(layer)
        q = q.reshape(q.shape[0], layer.num_q_heads, layer.head_dim)
        assert self.meta is not None
        if self.meta.phase == "ragged":
            kv_heads = layer.num_kv_heads
            k = k.reshape(k.shape[0], kv_heads, -1).to(q.dtype)
            v = v.reshape(v.shape[0], kv_heads, -1).to(q.dtype)
            return wrapper.run(q.contiguous(), k.contiguous(), v.contiguous())
        pool = batch.token_kv_pool
        k_scale, v_scale = layer_scales(pool, layer.layer_id)
        return wrapper.run(paged_query(pool, q), self.paged_kv(layer, batch), k_scale=k_scale, v_scale=v_scale)

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: LayerSpec,
                       batch: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor:
        if save_kv_cache:
            self._store(k, v, layer, batch)
        wrapper = self._planned_wrapper(layer)
        q = q.reshape(q.shape[0], layer.num_q_heads, layer.head_dim)
        pool = batch.token_kv_pool
        k_scale, v_scale = layer_scales(pool, layer.layer_id)
        return wrapper.run(paged_query(pool, q, strided_ok=True), self.paged_kv(layer, batch), k_scale=k_scale,
                           v_scale=v_scale)

    # ------------------------------------------------------------------ CUDA graphs (decode)
    def max_pages_per_request(self) -> int:
        return -(-self.ctx.req_to_token_pool.max_context_len // self.page_size)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        device, i32 = self.ctx.device, torch.int32
        self.graph = GraphState(indptr=torch.zeros(max_bs + 1, dtype=i32, device=device),
                                indices=torch.zeros(max_bs * self.max_pages_per_request(), dtype=i32, device=device),
                                last_page_len=torch.ones(max_bs, dtype=i32, device=device))

    def _graph_meta(self, bs: int, seq_lens_cpu: list[int]) -> StepMeta:
        g = self.graph
        assert g is not None, "init_cuda_graph_state must run first"
        indptr, last = paged_lengths(seq_lens_cpu, self.page_size)
        meta = g.metas.get(bs)
        if meta is None:
            meta = g.metas[bs] = StepMeta("decode", torch.arange(bs + 1, dtype=torch.int32), torch.zeros(0),
                                          None, g.indices, graph_bs=bs)
        meta.kv_indptr = torch.tensor(indptr, dtype=torch.int32)
        meta.last_page_len = torch.tensor(last, dtype=torch.int32)
        meta.seq_lens_cpu = list(seq_lens_cpu)
        meta.planned = set()
        return meta

    def init_forward_metadata_capture_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                                 seq_lens: torch.Tensor) -> None:
        g = self.graph
        assert g is not None, "init_cuda_graph_state must run first"
        g.inputs[bs] = (req_pool_indices, seq_lens)
        meta = self._graph_meta(bs, [self.get_cuda_graph_seq_len_fill_value()] * bs)
        self.meta = meta
        for kind in self.kinds:
            self._plan(meta, kind)

    def init_forward_metadata_in_graph(self, bs: int) -> None:
        """The page table from the graph's static inputs: captured, so every replay rebuilds it on the device."""
        g = self.graph
        assert g is not None and bs in g.inputs, f"no graph metadata was set up for batch size {bs}"
        req_pool_indices, seq_lens = g.inputs[bs]
        build_page_table(self.ctx.req_to_token_pool.req_to_token, req_pool_indices, seq_lens, self.page_size,
                         g.indices, g.indptr[:bs + 1], g.last_page_len[:bs])
        self.meta = g.metas[bs]

    def init_forward_metadata_replay_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                                seq_lens: torch.Tensor, seq_lens_cpu: list[int]) -> None:
        meta = self._graph_meta(bs, seq_lens_cpu)
        self.meta = meta
        for kind in self.kinds:
            self._plan(meta, kind)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1  # a padded request attends to one key: slot 0 of the padding page
