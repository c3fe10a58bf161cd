"""sglx's native FLUX.1 pipeline against diffusers' FluxPipeline on the same tiny random weights."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from diffusion_test_utils import make_tiny_flux
from sglx.attention.diffusion.metadata import DiTAttnMetadata
from sglx.attention.diffusion.sdpa import TorchSDPABackend
from sglx.diffusion.engine import DiffusionEngine
from sglx.diffusion.loader import read_model_index
from sglx.diffusion.request import DiffusionRequest
from sglx.errors import SglxError
from sglx.llm.engine_config import EngineConfig

pytest.importorskip("diffusers")

PROMPT = "a red circle moving right"


@pytest.fixture(scope="module")
def flux_dev(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_flux(tmp_path_factory.mktemp("flux_dev"), guidance_embeds=True)


@pytest.fixture(scope="module")
def flux_schnell(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_flux(tmp_path_factory.mktemp("flux_schnell"), seed=1, guidance_embeds=False)


@pytest.fixture(scope="module")
def dev_engine(flux_dev: Path) -> DiffusionEngine:
    return DiffusionEngine(EngineConfig(model_path=str(flux_dev), device="cpu"))


def _diffusers_image(path: Path, seed: int, max_len: int, **kwargs: object) -> torch.Tensor:
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(str(path), torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    out = pipe(prompt=PROMPT, generator=torch.Generator("cpu").manual_seed(seed), output_type="pt",
               max_sequence_length=max_len, **kwargs).images
    return out[0].permute(1, 2, 0).unsqueeze(0).float()  # [C, H, W] -> [1, H, W, C]


class RecordingBackend(TorchSDPABackend):
    """torch_sdpa that notes what each self-attention call saw: (layer, q shape, step metadata)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, tuple[int, ...], DiTAttnMetadata | None]] = []

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
                meta: DiTAttnMetadata | None = None, layer: int = 0) -> torch.Tensor:
        self.calls.append((layer, tuple(q.shape), meta))
        return super().forward(q, k, v, scale=scale, meta=meta, layer=layer)


@pytest.mark.parametrize(("variant", "extra"), [
    ("dev", {}),
    ("dev", {"negative_prompt": "blue square", "true_cfg_scale": 3.0}),
    ("schnell", {}),
    ("schnell", {"negative_prompt": "blue square", "true_cfg_scale": 2.5}),
])
def test_flux_matches_diffusers(request: pytest.FixtureRequest, variant: str, extra: dict) -> None:
    path = request.getfixturevalue(f"flux_{variant}")
    engine = DiffusionEngine(EngineConfig(model_path=str(path), device="cpu"))
    req = engine.resolve(DiffusionRequest(prompt=PROMPT, height=48, width=64, num_inference_steps=3,
                                          guidance_scale=4.0, seed=7, **extra))
    got, times = engine.pipeline.generate_tensor(req)
    want = _diffusers_image(path, 7, req.max_sequence_length, height=48, width=64, num_inference_steps=3,
                            guidance_scale=4.0, **extra)
    assert got.shape == want.shape == (1, 48, 64, 3)
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    assert set(times) == {"text_encode", "denoise", "vae_decode"}


def test_flux_defaults_follow_the_variant(dev_engine: DiffusionEngine, flux_schnell: Path) -> None:
    dev = dev_engine.defaults
    assert (dev.height, dev.width, dev.num_frames, dev.num_inference_steps, dev.guidance_scale,
            dev.max_sequence_length) == (1024, 1024, 1, 28, 3.5, 512)
    schnell = DiffusionEngine(EngineConfig(model_path=str(flux_schnell), device="cpu")).defaults
    assert (schnell.num_inference_steps, schnell.max_sequence_length) == (4, 256)


def test_flux_guidance_scale_is_distilled_guidance(dev_engine: DiffusionEngine, flux_schnell: Path) -> None:
    """dev embeds --guidance-scale (the picture changes with it); schnell has no guidance embedding (it does not)."""
    def image(engine: DiffusionEngine, guidance: float) -> torch.Tensor:
        req = engine.resolve(DiffusionRequest(prompt=PROMPT, height=32, width=32, num_inference_steps=2,
                                              guidance_scale=guidance, seed=3))
        return engine.pipeline.generate_tensor(req)[0]

    assert not torch.equal(image(dev_engine, 1.0), image(dev_engine, 6.0))
    schnell = DiffusionEngine(EngineConfig(model_path=str(flux_schnell), device="cpu"))
    assert torch.equal(image(schnell, 1.0), image(schnell, 6.0))


