"""Ranks for test_spawn_semaphores: each makes a multiprocessing lock (a named semaphore, as tqdm does for every
progress bar), then rank 1 raises while rank 0 waits to be terminated, or both return."""

from __future__ import annotations

import multiprocessing
import sys
import time

from sglx.distributed import WorkerError, spawn_workers


def lock_then(rank: int, world: int, fail: bool) -> str:
    lock = multiprocessing.RLock()  # noqa: F841 - alive until the rank ends, as a progress bar's lock is
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
