"""DiffusionEngine: load a diffusion model once, then turn requests into frames.

The diffusion half of sglx's one engine: it takes the same EngineConfig as the LLM engine, asks the same
registry for the attention backend, and runs either a native sglx pipeline (`--backend sglx`, every DiT
attention through sglx) or diffusers' own pipeline (`--backend diffusers`, for families sglx does not run
natively, and as the same-run peer in benchmarks).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from sglx.diffusion.loader import ModelIndex, read_model_index
from sglx.diffusion.pipelines.base import ProgressFn, to_uint8
from sglx.diffusion.request import DiffusionDefaults, DiffusionRequest, DiffusionResult, ResolvedRequest, StageTimings
from sglx.errors import SglxError
from sglx.llm.engine_config import EngineConfig

BACKENDS = ("sglx", "diffusers")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# EngineConfig fields that only mean something to an LLM; giving one for a diffusion model is an error.
LLM_ONLY_FLAGS = {
    "tokenizer_path": "--tokenizer-path", "prefill_attention_backend": "--prefill-attention-backend",
    "decode_attention_backend": "--decode-attention-backend", "page_size": "--page-size",
    "kv_cache_dtype": "--kv-cache-dtype", "mem_fraction_static": "--mem-fraction-static",
    "max_total_tokens": "--max-total-tokens", "max_running_requests": "--max-running-requests",
    "chunked_prefill_size": "--chunked-prefill-size", "max_prefill_tokens": "--max-prefill-tokens",
    "enable_mixed_chunk": "--enable-mixed-chunk", "disable_radix_cache": "--disable-radix-cache",
    "context_length": "--context-length", "cuda_graph_max_bs": "--cuda-graph-max-bs",
    "disable_cuda_graph": "--disable-cuda-graph", "disable_overlap_schedule": "--disable-overlap-schedule",
    "tp_size": "--tp-size",
    "dp_size": "--dp-size",
}


def resolve_diffusion_model_path(model_path: str | None) -> Path | None:
    """The model directory when `model_path` names a diffusion model (a folder or an embedded name), else None."""
    if model_path is None:
        return None
    from sglx.diffusion.embedded import resolve_embedded

    embedded = resolve_embedded(model_path)
    if embedded is not None:
        return embedded
    path = Path(model_path).expanduser()
    return path if (path / "model_index.json").is_file() else None


def _llm_flags_given(config: EngineConfig) -> list[str]:
    default = EngineConfig()
    return [flag for name, flag in LLM_ONLY_FLAGS.items() if getattr(config, name) != getattr(default, name)]


def _model_defaults(index: ModelIndex, family_defaults: DiffusionDefaults) -> DiffusionDefaults:
    """A model directory may carry `sglx.json` {"defaults": {...}} (the embedded models do)."""
    path = index.path / "sglx.json"
    if not path.is_file():
        return family_defaults
    try:
        raw = json.loads(path.read_text(encoding="utf-8")).get("defaults", {})
    except (OSError, json.JSONDecodeError, AttributeError) as exc:
        raise SglxError(f"{path}: not a JSON object with \"defaults\" ({exc})") from exc
    known = {f.name for f in fields(DiffusionDefaults)}
    return replace(family_defaults, **{k: v for k, v in raw.items() if k in known})


def resolve_device(name: str) -> torch.device:
    from sglx.llm.model_runner import resolve_device as llm_resolve_device

    return llm_resolve_device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def _transformer_attention_shape(index: ModelIndex) -> tuple[int | None, int | None]:
    """(heads, head_dim) from transformer/config.json, read before any weights load."""
    try:
        cfg = json.loads((index.path / "transformer" / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None, None
    return cfg.get("num_attention_heads"), cfg.get("attention_head_dim")


@dataclass(frozen=True)
class BackendChoice:
    name: str
    source: str  # auto | cli | forced
    why: str
    config: dict[str, Any]


class DiffusionEngine:
    """One loaded diffusion model. `generate` runs one request at a time (a lock serialises callers)."""

    def __init__(self, config: EngineConfig, backend: str = "sglx") -> None:
        if backend not in BACKENDS:
            raise SglxError(f"--backend {backend}: choose one of {', '.join(BACKENDS)}")
        path = resolve_diffusion_model_path(config.model_path)
        if path is None:
            read_model_index(config.model_path or ".")  # raises the precise reason
        assert path is not None
        given = _llm_flags_given(config)
        if given:
            raise SglxError(f"{', '.join(given)} only apply to LLMs; {config.model_path} is a diffusion model "
                            "(drop them)")
        self.config = config
        self.backend_kind = backend
        self.index = read_model_index(path)
        self.device = resolve_device(config.device)
        self.sp: Any = None  # SequenceParallelRuntime under --sp-size N > 1 (sglx.diffusion.parallel)
        if backend == "sglx":
            heads, head_dim = _transformer_attention_shape(self.index)
            self.sp = self._sequence_parallel(heads)
        else:
            from sglx.diffusion.parallel.runtime import check_native_backend

            check_native_backend(config, backend)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self._lock = threading.Lock()
        torch.manual_seed(config.seed)
        if backend == "sglx":
            from sglx.diffusion.families import native_pipeline_class

            cls = native_pipeline_class(self.index)
            self.attention = self._select_attention(head_dim)
            attn_backend = self._make_backend(self.attention)
            if self.sp is not None:
                attn_backend = self.sp.wrap(attn_backend)
            self.pipeline = cls.load(self.index, self.device, self.dtype, attn_backend,
                                     _model_defaults(self.index, cls.family_defaults()))
            if self.sp is not None:
                self.sp.install(self.pipeline)
            self.defaults = self.pipeline.defaults
        else:
            from sglx.diffusion.diffusers_runner import DiffusersRunner

            self.attention = BackendChoice(config.attention_backend or "diffusers default", "cli" if
                                           config.attention_backend else "auto", "diffusers' set_attention_backend",
                                           {})
            self.pipeline = DiffusersRunner.load(self.index, self.device, self.dtype, config.attention_backend)
            self.defaults = _model_defaults(self.index, self.pipeline.defaults)

    def _sequence_parallel(self, heads: int | None) -> Any:
        """The sequence-parallel runtime for --sp-size/--ulysses-degree/--ring-degree, or None for one rank."""
        from sglx.diffusion.parallel.runtime import SequenceParallelRuntime, requested_degrees

        degrees = requested_degrees(self.config, heads)
        if not degrees.active:
            return None
        runtime = SequenceParallelRuntime.start(degrees, self.device)
        if self.device.type == "cuda":  # one GPU per rank: the one torch.distributed set up for this rank
            self.device = torch.device("cuda", torch.cuda.current_device())
        return runtime

    @property
    def is_driver(self) -> bool:
        """Rank 0 under sequence parallelism (it decodes and writes); always True on one rank."""
        return self.sp is None or self.sp.is_driver

    # ------------------------------------------------------------------------------------ attention choice

    def _select_attention(self, head_dim: int | None) -> BackendChoice:
        from sglx.attention.config import load_backend_config
        from sglx.attention.registry import find
        from sglx.attention.request import AttentionRequest
        from sglx.attention.selection import select_diffusion
        from sglx.llm.model_runner import snapshot_for

        snap = snapshot_for(self.device)
        dtype_name = {v: k for k, v in DTYPES.items()}[self.dtype]
        req = AttentionRequest(family="diffusion", kind="dit", dtype=dtype_name, head_dim=head_dim)
        sel = select_diffusion(snap, req, cli_backend=self.config.attention_backend)
        spec = find(sel.backend, "diffusion", "dit")
        assert spec is not None
        cfg = load_backend_config(spec, self.config.attention_backend_config)
        return BackendChoice(sel.backend, sel.source, sel.why, cfg.as_dict())

    @staticmethod
    def _make_backend(choice: BackendChoice) -> Any:
        from sglx.attention.registry import find

        spec = find(choice.name, "diffusion", "dit")
        assert spec is not None
        return spec.load()(choice.config)

    # ------------------------------------------------------------------------------------------- running

    def resolve(self, request: DiffusionRequest) -> ResolvedRequest:
        req = request.resolved(self.defaults, self.config.seed)
        self.pipeline.validate(req)
        return req

    def generate(self, request: DiffusionRequest, progress: ProgressFn | None = None) -> DiffusionResult:
        req = self.resolve(request)
        with self._lock:
            try:
                frames, times = self.pipeline.generate_tensor(req, progress)
            except torch.OutOfMemoryError as exc:
                raise SglxError(f"out of GPU memory at {req.num_frames}x{req.height}x{req.width}: lower --height/"
                                "--width/--num-frames, or free the GPU") from exc
        timings = StageTimings(times.get("text_encode", 0.0), times.get("denoise", 0.0), times.get("vae_decode", 0.0))
        return DiffusionResult(to_uint8(frames), req, timings, self.attention.name)

    @property
    def info(self) -> dict[str, Any]:
        return {"model_path": str(self.index.path), "pipeline": self.index.pipeline_class,
                "backend": self.backend_kind, "attention_backend": self.attention.name,
                "attention_source": self.attention.source, "attention_why": self.attention.why,
                "attention_backend_config": self.attention.config, "device": str(self.device),
                "sequence_parallel": None if self.sp is None else self.sp.degrees.describe(),
                "dtype": str(self.dtype).removeprefix("torch."),
                "defaults": {f.name: getattr(self.defaults, f.name) for f in fields(self.defaults)}}

    def close(self) -> None:
        self.pipeline = None  # type: ignore[assignment]
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def __enter__(self) -> DiffusionEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
