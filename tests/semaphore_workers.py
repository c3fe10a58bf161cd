"""Ranks for test_spawn_semaphores: each makes multiprocessing locks (named semaphores, as tqdm does for every
progress bar), then rank 1 raises while rank 0 waits to be terminated, or both return.

Many locks, so that releasing them takes long enough for the parent's SIGTERMs to land in the middle of it: one
landing between a finalizer's unlink and unregister is what made CI print a leaked-semaphore warning once in
many runs (with 2000 locks the old code leaked in 4 of 6 runs)."""

from __future__ import annotations

import multiprocessing
import sys
import tempfile
import time
from pathlib import Path

from sglx.distributed import WorkerError, spawn_workers

LOCKS = 2000


def lock_then(rank: int, world: int, fail: bool, ready: str) -> str:
    locks = [multiprocessing.RLock() for _ in range(LOCKS)]  # noqa: F841 - alive until the rank ends
    if rank == 0:
        Path(ready).touch()
    if fail and rank == 1:
        # Fail only once rank 0 holds all its locks: a SIGTERM landing inside a lock's construction, between its
        # tracker registration and its finalizer (multiprocessing.synchronize.SemLock.__init__), leaves one
        # semaphore no finalizer can release; that window belongs to multiprocessing, not to this test's subject.
        while not Path(ready).exists():
            time.sleep(0.01)
        raise ValueError("boom")
    if fail:
        time.sleep(60)  # ended by WorkerGroup.terminate (SIGTERM) once rank 1 failed
    return multiprocessing.get_start_method()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        try:
            print(spawn_workers(lock_then, 2, (sys.argv[1] == "fail", f"{tmp}/rank0_ready"), timeout_s=120),
                  flush=True)
        except WorkerError as exc:
            print(f"error: {exc}", flush=True)
