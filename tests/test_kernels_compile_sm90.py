"""Kernels with constexpr branches (decode path, block-sparse) compile for sm_90a (H100) here, within its smem.

The interpreted tests check their numbers but never compile them; a type error inside a compile-time branch only
shows on a GPU (session 15: the router's add+norm branch reused a name for a tensor and an int64). Here each launch
variant the engine uses goes through Triton's compiler and its bundled ptxas (sglx.bench.sm90_compile), with the
real launch's pointer dtypes. Skipped where triton has no NVIDIA backend binaries.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

if importlib.util.find_spec("triton") is None:  # pragma: no cover - CI installs triton with torch
    pytest.skip("triton is not installed", allow_module_level=True)

import triton  # noqa: E402

if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():  # pragma: no cover
    pytest.skip("triton's NVIDIA backend binaries (ptxas) are not installed", allow_module_level=True)

from sglx.bench.sm90_compile import compile_sm90, gluon_source, kernel_source  # noqa: E402

BF16 = "*bf16"


def _router(add_norm: bool, one_chunk: bool, align: int) -> tuple:
    from sglx.llm.kernels.moe_router import _greedy_router_kernel

    ptrs = {"X": BF16, "W": BF16, "Logits": "*fp32", "Tickets": "*i32", "Weights": "*fp32", "Ids": "*i64",
            "Sorted_Ids": "*i32", "Block_Expert": "*i32", "Block_Rows": "*i32", "Residual": BF16, "Norm_W": BF16,
            "Normed": BF16, "Residual_Out": BF16}
    consts = dict(K=6, SHARED=2, RENORM=False, BLOCK_EP=2, BLOCK_H=2048 if one_chunk else 1024, BLOCK_E=64,
                  BLOCK_S=2, ALIGN_BM=align, ADD_NORM=add_norm, ONE_CHUNK=one_chunk)
    return kernel_source(_greedy_router_kernel, consts, ptrs, ("scale", "eps")), 4, 1


def _rmsnorm(residual: bool) -> tuple:
    from sglx.llm.kernels.rmsnorm import _rmsnorm_kernel

    ptrs = dict.fromkeys(("X", "Residual", "Weight", "Out", "Residual_Out"), BF16)
    return kernel_source(_rmsnorm_kernel, dict(HAS_RESIDUAL=residual, ROWS=1, BLOCK_N=2048), ptrs, ("eps",)), 4, 1


def _gemv(norm: int, narrow: bool, add: bool = False, pdl: bool = False, short: bool = False) -> tuple:
    from sglx.llm.kernels.gemv import _gemv_kernel, launch_params

    ptrs = dict.fromkeys(("X", "R", "G", "R_Out", "W", "B", "Y"), BF16)
    if short:  # the short-row launches, as `gemv` picks them for 2,048 inputs
        block_n, block_k, warps, _ = launch_params(2048, 2048, short_rows="normed" if norm else "plain")
    else:
        block_n, block_k, warps = (4, 1024, 8) if narrow else (8, 512, 4)
    consts = dict(NORM=norm, ADD=add, HAS_BIAS=True, BLOCK_N=block_n, BLOCK_K=block_k, PDL=pdl)
    return kernel_source(_gemv_kernel, consts, ptrs, ("eps",), div16=("N", "K")), warps, 3


def _gemv_gated_tma(rms: bool, bias: bool) -> tuple:
    from sglx.llm.kernels import gemv_gated as g

    ptrs = {**dict.fromkeys(("X", "B", "Y"), BF16), "W_desc": f"tensordesc<bf16[{g.TMA_BLOCK_P}, {g.TMA_BLOCK_K}]>"}
    consts = dict(HAS_BIAS=bias, BLOCK_P=g.TMA_BLOCK_P, BLOCK_K=g.TMA_BLOCK_K, RMS=rms, STAGES=g.TMA_STAGES, PDL=True)
    return (kernel_source(g._gemv_gated_tma_kernel, consts, ptrs, ("eps",), div16=("K", "n_out")), g.TMA_WARPS,
            g.TMA_STAGES)


def _rotary(store: bool, fmt: int, scaled: bool = False, bias: bool = False) -> tuple:
    from sglx.llm.kernels.rotary import _rotary_kernel

    kv = "*u8" if fmt else BF16
    ptrs = {**dict.fromkeys(("Q", "K", "Cos", "Sin", "V", "H", "Bias"), BF16), "K_Buf": kv, "V_Buf": kv,
            "Loc": "*i64"}
    consts = dict(HALF=64, BLOCK_D=64, BLOCK_HQ=32, BLOCK_HK=8, STORE=store, FMT=fmt, DV=128, BLOCK_DV=128,
                  SCALED=scaled, BLOCK_HID=4096 if scaled else 16, HAS_BIAS=bias)
    return kernel_source(_rotary_kernel, consts, ptrs, ("k_scale", "v_scale", "eps")), 4, 1


def _silu_and_mul(scaled: bool) -> tuple:
    from sglx.llm.kernels import activation as a

    block = a.SCALED_BLOCK if scaled else a.BLOCK
    consts = dict(BLOCK=block, SCALED=scaled, BLOCK_H=4096 if scaled else 16)
    return (kernel_source(a._silu_and_mul_kernel, consts, dict.fromkeys(("Gate_Up", "Out", "H"), BF16), ("eps",)),
            a.SCALED_WARPS if scaled else 4, 1)


def _gemv_fused(kind: str, narrow: bool, fmt: int = 0, rms: int = 0, pdl: bool = False) -> tuple:
    from sglx.llm.kernels import gemv_gated, gemv_rotary

    block_n, block_k, warps = (4, 1024, 8) if narrow else (8, 512, 4)
    div16 = ("K",)
    folded = dict(RMS=rms, KP=4096 if rms else 1, PDL=pdl)
    if kind == "gated":
        ptrs = dict.fromkeys(("X", "W", "B", "Y"), BF16)
        consts = dict(HAS_BIAS=True, BLOCK_P=block_n // 2, BLOCK_K=block_k, **folded)
        return kernel_source(gemv_gated._gemv_gated_kernel, consts, ptrs, ("eps",), div16=div16), warps, 3
    kv = "*u8" if fmt else BF16
    ptrs = {**dict.fromkeys(("X", "W", "B", "Cos", "Sin", "Q"), BF16), "K_Buf": kv, "V_Buf": kv, "Loc": "*i64"}
    consts = dict(D=128, HAS_BIAS=False, FMT=fmt, BLOCK_P=block_n // 2, BLOCK_K=block_k, **folded)
    return (kernel_source(gemv_rotary._gemv_rotary_kernel, consts, ptrs, ("k_scale", "v_scale", "eps"), div16), warps,
            3)


def _moe_gemm(fuse_silu: bool, routed: bool, shared: bool) -> tuple:
    from sglx.llm.kernels.fused_moe import _moe_gemm_kernel

    ptrs = {"A": BF16, "W": BF16, "C": "*fp32" if routed else BF16, "Sorted_Ids": "*i32", "Block_Expert": "*i32",
            "Block_Rows": "*i32", "Routed_W": "*fp32" if routed else BF16, "Shared_W": BF16}
    consts = dict(FUSE_SILU=fuse_silu, ROUTED=routed, IEEE=False, HAS_SHARED=shared, BLOCK_M=16, BLOCK_N=64,
                  BLOCK_K=128)
    return kernel_source(_moe_gemm_kernel, consts, ptrs), 4, 4


def _moe_align(step: str) -> tuple:
    from sglx.llm.kernels import moe_align as ma

    i32 = "*i32"
    kernel, ptrs, consts = {
        "one": (ma._align_one_program, dict.fromkeys(("Sorted_Ids", "Block_Expert", "Block_Rows"), i32),
                dict(E=66, BLOCK_E=128, BLOCK_M=16, CHUNK=32)),
        "count": (ma._align_count_kernel, {"Slice_Counts": i32}, dict(PER_PROGRAM=64, BLOCK_E=128, CHUNK=32)),
        "scan": (ma._align_scan_kernel, dict.fromkeys(("Slice_Counts", "Runs"), i32),
                 dict(BLOCK_E=512, BLOCK_M=64, SLICES=8)),
        "place": (ma._align_place_kernel,
                  dict.fromkeys(("Sorted_Ids", "Slice_Counts", "Runs", "Block_Expert", "Block_Rows"), i32),
                  dict(E=257, PER_PROGRAM=1024, BLOCK_E=512, BLOCK_M=64, CHUNK=16)),
    }[step]
    if "Ids" in kernel.arg_names:
        ptrs = {"Ids": i32, **ptrs}
    return kernel_source(kernel, consts, ptrs), 4, 1


def _moe_persistent() -> tuple:
    from sglx.llm.kernels.fused_moe import _moe_persistent_kernel

    ptrs = {"X": BF16, "W13": BF16, "W2": BF16, "Inter": BF16, "Y": "*fp32", "Sorted_Ids": "*i32",
            "Block_Expert": "*i32", "Block_Rows": "*i32", "Routed_W": "*fp32", "S13": BF16, "S2": BF16,
            "Work": "*i32"}
    consts = dict(IEEE=False, HAS_SHARED=True, BLOCK_M=16, UP_N=64, UP_K=128, DOWN_N=64, DOWN_K=128, BLOCK_B=16)
    return kernel_source(_moe_persistent_kernel, consts, ptrs), 4, 4


def _mla_stage1(single: bool, fp8: bool, block_h: int) -> tuple:
    from sglx.attention.kernels.mla_decode import _mla_decode_stage1

    ptrs = {"Q": BF16, "Q_pe": BF16, "Kv_Buf": "*u8" if fp8 else BF16, "Kv_Indptr": "*i32", "Kv_Indices": "*i32",
            "Mid_O": "*fp32", "Mid_Lse": "*fp32", "Out": BF16}
    consts = dict(H=16 if block_h == 16 else 128, BLOCK_H=block_h, R=512, DR=64, BLOCK_R=512, BLOCK_DR=64,
                  BLOCK_N=32 if block_h == 16 else 64, FMT=1 if fp8 else 0, IEEE=False, SINGLE=single)
    return (kernel_source(_mla_decode_stage1, consts, ptrs, ("qk_scale", "v_scale")),
            4 if block_h == 16 else 8, 2)


def _mla_merge() -> tuple:
    from sglx.attention.kernels.mla_decode import _mla_merge_kernel

    ptrs = {"Mid_O": "*fp32", "Mid_Lse": "*fp32", "Out": BF16, "Kv_Indptr": "*i32"}
    return kernel_source(_mla_merge_kernel, dict(H=128, R=512, BLOCK_HM=4, BLOCK_DV=512, BLOCK_S=4, BLOCK_N=64),
                         ptrs), 4, 1


def _mla_rope(store: bool, norm: bool) -> tuple:
    from sglx.llm.kernels.mla_rotary import _mla_rope_kernel

    ptrs = {"Q": BF16, "K": BF16, "Cos": BF16, "Sin": BF16, "C_Kv": BF16, "Buf": BF16, "Loc": "*i64",
            "Norm_W": BF16}
    consts = dict(HALF=32, BLOCK_D=32, BLOCK_H=16, INTERLEAVED=False, STORE=store, NORM=norm, R=512, BLOCK_R=512,
                  FMT=0)
    return kernel_source(_mla_rope_kernel, consts, ptrs, ("scale", "eps")), 4, 1


def _per_head_gemv() -> tuple:
    from sglx.attention.kernels.per_head_gemv import _per_head_gemv_kernel

    ptrs = dict.fromkeys(("X", "W", "Y"), BF16)
    return kernel_source(_per_head_gemv_kernel, dict(BLOCK_T=16, BLOCK_K=128, BLOCK_N=64, IEEE=False), ptrs), 4, 3


def _mla_gluon_launch(fn, warps: int, kv: str = BF16, partials: str = "*fp32", **consts) -> tuple:
    """A Gluon MLA stage-1 kernel (both share one argument list) at DeepSeek-V3's shape."""
    ptrs = {"Q": BF16, "Q_pe": BF16, "Kv_Buf": kv, "Kv_Indptr": "*i32", "Kv_Indices": "*i32", "Mid_O": partials,
            "Mid_Lse": "*fp32", "Out": BF16}
    consts = dict(H=128, BLOCK_H=64, R=512, DR=64, BLOCK_N=64, **consts)
    return gluon_source(fn, consts, ptrs, ("qk_scale", "v_scale")), warps, 1


