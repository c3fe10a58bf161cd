"""The contract of MLA (multi-head latent attention, DeepSeek-V2/V3) backends.

The model hands a backend, per layer and step: q_nope [T, H, dn] and the rotated q_pe [T, H, dr], the
normalized latent c_kv [T, r] and the rotated shared k_pe [T, dr] of this step's tokens, and the
layer's up-projections from kv_b_proj: W_UK [H, dn, r] (latent -> per-head k_nope) and W_UV [H, dv, r]
(latent -> per-head v). The backend stores [c_kv, k_pe] in the latent pool and returns the attention
output [T, H, dv] before o_proj. Which math runs is the backend's choice, as in SGLang:

- absorbed (decode): q_abs = q_nope W_UK, attention of [q_abs, q_pe] over the cached latents
  [c_kv, k_pe] as keys and c_kv as values (one shared "head" of r + dr), then o = o_latent W_UV^T;
  reads r + dr values per cached token instead of H * (dn + dr + dv).
- non-absorbed (prefill/extend): expand the latents of prefix + new tokens to per-head K = [c W_UK^T, k_pe]
  and V = c W_UV^T, then ordinary causal attention; cheaper when many queries share the expansion.

Both equal softmax(q.k * scale) v with k/v expanded from the latent, which is what the float64
reference (`mla_reference.py`) computes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglx.attention.llm.base import AttentionBackend, LayerSpec
from sglx.llm.forward_batch import ForwardBatch


@dataclass(frozen=True)
class MLALayerSpec:
    """What one MLA layer asks of the backend."""

    layer_id: int
    num_heads: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    kv_lora_rank: int
    scaling: float  # softmax scale (YaRN's mscale folded in, as the model computes it)

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MLAProjections:
    """A layer's kv_b_proj split into its two up-projections (views of the weight, no copies)."""

    w_uk: torch.Tensor  # [H, qk_nope_head_dim, kv_lora_rank]
    w_uv: torch.Tensor  # [H, v_head_dim, kv_lora_rank]

    @classmethod
    def from_kv_b_proj(cls, weight: torch.Tensor, spec: MLALayerSpec) -> MLAProjections:
        """kv_b_proj.weight [H * (dn + dv), r] -> (W_UK, W_UV)."""
        w = weight.view(spec.num_heads, spec.qk_nope_head_dim + spec.v_head_dim, spec.kv_lora_rank)
        return cls(w[:, :spec.qk_nope_head_dim], w[:, spec.qk_nope_head_dim:])


PER_HEAD_GEMV_TOKENS = 16  # = sglx.attention.kernels.per_head_gemv.MAX_TOKENS (that module imports triton)


def _per_head_kernel_applies(x: torch.Tensor, kernel: bool, interpret: bool) -> bool:
    """Whether absorb_q / apply_uv take the per-head GEMV: asked for, CUDA (or interpreted), decode-sized T,
    unit stride along the reduced dim."""
    return kernel and (x.is_cuda or interpret) and x.shape[0] <= PER_HEAD_GEMV_TOKENS and x.stride(-1) == 1


def absorb_q(q_nope: torch.Tensor, proj: MLAProjections, kernel: bool = False,
             interpret: bool = False) -> torch.Tensor:
    """q_nope [T, H, dn] -> q_nope W_UK [T, H, r]: the query in latent space. kernel: sglx's per-head GEMV
    (a Triton kernel; faster than bmm for decode-sized T) on CUDA tensors (or interpreted) where T allows, for
    backends that run Triton anyway."""
    if _per_head_kernel_applies(q_nope, kernel, interpret):
        from sglx.attention.kernels.per_head_gemv import per_head_gemv

        return per_head_gemv(q_nope, proj.w_uk, interpret=interpret)
    return torch.bmm(q_nope.transpose(0, 1), proj.w_uk).transpose(0, 1)


