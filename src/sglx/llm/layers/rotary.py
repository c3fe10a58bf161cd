"""Rotary position embedding (NeoX "rotate half" layout) with the scaling schemes Llama-family configs use.

Inverse frequencies follow Hugging Face's formulas exactly (float32, same operation order) so positions
far beyond the original context rotate identically; cos/sin are computed per step from the step's
positions instead of a max-length table, so a 128K-context config costs no memory up front. Every
layer then looks its rows up: on CUDA one Triton kernel rotates q and k in place (same roundings as
the torch code, which CPU runs).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from sglx.errors import SglxError
from sglx.llm.kernels import use_fused

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _base_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / head_dim
    return 1.0 / (theta**exponent)


def _llama3(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(head_dim: int, theta: float, params: dict[str, Any], max_positions: int) -> tuple[torch.Tensor, float]:
    factor = params.get("factor")
    original = params.get("original_max_position_embeddings") or max_positions
    if factor is None:
        factor = max_positions / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        if params.get("mscale") and params.get("mscale_all_dim"):
            attention_factor = mscale(factor, params["mscale"]) / mscale(factor, params["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, device="cpu").to(torch.float32) / head_dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None,
                  max_positions: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim/2] float32 on CPU, cos/sin multiplier) for a config's RoPE."""
    rope_type = (scaling or {}).get("rope_type", "default")
    params = scaling or {}
    try:
        if rope_type == "default":
            return _base_inv_freq(head_dim, theta), 1.0
        if rope_type == "linear":
            return _base_inv_freq(head_dim, theta) / params["factor"], 1.0
        if rope_type == "llama3":
            return _llama3(_base_inv_freq(head_dim, theta), params), 1.0
        if rope_type == "yarn":
            return _yarn(head_dim, theta, params, max_positions)
    except KeyError as exc:
        raise SglxError(f"rope_scaling of type {rope_type!r} is missing the field {exc.args[0]!r}") from exc
    raise SglxError(f"rope_scaling type {rope_type!r} is not supported; sglx supports "
                    f"{', '.join(SUPPORTED_ROPE_TYPES)}.")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    """Computes cos/sin for a step's positions once; every layer applies them with `apply`."""

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None = None,
                 max_positions: int = 4096) -> None:
        super().__init__()
        inv_freq, self.attention_scaling = rope_inv_freq(head_dim, theta, scaling, max_positions)
        # a plain attribute, not a buffer: it must survive meta-device construction and never be loaded
        self._inv_freq_cpu = inv_freq
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        if device not in self._inv_freq:
            self._inv_freq[device] = self._inv_freq_cpu.to(device)
        return self._inv_freq[device]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, head_dim] in `dtype`."""
        freqs = positions[:, None].float() * self.inv_freq(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:  # x * 1.0 == x: skip two kernels per step when there is no scaling
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)

    @staticmethod
    def apply(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hkv, D] rotated by cos/sin [T, D].

        On CUDA the rotation happens IN PLACE (q and k may be views into the fused qkv output) and the
        same tensors come back; on CPU new tensors come back and the inputs are untouched.
        """
        if use_fused(q) and q.dtype == k.dtype == cos.dtype == sin.dtype:
            from sglx.llm.kernels.rotary import apply_rotary_

            apply_rotary_(q, k, cos, sin)
            return q, k
        cos, sin = cos[:, None, :], sin[:, None, :]
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