def _mla_stage1_gluon(single: bool, fmt: int = 0, partials: str = "*fp32") -> tuple:
    from sglx.attention.kernels.mla_decode_gluon import _mla_decode_stage1_gluon

    return _mla_gluon_launch(_mla_decode_stage1_gluon, 8, "*u8" if fmt else BF16, partials, SINGLE=single, FMT=fmt)


def _mla_stage1_seesaw(single: bool) -> tuple:
    from sglx.attention.kernels.mla_decode import SEESAW_WORKER_REGS
    from sglx.attention.kernels.mla_decode_seesaw import _mla_decode_stage1_seesaw

    return _mla_gluon_launch(_mla_decode_stage1_seesaw, 4, SINGLE=single, WORKER_REGS=SEESAW_WORKER_REGS)


def _decode_stage1(merge_here: bool, fp8: bool, slot_scales: bool, prefetch: bool = False,
                   fold: int = 1, tma: bool = False, cvt: int | None = None) -> tuple:
    from sglx.attention.kernels.decode_attention import _decode_stage1

    kv = f"tensordesc<{'u8' if fp8 else 'bf16'}[64, 128]>" if tma else "*u8" if fp8 else BF16
    ptrs = {"Q": BF16, "K_Buf": kv, "V_Buf": kv, "Kv_Indptr": "*i32", "Kv_Indices": "*i32", "Mid_O": "*fp32",
            "Mid_Lse": "*fp32", "Out": BF16, "Semaphores": "*i32", "K_Scale": "*fp32", "V_Scale": "*fp32"}
    consts = dict(MERGE_HERE=merge_here, BLOCK_S=64, TMA=tma, GROUP=4, BLOCK_H=16, HEAD_BLOCKS=1, D=128, DV=128,
                  BLOCK_D=128, BLOCK_DV=128, BLOCK_N=64, FMT=1 if fp8 else 0, SOFTCAP=False, IEEE=False,
                  CVT=(1 if fp8 else 0) if cvt is None else cvt, SLOT_SCALES=slot_scales, SCALE_FOLD=fold,
                  PREFETCH=prefetch, SLOT64=False)
    return kernel_source(_decode_stage1, consts, ptrs, ("qk_scale", "logit_cap", "v_scale")), 4, 3


