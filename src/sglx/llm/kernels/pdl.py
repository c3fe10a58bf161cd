"""Programmatic dependent launch (PDL) for the batch-1 GEMV chain: each GEMV lets the next kernel launch while it
drains, and waits for the kernel before it only where it starts reading.

Why: a batch-1 decode step is a chain of short weight-streaming kernels (qkv, attention, o_proj, gate_up, down), and
without PDL each one launches only after the previous has finished. With PDL (sm_90+) every program signals at its
start (`griddepcontrol.launch_dependents`: the next grid may launch once every program here has), so the next
GEMV's launch and scheduling overlap this one's last wave; each GEMV program waits (`griddepcontrol.wait`: the
previous kernel finished, its writes visible) before reading anything. Measured on the H200 in graphs (session 25):
0.5-0.6 us a GEMV; Llama-3.1-8B batch-1 step 0.05-0.20 ms faster. Prefetching the head of each weight row into L2
before the wait (TMA bulk prefetch) was slower (4 KB a row: gate_up 66.7 against 61.6 us) and is not kept; so was
PDL on the other kernels of the step (decode attention, RMSNorm, DeepSeek's MLA / MoE / router kernels): Llama
4.37-4.47 ms against 4.21-4.22 with the GEMVs alone, DeepSeek-V2-Lite unchanged.
Kernels launched without PDL order as usual; the wait is a no-op when the launch had no PDL attribute.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from sglx.llm.kernels import env_switch

_PDL_ON = env_switch("SGLX_GEMV_PDL")


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    """Let the next PDL-launched kernel start once every program here has begun, then wait until the kernel before
    this one has finished and its writes are visible (nothing without PDL)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


def pdl_args(weight: torch.Tensor, interpret: bool, pdl: bool | None = None) -> dict:
    """The GEMV kernels' PDL constexpr and launch option: on for CUDA sm_90+ unless SGLX_GEMV_PDL=0 (`pdl`
    overrides the switch); off under the interpreter."""
    on = ((_PDL_ON if pdl is None else pdl) and not interpret and weight.is_cuda and torch.version.hip is None
          and torch.cuda.get_device_capability(weight.device)[0] >= 9)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}
