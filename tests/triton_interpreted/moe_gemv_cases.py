"""sglx.llm.kernels.moe_gemv (one token's experts as GEMVs) against fused_moe and a float64 loop over the experts.

Runs only under TRITON_INTERPRET=1 (tests/test_moe_gemv.py launches it in a child pytest). Same arithmetic as
fused_moe (silu(g) * u in float32 rounded once, the weighted products summed in float32 and rounded once), so the two
agree to the products' summation order; both are checked against float64 within the bf16 roundings.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover - guarded by the launcher
    pytest.skip("run through tests/test_moe_gemv.py (needs TRITON_INTERPRET=1)", allow_module_level=True)

from sglx.llm.kernels.fused_moe import fused_moe  # noqa: E402
from sglx.llm.kernels.gemv import GemvConfig  # noqa: E402
from sglx.llm.kernels.moe_gemv import moe_gemv  # noqa: E402


def _randn(*shape: int, seed: int, scale: float = 1.0, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale).to(dtype)


def _reference(x, w13, w2, weights, ids, shared, add):  # noqa: ANN001, ANN202
    """float64: sum over pairs of w * down(silu(gate x) * up x), shared expert s = slice s of the shared MLP."""
    e_routed, two_i, _ = w13.shape
    inter = two_i // 2
    out = torch.zeros(x.shape[1], dtype=torch.float64)
    for w, e in zip(weights[0].tolist(), ids[0].tolist()):
        if e < e_routed:
            gate, up, down = w13[e, :inter], w13[e, inter:], w2[e]
        else:
            s = e - e_routed
            sg, sd = shared
            n_shared = sd.shape[1] // inter
            gate = sg[s * inter:(s + 1) * inter]
            up = sg[(n_shared + s) * inter:(n_shared + s + 1) * inter]
            down = sd[:, s * inter:(s + 1) * inter]
        h = x[0].double()
        act = F.silu(gate.double() @ h) * (up.double() @ h)
        out += w * (down.double() @ act)
    return out if add is None else out + add[0].double()


@pytest.mark.parametrize("shared,add", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("config", [GemvConfig(4, 16), GemvConfig(8, 32)])
def test_moe_gemv_matches_fused_moe_and_float64(shared, add, config):
    experts, hidden, inter = 6, 40, 24
    x = _randn(1, hidden, seed=1, scale=2.0)
    w13 = _randn(experts, 2 * inter, hidden, seed=2, scale=hidden ** -0.5)
    w2 = _randn(experts, hidden, inter, seed=3, scale=inter ** -0.5)
    ids = torch.tensor([[4, 0, 5]])
    weights = torch.tensor([[0.5, 0.3, 0.2]])
    sh = None
    if shared:  # two shared experts ride along as experts 6 and 7, weight 1
        sh = (_randn(2 * 2 * inter, hidden, seed=4, scale=hidden ** -0.5), _randn(hidden, 2 * inter, seed=5,
                                                                                   scale=inter ** -0.5))
        ids = torch.tensor([[4, 0, 5, 6, 7]])
        weights = torch.tensor([[0.5, 0.3, 0.2, 1.0, 1.0]])
    extra = _randn(1, hidden, seed=6) if add else None
    got = moe_gemv(x, w13, w2, weights, ids, add=extra, shared=sh, config=config, interpret=True)
    assert got.shape == (1, hidden) and got.dtype == torch.bfloat16
    # fused_moe on the same (bf16-valued) operands in float32: the interpreter's bf16 `tl.dot` is not trusted here
    f32 = (lambda t: t.float() if t is not None else None)  # noqa: E731
    base = fused_moe(x.float(), w13.float(), w2.float(), weights, ids, interpret=True, add=f32(extra),
                     shared=(f32(sh[0]), f32(sh[1])) if sh is not None else None)
    want = _reference(x, w13, w2, weights, ids, sh, extra)
    eps = torch.finfo(torch.bfloat16).eps
    scale = want.abs().max().item()
    assert (got[0].double() - want).abs().max().item() <= 8 * eps * scale
    assert (got.double() - base.double()).abs().max().item() <= 2 * eps * scale  # got's rounding and a little


def test_moe_gemv_refuses_more_than_one_token():
    w13, w2 = torch.zeros(2, 8, 16, dtype=torch.bfloat16), torch.zeros(2, 16, 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="one token"):
        moe_gemv(torch.zeros(2, 16, dtype=torch.bfloat16), w13, w2, torch.ones(2, 1), torch.zeros(2, 1,
                                                                                                  dtype=torch.long),
                 interpret=True)
