"""`sglx bench diffusion` (b): one denoising step of a dummy-weight Wan2.1 transformer, sglx vs diffusers.

One WanTransformer3DModel with Wan2.1-1.3B's real config and random weights (bf16) runs one forward (one
CFG branch) on a 81x480x832 latent with 512 text tokens. diffusers' own forward is timed first with every
attention backend diffusers can use here (`set_attention_backend`); the fastest is the baseline. Then sglx's
processors are installed on the same module (`sglx.diffusion.processors.wan.install`) with the selected
sglx backend and the same call is timed again, inside a `dit_step` as sglx's pipeline runs it. The two
outputs are compared (relative L2 error), so a fast but wrong step cannot pass. No torch.compile on
either side.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from sglx.attention.diffusion.metadata import DiTAttnMetadata, dit_step
from sglx.bench.timing import TimingBudget, median_ms
from sglx.diffusion.fused import fused_kernels
from sglx.errors import SglxError

# diffusers attention backends tried for the baseline, in no particular order: the fastest one wins.
DIFFUSERS_BACKENDS = ("native", "_native_cudnn", "_native_flash", "_native_efficient", "flash", "_flash_3",
                      "flash_4_hub", "_flash_3_hub", "sage")

WAN_1_3B = {"patch_size": (1, 2, 2), "num_attention_heads": 12, "attention_head_dim": 128, "in_channels": 16,
            "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 8960, "num_layers": 30,
            "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "rope_max_seq_len": 1024}
TINY_WAN = {**WAN_1_3B, "num_attention_heads": 2, "attention_head_dim": 32, "in_channels": 4, "out_channels": 4,
            "text_dim": 32, "freq_dim": 16, "ffn_dim": 64, "num_layers": 2}


@dataclass(frozen=True)
class StepConfig:
    """Video size in pixels (Wan VAE: 4x time with 4k+1 frames, 8x space) and the model's shape."""

    frames: int = 81
    height: int = 480
    width: int = 832
    text_tokens: int = 512
    num_layers: int | None = None  # None: the config's (30)
    backend: str | None = None  # sglx backend; None = auto selection
    dtype: str = "bfloat16"
    tiny: bool = False  # a 2-layer toy of the same architecture (CPU tests)
    warmup_ms: float | None = None
    rep_ms: float | None = None
    seed: int = 0

    def model_config(self) -> dict[str, Any]:
        cfg = dict(TINY_WAN if self.tiny else WAN_1_3B)
        if self.num_layers is not None:
            cfg["num_layers"] = self.num_layers
        return cfg

    def latent_shape(self) -> tuple[int, int, int, int, int]:
        if (self.frames - 1) % 4 or self.height % 16 or self.width % 16:
            raise SglxError(f"{self.frames}x{self.height}x{self.width}: Wan needs 4k+1 frames and height/width "
                            "divisible by 16")
        channels = self.model_config()["in_channels"]
        return (1, channels, (self.frames - 1) // 4 + 1, self.height // 8, self.width // 8)

    def budget(self, device: torch.device) -> TimingBudget:
        cpu = device.type != "cuda"
        return TimingBudget(warmup_ms=self.warmup_ms if self.warmup_ms is not None else (5.0 if cpu else 1000.0),
                            rep_ms=self.rep_ms if self.rep_ms is not None else (20.0 if cpu else 5000.0),
                            min_runs=3 if cpu else 5, max_runs=50 if cpu else 30)


def _build(config: StepConfig, device: torch.device, dtype: torch.dtype) -> tuple[Any, dict[str, torch.Tensor]]:
    from diffusers import WanTransformer3DModel

    torch.manual_seed(config.seed)
    with torch.device(device):
        model = WanTransformer3DModel(**config.model_config())
    model = _cast_like_from_pretrained(model.eval(), dtype)
    gen = torch.Generator(device=device).manual_seed(config.seed)
    cfg = model.config
    inputs = {
        "hidden_states": torch.randn(config.latent_shape(), device=device, dtype=dtype, generator=gen),
        "timestep": torch.tensor([500.0], device=device),
        "encoder_hidden_states": torch.randn(1, config.text_tokens, cfg.text_dim, device=device, dtype=dtype,
                                             generator=gen),
    }
    return model, inputs


def _cast_like_from_pretrained(model: Any, dtype: torch.dtype) -> Any:
    """`dtype` everywhere except the modules diffusers keeps in float32 when loading (rope tables, time
    embedder, norms, scale_shift_table), as `from_pretrained(torch_dtype=...)` leaves a real checkpoint."""
    keep = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())

    def target(name: str) -> torch.dtype:
        return torch.float32 if any(k in name.split(".") for k in keep) else dtype

    for name, param in model.named_parameters():
        param.data = param.data.to(target(name))
    for mod_name, module in model.named_modules():
        for name, buf in list(module._buffers.items()):
            if buf is not None and buf.is_floating_point():  # rope tables: float64 -> float32, never via bf16
                module._buffers[name] = buf.to(target(f"{mod_name}.{name}" if mod_name else name))
    return model


