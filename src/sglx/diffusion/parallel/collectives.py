"""The data movement of sequence parallelism, on torch.distributed collectives (NCCL on GPUs, gloo on CPU).

Ulysses: `seq_to_heads` turns this rank's sequence chunk of every head [B, s, H, D] into the whole (Ulysses
group's) sequence of its H/u heads [B, u*s, H/u, D] with one all-to-all; `heads_to_seq` is the inverse.
Ring: `RingExchange` passes a tensor to the next ring rank while the current block is being attended.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def seq_to_heads(x: torch.Tensor, group: Any, degree: int) -> torch.Tensor:
    """[B, s, H, D] sequence chunk of all heads -> [B, degree*s, H/degree, D] all chunks of this rank's heads."""
    if degree == 1:
        return x
    b, s, h, d = x.shape
    send = x.reshape(b, s, degree, h // degree, d).permute(2, 0, 1, 3, 4).contiguous()  # [u, B, s, h/u, D]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[j]: rank j's chunk of my heads
    return recv.permute(1, 0, 2, 3, 4).reshape(b, degree * s, h // degree, d)


def seq_to_heads_many(xs: list[torch.Tensor], group: Any, degree: int) -> list[torch.Tensor]:
    """`seq_to_heads` of same-shaped tensors (q, k, v) in ONE all-to-all: one collective instead of three."""
    if degree == 1:
        return list(xs)
    if len({tuple(x.shape) for x in xs}) != 1 or len({x.dtype for x in xs}) != 1:
        return [seq_to_heads(x, group, degree) for x in xs]
    b, s, h, d = xs[0].shape
    n = len(xs)
    send = torch.stack([x.reshape(b, s, degree, h // degree, d).permute(2, 0, 1, 3, 4) for x in xs], dim=1)
    recv = torch.empty_like(send)  # [u, n, B, s, h/u, D]
    dist.all_to_all_single(recv, send, group=group)
    out = recv.permute(1, 2, 0, 3, 4, 5).reshape(n, b, degree * s, h // degree, d)
    return list(out.unbind(0))


def heads_to_seq(x: torch.Tensor, group: Any, degree: int) -> torch.Tensor:
    """[B, degree*s, h, D] all chunks of this rank's heads -> [B, s, degree*h, D] this rank's chunk of all heads."""
    if degree == 1:
        return x
    b, length, h, d = x.shape
    s = length // degree
    send = x.reshape(b, degree, s, h, d).transpose(0, 1).contiguous()  # [u, B, s, h, D]: chunk j goes to rank j
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[j]: rank j's heads of my chunk
    return recv.permute(1, 2, 0, 3, 4).reshape(b, s, degree * h, d)


def gather_heads(x: torch.Tensor, group: Any, degree: int) -> torch.Tensor:
    """[B, S, h, D] this rank's heads -> [B, S, degree*h, D] every rank's heads, in rank order."""
    if degree == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(degree)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=2)


def gather_seq(x: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Concatenate every rank's chunk of the default group along `dim`, in rank (= sequence) order."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)


class RingExchange:
    """Send to the next ring rank and receive from the previous one, asynchronously (batch_isend_irecv)."""

    def __init__(self, group: Any, ring_ranks: tuple[int, ...], rank: int) -> None:
        self.group = group
        i = ring_ranks.index(rank)
        self.next = ring_ranks[(i + 1) % len(ring_ranks)]
        self.prev = ring_ranks[(i - 1) % len(ring_ranks)]
        self._pending: list[Any] = []
        self._ops: list[Any] = []  # keeps the send buffer alive until wait()

    def start(self, tensor: torch.Tensor) -> torch.Tensor:
        """Begin passing `tensor` on; returns the buffer that `wait` fills with the previous rank's tensor."""
        recv = torch.empty_like(tensor)
        ops = [dist.P2POp(dist.isend, tensor.contiguous(), self.next, self.group),
               dist.P2POp(dist.irecv, recv, self.prev, self.group)]
        self._ops, self._pending = ops, dist.batch_isend_irecv(ops)
        return recv

    def wait(self) -> None:
        for req in self._pending:
            req.wait()
        self._pending, self._ops = [], []
