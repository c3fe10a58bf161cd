"""The `sglx bench serving` report as a rich table (the same numbers `--json` prints), and its ratio to an
offline-engine result on the same prompts (`--offline-result`, from `sglx bench offline-throughput`)."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from sglx.errors import SglxError

THROUGHPUT_KEYS = ("request_throughput", "input_token_throughput", "output_token_throughput", "total_token_throughput")
TARGET_RATIO = 0.9  # issue 13: serving at least 0.9x the offline engine on the same prompts


def vs_offline(report: dict[str, Any], offline: dict[str, Any], source: str = "") -> dict[str, Any]:
    """Serving throughput / offline throughput per metric. Refuses results of other prompts (the prompt
    fingerprints differ) or an offline run with failed requests, since their ratio would mean nothing."""
    name = source or "the offline result"
    missing = [k for k in ("prompts_sha256", *THROUGHPUT_KEYS) if k not in offline]
    if missing:
        raise SglxError(f"{name} lacks {', '.join(missing)}: give a JSON written by `sglx bench offline-throughput "
                        "--output-file`")
    if offline["prompts_sha256"] != report.get("prompts_sha256"):
        raise SglxError(f"{name} was measured on other prompts (prompt fingerprints differ): run both benches with "
                        "the same --num-prompts, --random-* lengths, --length-dist, --prompt-kind, --seed and model")
    cfg, off_cfg = report.get("config", {}), offline.get("config", {})
    if cfg.get("endpoint", "completions") != "completions":
        raise SglxError(f"--endpoint {cfg['endpoint']}: the offline engine runs the prompts as completions; compare "
                        "a --endpoint completions run (the chat template changes the requests)")
    differ = [f"--{k.replace('_', '-')}" for k in ("ignore_eos", "temperature")
              if k in cfg and k in off_cfg and cfg[k] != off_cfg[k]]
    if differ:
        raise SglxError(f"{name} used other {', '.join(differ)}: give both benches the same values")
    if offline.get("failed"):
        raise SglxError(f"{name} has {offline['failed']} failed requests; its throughput is not comparable")
    ratios = {k: (report[k] / offline[k] if offline[k] else 0.0) for k in THROUGHPUT_KEYS}
    return {"offline_file": source or None, "offline_max_concurrency": offline.get("config", {}).get("max_concurrency"),
            "offline": {k: offline[k] for k in THROUGHPUT_KEYS}, "ratio": ratios, "target_ratio": TARGET_RATIO,
            "meets_target": ratios["output_token_throughput"] >= TARGET_RATIO}


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
        if "p90_ms" in s:
            table.add_row(f"{label} p90 (ms)", f"{s['p90_ms']:.2f}")
        table.add_row(f"{label} p99 (ms)", f"{s['p99_ms']:.2f}")
    cmp = report.get("vs_offline")
    if cmp:
        table.add_section()
        for key in THROUGHPUT_KEYS:
            table.add_row(f"{key.replace('_', ' ')} / offline engine", f"{cmp['ratio'][key]:.3f}x")
        table.add_row(f"meets {cmp['target_ratio']}x (output tok/s)", "yes" if cmp["meets_target"] else "no")
    return table
