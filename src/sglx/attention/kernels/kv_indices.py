"""CSR KV indices: `kv_indices[kv_indptr[i]:kv_indptr[i+1]]` = slots of request i's tokens, read from req_to_token.

Built on the device with one program per request, so a step plans its metadata without a host sync
(and, later, inside a captured CUDA graph).
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
