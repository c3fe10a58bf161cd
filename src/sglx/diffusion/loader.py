"""Read a diffusers-format model directory (`model_index.json`) and load its components.

diffusers and transformers supply the classes (transformer, VAE, scheduler, text encoders, tokenizers);
sglx decides which family's native pipeline runs them and what to say when it cannot.
"""

from __future__ import annotations

import importlib
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sglx.errors import SglxError

INSTALL_DIFFUSION = "pip install diffusers; it is a dependency of sglx"


@dataclass(frozen=True)
class ModelIndex:
    """The parsed `model_index.json`: the pipeline class and each component's (library, class)."""

    path: Path
    pipeline_class: str
    components: dict[str, tuple[str, str]]
    extra: dict[str, Any]

    def component_class(self, name: str) -> str | None:
        entry = self.components.get(name)
        return entry[1] if entry else None


def is_diffusion_model_dir(path: str | Path) -> bool:
    return (Path(path).expanduser() / "model_index.json").is_file()


def read_model_index(path: str | Path) -> ModelIndex:
    """Parse model_index.json, with a one-line error a user can act on for each way it can be wrong."""
    root = Path(path).expanduser()
    if not root.exists():
        raise SglxError(f"--model-path {path}: no such directory (give a local diffusers-format model directory, "
                        "or --model-path tiny-shapes for the embedded diffusion model)")
    if not root.is_dir():
        raise SglxError(f"--model-path {path} is a file; give the model directory that holds model_index.json")
    index_file = root / "model_index.json"
    if not index_file.is_file():
        raise SglxError(f"--model-path {path} has no model_index.json, so it is not a diffusers-format model "
                        "(an LLM directory has config.json; a diffusion model needs model_index.json)")
    try:
        raw = json.loads(index_file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise SglxError(f"{index_file}: not readable JSON ({exc})") from exc
    if not isinstance(raw, dict) or not isinstance(raw.get("_class_name"), str):
        raise SglxError(f"{index_file}: expected a JSON object with \"_class_name\" (the diffusers pipeline class)")
    components: dict[str, tuple[str, str]] = {}
    extra: dict[str, Any] = {}
    for key, value in raw.items():
        if key.startswith("_"):
            continue
        if (isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) or v is None for v in value)):
            if value[0] is not None and value[1] is not None:
                components[key] = (value[0], value[1])
        else:
            extra[key] = value
    return ModelIndex(root, raw["_class_name"], components, extra)


def quiet_loading() -> None:
    """Loading bars and notices from transformers/diffusers would interleave with sglx's own output."""
    warnings.filterwarnings("ignore", message=".*`torch_dtype` is deprecated.*", category=FutureWarning)
    for module_name in ("transformers", "diffusers"):
        try:
            logging_utils = importlib.import_module(module_name).utils.logging
            logging_utils.disable_progress_bar()
            logging_utils.set_verbosity_error()
        except (ImportError, AttributeError):
            pass


def load_component(index: ModelIndex, name: str, **kwargs: Any) -> Any:
    """`<Class>.from_pretrained(<dir>/<name>)` from the library model_index.json names; nothing downloads."""
    quiet_loading()
    if name not in index.components:
        raise SglxError(f"{index.path}/model_index.json names no {name!r} component")
    library, class_name = index.components[name]
    module_name = {"diffusers": "diffusers", "transformers": "transformers"}.get(library)
    if module_name is None:
        raise SglxError(f"{index.path}: component {name!r} comes from library {library!r}; sglx loads components "
                        "from diffusers and transformers only")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        hint = INSTALL_DIFFUSION if module_name == "diffusers" else "pip install transformers"
        raise SglxError(f"loading {name} needs the {module_name} package ({hint}): {exc}") from exc
    cls = getattr(module, class_name, None)
    if cls is None and "Tokenizer" in class_name:
        cls = module.AutoTokenizer  # e.g. T5TokenizerFast saved by a newer transformers: the Auto class reads it
    if cls is None:
        raise SglxError(f"{index.path}: component {name!r} is {module_name}.{class_name}, which this {module_name} "
                        f"({getattr(module, '__version__', '?')}) does not have; upgrade it")
    folder = index.path / name
    if not folder.is_dir():
        raise SglxError(f"{index.path}: component folder {name}/ is missing")
    try:
        return cls.from_pretrained(str(folder), local_files_only=True, **kwargs)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SglxError(f"loading {name} ({class_name}) from {folder} failed: {first}") from exc
