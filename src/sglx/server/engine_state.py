"""A consistent snapshot of the engine's load (running/queued requests, KV pool) for /server_info and /metrics.

Read inside the scheduler loop (Scheduler.call, between steps), so the numbers never mix two steps;
from async code call it through asyncio.to_thread, since it waits for the current step to end.
"""

from __future__ import annotations

from typing import Any

from sglx.llm.engine import Engine


def engine_load(engine: Engine) -> dict[str, int]:
    def read() -> dict[str, int]:
        s = engine.scheduler
        total = s.allocator.num_slots
        free = s.allocator.available_size()
        cached = s.cache.evictable_size()
        running = len(s.running) + (1 if s.chunked_req is not None and s.chunked_req not in s.running else 0)
        return {"running_requests": running, "queued_requests": len(s.waiting), "kv_total": total,
                "kv_free": free, "kv_cached": cached, "kv_used": total - free - cached}

    return engine.scheduler.call(read)  # type: ignore[return-value]


def kv_pool_info(load: dict[str, int]) -> dict[str, Any]:
    """The KV pool as /server_info reports it: free + cached is what new requests can get."""
    return {"total": load["kv_total"], "free": load["kv_free"], "cached": load["kv_cached"],
            "available": load["kv_free"] + load["kv_cached"], "used": load["kv_used"]}


def metric_gauges(load: dict[str, int]) -> dict[str, float]:
    total = max(load["kv_total"], 1)
    return {"sglx_num_running_requests": load["running_requests"],
            "sglx_num_queued_requests": load["queued_requests"],
            "sglx_kv_cache_total_tokens": load["kv_total"], "sglx_kv_cache_free_tokens": load["kv_free"],
            "sglx_kv_cache_cached_tokens": load["kv_cached"], "sglx_kv_cache_used_tokens": load["kv_used"],
            "sglx_kv_cache_usage": load["kv_used"] / total}
