"""SiLU-gated MLP (SwiGLU) with gate and up projections fused into one matmul.

On CUDA tensors silu(gate) * up runs as one Triton kernel over the gate_up output (same roundings), or, for one
row wider than the norm-inside rule, in the gate_up GEMV's epilogue (`after_norm`); CPU runs the torch code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglx.llm.kernels import use_fused
from sglx.llm.layers.linear import Linear
from sglx.llm.layers.norm import RMSNorm, epilogue_gemv_applies
from sglx.llm.layers.parallel import ColumnParallelLinear, RowParallelLinear, TensorParallel


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); `gate_up_proj` holds [gate; up] stacked on the output dim."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 tp: TensorParallel | None = None) -> None:
        """tp: split the intermediate features over tensor-parallel ranks (gate/up column-, down row-parallel,
        one all-reduce of the output); None keeps single-device `Linear` layers."""
        super().__init__()
        if tp is None:
            self.intermediate_size = intermediate_size
            self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias)
            self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)
            return
        self.intermediate_size = tp.split(intermediate_size)[1]
        self.gate_up_proj = ColumnParallelLinear.even(hidden_size, [intermediate_size] * 2, bias, tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.gate_up_proj(x))

    def after_norm(self, norm: RMSNorm, delta: torch.Tensor, residual: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this MLP of norm(residual + delta), residual + delta): the decoder layer's post-attention add + norm and
        the MLP. One CUDA row too wide for the norm inside the gate_up GEMV (`RMSNorm.norm_linear`) takes the norm
        kernel, then the gate_up GEMV with SiLU-and-mul in its epilogue (sglx.llm.kernels.gemv_gated: the SiLU
        kernel's launch saved); otherwise `norm_linear`, then `down`."""
        proj = self.gate_up_proj
        if epilogue_gemv_applies(delta, proj.weight, proj.bias):
            from sglx.llm.kernels.gemv_gated import gemv_gated

            h, residual = norm.add_and_norm(delta, residual)
            return self.down_proj(gemv_gated(h, proj.weight, proj.bias)), residual
        gate_up, residual = norm.norm_linear(delta, residual, proj.weight, proj.bias)
        return self.down(gate_up), residual

    def add_one_row(self, h: torch.Tensor, rms_eps: float) -> torch.Tensor:
        """h + this MLP of rmsnorm(h) for one CUDA row, with the norm's scale folded into gate_up
        (sglx.llm.layers.norm_folding): the gate_up GEMV norms and applies SiLU-and-mul, the down GEMV adds h."""
        from sglx.llm.kernels.gemv import gemv
        from sglx.llm.kernels.gemv_gated import gemv_gated

        act = gemv_gated(h, self.gate_up_proj.weight, self.gate_up_proj.bias, rms_eps=rms_eps)
        return gemv(act, self.down_proj.weight, self.down_proj.bias, add_to=h)[0]

    def add_row_scaled(self, h: torch.Tensor, rms_eps: float) -> None:
        """h += this MLP of rmsnorm(h), in place, for several CUDA rows with the norm's scale folded into gate_up
        (sglx.llm.layers.norm_folding): gate_up reads h unnormed, SiLU-and-mul scales each row by its 1 / rms(h)
        first, and down adds into h (cuBLAS with beta = 1)."""
        from sglx.llm.kernels.activation import silu_and_mul

        act = silu_and_mul(self.gate_up_proj(h), rms_of=h, eps=rms_eps)
        h.addmm_(act, self.down_proj.weight.t())

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The MLP after its gate_up product (callers that fuse the norm into that product start here)."""
        if use_fused(gate_up):
            from sglx.llm.kernels.activation import silu_and_mul

            return self.down_proj(silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)
