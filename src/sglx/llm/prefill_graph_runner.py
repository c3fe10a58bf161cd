"""CUDA graphs for short single-request PREFILLS: the time to first token of a short prompt.

A prefill of a few hundred tokens is host-bound on an H100: Llama-3.1-8B at 512 tokens keeps the GPU
busy 11.6 ms, while launching its ~300 kernels one by one from Python takes 15-40 ms (docs/benchmarks.md,
session 11). Replaying a captured graph leaves the host a few copies and one launch.

Graphs bake in shapes, so each token bucket T has its own graph of a two-request EXTEND batch. Request 0
is the real one: n <= T new tokens after its cached prefix (a radix-cache hit works as is). Request 1 is
padding over rows [n, T): it lives on req_to_token row 0 (the padding row, every entry slot 0), attends
only to its own rows, and writes its K/V into slot 0 (the reserved padding page), so it never touches a
real request's cache. Only request 0's last token reaches the LM head. Every per-step input is a static
buffer; the attention backend rebuilds its indices from them inside the graph
(`init_prefill_metadata_in_graph`), so nothing about the step is baked in but T.

Only prefill backends that declare `supports_prefill_cuda_graph` (triton, also as the prefill half of a hybrid
pair whose decode backend has graphs) get these graphs; any other batch
(several requests, MIXED steps, more tokens than the largest bucket, all-token logits, and for triton MLA a
cached prefix: `prefill_graph_takes`) prefills eagerly.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass

import torch

from sglx.llm.cuda_graph_runner import GraphTarget, capture_buckets, greedy_in_graph
from sglx.llm.forward_batch import ForwardBatch, ForwardMode

log = logging.getLogger(__name__)

DEFAULT_MAX_PREFILL_TOKENS = 1024  # above this a prefill keeps the GPU busier than the host: graphs gain little
# padding costs at most half a bucket's compute at the small end (launch-bound anyway), a quarter above 256
BUCKETS = (16, 32, 64, 96, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024)


def prefill_buckets(max_tokens: int) -> list[int]:
    """Token buckets up to max_tokens (max_tokens itself always included)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    sizes = [b for b in BUCKETS if b < max_tokens]
    return [*sizes, max_tokens]


@dataclass(frozen=True)
class PrefillGraphPlan:
    """Whether short single-request prefills replay CUDA graphs, up to how many tokens, and why (not)."""

    enabled: bool
    max_tokens: int
    buckets: tuple[int, ...]
    why: str

    def describe(self) -> str:
        return f"on (single-request prefills up to {self.max_tokens} tokens)" if self.enabled else f"off: {self.why}"


def prefill_graph_plan(decode_graphs_on: bool, decode_why: str, backend_name: str, backend_supports: bool,
                       max_tokens: int | None, context_length: int, tp_size: int, mla: bool = False
                       ) -> PrefillGraphPlan:
    """Prefill graphs follow the decode graphs (device, --disable-cuda-graph, the model) plus their own limits.
    mla: the model uses multi-head latent attention (triton MLA's graphs take a cached prefix of at most the
    largest bucket)."""
    limit = DEFAULT_MAX_PREFILL_TOKENS if max_tokens is None else max_tokens
    limit = min(limit, context_length)
    why = ""
    if max_tokens == 0:
        why = "--cuda-graph-max-prefill-tokens 0"
    elif not decode_graphs_on:
        why = decode_why
    elif not backend_supports and mla:
        why = (f"MLA prefill attention backend {backend_name} has no prefill graph support (triton MLA has it: "
               "--attention-backend triton, or --prefill-attention-backend triton with a decode backend that has "
               "CUDA graphs)")
    elif not backend_supports:
        why = (f"prefill attention backend {backend_name} has no prefill graph support (triton has it: "
               "--attention-backend triton, or --prefill-attention-backend triton with any decode backend "
               "that has CUDA graphs)")
    elif tp_size > 1:
        why = "tensor parallelism: prefill graphs are captured on one GPU only"
    if why:
        return PrefillGraphPlan(False, limit, (), why)
    scope = f" on a cached prefix of at most {limit} tokens (MLA)" if mla else ""
    return PrefillGraphPlan(True, limit, tuple(prefill_buckets(limit)),
                            f"single-request prefills of up to {limit} tokens{scope} replay captured graphs")


