"""Model construction and loading: architecture -> class, dtype resolution, safetensors or dummy weights."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from sglx.errors import SglxError
from sglx.llm.model_config import ModelConfig, load_model_config
from sglx.llm.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from sglx.llm.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from sglx.llm.weights import fill_dummy_weights, load_safetensors_weights

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
}
DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")
LOAD_FORMATS = ("auto", "safetensors", "dummy")
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_dtype(name: str | torch.dtype, config: ModelConfig | None = None,
                  device: str | torch.device | None = None) -> torch.dtype:
    """The compute dtype for `--dtype name`.

    auto = the checkpoint's own dtype (config.json's torch_dtype), so weights are used as trained;
    float32 when the config does not say. One exception: float16 on a CPU device becomes float32,
    because CPU float16 kernels are slow and partly missing (bfloat16 is kept: CPUs run it fine).
    An explicit dtype is always honoured as given.
    """
    if isinstance(name, torch.dtype):
        return name
    if name != "auto":
        if name not in _DTYPES:
            raise SglxError(f"--dtype {name}: not supported; choose one of {', '.join(DTYPE_CHOICES)}.")
        return _DTYPES[name]
    chosen = _DTYPES.get(config.torch_dtype or "float32", torch.float32) if config else torch.float32
    if chosen == torch.float16 and device is not None and torch.device(device).type == "cpu":
        return torch.float32
    return chosen


def build_model(config: ModelConfig, dtype: torch.dtype, device: str | torch.device) -> nn.Module:
    """The model for `config` on `device` in `dtype`, with UNINITIALIZED weights (load_model fills them).

    Built on the meta device first so an 8B model allocates its memory once, directly in `dtype`.
    """
    cls = MODEL_CLASSES.get(config.architecture)
    if cls is None:
        raise SglxError(f"architecture {config.architecture} is not supported; "
                        f"supported: {', '.join(MODEL_CLASSES)}.")
    with torch.device("meta"):
        model = cls(config)
    model = model.to(dtype=dtype).to_empty(device=device)
    return model.eval()


def load_model(model_path: str | Path, dtype: torch.dtype | str, device: str | torch.device,
               load_format: str = "auto", seed: int = 0,
               show_progress: bool | None = None) -> tuple[nn.Module, ModelConfig]:
    """Config + model with weights: from `*.safetensors` in model_path, or random for load_format="dummy".

    model_path is a Hugging Face model directory or a shipped config name (dummy weights only).
    show_progress None = a progress bar when stderr is a terminal.
    """
    if load_format not in LOAD_FORMATS:
        raise SglxError(f"--load-format {load_format}: not supported; choose one of {', '.join(LOAD_FORMATS)}.")
    config = load_model_config(model_path)
    torch_dtype = resolve_dtype(dtype, config, device)
    if load_format != "dummy" and not Path(model_path).expanduser().is_dir():
        raise SglxError(f"--model-path {model_path} is a shipped config without weights; "
                        "run it with --load-format dummy (random weights, for benchmarks).")
    model = build_model(config, torch_dtype, device)
    if load_format == "dummy":
        fill_dummy_weights(model, seed)
    else:
        load_safetensors_weights(model, Path(model_path).expanduser(), show_progress)
    weights_loaded = getattr(model, "weights_loaded", None)
    if callable(weights_loaded):  # layout changes that need the loaded values (e.g. fusing two projections)
        weights_loaded()
    return model, config


__all__ = ["DTYPE_CHOICES", "LOAD_FORMATS", "MODEL_CLASSES", "build_model", "load_model", "resolve_dtype",
           "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
           "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"]
