"""The embedded diffusion model tiny-shapes: its pixel checker on rendered clips, and the model judged by it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sglx.diffusion.embedded import TINY_SHAPES, embedded_diffusion_models, resolve_embedded
from sglx.diffusion.embedded import shapes_task as task

MAX_BYTES = 20 * 1024 * 1024


def _blur(frames: np.ndarray) -> np.ndarray:
    """3x3 box blur per frame: edges as soft as a decoder draws them."""
    f = frames.astype(np.float32)
    out = np.zeros_like(f)
    for dy in (-1, 0, 1):
        for dx in (-1, 0, 1):
            out += np.roll(np.roll(f, dy, axis=1), dx, axis=2)
    return (out / 9).round().astype(np.uint8)


# ------------------------------------------------------------------------------------------ the task


def test_prompt_grammar() -> None:
    motion, still = task.motion_specs(), task.still_specs()
    assert len(motion) == 48 and len({s.prompt for s in motion}) == 48
    assert len(still) == 12
    assert motion[0].prompt == "a red circle moving left"
    assert still[-1].prompt == "a yellow triangle"
    for spec in motion + still:
        assert task.parse_prompt(spec.prompt) == spec
        assert set(spec.prompt.split()) <= set(task.WORDS)
    assert task.parse_prompt("A Blue square, moving UP.") == task.ShapeSpec("square", "blue", "up")
    assert task.parse_prompt("a cat") is None


def test_render_draws_the_shape_in_its_colour_inside_the_frame() -> None:
    rng = np.random.default_rng(0)
    for spec in task.motion_specs():
        params = task.random_params(spec, rng)
        clip = task.render(params)
        assert clip.shape == (17, 64, 64, 3) and clip.dtype == np.uint8
        lit = clip.max(axis=-1) > 0
        counts = lit.sum(axis=(1, 2))
        assert counts.min() > 0.8 * counts.max()  # the whole track stays inside the frame (pixel rounding aside)
        assert {tuple(c) for c in clip[lit]} == {task.COLOURS[spec.colour]}
        (y0, x0), (y1, x1) = (np.nonzero(lit[0]), np.nonzero(lit[-1]))
        dx, dy = task.STEP[spec.direction]
        travelled = (x1.mean() - x0.mean()) * dx + (y1.mean() - y0.mean()) * dy
        assert travelled > 16 * task.SPEED_RANGE[0] - 2


# ------------------------------------------------------------------------------------------ the checker


@pytest.mark.parametrize("soft", [False, True], ids=["sharp", "blurred"])
def test_checker_is_right_on_rendered_clips(soft: bool) -> None:
    rng = np.random.default_rng(1 + soft)
    cases = [(s, 17) for s in task.motion_specs() + task.still_specs()]
    cases += [(s, 1) for s in task.motion_specs()[::4] + task.still_specs()]
    for spec, frames in cases:
        clip = task.render_random(spec, rng, frames)
        clip = _blur(clip) if soft else clip
        judged = task.judge(clip)
        right = task.score(spec, judged, frames)
        assert all(right.values()), (spec, frames, judged)
        assert len(right) == (3 if frames > 1 else 2)


def test_checker_rejects_wrong_attributes() -> None:
    rng = np.random.default_rng(3)
    for spec in task.motion_specs():
        judged = task.judge(task.render_random(spec, rng))
        other_colour = task.ShapeSpec(spec.shape, next(c for c in task.COLOURS if c != spec.colour), spec.direction)
        other_shape = task.ShapeSpec(next(s for s in task.SHAPES if s != spec.shape), spec.colour, spec.direction)
        other_dir = task.ShapeSpec(spec.shape, spec.colour, next(d for d in task.DIRECTIONS if d != spec.direction))
        assert task.score(other_colour, judged, 17) == {"colour": False, "shape": True, "direction": True}
        assert task.score(other_shape, judged, 17) == {"colour": True, "shape": False, "direction": True}
        assert task.score(other_dir, judged, 17) == {"colour": True, "shape": True, "direction": False}
        # a moving clip is not a still one, and a still clip does not move
        assert not task.score(task.ShapeSpec(spec.shape, spec.colour), judged, 17)["direction"]


def test_checker_sees_nothing_in_noise_or_black() -> None:
    black = np.zeros((17, 64, 64, 3), np.uint8)
    assert task.judge(black) == task.Judgement(None, None, None)
    grey = np.full((1, 64, 64, 3), 128, np.uint8)  # lit but no named colour
    assert task.judge(grey).colour is None
    with pytest.raises(ValueError):
        task.judge(np.zeros((4, 64, 64), np.uint8))


def test_checker_keeps_the_largest_blob() -> None:
    """A few stray lit pixels far from the shape change neither its shape nor its track."""
    rng = np.random.default_rng(4)
    spec = task.ShapeSpec("triangle", "green", "down")
    clip = task.render_random(spec, rng).copy()
    clip[:, 0, 0] = 255
    clip[:, 63, 63] = (0, 255, 0)
    assert all(task.score(spec, task.judge(clip), 17).values())


# ------------------------------------------------------------------------------------------ the model


def test_model_folder_is_shipped_small_and_complete() -> None:
    path = resolve_embedded(TINY_SHAPES)
    assert path is not None and TINY_SHAPES in embedded_diffusion_models()
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    assert size <= MAX_BYTES, size
    index = json.loads((path / "model_index.json").read_text())
    assert index["_class_name"] == "WanPipeline"
    assert index["transformer"] == ["diffusers", "WanTransformer3DModel"]
    assert index["vae"] == ["diffusers", "AutoencoderKLWan"]
    assert index["text_encoder"] == ["transformers", "UMT5EncoderModel"]
    defaults = json.loads((path / "sglx.json").read_text())["defaults"]
    assert (defaults["height"], defaults["width"], defaults["num_frames"]) == (64, 64, 17)
    tcfg = json.loads((path / "transformer" / "config.json").read_text())
    assert tcfg["attention_head_dim"] == 64 and list(tcfg["patch_size"]) == [1, 2, 2]
    for sub in ("tokenizer/tokenizer.json", "scheduler/scheduler_config.json", "README.md"):
        assert (path / sub).is_file(), sub


@pytest.fixture(scope="module")
def engine():
    pytest.importorskip("diffusers")
    from sglx.diffusion.engine import DiffusionEngine
    from sglx.llm.engine_config import EngineConfig

    eng = DiffusionEngine(EngineConfig(model_path=TINY_SHAPES, device="cpu"))
    yield eng
    eng.close()


def test_vae_scale_factors_are_its_real_compression(engine) -> None:
    """The pipeline sizes latents from the VAE config, so the config must say what the VAE really does."""
    import torch

    vae, transformer = engine.pipeline.vae, engine.pipeline.transformer
    with torch.no_grad():
        latents = vae.encode(torch.zeros(1, 3, 17, 64, 64)).latent_dist.mode()
    t, s = vae.config.scale_factor_temporal, vae.config.scale_factor_spatial
    assert latents.shape[2:] == ((17 - 1) // t + 1, 64 // s, 64 // s) == (5, 16, 16)
    p = transformer.config.patch_size
    grid = (latents.shape[2] // p[0], latents.shape[3] // p[1], latents.shape[4] // p[2])
    assert grid[0] >= 4 and grid[1] >= 8 and grid[2] >= 8  # real tiles for tile-based sparse attention


# The criterion, exactly: all 48 moving prompts at the model's defaults (seed 0, CPU float32, one thread).
# Shipped weights (session 10): colour 48/48, direction 48/48, shape 44/48 (four squares judged circles) = 97.2%;
# run 5's weights gave 86.8% (squares 0/16). About 1 s a clip. The sparse backends: test_tiny_shapes_sparse_defaults.py.


@pytest.fixture(scope="module")
def all_judged(engine, single_torch_thread) -> dict[str, list[bool]]:
    from sglx.diffusion.request import DiffusionRequest

    def draw(prompt: str):  # noqa: ANN202
        frames = engine.generate(DiffusionRequest(prompt=prompt)).frames
        assert frames.shape == (17, 64, 64, 3)
        return frames

    return task.judge_moving_prompts(draw)


def test_model_draws_the_colour_and_direction_asked(all_judged) -> None:
    right = all_judged["colour"] + all_judged["direction"]
    assert sum(right) >= 0.95 * len(right), all_judged


def test_model_meets_the_95_percent_target(all_judged) -> None:
    right = [ok for oks in all_judged.values() for ok in oks]
    assert len(right) == 144 and sum(right) >= 0.95 * len(right), all_judged


def test_model_draws_every_shape(all_judged) -> None:
    """No shape may be the one the model cannot draw (squares were 0/16 until session 9; 12/16 now)."""
    specs = task.motion_specs()  # the order all_judged judged them in
    for shape in task.SHAPES:
        right = [ok for spec, ok in zip(specs, all_judged["shape"], strict=True) if spec.shape == shape]
        assert len(right) == 16 and sum(right) >= 10, (shape, all_judged["shape"])


def test_model_draws_a_still_image(engine, single_torch_thread) -> None:
    from sglx.diffusion.request import DiffusionRequest

    for prompt in ("a blue square", "a yellow circle", "a red triangle"):
        res = engine.generate(DiffusionRequest(prompt=prompt, num_frames=1))
        assert res.frames.shape == (1, 64, 64, 3) and res.is_image
        assert task.judge(res.frames).colour == task.parse_prompt(prompt).colour, prompt
