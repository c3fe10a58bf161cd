"""The engine flags, defined once for every command that runs an LLM engine (`generate`, `serve`, ...).

`@with_engine_options` appends all of them to a typer command's signature; the command receives one
validated `engine_config: EngineConfig` instead of twenty arguments. Backend choices come from the
registry, so a new backend appears in `--help`, validation and completions without touching this file.
"""

from __future__ import annotations

import enum
import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import typer

from sglx.errors import SglxError
from sglx.llm.engine_config import (
    DEFAULT_CHUNKED_PREFILL_SIZE,
    DEFAULT_MAX_PREFILL_TOKENS,
    DEVICE_CHOICES,
    DTYPE_CHOICES,
    KV_CACHE_DTYPE_CHOICES,
    KV_CACHE_SCALES_CHOICES,
    LOAD_FORMAT_CHOICES,
    EngineConfig,
)

PANEL = "Engine options"
PREFIX = "engine__"

F = TypeVar("F", bound=Callable[..., Any])


def llm_backend_names() -> tuple[str, ...]:
    from sglx.attention.registry import backend_names

    return backend_names("llm")


def attention_backend_names() -> tuple[str, ...]:
    """--attention-backend takes LLM and diffusion backends, and diffusers' names under --backend diffusers."""
    from sglx.attention.registry import backend_names
    from sglx.diffusion.diffusers_names import DIFFUSERS_ATTENTION_BACKENDS

    names = [*backend_names("llm"), *backend_names("diffusion")]
    names += [n for n in DIFFUSERS_ATTENTION_BACKENDS if n not in names]
    return tuple(dict.fromkeys(names))


@dataclass(frozen=True)
class EngineFlag:
    """One engine flag: the EngineConfig field it sets, its CLI spelling, type, default and help."""

    field: str
    flag: str
    annotation: Any
    default: Any
    help: str
    choices: Callable[[], Sequence[str]] | Sequence[str] | None = None
    aliases: tuple[str, ...] = ()  # other spellings of the flag (e.g. --tp for --tp-size)

    def choice_enum(self) -> type[enum.Enum] | None:
        """A str Enum of the allowed values: typer turns it into a validated choice list in --help."""
        if self.choices is None:
            return None
        names = self.choices() if callable(self.choices) else self.choices
        return enum.Enum(self.field, {n: n for n in names}, type=str)  # type: ignore[return-value]

    def annotation_for_typer(self) -> Any:
        choices = self.choice_enum()
        if choices is None:
            return self.annotation
        return choices | None if self.default is None else choices

    def option(self) -> Any:
        kwargs: dict[str, Any] = {"help": self.help, "rich_help_panel": PANEL,
                                  "show_default": self.default not in (None, False)}
        if self.choices is not None:
            kwargs["case_sensitive"] = False
        return typer.Option(self.default, self.flag, *self.aliases, **kwargs)


