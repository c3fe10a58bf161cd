"""The model side of the engine: device, dtype, backend selection, weights, KV pools, one forward per step.

Selection happens before weights load, so an impossible `--attention-backend` fails in a second, not
after minutes of loading. The KV pool is sized from `--max-total-tokens`, else on a GPU from
`--mem-fraction-static` of device memory (what is left after the weights), else on the CPU from a
share of free RAM capped at a few context lengths. On a CUDA GPU with a decode backend that supports
it, decode steps replay CUDA graphs captured at start-up (`cuda_graph_runner.py`); `cuda_graph`
says whether they do and why not.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from sglx.attention.llm.base import AttentionBackend, BackendContext
from sglx.attention.registry import backend_names, find
from sglx.attention.selection import LLMBackendArgs, LLMSelection, select_llm
from sglx.errors import SglxError
from sglx.llm.cuda_graph_runner import CudaGraphPlan, CudaGraphRunner, GraphTarget, cuda_graph_plan
from sglx.llm.engine_config import EngineConfig
from sglx.llm.forward_batch import ForwardBatch
from sglx.llm.kv_cache import ReqToTokenPool, TokenKVPool
from sglx.llm.mla_kv_cache import MLATokenKVPool
from sglx.llm.model_config import ModelConfig, load_model_config
from sglx.llm.prefill_graph_runner import PrefillGraphPlan, PrefillGraphRunner, prefill_graph_plan
from sglx.platform import PlatformSnapshot

if TYPE_CHECKING:
    from sglx.attention.registry import BackendSpec
    from sglx.distributed.group import DistContext

log = logging.getLogger(__name__)

DEFAULT_GPU_MEM_FRACTION = 0.85
DEFAULT_CPU_RAM_FRACTION = 0.25
CPU_MAX_CONTEXTS = 4  # a CPU pool holds at most this many full contexts (and at least 32k tokens)
CPU_MIN_TOKENS = 32768
DEFAULT_CPU_MAX_RUNNING = 256
DEFAULT_GPU_MAX_RUNNING = 2048


@dataclass(frozen=True)
class MemoryPlan:
    """How the KV memory was sized, for logs, --json output and errors."""

    num_slots: int
    bytes_per_token: int
    max_running_requests: int
    context_length: int
    source: str  # "max_total_tokens" | "mem_fraction_static" | "cpu_ram"


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise SglxError(f"--device {name}: CUDA is not available on this machine (torch {torch.__version__}); "
                        "use --device cpu.")
    return torch.device(name)


def snapshot_for(device: torch.device, snap: PlatformSnapshot | None = None) -> PlatformSnapshot:
    """The platform snapshot selection sees: the real one (or `snap`), but CPU-only when the user chose --device cpu."""
    from sglx import platform

    snap = snap or platform.current()
    if device.type == "cpu" and snap.device_kind != "cpu":
        snap = replace(snap, device_kind="cpu", gpus=())
    return snap


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype]


def _free_cpu_bytes() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 8 << 30


class ModelRunner:
    """Owns the model, the KV pools and the attention backend(s); `forward(batch)` runs one step.

    With `dist` (tensor parallelism, see sglx.llm.tp_runtime) this runner is one rank: its model holds that
    rank's weight shards, and its KV pool and backend that rank's heads (`local_heads`).
    """

    def __init__(self, config: EngineConfig, dist: DistContext | None = None,
                 platform_snapshot: PlatformSnapshot | None = None) -> None:
        """platform_snapshot: the machine as rank 0 saw it (worker ranks skip probing every kernel package and
        select exactly the backends rank 0 selected)."""
        from sglx.llm.layers.parallel import TensorParallel, check_tp_supported, use_tp

        self.config = config
        self.dist = dist
        self.tp = TensorParallel(dist.rank, dist.world_size, dist) if dist is not None else TensorParallel()
        self.model_path = config.resolved_model_path()
        self.device = dist.device if dist is not None else resolve_device(config.device)
        self.model_config: ModelConfig = load_model_config(self.model_path)
        check_tp_supported(self.model_config, self.tp.size)
        self.local_heads = (self.tp.split(self.model_config.num_heads)[1],
                            self.tp.kv_heads(self.model_config.num_kv_heads)[1])
        # rank 0 of a tensor-parallel group: sends each step to the other ranks first (tp_runtime.TPDriver)
        self.tp_driver: Any = None
        from sglx.llm.models import load_model, resolve_dtype

        self.dtype = resolve_dtype(config.dtype, self.model_config, self.device)
        self.selection: LLMSelection = select_llm(
            snapshot_for(self.device, platform_snapshot),
            self.model_config.attention_traits(_dtype_name(self.dtype)),
            LLMBackendArgs(attention_backend=config.attention_backend,
                           prefill_attention_backend=config.prefill_attention_backend,
                           decode_attention_backend=config.decode_attention_backend,
                           page_size=config.page_size, kv_cache_dtype=config.kv_cache_dtype),
        )
        self.page_size = self.selection.page_size
        self.backend_configs = self._backend_configs()
        with use_tp(self.tp):
            self.model, self.model_config = load_model(self.model_path, self.dtype, self.device,
                                                       load_format=config.load_format, seed=config.seed)
        self.memory = self._plan_memory()
        self.req_to_token_pool = ReqToTokenPool(self.memory.max_running_requests, self.memory.context_length + 1,
                                                device=self.device)
        self.token_kv_pool = self._kv_pool(self.memory.num_slots, self.page_size, self.device)
        self.backend = self._build_backend()
        self.cuda_graph: CudaGraphPlan = cuda_graph_plan(
            self.device, self.selection.decode, bool(self.backend.supports_cuda_graph), config.disable_cuda_graph,
            config.cuda_graph_max_bs, self.memory.max_running_requests)
        blocker = getattr(self.model, "cuda_graph_blocker", None)
        why_not = blocker(self.dtype, self.device) if blocker is not None else None
        if self.cuda_graph.enabled and why_not:  # the model has host syncs (MoE expert loop)
            self.cuda_graph = replace(self.cuda_graph, enabled=False, batch_sizes=(), why=why_not)
        self.graph_runner: CudaGraphRunner | None = None
        self.prefill_graph: PrefillGraphPlan = prefill_graph_plan(
            self.cuda_graph.enabled, self.cuda_graph.why, self.selection.prefill,
            bool(self.backend.supports_prefill_cuda_graph), config.cuda_graph_max_prefill_tokens,
            self.memory.context_length, self.tp.size, mla=self.model_config.mla is not None)
        self.prefill_graph_runner: PrefillGraphRunner | None = None
        # argmax of the latest forward's logits when a CUDA graph computed it (else None): the sampler's
        # greedy rows and bench one-batch read it instead of launching an argmax
        self.last_greedy_ids: torch.Tensor | None = None
        # fp8 KV scales calibrated from the first prefill are baked into captured graphs: capture after that batch
        self.graphs_wait_for_scales = self.cuda_graph.enabled and getattr(self.token_kv_pool, "calibrating", False)
        if self.graphs_wait_for_scales:
            log.info("CUDA graphs are captured after the first prefill batch calibrates the fp8 KV scales")
        elif self.cuda_graph.enabled:
            self._capture_graphs()
        else:
            log.info("CUDA graphs off: %s", self.cuda_graph.why)

    # ------------------------------------------------------------------ setup

    def _capture_graphs(self) -> None:
        target = GraphTarget(device=self.device, model=self.model, backend=self.backend,
                             req_to_token_pool=self.req_to_token_pool, token_kv_pool=self.token_kv_pool)
        self.graph_runner = CudaGraphRunner(target, self.cuda_graph)
        if self.prefill_graph.enabled:
            self.prefill_graph_runner = PrefillGraphRunner(target, self.prefill_graph)

    def _backend_configs(self) -> dict[str, dict]:
        """--attention-backend-config validated against each chosen backend's declared parameters."""
        text = self.config.attention_backend_config
        names = dict.fromkeys((self.selection.prefill, self.selection.decode))
        if not text:
            return {n: {} for n in names}
        from sglx.attention.config import load_backend_config, split_backend_prefix
        from sglx.errors import ConfigError

        def spec_of(name: str) -> BackendSpec:
            spec = find(name, "llm", self.model_config.attention_kind)  # type: ignore[arg-type]
            assert spec is not None
            return spec

        target, body = split_backend_prefix(text, set(backend_names("llm")))
        if target is not None:  # `flashinfer:decode_tensor_cores=off`: that backend only, validated strictly
            if target not in names:
                raise SglxError(f"--attention-backend-config {text!r}: {target} is not a backend of this run "
                                f"(prefill {self.selection.prefill}, decode {self.selection.decode}); name one of "
                                f"them, or drop the '{target}:' prefix")
            try:
                return {n: dict(load_backend_config(spec_of(n), body).values) if n == target else {} for n in names}
            except ConfigError as exc:
                raise SglxError(str(exc)) from None
        out: dict[str, dict] = {}
        errors: list[str] = []
        for name in names:  # no prefix: each backend of a hybrid pair takes the keys it declares
            try:
                out[name] = dict(load_backend_config(spec_of(name), text).values)
            except ConfigError as exc:
                errors.append(str(exc))
                out[name] = {}
        if len(errors) == len(names):
            raise SglxError(errors[0])
        return out

    def _plan_memory(self) -> MemoryPlan:
        cfg, mc = self.config, self.model_config
        context = cfg.context_length or mc.max_position_embeddings
        per_token = self._kv_pool(0, 1, "meta").bytes_per_token()
        default_running = DEFAULT_CPU_MAX_RUNNING if self.device.type == "cpu" else DEFAULT_GPU_MAX_RUNNING
        max_running = cfg.max_running_requests or default_running
        row_bytes = (context + 1) * 4
        if cfg.max_total_tokens is not None:
            slots, source = cfg.max_total_tokens, "max_total_tokens"
        elif self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            free, total = torch.cuda.mem_get_info(self.device)
            fraction = cfg.mem_fraction_static or DEFAULT_GPU_MEM_FRACTION
            budget = total * fraction - (total - free) - max_running * row_bytes
            slots, source = int(budget // per_token), "mem_fraction_static"
            if slots < 4 * self.page_size:
                used = (total - free) / 2**30
                raise SglxError(
                    f"no GPU memory left for the KV cache: --mem-fraction-static {fraction} of "
                    f"{total / 2**30:.1f} GiB, and {used:.1f} GiB are already in use (weights and others). "
                    "Raise --mem-fraction-static, lower --max-running-requests, or set --max-total-tokens.")
        else:
            fraction = cfg.mem_fraction_static or DEFAULT_CPU_RAM_FRACTION
            budget = int(_free_cpu_bytes() * fraction)
            cap = max(CPU_MAX_CONTEXTS * context, CPU_MIN_TOKENS)
            slots, source = min(budget // per_token, cap), "cpu_ram"
        if source != "max_total_tokens":  # more KV than every running request at full context is never used
            slots = min(slots, max_running * context)
        slots -= slots % self.page_size
        if slots < self.page_size * 2:
            raise SglxError(f"the KV pool would hold only {slots} tokens (page size {self.page_size}); "
                            "set --max-total-tokens to at least two pages.")
        max_running = max(1, min(max_running, slots))
        if self.dist is not None and self.dist.active:  # every rank must address the same slots and rows
            agreed = torch.tensor([slots, max_running], dtype=torch.int64, device=self.device)
            self.dist.all_reduce(agreed, op="min")
            slots, max_running = (int(x) for x in agreed.tolist())
        return MemoryPlan(slots, per_token, max_running, context, source)

    def _kv_pool(self, num_slots: int, page_size: int, device: torch.device | str) -> TokenKVPool | MLATokenKVPool:
        """Per-head K/V buffers, or for MLA models one latent (kv_lora_rank + qk_rope_head_dim) per token."""
        mc, kv_dtype = self.model_config, self.config.kv_cache_dtype
        if mc.mla is not None:
            return MLATokenKVPool(num_slots, page_size, mc.num_layers, mc.mla.kv_lora_rank, mc.mla.qk_rope_head_dim,
                                  self.dtype, kv_dtype, device)
        # fp8: per-token scales when every selected backend reads them (AttentionBackend.kv_scales_per_token)
        specs = [find(name, "llm", mc.attention_kind) for name in {self.selection.prefill, self.selection.decode}]  # type: ignore[arg-type]
        per_token = self.config.kv_cache_scales == "auto" and all(
            spec is not None and getattr(spec.load(), "kv_scales_per_token", False) for spec in specs)
        pool = TokenKVPool(num_slots, page_size, mc.num_layers, self.local_heads[1], mc.head_dim, self.dtype,
                           kv_dtype, device, per_token_scales=per_token)
        checkpoint_scales = getattr(getattr(self, "model", None), "kv_cache_scales", None)
        if checkpoint_scales is not None:  # fp8 KV: the checkpoint's static k_scale/v_scale win over everything
            pool.set_static_scales(*checkpoint_scales)
            pool.scale_source = "checkpoint"
        elif pool.is_fp8 and not per_token and self.config.kv_cache_scales != "one":
            # one scale per layer (FlashInfer, XQA): from the first prefill over rotated keys, then frozen
            # (embedded model, e4m3: 85-88.5% recall vs 52-54% with 1.0; docs/benchmarks.md)
            pool.calibrate_static_scales(rotate_keys=True)
        skip = self.config.kv_cache_skip_layers()
        if skip and pool.is_fp8:  # layers kept in the model dtype; every selected backend must read such a pool
            if not hasattr(pool, "keep_unquantized"):
                raise SglxError("--kv-cache-dtype-skip-layers: not available for MLA models (one latent pool); "
                                "drop the flag")
            unable = sorted(spec.name for spec in specs
                            if spec is not None and not getattr(spec.load(), "kv_dtype_per_layer", False))
            if unable:
                raise SglxError(f"--kv-cache-dtype-skip-layers {','.join(map(str, skip))}: attention backend "
                                f"{', '.join(unable)} reads every layer's KV in one dtype; use flashinfer, "
                                "trtllm_mha or torch_native, or drop the flag")
            pool.keep_unquantized(skip)
        if pool.is_fp8:
            log.info("fp8 KV scales: %s", pool.describe_scales())
        return pool

    def _build_backend(self) -> AttentionBackend:
        sel = self.selection
        mc = self.model_config
        pool = self.token_kv_pool

        def make(name: str) -> AttentionBackend:
            spec = find(name, "llm", mc.attention_kind)  # type: ignore[arg-type]
            assert spec is not None
            ctx = BackendContext(device=self.device, dtype=self.dtype, num_q_heads=self.local_heads[0],
                                 num_kv_heads=pool.num_kv_heads, head_dim=pool.head_dim, page_size=self.page_size,
                                 req_to_token_pool=self.req_to_token_pool, token_kv_pool=self.token_kv_pool,
                                 config=self.backend_configs.get(name, {}))
            return spec.load()(ctx)

        if not sel.hybrid:
            return make(sel.decode)
        from sglx.attention.llm.hybrid import HybridAttentionBackend

        prefill, decode = make(sel.prefill), make(sel.decode)
        return HybridAttentionBackend(decode.ctx, prefill, decode)

    # ------------------------------------------------------------------ running

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """float32 logits [batch_size, vocab] of each request's last token (every token if return_all_logits)."""
        if self.tp_driver is not None:
            return self.tp_driver.forward(batch, self._forward)
        return self._forward(batch)

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        batch.attn_backend = self.backend
        self.last_greedy_ids = None
        if self.graph_runner is not None and self.graph_runner.can_run(batch):
            logits = self.graph_runner.replay(batch)
            self.last_greedy_ids = self.graph_runner.last_greedy
            return logits
        if self.prefill_graph_runner is not None and self.prefill_graph_runner.can_run(batch):
            logits = self.prefill_graph_runner.replay(batch)
            self.last_greedy_ids = self.prefill_graph_runner.last_greedy
            return logits
        self.backend.init_forward_metadata(batch)
        logits = self.model(batch).float()
        if self.graphs_wait_for_scales and not self.token_kv_pool.calibrating:
            self.graphs_wait_for_scales = False
            self._capture_graphs()
        return logits

    def release_memory(self) -> None:
        """Free weights, KV pools and backend state (the runner is unusable afterwards)."""
        import gc

        if self.tp_driver is not None:  # rank 0: stop the worker ranks first
            self.tp_driver.shutdown()
        for name in ("graph_runner", "prefill_graph_runner", "model", "backend", "token_kv_pool", "req_to_token_pool"):
            if hasattr(self, name):
                delattr(self, name)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def describe(self) -> dict[str, object]:
        sel = self.selection
        return {
            "attention_backend": sel.label,
            "prefill_attention_backend": sel.prefill,
            "decode_attention_backend": sel.decode,
            "selection": sel.source,
            "why": sel.why,
            "page_size": self.page_size,
            "kv_cache_dtype": self.config.kv_cache_dtype,
            "dtype": _dtype_name(self.dtype),
            "device": str(self.device),
            "tp_size": self.tp.size,
            "max_total_tokens": self.memory.num_slots,
            "max_running_requests": self.memory.max_running_requests,
            "context_length": self.memory.context_length,
            "cuda_graph": self.cuda_graph.enabled,
            "cuda_graph_max_bs": self.cuda_graph.max_bs if self.cuda_graph.enabled else None,
            "cuda_graph_why": self.cuda_graph.why,
            "prefill_cuda_graph": self.prefill_graph.enabled,
            "prefill_cuda_graph_max_tokens": self.prefill_graph.max_tokens if self.prefill_graph.enabled else None,
            "prefill_cuda_graph_why": self.prefill_graph.why,
            "kv_cache_scales": self.token_kv_pool.describe_scales() if hasattr(self.token_kv_pool, "describe_scales")
            else None,
        }
