"""Moving q/k/v into a TileOrder and back, and pooling them per block: what VSA (cubes) and VMoBA (chunks) share.

Both backends regroup the latent tokens box by box (VSA: 4x4x4 cubes, VMoBA: temporal, spatial or
spatio-temporal chunks) with `tile_order`, each box padded to whole kernel blocks, and both score boxes with
mean-pooled queries and keys. Pooling averages only the real tokens of a block: padding slots repeat token 0
and must not bias the mean.
"""

from __future__ import annotations

import functools

import torch

from sglx.attention.diffusion.sparse.tile_order import TileOrder


@functools.lru_cache(maxsize=128)
def _device_copy(tensor: torch.Tensor, device: str) -> torch.Tensor:
    return tensor.to(device)  # keyed by the (cached) TileOrder's tensor object


def on_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A cached copy of one of a cached TileOrder's CPU tensors on `device`."""
    return tensor if device.type == "cpu" else _device_copy(tensor, str(device))


def to_order(x: torch.Tensor, order: TileOrder) -> torch.Tensor:
    """[B, S, H, D] in input order -> [B, slots, H, D] in tile order (padding slots hold token 0)."""
    return x if order.identity else x.index_select(1, on_device(order.gather, x.device))


def from_order(x: torch.Tensor, order: TileOrder) -> torch.Tensor:
    """[B, slots, H, D] in tile order -> [B, S, H, D] in input order (padding slots dropped)."""
    return x if order.identity else x.index_select(1, on_device(order.scatter, x.device))


@functools.lru_cache(maxsize=64)
def real_slots(order: TileOrder) -> torch.Tensor:
    """float [num_blocks, block]: 1 for a real token, 0 for padding (and for the slots past the last block)."""
    lengths = order.k_lengths
    if lengths is None:
        lengths = torch.full((order.num_blocks,), order.block, dtype=torch.int32)
        lengths[-1] = order.slots - (order.num_blocks - 1) * order.block
    return (torch.arange(order.block)[None, :] < lengths[:, None].long()).float()


def pooling_dtype(x: torch.Tensor) -> torch.dtype:
    """float32 for half inputs (scores must not round), float64 stays float64 (exact tests)."""
    return torch.promote_types(x.dtype, torch.float32)


@functools.lru_cache(maxsize=64)
def real_lengths(order: TileOrder) -> torch.Tensor:
    """int32 [num_blocks]: the real tokens at the start of every block (the rest of a block is padding)."""
    return real_slots(order).sum(1).to(torch.int32)


def block_means(x: torch.Tensor, order: TileOrder, heads: int | None = None) -> torch.Tensor:
    """Mean of the real tokens of every block: x [B, slots, Hx, D] in tile order -> [B, H, num_blocks, D].

    `heads` repeats grouped key/value heads to the query heads (GQA). Half-precision CUDA inputs go through one
    Triton kernel that reads each block's real rows once (sglx.attention.kernels.block_means); the rest (CPU,
    float32/64 tests) through a weighted einsum in `pooling_dtype`."""
    b, slots, hx, d = x.shape
    nb, block = order.num_blocks, order.block
    if x.is_cuda and x.dtype in (torch.float16, torch.bfloat16):
        from sglx.attention.kernels.block_means import block_means_kernel, kernel_serves

        if kernel_serves(x):
            means = block_means_kernel(x, on_device(real_lengths(order), x.device), block)
            return means if heads is None or heads == hx else means.repeat_interleave(heads // hx, dim=1)
    weights = on_device(real_slots(order), x.device).to(pooling_dtype(x))  # [nb, block]
    padded = x.to(weights.dtype)
    if nb * block != slots:  # (tile orders fill whole blocks: usually no copy)
        padded = torch.nn.functional.pad(padded, (0, 0, 0, 0, 0, nb * block - slots))
    sums = torch.einsum("bnkhd,nk->bhnd", padded.view(b, nb, block, hx, d), weights)
    means = sums / weights.sum(1).clamp(min=1.0)[None, None, :, None]
    if heads is not None and heads != hx:
        means = means.repeat_interleave(heads // hx, dim=1)
    return means


__all__ = ["block_means", "from_order", "on_device", "pooling_dtype", "real_lengths", "real_slots", "to_order"]
