"""KV memory: the request -> token-slot map and the per-layer K/V buffers (optionally fp8).

Backends never see pages: they read slot indices gathered from `req_to_token`, so page size is an
addressing detail of the allocator. Slot 0 (the whole first page) is reserved as the write target of
padding tokens, so a padded step never corrupts a real request's KV.
"""

from __future__ import annotations

import torch

from sglx.errors import SglxError

FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
KV_CACHE_DTYPE_CHOICES = ("auto", *FP8_DTYPES)


class ReqToTokenPool:
    """`req_to_token[row, pos]` is the KV slot of token `pos` of the request living in `row`; row 0 is padding."""

    def __init__(self, size: int, max_context_len: int, device: str | torch.device = "cpu") -> None:
        self.size = size
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros((size + 1, max_context_len), dtype=torch.int32, device=device)
        self._free = list(range(size, 0, -1))

    @property
    def available(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, row: int) -> None:
        if row <= 0 or row > self.size or row in self._free:
            raise ValueError(f"req_to_token row {row} is not allocated")
        self._free.append(row)


class TokenKVPool:
    """One K and one V buffer per layer, `[num_slots + page_size, kv_heads, head_dim]`.

    fp8 KV is stored as uint8 bits with one per-tensor scale per layer for K and V:
    stored = fp8(x / scale), read back as stored * scale.
    """

    def __init__(
        self,
        num_slots: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        kv_cache_dtype: str = "auto",
        device: str | torch.device = "cpu",
        v_head_dim: int | None = None,
    ) -> None:
        if kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise SglxError(
                f"--kv-cache-dtype {kv_cache_dtype}: not supported; choose one of {', '.join(KV_CACHE_DTYPE_CHOICES)}"
            )
        self.num_slots = num_slots
        self.page_size = page_size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim or head_dim
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype
        self.device = torch.device(device)
        self.fp8_dtype = FP8_DTYPES.get(kv_cache_dtype)
        store = torch.uint8 if self.fp8_dtype is not None else dtype
        rows = num_slots + page_size
        self.k_buffer = [torch.zeros((rows, num_kv_heads, head_dim), dtype=store, device=device)
                         for _ in range(num_layers)]
        self.v_buffer = [torch.zeros((rows, num_kv_heads, self.v_head_dim), dtype=store, device=device)
                         for _ in range(num_layers)]
        self.k_scale = [1.0] * num_layers
        self.v_scale = [1.0] * num_layers

    @property
    def is_fp8(self) -> bool:
        return self.fp8_dtype is not None

    def bytes_per_token(self) -> int:
        elem = 1 if self.is_fp8 else torch.tensor([], dtype=self.dtype).element_size()
        return self.num_layers * self.num_kv_heads * (self.head_dim + self.v_head_dim) * elem

    def _encode(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        if self.fp8_dtype is None:
            return x.to(self.dtype)
        scaled = x.float() / scale if scale != 1.0 else x.float()
        return scaled.to(self.fp8_dtype).view(torch.uint8)

    def decode(self, stored: torch.Tensor, scale: float, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Stored K or V rows back in compute dtype (dequantized for fp8)."""
        dtype = dtype or self.dtype
        if self.fp8_dtype is None:
            return stored.to(dtype)
        values = stored.view(self.fp8_dtype).to(torch.float32)
        return (values * scale if scale != 1.0 else values).to(dtype)

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k_buffer[layer_id][loc] = self._encode(k, self.k_scale[layer_id])
        self.v_buffer[layer_id][loc] = self._encode(v, self.v_scale[layer_id])

    def get_kv(self, layer_id: int, loc: torch.Tensor, dtype: torch.dtype | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the given slots, dequantized to `dtype`."""
        k = self.decode(self.k_buffer[layer_id][loc], self.k_scale[layer_id], dtype)
        v = self.decode(self.v_buffer[layer_id][loc], self.v_scale[layer_id], dtype)
        return k, v
