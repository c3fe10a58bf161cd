"""RMSNorm across heads, then interleaved rotary, of a DiT query or key in one pass (Wan's attention prologue).

diffusers runs these as a norm kernel plus about eight elementwise kernels over float32 temporaries (the
rotary tables are float32): on Wan2.1-1.3B at 81x480x832 that moves about 1.5 GB per layer for q and k.
The Triton kernel here reads each token's row once (any row stride, so the chunks of a fused QKV
projection need no copy) and writes the result once, with diffusers' arithmetic and rounding points:
normalise in float32, round to the input dtype, times the weight (rounded), rotate in float32, round.
CPU tensors, other dtypes or head dims, and SGLX_DIT_FUSED=0 (fused.py) take the plain torch path.
"""

from __future__ import annotations

import torch

from sglx.diffusion.dit_attention import apply_interleaved_rotary
from sglx.diffusion.fused import use_fused


def _kernel_ok(x: torch.Tensor, norm: torch.nn.Module, heads: int,
               rotary: tuple[torch.Tensor, torch.Tensor] | None) -> bool:
    if not use_fused(x):
        return False
    if not isinstance(norm, torch.nn.RMSNorm) or norm.weight is None or norm.weight.dtype != x.dtype:
        return False
    dim = x.shape[-1] // heads
    if dim & (dim - 1) or dim < 16:
        return False
    if rotary is not None:
        cos, sin = rotary
        if cos.dtype != torch.float32 or cos.shape[-1] != dim or cos.numel() != x.shape[1] * dim:
            return False
    return True


def norm_rope(x: torch.Tensor, norm: torch.nn.Module, heads: int,
              rotary: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """[B, S, H*D] (rows may be strided) -> normalised (and rotated) [B, S, H, D]."""
    if _kernel_ok(x, norm, heads, rotary):
        from sglx.diffusion.qk_norm_rope_triton import launch

        return launch(x, norm.weight, float(norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps),
                      heads, rotary)
    out = norm(x).unflatten(2, (heads, -1))
    return apply_interleaved_rotary(out, *rotary) if rotary is not None else out
