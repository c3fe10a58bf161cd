"""Server metrics in Prometheus text format, without a client library (a few counters and histograms).

Updated only on the HTTP event loop (no locks needed); engine gauges (running/queued requests, KV
cache) are read from the scheduler when /metrics is scraped, so they are never stale.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


@dataclass
class Histogram:
    buckets: Sequence[float]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.counts):
            self.counts[i] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, n in zip(self.buckets, self.counts):
            running += n
            out.append(f'{name}_bucket{{le="{_num(bound)}"}} {running}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        out.append(f"{name}_sum {_num(self.total)}")
        out.append(f"{name}_count {self.count}")
        return out


class PromText:
    """Lines of a Prometheus text exposition, each metric with its HELP and TYPE header."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def head(self, name: str, kind: str, help_text: str) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {kind}")

    def value(self, name: str, kind: str, help_text: str, value: float) -> None:
        self.head(name, kind, help_text)
        self.lines.append(f"{name} {_num(value)}")

    def histogram(self, name: str, help_text: str, hist: Histogram) -> None:
        self.head(name, "histogram", help_text)
        self.lines += hist.lines(name)

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


class HttpMetrics:
    """HTTP request counters every sglx server keeps (RequestCountMiddleware updates them)."""

    def __init__(self) -> None:
        self.http_requests: Counter[tuple[str, str, int]] = Counter()  # (method, route, status)
        self.in_flight = 0

    def render_http(self, out: PromText) -> None:
        out.head("sglx_http_requests_total", "counter", "HTTP requests by method, route and status code.")
        for (method, route, status), n in sorted(self.http_requests.items()):
            out.lines.append(f'sglx_http_requests_total{{method="{method}",route="{route}",status="{status}"}} {n}')
        out.value("sglx_http_requests_in_flight", "gauge", "HTTP requests being served now.", self.in_flight)


class ServerMetrics(HttpMetrics):
    def __init__(self) -> None:
        super().__init__()
        self.finished: Counter[str] = Counter()  # generations by finish reason
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)

    def render(self, gauges: Mapping[str, float]) -> str:
        out = PromText()
        self.render_http(out)
        out.head("sglx_generation_requests_total", "counter", "Finished generations (one per choice) by finish reason.")
        for reason, n in sorted(self.finished.items()):
            out.lines.append(f'sglx_generation_requests_total{{finish_reason="{reason}"}} {n}')
        out.value("sglx_prompt_tokens_total", "counter", "Prompt tokens of generations.", self.prompt_tokens)
        out.value("sglx_generation_tokens_total", "counter", "Generated tokens.", self.generation_tokens)
        out.histogram("sglx_time_to_first_token_seconds", "Time from request arrival to the first token.", self.ttft)
        out.histogram("sglx_inter_token_latency_seconds", "Time between consecutive output tokens.", self.itl)
        out.histogram("sglx_e2e_request_latency_seconds", "Time from request arrival to its last token.", self.e2e)
        for name, (kind, text) in ENGINE_GAUGES.items():
            if name in gauges:
                out.value(name, kind, text, gauges[name])
        return out.text()


ENGINE_GAUGES = {
    "sglx_num_running_requests": ("gauge", "Requests being prefilled or decoded."),
    "sglx_num_queued_requests": ("gauge", "Requests waiting for admission."),
    "sglx_kv_cache_total_tokens": ("gauge", "KV pool size in tokens."),
    "sglx_kv_cache_free_tokens": ("gauge", "KV slots free in the allocator."),
    "sglx_kv_cache_cached_tokens": ("gauge", "KV slots held by the prefix cache that can be evicted."),
    "sglx_kv_cache_used_tokens": ("gauge", "KV slots held by running requests (total - free - cached)."),
    "sglx_kv_cache_usage": ("gauge", "Share of the KV pool held by running requests (0..1)."),
}


def _num(value: float) -> str:
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer() and math.isfinite(value)):
        return str(int(value))
    return repr(float(value))
