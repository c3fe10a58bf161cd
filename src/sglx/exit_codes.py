"""Words for how a child process ended, shared by the tensor-parallel group and the server's engine process."""

from __future__ import annotations

import signal


def describe_exit(code: int | None, running: str = "is still running") -> str:
    """A Popen/multiprocessing exit code as the end of "the process ...": a negative code is the signal that killed
    it; None (no exit code yet) reads as `running`."""
    if code is None:
        return running
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
