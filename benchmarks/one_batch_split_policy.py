"""`sglx bench one-batch` with the triton decode split policy chosen on the command line, for same-machine A/B runs.

    PYTHONPATH=src python3 benchmarks/one_batch_split_policy.py --one-split-rows-per-sm 0 -- bench one-batch ...

`--one-split-rows-per-sm 0` restores the policy before session 13 (splits sized by `DecodeConfig.waves` alone, so
batch 64 x 8 KV heads ran 2 splits and the stage-2 merge); any other value sets `DecodeConfig.one_split_rows_per_sm`
for every DecodeConfig the triton backend builds (CUDA graphs are captured with it). The rest goes to the sglx CLI.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

import sglx.attention.llm.triton as triton_backend
from sglx.cli.app import main as sglx_main


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--one-split-rows-per-sm", type=float, required=True)
    ap.add_argument("rest", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    base = triton_backend.DecodeConfig

    def patched(**kw):  # the backend calls DecodeConfig() with no arguments
        return replace(base(**kw), one_split_rows_per_sm=args.one_split_rows_per_sm)
    triton_backend.DecodeConfig = patched  # type: ignore[assignment, misc]
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    sys.argv = ["sglx", *rest]
    sglx_main()


if __name__ == "__main__":
    main()
