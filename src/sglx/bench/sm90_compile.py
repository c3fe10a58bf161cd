"""Compile a Triton kernel for NVIDIA sm_90a on a machine without a GPU (Triton's bundled ptxas does the last step).

Why: the CPU tests run the kernels under TRITON_INTERPRET=1, which executes Python and never type-checks the
compiled form. A variable that holds a tensor in one constexpr branch and an integer later, for example, passes
every interpreted test and fails to compile on the GPU (session 15 lost a device call to one). Compiling each
launch variant here catches that class of error without a device. `benchmarks/sass_stats.py` uses the same
source builder to read registers and SASS.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

SM90 = GPUTarget("cuda", 90, 32)


def kernel_source(fn: Any, consts: dict[str, object], ptrs: dict[str, str], floats: Iterable[str] = (),
                  div16: Iterable[str] = ()) -> ASTSource:
    """`fn` (a @triton.jit function) with its constexprs set: pointer arguments typed by `ptrs` (e.g. "*bf16"),
    `floats` as fp32, every other argument i32; pointers, `div16` and every `stride*` argument get Triton's
    16-divisibility hint, as a real launch of aligned tensors and strides would. Without it on the strides the
    compiler cannot vectorise row loads, so it emits neither cp.async nor a software pipeline: a different kernel
    from the one the GPU runs (session 26: decode stage 1 compiled to 236-255 registers that way, 90-128 as
    launched)."""
    names = fn.arg_names
    floats = set(floats)
    div16 = set(div16) | {n for n in names if n.startswith("stride") and n not in consts}
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "fp32" if n in floats else "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n].startswith("*") or n in div16}
    return ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)


def gluon_source(fn: Any, consts: dict[str, object], ptrs: dict[str, str], floats: Iterable[str] = (),
                 div16: Iterable[str] = ()) -> ASTSource:
    """`kernel_source` for a @gluon.jit function (Triton's explicit-layout dialect)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    plain = kernel_source(fn, consts, ptrs, floats, div16)
    return GluonASTSource(fn=fn, signature=plain.signature, constexprs=plain.constants, attrs=plain.attrs)


def compile_sm90(source: ASTSource, num_warps: int = 4, num_stages: int = 3) -> Any:
    """The compiled kernel (ptx, cubin, metadata) for sm_90a; raises Triton's CompilationError as a launch would."""
    return triton.compile(source, target=SM90, options=dict(num_warps=num_warps, num_stages=num_stages))
