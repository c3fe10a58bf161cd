"""Serving against the offline engine on identical prompts: `sglx bench offline-throughput`, then `sglx serve` +
`sglx bench serving --offline-result`, interleaved per repetition and concurrency, and a summary of medians,
spreads and ratios.

Each run gets a fresh process (a fresh engine, an empty prefix cache): the offline bench in one process, the
server in another with the bench client in a third. Both sides run under the same `nice` and thread settings.

    python benchmarks/serving_vs_offline.py --out benchmarks/results/serving_vs_offline_cpu \\
        --concurrency 32 --concurrency 0 --reps 2 -- --dtype float32
(concurrency 0: every request at once; arguments after `--` are engine flags given to both sides.)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

KEYS = ("request_throughput", "input_token_throughput", "output_token_throughput", "total_token_throughput")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def sglx(args: list[str], nice: int) -> list[str]:
    return (["nice", "-n", str(nice)] if nice else []) + [sys.executable, "-m", "sglx", *args]


def run_offline(out: Path, dataset: list[str], engine: list[str], nice: int, env: dict[str, str]) -> dict[str, Any]:
    subprocess.run(sglx(["bench", "offline-throughput", *dataset, *engine, "--output-file", str(out), "--json"], nice),
                   check=True, env=env, stdout=subprocess.DEVNULL)
    return dict(json.loads(out.read_text()))


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a running process, all threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of a process and its running descendants (sglx serve's HTTP process and its engine process)."""
    import psutil

    pids = [pid] + [c.pid for c in psutil.Process(pid).children(recursive=True)]
    total = 0.0
    for p in pids:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            total += process_cpu_s(p)
    return total


def run_serving(out: Path, offline_file: Path, dataset: list[str], engine: list[str], nice: int,
                env: dict[str, str], log: Path, server_src: str | None) -> dict[str, Any]:
    port = free_port()
    server_env = {**env, "PYTHONPATH": server_src} if server_src else env
    with open(log, "w") as log_file:
        server = subprocess.Popen(sglx(["serve", "--port", str(port), *engine], nice), stdout=log_file,
                                  stderr=subprocess.STDOUT, env=server_env)
        try:
            deadline = time.monotonic() + 300
            while True:
                if server.poll() is not None:
                    raise RuntimeError(f"sglx serve exited with {server.returncode}; see {log}")
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"sglx serve did not become healthy; see {log}")
                time.sleep(0.3)
            cpu_before = tree_cpu_s(server.pid)
            subprocess.run(sglx(["bench", "serving", "--base-url", f"http://127.0.0.1:{port}", *dataset,
                                 "--disable-progress", "--offline-result", str(offline_file), "--output-file",
                                 str(out), "--json"], nice), check=True, env=env, stdout=subprocess.DEVNULL)
            server_cpu = tree_cpu_s(server.pid) - cpu_before  # the bench's span (client start-up included)
        finally:
            server.terminate()
            server.wait(60)
    report = dict(json.loads(out.read_text()))
    report["server_cpu_s"] = server_cpu
    out.write_text(json.dumps(report, indent=2) + "\n")
    return report


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": len(values)}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per concurrency: median/min/max of each side's throughput, of the per-pair ratio, and serving latencies."""
    out: dict[str, Any] = {}
    for conc in sorted({r["concurrency"] for r in runs}):
        rs = [r for r in runs if r["concurrency"] == conc]
        row: dict[str, Any] = {
            "offline": {k: spread([r["offline"][k] for r in rs]) for k in KEYS},
            "serving": {k: spread([r["serving"][k] for r in rs]) for k in KEYS},
            "ratio_per_pair": {k: spread([r["serving"][k] / r["offline"][k] for r in rs]) for k in KEYS},
            "ratio_of_medians": {k: statistics.median([r["serving"][k] for r in rs])
                                 / statistics.median([r["offline"][k] for r in rs]) for k in KEYS},
            # CPU seconds per request: what each side costs, apart from how much of the shared host it got
            "offline_cpu_ms_per_request": spread([r["offline"]["cpu_s"] / r["offline"]["completed"] * 1e3
                                                  for r in rs]),
            "server_cpu_ms_per_request": spread([r["serving"]["server_cpu_s"] / r["serving"]["completed"] * 1e3
                                                 for r in rs]),
        }
        for lat in ("ttft", "itl", "e2e_latency"):
            row[lat] = {p: statistics.median([r["serving"][lat][p] for r in rs])
                        for p in ("mean_ms", "median_ms", "p90_ms", "p99_ms")}
        out[str(conc) if conc else "all"] = row
    return out


def main() -> None:
    argv = sys.argv[1:]
    engine = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="directory for every run's JSON and summary.json")
    ap.add_argument("--concurrency", type=int, action="append", help="max concurrency, repeatable; 0 = all at once")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--random-input-len", type=int, default=128)
    ap.add_argument("--random-output-len", type=int, default=32)
    ap.add_argument("--random-range-ratio", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--nice", type=int, default=10, help="nice level of every process (both sides alike)")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every process")
    ap.add_argument("--server-src", default=None,
                    help="PYTHONPATH of the server only (e.g. an older checkout's src/, to measure a change)")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONUNBUFFERED": "1"}
    base = ["--num-prompts", str(args.num_prompts), "--random-input-len", str(args.random_input_len),
            "--random-output-len", str(args.random_output_len), "--random-range-ratio", str(args.random_range_ratio),
            "--seed", str(args.seed)]
    runs = []
    for rep in range(args.reps):
        for conc in args.concurrency or [32]:
            dataset = base + (["--max-concurrency", str(conc)] if conc else [])
            tag = f"c{conc or 'all'}_rep{rep}"
            offline_file = args.out / f"offline_{tag}.json"
            offline = run_offline(offline_file, dataset, engine, args.nice, env)
            serving = run_serving(args.out / f"serving_{tag}.json", offline_file, dataset, engine, args.nice, env,
                                  args.out / f"serve_{tag}.log", args.server_src)
            ratio = serving["output_token_throughput"] / offline["output_token_throughput"]
            print(f"{tag}: offline {offline['request_throughput']:.2f} req/s ({offline['cpu_s']:.1f} cpu s), serving "
                  f"{serving['request_throughput']:.2f} req/s ({serving['server_cpu_s']:.1f} server cpu s), "
                  f"ratio {ratio:.3f}", flush=True)
            runs.append({"concurrency": conc, "rep": rep, "offline": offline, "serving": serving})
    machine = {"platform": platform.platform(), "cpu_count": os.cpu_count(), "python": sys.version.split()[0],
               **runs[0]["offline"].get("environment", {})}
    summary = {"machine": machine,
               "server_src": args.server_src, "engine_flags": engine, "dataset": base, "nice": args.nice,
               "omp_num_threads": args.threads,
               "engine": runs[0]["offline"].get("engine"), "by_concurrency": summarize(runs)}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary["by_concurrency"], indent=1))


if __name__ == "__main__":
    main()
