"""The tiny model shipped inside sglx, so `sglx generate` works with no download.

It is a 4-layer Llama (GQA, RoPE, RMSNorm, SiLU MLP) trained by ``scripts/train_tiny_model.py``
on key-value recall (see ``task.py``): answers are checkably right only if attention reads the
whole context correctly.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL_NAME = "tiny-kv-recall"
DEFAULT_MODEL_DIR: Path = Path(__file__).resolve().parent / DEFAULT_MODEL_NAME


def default_model_path() -> Path:
    """Directory of the embedded model (Hugging Face layout: config.json, model.safetensors, tokenizer)."""
    return DEFAULT_MODEL_DIR