@pytest.mark.parametrize("true_cfg", [False, True])
def test_flux_step_metadata_reaches_the_backend(flux_dev: Path, true_cfg: bool) -> None:
    from sglx.diffusion.pipelines.flux import FluxPipeline

    backend = RecordingBackend()
    pipe = FluxPipeline.load(read_model_index(flux_dev), torch.device("cpu"), torch.float32, backend, None)
    extra = {"negative_prompt": "green square", "true_cfg_scale": 2.0} if true_cfg else {}
    req = DiffusionRequest(prompt=PROMPT, height=48, width=64, num_inference_steps=2, seed=0,
                           **extra).resolved(pipe.defaults, 0)
    pipe.validate(req)
    pipe.generate_tensor(req)
    layers = len(pipe.transformer.transformer_blocks) + len(pipe.transformer.single_transformer_blocks)
    assert layers == 3
    assert len(backend.calls) == 2 * layers  # one self-attention per block per step, nothing else
    rows = 2 if true_cfg else 1
    text, image = 512, (48 // 16) * (64 // 16)
    for n, (layer, shape, meta) in enumerate(backend.calls):
        assert meta is not None
        assert layer == n % layers
        assert meta.step_index == n // layers and meta.num_steps == 2
        assert meta.grid == (1, 3, 4) and meta.text_tokens == text and meta.text_position == "prefix"
        assert meta.image_start == text and meta.seq_len == text + image
        assert shape == (rows, text + image, 2, 16)
        assert (meta.batch_size, meta.cfg, meta.num_layers) == (rows, true_cfg, layers)
        assert (meta.num_heads, meta.head_dim) == (2, 16)


def test_flux_engine_makes_a_png_shaped_image(dev_engine: DiffusionEngine) -> None:
    a = dev_engine.generate(DiffusionRequest(prompt=PROMPT, height=32, width=48, num_inference_steps=2, seed=1))
    b = dev_engine.generate(DiffusionRequest(prompt=PROMPT, height=32, width=48, num_inference_steps=2, seed=2))
    c = dev_engine.generate(DiffusionRequest(prompt=PROMPT, height=32, width=48, num_inference_steps=2, seed=1))
    assert a.frames.shape == (1, 32, 48, 3) and a.frames.dtype.name == "uint8" and a.is_image
    assert (a.frames == c.frames).all()
    assert (a.frames != b.frames).any()


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"num_frames": 5}, "--num-frames 5: FLUX makes images; use --num-frames 1 or a .png output"),
    ({"height": 40}, "--height 40 is not a positive multiple of 16"),
    ({"width": 24}, "--width 24 is not a positive multiple of 16"),
    ({"num_inference_steps": 0}, "--num-inference-steps 0"),
    ({"true_cfg_scale": 4.0}, "--true-cfg-scale 4 needs --negative-prompt"),
    ({"negative_prompt": "blue"}, "--negative-prompt does nothing for FLUX unless --true-cfg-scale"),
])
def test_flux_bad_request(dev_engine: DiffusionEngine, kwargs: dict, needle: str) -> None:
    base = {"prompt": "x", "height": 32, "width": 32}
    with pytest.raises(SglxError, match=re.escape(needle)):
        dev_engine.resolve(DiffusionRequest(**{**base, **kwargs}))


def test_flux_processor_matches_diffusers_processor() -> None:
    """The transformer alone: sglx's processors on every block give diffusers' FluxAttnProcessor output."""
    import copy

    from diffusers import FluxTransformer2DModel

    from sglx.diffusion.pipelines.flux import latent_image_ids
    from sglx.diffusion.processors import flux as flux_processors

    torch.manual_seed(0)
    ref = FluxTransformer2DModel(in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
                                 num_attention_heads=3, joint_attention_dim=24, pooled_projection_dim=8,
                                 guidance_embeds=True, axes_dims_rope=(4, 6, 6)).eval()
    ours = copy.deepcopy(ref)
    backend = RecordingBackend()
    assert flux_processors.install(ours, backend) == 4
    text, (h, w) = 7, (3, 5)  # a text length and grid that are not multiples of anything
    inputs = {"hidden_states": torch.randn(2, h * w, 16), "encoder_hidden_states": torch.randn(2, text, 24),
              "pooled_projections": torch.randn(2, 8), "timestep": torch.tensor([0.3, 0.9]),
              "guidance": torch.tensor([3.5, 3.5]), "txt_ids": torch.zeros(text, 3),
              "img_ids": latent_image_ids(h, w, torch.device("cpu"), torch.float32), "return_dict": False}
    with torch.no_grad():
        want = ref(**inputs)[0]
        got = ours(**inputs)[0]
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    assert [layer for layer, _, _ in backend.calls] == [0, 1, 2, 3]
    assert all(shape == (2, text + h * w, 3, 16) for _, shape, _ in backend.calls)
