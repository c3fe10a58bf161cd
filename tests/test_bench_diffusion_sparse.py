"""`sglx bench diffusion --attention-backend ...` on CPU: sparse backends side by side with dense ones.

The bench's own check (float64 under the mask the backend's plan chose, on sampled rows) is only as good as
its mask in input order: `rows_mask` is compared here with doctor's independently written full-matrix mask
(sglx.attention.sparse_checks), and a backend that returns a wrong result must show as an untimed failure
with exit code 1.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from sglx.attention.diffusion.metadata import DiTAttnMetadata
from sglx.attention.diffusion.sparse.sta_strategy import write_uniform_strategy
from sglx.attention.sparse_checks import _input_order_mask
from sglx.bench.diffusion_sparse import BackendRequest, canvas_from_video, clustered, pair_backends
from sglx.bench.sparse_plan import plan_view, rows_mask
from sglx.cli.app import app
from sglx.errors import SglxError

pytestmark = pytest.mark.usefixtures("single_torch_thread")
FAST = ["--device", "cpu", "--warmup-ms", "0", "--rep-ms", "1"]
SPARSE = ("sliding_tile_attn", "video_sparse_attn", "vmoba_attn", "sparse_video_gen_2_attn")


def _strategy(tmp_path: Path) -> str:
    return str(write_uniform_strategy(tmp_path / "sta.json", 30, 2, (1, 1, 1)))


def _run(tmp_path: Path, *args: str) -> tuple[int, dict, str]:
    out = tmp_path / "r.json"
    result = CliRunner().invoke(app, ["bench", "diffusion", *FAST, "--heads", "2", "--head-dim", "32",
                                      "--output", str(out), "--json", *args])
    report = json.loads(out.read_text()) if out.exists() else {}
    return result.exit_code, report, result.output


def test_sparse_backends_side_by_side_with_dense_and_flex_at_the_same_mask(tmp_path: Path) -> None:
    # 6x16x8 latent grid: FastVideo's 6x8x8 tiles make 1x2x1 tiles, so STA window 1x1x1 keeps half the pairs
    code, report, output = _run(
        tmp_path, "--canvas", "6x16x8", "--attention-backend", "torch_sdpa,video_sparse_attn",
        "--attention-backend", "vmoba_attn", "--attention-backend", "sparse_video_gen_2_attn,sliding_tile_attn",
        "--attention-backend-config", "video_sparse_attn:sparsity=0.75",
        "--attention-backend-config", f"sliding_tile_attn:mask_strategy_file_path={_strategy(tmp_path)}",
        "--attention-backend-config", "sparse_video_gen_2_attn:num_q_centroids=8,num_k_centroids=16,top_p_kmeans=0.7")
    assert code == 0, output
    sparse = report["sparse"]
    assert "6x16x8 = 768 tokens" in sparse["label"] and sparse["dense_baseline"] == "sdpa"
    rows = sparse["rows"]
    by_name = {r["backend"].split(" [")[0]: r for r in rows if r["kind"] != "anchor"}
    assert set(by_name) == {"sdpa", "torch_sdpa", *SPARSE}
    assert by_name["video_sparse_attn"]["backend"] == "video_sparse_attn [sparsity=0.75]"
    assert by_name["sdpa"]["x_dense"] == 1.0
    dense = by_name["torch_sdpa"]
    assert dense["ok"] and dense["density"] == 1.0 and dense["rel_err_vs_dense"] < 1e-5
    for name in SPARSE:
        row = by_name[name]
        assert row["ok"] and row["max_abs_err"] <= row["tolerance"] and row["median_ms"] > 0, row
        assert 0.0 < row["density"] < 1.0, row
        assert row["rel_err_vs_dense"] > 1e-3, row  # a sparse mask really changes the output
        flex = next(r for r in rows if r["kind"] == "anchor" and r["backend"] == "flex same mask"
                    and r["of"] == row["backend"])
        assert flex["ok"] and flex["density"] == row["density"], flex
        assert flex["rel_err_vs_dense"] == pytest.approx(row["rel_err_vs_dense"], rel=1e-3)
    assert by_name["video_sparse_attn"]["density"] == pytest.approx(0.25)
    assert by_name["sliding_tile_attn"]["density"] == pytest.approx(0.5)
    upstream = [r for r in rows if r["backend"] == "fastvideo-kernel"]
    assert {r["of"].split(" [")[0] for r in upstream} == {"video_sparse_attn", "sliding_tile_attn"}
    assert all(r.get("skipped") or r["ok"] for r in upstream)


def test_a_wrong_sparse_result_is_an_untimed_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sglx.attention.diffusion.sparse import sparse_backend

    real = sparse_backend.run_block_sparse

    def off_by_a_bit(q, k, v, layout, scale=None, route=None):
        return real(q, k, v, layout, scale, route) + 1e-2

    monkeypatch.setattr(sparse_backend, "run_block_sparse", off_by_a_bit)
    code, report, output = _run(tmp_path, "--canvas", "4x8x8", "--no-anchors", "--no-baselines", "--attention-backend",
                                "video_sparse_attn", "--attention-backend-config", "sparsity=0.5")
    assert code == 1, output
    row = next(r for r in report["sparse"]["rows"] if r["kind"] == "sglx")
    assert not row["ok"] and "wrong result, not timed" in row["error"] and "median_ms" not in row
    assert report["failed"] and "video_sparse_attn" in report["failed"][0]


def test_svg2_density_follows_the_logit_spread_and_the_label_says_which(tmp_path: Path) -> None:
    """Top-p over centroid scores keeps fewer blocks when attention is sharper: why the H100 compare (std 1,
    density 0.53) and benchmarks/bench_sparse_backends.py (std 5, density 0.084) disagreed in session 11."""
    density = {}
    for std in ("1", "5"):
        code, report, output = _run(tmp_path, "--canvas", "6x16x8", "--no-anchors", "--no-baselines",
                                    "--attention-backend", "sparse_video_gen_2_attn", "--logit-std", std)
        assert code == 0, output
        assert report["sparse"]["label"].endswith(f"logit std {std}")
        row = next(r for r in report["sparse"]["rows"] if r["kind"] == "sglx")
        assert row["ok"], row
        density[std] = row["density"]
    assert density["5"] < density["1"] - 0.2, density


@pytest.mark.parametrize("name", SPARSE)
def test_rows_mask_equals_doctors_full_mask_in_input_order(name: str) -> None:
    """The bench's per-row mask (from the plan view) against sparse_checks' S x S mask, on a grid with a text
    prefix and GQA."""
    from sglx.attention.registry import find
    from sglx.attention.sparse_checks import _configs

    config, kwargs = _configs(False)[name]
    backend = find(name, "diffusion", "dit").load()(config, **kwargs)
    meta = DiTAttnMetadata(grid=(6, 6, 12), num_heads=4, head_dim=16, text_tokens=9, text_position="prefix",
                           step_index=1, num_steps=2, num_layers=3)
    gen = torch.Generator().manual_seed(0)
    q = clustered((1, meta.seq_len, 4, 16), gen, 8)
    k = clustered((1, meta.seq_len, 2, 16), gen, 8)
    v = torch.randn(1, meta.seq_len, 2, 16, generator=gen)
    rows = torch.randperm(meta.seq_len, generator=gen)[:40].sort().values
    for layer in range(3 if name == "vmoba_attn" else 1):
        backend.forward(q, k, v, scale=0.25, meta=meta, layer=layer)
        view = plan_view(backend, q, k, meta, layer, 0.25)
        assert view is not None and view.density < 1.0
        want = _input_order_mask(backend, q, k, meta, layer, 0.25).expand(1, 4, -1, -1)[:, :, rows]
        assert torch.equal(rows_mask(view, rows, 1, 4, 2), want)


def test_backend_configs_pair_by_position_or_by_name() -> None:
    got = pair_backends(["a_attn,b_attn", "a_attn"], ["b_attn:x=1", "y=2", "a_attn:{\"z\": 3}"])
    assert got == (BackendRequest("a_attn", '{"z": 3}'), BackendRequest("b_attn", "x=1"),
                   BackendRequest("a_attn", "y=2"))
    assert pair_backends(["a_attn"], []) == (BackendRequest("a_attn"),)
    with pytest.raises(SglxError, match="2 unnamed"):
        pair_backends(["a_attn"], ["x=1", "y=2"])
    assert canvas_from_video(81, 480, 832) == (21, 30, 52)


@pytest.mark.parametrize(("args", "needle"), [
    (["--canvas", "18x48", "--attention-backend", "torch_sdpa"], "--canvas 18x48: give the latent token grid"),
    (["--num-frames", "6", "--attention-backend", "torch_sdpa"], "4k+1 frames"),
    (["--canvas", "4x8x8", "--attention-backend", "nope_attn"], "--attention-backend nope_attn: no such"),
    (["--canvas", "4x8x8", "--attention-backend", "sage_attn_3"], "declared but not implemented"),
    (["--canvas", "4x8x8", "--attention-backend", "video_sparse_attn", "--attention-backend-config", "sparsity=2"],
     "sparsity"),
    (["--canvas", "4x8x8", "--attention-backend", "sliding_tile_attn"], "mask_strategy_file_path"),
    (["--canvas", "4x8x8", "--attention-backend", "vmoba_attn", "--attention-backend-config", "x=1",
      "--attention-backend-config", "y=2"], "2 unnamed --attention-backend-config values for 1 backends"),
    (["--canvas", "4x8x8", "--attention-backend-config", "sparsity=0.5"], "name at least one backend"),
    (["--canvas", "4x8x8", "--attention-backend", "torch_sdpa", "--layer", "30"], "--layer 30: choose 0 .. 29"),
    (["--canvas", "4x8x8", "--attention-backend", "torch_sdpa", "--logit-std", "0"], "--logit-std 0.0: give a"),
])
def test_bad_input_is_one_line_exit_2(tmp_path: Path, args: list[str], needle: str) -> None:
    code, _, output = _run(tmp_path, *args)
    assert code == 2 and needle in output, output
    assert output.count("\n") <= 3 and "Traceback" not in output
