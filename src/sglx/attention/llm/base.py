"""The contract every paged LLM attention backend implements.

Once per step the runner calls `init_forward_metadata(batch)`; every layer then calls `forward`,
which saves this step's K/V at `batch.out_cache_loc` and attends with `forward_extend` (prefill over
cached prefix + new tokens, also MIXED steps) or `forward_decode` (one query per request).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:  # annotations only: the contract does not load the runtime (kv_store imports LayerSpec from here)
    from sglx.attention.llm.kv_store import StepKVSlots
    from sglx.llm.forward_batch import ForwardBatch
    from sglx.llm.kv_cache import ReqToTokenPool, TokenKVPool
    from sglx.llm.mla_kv_cache import MLATokenKVPool


@dataclass(frozen=True)
class LayerSpec:
    """What one attention layer asks of the backend."""

    layer_id: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    sliding_window: int | None = None  # a query at position i sees keys j with i - window < j <= i
    logit_cap: float = 0.0  # > 0: scores = cap * tanh(scores / cap)


@dataclass(frozen=True)
class BackendContext:
    """Everything a backend needs at construction; shared pools are owned by the model runner."""

    device: torch.device
    dtype: torch.dtype
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    req_to_token_pool: ReqToTokenPool
    token_kv_pool: TokenKVPool | MLATokenKVPool  # MLA backends get the latent pool
    config: Mapping[str, Any] = field(default_factory=dict)


class AttentionBackend(ABC):
    """Base class; backends that can be captured in CUDA graphs override the graph hooks."""

    name: ClassVar[str] = "base"
    supports_cuda_graph: ClassVar[bool] = False
    supports_prefill_cuda_graph: ClassVar[bool] = False  # single-request prefills from captured graphs
    # True: reads fp8 pools with per-token scales and rotated keys (`TokenKVPool.per_token_scales`, see
    # kv_cache.py). The runner gives such a pool only when every selected backend says True; the others
    # get one static scale per layer (1.0, or the checkpoint's k_scale/v_scale).
    kv_scales_per_token: ClassVar[bool] = False
    # the pool is sglx's layout, written by sglx's store kernel: a kernel that computes this step's K/V may store them
    # itself (`step_kv_slots`)
    lends_pool_slots: ClassVar[bool] = False

    def __init__(self, ctx: BackendContext) -> None:
        self.ctx = ctx

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Build per-step metadata (indices, plans) once; every layer reuses it."""

    def step_kv_slots(self, layer: LayerSpec, batch: ForwardBatch) -> StepKVSlots | None:
        """Where the kernel that computes this step's K/V (rotary, the batch-1 qkv GEMV) may store them itself (backends
        that set `lends_pool_slots`), or None: the layer then calls `forward` with save_kv_cache=True and the backend
        stores. A layer that used the slots calls `forward` with save_kv_cache=False."""
        if not self.lends_pool_slots:
            return None
        from sglx.attention.llm.kv_store import step_kv_slots  # kv_store imports this module

        return step_kv_slots(layer, batch)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: LayerSpec,
                batch: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] for this step's tokens -> output [T, Hq, D]."""
        if batch.mode.is_decode:
            return self.forward_decode(q, k, v, layer, batch, save_kv_cache)
        return self.forward_extend(q, k, v, layer, batch, save_kv_cache)

    @abstractmethod
    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: LayerSpec,
                       batch: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor: ...

    @abstractmethod
    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: LayerSpec,
                       batch: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor: ...

    # CUDA-graph hooks: only backends with supports_cuda_graph = True implement them.
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        raise NotImplementedError(f"{self.name} does not support CUDA graphs")

    def init_forward_metadata_capture_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                                 seq_lens: torch.Tensor) -> None:
        raise NotImplementedError(f"{self.name} does not support CUDA graphs")

    def init_forward_metadata_replay_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                                seq_lens: torch.Tensor, seq_lens_cpu: list[int]) -> None:
        raise NotImplementedError(f"{self.name} does not support CUDA graphs")

    def init_forward_metadata_in_graph(self, bs: int) -> None:
        """Device work on the capture hook's static inputs that the graph runner captures before the model.

        Runs inside the captured region, so each replay redoes it on the inputs just copied in and the
        host launches nothing per step but the graph. Default: nothing (all work in the replay hook).
        """
        return None

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    # Prefill-graph hooks (llm/prefill_graph_runner.py): only backends with supports_prefill_cuda_graph
    # implement them. The batch is two requests (the real one, then padding) over `bucket` token rows.
    def init_prefill_graph_state(self, buckets: list[int], qo_indptr: torch.Tensor, req_pool_indices: torch.Tensor,
                                 seq_lens: torch.Tensor) -> None:
        """Static metadata of every token bucket over the runner's static inputs (before capture)."""
        raise NotImplementedError(f"{self.name} does not support prefill CUDA graphs")

    def prefill_graph_takes(self, batch: ForwardBatch) -> bool:
        """Whether this single-request prefill can replay a graph (backends whose graphs bake in more than the
        token bucket refuse the batches that differ). Default: every one."""
        return True

    def init_prefill_metadata_in_graph(self, bucket: int) -> None:
        """Device work on the static inputs, captured before the model (every replay redoes it)."""
        raise NotImplementedError(f"{self.name} does not support prefill CUDA graphs")

    def init_prefill_metadata_replay(self, bucket: int) -> None:
        """Point the layers at the bucket's metadata before a replay (host only, nothing launched)."""
        raise NotImplementedError(f"{self.name} does not support prefill CUDA graphs")

    @staticmethod
    def save_kv(k: torch.Tensor, v: torch.Tensor, layer: LayerSpec, batch: ForwardBatch) -> None:
        batch.token_kv_pool.set_kv(layer.layer_id, batch.out_cache_loc, k, v)
