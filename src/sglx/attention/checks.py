"""`doctor --check`: run each usable backend on a small random problem and compare with float64.

A backend whose package imports but whose kernel fails (or returns wrong numbers) is reported
as broken/failed with the error, so users learn it before a server start does.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass

import torch

from sglx.attention.registry import BackendSpec
from sglx.attention.sparse_checks import SPARSE_BACKENDS, sparse_problem
from sglx.platform import PlatformSnapshot

TOLERANCE = {torch.float32: 2e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}


@dataclass(frozen=True)
class CheckResult:
    backend: str
    family: str
    kind: str
    status: str  # "pass" | "fail" | "broken"
    max_abs_error: float | None
    tolerance: float
    ms: float | None
    problem: str
    error: str | None = None


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                        scale: float) -> torch.Tensor:
    """float64 attention; q [Hq, Lq, D], k/v [Hkv, Lk, D], mask [Lq, Lk] (True = attend)."""
    group = q.shape[0] // k.shape[0]
    k64 = k.double().repeat_interleave(group, 0)
    v64 = v.double().repeat_interleave(group, 0)
    scores = q.double() @ k64.transpose(-1, -2) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v64


def check_dtype(snap: PlatformSnapshot) -> torch.dtype:
    return torch.float32 if snap.device_kind in ("cpu", "mps") else torch.bfloat16


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _llm_problem(spec: BackendSpec, snap: PlatformSnapshot, device: torch.device, dtype: torch.dtype
                 ) -> tuple[float, float, str]:
    """Extend (with cached prefixes, ragged) then decode, on scattered pages; returns (max error, ms, shape)."""
    from sglx.attention.llm.base import BackendContext, LayerSpec
    from sglx.llm.forward_batch import ForwardBatch, ForwardMode
    from sglx.llm.kv_cache import ReqToTokenPool, TokenKVPool

    gen = torch.Generator().manual_seed(0)
    hq, hkv, dim = 8, 2, 64
    rule = spec.page_size_rule(snap)
    page = rule.sizes[0] if rule else 4
    prefix_lens, extend_lens = [0, 13, 37], [21, 6, 1]
    total = [p + e + 1 for p, e in zip(prefix_lens, extend_lens)]  # +1 for the decode step
    pages_needed = sum(-(-t // page) for t in total)
    num_slots = (pages_needed + 3) * page
    r2t = ReqToTokenPool(4, max(total) + page, device)
    pool = TokenKVPool(num_slots, page, 1, hkv, dim, dtype, device=device)
    page_ids = (torch.randperm(num_slots // page, generator=gen) + 1).tolist()  # page 0 is padding
    rows, keys, values = [], [], []
    for t in total:
        row = r2t.alloc()
        assert row is not None
        n_pages = -(-t // page)
        mine = [page_ids.pop() for _ in range(n_pages)]
        slots = torch.tensor([p * page + j for p in mine for j in range(page)][:t], device=device)
        r2t.req_to_token[row, :t] = slots.to(torch.int32)
        rows.append(row)
        keys.append(torch.randn(t, hkv, dim, generator=gen).to(device, dtype))
        values.append(torch.randn(t, hkv, dim, generator=gen).to(device, dtype))
    for row, p, kk, vv in zip(rows, prefix_lens, keys, values):
        if p:
            pool.set_kv(0, r2t.req_to_token[row, :p].long(), kk[:p], vv[:p])
    ctx = BackendContext(device, dtype, hq, hkv, dim, page, r2t, pool)
    backend = spec.load()(ctx)
    layer = LayerSpec(0, hq, hkv, dim, dim ** -0.5)
    worst = 0.0
    elapsed = 0.0
    for phase in ("extend", "decode"):
        if phase == "extend":
            lo = prefix_lens
            hi = [p + e for p, e in zip(prefix_lens, extend_lens)]
            mode = ForwardMode.EXTEND
        else:
            lo = [p + e for p, e in zip(prefix_lens, extend_lens)]
            hi = total
            mode = ForwardMode.DECODE
        n_new = [h - low for low, h in zip(lo, hi)]
        q = torch.randn(sum(n_new), hq, dim, generator=gen).to(device, dtype)
        k_new = torch.cat([kk[a:b] for kk, a, b in zip(keys, lo, hi)])
        v_new = torch.cat([vv[a:b] for vv, a, b in zip(values, lo, hi)])
        loc = torch.cat([r2t.req_to_token[r, a:b].long() for r, a, b in zip(rows, lo, hi)])
        positions = torch.cat([torch.arange(a, b) for a, b in zip(lo, hi)]).to(device)
        batch = ForwardBatch(
            mode=mode, input_ids=torch.zeros(sum(n_new), dtype=torch.long, device=device), positions=positions,
            req_pool_indices=torch.tensor(rows, device=device), seq_lens=torch.tensor(hi, device=device),
            out_cache_loc=loc, req_to_token_pool=r2t, token_kv_pool=pool, attn_backend=backend,
            seq_lens_cpu=list(hi), extend_seq_lens_cpu=n_new if mode is ForwardMode.EXTEND else [],
            extend_prefix_lens_cpu=list(lo) if mode is ForwardMode.EXTEND else [],
        )
        _sync(device)
        start = time.perf_counter()
        backend.init_forward_metadata(batch)
        out = backend.forward(q, k_new, v_new, layer, batch)
        _sync(device)
        elapsed += time.perf_counter() - start
        offset = 0
        for kk, vv, a, b in zip(keys, values, lo, hi):
            n = b - a
            qpos = torch.arange(a, b)[:, None]
            mask = (torch.arange(b)[None, :] <= qpos).to(device)
            ref = reference_attention(q[offset:offset + n].transpose(0, 1), kk[:b].transpose(0, 1),
                                      vv[:b].transpose(0, 1), mask, layer.scaling)
            got = out[offset:offset + n].transpose(0, 1).double()
            worst = max(worst, (got - ref).abs().max().item())
            offset += n
    shape = f"bs=3 Hq={hq} Hkv={hkv} D={dim} page={page} prefix={prefix_lens} extend={extend_lens} +1 decode"
    return worst, elapsed * 1e3, shape


# (batch, query tokens, key tokens, query heads, kv heads, head dim): self-attention whose lengths are not
# multiples of any kernel block (64, 128), with GQA, and a cross-attention (queries to 45 text tokens).
DIFFUSION_PROBLEMS = ((2, 77, 77, 8, 2, 64), (1, 300, 300, 4, 4, 128), (2, 77, 45, 4, 4, 64))


def _diffusion_problem(spec: BackendSpec, device: torch.device, dtype: torch.dtype) -> tuple[float, float, str]:
    """Self-attention (`forward`) and cross-attention (`forward_dense`) shapes; (max error, ms, shapes)."""
    gen = torch.Generator().manual_seed(0)
    backend = spec.load()({})
    worst, elapsed = 0.0, 0.0
    for b, sq, skv, hq, hkv, dim in DIFFUSION_PROBLEMS:
        q = torch.randn(b, sq, hq, dim, generator=gen).to(device, dtype)
        k = torch.randn(b, skv, hkv, dim, generator=gen).to(device, dtype)
        v = torch.randn(b, skv, hkv, dim, generator=gen).to(device, dtype)
        scale = 0.9 * dim ** -0.5  # not the default: the scale must reach the kernel
        _sync(device)
        start = time.perf_counter()
        if sq == skv:
            out = backend.forward(q, k, v, scale=scale, meta=None, layer=0)
        else:
            out = backend.forward_dense(q, k, v, scale=scale)
        _sync(device)
        elapsed += time.perf_counter() - start
        for i in range(b):
            ref = reference_attention(q[i].transpose(0, 1), k[i].transpose(0, 1), v[i].transpose(0, 1), None, scale)
            worst = max(worst, (out[i].transpose(0, 1).double() - ref).abs().max().item())
    shapes = ", ".join(f"B{b} S{sq}x{skv} H{hq}/{hkv} D{d}" for b, sq, skv, hq, hkv, d in DIFFUSION_PROBLEMS)
    return worst, elapsed * 1e3, f"{shapes}; non-causal, scale 0.9/sqrt(D)"


def tolerance(spec: BackendSpec, dtype: torch.dtype) -> float:
    """The dtype's tolerance, or the wider one a lossy backend declares in the registry (sage_attn: INT8 QK)."""
    declared = getattr(spec.features, "check_tolerance", None)
    if declared is not None and dtype in (torch.float16, torch.bfloat16):
        return max(declared, TOLERANCE[dtype])
    return TOLERANCE[dtype]


