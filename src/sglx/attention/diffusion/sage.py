"""sage_attn: dense DiT attention through SageAttention 1.x (INT8 Q/K per block, fp16 P/V; Triton kernels).

It is lossy by design: expect max errors around 1e-2 against exact attention (the registry declares the
wider tolerance its checks use). Two upstream traps are handled here:
- sageattn's `smooth_k` subtracts the keys' mean IN PLACE on the caller's tensor, so the mean is taken
  out here on a new tensor and the kernel is called with smooth_k=False: the same arithmetic (softmax is
  invariant to a per-query shift) without touching the caller's keys.
- sageattention 1.0.6's non-causal kernels do not mask the last key block: when the key count is not a
  multiple of 64 the missing keys count with score 0 (measured on H100: error 0.14-0.28 on short
  sequences). Keys and values are padded here with zeros to a multiple of 64, so each pad key adds exactly
  1 to a row's softmax denominator and nothing to its numerator; a second call with values of one (zero
  on the pads) measures that share, S / (S + pads), and the output is divided by it. Exact, at twice the
  cost on such lengths (Wan's 32,760 and 75,600 tokens are among them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from sglx.attention.diffusion.base import DiffusionAttentionBackend, check_qkv
from sglx.errors import BackendUnavailableError, SglxError

HEAD_DIMS = (64, 96, 128)
KEY_BLOCK = 64  # sageattention 1.0.6's key block (BLOCK_N)
KERNEL_DTYPES = (torch.float16, torch.bfloat16)


def _kernel() -> Callable[..., torch.Tensor]:
    try:
        from sageattention import sageattn  # type: ignore[import-not-found]
    except (ImportError, OSError, RuntimeError, AttributeError) as exc:
        raise BackendUnavailableError(f"attention backend sage_attn: sageattention failed to import "
                                      f"({type(exc).__name__}: {exc}); pip install 'sglx[sage]' or use "
                                      "--attention-backend torch_sdpa") from exc
    return sageattn


class SageAttentionBackend(DiffusionAttentionBackend):
    """Non-causal SageAttention over [B, S, H, D] ("NHD" layout), GQA included."""

    name = "sage_attn"

    def __init__(self, config: Mapping[str, Any] | None = None, *,
                 kernel: Callable[..., torch.Tensor] | None = None) -> None:
        super().__init__(config)
        self._fn = kernel or _kernel()

    def forward_dense(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                      scale: float | None = None) -> torch.Tensor:
        check_qkv(q, k, v)
        if q.dtype not in KERNEL_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
            raise SglxError(f"attention backend sage_attn takes float16 or bfloat16 q/k/v; got {q.dtype}, "
                            f"{k.dtype}, {v.dtype}. Run the model in bf16 or use --attention-backend torch_sdpa.")
        if q.shape[-1] not in HEAD_DIMS:
            raise SglxError(f"attention backend sage_attn takes head dims {', '.join(map(str, HEAD_DIMS))}; got "
                            f"{q.shape[-1]}. Use --attention-backend fa or torch_sdpa.")
        q = q if q.stride(-1) == 1 else q.contiguous()
        k = k - k.mean(dim=1, keepdim=True)  # sageattn's smooth_k, out of place
        pads = -k.shape[1] % KEY_BLOCK
        if not pads:
            v = v if v.stride(-1) == 1 else v.contiguous()
            return self._fn(q, k, v, tensor_layout="NHD", is_causal=False, sm_scale=scale, smooth_k=False)
        k, v = (F.pad(t, (0, 0, 0, 0, 0, pads)) for t in (k, v))  # zero keys: score exactly 0
        out = self._fn(q, k, v, tensor_layout="NHD", is_causal=False, sm_scale=scale, smooth_k=False)
        ones = torch.ones_like(v)
        ones[:, -pads:] = 0
        share = self._fn(q, k, ones, tensor_layout="NHD", is_causal=False, sm_scale=scale, smooth_k=False)
        return (out.float() / share[..., :1].float()).to(q.dtype)
