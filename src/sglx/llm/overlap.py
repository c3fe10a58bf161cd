"""Overlap scheduling's two device-side pieces: the future-token map and a launched step's pending output.

With overlap on (the default, as SGLang's overlap scheduler), the scheduler launches step n+1 before it
has read step n's sampled tokens: while the GPU runs step n, the host schedules and prepares step n+1.
A request decoding in step n+1 needs step n's token as its input, which the host does not know yet, so
its input id is a placeholder `-i` that names entry i of the `FutureTokenMap`; step n's sampler wrote
the token there on the device, and step n+1 resolves placeholders on the device before its forward.
The host reads step n's tokens (a non-blocking copy and an event, `StepOutput.wait`) only after step
n+1 was launched, one step late: stop conditions, streaming and finishing requests happen then, so a
request that finished at step n ran one extra decode step whose token is discarded (the scheduler
gives that step's KV slot back).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglx.llm.request import Request


class FutureTokenMap:
    """A ring of device slots holding sampled tokens the host has not read yet; placeholders are `-index`.

    Entries are 1-based (a placeholder of 0 would be token 0). The ring holds three steps' worth of
    requests: a step's entries are read by the next step's forward, which the device runs before any
    step that could reuse them is launched.
    """

    def __init__(self, max_running_requests: int, device: torch.device) -> None:
        self.size = 3 * max(1, max_running_requests) + 1
        self.device = device
        self.tokens = torch.zeros(self.size + 1, dtype=torch.long, device=device)
        self._next = 0

    def reserve(self, n: int) -> list[int]:
        """Entries for n tokens sampled by one step (placeholder of entry i: -i)."""
        out = [(self._next + k) % self.size + 1 for k in range(n)]
        self._next = (self._next + n) % self.size
        return out

    def store(self, entries: list[int], tokens: torch.Tensor) -> None:
        """Write a step's sampled tokens (device tensor) into their entries, on the device."""
        index = torch.tensor(entries, dtype=torch.long).to(self.device, non_blocking=True)
        self.tokens[index] = tokens.to(torch.long)

    def resolve(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids with every placeholder replaced by its token, computed on the device (no host sync)."""
        return torch.where(input_ids < 0, self.tokens[(-input_ids).clamp(min=0)], input_ids)


@dataclass
class StepOutput:
    """What one launched step sampled, on its way to the host.

    reqs: every request of the step (in batch order); sampled: those that sampled a token, with their
    future-map entries; tokens/logprobs/top_*: host tensors filled by non-blocking copies that are
    complete once `wait` returns.
    """

    reqs: list[Request]
    decode_ids: set[int]  # id() of the requests that decoded (were already running) in this step
    sampled: list[Request]
    entries: list[int]
    tokens: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_values: torch.Tensor | None = None
    event: torch.cuda.Event | None = None

    def wait(self) -> tuple[list[int], list[float] | None, list[list[tuple[int, float]]] | None]:
        """Block until the step's outputs are on the host; returns tokens, chosen logprobs, top logprobs."""
        if self.event is not None:
            self.event.synchronize()
        tokens = self.tokens.tolist() if self.tokens is not None else []
        logprobs = self.logprobs.tolist() if self.logprobs is not None else None
        top = None
        if self.top_ids is not None and self.top_values is not None:
            top = [list(zip(i, v)) for i, v in zip(self.top_ids.tolist(), self.top_values.tolist())]
        return tokens, logprobs, top


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy that does not block the host (pinned memory on CUDA); valid once the step's event fired."""
    if tensor.device.type == "cpu":
        return tensor
    out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    out.copy_(tensor, non_blocking=True)
    return out


def record_event(device: torch.device) -> torch.cuda.Event | None:
    """An event after everything enqueued so far on the device's current stream (None on the CPU)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event
