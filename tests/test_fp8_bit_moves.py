"""The PTX text of `e4m3_bits_to_bf16_scaled`, run by a small simulator over every e4m3 code (CPU; the kernels that
use it run on a GPU only, the interpreter does not execute inline PTX): each code must become the bfloat16 of its
value times 2**-120, subnormals and signed zero included, in the element order inline_asm_elementwise's pack=4 uses.
"""

from __future__ import annotations

import re

import torch

from sglx.attention.kernels.common import E4M3_TO_BF16_SCALED_PTX

MASK = 0xFFFFFFFF


def _prmt(a: int, b: int, sel: int) -> int:
    pool = (b << 32) | a  # bytes 0-3 from a, 4-7 from b
    out = 0
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        assert nib < 8, "sign-replicating selectors are not simulated"
        out |= ((pool >> (8 * nib)) & 0xFF) << (8 * i)
    return out


def run_ptx(text: str, inputs: dict[str, int]) -> dict[str, int]:
    """Registers after the statements of `text` (mov/prmt/shr/and/or on .b32), `$n` operands preset by `inputs`."""
    regs = dict(inputs)

    def val(tok: str) -> int:
        tok = tok.strip()
        return int(tok, 0) & MASK if re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)", tok) else regs[tok]

    for stmt in text.replace("{", ";").replace("}", ";").split(";"):
        stmt = stmt.strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        op, args = stmt.split(None, 1)
        dst, *src = [a.strip() for a in args.split(",")]
        if op == "mov.b32":
            regs[dst] = val(src[0])
        elif op == "prmt.b32":
            regs[dst] = _prmt(val(src[0]), val(src[1]), val(src[2]))
        elif op == "shr.b32":
            regs[dst] = val(src[0]) >> val(src[1])
        elif op == "and.b32":
            regs[dst] = val(src[0]) & val(src[1])
        elif op == "or.b32":
            regs[dst] = val(src[0]) | val(src[1])
        else:
            raise AssertionError(f"op {op} not simulated")
    return regs


def _expected_bf16_bits(codes: torch.Tensor) -> list[int]:
    values = codes.view(torch.float8_e4m3fn).double() * 2.0 ** -120
    return [int(b) & 0xFFFF for b in values.to(torch.bfloat16).view(torch.int16).tolist()]


def test_every_e4m3_code_becomes_its_value_at_2_pow_minus_120():
    finite = [c for c in range(256) if c & 0x7F != 0x7F]  # 0x7f / 0xff are e4m3fn's NaN
    expected = dict(zip(finite, _expected_bf16_bits(torch.tensor(finite, dtype=torch.uint8)), strict=True))
    gen = torch.Generator().manual_seed(0)
    for code in finite:
        for position in range(4):  # the code in each byte of the packed word, random codes around it
            others = [finite[i] for i in torch.randint(len(finite), (4,), generator=gen).tolist()]
            others[position] = code
            word = sum(c << (8 * i) for i, c in enumerate(others))
            regs = run_ptx(E4M3_TO_BF16_SCALED_PTX.value, {"$2": word})
            halves = [regs["$0"] & 0xFFFF, regs["$0"] >> 16, regs["$1"] & 0xFFFF, regs["$1"] >> 16]
            assert halves == [expected[c] for c in others], (hex(code), position, [hex(h) for h in halves])


def test_the_simulator_sees_a_wrong_move():
    """A shift by three instead of four must not pass: the check above can fail."""
    wrong = E4M3_TO_BF16_SCALED_PTX.value.replace("shr.b32 s0, t0, 4", "shr.b32 s0, t0, 3")
    regs = run_ptx(wrong, {"$2": 0x38})  # 1.0 in e4m3
    assert regs["$0"] & 0xFFFF != _expected_bf16_bits(torch.tensor([0x38], dtype=torch.uint8))[0]
