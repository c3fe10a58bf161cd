"""sglx's native Wan pipeline against diffusers' WanPipeline on the same tiny random weights."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from diffusion_test_utils import make_tiny_wan
from sglx.attention.diffusion.metadata import DiTAttnMetadata
from sglx.attention.diffusion.sdpa import TorchSDPABackend
from sglx.diffusion.engine import DiffusionEngine
from sglx.diffusion.request import DiffusionRequest
from sglx.errors import SglxError
from sglx.llm.engine_config import EngineConfig

pytest.importorskip("diffusers")


@pytest.fixture(scope="module")
def wan_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_wan(tmp_path_factory.mktemp("wan"))


def _diffusers_frames(path: Path, prompt: str, negative: str, steps: int, guidance: float, seed: int,
                      frames: int, height: int, width: int) -> torch.Tensor:
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(str(path), torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    out = pipe(prompt=prompt, negative_prompt=negative, height=height, width=width, num_frames=frames,
               num_inference_steps=steps, guidance_scale=guidance, generator=torch.Generator("cpu").manual_seed(seed),
               output_type="pt", max_sequence_length=512).frames
    return out[0].permute(0, 2, 3, 1).float()  # [F, C, H, W] -> [F, H, W, C]


@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_wan_matches_diffusers(wan_dir: Path, guidance: float) -> None:
    engine = DiffusionEngine(EngineConfig(model_path=str(wan_dir), device="cpu"))
    req = engine.resolve(DiffusionRequest(prompt="a red circle moving right", negative_prompt="blue square",
                                          height=32, width=48, num_frames=5, num_inference_steps=3,
                                          guidance_scale=guidance, seed=7))
    got, times = engine.pipeline.generate_tensor(req)
    want = _diffusers_frames(wan_dir, req.prompt, req.negative_prompt, 3, guidance, 7, 5, 32, 48)
    assert got.shape == want.shape == (5, 32, 48, 3)
    assert torch.allclose(got, want, atol=2e-4), (got - want).abs().max()
    assert set(times) == {"text_encode", "denoise", "vae_decode"}


def test_wan_seed_changes_output(wan_dir: Path) -> None:
    engine = DiffusionEngine(EngineConfig(model_path=str(wan_dir), device="cpu"))
    a = engine.generate(DiffusionRequest(prompt="a red circle", height=32, width=32, num_frames=1,
                                         num_inference_steps=2, seed=1))
    b = engine.generate(DiffusionRequest(prompt="a red circle", height=32, width=32, num_frames=1,
                                         num_inference_steps=2, seed=2))
    c = engine.generate(DiffusionRequest(prompt="a red circle", height=32, width=32, num_frames=1,
                                         num_inference_steps=2, seed=1))
    assert a.frames.shape == (1, 32, 32, 3) and a.frames.dtype.name == "uint8"
    assert (a.frames == c.frames).all()
    assert (a.frames != b.frames).any()


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"height": 30}, "--height 30 is not a positive multiple of 8"),
    ({"width": 36}, "--width 36 is not a positive multiple of 8"),
    ({"num_frames": 4}, "--num-frames 4: Wan takes 2k+1 frames"),
    ({"num_inference_steps": 0}, "--num-inference-steps 0"),
])
def test_wan_bad_request(wan_dir: Path, kwargs: dict, needle: str) -> None:
    engine = DiffusionEngine(EngineConfig(model_path=str(wan_dir), device="cpu"))
    base = {"prompt": "x", "height": 32, "width": 32, "num_frames": 5}
    with pytest.raises(SglxError, match=re.escape(needle)):
        engine.resolve(DiffusionRequest(**{**base, **kwargs}))


class RecordingBackend(TorchSDPABackend):
    """torch_sdpa that records what each attention call saw."""

    def __init__(self) -> None:
        super().__init__({})
        self.self_calls: list[tuple[int, DiTAttnMetadata | None, tuple[int, ...]]] = []
        self.dense_calls = 0

    def forward(self, q, k, v, *, scale=None, meta=None, layer=0):  # type: ignore[no-untyped-def]
        self.self_calls.append((layer, meta, tuple(q.shape)))
        return super().forward(q, k, v, scale=scale, meta=meta, layer=layer)

    def forward_dense(self, q, k, v, *, scale=None):  # type: ignore[no-untyped-def]
        self.dense_calls += 1
        return super().forward_dense(q, k, v, scale=scale)


def test_every_attention_goes_through_the_backend_with_step_metadata(wan_dir: Path) -> None:
    engine = DiffusionEngine(EngineConfig(model_path=str(wan_dir), device="cpu"))
    recorder = RecordingBackend()
    from sglx.diffusion.processors import wan as wan_processors

    wan_processors.install(engine.pipeline.transformer, recorder)
    engine.generate(DiffusionRequest(prompt="a red circle", height=32, width=48, num_frames=5,
                                     num_inference_steps=3, guidance_scale=4.0, seed=0))
    layers = len(engine.pipeline.transformer.blocks)
    assert len(recorder.self_calls) == 3 * layers  # one batched CFG forward per step
    # self-attention: forward -> forward_dense once each; cross-attention: forward_dense directly
    assert recorder.dense_calls == 2 * 3 * layers
    for n, (layer, meta, shape) in enumerate(recorder.self_calls):
        assert layer == n % layers
        assert meta is not None and meta.step_index == n // layers and meta.num_steps == 3
        # 5 frames -> 3 latent frames (2x temporal), 32x48 -> 8x12 latents (4x), patch (1, 2, 2) -> 3x4x6
        assert meta.grid == (3, 4, 6) and meta.text_tokens == 0 and meta.cfg and meta.batch_size == 2
        assert shape == (2, 72, 2, 16) and meta.seq_len == 72


def test_metadata_validates_layout() -> None:
    meta = DiTAttnMetadata(grid=(2, 3, 4), num_heads=2, head_dim=8, text_tokens=5, text_position="prefix")
    assert (meta.image_tokens, meta.seq_len, meta.image_start, meta.text_start) == (24, 29, 5, 0)
    suffix = DiTAttnMetadata(grid=(2, 3, 4), num_heads=2, head_dim=8, text_tokens=5, text_position="suffix")
    assert (suffix.image_start, suffix.text_start) == (0, 24)
    with pytest.raises(ValueError, match="text_position"):
        DiTAttnMetadata(grid=(1, 2, 2), num_heads=1, head_dim=8, text_tokens=3)
    with pytest.raises(ValueError, match="grid"):
        DiTAttnMetadata(grid=(0, 2, 2), num_heads=1, head_dim=8)
    with pytest.raises(ValueError, match="step_index"):
        DiTAttnMetadata(grid=(1, 2, 2), num_heads=1, head_dim=8, step_index=3, num_steps=3)


def test_diffusers_backend_names_match_installed_diffusers() -> None:
    from diffusers.models.attention_dispatch import AttentionBackendName

    from sglx.diffusion.diffusers_names import DIFFUSERS_ATTENTION_BACKENDS

    assert set(DIFFUSERS_ATTENTION_BACKENDS) == {b.value for b in AttentionBackendName}
