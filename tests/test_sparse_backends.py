"""video_sparse_attn, vmoba_attn and sparse_video_gen_2_attn: each layout against a brute-force token-level mask
built independently (Python loops over cubes, chunks and clusters), each backend against float64 masked
attention with that mask, degenerate configs equal to dense attention, config errors, and the tiny Wan end to
end through DiffusionEngine (CPU path: the masked reference)."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import torch

from sglx.attention.diffusion.metadata import DiTAttnMetadata
from sglx.attention.diffusion.sparse import svg2 as svg2_module
from sglx.attention.diffusion.sparse.kmeans import kmeans
from sglx.attention.diffusion.sparse.svg2 import SparseVideoGen2Backend, dynamic_map, svg2_plan
from sglx.attention.diffusion.sparse.video_sparse import (
    VideoSparseAttentionBackend,
    compute_topk,
    video_sparse_attention,
    vsa_plan,
)
from sglx.attention.diffusion.sparse.vmoba import VMoBABackend, VMoBAConfig, vmoba_plan
from sglx.errors import ConfigError, SglxError

pytestmark = pytest.mark.usefixtures("single_torch_thread")


# ------------------------------------------------------------------------------------------- shared helpers


def make_meta(grid, text=0, position="none", step=0, steps=1, layers=4, heads=4):
    return DiTAttnMetadata(grid=grid, num_heads=heads, head_dim=8, text_tokens=text,
                           text_position=position if text else "none", step_index=step, num_steps=steps,
                           num_layers=layers)


def qkv(meta, hq=4, hkv=2, d=8, batch=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, meta.seq_len, hq, d, generator=gen, dtype=torch.float64)
    k = torch.randn(batch, meta.seq_len, hkv, d, generator=gen, dtype=torch.float64)
    v = torch.randn(batch, meta.seq_len, hkv, d, generator=gen, dtype=torch.float64)
    return q, k, v


def masked_reference(q, k, v, allowed, scale):
    """float64 attention in input order; allowed bool [B|1, H, S, S] (query, key)."""
    group = q.shape[2] // k.shape[2]
    kk, vv = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("bhqk,bkhd->bqhd", probs, vv)


def dense(q, k, v, scale):
    return masked_reference(q, k, v, torch.ones(1, 1, q.shape[1], q.shape[1], dtype=torch.bool), scale)


def video_positions(meta):
    """Sequence index of the latent token at (t, h, w)."""
    t, h, w = meta.grid
    return lambda a, b, c: meta.image_start + (a * h + b) * w + c


def boxes(grid, box):
    """Python list of the token coordinates of every box, boxes row-major, tokens row-major inside."""
    out = []
    ranges = [range(0, g, b) for g, b in zip(grid, box)]
    for t0, h0, w0 in itertools.product(*ranges):
        out.append(list(itertools.product(range(t0, min(t0 + box[0], grid[0])),
                                          range(h0, min(h0 + box[1], grid[1])),
                                          range(w0, min(w0 + box[2], grid[2])))))
    return out


def text_positions(meta):
    return list(range(meta.text_start, meta.text_start + meta.text_tokens))


def with_text(mask, meta):
    """Text tokens attend everything and are attended by everything."""
    text = text_positions(meta)
    mask[..., text, :] = True
    mask[..., :, text] = True
    return mask


def layout_in_input_order(layout, scatter):
    """The layout's token mask [B, H, S, S] moved from tile order back to input order."""
    return layout.token_mask()[:, :, scatter][:, :, :, scatter]


def test_layout_from_mask_equals_the_sorting_constructor():
    from sglx.attention.diffusion.sparse.layout import BlockSparseLayout
    from sglx.attention.diffusion.sparse.mask_lists import layout_from_mask

    gen = torch.Generator().manual_seed(4)
    for density in (0.0, 0.3, 1.0):
        mask = torch.rand(2, 3, 9, 9, generator=gen) < density
        want = BlockSparseLayout.from_block_mask(mask, 16, 16, 140)
        got = layout_from_mask(mask, 16, 16, 140)
        assert torch.equal(got.kv_indices, want.kv_indices) and torch.equal(got.kv_counts, want.kv_counts)


# --------------------------------------------------------------------------------------------------- VSA


def vsa_blocks(meta):
    """VSA's blocks as sequence positions: the whole 4x4x4 cubes (row-major), then the tokens of the edge cubes
    back to back (row-major cubes) cut into 64-token blocks."""
    pos = video_positions(meta)
    cubes = [[pos(*c) for c in cube] for cube in boxes(meta.grid, (4, 4, 4))]
    edge = [p for cube in cubes if len(cube) != 64 for p in cube]
    return [cube for cube in cubes if len(cube) == 64] + [edge[i:i + 64] for i in range(0, len(edge), 64)]


def brute_force_vsa(q, k, meta, sparsity, scale):
    """Token mask of VSA computed block by block with Python loops (float64)."""
    cubes = vsa_blocks(meta)
    b, s, hq, _ = q.shape
    group = hq // k.shape[2]
    qc = torch.stack([q[:, idx].mean(1) for idx in cubes], 2)  # [B, H, n, D]
    kc = torch.stack([k[:, idx].mean(1) for idx in cubes], 2).repeat_interleave(group, 1)
    scores = torch.einsum("bhnd,bhmd->bhnm", qc, kc) * scale
    keep = math.ceil((1 - sparsity) * len(cubes))
    mask = torch.zeros(b, hq, s, s, dtype=torch.bool)
    for bb, hh, i in itertools.product(range(b), range(hq), range(len(cubes))):
        for j in scores[bb, hh, i].topk(max(1, keep)).indices.tolist():
            mask[bb, hh, torch.tensor(cubes[i])[:, None], torch.tensor(cubes[j])[None, :]] = True
    return with_text(mask, meta)


