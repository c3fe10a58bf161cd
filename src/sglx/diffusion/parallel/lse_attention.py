"""Ring attention's per-step attention (with its log-sum-exp) and the merge of the partial results.

Ring attention attends each query block to one key/value block at a time and merges the partial outputs with
their log-sum-exps (the online-softmax rule). Each step runs on the selected backend when its registry
features declare `lse=True` (its kernel returns the LSE: fa's FA4/FA3/FA2, torch_sdpa's LSE kernels). A dense
backend whose kernel returns no LSE (sage_attn) has its ring steps run on PyTorch SDPA's LSE kernels instead:
documented in docs/backends.md's "ring attention" column and `sglx doctor`, and logged as a warning when it
happens. Sparse backends are refused under ring attention (attention.check_backend_for_sp).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from sglx.attention.diffusion.base import DiffusionAttentionBackend
from sglx.attention.diffusion.sdpa_lse import lse_dtype, sdpa_with_lse
from sglx.attention.registry import DiffusionFeatures, find

StepFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "float | None"], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class RingStepAttention:
    """What attends one key/value block in a ring step: q [B, Sq, H, D], k/v [B, Skv, Hkv, D], scale ->
    (out [B, Sq, H, D], lse [B, H, Sq])."""

    fn: StepFn
    own_kernel: bool  # True: the selected backend's kernel; False: the PyTorch SDPA fallback
    description: str


def ring_step_attention(backend: DiffusionAttentionBackend) -> RingStepAttention:
    """The selected backend's LSE path when the registry declares one, else the documented SDPA fallback."""
    spec = find(backend.name, "diffusion", "dit")
    features = spec.features if spec is not None else None
    if isinstance(features, DiffusionFeatures) and features.lse:
        def own(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
            return backend.forward_dense_with_lse(q, k, v, scale=scale)

        return RingStepAttention(own, True, f"{backend.name}'s own kernel, which returns the log-sum-exp")
    return RingStepAttention(sdpa_with_lse, False,
                             f"PyTorch SDPA's LSE kernels, NOT {backend.name}: its kernel returns no log-sum-exp "
                             "(docs/backends.md, 'ring attention' column)")


class LSEMerger:
    """Accumulates partial attention results (out_i, lse_i) of the same queries over disjoint key blocks, in
    float32 (float64 for float64 inputs)."""

    def __init__(self) -> None:
        self.out: torch.Tensor | None = None  # [B, S, H, D]
        self.lse: torch.Tensor | None = None  # [B, H, S]

    def add(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        acc = lse_dtype(out.dtype)
        out, lse = out.to(acc), lse.to(acc)
        if self.out is None or self.lse is None:
            self.out, self.lse = out, lse
            return
        new = torch.logaddexp(self.lse, lse)
        w_old = torch.exp(self.lse - new).transpose(1, 2)[..., None]  # [B, S, H, 1]
        w_new = torch.exp(lse - new).transpose(1, 2)[..., None]
        self.out = self.out * w_old + out * w_new
        self.lse = new

    def result(self, dtype: torch.dtype) -> torch.Tensor:
        if self.out is None:
            raise RuntimeError("LSEMerger.result: no partial result was added")
        return self.out.to(dtype)
