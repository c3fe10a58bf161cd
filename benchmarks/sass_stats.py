"""Compile sglx's decode kernels for sm_90a on a machine without a GPU and count what the loop costs.

No timing: registers and spills (ptxas -v), shared memory, and the SASS instructions of the key-tile loop by
opcode (the longest backward branch). Used to pick which launch variants a GPU session should time
(bench_fp8_kv_decode.py, bench_mla_decode.py); the GPU's own Triton version matters (session 6's H100: 3.6),
so run it with that one, e.g. in a venv: `pip install triton==3.6.0`.

    python benchmarks/sass_stats.py decode                      # fp8 decode stage 1, the bench's variants
    python benchmarks/sass_stats.py mla                         # MLA stage 1: bf16 wide, fp8 wide, fp8 narrow
    python benchmarks/sass_stats.py decode --ops                # plus the loop's opcode counts

Shapes and strides are the benches': B64 Hq32/Hkv8 D128 bf16 queries (decode), H128 latent 512 + rope 64
(MLA); integer arguments divisible by 16 get Triton's divisibility hint as they would at a real launch.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
import sglx.attention.kernels.decode_attention as da  # noqa: E402
import sglx.attention.kernels.mla_decode as md  # noqa: E402
from sglx.bench.sm90_compile import SM90, kernel_source  # noqa: E402

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"

# name: (constexpr overrides, num_warps, num_stages)
DECODE = {
    "per-layer": ({}, 4, 3),
    "per-layer block_n 128": ({"BLOCK_N": 128}, 4, 3),
    "per-layer 2 stages": ({}, 4, 2),
    "per-token tile_max": ({"SLOT_SCALES": True, "SCALE_FOLD": 0}, 4, 3),
    "per-token exponent": ({"SLOT_SCALES": True, "SCALE_FOLD": 1}, 4, 3),
    "per-token exponent block_n 128": ({"SLOT_SCALES": True, "SCALE_FOLD": 1, "BLOCK_N": 128}, 4, 3),
    "per-token exponent 2 stages": ({"SLOT_SCALES": True, "SCALE_FOLD": 1}, 4, 2),
    "per-token exponent ptx_kv": ({"SLOT_SCALES": True, "SCALE_FOLD": 1, "CVT": 2}, 4, 3),
    "per-layer, slots a tile ahead": ({"PREFETCH": True}, 4, 3),
    "per-layer, slots a tile ahead, bits_k": ({"PREFETCH": True, "CVT": 3}, 4, 3),
    "per-token exponent, a tile ahead, bits_k": ({"SLOT_SCALES": True, "SCALE_FOLD": 1, "PREFETCH": True,
                                                  "CVT": 3}, 4, 3),
    "per-token exponent block_n 128, a tile ahead": ({"SLOT_SCALES": True, "SCALE_FOLD": 1, "BLOCK_N": 128,
                                                      "PREFETCH": True}, 4, 3),
}
MLA = {
    "bf16 wide (default)": ({"FMT": 0, "BLOCK_H": 64, "BLOCK_N": 64}, 8, 2),
    "fp8 wide": ({"FMT": 1, "BLOCK_H": 64, "BLOCK_N": 64}, 8, 2),
    "fp8 16 heads (default)": ({"FMT": 1, "BLOCK_H": 16, "BLOCK_N": 32}, 4, 2),
}


def decode_source(over: dict) -> ASTSource:
    consts = dict(MERGE_HERE=False, BLOCK_S=2, TMA=False, GROUP=4, BLOCK_H=16, HEAD_BLOCKS=1, D=128, DV=128,
                  BLOCK_D=128, BLOCK_DV=128, BLOCK_N=64, FMT=1, SOFTCAP=False, IEEE=False, CVT=1, SLOT_SCALES=False,
                  SCALE_FOLD=0, PREFETCH=False, SLOT64=False) | over
    ptrs = {"Q": "*bf16", "K_Buf": "*u8", "V_Buf": "*u8", "Kv_Indptr": "*i32", "Kv_Indices": "*i32",
            "Mid_O": "*fp32", "Mid_Lse": "*fp32", "Out": "*bf16", "Semaphores": "*i32", "K_Scale": "*fp32",
            "V_Scale": "*fp32"}
    return kernel_source(da._decode_stage1, consts, ptrs, ("qk_scale", "logit_cap", "v_scale"), ("min_chunk", "window"))


def mla_source(over: dict) -> ASTSource:
    consts = dict(H=128, BLOCK_H=64, R=512, DR=64, BLOCK_R=512, BLOCK_DR=64, BLOCK_N=64, FMT=0, IEEE=False,
                  SINGLE=True) | over
    ptrs = {"Q": "*bf16", "Q_pe": "*bf16", "Kv_Buf": "*u8" if consts["FMT"] else "*bf16", "Kv_Indptr": "*i32",
            "Kv_Indices": "*i32", "Mid_O": "*fp32", "Mid_Lse": "*fp32", "Out": "*bf16"}
    return kernel_source(md._mla_decode_stage1, consts, ptrs, ("qk_scale", "v_scale"), ("min_chunk",))


def ptxas(ptx: str, work: Path) -> tuple[str, str]:
    """(ptxas -v report, SASS) with the first bundled ptxas that takes this PTX version."""
    src, cubin = work / "k.ptx", work / "k.cubin"
    src.write_text(ptx)
    for tool in ("ptxas", "ptxas-blackwell"):
        proc = subprocess.run([str(BIN / tool), "-arch=sm_90a", "-v", str(src), "-o", str(cubin)],
                              capture_output=True, text=True)
        if proc.returncode == 0:
            sass = subprocess.run([str(BIN / "cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True)
            return proc.stderr + proc.stdout, sass.stdout
    raise RuntimeError(proc.stderr[-500:])


def loop_ops(sass: str) -> collections.Counter:
    """Opcode counts between the longest backward branch and its target (the key-tile loop)."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4})\*/\s+(.*?);", sass)]
    loops = [(int(t.group(1), 16), a) for a, txt in ins if "BRA" in txt
             for t in [re.search(r"0x([0-9a-f]+)", txt)] if t and int(t.group(1), 16) < a]
    if not loops:
        return collections.Counter()
    lo, hi = max(loops, key=lambda p: p[1] - p[0])
    return collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", txt).split()[0].split(".")[0]
                               for a, txt in ins if lo <= a <= hi)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kernel", choices=["decode", "mla"])
    ap.add_argument("--ops", action="store_true", help="print the loop's opcode counts")
    args = ap.parse_args()
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    variants, make = (DECODE, decode_source) if args.kernel == "decode" else (MLA, mla_source)
    print(f"triton {triton.__version__}, sm_90a")
    with tempfile.TemporaryDirectory() as tmp:
        for name, (over, warps, stages) in variants.items():
            k = triton.compile(make(over), target=SM90,
                               options=dict(num_warps=warps, num_stages=stages))
            report, sass = ptxas(k.asm["ptx"], Path(tmp))
            regs = re.search(r"Used (\d+) registers", report)
            spill = re.search(r"(\d+) bytes spill stores", report)
            ops = loop_ops(sass)
            counts = " ".join(f"{op} {ops[op]:2d}" for op in ("BAR", "SHFL", "LDGSTS", "LDL"))
            print(f"{name:32s} registers {regs.group(1) if regs else '?':>3}"
                  f"  spill {spill.group(1) if spill else '?':>4} B  shared {k.metadata.shared // 1024:3d} KB"
                  f"  loop {sum(ops.values()):5d} instructions  {counts}")
            if args.ops:
                print("   ", " ".join(f"{op}:{n}" for op, n in ops.most_common()))


if __name__ == "__main__":
    main()
