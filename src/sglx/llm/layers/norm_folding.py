"""RMSNorm scales folded into the projection each norm feeds, so a batch-1 decode step launches no norm kernel.

Why: rmsnorm(x) W^T = (x * rstd * g) W^T = rstd * (x (W diag g)^T). With g multiplied into W's columns once at
load time and the norm's own weight set to ones (so every other path, prefill and batched decode included, still
computes the same function), the one-row GEMVs with epilogues read the unnormed residual stream, gather its sum of
squares while they stream the weights and scale their sums by 1 / rms (`row_products`' RMS); the residual add
moves into the epilogue of the product before (o_proj, down: `gemv(..., add_to=)`). A Llama-3.1-8B step then loses
its 64 norm launches (about 3 us each on the H200, session 24 profile).

Batched decode steps of a folded model take the same identity the other way round (`row_scaled_applies`): qkv and
gate_up read the raw stream h, the kernel that reads their output (rotary + K/V store, SiLU-and-mul) scales each row
by 1 / rms(h) first, and o_proj / down add into h in place (cuBLAS with beta = 1), so a layer launches no add + norm
kernel. Measured on the H200 (benchmarks/probe_batched_layer_routes.py, session 27): a Llama-3.1-8B layer's products
and small kernels at 64 rows 139.6 us against 143.6-144.0, at 16 rows 134.3-134.4 against 138.5-138.6.

The folded weight is rounded once to the model dtype (W * g in float32): against Hugging Face's norm-then-product
the outputs differ by that rounding and the normed row's two roundings, like any kernel fusion. Only models whose
batch-1 steps take the route are folded (`folding_applies`); `SGLX_FOLD_NORMS=0` keeps the norms as they load.
"""

from __future__ import annotations

import torch

from sglx.llm.forward_batch import ForwardBatch
from sglx.llm.kernels import env_switch, use_fused
from sglx.llm.layers.linear import gemv_weight_eligible
from sglx.llm.layers.norm import RMSNorm, epilogue_width_applies

_FOLD_ON = env_switch("SGLX_FOLD_NORMS")
_ROW_SCALED_ON = env_switch("SGLX_ROW_SCALED_NORMS")


def folding_applies(hidden_size: int, weight: torch.Tensor, tp_size: int) -> bool:
    """Whether a decoder of this width with this (loaded) projection weight folds its norms: one rank (the residual
    add in o_proj's epilogue needs the whole sum), rows wider than the norm-inside rule (narrower models take the norm
    inside the GEMV already) with the epilogue GEMVs switched on, a weight the one-row GEMV takes (with `SGLX_GEMV=0`
    no step would take the folded route: the norms would run anyway, on folded weights)."""
    return _FOLD_ON and epilogue_width_applies(hidden_size) and tp_size == 1 and gemv_weight_eligible(weight)


@torch.no_grad()
def fold_norm_into(norm: RMSNorm, weight: torch.Tensor) -> None:
    """weight[:, j] *= norm.weight[j] (rounded once, from float32), then norm.weight = 1."""
    weight.copy_((weight.float() * norm.weight.float()[None, :]).to(weight.dtype))
    norm.weight.fill_(1.0)


def row_scale_dtype(projections: list[torch.nn.Module], biased: torch.nn.Module) -> torch.dtype | None:
    """At fold time, what a layer's batched route needs of its weights: the products' one dtype, or None where the
    route cannot run (mixed dtypes, or a bias on a product the row scale cannot leave out: o_proj's, the MLP's; the
    qkv product `biased` may have one, of its dtype, which the rotary kernel adds)."""
    dtype = biased.weight.dtype
    if any(p.weight.dtype != dtype for p in projections) or any(p.bias is not None for p in projections):
        return None
    return dtype if biased.bias is None or biased.bias.dtype == dtype else None


def row_scaled_applies(x: torch.Tensor, batch: ForwardBatch, dtype: torch.dtype | None) -> bool:
    """Whether a folded layer whose products are of `dtype` (`row_scale_dtype`, None: never) runs this step with the
    norms as row scales after its products: a decode step of more than one row of that dtype (one row takes the GEMVs
    that norm their input) on the fused CUDA kernels, switched on."""
    return (_ROW_SCALED_ON and dtype is not None and x.dtype == dtype and batch.mode.is_decode and x.dim() == 2
            and x.shape[0] > 1 and use_fused(x))
