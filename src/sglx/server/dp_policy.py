"""Which data-parallel replica serves a request: prefix-cache affinity, unless that would unbalance the load.

Like SGLang's cache-aware router: the router remembers, per replica, the prompts it sent there (as hashes of
every `CHUNK`-character prefix, so memory is bounded and lookups are O(prompt length / CHUNK)). A prompt goes
to the replica holding its longest remembered prefix when that prefix covers at least `cache_threshold` of
the prompt, since that replica's radix cache very likely still holds its KV; otherwise, or when the
replicas' in-flight loads differ by more than `balance_abs` requests and `balance_rel` times, it goes to the
least-loaded replica (ties: the one remembering the fewest prefixes, i.e. with the most cache to spare, as
SGLang's router picks the smallest tree; then the lowest index). The memory is an approximation: a replica
may have evicted a prefix the router still credits it with, which costs a recompute, never a wrong answer.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

CHUNK = 32  # characters per remembered prefix step
MAX_ENTRIES = 200_000  # remembered prefix hashes per replica (least recently used dropped first)


@dataclass
class ReplicaState:
    index: int
    in_flight: int = 0
    routed: int = 0
    prefix_hits: int = 0
    prefixes: OrderedDict[bytes, None] = field(default_factory=OrderedDict)


def prefix_keys(text: str) -> list[bytes]:
    """One chained hash per CHUNK-character prefix of `text` (the i-th covers text[:CHUNK * (i + 1)])."""
    keys = []
    h = hashlib.blake2b(digest_size=16)
    for start in range(0, len(text) - len(text) % CHUNK, CHUNK):
        h.update(text[start:start + CHUNK].encode("utf-8", "surrogatepass"))
        keys.append(h.copy().digest())
    return keys


@dataclass
class CacheAwarePolicy:
    num_replicas: int
    cache_threshold: float = 0.5
    balance_abs: int = 16
    balance_rel: float = 1.5
    replicas: list[ReplicaState] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.replicas:
            self.replicas = [ReplicaState(i) for i in range(self.num_replicas)]

    def _matched_chunks(self, replica: ReplicaState, keys: list[bytes]) -> int:
        lo, hi = 0, len(keys)  # prefixes are nested: if chunk i is remembered, so (very likely) is i - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if keys[mid - 1] in replica.prefixes:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _imbalanced(self) -> bool:
        loads = [r.in_flight for r in self.replicas]
        most, least = max(loads), min(loads)
        return most - least > self.balance_abs and most > least * self.balance_rel

    def choose(self, text: str) -> int:
        """The replica for a request whose prompt is `text`; records it there (call `done` when it finishes)."""
        keys = prefix_keys(text)
        least = min(self.replicas, key=lambda r: (r.in_flight, len(r.prefixes), r.index))
        chosen, hit = least, False
        if keys and not self._imbalanced():
            best = max(self.replicas, key=lambda r: (self._matched_chunks(r, keys), -r.in_flight, -r.index))
            matched = self._matched_chunks(best, keys)
            if matched and matched * CHUNK >= self.cache_threshold * len(text):
                chosen, hit = best, True
        chosen.in_flight += 1
        chosen.routed += 1
        chosen.prefix_hits += int(hit)
        for key in keys:
            chosen.prefixes[key] = None
            chosen.prefixes.move_to_end(key)
        while len(chosen.prefixes) > MAX_ENTRIES:
            chosen.prefixes.popitem(last=False)
        return chosen.index

    def done(self, index: int) -> None:
        self.replicas[index].in_flight = max(0, self.replicas[index].in_flight - 1)

    def stats(self) -> list[dict[str, int]]:
        return [{"replica": r.index, "in_flight": r.in_flight, "routed": r.routed, "prefix_hits": r.prefix_hits}
                for r in self.replicas]
