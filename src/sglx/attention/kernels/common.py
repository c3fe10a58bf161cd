"""Helpers shared by the Triton kernels: KV storage formats, padded head dims, device facts, soft-cap.

Kept apart so store, decode and extend agree bit for bit on how fp8 KV is encoded and decoded.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634

# KV storage format codes passed to kernels as constexpr.
KV_NATIVE, KV_FP8_E4M3, KV_FP8_E5M2 = 0, 1, 2
_FORMAT_BY_DTYPE = {torch.float8_e4m3fn: KV_FP8_E4M3, torch.float8_e5m2: KV_FP8_E5M2}


def kv_format(fp8_dtype: torch.dtype | None) -> int:
    """The constexpr code of a pool's storage: native dtype, or uint8 bits of one fp8 format."""
    if fp8_dtype is None:
        return KV_NATIVE
    return _FORMAT_BY_DTYPE[fp8_dtype]


def padded_dim(head_dim: int) -> int:
    """tl.arange needs a power of two: head dims 80/96 run in a 128-wide block with masks."""
    return max(16, triton.next_power_of_2(head_dim))


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def has_tma(device: torch.device) -> bool:
    """Whether the device has the Tensor Memory Accelerator Triton's descriptors load through (NVIDIA SM90+)."""
    return device.type == "cuda" and not torch.version.hip and torch.cuda.get_device_capability(device)[0] >= 9


def offsets_fit_int32(*tensors: torch.Tensor) -> bool:
    """Whether every element offset of these tensors (from their shapes and strides) fits a signed 32-bit integer.

    Kernels that gather pool rows by slot id compute `slot * stride` in int32 when it does: 64-bit address arithmetic
    for every gathered row was a quarter of the extend kernel's pool loop (SASS, session 20)."""
    return all(sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()) if n > 0) < 2**31 for t in tensors)


def tma_rows_ok(x: torch.Tensor) -> bool:
    """x [R, H, D] can be read as [R, H * D] rows by a TMA descriptor with [rows, D] boxes: D a power of two up to
    256 (a box's limit), heads packed, unit last stride, a 16-byte aligned base and row stride, at least one row."""
    if x.dim() != 3:
        return False
    r, _, d = x.shape
    return (r > 0 and d == padded_dim(d) and d <= 256 and x.stride(2) == 1 and x.stride(1) == d
            and x.data_ptr() % 16 == 0 and (x.stride(0) * x.element_size()) % 16 == 0)


def tma_rows_descriptor(x: torch.Tensor, block_rows: int):
    """A host-side TMA descriptor over x [R, H, D] (`tma_rows_ok`) as [R, H * D] rows, [block_rows, D] boxes: head h
    of row r is box column h * D."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    r, h, d = x.shape
    rows = x.as_strided((r, h * d), (x.stride(0), 1))
    return TensorDescriptor(rows, [r, h * d], [x.stride(0), 1], [block_rows, d])


@functools.lru_cache(maxsize=8)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors (CUDA/ROCm) the split heuristic fills; a small fixed number elsewhere."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


@triton.jit
def slot_offsets(slots, SLOT64: tl.constexpr):
    """Slot ids as the integer type of their row offsets: int32 unless the pool's offsets need 64 bits."""
    if SLOT64:  # noqa: SIM108 - constexpr branch, resolved at compile time
        offsets = slots.to(tl.int64)
    else:
        offsets = slots
    return offsets


@triton.jit
def fp8_bits_to_value(x, FMT: tl.constexpr):
    """uint8 bits of fp8 -> the fp8 tensor (caller casts to its compute dtype); native data passes through."""
    if FMT == 1:
        y = x.to(tl.float8e4nv, bitcast=True)
    elif FMT == 2:
        y = x.to(tl.float8e5, bitcast=True)
    else:
        y = x
    return y


