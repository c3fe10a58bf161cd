"""Sequence-parallel DiT attention (Ulysses, ring, USP) on 2 and 4 gloo ranks against float64 SDPA and SP 1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sglx.diffusion.parallel.degrees import SPDegrees, check_devices, check_heads, check_world, resolve_degrees
from sglx.distributed.spawn import spawn_workers
from sglx.errors import SglxError
from sp_workers import SPARSE, attention_cases, write_sta_strategy

TOL = 2e-5  # fp32 against float64: the all-to-alls move values exactly, the softmax sums in another order
CASES = ("dense", "prefix_text", "suffix_text", "gqa", "gqa_kv1_text")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, float]]:
    strategy = write_sta_strategy(tmp_path_factory.mktemp("sta") / "strategy.json")
    return spawn_workers(attention_cases, 2, ([(2, 1), (1, 2)], "cpu", str(strategy)), timeout_s=180)[0]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("split", ["u2r1", "u1r2"])
def test_sp2_matches_float64_sdpa(two_ranks: dict[str, dict[str, float]], split: str, case: str) -> None:
    """Ulysses 2 and ring 2 over latent tokens, with prefix/suffix joint text and GQA, equal one process."""
    res = two_ranks[split]
    assert res[case] < TOL, (split, case, res[case])
    assert res[case + "_text_spread"] == 0.0  # every rank holds the same text outputs


@pytest.mark.parametrize("name", SPARSE)
def test_sparse_backends_under_ulysses_equal_sp1(two_ranks: dict[str, dict[str, float]], name: str) -> None:
    """STA (a different window per head: each rank's heads get their own windows via head_offset), VSA, VMoBA and
    SVG2 see the full grid's metadata under Ulysses 2, so SP 2 is SP 1 to the bit; each is really sparse here."""
    res = two_ranks["u2r1"]
    assert res[f"{name}_vs_sp1"] < 1e-6
    assert res[f"{name}_vs_dense"] > 0.1


def test_four_ranks_usp_ring4_ulysses4_match_float64_sdpa() -> None:
    """4 ranks: USP (Ulysses 2 inside, ring 2 across), a ring of 4 (blocks travel 3 hops) and Ulysses 4."""
    res = spawn_workers(attention_cases, 4, ([(2, 2), (1, 4), (4, 1)], "cpu", None), timeout_s=180)[0]
    for split in ("u2r2", "u1r4", "u4r1"):
        for case in CASES:
            assert res[split][case] < TOL, (split, case, res[split][case])
            assert res[split][case + "_text_spread"] == 0.0


@pytest.mark.parametrize(("sp", "u", "r", "heads", "want"), [
    (None, None, None, 12, SPDegrees(1, 1)),
    (4, None, None, 12, SPDegrees(4, 1)),
    (4, None, None, 6, SPDegrees(2, 2)),  # heads do not divide by 4: the rest goes to the ring
    (3, None, None, 40, SPDegrees(1, 3)),
    (4, None, 4, 12, SPDegrees(1, 4)),
    (None, 2, 3, 12, SPDegrees(2, 3)),
    (6, 2, None, 12, SPDegrees(2, 3)),
])
def test_resolve_degrees(sp: int | None, u: int | None, r: int | None, heads: int, want: SPDegrees) -> None:
    assert resolve_degrees(sp, u, r, heads) == want


@pytest.mark.parametrize(("call", "needle"), [
    (lambda: resolve_degrees(4, 2, 3), "--sp-size 4 must equal --ulysses-degree 2 x --ring-degree 3 = 6"),
    (lambda: resolve_degrees(4, None, 3), "--sp-size 4 is not a multiple of --ring-degree 3"),
    (lambda: resolve_degrees(0, None, None), "--sp-size 0: must be an integer >= 1"),
    (lambda: resolve_degrees(None, 4, None, heads=6), "--ulysses-degree 4 does not divide the DiT's 6 attention"),
    (lambda: check_heads(SPDegrees(4, 1), 6), "--ulysses-degree 2 --ring-degree 2"),
    (lambda: check_world(SPDegrees(2, 1), 4), "needs 2 processes but 4 were started"),
    (lambda: check_devices(SPDegrees(4, 1), "cuda", 2), "needs 4 GPUs, this machine has 2"),
])
def test_bad_degrees_are_one_line(call, needle: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SglxError) as info:
        call()
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_sparse_backends_refuse_what_sp_would_change(tmp_path: Path) -> None:
    """Ring attention with a sparse backend; VMoBA thresholds across heads, STA search under Ulysses: one line."""
    from sglx.attention.diffusion.sparse.sliding_tile import SlidingTileAttentionBackend
    from sglx.attention.diffusion.sparse.vmoba import VMoBABackend
    from sglx.diffusion.parallel.attention import check_backend_for_sp
    from sglx.diffusion.parallel.groups import SPGroups
    from sp_workers import sta_backend

    ring = SPGroups(SPDegrees(1, 2), 0, None, None, (0, 1))
    ulysses = SPGroups(SPDegrees(2, 1), 0, None, None, (0,))
    with pytest.raises(SglxError, match="ring attention merges dense partial results"):
        check_backend_for_sp(sta_backend(write_sta_strategy(tmp_path / "s.json")), ring)
    with pytest.raises(SglxError, match="moba_threshold_type overall selects chunks across all heads"):
        check_backend_for_sp(VMoBABackend({"moba_threshold_type": "overall"}), ulysses)
    check_backend_for_sp(VMoBABackend({"moba_threshold_type": "head_global"}), ulysses)
    search = SlidingTileAttentionBackend({"mask_strategy_file_path": str(tmp_path / "w.json"),
                                          "sta_mode": "STA_searching"})
    with pytest.raises(SglxError, match="run the search with --sp-size 1"):
        check_backend_for_sp(search, ulysses)


@pytest.fixture(scope="module")
def wan_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from diffusion_test_utils import make_tiny_wan

    return _short_text(make_tiny_wan(tmp_path_factory.mktemp("wan_sp")))


@pytest.fixture(scope="module")
def flux_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from diffusion_test_utils import make_tiny_flux

    return _short_text(make_tiny_flux(tmp_path_factory.mktemp("flux_sp")))


def _expand_timesteps(src: Path, dst: Path) -> Path:
    """A copy of a tiny Wan whose model_index.json asks for per-token timesteps (Wan2.2 TI2V's expand_timesteps)."""
    import shutil

    shutil.copytree(src, dst)
    index = json.loads((dst / "model_index.json").read_text())
    (dst / "model_index.json").write_text(json.dumps({**index, "expand_timesteps": True}))
    return dst


def _short_text(path: Path) -> Path:
    """16 text tokens instead of 512 (the model's sglx.json defaults): the same code paths, a fraction of the time."""
    (path / "sglx.json").write_text(json.dumps({"defaults": {"max_sequence_length": 16}}))
    return path


@pytest.fixture(scope="module")
def wan_sp1(wan_dir: Path) -> torch.Tensor:
    from sp_workers import WAN_REQUEST, model_frames

    frames, tokens = model_frames(str(wan_dir), WAN_REQUEST)
    assert tokens == 16  # 1 latent frame of 4 x 4 patches
    assert frames.std() > 0.05  # a picture with content: equality below is not two blank pictures
    return frames


def test_pipelines_sp2_match_sp1(wan_dir: Path, flux_dir: Path, wan_sp1: torch.Tensor, tmp_path: Path) -> None:
    """Tiny Wan (2 heads, CFG batch of 2), the same with Wan2.2 TI2V's per-token timesteps (expand_timesteps) and
    tiny FLUX.1-dev (joint text prefix, 6 image tokens) under Ulysses 2 give SP 1's float frames; each rank's DiT
    saw half the latent tokens; rank 1 skipped the VAE. Then in the same 2 ranks, as under torchrun, `sglx
    generate --sp-size 2 --ring-degree 2` (Wan, ring attention): rank 0 writes SP 1's picture (to one uint8
    step: PNG rounding at .5 edges) and prints its JSON record with the split; rank 1 is silent."""
    import numpy as np
    from PIL import Image

    from sglx.diffusion.pipelines.base import to_uint8
    from sp_workers import FLUX_REQUEST, WAN_CLI_ARGS, WAN_REQUEST, model_frames, pipeline_sp_cases

    flux_sp1, flux_tokens = model_frames(str(flux_dir), FLUX_REQUEST)
    assert flux_tokens == 6 and flux_sp1.std() > 0.01
    ti2v = _expand_timesteps(wan_dir, tmp_path / "wan_ti2v")
    ti2v_sp1, _ = model_frames(str(ti2v), WAN_REQUEST)
    cases = [("wan_u2", str(wan_dir), WAN_REQUEST, 2, 1), ("flux_u2", str(flux_dir), FLUX_REQUEST, 2, 1),
             ("ti2v_u2", str(ti2v), WAN_REQUEST, 2, 1)]
    out = tmp_path / "sp2.png"
    cli = ["generate", "--model-path", str(wan_dir), "--device", "cpu", "--dtype", "float32", *WAN_CLI_ARGS,
           "--output", str(out), "--sp-size", "2", "--ring-degree", "2", "--json"]
    ranks = spawn_workers(pipeline_sp_cases, 2, (cases, "cpu", cli), timeout_s=300)
    for name, ref, tokens in (("wan_u2", wan_sp1, 8), ("flux_u2", flux_sp1, 3), ("ti2v_u2", ti2v_sp1, 8)):
        got = torch.from_numpy(ranks[0][name])
        assert got.shape == ref.shape and ranks[0][name + "_tokens"] == ranks[1][name + "_tokens"] == tokens, name
        assert (got - ref).abs().max() < 1e-4, (name, float((got - ref).abs().max()))
        assert ranks[1][name].shape[0] == 0
    assert ranks[0]["cli_exit"] == ranks[1]["cli_exit"] == 0, ranks[0]["cli_output"]
    record = json.loads(ranks[0]["cli_output"].strip().splitlines()[-1])
    assert record["sequence_parallel"] == "sp 2 (ulysses 1 x ring 2)" and record["path"] == str(out)
    assert ranks[1]["cli_output"] == ""
    got_png = np.asarray(Image.open(out).convert("RGB")).astype(int)
    ref_png = to_uint8(wan_sp1)[0].astype(int)
    assert got_png.shape == ref_png.shape and np.abs(got_png - ref_png).max() <= 1


def test_launch_ranks_spawns_one_process_per_rank(wan_dir: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """`sglx generate --sp-size 2` without torchrun: launch_ranks starts 2 gloo ranks that each run the job.
    Under torchrun (WORLD_SIZE=2 in the environment) nothing is spawned: the rank joins torchrun's group."""
    from sglx.diffusion.parallel.launch import launch_ranks, needs_launch
    from sglx.llm.engine_config import EngineConfig
    from sp_workers import probe_job

    config = EngineConfig(model_path=str(wan_dir), device="cpu", sp_size=2)
    assert needs_launch(config) and not needs_launch(EngineConfig(model_path=str(wan_dir), sp_size=1))
    with monkeypatch.context() as env:
        env.setenv("WORLD_SIZE", "2")
        assert not needs_launch(config)
    launch_ranks(probe_job, config, str(tmp_path))
    seen = sorted(json.loads(p.read_text())["rank"] for p in tmp_path.glob("rank*.json"))
    assert seen == [0, 1]
    assert json.loads((tmp_path / "rank1.json").read_text()) == {"rank": 1, "world": 2, "backend": "gloo", "sp": 2}


@pytest.mark.parametrize(("flags", "needle"), [
    (["--sp-size", "4", "--ulysses-degree", "2", "--ring-degree", "3"],
     "--sp-size 4 must equal --ulysses-degree 2 x --ring-degree 3 = 6"),
    (["--ulysses-degree", "4"], "--ulysses-degree 4 does not divide the DiT's 2 attention heads"),
    (["--sp-size", "2", "--backend", "diffusers"], "run on sglx's own pipelines"),
])
def test_bad_sp_flags_are_one_line_exit_2(wan_dir: Path, tmp_path: Path, flags: list[str], needle: str) -> None:
    from typer.testing import CliRunner

    from sglx.cli.app import app

    args = ["generate", "--model-path", str(wan_dir), "--device", "cpu", "--prompt", "a red circle",
            "--output", str(tmp_path / "x.png"), "--num-frames", "1", *flags]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2, res.output
    assert needle in res.output and len(res.output.strip().splitlines()) == 1, res.output


def test_llm_refuses_sp_flags() -> None:
    from sglx.llm.engine import Engine

    with pytest.raises(SglxError, match="--sp-size split a diffusion model's DiT sequence; this is an LLM"):
        Engine(sp_size=2)


def test_engine_without_ranks_says_how_to_start_them(wan_dir: Path) -> None:
    """DiffusionEngine (sglx serve, Python) with --sp-size 2 but no process group: one line, before any weights."""
    from sglx.diffusion.engine import DiffusionEngine
    from sglx.llm.engine_config import EngineConfig

    with pytest.raises(SglxError, match="needs one process per rank and none was started") as info:
        DiffusionEngine(EngineConfig(model_path=str(wan_dir), device="cpu", sp_size=2))
    assert "\n" not in str(info.value)
