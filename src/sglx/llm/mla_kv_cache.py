"""MLA KV memory: one latent vector per token per layer instead of per-head K and V.

A DeepSeek layer caches `[c_kv (kv_lora_rank), k_pe (qk_rope_head_dim)]` per token, 512 + 64 = 576
values, whatever the number of heads (K/V for 128 heads of 192/128 would be 40960). Addressing is the
MHA pool's: slots from `req_to_token`, `[num_slots + page_size]` rows, slot 0's page reserved for
padding, so the allocator, radix cache and scheduler are unchanged. fp8 stores uint8 bits with one
per-tensor scale per layer, as `TokenKVPool` does.
"""

from __future__ import annotations

import torch

from sglx.errors import SglxError
from sglx.llm.kv_cache import FP8_DTYPES, KV_CACHE_DTYPE_CHOICES


class MLATokenKVPool:
    """One latent buffer per layer, `[num_slots + page_size, 1, kv_lora_rank + qk_rope_head_dim]`."""

    def __init__(
        self,
        num_slots: int,
        page_size: int,
        num_layers: int,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        dtype: torch.dtype,
        kv_cache_dtype: str = "auto",
        device: str | torch.device = "cpu",
    ) -> None:
        if kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise SglxError(
                f"--kv-cache-dtype {kv_cache_dtype}: not supported; choose one of {', '.join(KV_CACHE_DTYPE_CHOICES)}"
            )
        self.num_slots = num_slots
        self.page_size = page_size
        self.num_layers = num_layers
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.latent_dim = kv_lora_rank + qk_rope_head_dim
        # MHA-pool vocabulary, so code that sizes or describes a pool reads either kind the same way
        self.num_kv_heads = 1
        self.head_dim = self.latent_dim
        self.v_head_dim = kv_lora_rank  # absorbed attention's values are the latent's c_kv part
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype
        self.device = torch.device(device)
        self.fp8_dtype = FP8_DTYPES.get(kv_cache_dtype)
        store = torch.uint8 if self.fp8_dtype is not None else dtype
        rows = num_slots + page_size
        self.kv_buffer = [torch.zeros((rows, 1, self.latent_dim), dtype=store, device=device)
                          for _ in range(num_layers)]
        self.kv_scale = [1.0] * num_layers

    @property
    def is_mla(self) -> bool:
        return True

    @property
    def is_fp8(self) -> bool:
        return self.fp8_dtype is not None

    def bytes_per_token(self) -> int:
        elem = 1 if self.is_fp8 else torch.tensor([], dtype=self.dtype).element_size()
        return self.num_layers * self.latent_dim * elem

    def _encode(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        if self.fp8_dtype is None:
            return x.to(self.dtype)
        scaled = x.float() / scale if scale != 1.0 else x.float()
        return scaled.to(self.fp8_dtype).view(torch.uint8)

    def decode(self, stored: torch.Tensor, scale: float, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Stored latent rows back in compute dtype (dequantized for fp8)."""
        dtype = dtype or self.dtype
        if self.fp8_dtype is None:
            return stored.to(dtype)
        values = stored.view(self.fp8_dtype).to(torch.float32)
        return (values * scale if scale != 1.0 else values).to(dtype)

    def set_latent(self, layer_id: int, loc: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor) -> None:
        """Store c_kv [T, kv_lora_rank] and the rotated k_pe [T, qk_rope_head_dim] of this step's tokens."""
        buf = self.kv_buffer[layer_id]
        scale = self.kv_scale[layer_id]
        buf[loc, 0, :self.kv_lora_rank] = self._encode(c_kv, scale)
        buf[loc, 0, self.kv_lora_rank:] = self._encode(k_pe, scale)

    def get_latent(self, layer_id: int, loc: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Latents [n, kv_lora_rank + qk_rope_head_dim] of the given slots, dequantized to `dtype`."""
        return self.decode(self.kv_buffer[layer_id][loc, 0], self.kv_scale[layer_id], dtype)
