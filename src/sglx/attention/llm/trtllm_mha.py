"""trtllm_mha: TensorRT-LLM's decode kernels through FlashInfer, for MHA/GQA models.

Decode calls `flashinfer.decode.trtllm_batch_decode_with_kv_cache`, which runs TRT-LLM's XQA kernel on
SM90 (Hopper) and SM120, and the trtllm-gen kernel on SM100 (Blackwell datacenter), over the pool's pages
viewed in place (NHD, as in flashinfer.py) with a dense [bs, pages] block table built on the device
(kernels/page_table.py). The kernels are compiled for fixed page sizes: this backend accepts
--page-size 16, 32 or 64 (the seed: 64 works best) and never rewrites the user's choice; another size is a
clear error. XQA reads fp8_e4m3 KV (not e5m2) and has no logit soft-cap; fp8 scales as in flashinfer.py (one
per layer, first-prefill calibrated over rotated keys unless the checkpoint has them; queries rotated to match).
Prefill (EXTEND/MIXED steps) is FlashInfer's own prefill, inherited from `FlashInferBackend`, as
SGLang's trtllm_mha backend does (ragged without cached prefixes, paged with them).
CUDA graphs: decode has no host-side plan, so the block table and lengths are rebuilt inside the graph
from its static inputs and a replay is input copies plus one launch. Only the SM90 XQA path has been run
(the lent H100); SM100/SM120 are FlashInfer's own dispatch, unverified here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sglx.attention.kernels.page_table import build_page_table, page_table_torch
from sglx.attention.llm.base import BackendContext, LayerSpec
from sglx.attention.llm.flashinfer import FlashInferBackend, layer_scales, paged_query, window_left
from sglx.errors import BackendUnavailableError
from sglx.llm.forward_batch import ForwardBatch

PAGE_SIZES = (16, 32, 64)
CAPABILITIES = ((9, 0), (10, None), (12, None))  # XQA on SM90/SM120, trtllm-gen on SM100
WORKSPACE_BYTES = 128 << 20  # 8 MB of semaphores (must start zeroed) + split-KV scratch, kept apart from FlashInfer's


def check_page_size(page_size: int) -> None:
    if page_size not in PAGE_SIZES:
        valid = ", ".join(map(str, PAGE_SIZES))
        raise BackendUnavailableError(
            f"attention backend trtllm_mha was asked for with --page-size {page_size}: its TRT-LLM decode kernels "
            f"are built for page sizes {valid} only; pass --page-size 64 (or 16, 32), or use --attention-backend "
            "flashinfer for any page size")


@dataclass
class DecodeMeta:
    block_tables: torch.Tensor  # [bs, width] int32 pages
    seq_lens: torch.Tensor  # [bs] int32
    max_seq_len: int


@dataclass
class XqaGraphState:
    block_tables: torch.Tensor  # [max_bs, max_pages] int32
    seq_lens: torch.Tensor  # [max_bs] int32
    inputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


class TrtllmMHABackend(FlashInferBackend):
    name = "trtllm_mha"
    supports_cuda_graph = True

    def __init__(self, ctx: BackendContext) -> None:
        check_page_size(ctx.page_size)
        super().__init__(ctx)
        cc = torch.cuda.get_device_capability(ctx.device)
        if not any(cc[0] == major and (minor is None or cc[1] == minor) for major, minor in CAPABILITIES):
            raise BackendUnavailableError(
                f"attention backend trtllm_mha needs an SM90, SM100 or SM120 GPU, this one is {cc[0]}.{cc[1]} "
                "(use --attention-backend flashinfer)")
        if self.kv_dtype == torch.float8_e5m2:
            raise BackendUnavailableError(
                "attention backend trtllm_mha reads fp8 KV as e4m3 only; use --kv-cache-dtype fp8_e4m3, or "
                "--attention-backend flashinfer for fp8_e5m2")
        self.decode_fn = self.fi.decode.trtllm_batch_decode_with_kv_cache
        self.xqa_workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=ctx.device)
        self.decode_meta: DecodeMeta | None = None
        self.xqa_graph: XqaGraphState | None = None

    # ------------------------------------------------------------------ metadata
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if not batch.mode.is_decode:
            self.decode_meta = None
            super().init_forward_metadata(batch)
            return
        device = self.ctx.device
        bs = batch.batch_size
        longest = max(batch.seq_lens_cpu, default=1)
        width = max(1, -(-longest // self.page_size))
        tables = torch.zeros((bs, width), dtype=torch.int32, device=device)
        lens = torch.empty(bs, dtype=torch.int32, device=device)
        r2t = batch.req_to_token_pool.req_to_token
        if r2t.device.type == "cpu":  # stand-in tests on CPU: the same rows by plain indexing
            indptr, indices, _ = page_table_torch(r2t, batch.req_pool_indices, batch.seq_lens_cpu, self.page_size)
            for i in range(bs):
                tables[i, :indptr[i + 1] - indptr[i]] = indices[indptr[i]:indptr[i + 1]]
            lens.copy_(torch.tensor(batch.seq_lens_cpu, dtype=torch.int32))
        else:
            build_page_table(r2t, batch.req_pool_indices.to(device), batch.seq_lens.to(device), self.page_size,
                             tables, width=width, lens_out=lens)
        self.decode_meta = DecodeMeta(tables, lens, width * self.page_size)

    # ------------------------------------------------------------------ attention
    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: LayerSpec,
                       batch: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor:
        if layer.logit_cap:
            raise BackendUnavailableError(
                f"attention backend trtllm_mha has no logit soft-cap (this model caps at {layer.logit_cap}); "
                "use --attention-backend flashinfer or triton")
        if save_kv_cache:
            self._store(k, v, layer, batch)
        meta = self.decode_meta
        assert meta is not None, "init_forward_metadata(batch) must run first"
        pool = batch.token_kv_pool
        q = paged_query(pool, q.reshape(q.shape[0], layer.num_q_heads, layer.head_dim))
        k_scale, v_scale = layer_scales(pool, layer.layer_id)
        return self.decode_fn(
            query=q, kv_cache=self.paged_kv(layer, batch), workspace_buffer=self.xqa_workspace,
            block_tables=meta.block_tables, seq_lens=meta.seq_lens, max_seq_len=meta.max_seq_len,
            bmm1_scale=layer.scaling * (k_scale or 1.0), bmm2_scale=v_scale or 1.0, window_left=window_left(layer),
            kv_layout="NHD")

    # ------------------------------------------------------------------ CUDA graphs (decode)
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        device = self.ctx.device
        self.xqa_graph = XqaGraphState(
            block_tables=torch.zeros((max_bs, self.max_pages_per_request()), dtype=torch.int32, device=device),
            seq_lens=torch.ones(max_bs, dtype=torch.int32, device=device))

    def _graph_decode_meta(self, bs: int) -> DecodeMeta:
        g = self.xqa_graph
        assert g is not None, "init_cuda_graph_state must run first"
        tables = g.block_tables[:bs]
        return DecodeMeta(tables, g.seq_lens[:bs], tables.shape[1] * self.page_size)

    def init_forward_metadata_capture_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                                 seq_lens: torch.Tensor) -> None:
        g = self.xqa_graph
        assert g is not None, "init_cuda_graph_state must run first"
        g.inputs[bs] = (req_pool_indices, seq_lens)
        self.decode_meta = self._graph_decode_meta(bs)

    def init_forward_metadata_in_graph(self, bs: int) -> None:
        """Block table and int32 lengths from the static inputs, captured: a replay launches nothing else."""
        g = self.xqa_graph
        assert g is not None and bs in g.inputs, f"no graph metadata was set up for batch size {bs}"
        req_pool_indices, seq_lens = g.inputs[bs]
        build_page_table(self.ctx.req_to_token_pool.req_to_token, req_pool_indices, seq_lens, self.page_size,
                         g.block_tables, width=g.block_tables.shape[1], lens_out=g.seq_lens)
        self.decode_meta = self._graph_decode_meta(bs)

    def init_forward_metadata_replay_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                                seq_lens: torch.Tensor, seq_lens_cpu: list[int]) -> None:
        self.decode_meta = self._graph_decode_meta(bs)
