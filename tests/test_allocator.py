"""TokenSlotAllocator: page accounting, extend continuing a partial page, double-free detection."""

from __future__ import annotations

import random

import pytest
import torch

from sglx.llm.allocator import TokenSlotAllocator


def test_token_granular_alloc_and_free() -> None:
    a = TokenSlotAllocator(num_slots=10, page_size=1)
    assert a.available_size() == 10
    x = a.alloc(4)
    assert x is not None and x.tolist() == [1, 2, 3, 4]  # slot 0 is the padding slot
    assert a.available_size() == 6
    assert a.alloc(7) is None and a.available_size() == 6  # a failed alloc takes nothing
    a.free(x)
    assert a.available_size() == 10
    with pytest.raises(RuntimeError, match="not allocated"):
        a.free(x)


def test_pages_start_after_the_reserved_page() -> None:
    a = TokenSlotAllocator(num_slots=64, page_size=16)
    assert a.num_pages == 4
    x = a.alloc(20)
    assert x is not None
    assert x.tolist() == list(range(16, 32)) + list(range(32, 36))
    assert a.free_pages == 2


def test_extend_continues_the_last_partial_page() -> None:
    a = TokenSlotAllocator(num_slots=64, page_size=4)
    first = a.alloc(6)  # pages 1 and 2: slots 4..9
    assert first is not None and first.tolist() == [4, 5, 6, 7, 8, 9]
    more = a.alloc_extend([6], [12], [9])  # 10, 11 fill page 2, then page 3 gets 12..15
    assert more is not None and more.tolist() == [10, 11, 12, 13, 14, 15]
    assert a.free_pages == 16 - 3
    dec = a.alloc_decode([13], [15])  # position 12 starts a new page
    assert dec is not None and dec.tolist() == [16]
    dec2 = a.alloc_decode([14], [16])  # position 13 continues it
    assert dec2 is not None and dec2.tolist() == [17]


def test_pages_needed_matches_what_alloc_takes() -> None:
    rng = random.Random(0)
    for ps in (1, 3, 16):
        a = TokenSlotAllocator(num_slots=ps * 200, page_size=ps)
        for _ in range(50):
            prefix = [rng.randrange(0, 40) for _ in range(3)]
            seq = [p + rng.randrange(0, 40) for p in prefix]
            before = a.free_pages
            need = a.pages_needed(prefix, seq)
            # last_locs: pretend each prefix's last token sits at the end of a page we own
            owned = [a.alloc(p) if p else torch.zeros(0, dtype=torch.long) for p in prefix]
            assert all(o is not None for o in owned)
            before = a.free_pages
            last = [int(o[-1]) if len(o) else 0 for o in owned]
            out = a.alloc_extend(prefix, seq, last)
            assert out is not None and len(out) == sum(s - p for p, s in zip(prefix, seq))
            assert before - a.free_pages == need
            every = torch.cat([*owned, out])
            assert len(set(every.tolist())) == len(every)  # no slot handed out twice
            a.free(every)
        assert a.free_pages == a.num_pages


def test_free_of_one_slot_returns_its_whole_page() -> None:
    a = TokenSlotAllocator(num_slots=32, page_size=8)
    x = a.alloc(8)
    assert x is not None
    a.free(x[3:4])
    assert a.free_pages == 4
    with pytest.raises(RuntimeError):
        a.free([0])  # the padding page is never allocated