@triton.jit
def fp8_bits_to_f16_asm(x, FMT: tl.constexpr):
    """uint8 bits of fp8 -> float16 with the sm_89+ paired converts (exact: every e4m3/e5m2 value is an fp16).

    Written as inline PTX so the compiler keeps the conversion in the load's register layout: left to
    itself it moves the cast after the shared-memory read of the dot operand, where a transposed 8-bit
    tile (V) can only be read one byte per instruction.
    """
    if FMT == 1:
        y = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            "=r,=r,r", [x], dtype=tl.float16, is_pure=False, pack=4)
    else:
        y = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e5m2x2 $0, lo; cvt.rn.f16x2.e5m2x2 $1, hi; }",
            "=r,=r,r", [x], dtype=tl.float16, is_pure=False, pack=4)
    return y


# $2: four e4m3 codes; $0 / $1: codes 0-1 / 2-3 as bfloat16 pairs (element 0 in the low half). prmt spreads two codes
# into the high bytes of two halves, the sign is kept, exponent and mantissa shift down by four.
# tests/test_fp8_bit_moves.py runs this text through a small PTX simulator over every code.
E4M3_TO_BF16_SCALED_PTX = tl.constexpr(
    "{ .reg .b32 z, t0, t1, s0, s1; mov.b32 z, 0; "
    "prmt.b32 t0, $2, z, 0x1404; prmt.b32 t1, $2, z, 0x3424; "
    "shr.b32 s0, t0, 4; shr.b32 s1, t1, 4; "
    "and.b32 s0, s0, 0x07F007F0; and.b32 s1, s1, 0x07F007F0; "
    "and.b32 t0, t0, 0x80008000; and.b32 t1, t1, 0x80008000; "
    "or.b32 $0, t0, s0; or.b32 $1, t1, s1; }")


@triton.jit
def e4m3_bits_to_bf16_scaled(x):
    """uint8 bits of e4m3 -> bfloat16 equal to the value times 2**-120, by integer operations only.

    The sign bit stays on top and the 4 exponent and 3 mantissa bits move down by four places, under
    bfloat16's exponent field: the same number with the exponent bias 127 instead of 7 (exact; e4m3
    subnormals become bfloat16 subnormals). Why: the hardware conversion to bfloat16 is two instructions on the
    SM's conversion unit (F2FP to float16, F2F to bfloat16) per pair, and decode converts every K byte it reads.
    The caller takes the 2**120 back: `bits_k_query` on q, `bits_k_scores` on q K^T."""
    return tl.inline_asm_elementwise(E4M3_TO_BF16_SCALED_PTX, "=r,=r,r", [x], dtype=tl.bfloat16, is_pure=True, pack=4)


def bits_k_applies(fmt: int, q_dtype: torch.dtype) -> bool:
    """Whether K tiles of this pool format (kv_format: 1 = e4m3) can reach the dot by `e4m3_bits_to_bf16_scaled`:
    the moved bits are bfloat16, so the queries must be too."""
    return fmt == 1 and q_dtype == torch.bfloat16


# The bit-move contract, shared by decode/extend (`bits_k_query`, `bits_k_scores`) and the Gluon MLA kernel (which
# cannot call @triton.jit helpers): moved values are 2**-120 of the real ones; queries take BITS_K_Q_LIFT (exact), so
# their products with moved keys stay clear of float32's subnormals, and the scores still owe BITS_K_SCORE_SCALE.
BITS_K_VALUE_SCALE = 2.0 ** 120
BITS_K_Q_LIFT = tl.constexpr(2.0 ** 64)
BITS_K_SCORE_SCALE = tl.constexpr(BITS_K_VALUE_SCALE / 2.0 ** 64)


@triton.jit
def bits_k_query(q):
    """q for keys from `e4m3_bits_to_bf16_scaled`: times BITS_K_Q_LIFT, 2**64 (exact)."""
    return (q.to(tl.float32) * BITS_K_Q_LIFT).to(q.dtype)


@triton.jit
def bits_k_scores(qk):
    """Scores of a `bits_k_query` against bit-moved keys, back to their values: BITS_K_SCORE_SCALE, 2**56 (exact)."""
    return qk * BITS_K_SCORE_SCALE


