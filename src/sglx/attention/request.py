"""What an attention backend is asked to do: the model's traits and the user's serving options."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Family = Literal["llm", "diffusion"]
Kind = Literal["mha", "mla", "dit"]
Phase = Literal["prefill", "decode"]

DTYPES = ("float16", "bfloat16", "float32")
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1")


@dataclass(frozen=True)
class AttentionRequest:
    """The facts a backend's requirements are checked against; None means "not known / not asked"."""

    family: Family = "llm"
    kind: Kind = "mha"
    dtype: str | None = None
    head_dim: int | None = None
    page_size: int | None = None
    kv_cache_dtype: str = "auto"
    sliding_window: bool = False
    spec_topk: int | None = None
    multimodal: bool = False
    # Which phase the backend would serve: None = both (--attention-backend), else one (the hybrid flags). Only
    # backends whose decode needs more than their prefill (`BackendSpec.decode_requires`) answer differently.
    phase: Phase | None = None

    @property
    def fp8_kv(self) -> bool:
        return self.kv_cache_dtype.startswith("fp8")

    @property
    def fp4_kv(self) -> bool:
        return self.kv_cache_dtype.startswith("fp4")
