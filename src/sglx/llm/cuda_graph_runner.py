"""CUDA graphs for DECODE steps: capture the whole model once per batch-size bucket, replay per step.

A decode step of a small batch is launch-bound (hundreds of small kernels, each a few microseconds
on the GPU), so replaying a captured graph removes the host from the critical path. Graphs bake in
tensor addresses and shapes, so every input lives in a static buffer (`DecodeInputBuffers`) and a
step of `bs` requests runs the graph of the smallest captured bucket >= bs: the extra slots are
padding that reads and writes only the reserved padding page (req_to_token row 0 -> KV slot 0), so
padding never touches a real request's KV. The attention backend keeps its own static metadata
(`init_cuda_graph_state` and the capture/replay hooks of `AttentionBackend`); its metadata build
(`init_forward_metadata_in_graph`) is captured with the model, so a replay is input copies + one launch.

Whether graphs run is decided by `cuda_graph_plan`, which also says why not (CPU device,
--disable-cuda-graph, a backend without graph support) for logs, `sglx generate` and `--json`.

The graph runner gets what it captures through `GraphTarget` (the model's forward, the backend, the
pools and the device), given by its owner: it never reaches back into the model runner.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from sglx.llm.forward_batch import ForwardBatch, ForwardMode
from sglx.llm.kernels import use_fused

if TYPE_CHECKING:
    from sglx.attention.llm.base import AttentionBackend
    from sglx.llm.kv_cache import ReqToTokenPool, TokenKVPool
    from sglx.llm.mla_kv_cache import MLATokenKVPool

log = logging.getLogger(__name__)

DEFAULT_MAX_BS = 160  # SGLang's default on an 80 GB GPU without tensor parallelism
SMALL_BUCKETS = (1, 2, 4)
BUCKET_STEP = 8  # above 8 requests, buckets grow by 8: at most 7 padded slots per step


def capture_batch_sizes(max_bs: int) -> list[int]:
    """Buckets 1, 2, 4, 8, 16, 24, ... up to max_bs (max_bs itself always included)."""
    if max_bs < 1:
        raise ValueError(f"max_bs must be >= 1, got {max_bs}")
    sizes = [b for b in SMALL_BUCKETS if b <= max_bs]
    sizes += list(range(BUCKET_STEP, max_bs + 1, BUCKET_STEP))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


def bucket_for(bs: int, buckets: list[int]) -> int | None:
    """The smallest captured batch size that holds bs requests; None when bs exceeds every bucket."""
    if bs < 1:
        return None
    i = bisect.bisect_left(buckets, bs)
    return buckets[i] if i < len(buckets) else None


@dataclass(frozen=True)
class CudaGraphPlan:
    """Whether decode steps replay CUDA graphs, up to which batch size, and why (not)."""

    enabled: bool
    max_bs: int
    batch_sizes: tuple[int, ...]
    why: str

    def describe(self) -> str:
        return f"on (batch sizes up to {self.max_bs})" if self.enabled else f"off: {self.why}"


def cuda_graph_plan(device: torch.device, backend_name: str, backend_supports: bool, disabled: bool,
                    max_bs: int | None, max_running_requests: int) -> CudaGraphPlan:
    """Decide graphs from the device, the flags and the decode backend's declared support."""
    limit = max_bs if max_bs is not None else DEFAULT_MAX_BS
    limit = max(1, min(limit, max_running_requests))
    why = ""
    if disabled:
        why = "--disable-cuda-graph"
    elif device.type != "cuda":
        why = f"the device is {device.type}; CUDA graphs need a CUDA GPU"
    elif not backend_supports:
        why = (f"decode attention backend {backend_name} does not support CUDA graphs "
               "(choose --attention-backend triton for graphs)")
    if why:
        return CudaGraphPlan(False, limit, (), why)
    sizes = tuple(capture_batch_sizes(limit))
    return CudaGraphPlan(True, limit, sizes, f"decode batches of up to {limit} requests replay captured graphs")


def greedy_in_graph(logits: torch.Tensor) -> torch.Tensor | None:
    """Greedy tokens computed inside a graph (a few us), so greedy steps need no launch after it."""
    if not use_fused(logits):
        return None
    from sglx.llm.kernels.argmax import greedy_argmax

    return greedy_argmax(logits)


GraphStep = Callable[[int], tuple[torch.Tensor, "torch.Tensor | None"]]


