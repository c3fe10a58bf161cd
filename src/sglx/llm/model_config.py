"""What the runtime needs from a Hugging Face `config.json`, normalized once.

Hugging Face configs drift between versions (`rope_scaling` + `rope_theta` vs transformers 5's
`rope_parameters`, `torch_dtype` vs `dtype`, Qwen's `use_sliding_window` switch, per-layer
`layer_types`); everything downstream reads this one frozen object instead of raw dicts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sglx.attention.selection import ModelTraits
from sglx.errors import SglxError
from sglx.llm.deepseek_config import MLAConfig, MoEConfig, parse_deepseek

SHIPPED_CONFIG_DIR = Path(__file__).parent / "configs"

# architecture name in config.json -> the model family that implements it
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}

_DTYPE_NAMES = {"float16": "float16", "fp16": "float16", "half": "float16", "bfloat16": "bfloat16",
                "bf16": "bfloat16", "float32": "float32", "fp32": "float32", "float": "float32"}


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only Llama-family model's shape and numerics, as sglx runs it."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # rope_type + its parameters; None = plain RoPE
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    sliding_window: int | None = None  # window of the layers that use one (see layer_sliding_windows)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    # per-layer window (None = full attention); empty means every layer uses `sliding_window`
    layer_sliding_windows: tuple[int | None, ...] = ()
    source: str = ""  # the directory or shipped name this config came from
    mla: MLAConfig | None = None  # DeepSeek-V2/V3: latent attention (then head_dim = qk_nope + qk_rope)
    moe: MoEConfig | None = None  # DeepSeek-V2/V3: routed + shared experts
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def family(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @property
    def rope_type(self) -> str:
        return (self.rope_scaling or {}).get("rope_type", "default")

    def sliding_window_for_layer(self, layer_id: int) -> int | None:
        if self.layer_sliding_windows:
            return self.layer_sliding_windows[layer_id]
        return self.sliding_window

    @property
    def uses_sliding_window(self) -> bool:
        return any(self.sliding_window_for_layer(i) for i in range(self.num_layers))

    def attention_traits(self, dtype: str) -> ModelTraits:
        """What backend selection needs to know about this model running in `dtype`."""
        # an MLA backend's kernels see one latent "head" of kv_lora_rank + qk_rope_head_dim (576 for DeepSeek)
        head_dim = self.mla.latent_dim if self.mla is not None else self.head_dim
        return ModelTraits(mla=self.mla is not None, head_dim=head_dim, dtype=dtype,
                           sliding_window=self.uses_sliding_window)

    @property
    def attention_kind(self) -> str:
        """"mla" for latent-attention models (their backends and KV pool differ), else "mha"."""
        return "mla" if self.mla is not None else "mha"

    def num_parameters(self) -> int:
        """Parameter count (for memory planning and progress messages)."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        if self.mla is not None:
            return sum(self.mla.attention_parameters(h, self.num_heads) + self._mlp_parameters(layer) + 2 * h
                       for layer in range(self.num_layers)) + embed + h
        attn = h * d * (2 * self.num_heads + 2 * self.num_kv_heads)
        per_layer = attn + 3 * h * i + 2 * h
        return self.num_layers * per_layer + embed + h

    def _mlp_parameters(self, layer_id: int) -> int:
        moe, h = self.moe, self.hidden_size
        if moe is None or not moe.is_moe_layer(layer_id):
            return 3 * h * self.intermediate_size
        bias = moe.n_routed_experts if moe.topk_method == "noaux_tc" else 0
        experts = (moe.n_routed_experts + moe.n_shared_experts) * 3 * h * moe.moe_intermediate_size
        return experts + moe.n_routed_experts * h + bias


def shipped_configs() -> list[str]:
    """Names of the configs packaged with sglx (usable with --load-format dummy)."""
    return sorted(p.stem for p in SHIPPED_CONFIG_DIR.glob("*.json"))


