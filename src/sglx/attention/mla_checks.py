"""`doctor --check` for MLA backends: extend over cached prefixes, then decode, on scattered latent pages.

Judged against the float64 expanded-latent reference, so an absorbed decode and an expanded prefill are
held to the same math.
"""

from __future__ import annotations

import time

import torch

from sglx.attention.registry import BackendSpec
from sglx.platform import PlatformSnapshot

H, DN, DR, DV, R = 8, 32, 64, 32, 512  # DeepSeek's latent 512 + rope 64: what every MLA kernel is built for


def mla_problem(spec: BackendSpec, snap: PlatformSnapshot, device: torch.device, dtype: torch.dtype
                ) -> tuple[float, float, str]:
    """(max abs error vs float64, ms, shape) for one ragged batch: an EXTEND step then a DECODE step (the EXTEND
    step alone for a backend whose decode does not run here, `prefill_only`)."""
    from sglx.attention.llm.base import BackendContext
    from sglx.attention.llm.mla_base import MLALayerSpec, MLAProjections
    from sglx.attention.llm.paged_latents import PagedLatents
    from sglx.attention.registry import prefill_only
    from sglx.llm.forward_batch import ForwardMode

    gen = torch.Generator().manual_seed(0)
    rule = spec.page_size_rule(snap)
    page = rule.sizes[0] if rule else 4
    prefix_lens, extend_lens = [0, 13, 37], [21, 6, 1]
    total = [p + e + 1 for p, e in zip(prefix_lens, extend_lens)]
    paged = PagedLatents.build(prefix_lens, total, page, R, DR, dtype, device, gen)
    layer = MLALayerSpec(0, H, DN, DR, DV, R, 0.9 * (DN + DR) ** -0.5)
    proj = MLAProjections.from_kv_b_proj((torch.randn(H * (DN + DV), R, generator=gen) * R ** -0.5).to(device, dtype),
                                         layer)
    ctx = BackendContext(device, dtype, H, 1, R + DR, page, paged.r2t, paged.pool)  # type: ignore[arg-type]
    backend = spec.load()(ctx)
    worst, elapsed = 0.0, 0.0
    lo, hi = prefix_lens, [p + e for p, e in zip(prefix_lens, extend_lens)]
    decode = not prefill_only(spec, snap)
    for mode in (ForwardMode.EXTEND, ForwardMode.DECODE) if decode else (ForwardMode.EXTEND,):
        n_new = [b - a for a, b in zip(lo, hi)]
        q_nope = torch.randn(sum(n_new), H, DN, generator=gen).to(device, dtype)
        q_pe = torch.randn(sum(n_new), H, DR, generator=gen).to(device, dtype)
        new = paged.new_latents(lo, hi)
        batch = paged.step(mode, lo, hi, backend)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        backend.init_forward_metadata(batch)
        out = backend.forward_mla(q_nope, q_pe, new[:, :R], new[:, R:], layer, proj, batch)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed += time.perf_counter() - start
        ref = paged.reference(q_nope, q_pe, lo, hi, proj, layer.scaling)
        worst = max(worst, (out.double() - ref).abs().max().item())
        lo, hi = hi, [b + 1 for b in hi]
    shape = (f"MLA bs=3 H={H} latent {R}+{DR} nope {DN} v {DV} page={page} prefix={prefix_lens} "
             f"extend={extend_lens}" + (" +1 decode" if decode else " (prefill only here)"))
    return worst, elapsed * 1e3, shape
