"""fa: dense DiT attention through FlashAttention: FA3, FA4 or FA2, whichever the registry says runs here.

The three packages take the same [B, S, H, D] layout (no transposes), GQA and any sequence length, but
differ in what they return: FA4's `flash_attn.cute.flash_attn_func` returns (out, lse) (lse filled with
return_lse=True on builds that take it), FA3 returns out or (out, softmax_lse) (return_attn_probs=True on builds
that take it), FA2 returns out, or (out, softmax_lse, S) with return_attn_probs=True. All three LSEs are float32
[B, H, Sq]: `forward_dense_with_lse` asks for it, so ring attention runs its steps on this kernel. The kernel is
imported when the backend is built, never at sglx import.
"""

from __future__ import annotations

import inspect
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


def lse_keywords(fn: Callable[..., Any]) -> dict[str, bool]:
    """The keyword that makes this build return the LSE: return_lse (FA4), return_attn_probs (FA2, newer FA3);
    none for builds that always return (out, lse) (older FA4 and FA3)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: call it plainly
        return {}
    for name in ("return_lse", "return_attn_probs"):
        if name in params:
            return {name: True}
    return {}


class FlashAttentionBackend(DiffusionAttentionBackend):
    """Non-causal FlashAttention over [B, S, H, D]; `variant` (FA3 | FA4 | FA2) says which kernel runs."""

    name = "fa"

    def __init__(self, config: Mapping[str, Any] | None = None, *, snapshot: PlatformSnapshot | None = None,
                 kernel: Callable[..., Any] | None = None, variant: str | None = None) -> None:
        super().__init__(config)
        if kernel is not None:  # tests: a stand-in kernel with FlashAttention's signature
            self.variant, self._fn = variant or "test", kernel
            self._lse_kwargs = lse_keywords(kernel)
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
        self._lse_kwargs = lse_keywords(self._fn)

    def forward_dense(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                      scale: float | None = None) -> torch.Tensor:
        q, k, v = self._checked(q, k, v)
        out = self._fn(q, k, v, softmax_scale=scale, causal=False)
        return out[0] if isinstance(out, tuple) else out

    def forward_dense_with_lse(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                               scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel's own softmax LSE [B, H, Sq] (float32) with its output: what each ring step merges by."""
        q, k, v = self._checked(q, k, v)
        res = self._fn(q, k, v, softmax_scale=scale, causal=False, **self._lse_kwargs)
        lse = res[1] if isinstance(res, (tuple, list)) and len(res) > 1 else None
        b, s, h = q.shape[:3]
        if not isinstance(lse, torch.Tensor) or lse.dim() != 3 or tuple(lse.shape[:2]) != (b, h) or lse.shape[2] < s:
            raise SglxError(f"attention backend fa ({self.variant}): this flash_attn build returned no log-sum-exp "
                            f"of shape [{b}, {h}, {s}], which ring attention (--ring-degree > 1) merges by; use "
                            "--ring-degree 1 or --attention-backend torch_sdpa")
        return res[0], lse[:, :, :s].float()

    def _checked(self, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as the kernels take them (last dim contiguous), or one SglxError line saying what would run."""
        check_qkv(q, k, v)
        if q.dtype not in KERNEL_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
            raise SglxError(f"attention backend fa ({self.variant}) takes float16 or bfloat16 q/k/v; got "
                            f"{q.dtype}, {k.dtype}, {v.dtype}. Run the model in bf16 (--dtype bfloat16) or use "
                            "--attention-backend torch_sdpa.")
        if q.shape[-1] > 256 or q.shape[-1] % 8:
            raise SglxError(f"attention backend fa ({self.variant}) takes head dims up to 256 in multiples of 8; "
                            f"got {q.shape[-1]}. Use --attention-backend torch_sdpa.")
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        return q, k, v
