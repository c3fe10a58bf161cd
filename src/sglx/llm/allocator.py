"""Page-granular allocation of KV token slots (page size 1 = token granular).

Slots of page `p` are `p * page_size .. p * page_size + page_size - 1`; page 0 is reserved as the
write target of padding tokens (see kv_cache.py), so real pages are 1..num_pages. A request's new
tokens first fill the free tail of its last, partially used page and then take whole new pages, as
SGLang's `alloc_extend` does, so every page holds tokens of exactly one request (or of the prefix cache).
Bookkeeping lives on the CPU; callers move the returned slot tensors to the device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class TokenSlotAllocator:
    """Hands out KV slots in pages and takes whole pages back."""

    def __init__(self, num_slots: int, page_size: int = 1) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if num_slots < page_size:
            raise ValueError(f"a KV pool of {num_slots} slots cannot hold one page of {page_size}")
        self.page_size = page_size
        self.num_pages = num_slots // page_size
        self.num_slots = self.num_pages * page_size
        self.clear()

    def clear(self) -> None:
        """Every page free again (used at startup and by tests)."""
        self._free_pages: list[int] = list(range(self.num_pages, 0, -1))  # pop() hands out low pages first
        self._is_free = bytearray(b"\x01") * (self.num_pages + 1)  # per page; page 0 is never free
        self._is_free[0] = 0

    # ------------------------------------------------------------------ introspection

    @property
    def free_pages(self) -> int:
        return len(self._free_pages)

    def available_size(self) -> int:
        """Free token slots, counted in whole pages."""
        return len(self._free_pages) * self.page_size

    def pages_needed(self, prefix_lens: Sequence[int], seq_lens: Sequence[int]) -> int:
        """Pages an extend from prefix_lens to seq_lens takes beyond each request's partially filled last page."""
        ps = self.page_size
        return sum(-(-s // ps) - -(-p // ps) for p, s in zip(prefix_lens, seq_lens))

    # ------------------------------------------------------------------ allocation

    def _take_pages(self, n: int) -> list[int]:
        pages = [self._free_pages.pop() for _ in range(n)]
        is_free = self._is_free
        for p in pages:
            is_free[p] = 0
        return pages

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Slots for `num_tokens` tokens of a fresh request (starting on a new page), or None if out of pages."""
        return self.alloc_extend([0], [num_tokens], [0])

    def alloc_extend(self, prefix_lens: Sequence[int], seq_lens: Sequence[int],
                     last_locs: Sequence[int]) -> torch.Tensor | None:
        """Slots for tokens prefix_lens[i]..seq_lens[i]-1 of every request, concatenated, or None (nothing taken).

        `last_locs[i]` is the slot of token prefix_lens[i]-1 (ignored when the prefix ends on a page boundary);
        new tokens continue in its page before new pages are taken.
        """
        ps = self.page_size
        if self.pages_needed(prefix_lens, seq_lens) > len(self._free_pages):
            return None
        out: list[int] = []
        for prefix, seq, last in zip(prefix_lens, seq_lens, last_locs):
            if seq < prefix:
                raise ValueError(f"seq_len {seq} < prefix_len {prefix}")
            pos = prefix
            if ps > 1 and pos % ps and pos < seq:  # continue the partially filled last page
                n = min(seq, pos + ps - pos % ps) - pos
                out.extend(range(last + 1, last + 1 + n))
                pos += n
            if pos < seq:
                need = seq - pos
                for page in self._take_pages(-(-need // ps)):
                    take = min(ps, need)
                    out.extend(range(page * ps, page * ps + take))
                    need -= take
        return torch.tensor(out, dtype=torch.int64)

    def alloc_decode(self, seq_lens: Sequence[int], last_locs: Sequence[int]) -> torch.Tensor | None:
        """One slot per request for the token at position seq_lens[i] - 1."""
        return self.alloc_extend([s - 1 for s in seq_lens], seq_lens, last_locs)

    def free(self, slots: torch.Tensor | Sequence[int]) -> None:
        """Return the pages holding `slots`; freeing a page that is already free is a bug and raises."""
        if isinstance(slots, torch.Tensor):
            if slots.numel() == 0:
                return
            pages = torch.unique(slots.detach().to("cpu", torch.int64) // self.page_size).tolist()
        else:
            if not slots:
                return
            pages = sorted({int(s) // self.page_size for s in slots})
        is_free = self._is_free
        bad = [p for p in pages if p <= 0 or p > self.num_pages or is_free[p]]
        if bad:
            raise RuntimeError(f"KV allocator: freeing pages that are not allocated: {bad[:8]}")
        for p in pages:
            is_free[p] = 1
        self._free_pages.extend(reversed(pages))