ENGINE_FLAGS: tuple[EngineFlag, ...] = (
    EngineFlag("model_path", "--model-path", str | None, None,
               "Hugging Face model directory (config.json, *.safetensors, tokenizer.json), a diffusers model "
               "directory (model_index.json), an embedded model (tiny-shapes), or a shipped config name with "
               "--load-format dummy. Default: the tiny LLM embedded in sglx."),
    EngineFlag("tokenizer_path", "--tokenizer-path", str | None, None, "Tokenizer directory (default: the model's)."),
    EngineFlag("load_format", "--load-format", str, "auto",
               "Weights: safetensors from the model directory, or dummy random weights (benchmarks).",
               LOAD_FORMAT_CHOICES),
    EngineFlag("dtype", "--dtype", str, "auto", "Compute dtype; auto = the checkpoint's.", DTYPE_CHOICES),
    EngineFlag("device", "--device", str, "auto", "Device; auto = cuda when available, else cpu.", DEVICE_CHOICES),
    EngineFlag("attention_backend", "--attention-backend", str | None, None,
               "Attention backend: for LLMs prefill and decode, for diffusion models every DiT attention; with "
               "--backend diffusers, diffusers' own backend name (default: auto selection; see `sglx doctor`).",
               attention_backend_names),
    EngineFlag("prefill_attention_backend", "--prefill-attention-backend", str | None, None,
               "Backend for prefill (EXTEND) steps only; the decode phase keeps the other choice.", llm_backend_names),
    EngineFlag("decode_attention_backend", "--decode-attention-backend", str | None, None,
               "Backend for DECODE steps only; the prefill phase keeps the other choice.", llm_backend_names),
    EngineFlag("attention_backend_config", "--attention-backend-config", str | None, None,
               "Backend parameters: a .json/.yaml file, a JSON object, or k=v pairs; prefix a backend name "
               "(flashinfer:decode_tensor_cores=off) to give them to one backend of a prefill/decode pair."),
    EngineFlag("page_size", "--page-size", int | None, None,
               "Tokens per KV-cache page (default: what the backend needs; 1 = token-level prefix reuse)."),
    EngineFlag("kv_cache_dtype", "--kv-cache-dtype", str, "auto",
               "KV-cache storage dtype; fp8 stores uint8 with scales (see --kv-cache-scales).", KV_CACHE_DTYPE_CHOICES),
    EngineFlag("kv_cache_scales", "--kv-cache-scales", str, "auto",
               "fp8 KV scales when the checkpoint has no k_scale/v_scale (which always win): auto = per token and "
               "head where every chosen backend reads them (triton, torch_native), else calibrate; calibrate = one "
               "scale per layer from the first prefill batch (amax/200 for K over rotated keys, amax/100 for V), "
               "then frozen; one = 1.0 per layer.", KV_CACHE_SCALES_CHOICES),
    EngineFlag("kv_cache_dtype_skip_layers", "--kv-cache-dtype-skip-layers", str | None, None,
               "fp8 KV with one scale per layer (flashinfer, trtllm_mha, checkpoint scales): keep these layers "
               "(comma-separated indices, e.g. 1) in the model dtype."),
    EngineFlag("mem_fraction_static", "--mem-fraction-static", float | None, None,
               "GPU: share of device memory for weights + KV cache (default 0.85); CPU: share of free RAM "
               "for the KV cache (default 0.25)."),
    EngineFlag("max_total_tokens", "--max-total-tokens", int | None, None,
               "KV-cache size in tokens (overrides --mem-fraction-static)."),
    EngineFlag("max_running_requests", "--max-running-requests", int | None, None,
               "Most requests decoding at once (default: 256 on CPU, 2048 on GPU, at most the pool size)."),
    EngineFlag("chunked_prefill_size", "--chunked-prefill-size", int | None, None,
               f"Split prompts into prefill chunks of this many tokens (default {DEFAULT_CHUNKED_PREFILL_SIZE}; "
               "-1 disables)."),
    EngineFlag("max_prefill_tokens", "--max-prefill-tokens", int, DEFAULT_MAX_PREFILL_TOKENS,
               "Token budget of one prefill batch."),
    EngineFlag("enable_mixed_chunk", "--enable-mixed-chunk", bool, False,
               "Run running decodes in the same step as a prefill chunk (MIXED steps)."),
    EngineFlag("disable_radix_cache", "--disable-radix-cache", bool, False, "Turn off prefix caching."),
    EngineFlag("context_length", "--context-length", int | None, None,
               "Longest sequence (prompt + output); default: the model's max_position_embeddings."),
    EngineFlag("seed", "--random-seed", int, 0,
               "Seed for dummy weights and for sampling of requests that give no seed of their own."),
    EngineFlag("cuda_graph_max_bs", "--cuda-graph-max-bs", int | None, None,
               "Largest decode batch replayed from a captured CUDA graph (buckets 1, 2, 4, 8, 16, 24, ...; "
               "default 160, at most --max-running-requests). Larger batches run eagerly."),
    EngineFlag("disable_cuda_graph", "--disable-cuda-graph", bool, False,
               "Run decode steps (and short prefills) eagerly instead of replaying CUDA graphs (graphs need a "
               "CUDA GPU and a backend that supports them, e.g. triton)."),
    EngineFlag("cuda_graph_max_prefill_tokens", "--cuda-graph-max-prefill-tokens", int | None, None,
               "Longest single-request prefill replayed from a captured CUDA graph (token buckets 16, 32, 64, "
               "96, ...; default 1024; 0 turns prefill graphs off). Short prompts are launch-bound: graphs "
               "cut their time to first token. Needs a prefill backend with graph support (triton)."),
    EngineFlag("disable_overlap_schedule", "--disable-overlap-schedule", bool, False,
               "Schedule each step only after reading the previous step's sampled tokens (by default the host "
               "schedules and launches step n+1 while the device runs step n; outputs are the same)."),
    EngineFlag("stream_interval", "--stream-interval", int, 1,
               "Streamed requests get a chunk every this many tokens (the first token at once, the last ones "
               "when the request ends); larger values cost the server less per token, as SGLang's flag."),
    EngineFlag("sp_size", "--sp-size", int | None, None,
               "Diffusion: sequence-parallel ranks sharing each DiT step (one process per rank, one GPU each on "
               "CUDA with NCCL, gloo on CPU) = --ulysses-degree x --ring-degree. Default 1."),
    EngineFlag("ulysses_degree", "--ulysses-degree", int | None, None,
               "Diffusion: ranks that split the attention heads (all-to-all); must divide the heads. Default: "
               "--sp-size when the heads divide by it."),
    EngineFlag("ring_degree", "--ring-degree", int | None, None,
               "Diffusion: ranks that pass key/value blocks around a ring (any head count; dense backends)."),
    EngineFlag("tp_size", "--tp-size", int, 1,
               "Tensor-parallel ranks for LLMs: one process per rank (one GPU each on CUDA, NCCL; gloo on CPU), "
               "attention heads and MLP split across them. Must divide the attention heads.",
               aliases=("--tp",)),
    EngineFlag("dp_size", "--dp-size", int, 1,
               "sglx serve, LLMs: data-parallel engine replicas (each a process with --tp-size GPUs of its own) "
               "behind one endpoint; requests go to the replica most likely to hold their prefix in its cache, "
               "else the least loaded.", aliases=("--dp",)),
)