@triton.jit
def kv_tile_to_compute(x, FMT: tl.constexpr, PTX: tl.constexpr, dtype: tl.constexpr):
    """A loaded K/V tile in the dtype its dot runs in: float16 through inline PTX, else a cast to `dtype`."""
    if PTX:  # noqa: SIM108 - a statement keeps the untaken branch out of the compiled kernel
        y = fp8_bits_to_f16_asm(x, FMT)
    else:
        y = fp8_bits_to_value(x, FMT).to(dtype)
    return y


@triton.jit
def value_to_fp8_bits(x, FMT: tl.constexpr):
    """float32 -> uint8 bits of e4m3fn (FMT 1) or e5m2 (FMT 2), round-to-nearest-even.

    Integer arithmetic instead of a cast so the bits equal torch's `.to(float8)` everywhere, the
    Triton interpreter included (its cast mis-rounds at binade edges); like torch, e4m3fn saturates
    out-of-range values and infinities to +-448 and e5m2 overflows to inf; NaN stays NaN.
    """
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    exp32 = mag >> 23
    mant = (mag & 0x7FFFFF) | 0x800000
    MBITS: tl.constexpr = 4 - FMT  # e4m3: 3 mantissa bits, e5m2: 2
    BIAS: tl.constexpr = 8 * FMT - 1  # e4m3: 7, e5m2: 15
    biased = exp32 - 127 + BIAS
    eb = tl.maximum(biased, 1)
    shift = tl.minimum(23 - MBITS + (eb - biased), 31)
    q = mant >> shift
    rest = mant - (q << shift)
    half = (1 << (shift - 1))
    q = q + ((rest > half) | ((rest == half) & ((q & 1) == 1))).to(tl.int32)
    enc = ((eb - 1) << MBITS) + q
    if FMT == 1:
        enc = tl.where(mag > 0x7F800000, 0x7F, tl.minimum(enc, 0x7E))
    else:
        enc = tl.where(exp32 == 0xFF, tl.where(mag > 0x7F800000, 0x7F, 0x7C), tl.minimum(enc, 0x7C))
    enc = tl.where(exp32 == 0, 0, enc)  # zeros and float32 subnormals
    return (enc | sign).to(tl.uint8)


@triton.jit
def encode_for_pool(x, scale, FMT: tl.constexpr, BUF_DT: tl.constexpr):
    """float32 x (a value of the model dtype) -> what the KV pool stores: the pool dtype, or fp8(x / scale) bits."""
    if FMT == 0:  # noqa: SIM108 - constexpr branch: the untaken side is never compiled
        y = x.to(BUF_DT)
    else:
        y = value_to_fp8_bits(x / scale, FMT)
    return y


@triton.jit
def fp8_max(FMT: tl.constexpr):
    """Largest finite value of the fp8 format (e4m3fn 448, e5m2 57344): a row's amax maps onto it."""
    if FMT == 1:  # noqa: SIM108 - constexpr branch
        m = 448.0
    else:
        m = 57344.0
    return m


@triton.jit
def quantize_rows(x, mult_ptr, FMT: tl.constexpr, STEPS: tl.constexpr, MIN_SCALE: tl.constexpr):
    """float32 x [R, C] -> (uint8 fp8 bits [R, C], float32 scale [R]) per row, as `kv_cache.quantize_per_token`.

    Base scale amax / fp8_max; with STEPS > 1 the candidates base * mult[j] are tried and the first with the
    least squared rounding error is kept (padding columns must be zero: they add no error).
    """
    base = tl.maximum(tl.max(tl.abs(x), 1) / fp8_max(FMT), MIN_SCALE)
    best_bits = value_to_fp8_bits(x / base[:, None], FMT)
    best_scale = base
    if STEPS > 1:
        deq = fp8_bits_to_value(best_bits, FMT).to(tl.float32) * base[:, None]
        best_err = tl.sum((deq - x) * (deq - x), 1)
        for j in tl.static_range(1, STEPS):
            scale = base * tl.load(mult_ptr + j)
            bits = value_to_fp8_bits(x / scale[:, None], FMT)
            deq = fp8_bits_to_value(bits, FMT).to(tl.float32) * scale[:, None]
            err = tl.sum((deq - x) * (deq - x), 1)
            better = err < best_err
            best_bits = tl.where(better[:, None], bits, best_bits)
            best_scale = tl.where(better, scale, best_scale)
            best_err = tl.where(better, err, best_err)
    return best_bits, best_scale