def apply_uv(o_latent: torch.Tensor, proj: MLAProjections, out: torch.Tensor | None = None, kernel: bool = False,
             interpret: bool = False) -> torch.Tensor:
    """Attention output in latent space [T, H, r] -> per-head values [T, H, dv], written into `out` when given
    (a contiguous `out` makes the caller's reshape to [T, H * dv] a view, not a copy kernel); kernel: as
    absorb_q's."""
    if _per_head_kernel_applies(o_latent, kernel, interpret):
        from sglx.attention.kernels.per_head_gemv import per_head_gemv

        return per_head_gemv(o_latent, proj.w_uv.transpose(1, 2), out, interpret=interpret)
    if out is None:
        return torch.bmm(o_latent.transpose(0, 1), proj.w_uv.transpose(1, 2)).transpose(0, 1)
    torch.bmm(o_latent.transpose(0, 1), proj.w_uv.transpose(1, 2), out=out.transpose(0, 1))
    return out


def expand_latent(latent: torch.Tensor, proj: MLAProjections, spec: MLALayerSpec
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Cached latents [L, r + dr] -> per-head keys [L, H, dn + dr] and values [L, H, dv] (non-absorbed path)."""
    c, k_pe = latent.split([spec.kv_lora_rank, spec.qk_rope_head_dim], dim=-1)
    k_nope = torch.einsum("lr,hdr->lhd", c, proj.w_uk)
    v = torch.einsum("lr,hvr->lhv", c, proj.w_uv)
    k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, spec.num_heads, -1)], dim=-1)
    return k, v


def expanded_key_bytes(layer: MLALayerSpec, elem: int) -> int:
    """Bytes one key takes expanded per head (K: dn + dr, V: dv values of `elem` bytes each)."""
    return layer.num_heads * (layer.qk_nope_head_dim + layer.qk_rope_head_dim + layer.v_head_dim) * elem


def expansion_groups(seq_lens: list[int], layer: MLALayerSpec, elem: int, max_bytes: int) -> list[range]:
    """Consecutive request ranges whose keys, expanded per head (`expanded_key_bytes`), fit max_bytes; at least one
    request each, so one very long request still expands whole."""
    per_key = expanded_key_bytes(layer, elem)
    groups, start, keys = [], 0, 0
    for i, n in enumerate(seq_lens):
        if i > start and (keys + n) * per_key > max_bytes:
            groups.append(range(start, i))
            start, keys = i, 0
        keys += n
    groups.append(range(start, len(seq_lens)))
    return groups


class MLAAttentionBackend(AttentionBackend):
    """Base of MLA backends: the same per-step metadata and CUDA-graph hooks, latent attention in `forward_mla`."""

    def forward_mla(self, q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                    layer: MLALayerSpec, proj: MLAProjections, batch: ForwardBatch,
                    save_kv_cache: bool = True) -> torch.Tensor:
        """Store this step's latents, attend; returns [T, H, v_head_dim]."""
        if save_kv_cache:
            self.save_latent(c_kv, k_pe, layer, batch)
        if batch.mode.is_decode:
            return self.forward_mla_decode(q_nope, q_pe, layer, proj, batch)
        return self.forward_mla_extend(q_nope, q_pe, layer, proj, batch)

    def forward_mla_extend(self, q_nope: torch.Tensor, q_pe: torch.Tensor, layer: MLALayerSpec,
                           proj: MLAProjections, batch: ForwardBatch) -> torch.Tensor:
        raise NotImplementedError(f"{self.name} (MLA) has no extend path")

    def forward_mla_decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, layer: MLALayerSpec,
                           proj: MLAProjections, batch: ForwardBatch) -> torch.Tensor:
        raise NotImplementedError(f"{self.name} (MLA) has no decode path")

    @staticmethod
    def save_latent(c_kv: torch.Tensor, k_pe: torch.Tensor, layer: MLALayerSpec, batch: ForwardBatch) -> None:
        batch.token_kv_pool.set_latent(layer.layer_id, batch.out_cache_loc, c_kv, k_pe)  # type: ignore[attr-defined]

    # An MLA backend attends over latents; the MHA entry points are a programming error, said so loudly.
    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: LayerSpec,
                       batch: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor:
        raise TypeError(f"{self.name} is an MLA backend: call forward_mla (an MHA model needs an MHA backend)")

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: LayerSpec,
                       batch: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor:
        raise TypeError(f"{self.name} is an MLA backend: call forward_mla (an MHA model needs an MHA backend)")
