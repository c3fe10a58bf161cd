"""CSR KV indices: `kv_indices[kv_indptr[i]:kv_indptr[i+1]]` = slots of request i's tokens, read from req_to_token.

Built on the device with one program per request, so a step plans its metadata without a host sync.
`build_kv_metadata` writes indptr and indices in ONE launch (each program sums the lengths before
its request itself), which is what a captured CUDA-graph decode step runs from its static inputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kv_indices_kernel(Req_To_Token, Req_Pool_Indices, Kv_Indptr, Kv_Indices, stride_row, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    row = tl.load(Req_Pool_Indices + b).to(tl.int64)
    start = tl.load(Kv_Indptr + b)
    length = tl.load(Kv_Indptr + b + 1) - start
    for off in range(0, length, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        mask = offs < length
        slots = tl.load(Req_To_Token + row * stride_row + offs, mask=mask)
        tl.store(Kv_Indices + start + offs, slots, mask=mask)


@triton.jit
def _kv_metadata_kernel(Req_To_Token, Req_Pool_Indices, Seq_Lens, Kv_Indptr, Kv_Indices, bs, stride_row,
                        BLOCK_BS: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    offs_b = tl.arange(0, BLOCK_BS)
    lens = tl.load(Seq_Lens + offs_b, mask=offs_b < bs, other=0).to(tl.int32)
    start = tl.sum(tl.where(offs_b < b, lens, 0), axis=0)
    length = tl.load(Seq_Lens + b).to(tl.int32)
    tl.store(Kv_Indptr + b + 1, start + length)
    if b == 0:
        tl.store(Kv_Indptr, 0)
    row = tl.load(Req_Pool_Indices + b).to(tl.int64)
    for off in range(0, length, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        mask = offs < length
        slots = tl.load(Req_To_Token + row * stride_row + offs, mask=mask)
        tl.store(Kv_Indices + start + offs, slots, mask=mask)


def build_kv_indptr(seq_lens: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[bs + 1] int32 prefix sums of `seq_lens` (written into `out` when given)."""
    bs = seq_lens.shape[0]
    if out is None:
        out = torch.zeros(bs + 1, dtype=torch.int32, device=seq_lens.device)
    else:
        out[:1].zero_()
    out[1:bs + 1] = torch.cumsum(seq_lens, dim=0)
    return out


def build_kv_indices(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, kv_indptr: torch.Tensor,
                     kv_indices: torch.Tensor) -> torch.Tensor:
    """Fill `kv_indices` (int32, at least kv_indptr[-1] long) from `req_to_token` rows."""
    bs = req_pool_indices.shape[0]
    if bs:
        _kv_indices_kernel[(bs,)](req_to_token, req_pool_indices, kv_indptr, kv_indices, req_to_token.stride(0),
                                  BLOCK=512)
    return kv_indices


def build_kv_metadata(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                      kv_indptr: torch.Tensor, kv_indices: torch.Tensor) -> None:
    """`kv_indptr` ([bs + 1] int32) and `kv_indices` from seq_lens and req_to_token rows in one launch.

    Same result as build_kv_indptr + build_kv_indices; one kernel instead of three keeps the metadata
    part of a captured decode graph short.
    """
    bs = req_pool_indices.shape[0]
    if bs:
        _kv_metadata_kernel[(bs,)](req_to_token, req_pool_indices, seq_lens, kv_indptr, kv_indices, bs,
                                   req_to_token.stride(0), BLOCK_BS=max(16, triton.next_power_of_2(bs)), BLOCK=512)
    else:
        kv_indptr[:1].zero_()
