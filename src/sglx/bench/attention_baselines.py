"""Baselines timed next to sglx's backends in `sglx bench attention`: SDPA on contiguous KV, and FlashInfer.

SDPA (cuDNN when it accepts the call, else PyTorch's own choice) reads K/V as one contiguous
[B, H, L, D] tensor: the speed a paged kernel would have if paging were free. FlashInfer's paged
wrappers (decode with tensor cores; ragged prefill without a prefix, paged prefill with one) read
the same pool the sglx backends read, viewed as [pages, page_size, H, D]. FlashInfer is imported only
here and only when asked for; any failure becomes a recorded error, never a crash of the benchmark.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from sglx.bench.attention_inputs import DTYPES, AttentionCase, CaseInputs
from sglx.bench.timing import TimingBudget, median_ms

FLASHINFER_WORKSPACE_BYTES = 256 << 20


@dataclass
class PreparedRun:
    """A ready-to-time call: `fn()` returns the [tokens, Hq, D] output; `context` wraps checking and timing."""

    name: str  # row label
    key: str  # ratio column: "sdpa" | "flashinfer"
    fn: Callable[[], torch.Tensor]
    kv_cache_dtype: str  # what it reads (SDPA: always the compute dtype)
    detail: str = ""
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    keep: list = field(default_factory=list)  # tensors the call needs alive
    # the output as [tokens, Hq, D] for the accuracy check only, so a layout change is not timed as part of the call
    as_rows: Callable[[torch.Tensor], torch.Tensor] = lambda out: out


@contextlib.contextmanager
def _cudnn() -> Iterator[None]:
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        yield


# only to choose between two ways of making the same SDPA call; the chosen one is then timed in full
CHOICE_BUDGET = TimingBudget(warmup_ms=5.0, rep_ms=20.0, min_runs=5, max_runs=50)


def _quick_ms(fn: Callable[[], torch.Tensor], context: Callable[[], contextlib.AbstractContextManager],
              device: torch.device) -> float:
    with context():
        return median_ms(fn, device, CHOICE_BUDGET).median_ms


def sdpa_contiguous(case: AttentionCase, inputs: CaseInputs) -> PreparedRun:
    """SDPA over contiguous copies of the pool's K/V (in the compute dtype, also for fp8 cases), called as its
    fastest: the output stays in SDPA's own layout (the [tokens, Hq, D] copy is made for the check only), and a
    prefix case takes the faster of cuDNN with a boolean mask and PyTorch's own kernel with a lower-right causal
    bias (the 2026-11-21 H100 run's cuDNN prefill baseline, with the copy and the mask, read 480 TFLOP/s where a
    plain cuDNN call gives 572-576)."""
    b, n, hq, hkv, d = case.batch, case.new, case.q_heads, case.kv_heads, case.head_dim
    k = inputs.keys.transpose(1, 2).contiguous()  # [B, Hkv, L, D]
    v = inputs.values.transpose(1, 2).contiguous()
    if case.phase == "decode":  # a KV head's query group are its query rows: no K/V copies for GQA
        q = inputs.q.view(b, hkv, hq // hkv, d)

        def call() -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, scale=case.scale)

        run = PreparedRun("sdpa contiguous", "sdpa", call, "auto", keep=[q, k, v],
                          as_rows=lambda o: o.reshape(b, hq, d))
        return _prefer_cudnn(run, q.device)
    q = inputs.q.view(b, n, hq, d).transpose(1, 2).contiguous()  # [B, Hq, n, D]
    if hq != hkv:
        k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)

    def rows(o: torch.Tensor) -> torch.Tensor:
        return o.transpose(1, 2).reshape(b * n, hq, d)

    if not case.prefix:
        def causal() -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=case.scale)

        return _prefer_cudnn(PreparedRun("sdpa contiguous", "sdpa", causal, "auto", keep=[q, k, v], as_rows=rows),
                             q.device)
    # causal aligned bottom-right: new query i sees keys 0..prefix + i
    mask = torch.ones(n, case.kv_len, dtype=torch.bool, device=q.device).tril(case.prefix)

    def masked() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=case.scale)

    run = _prefer_cudnn(PreparedRun("sdpa contiguous", "sdpa", masked, "auto", keep=[q, k, v, mask], as_rows=rows),
                        q.device)
    if q.device.type != "cuda":
        return run
    from torch.nn.attention.bias import causal_lower_right

    bias = causal_lower_right(n, case.kv_len)

    def lower_right() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=case.scale)

    try:
        other = _quick_ms(lower_right, contextlib.nullcontext, q.device)
        mine = _quick_ms(run.fn, run.context, q.device)
    except RuntimeError as exc:
        run.detail += f"; lower-right causal bias refused ({str(exc).splitlines()[0][:60]})"
        return run
    if other < mine:
        return PreparedRun("sdpa contiguous (causal_lower_right)", "sdpa", lower_right, "auto", keep=[q, k, v],
                           detail=f"PyTorch's choice with a lower-right causal bias ({other:.3f} ms; {run.detail} "
                                  f"with a boolean mask {mine:.3f} ms)", as_rows=rows)
    run.detail += f" (faster than PyTorch's choice with a lower-right causal bias: {mine:.3f} vs {other:.3f} ms)"
    return run


def _prefer_cudnn(run: PreparedRun, device: torch.device) -> PreparedRun:
    """cuDNN when it accepts the call (named so in the row), else PyTorch's own choice."""
    if device.type != "cuda":
        return run
    try:
        with _cudnn():
            run.fn()
        run.name, run.detail, run.context = run.name.replace("sdpa", "sdpa cudnn", 1), "cuDNN", _cudnn
    except RuntimeError as exc:  # cuDNN refused this shape or mask: PyTorch picks another kernel
        run.detail = f"cuDNN unavailable ({str(exc).splitlines()[0][:80]}); PyTorch's choice"
    return run


