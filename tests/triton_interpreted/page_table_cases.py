"""The page-table kernel (kernels/page_table.py) under TRITON_INTERPRET=1: CSR and dense vs a per-token loop."""

from __future__ import annotations

import random

import pytest
import torch

from sglx.attention.kernels.page_table import build_page_table, page_table_torch, paged_lengths


def scattered_requests(seed: int, page: int, bs: int) -> tuple[torch.Tensor, list[int], list[int]]:
    """req_to_token of `bs` requests (rows 1..bs, row 0 padding) on shuffled pages; (table, rows, lens)."""
    rng = random.Random(seed)
    lens = [rng.choice([0, 1, page, page + 1, rng.randint(1, 5 * page + 3)]) for _ in range(bs)]
    lens[0] = max(lens[0], 1)
    width = max(lens) + page
    pages = list(range(1, sum(-(-n // page) for n in lens) + 5))
    rng.shuffle(pages)
    table = torch.zeros(bs + 1, width, dtype=torch.int32)
    rows = list(range(1, bs + 1))
    rng.shuffle(rows)
    for row, n in zip(rows, lens):
        mine = [pages.pop() for _ in range(-(-n // page))]
        table[row, :n] = torch.tensor([p * page + j for p in mine for j in range(page)][:n], dtype=torch.int32)
    return table, rows, lens


def naive(table: torch.Tensor, rows: list[int], lens: list[int], page: int) -> tuple[list[int], list[int], list[int]]:
    """Pages by walking every token: a new page starts at each multiple of the page size."""
    indptr, indices, last = [0], [], []
    for row, n in zip(rows, lens):
        mine = [int(table[row, t]) // page for t in range(n) if t % page == 0]
        assert all(int(table[row, t]) // page == mine[t // page] for t in range(n))  # pages hold one request in order
        indices += mine
        indptr.append(len(indices))
        last.append(n - (len(mine) - 1) * page if mine else 0)
    return indptr, indices, last


@pytest.mark.parametrize("page", [1, 4, 16, 64])
@pytest.mark.parametrize("seed", [0, 1])
def test_csr_and_dense_tables_match_the_token_walk(page: int, seed: int) -> None:
    table, rows, lens = scattered_requests(seed, page, 7)
    want_indptr, want_indices, want_last = naive(table, rows, lens, page)
    assert paged_lengths(lens, page) == (want_indptr, want_last)
    indptr_t, indices_t, last_t = page_table_torch(table, torch.tensor(rows), lens, page)
    assert (indptr_t.tolist(), indices_t.tolist(), last_t.tolist()) == (want_indptr, want_indices, want_last)

    indices = torch.full((want_indptr[-1] + 3,), -1, dtype=torch.int32)
    indptr = torch.full((len(rows) + 1,), -1, dtype=torch.int32)
    last = torch.full((len(rows),), -1, dtype=torch.int32)
    build_page_table(table, torch.tensor(rows), torch.tensor(lens), page, indices, indptr, last)
    assert indptr.tolist() == want_indptr and last.tolist() == want_last
    assert indices[:want_indptr[-1]].tolist() == want_indices and indices[want_indptr[-1]:].eq(-1).all()

    width = max(-(-n // page) for n in lens) + 2
    dense = torch.full((len(rows) + 1, width), -1, dtype=torch.int32)
    lens_out = torch.full((len(rows),), -1, dtype=torch.int32)
    build_page_table(table, torch.tensor(rows), torch.tensor(lens, dtype=torch.int64), page, dense, width=width,
                     lens_out=lens_out)
    assert lens_out.tolist() == lens
    for i in range(len(rows)):
        mine = want_indices[want_indptr[i]:want_indptr[i + 1]]
        assert dense[i, :len(mine)].tolist() == mine and dense[i, len(mine):].eq(-1).all()
    assert dense[len(rows)].eq(-1).all()  # rows past the batch untouched
