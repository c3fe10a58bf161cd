"""Which native pipeline runs which diffusers pipeline class."""

from __future__ import annotations

import importlib

from sglx.diffusion.loader import ModelIndex
from sglx.errors import SglxError

# model_index.json `_class_name` -> "module:class" of the native pipeline (imported only when used).
NATIVE_PIPELINES: dict[str, str] = {
    "WanPipeline": "sglx.diffusion.pipelines.wan:WanPipeline",
    "FluxPipeline": "sglx.diffusion.pipelines.flux:FluxPipeline",
}


def native_pipeline_class(index: ModelIndex) -> type:
    target = NATIVE_PIPELINES.get(index.pipeline_class)
    if target is None:
        native = ", ".join(sorted(NATIVE_PIPELINES))
        raise SglxError(f"{index.path}: {index.pipeline_class} has no native sglx pipeline (native: {native}); "
                        f"run it through diffusers with --backend diffusers")
    module, _, attr = target.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except ImportError as exc:
        raise SglxError(f"the native {index.pipeline_class} pipeline needs diffusers ({exc}); "
                        "pip install diffusers (a dependency of sglx)") from exc
