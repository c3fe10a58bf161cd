"""sparse_video_gen_2_attn: Sparse-VideoGen 2's semantic-aware permutation (SAP) on sglx's block-sparse kernel.

Per batch row and head, the latent queries and keys are clustered by k-means (`num_q_centroids`,
`num_k_centroids`, capped at the number of latent tokens): `kmeans_iter_init` Lloyd iterations the first time a
layer clusters in a generation, then `kmeans_iter_step` iterations warm-started from that layer's previous
centroids. Each query cluster keeps the key clusters whose probability mass, softmax of centroid scores
`q_c . k_c * scale` weighted by key-cluster sizes (Sparse-VideoGen's `identify_dynamic_map`), reaches
`top_p_kmeans` best first (the cluster that crosses it included), and at least `min_kc_ratio` of the key
clusters. Queries are sorted by query cluster, keys and values by key cluster (per head), attention runs
block-sparse on the permuted sequence and the output is permuted back. The first `first_times_fp` of the
steps and `first_layers_fp` of the layers (fractions, rounded down as Sparse-VideoGen does) run dense;
`zero_step_kmeans_init` also clusters during those dense steps so the first sparse step starts warm.

Variable cluster sizes on a block-level layout (the documented approximation): the permuted sequence is cut
into fixed blocks (16 tokens on CPU, 64 on CUDA) that may hold the tail of one cluster and the head of the
next. A query block attends a key block when any query cluster in it keeps any key cluster in it, so every
pair Sparse-VideoGen attends is attended, plus the neighbours that share its blocks: density is at least
SVG2's, equal when clusters fill whole blocks. Joint text tokens sit after the latent tokens in the permuted
sequence, attend everything and are attended by every query. Calls without step metadata run dense.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from sglx.attention.diffusion.base import DiffusionAttentionBackend, check_qkv
from sglx.attention.diffusion.metadata import DiTAttnMetadata
from sglx.attention.diffusion.sparse.kmeans import KMeansResult, kmeans
from sglx.attention.diffusion.sparse.layout import BlockSparseLayout, cdiv
from sglx.attention.diffusion.sparse.routes import run_block_sparse
from sglx.attention.diffusion.sparse.tiled import pooling_dtype
from sglx.attention.diffusion.sparse.video_sparse import check_sequence, validated
from sglx.errors import ConfigError, SglxError

NAME = "sparse_video_gen_2_attn"


@dataclass(frozen=True)
class SVG2Config:
    num_q_centroids: int = 300
    num_k_centroids: int = 1000
    top_p_kmeans: float = 0.9
    min_kc_ratio: float = 0.10
    kmeans_iter_init: int = 50
    kmeans_iter_step: int = 2
    first_times_fp: float = 0.2
    first_layers_fp: float = 0.03
    zero_step_kmeans_init: bool = False

    def __post_init__(self) -> None:
        for key in ("num_q_centroids", "num_k_centroids"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{NAME} {key} must be >= 1; got {getattr(self, key)}", key)
        if not 0.0 < self.top_p_kmeans <= 1.0:
            raise ConfigError(f"{NAME} top_p_kmeans must be in (0, 1] (1.0 keeps every key cluster); got "
                              f"{self.top_p_kmeans}", "top_p_kmeans")
        for key in ("min_kc_ratio", "first_times_fp", "first_layers_fp"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise ConfigError(f"{NAME} {key} must be a fraction in [0, 1]; got {getattr(self, key)}", key)
        for key in ("kmeans_iter_init", "kmeans_iter_step"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{NAME} {key} must be >= 0; got {getattr(self, key)}", key)

    @classmethod
    def from_mapping(cls, config: Mapping[str, Any] | None) -> SVG2Config:
        return cls(**validated(NAME, config))

    def dense_steps(self, num_steps: int) -> int:
        return math.floor(self.first_times_fp * num_steps)

    def dense_layers(self, num_layers: int) -> int:
        return math.floor(self.first_layers_fp * num_layers)


def dynamic_map(q_centroids: torch.Tensor, k_centroids: torch.Tensor, k_sizes: torch.Tensor, scale: float,
                top_p: float, min_kc_ratio: float) -> torch.Tensor:
    """bool [B, H, Cq, Ck]: the key clusters each query cluster keeps (Sparse-VideoGen's identify_dynamic_map)."""
    ck = k_centroids.shape[2]
    if top_p >= 1.0:
        return torch.ones(q_centroids.shape[:3] + (ck,), dtype=torch.bool, device=q_centroids.device)
    scores = torch.einsum("bhqd,bhkd->bhqk", q_centroids.double(), k_centroids.double()) * scale
    weighted = k_sizes[:, :, None, :].double() * (scores - scores.amax(-1, keepdim=True)).exp()
    probs = weighted / weighted.sum(-1, keepdim=True).clamp(min=1e-300)
    ranked, order = probs.sort(-1, descending=True)
    before = F.pad(ranked.cumsum(-1)[..., :-1], (1, 0))  # mass of the better clusters: keep while <= top_p
    keep = before <= top_p
    keep[..., : max(1, int(min_kc_ratio * ck))] = True
    return torch.zeros_like(keep).scatter_(-1, order, keep)


def _membership(labels: torch.Tensor, clusters: int, block: int, seq_len: int) -> torch.Tensor:
    """bool [P, num_blocks, clusters]: which clusters appear in each block of a sorted label row [P, S]."""
    nb = cdiv(seq_len, block)
    padded = F.pad(labels, (0, nb * block - seq_len), value=clusters)  # past the end: a dropped extra column
    member = torch.zeros(labels.shape[0], nb, clusters + 1, dtype=torch.bool, device=labels.device)
    member.scatter_(-1, padded.view(labels.shape[0], nb, block), True)
    return member[..., :clusters]


@dataclass(frozen=True)
class SVG2Plan:
    """One layer's permutation and layout: q_index [B, S, Hq] / k_index [B, S, Hkv] are the source position of
    every permuted slot (latent tokens by cluster, then text)."""

    q_index: torch.Tensor
    k_index: torch.Tensor
    layout: BlockSparseLayout
    cluster_map: torch.Tensor  # bool [B, Hq, Cq, Ck]


def _permutation(labels: torch.Tensor, meta: DiTAttnMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """labels [P, N] of the latent tokens -> (source position of every slot [P, S], sorted labels with text
    slots labelled -1 [P, S])."""
    p, n = labels.shape
    sorted_labels, order = labels.sort(dim=-1, stable=True)
    text = torch.arange(meta.text_tokens, device=labels.device) + meta.text_start
    index = torch.cat([order + meta.image_start, text.expand(p, -1)], dim=1)
    slot_labels = torch.cat([sorted_labels, sorted_labels.new_full((p, meta.text_tokens), -1)], dim=1)
    return index, slot_labels


def svg2_plan(q_labels: torch.Tensor, k_labels: torch.Tensor, cluster_map: torch.Tensor, meta: DiTAttnMetadata,
              block: int) -> SVG2Plan:
    """Permutations and block layout from labels (q [B, Hq, N], k [B, Hkv, N]) and the cluster map."""
    b, hq, n = q_labels.shape
    hkv = k_labels.shape[1]
    cq, ck = cluster_map.shape[-2:]
    s = meta.seq_len
    q_index, q_slots = _permutation(q_labels.reshape(b * hq, n), meta)
    k_index, k_slots = _permutation(k_labels.reshape(b * hkv, n), meta)
    # text is one more cluster on each side, kept by everyone and keeping everything
    q_member = _membership(q_slots.where(q_slots >= 0, cq), cq + 1, block, s).view(b, hq, -1, cq + 1)
    k_member = _membership(k_slots.where(k_slots >= 0, ck), ck + 1, block, s).view(b, hkv, -1, ck + 1)
    k_member = k_member.repeat_interleave(hq // hkv, dim=1)
    full = F.pad(cluster_map, (0, 1, 0, 1), value=True)
    reach = torch.matmul(q_member.float(), full.float())  # [B, H, nq, Ck+1]: key clusters some query keeps
    blocks = torch.matmul(reach, k_member.float().transpose(-1, -2)) > 0
    layout = BlockSparseLayout.from_block_mask(blocks, block, block, s)
    return SVG2Plan(q_index.view(b, hq, s).transpose(1, 2), k_index.view(b, hkv, s).transpose(1, 2), layout,
                    cluster_map)


def permute(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [B, S, H, D] -> x at `index` [B, S, H] per head."""
    return x.gather(1, index[..., None].expand_as(x))


def unpermute(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x).scatter_(1, index[..., None].expand_as(x), x)


@dataclass
class _LayerState:
    key: tuple[Any, ...]
    step: int
    q_centroids: torch.Tensor
    k_centroids: torch.Tensor


@dataclass
class SVG2State:
    """Per-layer centroids of the generation in progress (reset when a generation starts over or changes shape)."""

    layers: dict[int, _LayerState] = field(default_factory=dict)

    def warm(self, layer: int, key: tuple[Any, ...], step: int) -> _LayerState | None:
        state = self.layers.get(layer)
        if state is None or state.key != key or step <= state.step:
            return None
        return state


class SparseVideoGen2Backend(DiffusionAttentionBackend):
    """SVG2: dense warm-up steps/layers, then k-means permutation and top-p cluster selection."""

    name = NAME
    sparse = True

    def __init__(self, config: Mapping[str, Any] | None = None, *, block: int | None = None) -> None:
        super().__init__(config)
        self.svg2 = SVG2Config.from_mapping(config)
        self.block = block
        self.state = SVG2State()
        self.last_plan: SVG2Plan | None = None  # the last sparse call's plan (density, tests)

    def forward_dense(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                      scale: float | None = None) -> torch.Tensor:
        check_qkv(q, k, v)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale,
                                             enable_gqa=q.shape[2] != k.shape[2])
        return out.transpose(1, 2)

    def is_dense(self, meta: DiTAttnMetadata, layer: int) -> bool:
        if meta.num_layers is None:
            raise SglxError(f"{NAME} needs the DiT's layer count in the step metadata (first_layers_fp is a "
                            "fraction of it); this pipeline does not provide num_layers")
        return (meta.step_index < self.svg2.dense_steps(meta.num_steps)
                or layer < self.svg2.dense_layers(meta.num_layers))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
                meta: DiTAttnMetadata | None = None, layer: int = 0) -> torch.Tensor:
        if meta is None:
            return self.forward_dense(q, k, v, scale=scale)
        check_qkv(q, k, v)
        check_sequence(NAME, q, k, meta)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        if self.is_dense(meta, layer):
            if self.svg2.zero_step_kmeans_init:
                self.cluster(q, k, meta, layer)
            return self.forward_dense(q, k, v, scale=scale)
        q_res, k_res = self.cluster(q, k, meta, layer)
        b, _, hq, d = q.shape
        hkv = k.shape[2]
        n = meta.image_tokens
        cmap = dynamic_map(q_res.centroids.view(b, hq, -1, d), k_res.centroids.view(b, hkv, -1, d)
                           .repeat_interleave(hq // hkv, dim=1), k_res.sizes.view(b, hkv, -1)
                           .repeat_interleave(hq // hkv, dim=1), scale, self.svg2.top_p_kmeans,
                           self.svg2.min_kc_ratio)
        block = self.block or (64 if q.device.type == "cuda" else 16)
        plan = svg2_plan(q_res.labels.view(b, hq, n), k_res.labels.view(b, hkv, n), cmap, meta, block)
        self.last_plan = plan
        out = run_block_sparse(permute(q, plan.q_index), permute(k, plan.k_index), permute(v, plan.k_index),
                               plan.layout, scale)
        return unpermute(out, plan.q_index)

    def cluster(self, q: torch.Tensor, k: torch.Tensor, meta: DiTAttnMetadata, layer: int
                ) -> tuple[KMeansResult, KMeansResult]:
        """k-means of this layer's latent queries and keys per (batch row, head), warm-started within a
        generation; returns (q result, k result) over [B*H, N] problems."""
        n = meta.image_tokens
        image = slice(meta.image_start, meta.image_start + n)
        dtype = pooling_dtype(q)
        qx = q[:, image].permute(0, 2, 1, 3).reshape(-1, n, q.shape[-1]).to(dtype)
        kx = k[:, image].permute(0, 2, 1, 3).reshape(-1, n, k.shape[-1]).to(dtype)
        cq, ck = min(self.svg2.num_q_centroids, n), min(self.svg2.num_k_centroids, n)
        key = (tuple(q.shape), tuple(k.shape), meta.grid, cq, ck, str(q.device), dtype)
        warm = self.state.warm(layer, key, meta.step_index)
        iters = self.svg2.kmeans_iter_init if warm is None else self.svg2.kmeans_iter_step
        q_res = kmeans(qx, cq, iters, None if warm is None else warm.q_centroids)
        k_res = kmeans(kx, ck, iters, None if warm is None else warm.k_centroids)
        self.state.layers[layer] = _LayerState(key, meta.step_index, q_res.centroids, k_res.centroids)
        return q_res, k_res


__all__ = ["SVG2Config", "SparseVideoGen2Backend", "dynamic_map", "svg2_plan"]