def _extend(ext: bool, tma: bool = False, section: int = 0, prefetch: bool = True, slot64: bool = False,
            fmt: int = 0, mla_split: bool = False, long: bool = False) -> tuple:
    """mla_split: MLA's expanded heads (192 = 128 + a 64-wide second tile, values 128) on the launch for heads past
    128 (64 x 32, 4 warps, 2 stages; long: 128 x 64, 8 warps, 3 stages, for long requests)."""
    from sglx.attention.kernels.extend_attention import _extend_kernel

    if mla_split and long:
        block_m, block_n, warps, stages = 128, 64, 8, 3
    else:
        block_m, block_n, warps, stages = (64, 32, 4, 2) if mla_split else (128, 128 if tma else 64, 8, 3)
    rows = f"tensordesc<bf16[{block_n}, 128]>" if tma else BF16
    pool = "*u8" if fmt else BF16
    ptrs = {"Q": BF16, "Out": BF16, "K_Buf": pool, "V_Buf": pool, "Qo_Indptr": "*i32", "Kv_Indptr": "*i32",
            "Kv_Indices": "*i32", "K_Ext": rows, "V_Ext": rows, "K_Scale": "*fp32", "V_Scale": "*fp32"}
    consts = dict(EXT=ext, TMA=tma, WS=False, SECTION=section, GROUP=1 if mla_split else 4,
                  D=192 if mla_split else 128, DV=128, BLOCK_D=128, BLOCK_DV=128, BLOCK_M=block_m,
                  BLOCK_N=block_n, FMT=fmt, SOFTCAP=False, IEEE=False, SLOT_SCALES=False, PREFETCH=prefetch,
                  SLOT64=slot64, DPE=64 if mla_split else 0)
    return kernel_source(_extend_kernel, consts, ptrs, ("qk_scale", "logit_cap", "v_scale")), warps, stages


