"""RadixCache against a brute-force reference: longest cached prefix (whole pages), locks, LRU eviction."""

from __future__ import annotations

import random

import pytest
import torch

from sglx.llm.allocator import TokenSlotAllocator
from sglx.llm.kv_cache import ReqToTokenPool
from sglx.llm.radix_cache import NoPrefixCache, RadixCache


def _cache(page_size: int, slots: int = 4096) -> tuple[RadixCache, TokenSlotAllocator]:
    alloc = TokenSlotAllocator(slots, page_size)
    return RadixCache(alloc, ReqToTokenPool(4, 256)), alloc


def _insert(cache: RadixCache, alloc: TokenSlotAllocator, tokens: list[int]) -> torch.Tensor:
    """Insert a sequence the way a finished request does: its own slots, duplicates freed."""
    n = len(tokens) - len(tokens) % cache.page_size
    slots = alloc.alloc(n)
    assert slots is not None
    already = cache.insert(tokens, slots)
    if already:
        alloc.free(slots[:already])
    return slots


def test_token_level_match_and_split() -> None:
    cache, alloc = _cache(1)
    s1 = _insert(cache, alloc, [1, 2, 3, 4, 5])
    got, _ = cache.match_prefix([1, 2, 3, 9])
    assert got.tolist() == s1[:3].tolist()
    _insert(cache, alloc, [1, 2, 3, 7, 8])  # splits the edge after 3
    got, _ = cache.match_prefix([1, 2, 3, 7, 8, 9])
    assert got[:3].tolist() == s1[:3].tolist() and len(got) == 5
    assert cache.total_size() == 7


def test_page_granular_match_only_whole_pages() -> None:
    cache, alloc = _cache(4)
    _insert(cache, alloc, list(range(10)))  # only the first 8 tokens (2 pages) are cached
    assert cache.total_size() == 8
    assert len(cache.match_prefix(list(range(10)))[0]) == 8
    assert len(cache.match_prefix([0, 1, 2, 3, 4, 5, 99])[0]) == 4  # the second page differs in its 3rd token
    assert len(cache.match_prefix([0, 1, 2])[0]) == 0  # shorter than one page: never matched


@pytest.mark.parametrize("page_size", [1, 2, 5])
def test_matches_brute_force_reference(page_size: int) -> None:
    rng = random.Random(page_size)
    cache, alloc = _cache(page_size)
    stored: list[list[int]] = []
    for _ in range(60):
        base = rng.choice(stored) if stored and rng.random() < 0.7 else []
        seq = base[: rng.randrange(0, len(base) + 1)] + [rng.randrange(4) for _ in range(rng.randrange(1, 12))]
        query = seq[: rng.randrange(0, len(seq) + 1)] + [rng.randrange(4) for _ in range(3)]
        expect = 0
        for s in stored:
            n = 0
            while n < min(len(s), len(query)) and s[n] == query[n]:
                n += 1
            expect = max(expect, n - n % page_size)
        assert len(cache.match_prefix(query)[0]) == expect
        _insert(cache, alloc, seq)
        stored.append(seq[: len(seq) - len(seq) % page_size])
    # every cached slot is allocated exactly once: evicting everything returns the pool to empty
    cache.evict(10**9)
    assert alloc.free_pages == alloc.num_pages
    assert cache.total_size() == 0


def test_lock_protects_and_lru_evicts_oldest_leaf() -> None:
    cache, alloc = _cache(1, slots=64)
    _insert(cache, alloc, [1, 1, 1, 1])
    _insert(cache, alloc, [2, 2, 2, 2])
    _insert(cache, alloc, [3, 3, 3, 3])
    cache.match_prefix([1, 1, 1, 1])  # touch: 2 is now the least recently used
    _, node3 = cache.match_prefix([3, 3, 3, 3])
    cache.lock(node3)
    assert cache.protected_size() == 4 and cache.evictable_size() == 8
    assert cache.evict(1) == 4
    assert len(cache.match_prefix([2, 2, 2, 2])[0]) == 0
    assert len(cache.match_prefix([1, 1, 1, 1])[0]) == 4
    assert cache.evict(100) == 4  # only [1...] is evictable; [3...] is locked
    assert len(cache.match_prefix([3, 3, 3, 3])[0]) == 4
    cache.unlock(node3)
    assert cache.evict(100) == 4
    assert alloc.free_pages == alloc.num_pages
    with pytest.raises(RuntimeError):
        cache.unlock(node3)


def test_evicting_a_leaf_exposes_its_parent() -> None:
    cache, alloc = _cache(1, slots=64)
    _insert(cache, alloc, [1, 2, 3])
    _insert(cache, alloc, [1, 2, 4])
    assert cache.evict(6) == 4  # both leaves (1 token each) then the shared [1, 2]
    assert cache.total_size() == 0 and alloc.free_pages == alloc.num_pages


def test_no_prefix_cache_never_matches() -> None:
    alloc = TokenSlotAllocator(64, 1)
    cache = NoPrefixCache(alloc, ReqToTokenPool(2, 16))
    assert len(cache.match_prefix([1, 2, 3])[0]) == 0
    assert cache.evict(10) == 0
