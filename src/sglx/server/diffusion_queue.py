"""One generation at a time: a bounded FIFO of diffusion jobs, run by one worker task in a worker thread.

Images and videos share the queue, so two generations never hold GPU memory together. A job runs in a
thread (the event loop stays free for polling and health checks) and is given a step callback; a job
that is cancelled (DELETE /v1/videos/{id}, a client gone, the server stopping) stops at its next
denoising step through that callback.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sglx.server.config import DEFAULT_MAX_QUEUED_REQUESTS
from sglx.server.errors import APIError

log = logging.getLogger("sglx.server")
StepFn = Callable[[int, int], None]  # (steps done, total steps)


class JobCancelled(Exception):
    """Raised inside a job's step callback to stop it between denoising steps."""


class QueueFull(APIError):
    def __init__(self, limit: int) -> None:
        super().__init__(503, f"the server already has {limit} generation job(s) waiting (--max-queued-requests "
                              f"{limit}); retry later", code="queue_full", headers={"Retry-After": "5"})


@dataclass(eq=False)
class Job:
    """`work(step)` runs in a worker thread; its return value (or exception) lands in `future`."""

    kind: str  # image | video, for metrics
    work: Callable[[StepFn], Any]
    future: asyncio.Future[Any]
    on_step: StepFn | None = None
    number: int = 0
    submitted: float = field(default_factory=time.monotonic)
    started: float | None = None
    cancel_reason: str | None = None

    def step(self, done: int, total: int) -> None:
        if self.cancel_reason is not None:
            raise JobCancelled(self.cancel_reason)
        if self.on_step is not None:
            self.on_step(done, total)


class GenerationQueue:
    """FIFO of jobs, at most `max_queued` waiting besides the one running."""

    def __init__(self, max_queued: int = DEFAULT_MAX_QUEUED_REQUESTS) -> None:
        self.max_queued = max_queued
        self.waiting: collections.deque[Job] = collections.deque()
        self.running: Job | None = None
        self.closed = False
        self._counter = itertools.count(1)
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the worker on the running event loop (the app's lifespan)."""
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._work(), name="sglx-diffusion-worker")

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done() and not self.closed

    @property
    def pending(self) -> int:
        """Jobs not finished: waiting plus running."""
        return len(self.waiting) + (self.running is not None)

    def submit(self, kind: str, work: Callable[[StepFn], Any], on_step: StepFn | None = None) -> Job:
        if self.closed:
            raise APIError(503, "the server is shutting down", code="server_shutdown")
        if self.pending > self.max_queued:  # the new job would be one too many waiting
            raise QueueFull(self.max_queued)
        job = Job(kind, work, asyncio.get_running_loop().create_future(), on_step, next(self._counter))
        self.waiting.append(job)
        assert self._wake is not None, "GenerationQueue.start() was not called"
        self._wake.set()
        return job

    def position(self, job: Job) -> int:
        """0 while running, else 1 + the jobs ahead of it (-1 once it left the queue)."""
        if job is self.running:
            return 0
        with contextlib.suppress(ValueError):
            return self.waiting.index(job) + 1 + (self.running is not None)
        return -1

    def cancel(self, job: Job, reason: str) -> None:
        """A waiting job leaves the queue now; the running one stops at its next step."""
        job.cancel_reason = reason
        if job in self.waiting:
            self.waiting.remove(job)
            if not job.future.done():
                job.future.set_exception(JobCancelled(reason))

    async def _work(self) -> None:
        assert self._wake is not None
        while not self.closed:
            if not self.waiting:
                self._wake.clear()
                await self._wake.wait()
                continue
            job = self.waiting.popleft()
            self.running = job
            job.started = time.monotonic()
            log.debug("%s job %d started after %.3f s in the queue (%d waiting)", job.kind, job.number,
                      job.started - job.submitted, len(self.waiting))
            try:
                result = await asyncio.to_thread(job.work, job.step)
            except Exception as exc:  # noqa: BLE001 - handed to whoever waits on the job
                if not job.future.done():
                    job.future.set_exception(exc)
            else:
                if not job.future.done():
                    job.future.set_result(result)
            finally:
                self.running = None

    async def stop(self, reason: str = "the server shut down") -> None:
        """Cancel every waiting job, stop the running one at its next step, and wait for the worker."""
        self.closed = True
        for job in list(self.waiting):
            self.cancel(job, reason)
        if self.running is not None:
            self.running.cancel_reason = reason
        if self._wake is not None:
            self._wake.set()
        if self._task is not None:
            await self._task
