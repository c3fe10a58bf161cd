"""Every engine flag in one frozen object, validated once with messages a user can act on.

`sglx generate`, `sglx serve` and `sglx.Engine(...)` all build this object; names and defaults follow
SGLang's server arguments so the flags users know mean the same thing here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from sglx.errors import SglxError

DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")
KV_CACHE_DTYPE_CHOICES = ("auto", "fp8_e4m3", "fp8_e5m2")
KV_CACHE_SCALES_CHOICES = ("auto", "calibrate", "one")
LOAD_FORMAT_CHOICES = ("auto", "safetensors", "dummy")
DEVICE_CHOICES = ("auto", "cpu", "cuda")
DEFAULT_CHUNKED_PREFILL_SIZE = 8192
DEFAULT_MAX_PREFILL_TOKENS = 16384


@dataclass(frozen=True)
class EngineConfig:
    """Engine flags as given; None means "let the engine decide" (documented per field)."""

    model_path: str | None = None  # None: the embedded tiny model shipped with sglx
    tokenizer_path: str | None = None  # None: the model directory
    load_format: str = "auto"  # auto | safetensors | dummy (random weights, for benchmarks)
    dtype: str = "auto"  # auto = the checkpoint's dtype
    device: str = "auto"  # auto = cuda when available, else cpu
    attention_backend: str | None = None  # None: auto selection
    prefill_attention_backend: str | None = None  # overrides the prefill phase only
    decode_attention_backend: str | None = None  # overrides the decode phase only
    attention_backend_config: str | None = None  # file, JSON or k=v pairs (sglx.attention.config)
    page_size: int | None = None  # None: what the chosen backends accept (1 for torch_native)
    kv_cache_dtype: str = "auto"
    # fp8 KV scales when the checkpoint has no k_scale/v_scale (its scales always win): auto = per token where
    # every selected backend reads them, else calibrate; calibrate = one K/V scale per layer from the first
    # prefill batch over rotated keys, then frozen; one = 1.0 per layer (vLLM/SGLang without scales)
    kv_cache_scales: str = "auto"
    # fp8 KV with one scale per layer: these layers (comma-separated indices) keep the model dtype (vLLM's
    # kv_cache_dtype_skip_layers); for layers whose keys need more than e4m3's mantissa (sglx.llm.kv_cache)
    kv_cache_dtype_skip_layers: str | None = None
    mem_fraction_static: float | None = None  # GPU: share of device memory for weights + KV (default 0.85)
    max_total_tokens: int | None = None  # KV pool size in tokens; overrides mem_fraction_static
    max_running_requests: int | None = None  # None: derived from the pool size
    chunked_prefill_size: int | None = None  # None: 8192; -1 disables chunked prefill
    max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS  # token budget of one prefill batch
    enable_mixed_chunk: bool = False  # run decodes in the same step as a prefill chunk
    disable_radix_cache: bool = False
    context_length: int | None = None  # None: the model's max_position_embeddings
    seed: int = 0  # seeds dummy weights and the sampling of requests without their own seed
    cuda_graph_max_bs: int | None = None  # largest decode batch replayed from a CUDA graph (None: 160)
    disable_cuda_graph: bool = False  # run every decode step (and short prefill) eagerly
    cuda_graph_max_prefill_tokens: int | None = None  # longest single-request prefill from a graph (None: 1024)
    disable_overlap_schedule: bool = False  # read each step's tokens before scheduling the next (sglx.llm.overlap)
    stream_interval: int = 1  # streamed requests get a chunk every this many tokens (SGLang's --stream-interval)
    sp_size: int | None = None  # diffusion: sequence-parallel ranks = ulysses x ring (sglx.diffusion.parallel)
    ulysses_degree: int | None = None  # diffusion: ranks splitting attention heads (all-to-all)
    ring_degree: int | None = None  # diffusion: ranks passing key/value blocks around a ring
    tp_size: int = 1  # tensor-parallel ranks (processes; one GPU each on CUDA), see sglx.llm.tp_runtime
    dp_size: int = 1  # data-parallel engine replicas behind one `sglx serve` endpoint (sglx.server.dp_router)

    def __post_init__(self) -> None:
        problems: list[str] = []

        def choice(flag: str, value: str, choices: tuple[str, ...]) -> None:
            if value not in choices:
                problems.append(f"{flag} {value}: choose one of {', '.join(choices)}")

        choice("--load-format", self.load_format, LOAD_FORMAT_CHOICES)
        choice("--dtype", self.dtype, DTYPE_CHOICES)
        choice("--kv-cache-dtype", self.kv_cache_dtype, KV_CACHE_DTYPE_CHOICES)
        choice("--kv-cache-scales", self.kv_cache_scales, KV_CACHE_SCALES_CHOICES)
        try:
            self.kv_cache_skip_layers()
        except ValueError:
            problems.append(f"--kv-cache-dtype-skip-layers {self.kv_cache_dtype_skip_layers}: give layer indices "
                            "separated by commas, e.g. 1 or 0,5")
        if self.device not in DEVICE_CHOICES and not self.device.startswith("cuda:"):
            problems.append(f"--device {self.device}: choose one of {', '.join(DEVICE_CHOICES)} (or cuda:N)")
        for flag, value, low in (("--page-size", self.page_size, 1),
                                 ("--max-total-tokens", self.max_total_tokens, 1),
                                 ("--max-running-requests", self.max_running_requests, 1),
                                 ("--max-prefill-tokens", self.max_prefill_tokens, 1),
                                 ("--context-length", self.context_length, 2),
                                 ("--cuda-graph-max-bs", self.cuda_graph_max_bs, 1),
                                 ("--cuda-graph-max-prefill-tokens", self.cuda_graph_max_prefill_tokens, 0),
                                 ("--sp-size", self.sp_size, 1),
                                 ("--ulysses-degree", self.ulysses_degree, 1),
                                 ("--ring-degree", self.ring_degree, 1),
                                 ("--tp-size", self.tp_size, 1),
                                 ("--dp-size", self.dp_size, 1),
                                 ("--stream-interval", self.stream_interval, 1)):
            if value is not None and value < low:
                problems.append(f"{flag} {value}: must be an integer >= {low}")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size == 0 or (
                self.chunked_prefill_size is not None and self.chunked_prefill_size < -1):
            problems.append(f"--chunked-prefill-size {self.chunked_prefill_size}: give a positive size, "
                            "or -1 to disable chunked prefill")
        if (self.page_size and self.chunked_prefill_size and self.chunked_prefill_size > 0
                and self.chunked_prefill_size < self.page_size):
            problems.append(f"--chunked-prefill-size {self.chunked_prefill_size} is smaller than "
                            f"--page-size {self.page_size}; a chunk must hold at least one page")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            problems.append(f"--mem-fraction-static {self.mem_fraction_static}: must be between 0 and 1 "
                            "(e.g. 0.85)")
        if self.model_path is not None and not str(self.model_path).strip():
            problems.append("--model-path is empty")
        if problems:
            raise SglxError("invalid engine options:\n" + "\n".join(f"  - {p}" for p in problems))

    def kv_cache_skip_layers(self) -> tuple[int, ...]:
        """--kv-cache-dtype-skip-layers as sorted unique layer indices (ValueError when malformed)."""
        text = (self.kv_cache_dtype_skip_layers or "").strip()
        layers = sorted({int(x) for x in text.split(",")}) if text else []
        if any(i < 0 for i in layers):
            raise ValueError(text)
        return tuple(layers)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from keyword flags (Engine(**flags)); unknown names are an error, not silently ignored."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise SglxError(f"unknown engine option(s): {', '.join(unknown)}. Known: {', '.join(sorted(known))}")
        if kwargs.get("model_path") is not None:
            kwargs["model_path"] = str(kwargs["model_path"])
        return cls(**kwargs)

    def resolved_model_path(self) -> str:
        if self.model_path is not None:
            return str(Path(self.model_path).expanduser()) if Path(self.model_path).expanduser().exists() \
                else self.model_path
        from sglx.llm.embedded import default_model_path

        return str(default_model_path())

    @property
    def chunked_prefill(self) -> int | None:
        """The chunk size in tokens, or None when chunked prefill is disabled."""
        if self.chunked_prefill_size is None:
            return DEFAULT_CHUNKED_PREFILL_SIZE
        return None if self.chunked_prefill_size < 0 else self.chunked_prefill_size

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
