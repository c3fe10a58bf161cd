"""Round float32 to a narrower dtype (nearest, ties to even) and keep computing in float32.

The fused kernels round wherever the torch code they replace rounds, so results match it bit for
bit. bfloat16 is rounded with integer arithmetic because the Triton interpreter (the CPU tests)
truncates float32 -> bfloat16 casts; on the GPU the result is the same as the hardware cast.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """float32 x -> the nearest `dtype` value, returned as float32 (exactly representable in `dtype`)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = bits + 0x7FFF + ((bits >> 16) & 1)
        is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
        bits = tl.where(is_nan, bits | 0x400000, rounded) & 0xFFFF0000
        y = bits.to(tl.float32, bitcast=True)
    elif dtype == tl.float32:
        y = x
    else:
        y = x.to(dtype).to(tl.float32)
    return y
