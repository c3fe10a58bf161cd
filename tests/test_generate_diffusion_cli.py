"""`sglx generate` with diffusion models: outputs by suffix, --json records, and one-line errors for bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from diffusion_test_utils import make_tiny_flux, make_tiny_wan
from sglx.cli.app import app
from sglx.diffusion.engine import DiffusionEngine
from sglx.diffusion.request import DiffusionRequest
from sglx.llm.engine_config import EngineConfig

SMALL = ("--height", "32", "--width", "32", "--num-inference-steps", "2")


def sglx(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "sglx", "generate", *args], capture_output=True, text=True,
                          timeout=300, env=env)


@pytest.fixture(scope="module")
def wan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_wan(tmp_path_factory.mktemp("cli_wan"))


def test_png_matches_engine_and_json_record(wan: Path, tmp_path: Path) -> None:
    out = tmp_path / "still.png"
    proc = sglx("--model-path", str(wan), "-p", "a red circle", *SMALL, "--num-frames", "1", "--seed", "5",
                "--output", str(out), "--json")
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout.strip())
    assert record["path"] == str(out) and record["seed"] == 5 and record["num_frames"] == 1
    assert record["attention_backend"] == "torch_sdpa" and record["backend"] == "sglx"
    assert set(record["timings"]) == {"text_encode_s", "denoise_s", "vae_decode_s", "total_s"}
    image = np.asarray(Image.open(out).convert("RGB"))
    engine = DiffusionEngine(EngineConfig(model_path=str(wan), device="cpu"))
    want = engine.generate(DiffusionRequest(prompt="a red circle", height=32, width=32, num_frames=1,
                                            num_inference_steps=2, seed=5)).frames[0]
    assert image.shape == (32, 32, 3)
    assert np.array_equal(image, want)


def test_mp4_and_gif_have_every_frame(wan: Path, tmp_path: Path) -> None:
    for suffix in (".mp4", ".gif"):
        out = tmp_path / f"clip{suffix}"
        proc = sglx("--model-path", str(wan), "-p", "a red circle moving right", *SMALL, "--num-frames", "5",
                    "--fps", "8", "--output", str(out))
        assert proc.returncode == 0, proc.stderr
        assert f"wrote {out}" in proc.stderr
        if suffix == ".mp4":
            with av.open(str(out)) as container:
                frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
                rate = container.streams.video[0].average_rate
            assert rate == 8
        else:
            gif = Image.open(out)
            frames = []
            for i in range(gif.n_frames):
                gif.seek(i)
                frames.append(np.asarray(gif.convert("RGB")))
        assert len(frames) == 5 and frames[0].shape == (32, 32, 3)


def test_output_dir_names_one_file_per_prompt(wan: Path, tmp_path: Path) -> None:
    proc = sglx("--model-path", str(wan), "-p", "red circle", "-p", "blue square", *SMALL, "--num-frames", "1",
                "--output-dir", str(tmp_path / "outs"), "--json", "--backend", "sglx")
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["prompt"] for r in records] == ["red circle", "blue square"]
    assert sorted(p.name for p in (tmp_path / "outs").iterdir()) == ["000_red_circle_seed0.png",
                                                                      "001_blue_square_seed0.png"]


@pytest.fixture(scope="module")
def flux(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_flux(tmp_path_factory.mktemp("cli_flux"))


@pytest.mark.parametrize("family", ["wan", "flux"])
def test_backend_diffusers_runs_diffusers_pipeline(family: str, request: pytest.FixtureRequest,
                                                   tmp_path: Path) -> None:
    """--backend diffusers runs diffusers' own pipeline; same weights and seed give the same picture as sglx."""
    model = request.getfixturevalue(family)
    cfg = (("--guidance-scale", "3") if family == "wan" else
           ("--true-cfg-scale", "2", "--negative-prompt", "blue square"))
    outs = {}
    for backend in ("sglx", "diffusers"):
        outs[backend] = tmp_path / f"{backend}.png"
        extra = ("--attention-backend", "native") if backend == "diffusers" else ()
        proc = sglx("--model-path", str(model), "-p", "a red circle", *SMALL, "--num-frames", "1", "--output",
                    str(outs[backend]), "--backend", backend, *cfg, *extra, "--json")
        assert proc.returncode == 0, proc.stderr
        record = json.loads(proc.stdout)
        assert record["backend"] == backend
    a = np.asarray(Image.open(outs["sglx"])).astype(int)
    b = np.asarray(Image.open(outs["diffusers"])).astype(int)
    assert np.abs(a - b).max() <= 1  # float32 tolerance, rounded to uint8


@pytest.mark.parametrize(("args", "needle"), [
    (("--model-path", "/nonexistent/model", "--num-frames", "5"), "no such directory"),
    (("--num-frames", "5"), "only apply to diffusion models"),
    (("--height", "30", "--num-frames", "1"), "--height 30 is not a positive multiple of 8"),
    (("--num-frames", "4"), "--num-frames 4: Wan takes 2k+1 frames"),
    (("--num-frames", "5", "--output", "x.avi"), "unknown format '.avi'"),
    (("--num-frames", "5", "--output", "x.png"), "a .png holds one image but 5 frames"),
    (("--num-frames", "1", "-p", "y", "--output", "x.png"), "--output names one file but there are 2 prompts"),
    (("--attention-backend", "triton", "--num-frames", "1"), "triton is an LLM attention backend"),
    (("--attention-backend", "fa", "--num-frames", "1"), "--attention-backend fa cannot run here"),
    (("--page-size", "16", "--num-frames", "1"), "--page-size only apply to LLMs"),
    (("--backend", "diffusers", "--attention-backend", "torch_sdpa", "--num-frames", "1"),
     "diffusers' set_attention_backend"),
])
def test_bad_input_is_one_line_exit_2(wan: Path, tmp_path: Path, args: tuple[str, ...], needle: str) -> None:
    model = () if "--model-path" in args or args == ("--num-frames", "5") else ("--model-path", str(wan))
    still = "--num-frames" in args and args[args.index("--num-frames") + 1] == "1"
    extra = () if "--output" in args else ("--output", str(tmp_path / ("never.png" if still else "never.mp4")))
    result = CliRunner().invoke(app, ["generate", *model, "-p", "x", "--height", "32", "--width", "32",
                                      "--num-inference-steps", "1", *args, *extra])
    assert result.exit_code == 2, result.output
    assert needle in result.output, result.output
    assert "Traceback" not in result.output
    assert not any(tmp_path.iterdir())  # no half-written output


def test_directory_without_model_index(tmp_path: Path) -> None:
    proc = sglx("--model-path", str(tmp_path), "-p", "x", "--num-frames", "1")
    assert proc.returncode == 2
    assert "has no model_index.json" in proc.stderr and "Traceback" not in proc.stderr


def test_unsupported_family_suggests_diffusers_backend(tmp_path: Path) -> None:
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline",
                                                           "unet": ["diffusers", "UNet2DConditionModel"]}))
    proc = sglx("--model-path", str(tmp_path), "-p", "x")
    assert proc.returncode == 2
    assert "StableDiffusionPipeline has no native sglx pipeline" in proc.stderr
    assert "--backend diffusers" in proc.stderr and "Traceback" not in proc.stderr


def test_written_file_has_the_usual_permissions(tmp_path: Path) -> None:
    from sglx.diffusion.output import write_frames

    path = write_frames(np.zeros((1, 8, 8, 3), dtype=np.uint8), tmp_path / "x.png")
    mask = os.umask(0)
    os.umask(mask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~mask
