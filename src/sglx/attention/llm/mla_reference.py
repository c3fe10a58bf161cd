"""float64 MLA reference: expand every latent to per-head K/V and attend causally, the plainest way.

Used by the tests and `doctor --check` to judge every MLA backend (absorbed or not) against the same math.
"""

from __future__ import annotations

import torch


def reference_mla(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, w_uk: torch.Tensor,
                  w_uv: torch.Tensor, q_positions: torch.Tensor, scale: float) -> torch.Tensor:
    """One request: q_nope [n, H, dn], q_pe [n, H, dr] at absolute positions q_positions [n];
    latent [L, r + dr] of positions 0..L-1; W_UK [H, dn, r], W_UV [H, dv, r] -> float64 [n, H, dv]."""
    r = w_uk.shape[-1]
    lat = latent.double()
    c, k_pe = lat[:, :r], lat[:, r:]
    k_nope = torch.einsum("lr,hdr->hld", c, w_uk.double())
    v = torch.einsum("lr,hvr->hlv", c, w_uv.double())
    scores = (torch.einsum("nhd,hld->hnl", q_nope.double(), k_nope)
              + torch.einsum("nhd,ld->hnl", q_pe.double(), k_pe)) * scale
    key_pos = torch.arange(lat.shape[0], device=lat.device)
    mask = key_pos[None, :] <= q_positions.to(lat.device)[:, None]
    scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hnl,hlv->nhv", torch.softmax(scores, dim=-1), v)
