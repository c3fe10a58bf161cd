"""Ring attention through the selected backend's LSE path: run in 2 spawned gloo ranks (tests/test_ring_lse.py).

The fa backend is built on stand-in kernels with FA4's and FA2's signatures (the real ones need a GPU): they
count their calls and compute exact attention in float64, returning bf16 outputs and a float32 LSE the way
the packages do (FA2's LSE padded on the query axis, as some builds return it). sage_attn's stand-in has
sageattn's signature and returns no LSE, so its ring steps must take the documented SDPA fallback. On GPUs
(tests/gpu/test_ring_lse_gpu.py) "fa" is the real backend, its kernel's calls counted.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch

from sglx.attention.diffusion.metadata import DiTAttnMetadata
from sglx.attention.diffusion.sdpa import TorchSDPABackend
from sglx.diffusion.parallel.attention import SequenceParallelBackend
from sglx.diffusion.parallel.degrees import SPDegrees
from sglx.diffusion.parallel.groups import sp_groups
from sglx.distributed.group import destroy_distributed, init_distributed
from sp_workers import DIM, GRID, HEADS, _inputs, _shard, _unshard, sdpa64


def exact_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, S, H, D] float64 attention: (out in q's dtype, lse [B, H, Sq] float32)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * scale
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.exp(scores - lse[..., None]), v.double())
    return out.to(q.dtype), lse.float()


class Calls:
    """How many times each stand-in kernel ran, and with which LSE keywords."""

    def __init__(self) -> None:
        self.n = 0
        self.lse_requests = 0


def fa4_standin(calls: Calls) -> Callable[..., Any]:
    def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None = None,
                        causal: bool = False, return_lse: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        calls.n += 1
        calls.lse_requests += int(return_lse)
        out, lse = exact_with_lse(q, k, v, softmax_scale)
        return out, (lse if return_lse else None)  # FA4 fills the LSE only when asked (or for autograd)
    return flash_attn_func


def fa2_standin(calls: Calls) -> Callable[..., Any]:
    def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                        softmax_scale: float | None = None, causal: bool = False,
                        return_attn_probs: bool = False) -> Any:
        calls.n += 1
        out, lse = exact_with_lse(q, k, v, softmax_scale)
        if not return_attn_probs:
            return out
        calls.lse_requests += 1
        pad = -lse.shape[2] % 128  # a padded query axis: only the first Sq entries are the LSE
        return out, torch.nn.functional.pad(lse, (0, pad), value=float("nan")), None
    return flash_attn_func


def sage_standin(calls: Calls) -> Callable[..., Any]:
    def sageattn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tensor_layout: str = "HND",
                 is_causal: bool = False, sm_scale: float | None = None, smooth_k: bool = True) -> torch.Tensor:
        calls.n += 1
        return exact_with_lse(q, k, v, sm_scale)[0]
    return sageattn


class CountingSDPA(TorchSDPABackend):
    """torch_sdpa, counting the calls of its LSE path."""

    def __init__(self, calls: Calls) -> None:
        super().__init__()
        self.calls = calls

    def forward_dense_with_lse(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                               scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls.n += 1
        self.calls.lse_requests += 1
        return super().forward_dense_with_lse(q, k, v, scale=scale)


def _counted_fa(calls: Calls):  # type: ignore[no-untyped-def]
    """The real fa backend (the FA variant the registry picks here), counting its kernel's calls."""
    from sglx.attention.diffusion.flash_attn import FlashAttentionBackend

    backend = FlashAttentionBackend()
    kernel = backend._fn

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.n += 1
        calls.lse_requests += int(bool(kwargs.get("return_lse") or kwargs.get("return_attn_probs")))
        return kernel(*args, **kwargs)

    backend._fn = counted
    return backend


def _backend(name: str, calls: Calls):  # type: ignore[no-untyped-def]
    from sglx.attention.diffusion.flash_attn import FlashAttentionBackend
    from sglx.attention.diffusion.sage import SageAttentionBackend

    if name == "fa":
        return _counted_fa(calls), torch.bfloat16
    if name == "torch_sdpa":
        return CountingSDPA(calls), torch.float32
    if name == "fa4":
        return FlashAttentionBackend(kernel=fa4_standin(calls), variant="FA4"), torch.bfloat16
    if name == "fa2":
        return FlashAttentionBackend(kernel=fa2_standin(calls), variant="FA2"), torch.bfloat16
    return SageAttentionBackend(kernel=sage_standin(calls)), torch.bfloat16


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def ring_backend_cases(rank: int, world: int, names: list[str], device: str = "cpu") -> dict[str, Any]:
    """Per backend, ring degree `world` with prefix text and GQA (4 query heads, 2 KV heads; head dim 64 for
    sage and the real fa): max |ring - SP 1 through the same backend|, max |ring - float64|, the rank's calls
    of the backend's kernel (and LSE requests) during the ring forward, whether the ring used the backend's
    own kernel, and the warnings logged."""
    torch.set_num_threads(1)
    dev = init_distributed(device=device).device
    warnings = _Warnings()
    logging.getLogger("sglx.diffusion").addHandler(warnings)
    groups = sp_groups(SPDegrees(1, world))
    out: dict[str, Any] = {}
    try:
        for i, name in enumerate(names):
            calls = Calls()
            backend, dtype = _backend(name, calls)
            dim = 64 if name in ("sage", "fa") else DIM  # sageattn and FA4 take head dims 64/96/128
            meta = DiTAttnMetadata(grid=GRID, num_heads=HEADS, head_dim=dim, text_tokens=5, text_position="prefix")
            q, k, v = _inputs(40 + i, 5, 2, dtype)
            if dim != DIM:
                q, k, v = (torch.cat([t] * (dim // DIM), dim=-1) * (DIM / dim) ** 0.25 for t in (q, k, v))
            q, k, v = (t.to(dev) for t in (q, k, v))
            single = backend.forward(q, k, v, meta=meta)  # SP 1: one process, the backend's own forward
            calls.n = calls.lse_requests = 0
            before = len(warnings.lines)
            sp = SequenceParallelBackend(backend, groups)
            full, spread = _unshard(sp.forward(*(_shard(t, meta, rank, world) for t in (q, k, v)), meta=meta), meta)
            out[name] = {"vs_sp1": float((full.float() - single.float()).abs().max()),
                         "vs_f64": float((full.double() - sdpa64(q, k, v)).abs().max()),
                         "text_spread": float(spread), "kernel_calls": calls.n,
                         "lse_requests": calls.lse_requests, "own_kernel": sp.ring_step.own_kernel,
                         "warnings": warnings.lines[before:]}
    finally:
        logging.getLogger("sglx.diffusion").removeHandler(warnings)
        destroy_distributed()
    return out