def _block_sparse(mask_keys: bool, qmap: bool) -> tuple:
    from sglx.attention.kernels.block_sparse_attention import _block_sparse_fwd

    ptrs = {"Q": BF16, "K": BF16, "V": BF16, "Out": BF16, "Kv_Indices": "*i32", "Kv_Counts": "*i32",
            "K_Lengths": "*i32", "Q_Map": "*i32"}
    consts = dict(GROUP=1, D=128, BLOCK_M=128, BLOCK_N=64, Q_BLOCK=128, K_BLOCK=128, MASK_KEYS=mask_keys,
                  HAS_LENGTHS=mask_keys, IEEE=False, HAS_QMAP=qmap)
    return kernel_source(_block_sparse_fwd, consts, ptrs, ("qk_scale",)), 4, 2


def _block_sparse_tma() -> tuple:
    from sglx.attention.kernels.block_sparse_attention import _block_sparse_fwd_tma

    ptrs = {"Q": BF16, "K_desc": "tensordesc<bf16[64, 128]>", "V_desc": "tensordesc<bf16[64, 128]>", "Out": BF16,
            "Kv_Indices": "*i32", "Kv_Counts": "*i32", "K_Lengths": "*i32"}
    consts = dict(GROUP=1, D=128, BLOCK_M=64, BLOCK_N=64, Q_BLOCK=64, K_BLOCK=64, MASK_KEYS=True, HAS_LENGTHS=True)
    return kernel_source(_block_sparse_fwd_tma, consts, ptrs, ("qk_scale",)), 4, 3


