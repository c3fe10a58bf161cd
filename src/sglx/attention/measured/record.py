"""Load the measured-timing record of this machine's GPU class (packaged, or the user's own directory)."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path

from sglx.platform import PlatformSnapshot

FORMAT = 1
# A directory of <gpu class>.json records consulted before the packaged ones; "off" ignores every record
# (auto then follows SGLang's fixed order everywhere).
RECORDS_ENV = "SGLX_ATTENTION_RECORDS"
_VENDOR_WORDS = {"nvidia", "geforce", "tesla", "quadro"}


# shape labels of whole-engine medians (`sglx bench one-batch` reports) start with this; ranking.py ranks by them
# before the kernels' shapes
ENGINE_SHAPE = "engine "


def engine_shape(shape: str) -> bool:
    """Whether a recorded shape is the whole engine's (a one-batch step or prefill), not one kernel call's."""
    return shape.startswith(ENGINE_SHAPE)


@dataclass(frozen=True)
class Measurement:
    """One median of one sglx backend on one bench shape, with where and when it was measured."""

    kind: str  # "mha" | "mla"
    phase: str  # "decode" | "prefill"
    shape: str  # the bench's label, e.g. "B64 H32/8 D128 ctx 4096"
    page_size: int
    kv_cache_dtype: str  # "auto" | "fp8_e4m3" | ...
    backend: str
    median_ms: float
    source: str  # the raw result file (repository-relative)
    date: str
    device: str
    note: str = ""


@dataclass(frozen=True)
class Record:
    gpu_class: str
    origin: str  # where this record was read from
    entries: tuple[Measurement, ...]


def gpu_class(snap: PlatformSnapshot) -> str | None:
    """`sm90-h100` for an NVIDIA H100 (any form factor); None off CUDA or without a model number."""
    if snap.device_kind != "cuda" or snap.capability is None or not snap.gpu_name:
        return None
    words = [w for w in re.split(r"[\s\-_]+", snap.gpu_name.lower()) if w and w not in _VENDOR_WORDS]
    model = next((w for w in words if re.search(r"\d", w) and not re.fullmatch(r"\d+gb", w)), None)
    if model is None:
        return None
    return f"sm{snap.capability[0]}{snap.capability[1]}-{model}"


def parse_record(data: dict, origin: str) -> Record:
    if data.get("format") != FORMAT:
        raise ValueError(f"{origin}: attention record format {data.get('format')!r}, expected {FORMAT}")
    fields = set(Measurement.__dataclass_fields__)
    entries = tuple(Measurement(**{k: v for k, v in e.items() if k in fields}) for e in data["entries"])
    return Record(gpu_class=data["gpu_class"], origin=origin, entries=entries)


@lru_cache(maxsize=16)
def _load(cls: str, user_dir: str) -> Record | None:
    if user_dir:
        path = Path(user_dir).expanduser() / f"{cls}.json"
        if path.is_file():
            return parse_record(json.loads(path.read_text()), str(path))
    packaged = resources.files("sglx.attention.measured") / f"{cls}.json"
    if packaged.is_file():
        return parse_record(json.loads(packaged.read_text()), f"sglx/attention/measured/{cls}.json")
    return None


def record_for(snap: PlatformSnapshot) -> Record | None:
    """The record of this GPU's class, or None (no class, no record, or SGLX_ATTENTION_RECORDS=off)."""
    user_dir = os.environ.get(RECORDS_ENV, "")
    cls = gpu_class(snap)
    if cls is None or user_dir.strip().lower() == "off":
        return None
    return _load(cls, user_dir)
