"""Block masks over the paged KV pool for the flex_attention backend.

The keys flex_attention sees are rows of the pool: the whole per-layer K/V buffer as a view (key row
`kv` is slot `kv`; compiled runs, nothing copied), or only the step's own slots gathered in slot order
(key row `kv` is slot `key_slot[kv]`; eager runs, which materialize scores over every key they get).
Either way paging lives in the mask: `slot_pos[kv]` is the position the key row's slot has in the
requests of this step (-1 if none), and a query of request row `r` at position `P` may read it iff
`0 <= p <= P`, `req_to_token[r, p]` is that slot (it really is this request's, which also holds for a
radix-shared prefix page) and, with a sliding window `W`, `p > P - W`.

The block lists (`kv_num_blocks`/`kv_indices`) name, per query block, only the key blocks holding a
slot some query of that block may read, so a compiled kernel visits only those; extend also lists
full blocks (`full_kv_*`: the rule holds for every element, so the kernel skips the mask there, e.g.
a request's cached prefix pages under its later queries). They are computed from the same rule on
the step's CSR indices, per step, with no per-element loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask

Q_BLOCK = 128
KV_BLOCK = 128


@dataclass(frozen=True)
class KVLayout:
    """Which pool rows are flex's keys: all of them in place (`slots` None) or the given sorted slots."""

    length: int
    slots: torch.Tensor | None = None  # gathered: key row i holds pool slot slots[i]

    def key_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """Key row of each slot."""
        return slots if self.slots is None else torch.searchsorted(self.slots, slots)


@dataclass(frozen=True)
class StepTables:
    """Per-step lookup tables the mask reads; built once per step, shared by every layer."""

    req_to_token: torch.Tensor  # [rows, max_context] int32, the live table (read, never copied)
    slot_pos: torch.Tensor  # [layout.length] int32: position of the key row's slot in this step, -1 if none
    q_row: torch.Tensor  # extend: [T] req_to_token row per packed query; decode: [bs] per batch entry
    q_pos: torch.Tensor  # same shape: the query's position
    key_slot: torch.Tensor | None  # gathered layout: [layout.length] int32 slot of each key row


@dataclass(frozen=True)
class StepKeys:
    """Every key of the step, request after request (CSR order): its request, position and key row."""

    req: torch.Tensor
    pos: torch.Tensor
    row: torch.Tensor