VARIANTS = {
    "router": lambda: _router(False, True, 16),
    "router add_norm, one-block row": lambda: _router(True, True, 16),
    "router add_norm, chunked row": lambda: _router(True, False, 0),
    "router, chunked row": lambda: _router(False, False, 0),
    "rmsnorm": lambda: _rmsnorm(False),
    "add + rmsnorm": lambda: _rmsnorm(True),
    "gemv": lambda: _gemv(0, False),
    "gemv, narrow launch": lambda: _gemv(0, True),
    "gemv with rmsnorm inside": lambda: _gemv(1, True),
    "gemv with add + rmsnorm inside": lambda: _gemv(2, False),
    "gemv with add + rmsnorm inside, short rows (8 x 1,024, 4 warps), PDL":
        lambda: _gemv(2, True, pdl=True, short=True),
    "gemv + residual add, short rows (the whole 2,048 in one step), PDL":
        lambda: _gemv(0, True, add=True, pdl=True, short=True),
    "rotary": lambda: _rotary(False, 0),
    "rotary + K/V store, fp8 e4m3 pool": lambda: _rotary(True, 1),
    "rotary + K/V store, rows scaled by 1 / rms (batched folded norms)": lambda: _rotary(True, 0, scaled=True),
    "rotary, rows scaled by 1 / rms, qkv bias added": lambda: _rotary(False, 0, scaled=True, bias=True),
    "SiLU-and-mul": lambda: _silu_and_mul(False),
    "SiLU-and-mul, rows scaled by 1 / rms (batched folded norms)": lambda: _silu_and_mul(True),
    "gemv gate_up + SiLU-and-mul": lambda: _gemv_fused("gated", False),
    "gemv qkv + rotary + K/V store": lambda: _gemv_fused("rotary", False),
    "gemv qkv + rotary + fp8 e4m3 K/V store": lambda: _gemv_fused("rotary", False, 1),
    "gemv + residual add": lambda: _gemv(0, True, add=True),
    "gemv + residual add, PDL": lambda: _gemv(0, True, add=True, pdl=True),
    "gemv gate_up + SiLU-and-mul, folded norm, PDL": lambda: _gemv_fused("gated", False, rms=1, pdl=True),
    "gemv qkv + rotary + K/V store, folded norm, PDL": lambda: _gemv_fused("rotary", False, rms=2, pdl=True),
    "gemv gate_up + SiLU-and-mul by TMA, folded norm, PDL": lambda: _gemv_gated_tma(True, False),
    "gemv gate_up + SiLU-and-mul by TMA, bias": lambda: _gemv_gated_tma(False, True),
    "gemv gate_up + SiLU-and-mul, folded norm": lambda: _gemv_fused("gated", False, rms=1),
    "gemv qkv + rotary + K/V store, folded norm": lambda: _gemv_fused("rotary", False, rms=1),
    "gemv qkv + rotary + K/V store, folded norm, pass before": lambda: _gemv_fused("rotary", False, rms=2),
    "moe gate/up with shared experts": lambda: _moe_gemm(True, False, True),
    "moe down with shared experts": lambda: _moe_gemm(False, True, True),
    "moe gate/up": lambda: _moe_gemm(True, False, False),
    "moe both GEMMs, persistent": _moe_persistent,
    "moe align, one program": lambda: _moe_align("one"),
    "moe align, count a slice": lambda: _moe_align("count"),
    "moe align, scan over slices": lambda: _moe_align("scan"),
    "moe align, place a slice and blocks (DeepSeek-V3's 257 experts)": lambda: _moe_align("place"),
    "mla stage 1, 16 heads, splits": lambda: _mla_stage1(False, False, 16),
    "mla stage 1, 16 heads, one split": lambda: _mla_stage1(True, False, 16),
    "mla stage 1, 64-head wide, fp8": lambda: _mla_stage1(False, True, 64),
    "mla stage 1, Gluon 64-head, splits": lambda: _mla_stage1_gluon(False),
    "mla stage 1, Gluon 64-head, one split": lambda: _mla_stage1_gluon(True),
    "mla stage 1, Gluon 64-head, bf16 partials": lambda: _mla_stage1_gluon(False, partials=BF16),
    "mla stage 1, Gluon 64-head, fp8 e4m3 latents": lambda: _mla_stage1_gluon(False, 1),
    "mla stage 1, Gluon 64-head, e4m3 latents by bit moves": lambda: _mla_stage1_gluon(False, 3),
    "mla stage 1, Gluon 64-head, e4m3 by bit moves, one split": lambda: _mla_stage1_gluon(True, 3),
    "mla stage 1, Gluon seesaw (warp-specialised), splits": lambda: _mla_stage1_seesaw(False),
    "mla stage 1, Gluon seesaw (warp-specialised), one split": lambda: _mla_stage1_seesaw(True),
    "mla merge": _mla_merge,
    "mla rope + latent store + kv norm": lambda: _mla_rope(True, True),
    "mla rope": lambda: _mla_rope(False, False),
    "per-head gemv": _per_head_gemv,
    "decode stage 1, in-kernel merge": lambda: _decode_stage1(True, False, False),
    "decode stage 1, fp8 per-token scales": lambda: _decode_stage1(False, True, True),
    "decode stage 1, fp8 one scale a layer, slots a tile ahead": lambda: _decode_stage1(False, True, False, True),
    "decode stage 1, fp8 per-token scales a tile ahead": lambda: _decode_stage1(False, True, True, True),
    "decode stage 1, fp8 per-token tile_max scales a tile ahead": lambda: _decode_stage1(False, True, True, True, 0),
    "decode stage 1, bf16 tiles by TMA": lambda: _decode_stage1(False, False, False, tma=True),
    "decode stage 1, fp8 tiles by TMA, K and V converted in PTX": lambda: _decode_stage1(False, True, False, tma=True,
                                                                                          cvt=2),
    "decode stage 1, fp8 K and V converted in PTX, slots a tile ahead": lambda: _decode_stage1(False, True, False, True,
                                                                                                cvt=2),
    "decode stage 1, fp8 K by bit moves (bits_k), slots a tile ahead": lambda: _decode_stage1(False, True, False,
                                                                                               True, cvt=3),
    "decode stage 1, fp8 per-token scales, K by bit moves": lambda: _decode_stage1(False, True, True, True, cvt=3),
    "extend, this step's rows": lambda: _extend(True),
    "extend, e4m3 pool, K by bit moves": lambda: _extend(False, fmt=3),
    "extend, e4m3 pool, cast": lambda: _extend(False, fmt=1),
    "extend, pool only": lambda: _extend(False),
    "extend, pool only, slot ids loaded in the loop": lambda: _extend(False, prefetch=False),
    "extend, pool only, 64-bit slot offsets": lambda: _extend(False, slot64=True),
    "extend, MLA's expanded heads as 128 + 64 (pool gathers, as triton MLA runs it)": lambda: _extend(False,
                                                                                                    mla_split=True),
    "extend, MLA's expanded heads as 128 + 64, this step's rows": lambda: _extend(True, mla_split=True),
    "extend, MLA's expanded heads as 128 + 64, long requests' launch": lambda: _extend(False, mla_split=True,
                                                                                      long=True),
    "extend, TMA rows": lambda: _extend(True, tma=True),
    "extend, TMA rows, head sections": lambda: _extend(True, tma=True, section=8),
    "block-sparse (diffusion), padded keys": lambda: _block_sparse(True, False),
    "block-sparse (diffusion), q map": lambda: _block_sparse(False, True),
    "block-sparse (diffusion), TMA": _block_sparse_tma,
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_kernel_variant_compiles_for_sm90(name: str) -> None:
    source, warps, stages = VARIANTS[name]()
    kernel = compile_sm90(source, num_warps=warps, num_stages=stages)
    assert ".target sm_90a" in kernel.asm["ptx"] and kernel.asm["cubin"]
    assert kernel.metadata.shared <= 227 * 1024  # an H100 SM's shared memory for one program
    if name.startswith(("decode stage 1", "extend")) and "TMA" not in name:  # gathered K/V tiles pipelined, as the
        assert "cp.async" in kernel.asm["ptx"], "K/V tiles not pipelined"  # GPU runs them (strides 16-divisible)
    if "by TMA" in name:  # the weight boxes pipelined through shared memory: a TMA load a stage in flight
        assert kernel.asm["ptx"].count("cp.async.bulk.tensor") >= 2 * (stages - 1), "TMA loads not pipelined"
