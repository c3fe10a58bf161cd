"""Ranks for test_spawn_semaphores: each makes multiprocessing locks (named semaphores, as tqdm does for every
progress bar), then rank 1 raises while rank 0 waits to be terminated, or both return.

Many locks, so that releasing them takes long enough for the parent's SIGTERMs to land in the middle of it: one
landing between a finalizer's unlink and unregister is what made CI print a leaked-semaphore warning once in
many runs (with 2000 locks the old code leaked in 4 of 6 runs)."""

from __future__ import annotations

import multiprocessing
import sys
import time

from sglx.distributed import WorkerError, spawn_workers

LOCKS = 2000


def lock_then(rank: int, world: int, fail: bool) -> str:
    locks = [multiprocessing.RLock() for _ in range(LOCKS)]  # noqa: F841 - alive until the rank ends
    if fail and rank == 1:
        raise ValueError("boom")
    if fail:
        time.sleep(60)  # ended by WorkerGroup.terminate (SIGTERM) once rank 1 failed
    return multiprocessing.get_start_method()


if __name__ == "__main__":
    try:
        print(spawn_workers(lock_then, 2, (sys.argv[1] == "fail",), timeout_s=120), flush=True)
    except WorkerError as exc:
        print(f"error: {exc}", flush=True)