@pytest.mark.parametrize(("grid", "text", "position", "sparsity"), [
    ((5, 6, 7), 0, "none", 0.6),       # nothing divides by 4: edge cubes packed
    ((4, 8, 4), 0, "none", 0.5),       # divides: no padding at all
    ((3, 5, 9), 7, "prefix", 0.7),     # FLUX-like text prefix
    ((6, 5, 9), 70, "suffix", 0.4),    # text suffix longer than one block
])
def test_vsa_layout_and_output_match_brute_force(grid, text, position, sparsity):
    meta = make_meta(grid, text, position)
    q, k, v = qkv(meta)
    plan = vsa_plan(q, k, meta, sparsity, 0.3)
    want = brute_force_vsa(q, k, meta, sparsity, 0.3)
    assert torch.equal(layout_in_input_order(plan.layout, plan.order.scatter), want)
    out = VideoSparseAttentionBackend({"sparsity": sparsity}).forward(q, k, v, scale=0.3, meta=meta, layer=3)
    assert torch.allclose(out, masked_reference(q, k, v, want, 0.3), atol=1e-10)
    assert not torch.allclose(out, dense(q, k, v, 0.3), atol=1e-3)


def test_vsa_sparsity_zero_is_dense_and_topk_rule():
    meta = make_meta((5, 6, 7), 5, "prefix")
    q, k, v = qkv(meta)
    out = VideoSparseAttentionBackend({}).forward(q, k, v, scale=0.3, meta=meta)  # runs SDPA: the same
    assert torch.allclose(out, dense(q, k, v, 0.3), atol=1e-12)
    kernel_path = video_sparse_attention(q, k, v, meta, 0.0, 0.3)  # every cube listed, through the layout
    assert torch.allclose(kernel_path, dense(q, k, v, 0.3), atol=1e-12)
    assert [compute_topk(s, 10) for s in (0.0, 0.5, 0.87, 0.99)] == [10, 5, 2, 1]


def test_vsa_gated_coarse_branch_matches_reference():
    """out = fine + gate * coarse, coarse = attention over mean-pooled cubes broadcast to each cube's tokens."""
    meta = make_meta((5, 6, 7))
    q, k, v = qkv(meta)
    gate = torch.rand_like(q)
    out = video_sparse_attention(q, k, v, meta, 0.6, 0.3, gate_compress=gate)
    cubes = vsa_blocks(meta)
    qc = torch.stack([q[:, idx].mean(1) for idx in cubes], 2)
    kc = torch.stack([k[:, idx].mean(1) for idx in cubes], 2).repeat_interleave(2, 1)
    vc = torch.stack([v[:, idx].mean(1) for idx in cubes], 2).repeat_interleave(2, 1)
    coarse_cubes = (torch.einsum("bhnd,bhmd->bhnm", qc, kc) * 0.3).softmax(-1) @ vc
    coarse = torch.zeros_like(q)
    for i, idx in enumerate(cubes):
        coarse[:, idx] = coarse_cubes[:, :, i][:, None]
    fine = masked_reference(q, k, v, brute_force_vsa(q, k, meta, 0.6, 0.3), 0.3)
    assert torch.allclose(out, fine + gate * coarse, atol=1e-10)


# ------------------------------------------------------------------------------------------------- VMoBA


GROUP_OF = {"query_head": lambda b, h, i, c: (b, h, i), "block": lambda b, h, i, c: (b, c),
            "overall": lambda b, h, i, c: (b,), "head_global": lambda b, h, i, c: (b, h)}


def select_reference(gates, own, mode, ttype, threshold, topk, heads, rows):
    """Upstream's choice written with Python dicts: gates {(b, h, i, c): gate} over latent query blocks i, own
    {(b, h, i): own chunk}; returns the kept (b, h, i, c)."""
    groups = {}
    for e in gates:
        groups.setdefault(GROUP_OF[ttype](*e), []).append(e)
    kept = set()
    for members in groups.values():
        is_own = {e: own[e[:3]] == e[3] for e in members}
        if mode == "topk":
            count = topk * {"query_head": 1, "head_global": rows, "overall": rows * heads}[ttype]
            ranked = sorted(members, key=lambda e: (not is_own[e], -gates[e]))
            kept |= set(ranked[:count])
            continue
        if threshold >= 1.0:
            kept |= set(members)
            continue
        lo, hi = min(gates[e] for e in members), max(gates[e] for e in members)
        denom = hi - lo if hi - lo > 1e-6 else 1.0
        norm = {e: (gates[e] - lo) / denom for e in members}
        total = sum(norm.values())
        remain = max(threshold - sum(norm[e] for e in members if is_own[e]) / (total + 1e-6), 0.0)
        kept |= {e for e in members if is_own[e]}
        acc = 0.0
        for e in sorted(members, key=lambda e: -(0.0 if is_own[e] else norm[e])):
            acc += 0.0 if is_own[e] else norm[e]
            kept.add(e)
            if acc / (total + 1e-6) >= remain:
                break
    return kept


