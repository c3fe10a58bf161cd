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

Variable cluster sizes on a block-level layout: in the permuted query sequence every query cluster is padded to
whole blocks (16 tokens on CPU, 64 on CUDA; padded rows are computed and dropped), so a query block holds one
cluster; when padding would add more than half the sequence (many clusters smaller than a block), query
clusters are packed like the keys and a block holding several attends the union of their rows. Keys are sorted
by cluster without padding, so a key block may hold the tails and heads of several clusters.

Which key blocks a query cluster attends (the top-p budget, counted in the kernel's units): the softmax mass a
key block carries for query cluster c is the sum, over the key tokens in it, of c's centroid-estimated
probability of that token's cluster (cluster mass / cluster size). Each query cluster keeps its key blocks best
first until their mass reaches `top_p_kmeans` (the block that crosses it included), and at least
`min_kc_ratio` of the latent key blocks. So every query attends keys carrying at least top_p of its estimated
mass, as in Sparse-VideoGen, and the keys a kept block brings in besides its best cluster count towards the
budget instead of being attended on top of it. (Attending every block that holds any kept cluster, `svg2_plan`
without `probs`, covers Sparse-VideoGen's pairs exactly but overshoots when clusters are smaller than a
block: 300 key clusters of 9 tokens in 64-token blocks made 91% of the block pairs for SVG2's 13%.)
`SVG2Plan.cluster_density` is Sparse-VideoGen's own density, `layout.density()` what the kernel computes.
Joint text tokens follow the latent tokens in blocks of their own, attend everything and are attended by every
query. Calls without step metadata run dense.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from sglx.attention.diffusion.base import check_qkv
from sglx.attention.diffusion.metadata import DiTAttnMetadata
from sglx.attention.diffusion.sparse.kmeans import KMeansResult, kmeans
from sglx.attention.diffusion.sparse.layout import BlockSparseLayout, cdiv
from sglx.attention.diffusion.sparse.mask_lists import layout_from_mask
from sglx.attention.diffusion.sparse.sparse_backend import SparseDiTBackend, validated
from sglx.attention.diffusion.sparse.tiled import pooling_dtype
from sglx.errors import ConfigError, SglxError

NAME = "sparse_video_gen_2_attn"
PAD_LIMIT = 0.5  # pad query clusters to whole blocks only while that adds at most half the sequence


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


def cluster_probs(q_centroids: torch.Tensor, k_centroids: torch.Tensor, k_sizes: torch.Tensor, scale: float
                  ) -> torch.Tensor:
    """float64 [B, H, Cq, Ck]: the softmax mass of each key cluster for each query cluster, estimated from
    centroids (`softmax(q_c . k_c * scale)` weighted by key-cluster sizes; each row sums to 1)."""
    scores = torch.einsum("bhqd,bhkd->bhqk", q_centroids.double(), k_centroids.double()) * scale
    weighted = k_sizes[:, :, None, :].double() * (scores - scores.amax(-1, keepdim=True)).exp()
    return weighted / weighted.sum(-1, keepdim=True).clamp(min=1e-300)


def top_p_keep(mass: torch.Tensor, top_p: float, at_least: int) -> torch.Tensor:
    """bool like `mass` [..., N]: the entries kept best first until their mass reaches top_p (the one crossing
    it included), and at least `at_least` of them."""
    if top_p >= 1.0:
        return torch.ones_like(mass, dtype=torch.bool)
    ranked, order = mass.sort(-1, descending=True)
    before = F.pad(ranked.cumsum(-1)[..., :-1], (1, 0))  # mass of the better entries: keep while <= top_p
    keep = before <= top_p
    keep[..., : max(1, at_least)] = True
    return torch.zeros_like(keep).scatter_(-1, order, keep)


def dynamic_map(q_centroids: torch.Tensor, k_centroids: torch.Tensor, k_sizes: torch.Tensor, scale: float,
                top_p: float, min_kc_ratio: float) -> torch.Tensor:
    """bool [B, H, Cq, Ck]: the key clusters each query cluster keeps (Sparse-VideoGen's identify_dynamic_map)."""
    ck = k_centroids.shape[2]
    if top_p >= 1.0:
        return torch.ones(q_centroids.shape[:3] + (ck,), dtype=torch.bool, device=q_centroids.device)
    probs = cluster_probs(q_centroids, k_centroids, k_sizes, scale)
    return top_p_keep(probs, top_p, int(min_kc_ratio * ck))


def _membership(labels: torch.Tensor, clusters: int, block: int) -> torch.Tensor:
    """bool [P, L / block, clusters]: which clusters appear in each block of a label row [P, L] (labels outside
    [0, clusters) are ignored)."""
    p, length = labels.shape
    safe = torch.where((labels >= 0) & (labels < clusters), labels, clusters)
    member = torch.zeros(p, length // block, clusters + 1, dtype=torch.bool, device=labels.device)
    member.scatter_(-1, safe.view(p, length // block, block), True)
    return member[..., :clusters]


def semantic_cluster_order(q_labels: torch.Tensor, k_labels: torch.Tensor, probs: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Renumber clusters so the permuted sequences put related clusters next to each other (k-means numbers them
    arbitrarily): key clusters grouped by the query cluster that weighs them most (summed over a GQA group), each
    query cluster placed at its heaviest key cluster. A query cluster's key mass then sits in few key blocks and
    packed query blocks hold clusters that want the same ones. Returns (q labels, k labels, probs) renumbered;
    labels q [B, Hq, N], k [B, Hkv, N], probs [B, Hq, Cq, Ck] (`cluster_probs`)."""
    b, hq, cq, ck = probs.shape
    hkv = k_labels.shape[1]
    group = hq // hkv
    per_kv = probs.view(b, hkv, group, cq, ck).sum(2)  # [B, Hkv, Cq, Ck]
    owner_mass, owner = per_kv.max(-2)  # [B, Hkv, Ck]
    # key clusters by owner, heaviest first within an owner (owner mass < group <= cq keeps the key exact)
    k_order = torch.argsort(owner.double() * (group + 1) - owner_mass, dim=-1)  # rank -> old id
    k_new = torch.empty_like(k_order).scatter_(-1, k_order, torch.arange(ck, device=probs.device).expand_as(k_order))
    heaviest = probs.argmax(-1)  # [B, Hq, Cq]: old id of each query cluster's heaviest key cluster
    anchor = k_new.repeat_interleave(group, 1).gather(-1, heaviest)
    q_order = torch.argsort(anchor * cq + torch.arange(cq, device=probs.device), dim=-1)
    q_new = torch.empty_like(q_order).scatter_(-1, q_order, torch.arange(cq, device=probs.device).expand_as(q_order))
    probs = probs.gather(2, q_order[..., None].expand(-1, -1, -1, ck))
    probs = probs.gather(3, k_order.repeat_interleave(group, 1)[:, :, None, :].expand(-1, -1, cq, -1))
    return q_new.gather(-1, q_labels), k_new.gather(-1, k_labels), probs


def _block_counts(labels: torch.Tensor, clusters: int, block: int) -> torch.Tensor:
    """float [P, L / block, clusters]: tokens of each cluster in each block of a label row [P, L] (labels outside
    [0, clusters) are not counted)."""
    p, length = labels.shape
    safe = torch.where((labels >= 0) & (labels < clusters), labels, clusters)
    counts = torch.zeros(p, length // block, clusters + 1, device=labels.device, dtype=torch.float64)
    counts.scatter_add_(-1, safe.view(p, length // block, block), torch.ones_like(safe, dtype=torch.float64)
                        .view(p, length // block, block))
    return counts[..., :clusters]


@dataclass(frozen=True)
class SVG2Plan:
    """One layer's permutations and layout over a permuted sequence of `layout.seq_len` slots.

    Queries: each query cluster padded to whole blocks (or packed, see PAD_LIMIT), then the text queries; `q_index`
    [B, L, Hq] is the source token of every slot (padding repeats token 0, its output is dropped) and `q_slot`
    [B, S, Hq] the slot of every token. Keys/values: sorted by key cluster, then text, no padding between,
    junk tail slots up to L cut off by `layout.k_lengths`; `k_index` [B, L, Hkv], `k_slot` [B, S, Hkv]."""

    q_index: torch.Tensor
    q_slot: torch.Tensor
    k_index: torch.Tensor
    k_slot: torch.Tensor
    layout: BlockSparseLayout
    cluster_map: torch.Tensor  # bool [B, Hq, Cq, Ck]
    q_sizes: torch.Tensor  # int64 [B, Hq, Cq]
    k_sizes: torch.Tensor  # int64 [B, Hq, Ck]
    kept_mass: torch.Tensor | None = None  # float64 [B, Hq, Cq]: estimated mass of the key blocks each kept

    def cluster_density(self) -> float:
        """Share of (latent query, latent key) pairs Sparse-VideoGen itself would attend (its density)."""
        kept = torch.einsum("bhq,bhqk,bhk->bh", self.q_sizes.double(), self.cluster_map.double(),
                            self.k_sizes.double())
        n = float(self.q_sizes[0, 0].sum())
        return float(kept.mean()) / (n * n)


def _label_sizes(labels: torch.Tensor, clusters: int) -> torch.Tensor:
    """int64 [P, C]: tokens per cluster of label rows [P, N]."""
    sizes = torch.zeros(labels.shape[0], clusters, dtype=torch.long, device=labels.device)
    return sizes.scatter_add_(1, labels, torch.ones_like(labels))


def _padded_spans(sizes: torch.Tensor, block: int) -> torch.Tensor:
    return (sizes + block - 1) // block * block


def _sorted_slots(labels: torch.Tensor, sizes: torch.Tensor, text: int, block: int | None, width: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Latent tokens sorted by label (stable), then the text tokens. With `block`, every cluster and the text
    start on a block boundary (padded queries); without, they follow each other (keys). `sizes` [P, C] are the
    cluster sizes (`_label_sizes`), `width` at least the most slots of any row (without `block`: N + text).

    Returns (slot of every token [P, N + text], slot label [P, width] (-1 padding, C for text))."""
    p, n = labels.shape
    clusters = sizes.shape[1]
    spans = sizes if block is None else _padded_spans(sizes, block)
    # the token at sorted position i of cluster c goes to slot i + (padded start of c - unpadded start of c)
    shift = torch.cumsum(spans - sizes, 1) - (spans - sizes)  # [P, C]
    sorted_labels, order = labels.sort(dim=-1, stable=True)
    slot = torch.empty_like(labels)
    slot.scatter_(1, order, torch.arange(n, device=labels.device) + shift.gather(1, sorted_labels))
    video_slots = spans.sum(1, keepdim=True)  # [P, 1]
    slots = torch.cat([slot, torch.arange(text, device=labels.device) + video_slots], 1)
    slot_labels = labels.new_full((p, width), -1)
    slot_labels.scatter_(1, slots, torch.cat([labels, labels.new_full((p, text), clusters)], 1))
    return slots, slot_labels


def _per_q_head(x: torch.Tensor, group: int) -> torch.Tensor:
    """[B, Hkv, ...] -> [B, Hq, ...] (GQA); no copy without grouping."""
    return x if group == 1 else x.repeat_interleave(group, 1)


def _to_input_order(slots: torch.Tensor, meta: DiTAttnMetadata) -> torch.Tensor:
    """Slots of [latent..., text...] rows -> slots in the sequence's input order (text before or after)."""
    n = meta.image_tokens
    if meta.text_position == "prefix":
        return torch.cat([slots[:, n:], slots[:, :n]], 1)
    return slots


def _index_of(slot: torch.Tensor, length: int) -> torch.Tensor:
    """Inverse of a slot map [P, S] -> source token of every one of `length` slots (unused slots: token 0)."""
    index = torch.zeros(slot.shape[0], length, dtype=torch.long, device=slot.device)
    return index.scatter_(1, slot, torch.arange(slot.shape[1], device=slot.device).expand_as(slot))


def padded_query_slots(q_sizes: torch.Tensor, block: int) -> torch.Tensor:
    """Latent query slots when every query cluster is padded to whole blocks: the most over rows of `q_sizes`
    [..., Cq] (0-dim; the same for any numbering of the clusters)."""
    return _padded_spans(q_sizes, block).sum(-1).amax()


class HostInt:
    """A 0-dim device integer copied to the host without waiting for the GPU now: `value()` waits only for the
    work queued before the copy, so a later read costs no pipeline drain when the GPU has moved on."""

    def __init__(self, x: torch.Tensor) -> None:
        self._event = None
        if x.is_cuda:
            self._host = torch.empty((), dtype=x.dtype, pin_memory=True)
            self._host.copy_(x, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = x

    def value(self) -> int:
        if self._event is not None:
            self._event.synchronize()
        return int(self._host)


def svg2_plan(q_labels: torch.Tensor, k_labels: torch.Tensor, cluster_map: torch.Tensor, meta: DiTAttnMetadata,
              block: int, pad_queries: bool | None = None, *, probs: torch.Tensor | None = None,
              top_p: float = 1.0, min_ratio: float = 0.0, padded_slots: HostInt | None = None) -> SVG2Plan:
    """Permutations and block layout from labels (q [B, Hq, N], k [B, Hkv, N]) and the cluster map.

    Without `probs`, a block pair is attended when any (query cluster, key cluster) pair in it is kept
    by `cluster_map` (covers it exactly, overshoots with small clusters). With `probs` ([B, Hq, Cq, Ck],
    `cluster_probs()`), each query cluster keeps key blocks by the top-p budget (module docstring) and
    `cluster_map` only feeds `cluster_density`.
    `pad_queries` None: pad query clusters to whole blocks unless that adds more than PAD_LIMIT of the sequence
    in some row (many small clusters), then pack them like the keys. `padded_slots`: `padded_query_slots` of
    these labels' cluster sizes, started earlier (the backend starts it right after clustering the queries)."""
    b, hq, n = q_labels.shape
    hkv = k_labels.shape[1]
    group = hq // hkv
    cq, ck = cluster_map.shape[-2:]
    text, seq = meta.text_tokens, meta.seq_len
    flat_q = q_labels.reshape(b * hq, n)
    q_sizes = _label_sizes(flat_q, cq)
    text_padded = cdiv(text, block) * block
    pad, length = False, cdiv(seq, block) * block
    if pad_queries is not False:
        # the one host read of a call: the permuted length (a tensor shape) depends on the clusters' sizes
        slots = padded_slots or HostInt(padded_query_slots(q_sizes, block))
        padded = slots.value() + text_padded
        pad = pad_queries is True or padded <= (1 + PAD_LIMIT) * seq
        if pad:
            length = cdiv(max(padded, seq), block) * block
    q_slots, q_labels_at = _sorted_slots(flat_q, q_sizes, text, block if pad else None, length)
    flat_k = k_labels.reshape(b * hkv, n)
    k_sizes = _label_sizes(flat_k, ck)
    k_slots, k_labels_at = _sorted_slots(flat_k, k_sizes, text, None, length)
    # clusters present in each block (text is cluster cq / ck: kept by and keeping everything)
    q_member = _membership(q_labels_at, cq + 1, block).view(b, hq, -1, cq + 1)
    k_member = _per_q_head(_membership(k_labels_at, ck + 1, block).view(b, hkv, -1, ck + 1), group)
    kept_mass = None
    if probs is None:
        full = F.pad(cluster_map, (0, 1, 0, 1), value=True)
        rows = torch.matmul(q_member.float(), full.float())  # [B, Hq, nq, Ck + 1]: > 0 where some query keeps it
        blocks = torch.matmul(rows, k_member.float().transpose(-1, -2)) > 0
    else:
        counts = _per_q_head(_block_counts(k_labels_at, ck, block).view(b, hkv, -1, ck), group)
        per_token = probs / _per_q_head(k_sizes.view(b, hkv, 1, ck), group).clamp(min=1)
        mass = torch.matmul(per_token, counts.transpose(-1, -2))  # [B, Hq, Cq, nk]: each row sums to 1
        latent_blocks = cdiv(n, block)
        keep = top_p_keep(mass, top_p, int(min_ratio * latent_blocks))
        kept_mass = (mass * keep).sum(-1)
        text_keys = k_member[..., ck]  # [B, Hq, nk]: blocks holding text keys, attended by every query
        blocks = (torch.matmul(q_member[..., :cq].float(), keep.float()) > 0) | text_keys[:, :, None, :]
        blocks |= q_member[..., cq, None]  # text query blocks attend everything
    real = (seq - torch.arange(length // block, device=blocks.device) * block).clamp(0, block)
    k_lengths = None if length == seq else real.to(torch.int32)
    layout = layout_from_mask(blocks, block, block, length, k_lengths, width=length // block)
    q_slot = _to_input_order(q_slots, meta)
    k_slot = _to_input_order(k_slots, meta)
    return SVG2Plan(
        q_index=_index_of(q_slot, length).view(b, hq, length).transpose(1, 2),
        q_slot=q_slot.view(b, hq, -1).transpose(1, 2),
        k_index=_index_of(k_slot, length).view(b, hkv, length).transpose(1, 2),
        k_slot=k_slot.view(b, hkv, -1).transpose(1, 2),
        layout=layout, cluster_map=cluster_map, q_sizes=q_sizes.view(b, hq, cq),
        k_sizes=_per_q_head(k_sizes.view(b, hkv, ck), group), kept_mass=kept_mass)


def _take_rows(flat: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """flat.index_select(0, rows); on CUDA sglx's row-gather kernel (torch's index_select ran at a third of the copy
    bandwidth on these 256-byte rows, see sglx.attention.kernels.row_gather)."""
    if flat.is_cuda:
        from sglx.attention.kernels.row_gather import gather_rows

        return gather_rows(flat, rows)
    return flat.index_select(0, rows)


def permute(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [B, S, H, D] -> [B, L, H, D]: slot i of head h holds x[:, index[:, i, h], h].

    One gather of whole D-wide rows (`_take_rows`) into a head-major buffer [B, H, L, D], returned as its
    [B, L, H, D] view (the block-sparse kernels take any strides and read head-major K/V by TMA in place). Why: an
    element-wise `gather` reads an expanded int64 index per element, 4x the data it moves (H100 profile, Wan 480p:
    0.22 ms a tensor; torch's `index_select` of the rows 0.30 ms)."""
    b, s, h, d = x.shape
    length = index.shape[1]
    heads = torch.arange(h, device=x.device)[None, :, None]
    rows = (torch.arange(b, device=x.device)[:, None, None] * s + index.transpose(1, 2)) * h + heads  # [B, H, L]
    flat = (x if x.is_contiguous() else x.contiguous()).view(b * s * h, d)
    return _take_rows(flat, rows.reshape(-1)).view(b, h, length, d).transpose(1, 2)


def unpermute(x: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """[B, L, H, D] in slot order -> [B, S, H, D] in input order (`slot` [B, S, H]): one row gather, reading a
    head-major x (what `permute` and kernels fed by it give) in place."""
    b, length, h, d = x.shape
    batch = torch.arange(b, device=x.device)[:, None, None]
    heads = torch.arange(h, device=x.device)[None, None, :]
    if x.transpose(1, 2).is_contiguous():
        flat = x.transpose(1, 2).reshape(b * h * length, d)  # a view
        rows = (batch * h + heads) * length + slot
    else:
        flat = (x if x.is_contiguous() else x.contiguous()).view(b * length * h, d)
        rows = (batch * length + slot) * h + heads
    return _take_rows(flat, rows.reshape(-1)).view(*slot.shape, d)


def _problems(x: torch.Tensor, image: slice, dtype: torch.dtype) -> torch.Tensor:
    """Latent tokens [B, S, H, D] -> k-means problems [B * H, N, D] in `dtype`: one transposing copy."""
    b, _, h, d = x.shape
    latent = x[:, image]
    out = torch.empty(b, h, latent.shape[1], d, dtype=dtype, device=x.device)
    return out.copy_(latent.permute(0, 2, 1, 3)).view(b * h, -1, d)


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


class SparseVideoGen2Backend(SparseDiTBackend):
    """SVG2: dense warm-up steps/layers, then k-means permutation and top-p cluster selection."""

    name = NAME

    def __init__(self, config: Mapping[str, Any] | None = None, *, block: int | None = None) -> None:
        super().__init__(config)
        self.svg2 = SVG2Config.from_mapping(config)
        self.block = block
        self.state = SVG2State()
        self.last_plan: SVG2Plan | None = None  # the last sparse call's plan (density, tests)

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
        self.check_sequence(q, k, meta)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        if self.svg2.top_p_kmeans >= 1.0:  # every key cluster kept: exactly dense, no clustering needed
            return self.forward_dense(q, k, v, scale=scale)
        if self.is_dense(meta, layer):
            if self.svg2.zero_step_kmeans_init:
                self.cluster(q, k, meta, layer)
            return self.forward_dense(q, k, v, scale=scale)
        block = self.block or (64 if q.device.type == "cuda" else 16)
        q_res, k_res, padded_slots = self.cluster(q, k, meta, layer, block)
        b, _, hq, d = q.shape
        hkv = k.shape[2]
        n = meta.image_tokens
        probs = cluster_probs(q_res.centroids.view(b, hq, -1, d),
                              _per_q_head(k_res.centroids.view(b, hkv, -1, d), hq // hkv),
                              _per_q_head(k_res.sizes.view(b, hkv, -1), hq // hkv), scale)
        q_labels, k_labels, probs = semantic_cluster_order(q_res.labels.view(b, hq, n), k_res.labels.view(b, hkv, n),
                                                           probs)
        cmap = top_p_keep(probs, self.svg2.top_p_kmeans, int(self.svg2.min_kc_ratio * probs.shape[-1]))
        plan = svg2_plan(q_labels, k_labels, cmap, meta, block, probs=probs, top_p=self.svg2.top_p_kmeans,
                         min_ratio=self.svg2.min_kc_ratio, padded_slots=padded_slots)
        self.last_plan = plan
        out = self.run(permute(q, plan.q_index), permute(k, plan.k_index), permute(v, plan.k_index), plan.layout,
                       scale)
        return unpermute(out, plan.q_slot)

    def cluster(self, q: torch.Tensor, k: torch.Tensor, meta: DiTAttnMetadata, layer: int, block: int = 16
                ) -> tuple[KMeansResult, KMeansResult, HostInt]:
        """k-means of this layer's latent queries and keys per (batch row, head), warm-started within a
        generation; returns (q result, k result) over [B*H, N] problems and the padded query length
        (`padded_query_slots`) on its way to the host, started before the keys are clustered."""
        n = meta.image_tokens
        image = slice(meta.image_start, meta.image_start + n)
        dtype = pooling_dtype(q)
        qx, kx = _problems(q, image, dtype), _problems(k, image, dtype)
        cq, ck = min(self.svg2.num_q_centroids, n), min(self.svg2.num_k_centroids, n)
        key = (tuple(q.shape), tuple(k.shape), meta.grid, cq, ck, str(q.device), dtype)
        warm = self.state.warm(layer, key, meta.step_index)
        iters = self.svg2.kmeans_iter_init if warm is None else self.svg2.kmeans_iter_step
        fast = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)  # tensor-core scores in q's dtype
        q_res = kmeans(qx, cq, iters, None if warm is None else warm.q_centroids,
                       x_scores=_problems(q, image, q.dtype) if fast else None)
        padded_slots = HostInt(padded_query_slots(q_res.sizes, block))
        k_res = kmeans(kx, ck, iters, None if warm is None else warm.k_centroids,
                       x_scores=_problems(k, image, k.dtype) if fast else None)
        self.state.layers[layer] = _LayerState(key, meta.step_index, q_res.centroids, k_res.centroids)
        return q_res, k_res, padded_slots


__all__ = ["SVG2Config", "SparseVideoGen2Backend", "cluster_probs", "dynamic_map", "semantic_cluster_order",
           "svg2_plan", "top_p_keep"]