def _metadata(model: Any, latent: tuple[int, ...]) -> DiTAttnMetadata:
    pt, ph, pw = model.config.patch_size
    grid = (latent[2] // pt, latent[3] // ph, latent[4] // pw)
    return DiTAttnMetadata(grid=grid, num_heads=model.config.num_attention_heads,
                           head_dim=model.config.attention_head_dim, num_layers=model.config.num_layers)


def _quiet_diffusers() -> Callable[[], None]:
    """Silence diffusers' per-call 'experimental feature' warnings; returns the restore function."""
    from diffusers.utils import logging as dlogging

    level = dlogging.get_verbosity()
    dlogging.set_verbosity_error()
    return lambda: dlogging.set_verbosity(level)


def _time(fn: Callable[[], torch.Tensor], device: torch.device, budget: TimingBudget) -> dict[str, Any]:
    t = median_ms(fn, device, budget)
    return {"median_ms": t.median_ms, "min_ms": t.min_ms, "max_ms": t.max_ms, "runs": t.runs}


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


def run_step(config: StepConfig, device: torch.device, snap: Any,
             progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    from sglx.attention.registry import find
    from sglx.attention.selection import select_diffusion
    from sglx.diffusion.processors.wan import install

    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[config.dtype]
    say = progress or (lambda _m: None)
    say(f"step: building a dummy Wan transformer ({config.model_config()['num_layers']} layers, {config.dtype})")
    model, inputs = _build(config, device, dtype)
    budget = config.budget(device)

    def forward() -> torch.Tensor:
        return model(**inputs, return_dict=False)[0]

    rows: list[dict[str, Any]] = []
    outputs: dict[str, torch.Tensor] = {}
    quiet = _quiet_diffusers()
    # set_attention_backend also sets diffusers' process-wide active backend: put it back afterwards.
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    active = _AttentionBackendRegistry._active_backend
    try:
        with torch.inference_mode():
            for name in DIFFUSERS_BACKENDS:
                say(f"step: diffusers forward, attention backend {name}")
                row: dict[str, Any] = {"side": "diffusers", "attention": name}
                try:
                    model.set_attention_backend(name)
                    outputs[name] = forward()
                    row.update(_time(forward, device, budget))
                except Exception as exc:  # not installed / not supported here: recorded, not fatal
                    row["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
                rows.append(row)
            timed = [r for r in rows if "median_ms" in r]
            if not timed:
                raise SglxError("no diffusers attention backend ran the Wan step here")
            best = min(timed, key=lambda r: r["median_ms"])
            reference = outputs[best["attention"]]
            model.reset_attention_backend()
    finally:
        _AttentionBackendRegistry.set_active_backend(active)
    selection = select_diffusion(snap, None, config.backend)
    spec = find(selection.backend, "diffusion", "dit")
    backend = spec.load()({})
    install(model, backend)  # fuses the QKV projections: outside inference mode, they become parameters
    meta = _metadata(model, tuple(inputs["hidden_states"].shape))

    def sglx_forward() -> torch.Tensor:
        with dit_step(meta):
            return model(**inputs, return_dict=False)[0]

    variant = getattr(backend, "variant", None)
    with torch.inference_mode():
        for fused in (True, False):  # sglx's fused DiT kernels, then diffusers' torch arithmetic (A/B)
            say(f"step: sglx forward, backend {selection.backend}, fused kernels {fused}")
            with fused_kernels(fused):
                got = sglx_forward()
                row = {"side": "sglx", "attention": selection.backend, "variant": variant, "fused_kernels": fused,
                       **_time(sglx_forward, device, budget), "rel_l2_vs_baseline": _rel_err(got, reference)}
            rows.append(row)
    sglx_row = rows[-2]
    quiet()
    return {
        "config": asdict(config), "model": config.model_config(), "latent": list(inputs["hidden_states"].shape),
        "tokens": meta.seq_len, "rows": rows, "baseline": best["attention"],
        "sglx_over_diffusers": sglx_row["median_ms"] / best["median_ms"],
        "baseline_rel_l2_spread": {k: _rel_err(v, reference) for k, v in outputs.items()},
    }
