"""Accuracy of the embedded model on its recall task through every runnable backend and page size.

Usage: python scripts/eval_embedded.py [--examples 100] [--pairs 62] [--json]
Runs on whatever device `--device auto` picks; prints a table (or JSON) of accuracy per configuration.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from rich.console import Console
from rich.table import Table

from sglx import platform
from sglx.attention.registry import all_backends, availability
from sglx.attention.request import AttentionRequest
from sglx.llm.embedded.task import MAX_PAIRS, make_example, normalize_output, score
from sglx.llm.engine import Engine


def runnable_backends(page_size: int, kv_cache_dtype: str) -> list[str]:
    """Backends that run here for this page size and KV dtype (flex_attention has no fp8 KV)."""
    snap = platform.current()
    req = AttentionRequest(family="llm", kind="mha", page_size=page_size, kv_cache_dtype=kv_cache_dtype)
    return [s.name for s in all_backends("llm", "mha") if availability(s, snap, req).ok]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--examples", type=int, default=100)
    parser.add_argument("--pairs", type=int, default=MAX_PAIRS)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rng = random.Random(7)
    examples = [make_example(rng, args.pairs) for _ in range(args.examples)]
    prompts, answers = [p for p, _ in examples], [a for _, a in examples]
    rows = []
    for page_size in (1, 16, 64):
        for kv in ("auto", "fp8_e4m3"):
            for backend in runnable_backends(page_size, kv):
                for radix in (True, False):
                    start = time.perf_counter()
                    with Engine(attention_backend=backend, page_size=page_size, kv_cache_dtype=kv,
                                disable_radix_cache=not radix, chunked_prefill_size=128,
                                device=args.device) as eng:
                        results = eng.generate(prompts, {"max_new_tokens": 8, "temperature": 0.0})
                        device = eng.info["device"]
                    outputs = [normalize_output(r["text"]) for r in results]
                    rows.append({"backend": backend, "page_size": page_size, "kv_cache_dtype": kv,
                                 "radix_cache": radix, "chunked_prefill": 128, "device": device,
                                 "examples": len(answers), "pairs": args.pairs,
                                 "prompt_tokens": results[0]["prompt_tokens"],
                                 "accuracy": score(outputs, answers),
                                 "seconds": round(time.perf_counter() - start, 2)})
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    table = Table(title=f"tiny-kv-recall accuracy, {args.examples} prompts of {args.pairs} pairs")
    for col in ("device", "backend", "page", "KV", "radix", "accuracy", "s"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["device"], r["backend"], str(r["page_size"]), r["kv_cache_dtype"],
                      "on" if r["radix_cache"] else "off", f"{r['accuracy']:.1%}", str(r["seconds"]))
    Console().print(table)


if __name__ == "__main__":
    main()