def kv_tokens(req_to_token: torch.Tensor, rows: list[int], seq_lens: list[int]
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(request index, position, slot) of every key of the step, request after request (CSR order)."""
    device = req_to_token.device
    lens = torch.tensor(seq_lens, dtype=torch.long, device=device)
    req = torch.repeat_interleave(torch.arange(len(rows), device=device), lens)
    starts = torch.cumsum(lens, 0) - lens
    pos = torch.arange(int(lens.sum()), device=device) - starts[req]
    row_of = torch.tensor(rows, dtype=torch.long, device=device)[req]
    slots = req_to_token[row_of, pos].long()
    return req, pos, slots


def gathered_layout(slots: torch.Tensor) -> KVLayout:
    """Only the step's own slots (sorted, a radix-shared one once): what eager flex should score."""
    unique = torch.unique(slots)
    return KVLayout(int(unique.numel()), unique)


def slot_positions(keys: StepKeys, layout: KVLayout) -> torch.Tensor:
    """Inverse of req_to_token over the key rows; a radix-shared slot has one position in every request."""
    table = torch.full((layout.length,), -1, dtype=torch.int32, device=keys.row.device)
    table[keys.row] = keys.pos.to(torch.int32)
    return table


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., nq, nk] bool -> (kv_num_blocks [..., nq], kv_indices [..., nq, nk]) with listed blocks first."""
    counts = dense.sum(-1, dtype=torch.int32)
    order = torch.argsort((~dense).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return counts, order


def extend_block_mask(tables: StepTables, layout: KVLayout, keys: StepKeys, qo_indptr: list[int],
                      prefix_lens: list[int], sliding_window: int | None,
                      full_blocks: bool = True) -> BlockMask:
    """Packed queries [1, H, T] over the key rows: each query block lists the key blocks it may read.

    Key `p` of request i is read by the queries at positions max(p, prefix_i) .. min(last_i, p + W - 1);
    that is a contiguous run of packed rows, so each key marks a run of query blocks (difference array).
    """
    req, pos, rows = keys.req, keys.pos, keys.row
    device = rows.device
    total_q = qo_indptr[-1]
    nq = -(-total_q // Q_BLOCK)
    nk = -(-layout.length // KV_BLOCK)
    qo = torch.tensor(qo_indptr[:-1], dtype=torch.long, device=device)[req]
    prefix = torch.tensor(prefix_lens, dtype=torch.long, device=device)[req]
    last = torch.tensor(qo_indptr[1:], dtype=torch.long, device=device)[req] - qo + prefix - 1
    first_q = torch.maximum(pos, prefix)
    last_q = last if not sliding_window else torch.minimum(last, pos + sliding_window - 1)
    keep = first_q <= last_q
    qa = (qo + first_q - prefix)[keep] // Q_BLOCK
    qz = (qo + last_q - prefix)[keep] // Q_BLOCK
    kb = rows[keep] // KV_BLOCK
    diff = torch.zeros((nq + 1, nk), dtype=torch.int32, device=device)
    ones = torch.ones_like(kb, dtype=torch.int32)
    diff.index_put_((qa, kb), ones, accumulate=True)
    diff.index_put_((qz + 1, kb), -ones, accumulate=True)
    needed = torch.cumsum(diff, 0)[:nq] > 0
    full_counts = full_order = None
    if full_blocks:
        full = _full_extend_blocks(tables, keys, qo_indptr, sliding_window, nq, nk) & needed
        needed = needed & ~full
        full_counts, full_order = _ordered(full[None, None])
    counts, order = _ordered(needed[None, None])
    return BlockMask.from_kv_blocks(counts, order, full_counts, full_order, BLOCK_SIZE=(Q_BLOCK, KV_BLOCK),
                                    mask_mod=paged_mask_mod(tables, sliding_window, decode=False),
                                    seq_lengths=(total_q, layout.length), compute_q_blocks=False)


def _full_extend_blocks(tables: StepTables, keys: StepKeys, qo_indptr: list[int], sliding_window: int | None,
                        nq: int, nk: int) -> torch.Tensor:
    """[nq, nk] blocks where the mask holds for every element, so the kernel can skip evaluating it.

    Only whole blocks qualify: a query block of one request (positions P0..P1) and a key block whose
    KV_BLOCK key rows all hold that request's keys at positions p <= P0 (and p > P1 - W with a window).
    Tail blocks and query blocks spanning two requests stay partial (the mask decides there).
    """
    req, pos = keys.req, keys.pos
    device = pos.device
    bs = len(qo_indptr) - 1
    key = req * nk + keys.row // KV_BLOCK
    cells = bs * nk
    count = torch.bincount(key, minlength=cells).view(bs, nk)
    high = torch.full((cells,), -1, dtype=torch.long, device=device).scatter_reduce(0, key, pos, "amax")
    full_q = qo_indptr[-1] // Q_BLOCK
    full = torch.zeros((nq, nk), dtype=torch.bool, device=device)
    if full_q == 0:
        return full
    lens = torch.tensor(qo_indptr[1:], dtype=torch.long, device=device) - torch.tensor(
        qo_indptr[:-1], dtype=torch.long, device=device)
    q_req = torch.repeat_interleave(torch.arange(bs, device=device), lens)
    first = torch.arange(full_q, device=device) * Q_BLOCK
    last = first + Q_BLOCK - 1
    owner = q_req[first]
    p0, p1 = tables.q_pos[first].long()[:, None], tables.q_pos[last].long()[:, None]
    ok = (count[owner] == KV_BLOCK) & (high.view(bs, nk)[owner] <= p0) & (owner == q_req[last])[:, None]
    if sliding_window:
        low = torch.full((cells,), 2**62, dtype=torch.long, device=device).scatter_reduce(0, key, pos, "amin")
        ok &= low.view(bs, nk)[owner] > p1 - sliding_window
    full[:full_q] = ok
    return full


def decode_block_mask(tables: StepTables, layout: KVLayout, keys: StepKeys, seq_lens: list[int],
                      sliding_window: int | None, batch_rows: int | None = None) -> BlockMask:
    """One query per batch entry [bs, H, 1]: entry i lists exactly the key blocks holding its own keys.

    `batch_rows` > len(seq_lens) pads the batch (compiled decode runs bucketed sizes): padding lists nothing.
    """
    req, pos, rows = keys.req, keys.pos, keys.row
    device = rows.device
    bs = batch_rows or len(seq_lens)
    nk = -(-layout.length // KV_BLOCK)
    keep = torch.ones_like(pos, dtype=torch.bool)
    if sliding_window:
        last = torch.tensor(seq_lens, dtype=torch.long, device=device)[req] - 1
        keep = pos > last - sliding_window
    dense = torch.zeros((bs, nk), dtype=torch.bool, device=device)
    dense[req[keep], rows[keep] // KV_BLOCK] = True
    counts, order = _ordered(dense[:, None, None, :])
    return BlockMask.from_kv_blocks(counts, order, BLOCK_SIZE=(Q_BLOCK, KV_BLOCK),
                                    mask_mod=paged_mask_mod(tables, sliding_window, decode=True),
                                    seq_lengths=(1, layout.length), compute_q_blocks=False)


def own_keys_decode_block_mask(seq_lens: list[int], sliding_window: int | None, device: torch.device) -> BlockMask:
    """Decode over each request's own keys gathered as [bs, Hkv, max_len] (eager): key row j is position j.

    Each entry then scores only its own keys (max_len of them) instead of every key of the batch.
    """
    last = torch.tensor(seq_lens, dtype=torch.long, device=device) - 1
    max_len = max(seq_lens)
    start = torch.arange(-(-max_len // KV_BLOCK), device=device) * KV_BLOCK
    dense = start[None, :] <= last[:, None]
    if sliding_window:
        dense &= start[None, :] + KV_BLOCK - 1 > last[:, None] - sliding_window
    counts, order = _ordered(dense[:, None, None, :])

    def own_mask(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        ok = kv_idx <= last[b]
        if sliding_window:
            ok = ok & (kv_idx > last[b] - sliding_window)
        return ok

    return BlockMask.from_kv_blocks(counts, order, BLOCK_SIZE=(Q_BLOCK, KV_BLOCK), mask_mod=own_mask,
                                    seq_lengths=(1, max_len), compute_q_blocks=False)


def paged_mask_mod(tables: StepTables, sliding_window: int | None, decode: bool) -> Callable:
    """The element rule of the module docstring; decode indexes its tables by batch entry, extend by query."""
    r2t, slot_pos, q_row, q_pos, key_slot = (tables.req_to_token, tables.slot_pos, tables.q_row, tables.q_pos,
                                             tables.key_slot)

    def allowed(row: torch.Tensor, at: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        p = slot_pos[kv_idx]
        slot = kv_idx if key_slot is None else key_slot[kv_idx]
        ok = (p >= 0) & (p <= at) & (r2t[row, torch.clamp(p, min=0)] == slot)
        if sliding_window:
            ok = ok & (p > at - sliding_window)
        return ok

    if decode:
        def decode_mask(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
            return allowed(q_row[b], q_pos[b], kv_idx)

        return decode_mask

    def extend_mask(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return allowed(q_row[q_idx], q_pos[q_idx], kv_idx)

    return extend_mask


def soft_cap_score_mod(cap: float) -> Callable:
    """scores = cap * tanh(scores / cap), applied after the softmax scale as torch_native does."""

    def score_mod(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                  kv_idx: torch.Tensor) -> torch.Tensor:
        return cap * torch.tanh(score / cap)

    return score_mod
