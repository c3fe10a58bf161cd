"""Page tables for page-addressed kernels (FlashInfer, TRT-LLM XQA), read from `req_to_token`.

sglx's pool addresses tokens by slot (`slot = page * page_size + offset`, see allocator.py), and every
page holds tokens of one request in order, so request i's j-th page is `req_to_token[row, j * page_size]
// page_size`. Two layouts:

- CSR (FlashInfer): `indptr[i]` = pages before request i, `indices[indptr[i]:indptr[i+1]]` its pages,
  `last_page_len[i]` in 1..page_size (a request of length 0 has no pages and last_page_len 0).
- dense (XQA block tables): row i of a [bs, width] int32 table holds request i's pages (tail left as is),
  plus the int32 lengths the kernel reads.

One Triton program per request writes its row, so a captured CUDA-graph decode rebuilds the table from
its static inputs inside the graph, without the host. `page_table_torch` is the same definition in plain
PyTorch (CPU tensors, tests); `paged_lengths` computes indptr/last_page_len on the host from the step's
`seq_lens_cpu`, which FlashInfer's `plan` needs on the host anyway.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def paged_lengths(seq_lens: list[int], page_size: int) -> tuple[list[int], list[int]]:
    """(page indptr [bs + 1], last_page_len [bs]) of requests with `seq_lens` tokens."""
    indptr = [0]
    last = []
    for n in seq_lens:
        pages = -(-n // page_size)
        indptr.append(indptr[-1] + pages)
        last.append(n - (pages - 1) * page_size if pages else 0)
    return indptr, last


@triton.jit
def _page_table_kernel(Req_To_Token, Req_Pool_Indices, Seq_Lens, Indptr, Indices, Last_Page_Len, Lens_Out,
                       bs, stride_row, width, PAGE: tl.constexpr, DENSE: tl.constexpr, BLOCK_BS: tl.constexpr,
                       BLOCK: tl.constexpr):
    b = tl.program_id(0)
    length = tl.load(Seq_Lens + b).to(tl.int32)
    pages = (length + PAGE - 1) // PAGE
    if DENSE:
        start = b * width
        tl.store(Lens_Out + b, length)
    else:
        offs_b = tl.arange(0, BLOCK_BS)
        lens = tl.load(Seq_Lens + offs_b, mask=offs_b < bs, other=0).to(tl.int32)
        start = tl.sum(tl.where(offs_b < b, (lens + PAGE - 1) // PAGE, 0), axis=0)
        tl.store(Indptr + b + 1, start + pages)
        if b == 0:
            tl.store(Indptr, 0)
        tl.store(Last_Page_Len + b, length - tl.maximum(pages - 1, 0) * PAGE)
    row = tl.load(Req_Pool_Indices + b).to(tl.int64)
    for off in range(0, pages, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        mask = offs < pages
        slots = tl.load(Req_To_Token + row * stride_row + offs.to(tl.int64) * PAGE, mask=mask)
        tl.store(Indices + start + offs, slots // PAGE, mask=mask)


def build_page_table(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                     page_size: int, indices: torch.Tensor, indptr: torch.Tensor | None = None,
                     last_page_len: torch.Tensor | None = None, width: int | None = None,
                     lens_out: torch.Tensor | None = None) -> None:
    """CSR (indptr, indices, last_page_len all given) or dense (width and lens_out given) page table, one launch.

    Dense: `indices` is a [>= bs, width] int32 table, row-major contiguous; lens_out gets int32 seq_lens.
    """
    bs = req_pool_indices.shape[0]
    dense = width is not None
    if dense:
        assert lens_out is not None and indices.stride(0) == width, "dense tables need lens_out and stride width"
    else:
        assert indptr is not None and last_page_len is not None, "CSR tables need indptr and last_page_len"
    if bs == 0:
        if indptr is not None:
            indptr[:1].zero_()
        return
    dummy = indices
    _page_table_kernel[(bs,)](
        req_to_token, req_pool_indices, seq_lens, indptr if indptr is not None else dummy, indices,
        last_page_len if last_page_len is not None else dummy, lens_out if lens_out is not None else dummy,
        bs, req_to_token.stride(0), width or 0, PAGE=page_size, DENSE=dense,
        BLOCK_BS=max(16, triton.next_power_of_2(bs)), BLOCK=256)


def page_table_torch(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: list[int],
                     page_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(indptr, indices, last_page_len) int32 by plain indexing: the definition, for CPU tensors and tests."""
    indptr, last = paged_lengths(seq_lens, page_size)
    device = req_to_token.device
    parts = [req_to_token[int(row), : -(-n // page_size) * page_size: page_size] // page_size
             for row, n in zip(req_pool_indices.tolist(), seq_lens)]
    indices = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int32, device=device)
    as_i32 = {"dtype": torch.int32, "device": device}
    return torch.tensor(indptr, **as_i32), indices.to(torch.int32), torch.tensor(last, **as_i32)
