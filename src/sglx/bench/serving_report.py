"""The `sglx bench serving` report as a rich table (the same numbers `--json` prints)."""

from __future__ import annotations

from typing import Any

from rich.table import Table


def report_table(report: dict[str, Any]) -> Table:
    cfg = report["config"]
    rate = cfg["request_rate"] if cfg["request_rate"] is not None else "inf"
    title = (f"sglx bench serving: {report['model']} at {cfg['base_url']} ({cfg['endpoint']}, "
             f"rate {rate}/s, max concurrency {cfg['max_concurrency'] or 'none'})")
    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("successful requests", f"{report['completed']}"),
        ("failed requests", f"{report['failed']}"),
        ("duration (s)", f"{report['duration_s']:.2f}"),
        ("peak concurrency", f"{report['peak_concurrency']}"),
        ("total input tokens", f"{report['total_input_tokens']}"),
        ("total output tokens", f"{report['total_output_tokens']}"),
        ("request throughput (req/s)", f"{report['request_throughput']:.2f}"),
        ("input token throughput (tok/s)", f"{report['input_token_throughput']:.2f}"),
        ("output token throughput (tok/s)", f"{report['output_token_throughput']:.2f}"),
        ("total token throughput (tok/s)", f"{report['total_token_throughput']:.2f}"),
    ]
    for row in rows:
        table.add_row(*row)
    for key, label in (("ttft", "time to first token"), ("itl", "inter-token latency"),
                       ("e2e_latency", "end-to-end latency")):
        s = report[key]
        table.add_section()
        table.add_row(f"{label} mean (ms)", f"{s['mean_ms']:.2f}")
        table.add_row(f"{label} median (ms)", f"{s['median_ms']:.2f}")
        table.add_row(f"{label} p99 (ms)", f"{s['p99_ms']:.2f}")
    return table