@torch.inference_mode()
def capture_buckets(device: torch.device, buckets: list[int], prepare: Callable[[int], None], step: GraphStep
                    ) -> tuple[dict[int, torch.cuda.CUDAGraph], dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """One CUDA graph per bucket: graphs, their static outputs, and their in-graph greedy picks (where made).

    Largest bucket first, so later graphs reuse its memory pool. For each: `prepare(bucket)` sets the static
    inputs, two warm-up steps on the capture stream compile kernels and settle the allocator, then
    `step(bucket)` (the work a replay redoes: in-graph metadata, the model, the greedy pick) is captured."""
    pool = torch.cuda.graph_pool_handle()
    stream = torch.cuda.Stream(device=device)
    graphs: dict[int, torch.cuda.CUDAGraph] = {}
    outputs: dict[int, torch.Tensor] = {}
    greedy: dict[int, torch.Tensor] = {}
    for bucket in sorted(buckets, reverse=True):
        prepare(bucket)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                step(bucket)
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            out, picked = step(bucket)
        graphs[bucket], outputs[bucket] = graph, out
        if picked is not None:
            greedy[bucket] = picked
    torch.cuda.synchronize(device)
    return graphs, outputs, greedy


class BatchSources(Protocol):
    """What a captured batch points at besides its inputs: the pools and the attention backend."""

    req_to_token_pool: ReqToTokenPool
    token_kv_pool: TokenKVPool | MLATokenKVPool
    backend: AttentionBackend | None


@dataclass(frozen=True)
class GraphTarget:
    """Everything the graph runner captures, handed over by its owner (the model runner)."""

    device: torch.device
    model: Callable[[ForwardBatch], torch.Tensor]  # the model's forward: logits of each request's last token
    backend: AttentionBackend
    req_to_token_pool: ReqToTokenPool
    token_kv_pool: TokenKVPool | MLATokenKVPool


class DecodeInputBuffers:
    """Static per-token inputs of a decode step, `max_bs` long; a step fills the first `bucket` entries.

    Real requests take [0, bs); padding [bs, bucket) gets token 0 at position 0 of req_to_token row 0
    with `fill_seq_len` keys, and writes its K/V into slot 0 (the reserved padding page).
    The five inputs are rows of ONE [5, max_bs] int64 tensor, so a step fills them with one launch
    (device sources: one multi-tensor copy; host sources: one pinned staging buffer, one async H2D
    copy) instead of five copies plus five padding fills: a decode step at batch 1 is launch-bound.
    """

    FIELDS = ("input_ids", "positions", "req_pool_indices", "seq_lens", "out_cache_loc")
    SEQ_LENS_ROW = 3

    def __init__(self, max_bs: int, device: torch.device) -> None:
        self.max_bs = max_bs
        self.device = device
        self.packed = torch.zeros(len(self.FIELDS), max_bs, dtype=torch.long, device=device)
        self.packed[self.SEQ_LENS_ROW].fill_(1)
        self.input_ids, self.positions, self.req_pool_indices, self.seq_lens, self.out_cache_loc = self.packed
        self._rows: dict[int, list[torch.Tensor]] = {}  # bs -> the five rows' first bs entries (views, made once)
        self._host: torch.Tensor | None = None  # pinned staging for host-side inputs (CUDA only), made on first use
        self._host_done: torch.cuda.Event | None = None  # the staging buffer's last H2D copy

    def fill(self, batch: ForwardBatch, bucket: int, fill_seq_len: int) -> list[int]:
        """Copy a decode batch into the buffers and pad it to `bucket`; returns the padded seq_lens (host)."""
        bs = batch.batch_size
        if not 0 < bs <= bucket <= self.max_bs:
            raise ValueError(f"cannot pad a batch of {bs} to {bucket} (buffers hold {self.max_bs})")
        srcs = [getattr(batch, name) for name in self.FIELDS]
        if self.device.type == "cuda" and all(t.device.type == "cpu" for t in srcs):
            self._fill_from_host(srcs, bs, bucket, fill_seq_len)
        else:
            dsts = self._rows.get(bs)
            if dsts is None:  # slicing five rows costs ~20 us of host time a step: keep the views
                dsts = self._rows[bs] = [row[:bs] for row in self.packed]
            if all(t.device == self.packed.device and t.dtype == torch.long for t in srcs):
                torch._foreach_copy_(dsts, srcs, non_blocking=True)  # one launch for all five
            else:
                for dst, src in zip(dsts, srcs, strict=True):
                    dst.copy_(src, non_blocking=True)
            if bucket > bs:
                self.packed[:, bs:bucket].fill_(0)
                self.seq_lens[bs:bucket].fill_(fill_seq_len)
        return [*batch.seq_lens_cpu, *([fill_seq_len] * (bucket - bs))]

    def _fill_from_host(self, srcs: list[torch.Tensor], bs: int, bucket: int, fill_seq_len: int) -> None:
        """Host inputs: stage them (padding included) in pinned memory, then ONE async copy to the device."""
        if self._host is None:
            self._host = torch.zeros(self.packed.shape, dtype=torch.long).pin_memory()
            self._host_done = torch.cuda.Event()
        else:
            assert self._host_done is not None
            self._host_done.synchronize()  # the previous step's copy must have read the staging buffer
        host = self._host
        for row, src in zip(host, srcs, strict=True):
            row[:bs].copy_(src)
        host[:, bs:bucket].fill_(0)
        host[self.SEQ_LENS_ROW, bs:bucket].fill_(fill_seq_len)
        self.packed.copy_(host, non_blocking=True)  # whole buffer: contiguous, one memcpy of a few KB
        self._host_done.record()

    def batch(self, bucket: int, sources: BatchSources, seq_lens_cpu: list[int]) -> ForwardBatch:
        """A DECODE ForwardBatch over the first `bucket` entries (views: captured addresses never change)."""
        return ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=self.input_ids[:bucket], positions=self.positions[:bucket],
            req_pool_indices=self.req_pool_indices[:bucket], seq_lens=self.seq_lens[:bucket],
            out_cache_loc=self.out_cache_loc[:bucket], req_to_token_pool=sources.req_to_token_pool,
            token_kv_pool=sources.token_kv_pool, attn_backend=sources.backend, seq_lens_cpu=seq_lens_cpu)