def brute_force_vmoba(q, k, meta, box, block, mode, threshold, topk, ttype="query_head"):
    """Token mask of VMoBA: chunks (boxes), query blocks of `block` tokens inside each chunk, pooled query per
    block against the mean key of every chunk."""
    pos = video_positions(meta)
    chunks = [[pos(*c) for c in chunk] for chunk in boxes(meta.grid, box)]
    b, s, hq, _ = q.shape
    kk = k.repeat_interleave(hq // k.shape[2], 2)
    means = torch.stack([kk[:, idx].mean(1) for idx in chunks], 2)  # [B, H, C, D]
    groups = [(c, idx[start:start + block]) for c, idx in enumerate(chunks) for start in range(0, len(idx), block)]
    gates, own = {}, {}
    for i, (c, rows) in enumerate(groups):
        gate = torch.einsum("bhd,bhcd->bhc", q[:, rows].mean(1), means)
        for bb, hh in itertools.product(range(b), range(hq)):
            own[bb, hh, i] = c
            for j in range(len(chunks)):
                gates[bb, hh, i, j] = gate[bb, hh, j].item()
    mask = torch.zeros(b, hq, s, s, dtype=torch.bool)
    for bb, hh, i, j in select_reference(gates, own, mode, ttype, threshold, topk, hq, len(groups)):
        mask[bb, hh, torch.tensor(groups[i][1])[:, None], torch.tensor(chunks[j])[None, :]] = True
    return with_text(mask, meta)


@pytest.mark.parametrize(("grid", "text", "position", "kind", "chunk", "mode", "threshold", "ttype"), [
    ((5, 6, 7), 0, "none", "temporal", 2, "threshold", 0.25, "query_head"),
    ((5, 6, 7), 6, "prefix", "spatial", (4, 3), "threshold", 0.6, "query_head"),
    ((4, 6, 5), 0, "none", "st", (2, 4, 3), "threshold", 0.25, "query_head"),
    ((4, 6, 5), 9, "suffix", "st", (3, 3, 2), "topk", 0.25, "query_head"),
    ((5, 4, 6), 0, "none", "spatial", (2, 2), "topk", 0.25, "query_head"),
    ((5, 6, 7), 5, "prefix", "st", (2, 3, 4), "threshold", 0.3, "block"),
    ((5, 6, 7), 0, "none", "temporal", 1, "threshold", 0.4, "overall"),
    ((4, 6, 5), 0, "none", "spatial", (3, 2), "threshold", 0.35, "head_global"),
    ((4, 6, 5), 3, "suffix", "st", (2, 3, 2), "topk", 0.25, "overall"),
    ((5, 4, 6), 0, "none", "spatial", (2, 3), "topk", 0.25, "head_global"),
])
def test_vmoba_layout_and_output_match_brute_force(grid, text, position, kind, chunk, mode, threshold, ttype):
    meta = make_meta(grid, text, position, step=1, steps=2)
    q, k, v = qkv(meta)
    cfg = VMoBAConfig(**{f"{kind}_chunk_size": chunk, f"{kind}_topk": 3}, moba_select_mode=mode,
                      moba_threshold=threshold, moba_threshold_type=ttype, first_full_step=1)
    plan = vmoba_plan(q, k, meta, cfg, kind, block=16)
    box = cfg.chunk_box(kind, grid)
    want = brute_force_vmoba(q, k, meta, box, 16, mode, threshold, 3, ttype)
    assert torch.equal(layout_in_input_order(plan.layout, plan.order.scatter), want)
    assert plan.layout.density() < 0.95
    layer = {"temporal": 0, "spatial": 1, "st": 2}[kind]
    out = VMoBABackend(cfg.__dict__).forward(q, k, v, scale=0.3, meta=meta, layer=layer)
    assert torch.allclose(out, masked_reference(q, k, v, want, 0.3), atol=1e-10)


def test_vmoba_layer_cycle_full_steps_and_layers():
    cfg = VMoBAConfig(first_full_layer=2, temporal_layer=2, spatial_layer=1, st_layer=1)
    assert [cfg.kind_of_layer(n) for n in range(8)] == [None, None, "temporal", "temporal", "spatial", "st",
                                                         "temporal", "temporal"]
    backend = VMoBABackend({"first_full_step": 2, "first_full_layer": 1, "temporal_chunk_size": 1})
    meta = make_meta((3, 4, 4), step=1, steps=3)
    q, k, v = qkv(meta)
    assert backend.layer_kind(meta, 1) is None and backend.layer_kind(meta.at_step(2), 0) is None
    assert backend.layer_kind(meta.at_step(2), 1) == "temporal" and backend.layer_kind(None, 3) is None
    assert torch.allclose(backend.forward(q, k, v, scale=0.3, meta=meta, layer=1), dense(q, k, v, 0.3), atol=1e-12)
    assert not torch.allclose(backend.forward(q, k, v, scale=0.3, meta=meta.at_step(2), layer=1),
                              dense(q, k, v, 0.3), atol=1e-3)


def test_vmoba_threshold_one_and_topk_all_are_dense():
    meta = make_meta((5, 6, 7), 4, "suffix", step=0, steps=1)
    q, k, v = qkv(meta)
    for config in ({"moba_threshold": 1.0, "temporal_chunk_size": 1},
                   {"moba_select_mode": "topk", "spatial_chunk_size": [2, 2], "spatial_topk": 100}):
        backend = VMoBABackend({"first_full_step": 0, **config})
        for layer in range(3):
            out = backend.forward(q, k, v, scale=0.3, meta=meta, layer=layer)
            assert torch.allclose(out, dense(q, k, v, 0.3), atol=1e-12)


def test_vmoba_unset_chunks_fall_back_to_fastvideo_values_cut_to_the_grid():
    cfg = VMoBAConfig()
    assert cfg.chunk_box("temporal", (21, 30, 52)) == (2, 30, 52)
    assert cfg.chunk_box("spatial", (21, 30, 52)) == (21, 3, 4)
    assert cfg.chunk_box("st", (21, 30, 52)) == (4, 6, 4)
    assert cfg.chunk_box("st", (3, 4, 8)) == (3, 4, 4)
    assert (cfg.topk("temporal"), cfg.topk("spatial"), cfg.topk("st")) == (3, 20, 15)


# -------------------------------------------------------------------------------------------------- SVG2


def brute_force_svg2_blocks(q_labels, k_labels, cmap, meta, block, pad):
    """Per (b, h): queries sorted by cluster, each cluster and the text padded to whole blocks (`pad`) or not;
    keys sorted by cluster, then text, unpadded, junk up to the common length. A block pair is attended when any
    (query cluster, key cluster) pair in it is kept; text is a cluster kept by and keeping everything."""
    b, hq, n = q_labels.shape
    hkv = k_labels.shape[1]
    rows = {}
    for bb, hh in itertools.product(range(b), range(hq)):
        labels = q_labels[bb, hh].tolist()
        row = []
        for c in range(cmap.shape[2]):
            size = labels.count(c)
            row += [c] * size + [None] * (-size % block if pad else 0)
        row += ["text"] * meta.text_tokens + [None] * (-meta.text_tokens % block if pad else 0)
        rows[bb, hh] = row
    length = -(-max(len(r) for r in rows.values()) // block) * block
    nb = length // block
    out = torch.zeros(b, hq, nb, nb, dtype=torch.bool)
    for (bb, hh), row in rows.items():
        row = row + [None] * (length - len(row))
        keys = sorted(k_labels[bb, hh // (hq // hkv)].tolist()) + ["text"] * meta.text_tokens
        keys += [None] * (length - len(keys))
        for i, j in itertools.product(range(nb), range(nb)):
            qs = {a for a in row[i * block:(i + 1) * block] if a is not None}
            ks = {c for c in keys[j * block:(j + 1) * block] if c is not None}
            out[bb, hh, i, j] = any(a == "text" or c == "text" or bool(cmap[bb, hh, a, c]) for a in qs for c in ks)
    return out


def plan_mask_in_input_order(plan, hq, hkv):
    """The plan's token mask [B, Hq, S, S] moved from slots back to input order."""
    perm = plan.layout.token_mask()
    q_slot = plan.q_slot.transpose(1, 2)  # [B, Hq, S]
    k_slot = plan.k_slot.transpose(1, 2).repeat_interleave(hq // hkv, 1)
    b = q_slot.shape[0]
    return torch.stack([torch.stack([perm[bb, hh][q_slot[bb, hh]][:, k_slot[bb, hh]] for hh in range(hq)])
                        for bb in range(b)])


@pytest.mark.parametrize(("grid", "text", "position", "pad"), [
    ((3, 5, 7), 0, "none", True), ((2, 5, 6), 9, "prefix", True), ((3, 4, 5), 20, "suffix", True),
    ((3, 5, 7), 0, "none", False), ((2, 5, 6), 9, "prefix", False), ((6, 8, 9), 0, "none", True),
])
def test_svg2_layout_matches_brute_force_and_covers_the_cluster_mask(grid, text, position, pad):
    meta = make_meta(grid, text, position)
    gen = torch.Generator().manual_seed(1)
    n = meta.image_tokens
    q_labels = torch.randint(0, 6, (2, 4, n), generator=gen)
    k_labels = torch.randint(0, 9, (2, 2, n), generator=gen)
    cmap = torch.rand(2, 4, 6, 9, generator=gen) < 0.3
    plan = svg2_plan(q_labels, k_labels, cmap, meta, 16, pad_queries=pad)
    want = brute_force_svg2_blocks(q_labels, k_labels, cmap, meta, 16, pad)
    assert torch.equal(plan.layout.block_mask(), want)
    auto = svg2_plan(q_labels, k_labels, cmap, meta, 16)  # pads only while padding adds <= half the sequence
    padded = max(sum(-(-int((q_labels[bb, hh] == c).sum()) // 16) * 16 for c in range(6)) + -(-text // 16) * 16
                 for bb in range(2) for hh in range(4))
    if (padded <= 1.5 * meta.seq_len) == pad:
        assert torch.equal(auto.layout.block_mask(), want)
    got = plan_mask_in_input_order(plan, 4, 2)
    image = slice(meta.image_start, meta.image_start + n)
    kept = cmap.gather(2, q_labels[..., None].expand(-1, -1, -1, 9))  # [B, H, N, Ck]
    kept = kept.gather(3, k_labels.repeat_interleave(2, 1)[:, :, None, :].expand(-1, -1, n, -1))
    # every (query, key) pair SVG2 keeps is attended, and a query attends only keys of clusters its cluster keeps
    # or keys sharing a key block with one (the block-level approximation is on the key side only)
    assert bool(got[:, :, image, image][kept].all())
    assert bool(got[:, :, text_positions(meta)].all()) and bool(got[:, :, :, text_positions(meta)].all())
    assert 0.0 < plan.cluster_density() < 0.5 and (plan.layout.density() < 0.95 or not pad)


@pytest.mark.parametrize(("grid", "text", "position", "top_p", "min_ratio"), [
    ((3, 5, 7), 0, "none", 0.6, 0.0), ((2, 5, 6), 9, "prefix", 0.8, 0.0), ((3, 4, 5), 20, "suffix", 0.5, 0.5),
])
def test_svg2_top_p_budget_keeps_key_blocks_by_their_mass(grid, text, position, top_p, min_ratio):
    """With cluster probabilities, each query cluster keeps whole key blocks best first by the mass its tokens
    carry (cluster mass / cluster size per key), until top_p (the crossing block included) and at least
    min_ratio of the latent key blocks; text keys' blocks are kept by all, text rows keep all."""
    meta = make_meta(grid, text, position)
    gen = torch.Generator().manual_seed(4)
    n, block, cq, ck = meta.image_tokens, 16, 5, 9
    q_labels = torch.randint(0, cq, (1, 2, n), generator=gen)
    k_labels = torch.randint(0, ck, (1, 1, n), generator=gen)
    probs = torch.rand(1, 2, cq, ck, generator=gen, dtype=torch.float64) ** 4
    probs /= probs.sum(-1, keepdim=True)
    plan = svg2_plan(q_labels, k_labels, torch.ones(1, 2, cq, ck, dtype=torch.bool), meta, block, pad_queries=True,
                     probs=probs, top_p=top_p, min_ratio=min_ratio)
    keys = sorted(k_labels[0, 0].tolist()) + ["text"] * text
    keys += [None] * (plan.layout.seq_len - len(keys))
    nb = plan.layout.seq_len // block
    sizes = [keys.count(c) for c in range(ck)]
    text_blocks = {j for j in range(nb) if "text" in keys[j * block:(j + 1) * block]}
    got = plan.layout.block_mask()[0]
    for h in range(2):
        expected_rows = []
        for c in range(cq):
            mass = [sum(float(probs[0, h, c, x]) / sizes[x] for x in keys[j * block:(j + 1) * block]
                        if x not in (None, "text")) for j in range(nb)]
            kept, total = set(), 0.0
            for j in sorted(range(nb), key=lambda j: -mass[j]):
                if total > top_p and len(kept) >= max(1, int(min_ratio * -(-n // block))):
                    break
                kept.add(j)
                total += mass[j]
            assert total >= top_p - 1e-9 and abs(float(plan.kept_mass[0, h, c]) - total) < 1e-9
            size = int((q_labels[0, h] == c).sum())
            expected_rows += [kept | text_blocks] * -(-size // block)
        expected_rows += [set(range(nb))] * -(-text // block)
        for i, row in enumerate(expected_rows):
            assert {j for j in range(nb) if got[h, i, j]} == row, (h, i)


def test_svg2_many_small_clusters_are_packed_not_padded():
    meta = make_meta((3, 5, 7))
    labels = torch.arange(meta.image_tokens).repeat(1, 1, 1) % 50  # 50 clusters of 2-3 tokens, blocks of 16
    plan = svg2_plan(labels, labels, torch.eye(50, dtype=torch.bool)[None, None], meta, 16)
    assert plan.layout.seq_len == 112  # 105 tokens in 7 blocks, not 50 padded blocks


def test_svg2_dynamic_map_is_weighted_top_p():
    gen = torch.Generator().manual_seed(2)
    qc, kc = torch.randn(1, 2, 3, 4, generator=gen), torch.randn(1, 2, 7, 4, generator=gen)
    sizes = torch.randint(0, 5, (1, 2, 7), generator=gen)
    got = dynamic_map(qc, kc, sizes, 0.5, 0.6, 0.0)
    for h, i in itertools.product(range(2), range(3)):
        w = [sizes[0, h, j].item() * math.exp(0.5 * float(qc[0, h, i] @ kc[0, h, j])) for j in range(7)]
        probs = [x / sum(w) for x in w]
        order = sorted(range(7), key=lambda j: -probs[j])
        keep, mass = set(), 0.0
        for j in order:
            if mass > 0.6:
                break
            keep.add(j)
            mass += probs[j]
        assert {j for j in range(7) if got[0, h, i, j]} == keep
    assert bool(dynamic_map(qc, kc, sizes, 0.5, 1.0, 0.0).all())
    assert int(dynamic_map(qc, kc, sizes, 0.5, 0.01, 0.5).sum(-1).min()) == 3  # int(0.5 * 7) kept at least


def test_kmeans_converges_to_nearest_centroid_means():
    gen = torch.Generator().manual_seed(3)
    centres = torch.tensor([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]], dtype=torch.float64)
    points = centres.repeat_interleave(20, 0) + 0.1 * torch.randn(60, 2, generator=gen, dtype=torch.float64)
    res = kmeans(points[None], 3, 20)  # strided init picks one point per blob: the blobs come out
    assert res.sizes[0].tolist() == [20, 20, 20]
    fast = kmeans(points[None].float(), 3, 20, score_dtype=torch.bfloat16)  # bf16 products (GPU path)
    assert torch.equal(fast.labels, res.labels)
    # any start ends at a Lloyd fixed point: every label is the nearest centroid, every centroid its cluster's mean
    x = points[torch.randperm(60, generator=gen)][None]
    res = kmeans(x, 3, 50)
    dist = torch.cdist(x[0], res.centroids[0])
    assert torch.equal(res.labels[0], dist.argmin(-1))
    for c in range(3):
        assert torch.allclose(res.centroids[0, c], x[0][res.labels[0] == c].mean(0))


def test_svg2_backend_matches_reference_with_its_own_plan_and_warm_starts(monkeypatch):
    meta = make_meta((3, 5, 6), 7, "prefix", step=1, steps=3, layers=2)
    q, k, v = qkv(meta)
    calls = []
    real = svg2_module.kmeans

    def spy(x, clusters, iters, init=None, **kw):
        calls.append((clusters, iters, init is None))
        return real(x, clusters, iters, init, **kw)

    monkeypatch.setattr(svg2_module, "kmeans", spy)
    backend = SparseVideoGen2Backend({"num_q_centroids": 6, "num_k_centroids": 10, "top_p_kmeans": 0.5,
                                      "min_kc_ratio": 0.0, "kmeans_iter_init": 7, "kmeans_iter_step": 2,
                                      "first_times_fp": 0.34, "first_layers_fp": 0.5})
    assert torch.allclose(backend.forward(q, k, v, scale=0.3, meta=meta.at_step(0), layer=1), dense(q, k, v, 0.3))
    assert torch.allclose(backend.forward(q, k, v, scale=0.3, meta=meta, layer=0), dense(q, k, v, 0.3))
    assert calls == []  # dense step 0 (0.34 * 3 -> 1 step) and dense layer 0 (0.5 * 2 -> 1 layer): no clustering
    out = backend.forward(q, k, v, scale=0.3, meta=meta, layer=1)
    plan = backend.last_plan
    assert plan is not None and plan.layout.density() < 0.95
    allowed = plan_mask_in_input_order(plan, 4, 2)
    assert torch.allclose(out, masked_reference(q, k, v, allowed, 0.3), atol=1e-10)
    backend.forward(q, k, v, scale=0.3, meta=meta.at_step(2), layer=1)  # warm: previous step's centroids
    backend.forward(q, k, v, scale=0.3, meta=meta.at_step(1), layer=1)  # a new generation starts over
    assert calls == [(6, 7, True), (10, 7, True), (6, 2, False), (10, 2, False), (6, 7, True), (10, 7, True)]


def test_svg2_zero_step_kmeans_init_clusters_during_dense_steps(monkeypatch):
    meta = make_meta((3, 4, 5), step=0, steps=4, layers=1)
    q, k, v = qkv(meta)
    calls = []
    real = svg2_module.kmeans
    monkeypatch.setattr(svg2_module, "kmeans", lambda x, c, iters, init=None, **kw: (
        calls.append((iters, init is None)), real(x, c, iters, init, **kw))[1])
    backend = SparseVideoGen2Backend({"num_q_centroids": 4, "num_k_centroids": 4, "first_times_fp": 0.5,
                                      "first_layers_fp": 0.0, "kmeans_iter_init": 6, "zero_step_kmeans_init": True})
    out = backend.forward(q, k, v, scale=0.3, meta=meta, layer=0)  # dense step (2 of 4), but clusters
    assert torch.allclose(out, dense(q, k, v, 0.3)) and backend.last_plan is None
    backend.forward(q, k, v, scale=0.3, meta=meta.at_step(2), layer=0)  # first sparse step starts warm
    assert calls == [(6, True), (6, True), (2, False), (2, False)]


def test_svg2_top_p_one_and_full_fractions_are_dense():
    meta = make_meta((3, 4, 5), 3, "suffix", step=2, steps=3, layers=2)
    q, k, v = qkv(meta)
    for config in ({"top_p_kmeans": 1.0, "num_q_centroids": 4, "num_k_centroids": 4}, {"first_times_fp": 1.0},
                   {"first_layers_fp": 1.0}):
        out = SparseVideoGen2Backend(config).forward(q, k, v, scale=0.3, meta=meta, layer=1)
        assert torch.allclose(out, dense(q, k, v, 0.3), atol=1e-12)


# ------------------------------------------------------------------------------------------ config errors


@pytest.mark.parametrize(("cls", "config", "needle"), [
    (VideoSparseAttentionBackend, {"sparsity": 1.0}, "sparsity must be in [0, 1)"),
    (VideoSparseAttentionBackend, {"sparsity": -0.1}, "sparsity must be in [0, 1)"),
    (VideoSparseAttentionBackend, {"sparsity": "high"}, "'sparsity' for video_sparse_attn must be float"),
    (VMoBABackend, {"spatial_chunk_size": [3]}, "spatial_chunk_size must be 2 positive sizes (H, W)"),
    (VMoBABackend, {"st_chunk_size": [1, 0, 2]}, "st_chunk_size must be 3 positive sizes (T, H, W)"),
    (VMoBABackend, {"temporal_chunk_size": 0}, "temporal_chunk_size must be a positive number of frames"),
    (VMoBABackend, {"st_topk": 0}, "st_topk must be >= 1"),
    (VMoBABackend, {"moba_select_mode": "random"}, "moba_select_mode 'random' is not one of threshold, topk"),
    (VMoBABackend, {"moba_threshold": 0.0}, "moba_threshold must be in (0, 1]"),
    (VMoBABackend, {"moba_threshold": 1.5}, "moba_threshold must be in (0, 1]"),
    (VMoBABackend, {"moba_threshold_type": "rows"}, "moba_threshold_type 'rows' is not one of query_head, block"),
    (VMoBABackend, {"moba_select_mode": "topk", "moba_threshold_type": "block"}, "upstream has no top-k per block"),
    (VMoBABackend, {"temporal_layer": 0, "spatial_layer": 0, "st_layer": 0}, "at least one chunk layer"),
    (VMoBABackend, {"first_full_step": -1}, "first_full_step must be >= 0"),
    (SparseVideoGen2Backend, {"top_p_kmeans": 0.0}, "top_p_kmeans must be in (0, 1]"),
    (SparseVideoGen2Backend, {"min_kc_ratio": 2.0}, "min_kc_ratio must be a fraction in [0, 1]"),
    (SparseVideoGen2Backend, {"num_k_centroids": 0}, "num_k_centroids must be >= 1"),
    (SparseVideoGen2Backend, {"kmeans_iter_step": -2}, "kmeans_iter_step must be >= 0"),
    (SparseVideoGen2Backend, {"centroids": 3}, "unknown key 'centroids'"),
])
def test_bad_config_is_one_clear_error(cls, config, needle):
    with pytest.raises(ConfigError) as info:
        cls(config)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_chunk_larger_than_grid_and_bad_sequence_are_clear_errors():
    meta = make_meta((3, 4, 5), step=0, steps=1)
    q, k, v = qkv(meta)
    backend = VMoBABackend({"first_full_step": 0, "st_chunk_size": [2, 6, 2]})
    with pytest.raises(ConfigError, match=r"st_chunk_size \[2, 6, 2\] does not fit the latent grid"):
        backend.forward(q, k, v, scale=0.3, meta=meta, layer=2)
    with pytest.raises(SglxError, match="sequence of 59 tokens"):
        VideoSparseAttentionBackend({"sparsity": 0.5}).forward(q[:, :59], k[:, :59], v[:, :59], meta=meta)


def test_no_metadata_runs_dense():
    meta = make_meta((3, 4, 5))
    q, k, v = qkv(meta)
    for backend in (VideoSparseAttentionBackend({"sparsity": 0.9}), VMoBABackend({"first_full_step": 0}),
                    SparseVideoGen2Backend({"first_times_fp": 0.0, "first_layers_fp": 0.0})):
        assert torch.allclose(backend.forward(q, k, v, scale=0.3, meta=None, layer=5), dense(q, k, v, 0.3))


# ------------------------------------------------------------------------------------------- end to end


@pytest.mark.parametrize(("name", "config", "sparse_steps"), [
    ("video_sparse_attn", "sparsity=0.5", {0, 1}),
    ("vmoba_attn", json.dumps({"first_full_step": 1, "temporal_chunk_size": 1, "spatial_chunk_size": [2, 4]}), {1}),
    ("sparse_video_gen_2_attn", "first_times_fp=0.5,num_q_centroids=4,num_k_centroids=8,top_p_kmeans=0.5,"
                                "min_kc_ratio=0.0,kmeans_iter_init=5", {1}),
])
def test_tiny_wan_end_to_end_switches_dense_and_sparse_per_step(tmp_path, monkeypatch, name, config, sparse_steps):
    pytest.importorskip("diffusers")
    from diffusion_test_utils import make_tiny_wan
    from sglx.attention.registry import find
    from sglx.diffusion.engine import DiffusionEngine
    from sglx.diffusion.request import DiffusionRequest
    from sglx.llm.engine_config import EngineConfig

    cls = find(name, "diffusion", "dit").load()  # type: ignore[union-attr]
    original = cls.forward
    seen: list[tuple[int, int, float]] = []

    def spy(self, q, k, v, *, scale=None, meta=None, layer=0):
        out = original(self, q, k, v, scale=scale, meta=meta, layer=layer)
        seen.append((meta.step_index, layer, (out - self.forward_dense(q, k, v, scale=scale)).abs().max().item()))
        return out

    monkeypatch.setattr(cls, "forward", spy)
    wan = make_tiny_wan(tmp_path / "wan", head_dim=16, heads=2, layers=2)
    engine = DiffusionEngine(EngineConfig(model_path=str(wan), device="cpu", attention_backend=name,
                                          attention_backend_config=config))
    assert engine.attention.name == name
    req = DiffusionRequest(prompt="a red circle", height=32, width=64, num_frames=5, num_inference_steps=2,
                           guidance_scale=1.0, seed=1)
    out = engine.generate(req)
    assert out.frames.shape == (5, 32, 64, 3) and torch.isfinite(torch.as_tensor(out.frames).float()).all()
    assert sorted((step, layer) for step, layer, _ in seen) == [(0, 0), (0, 1), (1, 0), (1, 1)]  # grid (3, 4, 8)
    for step, layer, diff in seen:
        if step in sparse_steps:
            assert diff > 1e-4, (step, layer, diff)  # really sparse: differs from dense attention
        else:
            assert diff == 0.0, (step, layer, diff)


@pytest.mark.parametrize(("name", "config", "needle"), [
    ("video_sparse_attn", "sparsity=1.0", "video_sparse_attn sparsity must be in [0, 1)"),
    ("vmoba_attn", "first_full_step=0,st_layer=1,temporal_layer=0,spatial_layer=0,st_chunk_size=[1,9,1]",
     "st_chunk_size [1, 9, 1] does not fit the latent grid"),
    ("sparse_video_gen_2_attn", '{"top_p_kmeans": 0}', "top_p_kmeans must be in (0, 1]"),
])
def test_bad_config_through_the_cli_is_one_line_exit_2(tmp_path, name, config, needle):
    pytest.importorskip("diffusers")
    from typer.testing import CliRunner

    from diffusion_test_utils import make_tiny_wan
    from sglx.cli.app import app

    wan = make_tiny_wan(tmp_path / "wan", head_dim=16, heads=2, layers=1)
    out = tmp_path / "never.png"
    result = CliRunner().invoke(app, ["generate", "--model-path", str(wan), "-p", "x", "--height", "32", "--width",
                                      "32", "--num-frames", "1", "--num-inference-steps", "1", "--attention-backend",
                                      name, "--attention-backend-config", config, "--output", str(out)])
    assert result.exit_code == 2, result.output
    assert needle in result.output and "Traceback" not in result.output, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], result.output
    assert not out.exists()


def test_backends_through_the_triton_kernel_under_the_interpreter():
    from triton_interpreted.launch import run_interpreted

    run_interpreted("sparse_backend_cases.py")


def test_vsa_topk_kernel_under_the_interpreter():
    from triton_interpreted.launch import run_interpreted

    run_interpreted("topk_rows_cases.py")


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("name", ["video_sparse_attn", "vmoba_attn", "sparse_video_gen_2_attn"])
def test_gpu_bf16_matches_float64_under_the_same_plan(name, dim):
    """On a Wan-like odd grid (no dimension divides the cubes/chunks) with a text prefix: the Triton route in
    bf16 against float64 masked attention with the plan the backend made (relative error <= 2e-2)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from sglx.attention.diffusion.sparse.reference import masked_attention
    from sglx.attention.diffusion.sparse.svg2 import permute, unpermute
    from sglx.attention.diffusion.sparse.tiled import from_order, to_order

    meta = DiTAttnMetadata(grid=(7, 15, 26), num_heads=4, head_dim=dim, text_tokens=77, text_position="prefix",
                           step_index=3, num_steps=4, num_layers=3)
    gen = torch.Generator().manual_seed(0)

    def clustered(heads):  # tokens around 40 centres per head: structure SVG2's clusters can find
        centres = torch.randn(heads, 40, dim, generator=gen) * 2
        which = torch.randint(0, 40, (2, meta.seq_len, heads), generator=gen)
        noise = torch.randn(2, meta.seq_len, heads, dim, generator=gen)
        return (centres[torch.arange(heads), which] + noise).to("cuda", torch.bfloat16)

    q, k = clustered(4), clustered(2)
    v = torch.randn(2, meta.seq_len, 2, dim, generator=gen).to("cuda", torch.bfloat16)
    scale = dim ** -0.5
    if name == "video_sparse_attn":
        got = VideoSparseAttentionBackend({"sparsity": 0.75}).forward(q, k, v, scale=scale, meta=meta, layer=2)
        plan = vsa_plan(q, k, meta, 0.75, scale)
        want = from_order(masked_attention(*(to_order(t.double(), plan.order) for t in (q, k, v)), plan.layout,
                                           scale), plan.order)
    elif name == "vmoba_attn":
        backend = VMoBABackend({"first_full_step": 0})
        got = backend.forward(q, k, v, scale=scale, meta=meta, layer=2)
        plan = vmoba_plan(q, k, meta, backend.vmoba, "st")
        want = from_order(masked_attention(*(to_order(t.double(), plan.order) for t in (q, k, v)), plan.layout,
                                           scale), plan.order)
    else:
        backend = SparseVideoGen2Backend({"num_q_centroids": 100, "num_k_centroids": 300})
        got = backend.forward(q, k, v, scale=scale, meta=meta, layer=2)
        p = backend.last_plan
        assert p is not None
        want = unpermute(masked_attention(permute(q.double(), p.q_index), permute(k.double(), p.k_index),
                                          permute(v.double(), p.k_index), p.layout, scale), p.q_slot)
        plan = p
    # SVG2 keeps key blocks by a top-p budget: 0.47 of the block pairs here (0.91 when every block holding any
    # kept key cluster was attended, for SVG2's own 0.13)
    assert plan.layout.density() < (0.7 if name == "sparse_video_gen_2_attn" else 0.9)
    err = ((got.double() - want).norm() / want.norm()).item()
    assert err <= 2e-2, err


@pytest.mark.parametrize(("name", "config", "size", "grid"), [
    # VSA packs the edge cubes of 1x4x8 into one 64-token block (dense): 1x8x16 makes two blocks
    ("video_sparse_attn", "sparsity=0.5", (128, 256), (1, 8, 16)),
    ("vmoba_attn", "first_full_step=1,spatial_chunk_size=[2,2],st_chunk_size=[1,2,4]", (64, 128), (1, 4, 8)),
    ("sparse_video_gen_2_attn", "first_times_fp=0.5,num_q_centroids=3,num_k_centroids=6,top_p_kmeans=0.4,"
                                "min_kc_ratio=0.0,first_layers_fp=0.0", (64, 128), (1, 4, 8)),
])
def test_tiny_flux_end_to_end_with_a_text_prefix(tmp_path, monkeypatch, name, config, size, grid):
    """FLUX's joint attention puts the text tokens before the image tokens: they attend and are attended fully."""
    pytest.importorskip("diffusers")
    from diffusion_test_utils import make_tiny_flux
    from sglx.attention.registry import find
    from sglx.diffusion.engine import DiffusionEngine
    from sglx.diffusion.request import DiffusionRequest
    from sglx.llm.engine_config import EngineConfig

    cls = find(name, "diffusion", "dit").load()  # type: ignore[union-attr]
    original = cls.forward
    seen: list[tuple[int, tuple, int, float]] = []

    def spy(self, q, k, v, *, scale=None, meta=None, layer=0):
        out = original(self, q, k, v, scale=scale, meta=meta, layer=layer)
        diff = (out - self.forward_dense(q, k, v, scale=scale)).abs().max().item()
        seen.append((meta.step_index, meta.grid, meta.text_tokens, diff))
        return out

    monkeypatch.setattr(cls, "forward", spy)
    flux = make_tiny_flux(tmp_path / "flux")
    engine = DiffusionEngine(EngineConfig(model_path=str(flux), device="cpu", attention_backend=name,
                                          attention_backend_config=config))
    req = DiffusionRequest(prompt="a red circle", height=size[0], width=size[1], num_inference_steps=2,
                           guidance_scale=3.5, seed=2)
    out = engine.generate(req)
    assert np.isfinite(np.asarray(out.frames, dtype=np.float32)).all()
    assert {g for _, g, _, _ in seen} == {grid} and min(t for _, _, t, _ in seen) > 0
    assert len(seen) == 6  # 3 layers x 2 steps
    dense_step = [d for s, _, _, d in seen if s == 0]
    sparse_step = [d for s, _, _, d in seen if s == 1]
    if name != "video_sparse_attn":  # VSA has no dense warm-up
        assert max(dense_step) == 0.0
    assert max(sparse_step) > 1e-4


def test_backends_show_the_route_and_density_of_their_last_sparse_call():
    meta = make_meta((5, 6, 7), step=1, steps=2, layers=2)
    q, k, v = qkv(meta)
    for backend in (VideoSparseAttentionBackend({"sparsity": 0.7}),
                    VMoBABackend({"first_full_step": 1, "temporal_chunk_size": 1}),
                    SparseVideoGen2Backend({"num_q_centroids": 4, "num_k_centroids": 8, "top_p_kmeans": 0.5,
                                            "first_times_fp": 0.0, "first_layers_fp": 0.0})):
        assert backend.route is None and backend.last_density is None
        backend.forward(q, k, v, scale=0.3, meta=meta, layer=0)
        assert backend.route == "reference" and "cpu" in backend.route_why
        assert 0.0 < backend.last_density < 0.95


@pytest.mark.parametrize("name", ["sliding_tile_attn", "video_sparse_attn", "vmoba_attn", "sparse_video_gen_2_attn"])
def test_doctor_check_runs_a_real_sparse_call(name, monkeypatch):
    """doctor --check's sparse problem: the backend with step metadata against float64 under its own plan's mask,
    in input order; a wrong mask mapping or a kernel error shows as a large error, a dense run as an error."""
    from sglx.attention import sparse_checks
    from sglx.attention.registry import find

    spec = find(name, "diffusion", "dit")
    err, _, shape = sparse_checks.sparse_problem(spec, torch.device("cpu"), torch.float32, lambda d: None)
    assert err < 1e-4 and "route reference" in shape, (err, shape)
    low, high = (float(x) for x in shape.split("density ")[1].split(",")[0].split("-"))
    assert 0.0 < low <= high < 1.0
    if name == "video_sparse_attn":  # a config that leaves nothing sparse is reported, not passed
        monkeypatch.setattr(sparse_checks, "_configs", lambda cuda: {name: ({"sparsity": 0.0}, {})})
        with pytest.raises(RuntimeError, match="not exercised"):
            sparse_checks.sparse_problem(spec, torch.device("cpu"), torch.float32, lambda d: None)
    if name == "sliding_tile_attn":  # a backend whose output ignores its mask fails the comparison
        from sglx.attention.diffusion.sparse.sliding_tile import SlidingTileAttentionBackend

        monkeypatch.setattr(SlidingTileAttentionBackend, "forward", lambda self, q, k, v, scale=None, meta=None,
                            layer=0: self.forward_dense(q, k, v, scale=scale))
        err, _, _ = sparse_checks.sparse_problem(spec, torch.device("cpu"), torch.float32, lambda d: None)
        assert err > 1e-2


def test_vmoba_chunk_blocks_prefer_64_token_tiles_on_cuda() -> None:
    """On CUDA a chunk gets 64-token blocks when that pads it by at most a third (96-token chunks: 128 slots, the
    64x64 TMA tiles measured 3x faster per unit of work than 32-token tiles); else the old 1/16 rule; CPU: 16."""
    from sglx.attention.diffusion.sparse.vmoba import chunk_block

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert chunk_block(96, cuda) == 64  # 4x6x4 spatio-temporal chunks
    assert chunk_block(1560, cuda) == 64  # 1,600 slots: 2.6% padding
    assert chunk_block(40, cuda) == 64  # 64 slots against 48 with 16-token blocks: exactly a third more
    assert chunk_block(20, cuda) == 32  # 64 would double 32: the 1/16 rule picks 32 (no padding beyond 16's)
    assert chunk_block(10, cuda) == 16  # 32 would double 16
    assert chunk_block(96, cpu) == 16


def test_wan_keeps_cube_order_across_blocks_and_matches_the_per_layer_reorder():
    """VSA's packed cube order is a pure permutation: a Wan DiT keeps its tokens in it for the whole forward
    (sglx.diffusion.step_order) and every VSA layer skips its gathers. Same output as reordering in every layer."""
    pytest.importorskip("diffusers")
    from diffusion_test_utils import step_order_models
    from sglx.attention.diffusion.metadata import dit_step
    from sglx.attention.diffusion.sparse.tile_order import step_tile_order

    class Spied(VideoSparseAttentionBackend):
        seen: list = []

        def run(self, q, k, v, layout, scale):
            self.seen.append(step_tile_order() is not None)
            return super().run(q, k, v, layout, scale)

    vsa = Spied({"sparsity": 0.5})  # grid 3x4x16: four 3x4x4 edge cubes packed into three blocks, two kept
    kept, per_layer, model, inputs = step_order_models(vsa)
    meta = DiTAttnMetadata(grid=(3, 4, 16), num_heads=2, head_dim=16, num_layers=3)
    with torch.no_grad(), dit_step(meta):
        got = kept(**inputs)[0]
        assert vsa.seen == [True] * 3 and step_tile_order() is None  # every layer, and reset after
        want = per_layer(**inputs)[0]
        assert vsa.seen == [True] * 3 + [False] * 3
        dense = model(**inputs)[0]
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    assert (got - dense).abs().max() > 1e-3  # one of three blocks dropped per query block: really sparse
