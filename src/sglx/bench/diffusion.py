"""`sglx bench diffusion` (a): dense DiT attention at real model shapes, every usable backend vs cuDNN SDPA.

Each shape is one self-attention call of a real DiT (Wan2.1-1.3B at 81x480x832, Wan2.1-14B at 720p,
FLUX.1 at 1024x1024 with its 512 joint text tokens). Every sglx diffusion backend usable here runs it
through `forward` with the step's DiTAttnMetadata; the baselines run in the same process on the same
numbers: SDPA pinned to cuDNN on [B, H, S, D] (what a PyTorch user's best call is), SDPA's own flash
kernel, and FlashAttention 4 called directly when `flash_attn.cute` imports. Every output is first
compared with a float64 reference on sampled query rows (full rows: every key); only a correct result is
timed. `x cuDNN` = cuDNN time / this time (above 1 = faster than cuDNN).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

from sglx.attention.checks import TOLERANCE, tolerance
from sglx.attention.diffusion.metadata import DiTAttnMetadata
from sglx.attention.registry import all_backends, availability, find
from sglx.attention.request import AttentionRequest
from sglx.bench.timing import TimingBudget, median_ms
from sglx.errors import SglxError

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
SAMPLED_ROWS = 96  # query rows per batch entry checked against float64 (all heads, all keys)


@dataclass(frozen=True)
class DiTShape:
    """One DiT self-attention call: latent grid after patchify plus joint text tokens (prefix, MM-DiT)."""

    key: str
    title: str
    grid: tuple[int, int, int]
    heads: int
    head_dim: int = 128
    text_tokens: int = 0
    batch: int = 1

    @property
    def tokens(self) -> int:
        t, h, w = self.grid
        return t * h * w + self.text_tokens

    def flops(self) -> float:
        return 4.0 * self.batch * self.heads * self.tokens ** 2 * self.head_dim

    def metadata(self) -> DiTAttnMetadata:
        return DiTAttnMetadata(grid=self.grid, num_heads=self.heads, head_dim=self.head_dim,
                               text_tokens=self.text_tokens,
                               text_position="prefix" if self.text_tokens else "none", batch_size=self.batch)

    def label(self) -> str:
        text = f" + {self.text_tokens} text" if self.text_tokens else ""
        return f"{self.title}: B{self.batch} {self.tokens} tokens{text} H{self.heads} D{self.head_dim}"


# Wan VAE: 4x time (4k+1 frames), 8x space; patch (1, 2, 2). FLUX VAE 8x, patch 2x2, 512 T5 tokens.
SHAPES = {
    "wan-1.3b": DiTShape("wan-1.3b", "Wan2.1-1.3B 81x480x832", (21, 30, 52), 12),
    "wan-14b-720p": DiTShape("wan-14b-720p", "Wan2.1-14B 81x720x1280", (21, 45, 80), 40),
    "flux-1024": DiTShape("flux-1024", "FLUX.1 1024x1024", (1, 64, 64), 24, text_tokens=512),
}
CPU_SHAPES = {
    "tiny-video": DiTShape("tiny-video", "tiny video 5x6x7", (5, 6, 7), 4, 64),
    "tiny-joint": DiTShape("tiny-joint", "tiny image 8x9 + text", (1, 8, 9), 4, 64, text_tokens=29),
}


@dataclass(frozen=True)
class DiffusionAttentionBenchConfig:
    shapes: tuple[str, ...] = ()  # empty: every shape for the device (SHAPES on CUDA, CPU_SHAPES on CPU)
    backends: tuple[str, ...] = ()  # empty: every implemented diffusion backend usable here
    dtype: str | None = None  # CUDA bfloat16, CPU float32
    baselines: bool = True
    warmup_ms: float | None = None
    rep_ms: float | None = None
    seed: int = 0

    def shape_list(self, device: torch.device) -> list[DiTShape]:
        table = SHAPES if device.type == "cuda" else CPU_SHAPES
        known = {**SHAPES, **CPU_SHAPES}
        unknown = [s for s in self.shapes if s not in known]
        if unknown:
            raise SglxError(f"--shape {', '.join(unknown)}: unknown; choose from {', '.join(known)}")
        return [known[s] for s in self.shapes] if self.shapes else list(table.values())

    def budget(self, device: torch.device) -> TimingBudget:
        cpu = device.type != "cuda"
        return TimingBudget(warmup_ms=self.warmup_ms if self.warmup_ms is not None else (5.0 if cpu else 100.0),
                            rep_ms=self.rep_ms if self.rep_ms is not None else (20.0 if cpu else 1000.0),
                            min_runs=3 if cpu else 10, max_runs=50 if cpu else 200)


def resolve_backends(names: tuple[str, ...], snap: Any, dtype: str) -> list[str]:
    """Explicit names must exist, be implemented and run here; empty: every usable implemented dense backend."""
    req = AttentionRequest(family="diffusion", kind="dit", dtype=dtype, head_dim=128)
    if not names:  # dense ones: a sparse backend needs its config and is benchmarked against its own pattern
        return [s.name for s in all_backends("diffusion", "dit")
                if s.implemented and not s.features.sparse and availability(s, snap, req).ok]
    out = []
    for name in names:
        spec = find(name, "diffusion", "dit")
        if spec is None:
            known = ", ".join(s.name for s in all_backends("diffusion", "dit"))
            raise SglxError(f"--backend {name}: no such diffusion attention backend (known: {known})")
        avail = availability(spec, snap, req)
        if not avail.ok:
            raise SglxError(f"--backend {name} cannot run here: {'; '.join(avail.reasons)}")
        out.append(spec.name)
    return out


@dataclass
class Run:
    name: str
    kind: str  # "sglx" | "baseline"
    fn: Callable[[], torch.Tensor]  # returns [B, S, H, D]
    tol: float
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    detail: str = ""


@contextlib.contextmanager
def _sdpa(backend: Any) -> Iterator[None]:
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel([backend]):
        yield


def _baselines(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, tol: float) -> list[Run]:
    """cuDNN SDPA and SDPA flash on [B, H, S, D] copies; FA4 directly on [B, S, H, D] when it imports."""
    from torch.nn.attention import SDPBackend

    qh, kh, vh = (t.transpose(1, 2).contiguous() for t in (q, k, v))

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(qh, kh, vh, scale=scale).transpose(1, 2)

    runs = [Run("sdpa cudnn", "baseline", sdpa, tol, lambda: _sdpa(SDPBackend.CUDNN_ATTENTION), "cuDNN"),
            Run("sdpa flash", "baseline", sdpa, tol, lambda: _sdpa(SDPBackend.FLASH_ATTENTION), "FA2 in PyTorch")]
    try:
        from flash_attn.cute import flash_attn_func  # type: ignore[import-not-found]
    except Exception as exc:  # not installed or broken: the row says why
        runs.append(Run("fa4 direct", "baseline", _raiser(f"flash_attn.cute: {type(exc).__name__}: {exc}"), tol))
    else:
        runs.append(Run("fa4 direct", "baseline", lambda: flash_attn_func(q, k, v, softmax_scale=scale)[0], tol,
                        detail="flash_attn.cute.flash_attn_func"))
    return runs


def _raiser(message: str) -> Callable[[], torch.Tensor]:
    def call() -> torch.Tensor:
        raise RuntimeError(message)
    return call


def sampled_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """float64 attention of the sampled query rows over all keys, head by head: [B, len(rows), H, D]."""
    out = torch.empty(q.shape[0], len(rows), q.shape[2], q.shape[3], dtype=torch.float64, device=q.device)
    group = q.shape[2] // k.shape[2]
    for b in range(q.shape[0]):
        for h in range(q.shape[2]):
            qs = q[b, rows, h].double()
            kk, vv = k[b, :, h // group].double(), v[b, :, h // group].double()
            out[b, :, h] = torch.softmax(qs @ kk.T * scale, dim=-1) @ vv
    return out


def _measure(run: Run, ref: torch.Tensor, rows: torch.Tensor, shape: DiTShape, device: torch.device,
             budget: TimingBudget) -> dict[str, Any]:
    row: dict[str, Any] = {"backend": run.name, "kind": run.kind}
    if run.detail:
        row["detail"] = run.detail
    try:
        with run.context():
            out = run.fn()
            err = (out[:, rows].double() - ref).abs().max().item()
            row.update(max_abs_err=err, tolerance=run.tol, ok=err <= run.tol)
            if not row["ok"]:
                row["error"] = f"max |out - float64| = {err:.3g} > {run.tol:g}: wrong result, not timed"
                return row
            del out
            timing = median_ms(run.fn, device, budget)
    except Exception as exc:  # a backend or baseline that cannot run this shape is a result, not a crash
        row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:300])
        return row
    row.update(median_ms=timing.median_ms, min_ms=timing.min_ms, max_ms=timing.max_ms, runs=timing.runs,
               tflops=shape.flops() / (timing.median_ms * 1e-3) / 1e12)
    return row


def run_shape(shape: DiTShape, backends: list[str], device: torch.device, dtype: torch.dtype,
              config: DiffusionAttentionBenchConfig) -> dict[str, Any]:
    gen = torch.Generator(device=device).manual_seed(config.seed)
    b, s, h, d = shape.batch, shape.tokens, shape.heads, shape.head_dim
    q, k, v = (torch.randn(b, s, h, d, device=device, dtype=dtype, generator=gen) for _ in range(3))
    scale = 1 / math.sqrt(d)
    rows = torch.randperm(s, device=device, generator=gen)[:SAMPLED_ROWS].sort().values
    ref = sampled_reference(q, k, v, rows, scale)
    meta = shape.metadata()
    runs = _baselines(q, k, v, scale, TOLERANCE[dtype]) if config.baselines and device.type == "cuda" else []
    for name in backends:
        spec = find(name, "diffusion", "dit")
        assert spec is not None
        try:
            backend = spec.load()({})
        except Exception as exc:
            runs.append(Run(name, "sglx", _raiser(f"{type(exc).__name__}: {exc}"), 0.0))
            continue
        variant = getattr(backend, "variant", "")

        def call(backend: Any = backend) -> torch.Tensor:
            return backend.forward(q, k, v, scale=scale, meta=meta, layer=0)
        runs.append(Run(name, "sglx", call, tolerance(spec, dtype), detail=variant))
    budget = config.budget(device)
    results = [_measure(r, ref, rows, shape, device, budget) for r in runs]
    cudnn = next((r["median_ms"] for r in results if r["backend"] == "sdpa cudnn" and r.get("median_ms")), None)
    for r in results:
        if cudnn and r.get("median_ms"):
            r["x_cudnn"] = cudnn / r["median_ms"]
    return {"shape": asdict(shape), "tokens": shape.tokens, "label": shape.label(), "rows": results}


def run_attention(config: DiffusionAttentionBenchConfig, device: torch.device, snap: Any,
                  progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    dtype_name = config.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    if dtype_name not in DTYPES:
        raise SglxError(f"--dtype {dtype_name}: choose one of {', '.join(DTYPES)}")
    backends = resolve_backends(config.backends, snap, dtype_name)
    out = []
    shapes = config.shape_list(device)
    for i, shape in enumerate(shapes):
        if progress is not None:
            progress(f"attention [{i + 1}/{len(shapes)}] {shape.label()}")
        with torch.inference_mode():
            out.append(run_shape(shape, backends, device, DTYPES[dtype_name], config))
        if device.type == "cuda":
            torch.cuda.empty_cache()  # this shape's inputs are gone with run_shape's frame
    return out
