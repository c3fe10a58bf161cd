"""Prefix cache: a radix tree over token ids whose nodes own the KV slots of those tokens.

With page size 1 matching is token-level. With page size N only whole pages are cached and matched
(a page cannot be padded): a 65-token prompt with page size 64 caches and matches its first 64 tokens
only, and a prompt shorter than one page is never cached. Nodes in use by running requests are locked
(`lock_ref`); unlocked leaves are evicted least-recently-used first when the KV pool runs short.
`NoPrefixCache` is the `--disable-radix-cache` path with the same interface.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from sglx.llm.allocator import TokenSlotAllocator

if TYPE_CHECKING:
    from sglx.llm.kv_cache import ReqToTokenPool
    from sglx.llm.request import Request

_EMPTY = torch.zeros(0, dtype=torch.int64)


class TreeNode:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access")

    def __init__(self, parent: TreeNode | None = None, key: tuple[int, ...] = (),
                 value: torch.Tensor = _EMPTY) -> None:
        self.children: dict[object, TreeNode] = {}
        self.parent = parent
        self.key = key  # tokens of this edge
        self.value = value  # KV slots of those tokens (CPU int64)
        self.lock_ref = 0
        self.last_access = 0

    def __lt__(self, other: TreeNode) -> bool:  # heap order: least recently used first
        return self.last_access < other.last_access


class PrefixCache(ABC):
    """What the scheduler needs from a prefix cache (radix tree or none)."""

    def __init__(self, allocator: TokenSlotAllocator, req_to_token_pool: ReqToTokenPool) -> None:
        self.allocator = allocator
        self.req_to_token_pool = req_to_token_pool
        self.page_size = allocator.page_size

    @abstractmethod
    def match_prefix(self, token_ids: Sequence[int]) -> tuple[torch.Tensor, TreeNode | None]:
        """KV slots of the longest cached prefix of token_ids and the node that ends it (lock it to keep it)."""

    def lock(self, node: TreeNode | None) -> None:  # noqa: B027 - no-op unless the cache has nodes
        pass

    def unlock(self, node: TreeNode | None) -> None:  # noqa: B027
        pass

    def evict(self, num_tokens: int) -> int:
        """Free at least num_tokens slots held only by the cache, if it can; returns slots freed."""
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def drop_req(self, req: Request, upto: int) -> None:
        """Free the request's own slots of positions [cache_len, upto) without caching them (after a failure)."""
        self.allocator.free(self._row_slots(req, upto)[req.cache_len:])
        self.unlock(req.last_node)
        req.cache_len, req.last_node = 0, None

    def _row_slots(self, req: Request, length: int) -> torch.Tensor:
        """The request's first `length` KV slots: from its host copy (no device sync) when it has one."""
        known = req.host_slots(length)
        if known is not None:
            return known
        return self.req_to_token_pool.req_to_token[req.row, :length].to("cpu", torch.int64)

    @abstractmethod
    def cache_unfinished_req(self, req: Request) -> None:
        """After a prefill chunk: share the request's computed full pages with the cache and lock them."""

    @abstractmethod
    def cache_finished_req(self, req: Request) -> None:
        """The request is done with its KV (finished or retracted): hand it to the cache or free it."""


class NoPrefixCache(PrefixCache):
    """--disable-radix-cache: every request owns all of its KV and frees it when done."""

    def match_prefix(self, token_ids: Sequence[int]) -> tuple[torch.Tensor, TreeNode | None]:
        return _EMPTY, None

    def cache_unfinished_req(self, req: Request) -> None:
        pass

    def cache_finished_req(self, req: Request) -> None:
        self.allocator.free(self._row_slots(req, req.kv_len))
        req.cache_len, req.last_node = 0, None


