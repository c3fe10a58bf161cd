"""fa: dense DiT attention through FlashAttention: FA3, FA4 or FA2, whichever the registry says runs here.

The three packages take the same [B, S, H, D] layout (no transposes), GQA and any sequence length, but
differ in what they return: FA4's `flash_attn.cute.flash_attn_func` always returns (out, lse), some FA3
builds do too, FA2 returns out. The kernel is imported when the backend is built, never at sglx import.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from sglx.attention.diffusion.base import DiffusionAttentionBackend, check_qkv
from sglx.attention.optional_kernels import load_kernel
from sglx.attention.registry import availability, chosen_variant, find
from sglx.errors import BackendUnavailableError, SglxError
from sglx.platform import PlatformSnapshot

KERNEL_DTYPES = (torch.float16, torch.bfloat16)


def _kernel(module: str) -> Callable[..., Any]:
    return load_kernel(module, "flash_attn_func", "fa", "--attention-backend torch_sdpa")


class FlashAttentionBackend(DiffusionAttentionBackend):
    """Non-causal FlashAttention over [B, S, H, D]; `variant` (FA3 | FA4 | FA2) says which kernel runs."""

    name = "fa"

    def __init__(self, config: Mapping[str, Any] | None = None, *, snapshot: PlatformSnapshot | None = None,
                 kernel: Callable[..., Any] | None = None, variant: str | None = None) -> None:
        super().__init__(config)
        if kernel is not None:  # tests: a stand-in kernel with FlashAttention's signature
            self.variant, self._fn = variant or "test", kernel
            return
        from sglx import platform

        snap = snapshot or platform.current()
        spec = find("fa", "diffusion", "dit")
        assert spec is not None  # declared in diffusion_backends.py
        chosen = chosen_variant(spec, snap)
        if chosen is None:
            reasons = "; ".join(availability(spec, snap).reasons)
            raise BackendUnavailableError(f"attention backend fa cannot run here: {reasons}. "
                                          "torch_sdpa runs everywhere (--attention-backend torch_sdpa).")
        self.variant = chosen.name
        self._fn = _kernel(chosen.module)

    def forward_dense(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                      scale: float | None = None) -> torch.Tensor:
        check_qkv(q, k, v)
        if q.dtype not in KERNEL_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
            raise SglxError(f"attention backend fa ({self.variant}) takes float16 or bfloat16 q/k/v; got "
                            f"{q.dtype}, {k.dtype}, {v.dtype}. Run the model in bf16 (--dtype bfloat16) or use "
                            "--attention-backend torch_sdpa.")
        if q.shape[-1] > 256 or q.shape[-1] % 8:
            raise SglxError(f"attention backend fa ({self.variant}) takes head dims up to 256 in multiples of 8; "
                            f"got {q.shape[-1]}. Use --attention-backend torch_sdpa.")
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        out = self._fn(q, k, v, softmax_scale=scale, causal=False)
        return out[0] if isinstance(out, tuple) else out
