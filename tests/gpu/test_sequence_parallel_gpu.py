"""Sequence-parallel DiT attention on 2 GPUs with NCCL: the CPU tier's checks (tests/test_sequence_parallel.py)
on CUDA, plus bf16 through the flash kernels that return the log-sum-exp.

Not yet run on a GPU (written on a CPU-only session; no multi-GPU machine was lent). Run on the lent
nvidia-h200-x2: PYTHONPATH=src:tests python3 -m pytest -m gpu tests/gpu/test_sequence_parallel_gpu.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sglx.distributed.spawn import spawn_workers
from sp_workers import SPARSE, attention_cases, write_sta_strategy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]

CASES = ("dense", "prefix_text", "suffix_text", "gqa", "gqa_kv1_text")


@pytest.mark.parametrize(("dtype", "tol"), [("float32", 1e-4), ("bfloat16", 3e-2)])
def test_ulysses_and_ring_on_nccl_match_float64(dtype: str, tol: float) -> None:
    res = spawn_workers(attention_cases, 2, ([(2, 1), (1, 2)], "cuda", None, dtype), timeout_s=300)[0]
    for split in ("u2r1", "u1r2"):
        for case in CASES:
            assert res[split][case] < tol, (dtype, split, case, res[split][case])
            assert res[split][case + "_text_spread"] == 0.0


def test_sparse_backends_under_ulysses_on_nccl_equal_sp1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """STA, VSA, VMoBA, SVG2 under Ulysses over NCCL. The tiny grid's blocks (4-16 tokens) are below the CUDA
    kernels' tiles, so the block-sparse calls take the masked reference route (the kernels have their own tests);
    what is checked here is the sharding, the full-grid metadata and each rank's heads."""
    monkeypatch.setenv("SGLX_BLOCK_SPARSE_ROUTE", "reference")  # inherited by the spawned ranks
    strategy = write_sta_strategy(tmp_path / "strategy.json")
    res = spawn_workers(attention_cases, 2, ([(2, 1)], "cuda", str(strategy)), timeout_s=300)[0]["u2r1"]
    for name in SPARSE:
        assert res[f"{name}_vs_sp1"] < 1e-5 and res[f"{name}_vs_dense"] > 0.1, name


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 CUDA GPUs")
def test_four_gpus_usp_ring4_ulysses4_match_float64() -> None:
    res = spawn_workers(attention_cases, 4, ([(2, 2), (1, 4), (4, 1)], "cuda", None), timeout_s=300)[0]
    for split in ("u2r2", "u1r4", "u4r1"):
        for case in CASES:
            assert res[split][case] < 1e-4, (split, case, res[split][case])


def test_wan_and_flux_sp2_on_nccl_match_sp1(tmp_path: Path) -> None:
    from diffusion_test_utils import make_tiny_flux, make_tiny_wan
    from sp_workers import FLUX_REQUEST, WAN_REQUEST, model_frames, pipeline_sp_cases

    dirs = {}
    for name, make in (("wan", make_tiny_wan), ("flux", make_tiny_flux)):
        dirs[name] = make(tmp_path / name)
        (dirs[name] / "sglx.json").write_text(json.dumps({"defaults": {"max_sequence_length": 16}}))
    refs = {"wan": model_frames(str(dirs["wan"]), WAN_REQUEST, "cuda")[0],
            "flux": model_frames(str(dirs["flux"]), FLUX_REQUEST, "cuda")[0]}
    cases = [("wan", str(dirs["wan"]), WAN_REQUEST, 2, 1), ("wan_ring", str(dirs["wan"]), WAN_REQUEST, 1, 2),
             ("flux", str(dirs["flux"]), FLUX_REQUEST, 2, 1), ("flux_ring", str(dirs["flux"]), FLUX_REQUEST, 1, 2)]
    ranks = spawn_workers(pipeline_sp_cases, 2, (cases, "cuda"), timeout_s=600)
    for name, _, _, _, _ in cases:
        ref = refs[name.split("_")[0]].cpu()
        got = torch.from_numpy(ranks[0][name])
        assert got.shape == ref.shape and (got - ref).abs().max() < 2e-3, (name, float((got - ref).abs().max()))


def test_more_ranks_than_gpus_is_one_line(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from diffusion_test_utils import make_tiny_wan
    from sglx.cli.app import app

    path = make_tiny_wan(tmp_path / "wan")
    n = torch.cuda.device_count() * 2
    res = CliRunner().invoke(app, ["generate", "--model-path", str(path), "--prompt", "a red circle", "--output",
                                   str(tmp_path / "x.png"), "--num-frames", "1", "--sp-size", str(n),
                                   "--ring-degree", str(n)])
    assert res.exit_code == 2 and f"needs {n} GPUs, this machine has" in res.output
    assert len(res.output.strip().splitlines()) == 1