def engine_cli_args(config: EngineConfig, skip: Sequence[str] = ()) -> list[str]:
    """The command-line flags that rebuild `config` (non-default values only), e.g. for replica processes."""
    default = EngineConfig()
    args: list[str] = []
    for f in ENGINE_FLAGS:
        value = getattr(config, f.field)
        if f.field in skip or value == getattr(default, f.field):
            continue
        args += [f.flag] if isinstance(value, bool) else [f.flag, str(value)]
    return args


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, enum.Enum) else value


def with_engine_options(fn: F) -> F:
    """Add every engine flag to a typer command; it is called with `engine_config=EngineConfig(...)`.

    An invalid combination (EngineConfig's validation) is a usage error: message, exit code 2, no traceback.
    """
    sig = inspect.signature(fn)
    if "engine_config" not in sig.parameters:
        raise TypeError(f"{fn.__name__} must take an `engine_config` parameter")
    params = [p for p in sig.parameters.values() if p.name != "engine_config"]
    annotations = {k: v for k, v in getattr(fn, "__annotations__", {}).items() if k != "engine_config"}
    for f in ENGINE_FLAGS:
        name = PREFIX + f.field
        annotation = f.annotation_for_typer()
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=f.option(),
                                        annotation=annotation))
        annotations[name] = annotation

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        flags = {k[len(PREFIX):]: _plain(kwargs.pop(k)) for k in list(kwargs) if k.startswith(PREFIX)}
        try:
            config = EngineConfig.from_kwargs(**flags)
        except SglxError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
        return fn(*args, engine_config=config, **kwargs)

    wrapper.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    wrapper.__annotations__ = annotations
    return wrapper  # type: ignore[return-value]