def flashinfer_module() -> tuple[object | None, str]:
    """(flashinfer, version) when it imports, else (None, why not)."""
    try:
        import flashinfer  # type: ignore[import-not-found]
    except Exception as exc:  # not installed, or installed but broken: both mean no FlashInfer baseline
        return None, f"{type(exc).__name__}: {exc}"[:200]
    return flashinfer, str(getattr(flashinfer, "__version__", "unknown"))


def flashinfer_paged(case: AttentionCase, inputs: CaseInputs, fi: object) -> PreparedRun:
    """FlashInfer on the same pool: paged decode (tensor cores), ragged prefill, or paged prefill over a prefix."""
    device = inputs.q.device
    b, page, length = case.batch, case.page_size, case.kv_len
    per_req = -(-length // page)
    page_ids = (inputs.slots[:, ::page] // page).to(torch.int32).reshape(-1).contiguous()
    page_indptr = torch.arange(b + 1, dtype=torch.int32, device=device) * per_req
    last_page_len = torch.full((b,), length - (per_req - 1) * page, dtype=torch.int32, device=device)
    pool = inputs.token_kv_pool
    kv_dtype = pool.fp8_dtype or DTYPES[case.dtype]
    k_cache = pool.k_buffer[0].view(kv_dtype).view(-1, page, case.kv_heads, case.head_dim)
    v_cache = pool.v_buffer[0].view(kv_dtype).view(-1, page, case.kv_heads, case.head_dim)
    workspace = torch.empty(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    q_dtype = DTYPES[case.dtype]
    out = torch.empty_like(inputs.q)
    if case.phase == "decode":
        wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)  # type: ignore
        wrapper.plan(page_indptr, page_ids, last_page_len, case.q_heads, case.kv_heads, case.head_dim, page,
                     q_data_type=q_dtype, kv_data_type=kv_dtype, sm_scale=case.scale)
        name = "flashinfer paged decode (tensor cores)"

        def call() -> torch.Tensor:
            return wrapper.run(inputs.q, (k_cache, v_cache), out=out)
        keep = [k_cache, v_cache]
    elif case.prefix == 0:
        wrapper = fi.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD")  # type: ignore[attr-defined]
        qo_indptr = torch.arange(b + 1, dtype=torch.int32, device=device) * case.new
        kv_indptr = torch.arange(b + 1, dtype=torch.int32, device=device) * length
        k = inputs.keys.reshape(b * length, case.kv_heads, case.head_dim)
        v = inputs.values.reshape(b * length, case.kv_heads, case.head_dim)
        wrapper.plan(qo_indptr, kv_indptr, case.q_heads, case.kv_heads, case.head_dim, causal=True,
                     sm_scale=case.scale, q_data_type=q_dtype, kv_data_type=q_dtype)
        name = "flashinfer ragged prefill"

        def call() -> torch.Tensor:
            return wrapper.run(inputs.q, k, v, out=out)
        keep = [k, v]
    else:
        wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")  # type: ignore[attr-defined]
        qo_indptr = torch.arange(b + 1, dtype=torch.int32, device=device) * case.new
        wrapper.plan(qo_indptr, page_indptr, page_ids, last_page_len, case.q_heads, case.kv_heads, case.head_dim,
                     page, causal=True, sm_scale=case.scale, q_data_type=q_dtype, kv_data_type=kv_dtype)
        name = "flashinfer paged prefill"

        def call() -> torch.Tensor:
            return wrapper.run(inputs.q, (k_cache, v_cache), out=out)
        keep = [k_cache, v_cache]
    kv = case.kv_cache_dtype if name != "flashinfer ragged prefill" else "auto"
    return PreparedRun(name, "flashinfer", call, kv, keep=[workspace, wrapper, out, *keep])
