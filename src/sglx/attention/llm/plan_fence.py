"""A fence around FlashInfer's `plan()` for overlap scheduling.

FlashInfer's wrappers stage each plan's indptrs and work lists in one pinned host buffer and copy them to
the device without blocking. With overlap scheduling the host plans step n+1 while the GPU may not yet have
executed step n's copy, so rewriting the pinned buffer could corrupt step n's plan. Waiting on an event
recorded right after the previous plan's copies closes that race; by the time step n+1 is planned the host
has already consumed step n-1's tokens, so the wait is for a copy that is next in the stream (microseconds).
"""

from __future__ import annotations

import torch


class PlanFence:
    """Call `before()` ahead of a plan that reuses the pinned buffer and `after()` once the plans are queued."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._event: torch.cuda.Event | None = None

    def before(self) -> None:
        if self._event is not None:
            self._event.synchronize()
            self._event = None

    def after(self) -> None:
        if not self._cuda or torch.cuda.is_current_stream_capturing():
            return
        event = torch.cuda.Event()
        event.record()
        self._event = event
