"""Model weights: Hugging Face safetensors checkpoints (single or sharded) and random dummy weights.

Loading streams one tensor at a time from memory-mapped files into the already-allocated parameters,
so peak host memory stays around one tensor, and reports progress over tensors (rich bar on a TTY).
Dummy weights exist so benchmarks can run any shipped config without downloading anything.
fp8 KV-cache scales a checkpoint carries (vLLM/SGLang names, see `KV_SCALE_NAME`) are taken out of the
stream and left on the model as `model.kv_cache_scales` for the KV pool (`TokenKVPool.set_static_scales`).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from sglx.errors import SglxError

INDEX_FILE = "model.safetensors.index.json"
DUMMY_STD = 0.02
KV_SCALE_NAME = re.compile(
    r"^(?:model\.)?layers\.(\d+)\.self_attn\.(?:attn\.)?(k_scale|v_scale|kv_scale|k_proj\.output_scale|v_proj\.output_scale)$")
"""fp8 KV dequantization scales as vLLM/SGLang checkpoints name them: `model.layers.N.self_attn.k_scale` /
`.v_scale` (also under `.attn.`), the older single `.kv_scale`, or `k_proj.output_scale` / `v_proj.output_scale`."""


class WeightLoadable(Protocol):
    def checkpoint_names(self) -> set[str]: ...

    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> tuple[set[str], list[str]]: ...


def find_safetensors(model_dir: str | Path) -> list[Path]:
    """The checkpoint files, in index order when sharded; SglxError when there are none."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as exc:
            raise SglxError(f"{index}: not a valid safetensors index ({exc})") from exc
        files = [model_dir / f for f in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise SglxError(f"{index} lists shards that are not in {model_dir}: {', '.join(missing[:5])}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    other = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(p.name for p in model_dir.glob("*.pt"))
    hint = (f" It has {', '.join(other[:3])}: sglx reads only safetensors; convert with "
            "transformers' save_pretrained(..., safe_serialization=True).") if other else ""
    raise SglxError(f"{model_dir} has no *.safetensors weights.{hint} "
                    "For random weights (benchmarks), pass --load-format dummy.")


@contextmanager
def _progress(total: int, enabled: bool) -> Iterator:
    """Yields advance(description) -> None; a rich progress bar on stderr when enabled."""
    if not enabled:
        yield lambda description: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("[bold]loading weights[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=Console(stderr=True), transient=False) as progress:
        task = progress.add_task("", total=total)

        def advance(description: str) -> None:
            progress.update(task, advance=1, description=description)

        yield advance


def iter_safetensors(files: list[Path], show_progress: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for every tensor of every shard, advancing the progress bar per tensor."""
    from safetensors import safe_open

    counts = []
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as handle:
            counts.append(len(list(handle.keys())))
    with _progress(sum(counts), show_progress) as advance:
        for i, f in enumerate(files):
            with safe_open(str(f), framework="pt", device="cpu") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                    yield name, handle.get_tensor(name)
                    advance(f"{f.name} ({i + 1}/{len(files)})")


def _without_kv_scales(weights: Iterator[tuple[str, torch.Tensor]], found: dict[int, dict[str, float]]
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights minus KV-cache scales, which go to `found[layer]['k'|'v']` (per-head scales: their max)."""
    for name, tensor in weights:
        match = KV_SCALE_NAME.match(name)
        if match is None:
            yield name, tensor
            continue
        value = float(tensor.float().abs().max())
        if not (value > 0 and value < float("inf")):
            raise SglxError(f"checkpoint tensor {name} = {value}: a KV-cache scale must be positive and finite")
        kinds = {"k_scale": "k", "k_proj.output_scale": "k", "v_scale": "v", "v_proj.output_scale": "v"}
        for kind in ("k", "v") if match.group(2) == "kv_scale" else (kinds[match.group(2)],):
            found.setdefault(int(match.group(1)), {})[kind] = value


def kv_cache_scales(found: dict[int, dict[str, float]], num_layers: int) -> tuple[list[float], list[float]] | None:
    """Per-layer (K scales, V scales) from what `_without_kv_scales` collected; None when the checkpoint has none.

    A checkpoint that scales only some layers, or only K or only V, is an error (sglx would have to guess).
    """
    if not found:
        return None
    incomplete = [i for i in range(num_layers) if set(found.get(i, {})) != {"k", "v"}]
    extra = sorted(set(found) - set(range(num_layers)))
    if incomplete or extra:
        raise SglxError(f"the checkpoint has fp8 KV-cache scales (k_scale/v_scale) for some layers only: none or "
                        f"half for layer(s) {incomplete[:5]}{' and layers ' + str(extra[:5]) if extra else ''}; "
                        "add both to every layer, or remove them (sglx then computes per-token scales)")
    return [found[i]["k"] for i in range(num_layers)], [found[i]["v"] for i in range(num_layers)]


def load_safetensors_weights(model: nn.Module, model_dir: str | Path, show_progress: bool | None = None) -> None:
    """Fill every parameter of `model` from the checkpoint; missing or unexpected tensors are an error.

    KV-cache scales are not parameters: they are collected into `model.kv_cache_scales`
    ((k list, v list) per layer, or None).
    """
    files = find_safetensors(model_dir)
    if show_progress is None:
        show_progress = sys.stderr.isatty()
    loadable: WeightLoadable = model  # type: ignore[assignment]
    scales: dict[int, dict[str, float]] = {}
    loaded, unexpected = loadable.load_weights(_without_kv_scales(iter_safetensors(files, show_progress), scales))
    num_layers = getattr(getattr(model, "config", None), "num_layers", None)
    model.kv_cache_scales = kv_cache_scales(scales, num_layers if num_layers is not None else len(scales))
    missing = sorted(loadable.checkpoint_names() - loaded)
    problems = []
    if missing:
        problems.append(f"{len(missing)} tensor(s) missing from the checkpoint, e.g. {', '.join(missing[:5])}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor(s), e.g. {', '.join(sorted(unexpected)[:5])}")
    if problems:
        raise SglxError(f"{model_dir}: the weights do not match config.json: {'; '.join(problems)}.")


def fill_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights for benchmarks: N(0, 0.02) everywhere, norm scales 1; identical for equal seeds."""
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            gen = generators.get(param.device)
            if gen is None:
                gen = generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
            param.normal_(0.0, DUMMY_STD, generator=gen)