def run_check(spec: BackendSpec, snap: PlatformSnapshot) -> CheckResult:
    """Run one backend's small problem on this machine's device; never raises."""
    device = torch.device(snap.torch_device)
    dtype = check_dtype(snap)
    tol = tolerance(spec, dtype)
    try:
        # Twice: the first run pays for kernel compilation (Triton JIT), the second is what gets timed.
        for _ in range(2):
            if spec.family == "llm" and spec.kind == "mla":
                from sglx.attention.mla_checks import mla_problem

                err, ms, shape = mla_problem(spec, snap, device, dtype)
            elif spec.family == "llm":
                err, ms, shape = _llm_problem(spec, snap, device, dtype)
            elif spec.name in SPARSE_BACKENDS:  # dense problems as every backend, then a real sparse call
                err, ms, shape = _diffusion_problem(spec, device, dtype)
                s_err, s_ms, s_shape = sparse_problem(spec, device, dtype, _sync)
                err, ms, shape = max(err, s_err), ms + s_ms, f"{shape}; sparse: {s_shape}"
            else:
                err, ms, shape = _diffusion_problem(spec, device, dtype)
    except Exception as exc:  # a broken kernel must be reported, not crash doctor
        last = traceback.extract_tb(exc.__traceback__)[-1]
        where = f" ({last.filename.rsplit('/', 1)[-1]}:{last.lineno})"
        return CheckResult(spec.name, spec.family, spec.kind, "broken", None, tol, None, "",
                           f"{type(exc).__name__}: {exc}"[:400] + where)
    status = "pass" if err <= tol else "fail"
    error = None if status == "pass" else f"max abs error {err:.3g} exceeds {tol:g} vs float64 reference"
    return CheckResult(spec.name, spec.family, spec.kind, status, err, tol, ms, f"{shape}, {dtype}", error)