@triton.jit
def soft_cap(s, cap):
    """cap * tanh(s / cap), written with exp so it runs on every Triton backend and the interpreter."""
    t = s / cap
    return cap * (2.0 / (1.0 + tl.exp(-2.0 * t)) - 1.0)


@triton.jit
def dot(a, b, IEEE: tl.constexpr):
    """tl.dot; float32 inputs get exact IEEE products instead of TF32 (used by the CPU reference paths)."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def online_softmax_step(qk, visible, m_i, l_i, qk_scale, logit_cap, MASK: tl.constexpr, SOFTCAP: tl.constexpr):
    """One key tile of online softmax in the log2 domain -> (p, alpha, m_new, l_new).

    Without soft-cap the scale is applied as `qk * scale - m` (one FMA per score; scale > 0 keeps the
    row max); qk_scale then already holds log2(e). m_i starts finite (-1e30), so fully masked rows give
    p = 0 and alpha = 1 instead of NaN.
    """
    if SOFTCAP:
        s = soft_cap(qk * qk_scale, logit_cap) * 1.4426950408889634
        if MASK:
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
    else:
        if MASK:
            qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def pv_step(acc, alpha, p, v, v_scale_n, SCALED: tl.constexpr, IEEE: tl.constexpr):
    """acc * alpha + p V. SCALED: per-key V scales `v_scale_n` ([BLOCK_N]) enter as weights p * s / max(s) over the
    tile, which stay in [0, 1] (no fp16 underflow where likely keys have small scales), and the product is multiplied
    back by that max."""
    if SCALED:
        v_top = tl.max(v_scale_n, 0)
        p = p * (v_scale_n / v_top)[None, :]
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, IEEE) * v_top
    else:
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, IEEE)
    return acc


@triton.jit
def scaled_softmax_step(qk, visible, k_s, v_s, m_i, l_i, qk_scale, logit_cap, SOFTCAP: tl.constexpr):
    """`online_softmax_step` for keys with per-key K scales `k_s` and V scales `v_s` ([BLOCK_N] each, positive
    normal float32) -> (w, alpha, m_new, l_new) where the PV weights w already carry the V scales.

    Each V scale is split exactly into 2^e_n * f_n (f_n in [1, 2), integer bit operations) and e_n joins the
    score in the exponent: t = x + e_n, m = running row max of t, u = exp2(t - m), w = u * f_n = exp2(x - m) * s_n.
    Every weight is below 2 and each row's largest is at least 1, so fp16 weights neither overflow nor
    underflow (as a plain softmax's p), without a max over the tile's scales; the denominator adds
    u * 2^-e_n = exp2(x - m) (exact), so m + log2(l) is the log2-sum-exp of the scores x as in
    `online_softmax_step`. Masked keys' scales may hold anything (their scores become -inf, their factors
    stay finite).
    """
    bits = v_s.to(tl.int32, bitcast=True)
    biased = tl.minimum((bits >> 23) & 0xFF, 253)  # any bits (a masked key's) give finite factors
    frac = ((bits & 0x7FFFFF) | 0x3F800000).to(tl.float32, bitcast=True)
    inv_pow = ((254 - biased) << 23).to(tl.float32, bitcast=True)  # 2^-e
    e = (biased - 127).to(tl.float32)
    if SOFTCAP:
        t = soft_cap(qk * (k_s * qk_scale)[None, :], logit_cap) * 1.4426950408889634 + e[None, :]
    else:
        t = qk * (k_s * qk_scale)[None, :] + e[None, :]  # qk_scale holds log2(e): one FMA per score
    t = tl.where(visible, t, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(t, 1))
    u = tl.exp2(t - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    return u * frac[None, :], alpha, m_new, l_i * alpha + tl.sum(u * inv_pow[None, :], 1)
