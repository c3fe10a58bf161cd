"""`python -m sglx.attention.measured`: write a GPU class's record from benchmark reports (arguments only)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from sglx.attention.measured.build import build_record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sglx.attention.measured",
        description="Record sglx backends' medians from `sglx bench attention --json` reports (one GPU class) "
                    "so that auto-selection ranks backends by them; `sglx bench one-batch --json` reports add the "
                    "whole engine's medians (decode step, prefill), which rank before the kernels'. Point "
                    "SGLX_ATTENTION_RECORDS at the output's directory to use your own record.")
    parser.add_argument("reports", nargs="+", type=Path, help="report JSON files (REPORT or REPORT@DATE)")
    parser.add_argument("--gpu-class", required=True, help="e.g. sm90-h100 (sglx doctor --json shows yours)")
    parser.add_argument("--output", required=True, type=Path, help="where to write <gpu class>.json")
    args = parser.parse_args(argv)
    reports = []
    for item in args.reports:
        path, _, date = str(item).partition("@")
        try:
            reports.append((json.loads(Path(path).read_text()), path, date or None))
        except (OSError, ValueError) as exc:
            print(f"error: {path}: {exc}", file=sys.stderr)
            return 2
    try:
        record = build_record(args.gpu_class, reports)
    except (ValueError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(record, indent=1) + "\n")
    except OSError as exc:
        print(f"error: cannot write the record to {args.output}: {exc.strerror or exc}; give --output a writable "
              "path", file=sys.stderr)
        return 2
    print(f"wrote {len(record['entries'])} medians for {args.gpu_class} to {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