class PrefillInputBuffers:
    """Static inputs of the two-request prefill batch, `max_tokens` rows long.

    `tokens` rows: input ids, positions, KV slots (rows [n, T) of the slots are zeroed each step: slot 0).
    `meta`: [real row, padding row 0, real seq_len, padding seq_len T - n, qo_indptr 0, n, T, n - 1]; one
    copy fills it. `qo_indptr` is its int32 copy, made inside the graph.
    """

    def __init__(self, max_tokens: int, device: torch.device) -> None:
        self.max_tokens = max_tokens
        self.device = device
        self.tokens = torch.zeros(3, max_tokens, dtype=torch.long, device=device)
        self.input_ids, self.positions, self.out_cache_loc = self.tokens
        self.meta = torch.zeros(8, dtype=torch.long, device=device)
        self.req_pool_indices = self.meta[0:2]
        self.seq_lens = self.meta[2:4]
        self.qo_indptr64 = self.meta[4:7]
        self.last_index = self.meta[7:8]
        self.qo_indptr = torch.zeros(3, dtype=torch.int32, device=device)

    def fill(self, batch: ForwardBatch, bucket: int) -> None:
        """Copy a one-request extend batch into the buffers and pad it to `bucket` tokens."""
        n = batch.num_tokens
        if not 0 < n <= bucket <= self.max_tokens or batch.batch_size != 1:
            raise ValueError(f"cannot pad a {batch.batch_size}-request batch of {n} tokens to {bucket}")
        seq_len = batch.seq_lens_cpu[0]
        host_meta = torch.tensor([0, seq_len, bucket - n, 0, n, bucket, n - 1], dtype=torch.long)
        srcs = [batch.input_ids, batch.positions, batch.out_cache_loc, batch.req_pool_indices,
                host_meta.to(self.device, non_blocking=True)]
        dsts = [self.input_ids[:n], self.positions[:n], self.out_cache_loc[:n], self.meta[0:1], self.meta[1:8]]
        if all(t.device == self.device and t.dtype == torch.long for t in srcs):
            torch._foreach_copy_(dsts, srcs, non_blocking=True)  # one launch for all five
        else:
            for dst, src in zip(dsts, srcs, strict=True):
                dst.copy_(src.reshape(dst.shape), non_blocking=True)
        if bucket > n:
            self.out_cache_loc[n:bucket].zero_()  # padding writes only slot 0, never a previous step's slots

    def batch(self, bucket: int, target: GraphTarget) -> ForwardBatch:
        """The static EXTEND batch of `bucket` tokens (views: captured addresses never change).

        Its host lists describe the capture-time step (one request of `bucket` tokens); nothing in a
        prefill-graph-capable model or backend reads them inside the captured region."""
        return ForwardBatch(
            mode=ForwardMode.EXTEND, input_ids=self.input_ids[:bucket], positions=self.positions[:bucket],
            req_pool_indices=self.req_pool_indices, seq_lens=self.seq_lens,
            out_cache_loc=self.out_cache_loc[:bucket], req_to_token_pool=target.req_to_token_pool,
            token_kv_pool=target.token_kv_pool, attn_backend=target.backend, seq_lens_cpu=[bucket, 0],
            extend_seq_lens_cpu=[bucket, 0], extend_prefix_lens_cpu=[0, 0], last_token_index=self.last_index)


class PrefillGraphRunner:
    """Captures one prefill graph per token bucket at start-up and replays it for every prefill it fits.

    `capture=False` runs the very same static-buffer step eagerly instead of replaying a graph: the CPU
    tests check the padding and metadata logic through it (graphs themselves need a CUDA GPU)."""

    def __init__(self, target: GraphTarget, plan: PrefillGraphPlan, capture: bool = True) -> None:
        self.target = target
        self.plan = plan
        self.buckets = list(plan.buckets)
        self.max_tokens = plan.max_tokens
        self.capture = capture
        self.buffers = PrefillInputBuffers(self.max_tokens, target.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.greedy: dict[int, torch.Tensor] = {}
        self.last_greedy: torch.Tensor | None = None
        self.replays = 0
        target.backend.init_prefill_graph_state(self.buckets, self.buffers.qo_indptr, self.buffers.req_pool_indices,
                                                self.buffers.seq_lens)
        self.capture_seconds = 0.0
        if capture:
            started = time.perf_counter()
            self.graphs, self.outputs, self.greedy = capture_buckets(target.device, self.buckets, self._capture_for,
                                                                     self._step)
            self.capture_seconds = time.perf_counter() - started
            log.info("captured %d prefill CUDA graphs (token buckets %s) in %.1f s", len(self.graphs), self.buckets,
                     self.capture_seconds)

    def can_run(self, batch: ForwardBatch) -> bool:
        return (batch.mode is ForwardMode.EXTEND and batch.batch_size == 1 and not batch.return_all_logits
                and 0 < batch.num_tokens <= self.max_tokens and self.target.backend.prefill_graph_takes(batch))

    def _step(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What a graph holds: the int32 indptr, the backend's indices, the model, the greedy pick."""
        b = self.buffers
        b.qo_indptr.copy_(b.qo_indptr64)
        self.target.backend.init_prefill_metadata_in_graph(bucket)
        logits = self.target.model(b.batch(bucket, self.target))
        return logits, greedy_in_graph(logits)

    def _capture_for(self, bucket: int) -> None:
        """Padding-only inputs (real request = padding row, one token) so warm-up and capture write slot 0 only."""
        b = self.buffers
        b.tokens[:, :bucket].zero_()
        b.meta.copy_(torch.tensor([0, 0, 1, bucket - 1, 0, 1, bucket, 0], dtype=torch.long))

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [1, vocab] of the request's last token; a view of the graph's output, valid until the next replay."""
        n = batch.num_tokens
        i = bisect.bisect_left(self.buckets, n)
        assert i < len(self.buckets), "can_run(batch) must be checked first"
        bucket = self.buckets[i]
        self.buffers.fill(batch, bucket)
        self.target.backend.init_prefill_metadata_replay(bucket)
        self.replays += 1
        if not self.capture:
            logits, greedy = self._step(bucket)
            self.last_greedy = greedy
            return logits
        self.graphs[bucket].replay()
        self.last_greedy = self.greedy.get(bucket)
        return self.outputs[bucket]