class RadixCache(PrefixCache):
    def __init__(self, allocator: TokenSlotAllocator, req_to_token_pool: ReqToTokenPool) -> None:
        super().__init__(allocator, req_to_token_pool)
        self._clock = itertools.count(1)
        self.reset()

    def reset(self) -> None:
        self.root = TreeNode()
        self.root.lock_ref = 1  # the root is never evicted
        self._evictable = 0
        self._protected = 0

    # ------------------------------------------------------------------ keys

    def _child_key(self, key: Sequence[int]) -> object:
        return key[0] if self.page_size == 1 else tuple(key[: self.page_size])

    def _match_len(self, a: Sequence[int], b: Sequence[int]) -> int:
        """Common prefix length of a and b, in whole pages."""
        n = 0
        for x, y in zip(a, b):
            if x != y:
                break
            n += 1
        return n - n % self.page_size

    def _aligned(self, n: int) -> int:
        return n - n % self.page_size

    # ------------------------------------------------------------------ tree operations

    def match_prefix(self, token_ids: Sequence[int]) -> tuple[torch.Tensor, TreeNode | None]:
        key = tuple(token_ids[: self._aligned(len(token_ids))])
        node, values = self.root, []
        now = next(self._clock)
        node.last_access = now
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            n = self._match_len(child.key, key)
            if n == 0:
                break
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            values.append(child.value)
            node, key = child, key[n:]
        return (torch.cat(values) if values else _EMPTY), node

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut child's edge after n tokens; returns the new upper node."""
        parent = child.parent
        assert parent is not None
        upper = TreeNode(parent, child.key[:n], child.value[:n])
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        child.key, child.value, child.parent = child.key[n:], child.value[n:], upper
        upper.children[self._child_key(child.key)] = child
        parent.children[self._child_key(upper.key)] = upper
        return upper

    def insert(self, token_ids: Sequence[int], slots: torch.Tensor) -> int:
        """Add token_ids (whole pages) with their slots; returns how many leading tokens were already cached.

        The caller owns `slots[:returned]`, which duplicate cached KV, and must free them.
        """
        n_aligned = self._aligned(len(token_ids))
        key, value = tuple(token_ids[:n_aligned]), slots[:n_aligned]
        node, matched = self.root, 0
        now = next(self._clock)
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                leaf = TreeNode(node, key, value.clone())
                leaf.last_access = now
                node.children[self._child_key(key)] = leaf
                self._evictable += len(key)
                return matched
            n = self._match_len(child.key, key)
            if n == 0:  # same first page key is impossible without a match; defensive
                break
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            matched += n
            node, key, value = child, key[n:], value[n:]
        return matched

    def lock(self, node: TreeNode | None) -> None:
        while node is not None and node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode | None) -> None:
        while node is not None and node is not self.root:
            if node.lock_ref == 1:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
            if node.lock_ref <= 0:
                raise RuntimeError("radix cache: unlocking a node that is not locked")
            node.lock_ref -= 1
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        heap = [n for n in self._nodes() if not n.children and n.lock_ref == 0 and n is not self.root]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            leaf = heapq.heappop(heap)
            self.allocator.free(leaf.value)
            freed += len(leaf.key)
            self._evictable -= len(leaf.key)
            parent = leaf.parent
            assert parent is not None
            del parent.children[self._child_key(leaf.key)]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        return freed

    def _nodes(self) -> list[TreeNode]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return sum(len(n.key) for n in self._nodes())

    # ------------------------------------------------------------------ request hand-off

    def _insert_computed(self, req: Request) -> int:
        """Insert the request's computed full pages, free its duplicates; returns the aligned length."""
        slots = self._row_slots(req, req.kv_len)
        aligned = self._aligned(req.kv_len)
        already = self.insert(req.fill_ids[:aligned], slots[:aligned])
        if already > req.cache_len:
            self.allocator.free(slots[req.cache_len:already])
        return aligned

    def cache_unfinished_req(self, req: Request) -> None:
        aligned = self._insert_computed(req)
        new_slots, node = self.match_prefix(req.fill_ids[:aligned])
        assert len(new_slots) == aligned, (len(new_slots), aligned)
        if aligned:
            table = self.req_to_token_pool.req_to_token
            table[req.row, :aligned] = new_slots.to(table.device, table.dtype, non_blocking=True)
            req.record_slots(0, new_slots.to("cpu"))
        self.lock(node)
        self.unlock(req.last_node)
        req.cache_len, req.last_node = aligned, node

    def cache_finished_req(self, req: Request) -> None:
        aligned = self._insert_computed(req)
        if req.kv_len > aligned:
            self.allocator.free(self._row_slots(req, req.kv_len)[aligned:])
        self.unlock(req.last_node)
        req.cache_len, req.last_node = 0, None
