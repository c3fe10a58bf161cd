"""sliding_tile_attn: tile order, STA layout vs a brute-force token mask, mask strategy files, backend vs the
masked reference, and end to end through the tiny Wan pipeline (CPU path: masked reference)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sglx.attention.diffusion.metadata import DiTAttnMetadata
from sglx.attention.diffusion.sparse.sliding_tile import SlidingTileAttentionBackend, sta_layout
from sglx.attention.diffusion.sparse.sta_strategy import load_strategy, uniform_strategy, write_uniform_strategy
from sglx.attention.diffusion.sparse.tile_order import tile_order
from sglx.errors import ConfigError


def brute_force_sta(grid, tile, window, text, prefix):
    """Token-level STA in input order: i attends j iff j's tile lies in i's window (centre clamped inside the
    grid of tiles, as FastVideo's reference); text tokens attend and are attended by everything."""
    gt, gh, gw = grid
    tiles = [-(-g // t) for g, t in zip(grid, tile)]
    t, h, w = torch.meshgrid(torch.arange(gt), torch.arange(gh), torch.arange(gw), indexing="ij")
    coords = torch.stack([t.reshape(-1) // tile[0], h.reshape(-1) // tile[1], w.reshape(-1) // tile[2]], 1)
    half = torch.tensor(window) // 2
    centre = torch.minimum(torch.maximum(coords, half), torch.tensor(tiles) - 1 - half)
    video = ((centre[:, None] - coords[None]).abs() <= half).all(-1)
    n = video.shape[0] + text
    full = torch.ones(n, n, dtype=torch.bool)
    sl = slice(text, n) if prefix else slice(0, video.shape[0])
    full[sl, sl] = video
    return full


@pytest.mark.parametrize(("grid", "tile", "window", "text", "prefix", "block"), [
    ((5, 7, 9), (2, 3, 4), (3, 3, 3), 0, True, 16),     # nothing divides: every edge tile padded
    ((4, 6, 8), (2, 3, 4), (1, 3, 2), 0, True, 16),     # divides; even window
    ((3, 5, 6), (2, 2, 2), (2, 1, 3), 21, True, 16),    # FLUX-like text prefix (partial text block)
    ((3, 4, 5), (3, 2, 2), (1, 2, 3), 7, False, 32),    # text suffix, tiles smaller than a block
    ((2, 4, 4), (2, 4, 4), (1, 1, 1), 0, True, 32),     # one tile: dense, identity order
])
def test_layout_equals_brute_force_token_mask(grid, tile, window, text, prefix, block):
    order = tile_order(grid, tile, text, prefix, block)
    seq = grid[0] * grid[1] * grid[2] + text
    assert torch.equal(order.gather[order.scatter], torch.arange(seq))
    layout = sta_layout(order, (window,))
    perm = layout.token_mask()[0, 0]  # [slots, slots] in tile order
    got = perm[order.scatter][:, order.scatter]
    assert torch.equal(got, brute_force_sta(grid, tile, window, text, prefix))
    assert layout.kv_indices.shape[:2] == (1, 1)


def test_per_head_windows_give_per_head_rows():
    order = tile_order((4, 6, 6), (2, 2, 2), 0, True, 16)
    layout = sta_layout(order, ((1, 1, 1), (3, 3, 3)))
    assert layout.kv_indices.shape[1] == 2
    assert layout.density() < 1.0
    for head, window in enumerate(((1, 1, 1), (3, 3, 3))):
        want = brute_force_sta((4, 6, 6), (2, 2, 2), window, 0, True)
        got = layout.token_mask()[0, head][order.scatter][:, order.scatter]
        assert torch.equal(got, want)


def _strategy(tmp_path: Path, layers: int, heads: int, window=(1, 1, 1)) -> Path:
    return write_uniform_strategy(tmp_path / "sta.json", layers, heads, window)


@pytest.mark.parametrize(("text", "position"), [(0, "none"), (5, "prefix")])
def test_backend_matches_masked_reference_in_input_order(tmp_path, text, position):
    torch.manual_seed(0)
    backend = SlidingTileAttentionBackend({"mask_strategy_file_path": str(_strategy(tmp_path, 2, 3)),
                                           "skip_time_steps": 1}, tile=(2, 2, 2))
    meta = DiTAttnMetadata(grid=(3, 5, 4), num_heads=3, head_dim=8, text_tokens=text, text_position=position,
                           step_index=1, num_steps=2)
    q, k, v = (torch.randn(2, meta.seq_len, h, 8, dtype=torch.float64) for h in (3, 1, 1))
    out = backend.forward(q, k, v, scale=0.4, meta=meta, layer=1)
    allowed = brute_force_sta(meta.grid, (2, 2, 2), (1, 1, 1), text, True)
    scores = torch.einsum("bqhd,bkd->bhqk", q, k[:, :, 0]) * 0.4
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    want = torch.einsum("bhqk,bkd->bqhd", probs, v[:, :, 0])
    assert torch.allclose(out, want, atol=1e-10)
    dense = backend.forward(q, k, v, scale=0.4, meta=meta.at_step(0), layer=1)  # a skipped step: dense
    assert torch.allclose(dense, backend.forward_dense(q, k, v, scale=0.4))
    assert not torch.allclose(dense, out)


@pytest.mark.parametrize(("content", "needle"), [
    ("{not json", "not valid JSON"),
    ("[]", "non-empty JSON object"),
    ('{"0_1": [1, 1, 1]}', "key '0_1' is not '<step>_<layer>_<head>'"),
    ('{"0_3_1": [1, 1]}', "key '0_3_1' (layer 3, head 1) must be a window"),
    ('{"0_0_0": [1, 0, 1]}', "three positive integers"),
])
def test_malformed_strategy_file_is_one_clear_error(tmp_path, content, needle):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=None) as info:
        load_strategy(path)
    assert needle in str(info.value) and info.value.key == "mask_strategy_file_path"


def test_missing_file_missing_key_window_too_large_and_mode(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        SlidingTileAttentionBackend({"mask_strategy_file_path": str(tmp_path / "nope.json")})
    with pytest.raises(ConfigError, match="STA_searching needs mask_strategy_file_path"):
        SlidingTileAttentionBackend({"sta_mode": "STA_searching"})
    path = _strategy(tmp_path, 1, 2)
    with pytest.raises(ConfigError, match="sta_mode 'STA_tuning' is not supported"):
        SlidingTileAttentionBackend({"mask_strategy_file_path": str(path), "sta_mode": "STA_tuning"})
    backend = SlidingTileAttentionBackend({"mask_strategy_file_path": str(path), "skip_time_steps": 0}, tile=(2, 2, 2))
    meta = DiTAttnMetadata(grid=(2, 4, 4), num_heads=2, head_dim=8)
    q = torch.randn(1, 32, 2, 8)
    with pytest.raises(ConfigError, match=r"no key '0_1_0' \(step 0, layer 1, head 0\)"):
        backend.forward(q, q, q, meta=meta, layer=1)
    path.write_text(json.dumps(uniform_strategy(1, 2, (1, 3, 1))))
    big = SlidingTileAttentionBackend({"mask_strategy_file_path": str(path), "skip_time_steps": 0}, tile=(2, 2, 2))
    with pytest.raises(ConfigError, match=r"window \[1, 3, 1\] of layer 0 head 0 is larger than the grid"):
        big.forward(q, q, q, meta=meta, layer=0)


def test_strategy_steps_after_the_last_reuse_it_and_earlier_steps_are_an_error(tmp_path):
    data = {**uniform_strategy(1, 1, (1, 1, 1), step=3), **uniform_strategy(1, 1, (3, 3, 3), step=5)}
    path = tmp_path / "s.json"
    path.write_text(json.dumps(data))
    strategy = load_strategy(path)
    assert strategy.layer_windows(4, 0, 1) == ((1, 1, 1),)
    assert strategy.layer_windows(40, 0, 1) == ((3, 3, 3),)
    with pytest.raises(ConfigError, match="no windows for step 2"):
        strategy.layer_windows(2, 0, 1)


def test_tiny_wan_end_to_end_uses_the_pipeline_metadata(tmp_path, monkeypatch):
    pytest.importorskip("diffusers")
    from diffusion_test_utils import make_tiny_wan
    from sglx.diffusion.engine import DiffusionEngine
    from sglx.diffusion.request import DiffusionRequest
    from sglx.llm.engine_config import EngineConfig

    wan = make_tiny_wan(tmp_path / "wan", head_dim=16, heads=2, layers=2)
    path = write_uniform_strategy(tmp_path / "sta.json", 2, 2, (1, 1, 1))
    cfg = json.dumps({"mask_strategy_file_path": str(path), "skip_time_steps": 1})
    seen = []
    original = SlidingTileAttentionBackend.attend

    def spy(self, q, k, v, meta, windows, **kw):
        out = original(self, q, k, v, meta, windows, **kw)
        seen.append((meta.grid, meta.step_index, windows, (out - self.forward_dense(q, k, v)).abs().max().item()))
        return out

    monkeypatch.setattr(SlidingTileAttentionBackend, "attend", spy)
    # 6x8x8 tiles would make this 3x4x8 grid one tile (dense); 1x2x2 tiles give 3x2x4 tiles, window 1x1x1
    monkeypatch.setattr(SlidingTileAttentionBackend, "default_tile", (1, 2, 2))
    engine = DiffusionEngine(EngineConfig(model_path=str(wan), device="cpu", attention_backend="sliding_tile_attn",
                                          attention_backend_config=cfg))
    assert engine.attention.name == "sliding_tile_attn"
    req = DiffusionRequest(prompt="a red circle", height=32, width=64, num_frames=5, num_inference_steps=2,
                           guidance_scale=1.0, seed=1)
    out = engine.generate(req)
    assert out.frames.shape == (5, 32, 64, 3)
    assert len(seen) == 2 and {s[1] for s in seen} == {1}  # two layers; step 0 ran dense (skip_time_steps=1)
    assert seen[0][0] == (3, 4, 8) and seen[0][2] == ((1, 1, 1), (1, 1, 1))
    assert min(s[3] for s in seen) > 1e-4  # really sparse: differs from dense attention


def test_mask_search_writes_the_smallest_window_within_tolerance(tmp_path):
    out = tmp_path / "searched.json"
    backend = SlidingTileAttentionBackend({"mask_strategy_file_path": str(out), "sta_mode": "STA_searching",
                                           "skip_time_steps": 1}, tile=(1, 2, 2))
    backend.candidates = ((1, 1, 1), (3, 3, 3), (9, 9, 9))  # the last one covers the 3x2x2-tile grid: exact
    meta = DiTAttnMetadata(grid=(3, 4, 4), num_heads=2, head_dim=8, step_index=1, num_steps=3, num_layers=1)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 48, 2, 8, dtype=torch.float64) for _ in range(3))
    dense = backend.forward_dense(q, k, v)
    assert torch.equal(backend.forward(q, k, v, meta=meta, layer=0), dense)  # searching returns dense
    backend.forward(q, k, v, meta=meta.at_step(2), layer=0)
    strategy = json.loads(out.read_text())
    assert set(strategy) == {"1_0_0", "1_0_1", "2_0_0", "2_0_1"}
    assert strategy["1_0_0"] == [3, 2, 2]  # (9, 9, 9) clamped to the grid of tiles: the only exact window
    backend.search.write(out, tolerance=10.0)
    assert json.loads(out.read_text())["2_0_1"] == [1, 1, 1]
    inference = SlidingTileAttentionBackend({"mask_strategy_file_path": str(out), "skip_time_steps": 1},
                                            tile=(1, 2, 2))
    assert inference.forward(q, k, v, meta=meta, layer=0).shape == q.shape


def test_without_a_strategy_file_every_head_uses_the_default_window_cut_to_the_grid():
    backend = SlidingTileAttentionBackend({"skip_time_steps": 0}, tile=(1, 2, 2))  # doctor --check builds it so
    meta = DiTAttnMetadata(grid=(5, 4, 4), num_heads=2, head_dim=8)
    seen = []
    original = backend.attend
    backend.attend = lambda *a, **kw: seen.append(a[4]) or original(*a, **kw)
    q = torch.randn(1, 80, 2, 8, dtype=torch.float64)
    backend.forward(q, q, q, meta=meta, layer=7)
    assert seen == [((3, 2, 2), (3, 2, 2))]
    assert torch.allclose(backend.forward(q, q, q, meta=None), backend.forward_dense(q, q, q))


@pytest.mark.gpu
@pytest.mark.parametrize("route", ["triton", "fa4"])
@pytest.mark.parametrize(("grid", "window", "text", "position", "dim"), [
    ((5, 13, 19), (1, 1, 3), 0, "none", 128),      # nothing divides by 6x8x8: padded tiles
    ((6, 24, 24), (1, 3, 1), 77, "prefix", 64),    # FLUX-like text prefix (partial text block)
])
def test_gpu_backend_matches_float64_in_input_order(tmp_path, monkeypatch, route, grid, window, text, position,
                                                    dim):
    from sglx.attention.diffusion.sparse.fa4_route import fa4_supports
    from sglx.attention.diffusion.sparse.routes import ENV

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    monkeypatch.setenv(ENV, route)
    path = write_uniform_strategy(tmp_path / "s.json", 1, 4, window)
    backend = SlidingTileAttentionBackend({"mask_strategy_file_path": str(path), "skip_time_steps": 0})
    meta = DiTAttnMetadata(grid=grid, num_heads=4, head_dim=dim, text_tokens=text, text_position=position)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, meta.seq_len, 4, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    if route == "fa4":
        order = tile_order(grid, (6, 8, 8), text, True, 128)
        from sglx.attention.diffusion.sparse.sliding_tile import _cached_layout

        why = fa4_supports(q, _cached_layout(order, (window,), "cuda"))
        if why:
            pytest.skip(why)
    got = backend.forward(q, k, v, meta=meta, layer=0)
    assert backend.route == route
    tile = tuple(min(t, g) for t, g in zip((6, 8, 8), grid))
    allowed = brute_force_sta(grid, tile, window, text, True).cuda()
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * dim ** -0.5
    want = torch.einsum("bhqk,bkhd->bqhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v.double())
    assert ((got.double() - want).norm() / want.norm()).item() <= 2e-2


def test_strategy_writer_command(tmp_path, capsys):
    from sglx.attention.diffusion.sparse.sta_strategy import main

    out = tmp_path / "wan.json"
    assert main([str(out), "--layers", "2", "--heads", "3", "--window", "1,3,5"]) == 0
    strategy = load_strategy(out)
    assert strategy.layer_windows(20, 1, 3) == ((1, 3, 5),) * 3
    with pytest.raises(SystemExit):
        main([str(out), "--layers", "2", "--heads", "3", "--window", "1,3"])
    assert "three integers" in capsys.readouterr().err


def test_wan_keeps_tile_order_across_blocks_and_matches_the_per_layer_reorder(tmp_path, monkeypatch):
    """sglx.diffusion.step_order: the hidden states and rotary tables move into tile order once before the first
    block and back after the last; every STA layer then skips its gathers. Same output as the per-layer path."""
    pytest.importorskip("diffusers")
    from diffusion_test_utils import step_order_models
    from sglx.attention.diffusion.metadata import dit_step
    from sglx.attention.diffusion.sparse import sliding_tile

    path = write_uniform_strategy(tmp_path / "sta.json", 3, 2, (1, 1, 1))
    sta = SlidingTileAttentionBackend({"mask_strategy_file_path": str(path), "skip_time_steps": 0}, tile=(1, 2, 8),
                                      block=16)  # 16-token tiles on 16-token blocks: a pure permutation
    kept, per_layer, model, inputs = step_order_models(sta)
    meta = DiTAttnMetadata(grid=(3, 4, 16), num_heads=2, head_dim=16, num_layers=3)
    seen = []
    original = sliding_tile.run_block_sparse

    def spy(q, k, v, layout, scale, route):
        seen.append(sliding_tile.step_tile_order() is not None)
        return original(q, k, v, layout, scale, route)

    monkeypatch.setattr(sliding_tile, "run_block_sparse", spy)
    with torch.no_grad(), dit_step(meta):
        got = kept(**inputs)[0]
        assert seen == [True] * 3 and sliding_tile.step_tile_order() is None  # every layer, and reset after
        want = per_layer(**inputs)[0]
        assert seen == [True] * 3 + [False] * 3
        dense = model(**inputs)[0]
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    assert (got - dense).abs().max() > 1e-3  # STA 1x1x1 tiles: really sparse, not dense attention