class CudaGraphRunner:
    """Captures one decode graph per bucket at start-up and replays it for every decode step it fits."""

    def __init__(self, target: GraphTarget, plan: CudaGraphPlan) -> None:
        self.target = target
        self.plan = plan
        self.buckets = list(plan.batch_sizes)
        self.max_bs = plan.max_bs
        self.fill_seq_len = target.backend.get_cuda_graph_seq_len_fill_value()
        self.buffers = DecodeInputBuffers(self.max_bs, target.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.greedy: dict[int, torch.Tensor] = {}  # per bucket: argmax of the logits, captured with them
        self.last_greedy: torch.Tensor | None = None  # greedy tokens of the latest replay (a view)
        self.replays = 0
        target.backend.init_cuda_graph_state(self.max_bs, self.max_bs)
        started = time.perf_counter()
        self._capture_all()
        self.capture_seconds = time.perf_counter() - started
        log.info("captured %d CUDA graphs (batch sizes %s) in %.1f s", len(self.graphs), self.buckets,
                 self.capture_seconds)

    def can_run(self, batch: ForwardBatch) -> bool:
        return (batch.mode is ForwardMode.DECODE and 0 < batch.batch_size <= self.max_bs
                and not batch.return_all_logits)

    def _capture_all(self) -> None:
        backend = self.target.backend
        batches: dict[int, ForwardBatch] = {}

        def prepare(bucket: int) -> None:  # all padding: every request attends to slot 0 of the padding page
            self.buffers.seq_lens[:bucket].fill_(self.fill_seq_len)
            batch = batches[bucket] = self.buffers.batch(bucket, self.target, [self.fill_seq_len] * bucket)
            backend.init_forward_metadata_capture_cuda_graph(bucket, batch.req_pool_indices, batch.seq_lens)

        def step(bucket: int) -> tuple[torch.Tensor, torch.Tensor | None]:
            backend.init_forward_metadata_in_graph(bucket)  # metadata from the static inputs, per replay
            out = self.target.model(batches[bucket])
            return out, greedy_in_graph(out)

        self.graphs, self.outputs, self.greedy = capture_buckets(self.target.device, self.buckets, prepare, step)

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [bs, vocab] of a decode batch; a view of the graph's output, valid until the next replay."""
        bs = batch.batch_size
        bucket = bucket_for(bs, self.buckets)
        assert bucket is not None, "can_run(batch) must be checked first"
        seq_lens_cpu = self.buffers.fill(batch, bucket, self.fill_seq_len)
        b = self.buffers
        self.target.backend.init_forward_metadata_replay_cuda_graph(bucket, b.req_pool_indices[:bucket],
                                                                    b.seq_lens[:bucket], seq_lens_cpu)
        self.graphs[bucket].replay()
        self.replays += 1
        greedy = self.greedy.get(bucket)
        self.last_greedy = greedy[:bs] if greedy is not None else None
        return self.outputs[bucket][:bs]