def load_model_config(model_path: str | Path) -> ModelConfig:
    """Read `config.json` from a model directory, or a shipped config by name (e.g. "llama-3.1-8b")."""
    path = Path(model_path).expanduser()
    if path.is_dir():
        config_file = path / "config.json"
        if not config_file.is_file():
            raise SglxError(f"--model-path {model_path}: the directory has no config.json (an LLM) and no "
                            "model_index.json (a diffusers model); point it at a Hugging Face model directory "
                            "(config.json + *.safetensors) or a diffusers-format one.")
    elif path.is_file() and path.suffix == ".json":
        config_file = path
    elif str(model_path) in shipped_configs():
        config_file = SHIPPED_CONFIG_DIR / f"{model_path}.json"
    else:
        raise SglxError(
            f"--model-path {model_path}: no such directory and not a shipped config. "
            f"Give a local Hugging Face or diffusers model directory, the embedded diffusion model "
            f"tiny-shapes, or one of: {', '.join(shipped_configs())} "
            "(shipped configs have no weights: use them with --load-format dummy)."
        )
    try:
        raw = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise SglxError(f"could not read {config_file}: {exc}") from exc
    generation = {}
    gen_file = config_file.parent / "generation_config.json"
    if config_file.name == "config.json" and gen_file.is_file():
        try:
            generation = json.loads(gen_file.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            generation = {}
    return parse_model_config(raw, source=str(model_path), generation_config=generation)


def parse_model_config(raw: dict[str, Any], source: str = "",
                       generation_config: dict[str, Any] | None = None) -> ModelConfig:
    """Normalize a config.json dict (any transformers version) into a ModelConfig."""
    architecture = _architecture(raw, source)
    family = SUPPORTED_ARCHITECTURES[architecture]
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise SglxError(f"{source or 'config.json'}: hidden_act {act!r} is not supported; "
                        "sglx's Llama-family models use SiLU-gated MLPs.")
    try:
        hidden = int(raw["hidden_size"])
        num_heads = int(raw["num_attention_heads"])
        num_layers = int(raw["num_hidden_layers"])
        vocab = int(raw["vocab_size"])
        intermediate = int(raw["intermediate_size"])
    except KeyError as exc:
        raise SglxError(f"{source or 'config.json'}: missing required field {exc.args[0]!r}") from exc
    num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
    head_dim = int(raw.get("head_dim") or hidden // num_heads)
    mla, moe = None, None
    if family.startswith("deepseek"):
        mla, moe = parse_deepseek(raw, architecture, source)
        num_kv_heads, head_dim = num_heads, mla.qk_head_dim
    rope_theta, rope_scaling = _rope(raw)
    sliding_window, layer_windows = _sliding_windows(raw, family, num_layers)
    bias = bool(raw.get("attention_bias", False))
    eos = _as_ids(raw.get("eos_token_id"))
    if generation_config:
        eos += tuple(i for i in _as_ids(generation_config.get("eos_token_id")) if i not in eos)
    dtype = raw.get("torch_dtype") or raw.get("dtype")
    return ModelConfig(
        architecture=architecture,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        sliding_window=sliding_window,
        qkv_bias=True if family == "qwen2" else bias,
        o_bias=False if family == "qwen2" else bias,
        mlp_bias=bool(raw.get("mlp_bias", False)) if family == "llama" else False,
        qk_norm=family == "qwen3",
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos,
        torch_dtype=_DTYPE_NAMES.get(str(dtype)) if dtype else None,
        layer_sliding_windows=layer_windows,
        source=source,
        mla=mla,
        moe=moe,
        raw=raw,
    )


def _architecture(raw: dict[str, Any], source: str) -> str:
    archs = raw.get("architectures") or []
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    asked = ", ".join(archs) if archs else f"model_type {raw.get('model_type')!r} (no 'architectures' field)"
    raise SglxError(f"{source or 'config.json'}: architecture {asked} is not supported by sglx. "
                    f"Supported architectures: {supported}.")


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict with 'rope_type' or None) from either the old or the transformers-5 layout."""
    params = raw.get("rope_parameters")
    scaling = raw.get("rope_scaling")
    theta = raw.get("rope_theta")
    merged: dict[str, Any] = {}
    for source in (params, scaling):
        if isinstance(source, dict):
            merged.update(source)
    if theta is None:
        theta = merged.get("rope_theta", 10000.0)
    merged.pop("rope_theta", None)
    rope_type = merged.pop("rope_type", None) or merged.pop("type", None) or "default"
    merged.pop("type", None)
    if rope_type == "default":
        return float(theta), None
    return float(theta), {"rope_type": rope_type, **merged}


def _sliding_windows(raw: dict[str, Any], family: str,
                     num_layers: int) -> tuple[int | None, tuple[int | None, ...]]:
    window = raw.get("sliding_window")
    if family == "llama":
        return None, ()
    if family in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
        return None, ()
    if not window:
        return None, ()
    window = int(window)
    layer_types = raw.get("layer_types")
    if family in ("qwen2", "qwen3") and not layer_types:
        start = int(raw.get("max_window_layers", num_layers))
        layer_types = ["sliding_attention" if i >= start else "full_attention" for i in range(num_layers)]
    if layer_types:
        windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
        if all(w == window for w in windows):
            return window, ()
        return window, windows
    return window, ()


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
