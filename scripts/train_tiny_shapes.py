#!/usr/bin/env python3
"""Train the embedded diffusion model (``src/sglx/diffusion/embedded/tiny-shapes``) from scratch.

A tiny Wan2.1-architecture text-to-video model in diffusers format: UMT5 text encoder (word-level
tokenizer), WanTransformer3DModel (2 heads of dim 64, patch 1x2x2) and AutoencoderKLWan (4x spatial,
4x temporal compression), trained on the synthetic clips of ``sglx.diffusion.embedded.shapes_task``
("a red circle moving right", 64x64, 17 frames; still prompts and one-frame clips too).

Stages (every one seeded; the step counts actually run are written to train_info.json):
  1. VAE: reconstruction (L1 + MSE, lit pixels weighted up) with a small KL term, on 17-frame clips.
  2. Latents: the VAE's posterior means for a fixed set of rendered clips; per-channel mean/std
     become the VAE config's latents_mean/latents_std (the pipeline un-normalises with them).
  3. DiT + text encoder jointly: flow matching (x_t = (1-s) x0 + s noise, target noise - x0,
     s from uniform u shifted by the scheduler's shift, as FlowMatchEulerDiscreteScheduler samples),
     10% of prompts dropped to "" so classifier-free guidance works; a quarter of the steps are
     one-frame batches (the first latent frame is a causal encoding of the first frame alone), and
     some 17-frame clips stand still under a still prompt. EMA weights are the ones saved.

    # a full run on one GPU (about 10 minutes; the shipped model's two runs and their flags are in
    # src/sglx/diffusion/embedded/tiny-shapes/README.md)
    python scripts/train_tiny_shapes.py --device cuda --out /tmp/tiny-shapes
    # go on from a saved folder: fine-tune its VAE decoder on 17-frame clips, then train its DiT further
    python scripts/train_tiny_shapes.py --device cuda --resume /tmp/tiny-shapes --out /tmp/tiny-shapes-2 \
        --finetune-seconds 60 --dit-seconds 110
    # CPU fine-tunes of the shipped model (session 5; neither beat it, see the model README): the DiT at
    # low-noise timesteps (1 thread; encoded clips cached for the next run) ...
    nice -n 10 python scripts/train_tiny_shapes.py --device cpu --threads 1 \
        --resume src/sglx/diffusion/embedded/tiny-shapes --out /tmp/ts5 --clips 768 \
        --latents-cache /tmp/latents768.pt --batch 8 --dit-lr 5e-5 --dit-warmup 30 --train-shift 0.5 \
        --dit-seconds 3000 --dit-steps 100000
    # or only the VAE decoder, on the DiT's own denoised latents of rendered clips (DiT and encoder frozen)
    python scripts/train_tiny_shapes.py --device cpu --threads 1 --resume src/sglx/diffusion/embedded/tiny-shapes \
        --out /tmp/ts5-dod --dit-seconds 0 --dod-seconds 2280 --dod-batch 2 --dod-lr 5e-4
    # smoke test on CPU (seconds; the model draws nothing useful)
    python scripts/train_tiny_shapes.py --device cpu --vae-steps 2 --dit-steps 2 --clips 64 --batch 4 --out /tmp/s

The output folder is a diffusers WanPipeline directory plus sglx.json (the defaults sglx samples with)
and train_info.json (arguments, steps run, losses, timings), which is not shipped.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import json
import math
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str, rel: str):  # noqa: ANN202
    """Load a module by path, so the script runs where sglx is not installed (only its source is)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / rel)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


task = _load("shapes_task", "src/sglx/diffusion/embedded/shapes_task.py")
word_tokenizer = _load("word_tokenizer", "src/sglx/diffusion/word_tokenizer.py")

Z_DIM = 16
MAX_LEN = 8  # tokens per prompt: "a red circle moving right" is 5 words + </s>
SHIFT = 2.0  # flow shift, used for training timesteps and saved in the scheduler
DEFAULTS = {"height": 64, "width": 64, "num_frames": 17, "num_inference_steps": 16, "guidance_scale": 4.0,
            "fps": 8, "max_sequence_length": MAX_LEN}


# ------------------------------------------------------------------------------------------ models


def build_models(vocab: int):  # noqa: ANN201
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=vocab, d_model=64, d_kv=32, d_ff=128, num_layers=2, num_heads=2,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
    vae = AutoencoderKLWan(base_dim=16, decoder_base_dim=12, z_dim=Z_DIM, dim_mult=[1, 2, 4], num_res_blocks=1,
                           temperal_downsample=[True, True], scale_factor_temporal=4, scale_factor_spatial=4,
                           latents_mean=[0.0] * Z_DIM, latents_std=[1.0] * Z_DIM)
    transformer = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=64,
                                        in_channels=Z_DIM, out_channels=Z_DIM, text_dim=64, freq_dim=64,
                                        ffn_dim=512, num_layers=6, rope_max_seq_len=64)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=SHIFT)
    return text_encoder, vae, transformer, scheduler


def load_models(folder: Path):  # noqa: ANN201
    """The components of a model folder this script saved, in float32, for a resumed run."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanTransformer3DModel
    from transformers import PreTrainedTokenizerFast, UMT5EncoderModel

    return (UMT5EncoderModel.from_pretrained(str(folder / "text_encoder")),
            AutoencoderKLWan.from_pretrained(str(folder / "vae")),
            WanTransformer3DModel.from_pretrained(str(folder / "transformer")),
            FlowMatchEulerDiscreteScheduler.from_pretrained(str(folder / "scheduler")),
            PreTrainedTokenizerFast.from_pretrained(str(folder / "tokenizer")))


def grow_transformer(transformer, num_layers: int):  # noqa: ANN001, ANN201
    """A deeper copy of a trained WanTransformer3DModel that computes exactly what it computes.

    Why: a resumed run keeps its trained blocks and gains capacity without starting over. The new
    blocks sit evenly between the trained ones with their three residual outputs (self-attention,
    cross-attention and FFN output projections) zeroed, so each starts as the identity and training
    grows it from there."""
    from diffusers import WanTransformer3DModel

    old = len(transformer.blocks)
    extra = num_layers - old
    if extra <= 0:
        return transformer
    cfg = {k: v for k, v in transformer.config.items() if not k.startswith("_")}
    grown = WanTransformer3DModel.from_config({**cfg, "num_layers": num_layers})
    after = {round((k + 1) * old / (extra + 1)) for k in range(extra)}  # insert a new block after these
    order: list[int | None] = []
    for i in range(old):
        if i in after:
            order.append(None)
        order.append(i)
    order += [None] * (num_layers - len(order))
    state = {k: v for k, v in transformer.state_dict().items() if not k.startswith("blocks.")}
    missing, _ = grown.load_state_dict(state, strict=False)
    assert all(k.startswith("blocks.") for k in missing), missing
    for block, src in zip(grown.blocks, order):
        if src is not None:
            block.load_state_dict(transformer.blocks[src].state_dict())
            continue
        for linear in (block.attn1.to_out[0], block.attn2.to_out[0], block.ffn.net[2]):
            torch.nn.init.zeros_(linear.weight)
            torch.nn.init.zeros_(linear.bias)
    return grown


# -------------------------------------------------------------------------------------------- data


def render_batch(specs: list, rng: np.random.Generator, num_frames: int) -> torch.Tensor:
    """[B, 3, F, H, W] floats in [-1, 1] (the VAE's input range)."""
    clips = np.stack([task.render_random(s, rng, num_frames) for s in specs])  # [B, F, H, W, 3]
    return torch.from_numpy(clips).permute(0, 4, 1, 2, 3).float().div(127.5).sub(1.0)


def random_specs(rng: np.random.Generator, n: int, still_share: float) -> list:
    motion, still = task.motion_specs(), task.still_specs()
    return [still[rng.integers(len(still))] if rng.random() < still_share else motion[rng.integers(len(motion))]
            for _ in range(n)]


# --------------------------------------------------------------------------------------------- VAE


def schedule(step: int, warmup: int, progress: float) -> float:
    """Linear warm-up, then cosine down to 10%; progress counts steps or seconds, whichever runs out first,
    so a stage cut short by its time limit still ends annealed."""
    return min(1.0, step / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def reconstruction_loss(rec: torch.Tensor, x: torch.Tensor, lit_weight: float) -> torch.Tensor:
    """L1 + MSE with lit pixels weighted 1 + lit_weight: the shape is a few percent of a black frame."""
    weight = 1.0 + lit_weight * (x.amax(dim=1, keepdim=True) > 0).float()
    err = rec - x
    return (weight * (err.abs() + err.square())).mean()


def optimizer_step(opt: torch.optim.Optimizer, params, loss: torch.Tensor) -> None:  # noqa: ANN001
    """One step of every stage here: gradients clipped to norm 1."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()


def ema_update(ema: torch.nn.Module, model: torch.nn.Module, step: int, ema_max: float) -> None:
    """EMA with warm-up: decay (1 + step) / (10 + step), capped at ema_max."""
    decay = min(ema_max, (1 + step) / (10 + step))
    with torch.no_grad():
        torch._foreach_lerp_(list(ema.parameters()), list(model.parameters()), 1 - decay)


def train_vae(vae, args, device: torch.device, log) -> dict:  # noqa: ANN001
    rng = np.random.default_rng(args.seed + 1)
    opt = torch.optim.AdamW(vae.parameters(), lr=args.vae_lr, weight_decay=0.0)
    vae.train()
    t0, step, losses = time.time(), 0, []
    for step in range(1, args.vae_steps + 1):
        lr = args.vae_lr * schedule(step, 100, max(step / args.vae_steps, (time.time() - t0) / args.vae_seconds))
        for g in opt.param_groups:
            g["lr"] = lr
        frames = 1 if step % 4 == 0 else args.vae_frames
        x = render_batch(random_specs(rng, args.vae_batch, 0.15), rng, frames).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            h = vae._encode(x)
            mu, logvar = h.float().chunk(2, dim=1)
            logvar = logvar.clamp(-30, 20)
            z = mu + torch.randn_like(mu) * (0.5 * logvar).exp()
            rec = decode_unclamped(vae, z).float()
        rec_loss = reconstruction_loss(rec, x, args.lit_weight)
        kl = 0.5 * (mu.square() + logvar.exp() - 1 - logvar).mean()
        loss = rec_loss + args.kl_weight * kl
        optimizer_step(opt, vae.parameters(), loss)
        losses.append(rec_loss.item())
        if step % args.log_every == 0 or step == args.vae_steps:
            log(f"vae step {step} rec {np.mean(losses[-100:]):.4f} kl {kl.item():.3f} lr {lr:.2e} "
                f"{time.time() - t0:.0f}s")
        if time.time() - t0 > args.vae_seconds:
            log(f"vae: time limit after {step} steps")
            break
    vae.eval()
    info = {"vae_steps_run": step, "vae_rec_loss": float(np.mean(losses[-100:])), "vae_seconds": time.time() - t0}
    info["vae_recon_attributes_right"] = vae_recon_check(vae, args, device)
    log(f"vae: {info['vae_recon_attributes_right']:.3f} of attributes right after reconstruction")
    return info


def decode_unclamped(vae, z: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    """AutoencoderKLWan._decode without its final clamp to [-1, 1]: training through the clamp starves
    every pixel pushed past black of gradient, and the decoder then learns to draw nothing at all."""
    vae.clear_cache()
    x = vae.post_quant_conv(z)
    outs = []
    for i in range(x.shape[2]):
        vae._conv_idx = [0]
        outs.append(vae.decoder(x[:, :, i:i + 1], feat_cache=vae._feat_map, feat_idx=vae._conv_idx, first_chunk=i == 0))
    vae.clear_cache()
    return torch.cat(outs, 2)


def finetune_decoder(vae, args, device: torch.device, log) -> dict:  # noqa: ANN001
    """Train only the decoder on full 17-frame clips, decoding the frozen encoder's posterior means.

    Why: a VAE trained on 9-frame clips decodes latent frames 3+ badly (the causal caches of chunk 3
    onwards hold real frames where chunk 2's hold the single first frame). Keeping the encoder frozen
    keeps the latent space, so a DiT already trained on it stays valid."""
    rng = np.random.default_rng(args.seed + 6)
    params = [*vae.decoder.parameters(), *vae.post_quant_conv.parameters()]
    vae.requires_grad_(False)
    for q in params:
        q.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=args.finetune_lr, weight_decay=0.0)
    vae.decoder.train()
    t0, step, losses = time.time(), 0, []
    for step in range(1, args.finetune_steps + 1):
        lr = args.finetune_lr * schedule(step, 50, max(step / args.finetune_steps,
                                                       (time.time() - t0) / args.finetune_seconds))
        for g in opt.param_groups:
            g["lr"] = lr
        x = render_batch(random_specs(rng, args.vae_batch, 0.15), rng, task.NUM_FRAMES).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            with torch.no_grad():
                z = vae._encode(x)[:, :Z_DIM]
            rec = decode_unclamped(vae, z).float()
        loss = reconstruction_loss(rec, x, args.lit_weight)
        optimizer_step(opt, params, loss)
        losses.append(loss.item())
        if step % args.log_every == 0 or step == args.finetune_steps:
            log(f"decoder step {step} rec {np.mean(losses[-args.log_every:]):.4f} lr {lr:.2e} {time.time() - t0:.0f}s")
        if time.time() - t0 > args.finetune_seconds:
            log(f"decoder: time limit after {step} steps")
            break
    vae.eval().requires_grad_(False)
    info = {"finetune_steps_run": step, "finetune_rec_loss": float(np.mean(losses[-args.log_every:])),
            "finetune_seconds": time.time() - t0}
    info["vae_recon_attributes_right_after_finetune"] = vae_recon_check(vae, args, device)
    log(f"decoder: {info['vae_recon_attributes_right_after_finetune']:.3f} of attributes right after reconstruction")
    return info


@torch.no_grad()
def denoised_latents(ema, scheduler, tokenizer, z0: torch.Tensor, prompts: list[str], start: list[int],  # noqa: ANN001
                     guidance: float, steps: int) -> torch.Tensor:
    """Normalised latents z0 noised to the sampler's sigma at step start[i] of `steps`, then denoised by the
    pipeline's own loop (Euler, batched CFG against "") from there: latents as the DiT hands them to the decoder."""
    device = z0.device
    sched = scheduler.__class__.from_config(scheduler.config)
    sched.set_timesteps(steps, device=device)
    sigmas, timesteps = sched.sigmas.to(device), sched.timesteps
    out = z0.clone()
    cond = encode_text(tokenizer, ema["text_encoder"], prompts, device)
    uncond = encode_text(tokenizer, ema["text_encoder"], [""] * len(prompts), device)
    for i in range(len(prompts)):
        if start[i] >= steps:  # no noise: the encoder's own latent
            continue
        ctx = torch.cat([cond[i:i + 1], uncond[i:i + 1]])
        out[i:i + 1] = euler_cfg_from(ema["transformer"], z0[i:i + 1], ctx, sigmas, timesteps, start[i], guidance)
    return out


def euler_cfg_from(transformer, z0: torch.Tensor, ctx: torch.Tensor, sigmas: torch.Tensor,  # noqa: ANN001
                   timesteps: torch.Tensor, start: int, guidance: float,
                   step_context=lambda k: contextlib.nullcontext()) -> torch.Tensor:  # noqa: ANN001
    """z0 [1, ...] noised to sigmas[start], then the sampler's Euler steps from `start` on, batched CFG (ctx holds
    the conditional and the unconditional row); `step_context(k)` wraps step k's forward (sglx's step metadata)."""
    lat = (1 - sigmas[start]) * z0 + sigmas[start] * torch.randn_like(z0)
    for k in range(start, len(timesteps)):
        with step_context(k):
            pred = transformer(hidden_states=torch.cat([lat, lat]), timestep=timesteps[k].expand(2),
                               encoder_hidden_states=ctx, return_dict=False)[0]
        pc, pu = pred.chunk(2)
        lat = lat + (sigmas[k + 1] - sigmas[k]) * (pu + guidance * (pc - pu))
    return lat


class BackendDenoisers:
    """The frozen DiT as sglx's pipeline runs it, once per attention backend (registry defaults).

    Why: a sparse backend (VMoBA's last steps, SVG2 after its warm-up) hands the decoder latents that differ
    from dense attention's in fine structure; a decoder fine-tuned on dense latents alone rounds the corners
    sparse attention leaves soft. Each clip is denoised through one backend, in turn."""

    def __init__(self, folder: Path, names: list[str], device: torch.device) -> None:
        from sglx.diffusion.engine import DiffusionEngine
        from sglx.llm.engine_config import EngineConfig

        self.engines = [DiffusionEngine(EngineConfig(model_path=str(folder), device=str(device), dtype="float32",
                                                     attention_backend=name)) for name in names]
        self.names = names
        self.used = dict.fromkeys(names, 0)

    @torch.no_grad()
    def denoise(self, which: int, z0: torch.Tensor, prompt: str, start: int, guidance: float,
                steps: int) -> torch.Tensor:
        """z0 [1, C, F, H, W] noised to the sampler's sigma at step `start`, denoised from there by the
        pipeline's own transformer, metadata and batched CFG, with backend `which`."""
        from sglx.attention.diffusion.metadata import dit_step

        pipe = self.engines[which].pipeline
        self.used[self.names[which]] += 1
        sched = pipe.scheduler.__class__.from_config(pipe.scheduler.config)
        sched.set_timesteps(steps, device=z0.device)
        sigmas, timesteps = sched.sigmas.to(z0.device), sched.timesteps
        max_len = pipe.defaults.max_sequence_length
        ctx = torch.cat([pipe.encode_text([prompt], max_len), pipe.encode_text([""], max_len)])
        meta = pipe.metadata(z0, 2, True, steps)
        return euler_cfg_from(pipe.transformer, z0, ctx, sigmas, timesteps, start, guidance,
                              lambda k: dit_step(meta.at_step(k, float(timesteps[k]))))


def finetune_decoder_on_dit(vae, ema, scheduler, tokenizer, args, device: torch.device, log) -> dict:  # noqa: ANN001
    """Train only the decoder to draw the rendered clip from the latent the DiT makes of it.

    Why: the decoder learnt from the encoder's posterior means, but at sampling time it decodes the DiT's
    output, whose fine structure (a square's corners, a triangle's apex) comes out smoothed. Here each
    rendered clip is encoded, noised to one of the sampler's last sigmas (at most --dod-max-sigma; a share
    left clean), denoised by the DiT with the pipeline's schedule and guidance, and the decoder is trained
    to draw the clean clip from the result. Encoder and DiT frozen: the latent space stays."""
    rng = np.random.default_rng(args.seed + 8)
    mean = torch.tensor(vae.config.latents_mean, device=device).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std, device=device).view(1, -1, 1, 1, 1)
    steps, guidance = DEFAULTS["num_inference_steps"], DEFAULTS["guidance_scale"]
    sched = scheduler.__class__.from_config(scheduler.config)
    sched.set_timesteps(steps)
    first = int((sched.sigmas[:-1] > args.dod_max_sigma).sum())  # first step index at or below the max sigma
    params = [*vae.decoder.parameters(), *vae.post_quant_conv.parameters()]
    vae.requires_grad_(False)
    for q in params:
        q.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=args.dod_lr, weight_decay=0.0)
    names = [n for n in args.dod_backends.split(",") if n]
    denoisers = BackendDenoisers(Path(args.resume), names, device) if names else None
    vae.decoder.train()
    t0, step, losses, clip = time.time(), 0, [], 0
    last_checkpoint = t0
    for step in range(1, args.dod_steps + 1):
        lr = args.dod_lr * schedule(step, 20, max(step / args.dod_steps, (time.time() - t0) / args.dod_seconds))
        for g in opt.param_groups:
            g["lr"] = lr
        specs = random_specs(rng, args.dod_batch, 0.15)
        x = render_batch(specs, rng, task.NUM_FRAMES).to(device)
        start = [steps if rng.random() < args.dod_clean_share else int(rng.integers(first, steps))
                 for _ in specs]
        with torch.no_grad():
            z0 = (vae._encode(x)[:, :Z_DIM] - mean) / std
            if denoisers is None:
                z = denoised_latents(ema, scheduler, tokenizer, z0, [sp.prompt for sp in specs], start, guidance,
                                     steps)
            else:
                z = z0.clone()
                for i, sp in enumerate(specs):
                    if start[i] < steps:
                        z[i:i + 1] = denoisers.denoise(clip % len(names), z0[i:i + 1], sp.prompt, start[i],
                                                       guidance, steps)
                        clip += 1
        rec = decode_unclamped(vae, z * std + mean).float()
        loss = reconstruction_loss(rec, x, args.lit_weight)
        optimizer_step(opt, params, loss)
        losses.append(loss.item())
        if step % args.log_every == 0 or step == args.dod_steps:
            log(f"decoder-on-dit step {step} rec {np.mean(losses[-args.log_every:]):.4f} lr {lr:.2e} "
                f"{time.time() - t0:.0f}s")
        if time.time() - t0 > args.dod_seconds:
            log(f"decoder-on-dit: time limit after {step} steps")
            break
        due = args.checkpoint_seconds > 0 and time.time() - last_checkpoint > args.checkpoint_seconds
        if args.checkpoint_dir and due:
            vae.eval()
            save_folder(Path(args.checkpoint_dir), tokenizer, ema, vae, scheduler, {"dod_step": step})
            vae.decoder.train()
            last_checkpoint = time.time()
            log(f"checkpoint at decoder-on-dit step {step} -> {args.checkpoint_dir}")
    vae.eval().requires_grad_(False)
    info = {"dod_steps_run": step, "dod_rec_loss": float(np.mean(losses[-args.log_every:])),
            "dod_seconds": time.time() - t0}
    if denoisers is not None:
        info["dod_clips_per_backend"] = denoisers.used
    info["vae_recon_attributes_right_after_dod"] = vae_recon_check(vae, args, device)
    log(f"decoder-on-dit: {info['vae_recon_attributes_right_after_dod']:.3f} of attributes right after "
        "reconstruction")
    return info


@torch.no_grad()
def vae_recon_check(vae, args, device: torch.device) -> float:  # noqa: ANN001
    """Share of attributes the pixel checker still sees after encode (posterior mean) + decode."""
    rng = np.random.default_rng(args.seed + 5)
    specs = task.motion_specs() + task.still_specs()
    x = render_batch(specs, rng, task.NUM_FRAMES).to(device)
    rec = vae._decode(vae._encode(x)[:, :Z_DIM], return_dict=False)[0]
    frames = ((rec.clamp(-1, 1) + 1) * 127.5).round().byte().permute(0, 2, 3, 4, 1).cpu().numpy()
    right = [v for s, f in zip(specs, frames) for v in task.score(s, task.judge(f), len(f)).values()]
    return sum(right) / len(right)


@torch.no_grad()
def encode_dataset(vae, args, device: torch.device) -> tuple[torch.Tensor, list]:  # noqa: ANN001
    """Posterior means of args.clips rendered clips ([N, Z, 5, 16, 16]) and their specs; with
    --latents-cache, read from / written to that file (encoding is most of a short CPU run's cost)."""
    cache = Path(args.latents_cache) if args.latents_cache else None
    if cache is not None and cache.is_file():
        saved = torch.load(cache)
        return saved["latents"].to(device), [task.ShapeSpec(*s) for s in saved["specs"]]
    latents, specs = _encode_clips(vae, args, device)
    if cache is not None:
        torch.save({"latents": latents.cpu(), "specs": [(s.shape, s.colour, s.direction) for s in specs]}, cache)
    return latents, specs


def _encode_clips(vae, args, device: torch.device) -> tuple[torch.Tensor, list]:  # noqa: ANN001
    rng = np.random.default_rng(args.seed + 2)
    specs = random_specs(rng, args.clips, 0.15)
    out = []
    for i in range(0, len(specs), args.encode_batch):
        x = render_batch(specs[i:i + args.encode_batch], rng, task.NUM_FRAMES).to(device)
        out.append(vae._encode(x)[:, :Z_DIM].float())
    return torch.cat(out), specs


# ----------------------------------------------------------------------------------------- text + DiT


def tokenize(tokenizer, prompts: list[str], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """Token ids and attention mask, padded to MAX_LEN as the pipeline pads them."""
    inputs = tokenizer(prompts, padding="max_length", max_length=MAX_LEN, truncation=True,
                       add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
    return inputs.input_ids.to(device), inputs.attention_mask.to(device)


def masked_embeddings(text_encoder, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    """Embeddings exactly as sglx's (and diffusers') Wan pipeline builds them: zeros past the prompt."""
    embeds = text_encoder(ids, mask).last_hidden_state
    return torch.where(mask.gt(0).unsqueeze(-1), embeds, torch.zeros_like(embeds))


def encode_text(tokenizer, text_encoder, prompts: list[str], device: torch.device) -> torch.Tensor:  # noqa: ANN001
    return masked_embeddings(text_encoder, *tokenize(tokenizer, prompts, device))


class PromptTable:
    """Every prompt the DiT stage can draw ("", the 48 moving and 12 still ones), tokenized once. A step
    encodes the table's 61 rows and gathers a row per sample, instead of tokenizing and encoding 512-1,024
    strings: the text encoder has no dropout, so the gathered rows are exactly the per-sample encodings."""

    def __init__(self, tokenizer, device: torch.device) -> None:  # noqa: ANN001
        self.prompts = ["", *(s.prompt for s in task.motion_specs()), *(s.prompt for s in task.still_specs())]
        self.index = {p: i for i, p in enumerate(self.prompts)}
        self.ids, self.mask = tokenize(tokenizer, self.prompts, device)

    def encode(self, text_encoder, rows: np.ndarray) -> torch.Tensor:  # noqa: ANN001
        table = masked_embeddings(text_encoder, self.ids, self.mask)
        return table[torch.as_tensor(rows, device=table.device)]


def compile_blocks(transformer, log) -> bool:  # noqa: ANN001
    """torch.compile each DiT block (diffusers' regional compile): the 2.3M-parameter DiT at batch 512 is
    bound by many small elementwise kernels, which inductor fuses. False when this torch/diffusers cannot."""
    try:
        transformer.compile_repeated_blocks(fullgraph=True)
    except Exception as exc:  # noqa: BLE001 - an experiment knob: fall back to eager, say why
        log(f"compile: not available ({type(exc).__name__}: {exc}); eager")
        return False
    return True


def uncompile_blocks(transformer) -> None:  # noqa: ANN001
    for block in transformer.blocks:
        block._compiled_call_impl = None


def weighted_mse(pred: torch.Tensor, target: torch.Tensor, x0: torch.Tensor, background: torch.Tensor,
                 fg_weight: float, contrast: torch.Tensor | None = None, contrast_weight: float = 0.0) -> torch.Tensor:
    """MSE with the shape's latent positions (and one position around them) weighted 1 + fg_weight: the
    shape covers about a tenth of the latent grid, so plain MSE spends most of its gradient on black.
    With a contrast map (see contrast_maps) its positions get contrast_weight x the map on top."""
    err = (pred - target).square()
    if fg_weight <= 0 and (contrast is None or contrast_weight <= 0):
        return err.mean()
    w = torch.ones_like(err[:, :1])
    if fg_weight > 0:
        lit = ((x0 - background).norm(dim=1, keepdim=True) > 0.5).float()
        w = w + fg_weight * F.max_pool3d(lit, kernel_size=(1, 3, 3), stride=1, padding=(0, 1, 1))
    if contrast is not None and contrast_weight > 0:
        w = w + contrast_weight * contrast
    return (err * w).mean() / w.mean()


def contrast_maps(args, specs: list) -> torch.Tensor:
    """[N, 1, 5, 16, 16] in [0, 1]: for each encoded clip (replaying _encode_clips' random draws, so row i is
    clip i) and latent position, the share of the position's 4x4 pixel cell, over the frames its latent frame
    holds (1, then 4 each), where the clip's shape differs from the other two shapes drawn at the same place
    and size: a square's corners, a triangle's flanks and apex.

    Why (session 6 CPU study in the model README): the square-circle difference is a fifth of a shape's latent
    and lives in a few corner cells, so plain MSE gives the DiT almost no reason to read the shape word; the
    shipped DiT's prediction moves by 1-15% of that difference (sigma 0.1-0.7) when "circle" is swapped for "square"."""
    rng = np.random.default_rng(args.seed + 2)
    num_clips = len(specs)
    if random_specs(rng, num_clips, 0.15) != specs:
        raise SystemExit(f"--contrast-weight: the {num_clips} encoded clips (--latents-cache?) were not drawn with "
                         f"--seed {args.seed} and --clips {num_clips}; encode them again without the cache")
    groups = [range(0, 1)] + [range(4 * k - 3, 4 * k + 1) for k in range(1, (task.NUM_FRAMES - 1) // 4 + 1)]
    out = np.zeros((num_clips, len(groups), 16, 16), np.float32)
    t = np.arange(task.NUM_FRAMES, dtype=np.float32)
    for i, spec in enumerate(specs):
        prm = task.random_params(spec, rng, task.NUM_FRAMES)
        dx, dy = task.STEP[spec.direction] if spec.direction is not None else (0.0, 0.0)
        cx, cy = prm.x0 + dx * prm.speed * t, prm.y0 + dy * prm.speed * t
        own = task.shape_mask(spec.shape, cx, cy, prm.size)
        diff = np.zeros_like(own)
        for other in task.SHAPES:
            if other != spec.shape:
                diff |= task.shape_mask(other, cx, cy, prm.size) != own
        cells = diff.reshape(task.NUM_FRAMES, 16, 4, 16, 4).mean(axis=(2, 4))
        for k, frames in enumerate(groups):
            out[i, k] = cells[list(frames)].mean(axis=0)
    return torch.from_numpy(out).unsqueeze(1)


def train_dit(transformer, text_encoder, tokenizer, latents: torch.Tensor, specs: list, args,  # noqa: ANN001
              device: torch.device, log, checkpoint=None,  # noqa: ANN001
              contrast: torch.Tensor | None = None) -> tuple[dict, torch.nn.ModuleDict]:
    """Flow matching on the encoded latents; `checkpoint(ema, step)` is called every
    args.checkpoint_seconds, so a run cut short still leaves weights behind. `contrast` (contrast_maps,
    row i for clip i) weights the loss by --contrast-weight where the clip's shape differs from the others."""
    rng = np.random.default_rng(args.seed + 3)
    gen = torch.Generator(device).manual_seed(args.seed + 4)
    models = torch.nn.ModuleDict({"transformer": transformer, "text_encoder": text_encoder}).train()
    ema = copy.deepcopy(models).eval().requires_grad_(False)
    groups = [{"params": list(transformer.parameters()), "lr_mult": 1.0},
              {"params": list(text_encoder.parameters()), "lr_mult": args.te_lr_mult}]
    opt = torch.optim.AdamW(groups, lr=args.dit_lr, weight_decay=0.01, fused=device.type == "cuda")
    # the black background's latent at every (channel, frame, row, column), border effects included: a
    # position whose clean latent is far from it holds the shape, where --fg-weight puts extra loss
    background = latents[:2048].median(dim=0).values.unsqueeze(0)
    motion_idx = np.array([i for i, s in enumerate(specs) if s.direction is not None])
    still_idx = np.array([i for i, s in enumerate(specs) if s.direction is None])
    table = PromptTable(tokenizer, device)
    compiled = args.compile and device.type == "cuda" and compile_blocks(models["transformer"], log)
    t0, step, losses, pending = time.time(), 0, [], []
    last_checkpoint = t0

    def read_losses() -> None:  # read back in groups: a .item() per step stalls the GPU queue
        if pending:
            losses.extend(torch.stack(pending).tolist())
            pending.clear()

    for step in range(1, args.dit_steps + 1):
        lr = args.dit_lr * schedule(step, args.dit_warmup,
                                    max(step / args.dit_steps, (time.time() - t0) / args.dit_seconds))
        for g in opt.param_groups:
            g["lr"] = lr * g["lr_mult"]
        one_frame = step % args.image_every == 0
        if one_frame:  # an image: the first frame of any clip, under its own or its still prompt
            idx = rng.integers(len(specs), size=args.batch * 2)
            x0 = latents[torch.as_tensor(idx, device=device), :, :1]
            cmap = contrast[torch.as_tensor(idx, device=device), :, :1] if contrast is not None else None
            own = rng.random(len(idx)) < 0.5
            prompts = [specs[i].prompt if o else task.ShapeSpec(specs[i].shape, specs[i].colour).prompt
                       for i, o in zip(idx, own, strict=True)]
        else:
            n_still = int(round(args.batch * 0.15))
            idx = np.concatenate([rng.choice(motion_idx, args.batch - n_still), rng.choice(still_idx, n_still)])
            x0 = latents[torch.as_tensor(idx, device=device)]
            cmap = contrast[torch.as_tensor(idx, device=device)] if contrast is not None else None
            prompts = [specs[i].prompt for i in idx]
        rows = np.array([table.index[p] for p in prompts])
        rows[rng.random(len(rows)) < args.text_dropout] = 0  # "" for classifier-free guidance
        b = x0.shape[0]
        # stratified: one draw in each of b equal bins, so every batch covers all noise levels
        perm = torch.rand(b, device=device, generator=gen).argsort()
        u = (perm + torch.rand(b, device=device, generator=gen)) / b
        sigma = args.train_shift * u / (1 + (args.train_shift - 1) * u)
        noise = torch.randn(x0.shape, device=device, generator=gen)
        s = sigma.view(b, 1, 1, 1, 1)
        xt = (1 - s) * x0 + s * noise
        try:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                context = table.encode(models["text_encoder"], rows)
                pred = models["transformer"](hidden_states=xt, timestep=sigma * 1000,
                                             encoder_hidden_states=context, return_dict=False)[0]
            loss = weighted_mse(pred.float(), noise - x0, x0, background[:, :, :x0.shape[2]], args.fg_weight,
                                cmap, args.contrast_weight)
            optimizer_step(opt, models.parameters(), loss)
        except Exception as exc:  # noqa: BLE001 - a compiled block that fails on its first shapes: go eager
            if not compiled or step > 16:
                raise
            log(f"compile: failed at step {step} ({type(exc).__name__}: {str(exc)[:200]}); eager from here")
            uncompile_blocks(models["transformer"])
            compiled = False
            opt.zero_grad(set_to_none=True)
            continue
        ema_update(ema, models, step, args.ema)
        pending.append(loss.detach())
        if len(pending) >= 50:
            read_losses()
        if step % (2 * args.log_every) == 0 or step == args.dit_steps:
            read_losses()
            log(f"dit step {step} loss {np.mean(losses[-200:]):.4f} lr {lr:.2e} {time.time() - t0:.0f}s")
        if time.time() - t0 > args.dit_seconds:
            log(f"dit: time limit after {step} steps")
            break
        due = args.checkpoint_seconds > 0 and time.time() - last_checkpoint > args.checkpoint_seconds
        if checkpoint is not None and due:
            checkpoint(ema, step)
            last_checkpoint = time.time()
    read_losses()
    info = {"dit_steps_run": step, "dit_loss": float(np.mean(losses[-200:])), "dit_seconds": time.time() - t0,
            "compiled": bool(compiled)}
    return info, ema


# -------------------------------------------------------------------------------------------- main


def portable_tokenizer(folder: Path) -> None:
    """Name the tokenizer PreTrainedTokenizerFast (transformers 5 saves TokenizersBackend, which 4.x lacks)."""
    index_path, cfg_path = folder / "model_index.json", folder / "tokenizer" / "tokenizer_config.json"
    index, cfg = json.loads(index_path.read_text()), json.loads(cfg_path.read_text())
    index["tokenizer"] = ["transformers", "PreTrainedTokenizerFast"]
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    index_path.write_text(json.dumps(index, indent=2) + "\n")
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")


def save_folder(out: Path, tokenizer, ema, vae, scheduler, info: dict) -> None:  # noqa: ANN001
    """The model folder: a diffusers WanPipeline directory (float32 copies on the CPU) plus sglx.json."""
    from diffusers import WanPipeline

    def cpu(m):  # noqa: ANN001, ANN202
        return copy.deepcopy(m).float().cpu()

    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=cpu(ema["text_encoder"]), vae=cpu(vae),
                       transformer=cpu(ema["transformer"]), scheduler=scheduler)
    pipe.save_pretrained(str(out), safe_serialization=True)
    portable_tokenizer(out)
    (out / "sglx.json").write_text(json.dumps({"defaults": DEFAULTS}, indent=2) + "\n")
    (out / "train_info.json").write_text(json.dumps(info, indent=2) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output model folder")
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vae-steps", type=int, default=3000)
    p.add_argument("--vae-batch", type=int, default=16)
    p.add_argument("--vae-frames", type=int, default=17, help="frames of the VAE's training clips (4k+1); "
                   "9 are not enough: chunks 3+ of a 17-frame clip then decode badly")
    p.add_argument("--vae-lr", type=float, default=2e-3)
    p.add_argument("--kl-weight", type=float, default=1e-4)
    p.add_argument("--vae-seconds", type=float, default=240.0, help="stop the VAE stage after this long")
    p.add_argument("--clips", type=int, default=12288, help="clips encoded once for the DiT stage")
    p.add_argument("--dit-steps", type=int, default=8000)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--dit-lr", type=float, default=8e-4)
    p.add_argument("--text-dropout", type=float, default=0.1)
    p.add_argument("--ema", type=float, default=0.999)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--dit-seconds", type=float, default=300.0, help="stop the DiT stage after this long")
    p.add_argument("--lit-weight", type=float, default=8.0, help="extra reconstruction weight of lit pixels")
    p.add_argument("--resume", default="", help="a model folder this script saved: fine-tune its VAE decoder "
                   "on 17-frame clips (encoder frozen, so the latent space stays), then go on training its DiT "
                   "and text encoder; the VAE stage is skipped")
    p.add_argument("--finetune-steps", type=int, default=2000)
    p.add_argument("--finetune-lr", type=float, default=1e-3)
    p.add_argument("--finetune-seconds", type=float, default=0.0, help="decoder fine-tune time (with --resume)")
    p.add_argument("--grow-layers", type=int, default=0, help="with --resume: deepen the DiT to this many blocks, "
                   "new blocks inserted as the identity (zeroed residual outputs) between the trained ones")
    p.add_argument("--encode-batch", type=int, default=256, help="clips per VAE encode batch")
    p.add_argument("--checkpoint-dir", default="", help="save the EMA model here every --checkpoint-seconds")
    p.add_argument("--checkpoint-seconds", type=float, default=0.0)
    p.add_argument("--checkpoint-tar", default="", help="also pack each checkpoint into this tar file")
    p.add_argument("--image-every", type=int, default=4, help="every n-th DiT step is a one-frame (picture) batch")
    p.add_argument("--te-lr-mult", type=float, default=1.0, help="the text encoder's learning rate as a multiple "
                   "of --dit-lr (it must learn to tell the shape words apart)")
    p.add_argument("--fg-weight", type=float, default=0.0, help="extra loss weight on the latent positions that "
                   "hold the shape (0: plain MSE)")
    p.add_argument("--contrast-weight", type=float, default=0.0, help="extra loss weight (x the share of a 4x4 "
                   "pixel cell that differs) on the latent positions where the clip's shape differs from the other "
                   "two shapes at the same place and size: a square's corners (0: off; the CPU study used 30)")
    p.add_argument("--compile", action="store_true", help="torch.compile the DiT blocks (CUDA; eager if it fails)")
    p.add_argument("--dit-warmup", type=int, default=300, help="DiT learning-rate warm-up steps")
    p.add_argument("--train-shift", type=float, default=SHIFT, help="flow shift of the DiT's training timesteps "
                   "(below the scheduler's shift: more low-noise steps, where edges and corners are drawn)")
    p.add_argument("--latents-cache", default="", help="encoded clips are read from this file when it exists, "
                   "else written to it")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--dod-seconds", type=float, default=0.0, help="with --resume and --dit-seconds 0: fine-tune the "
                   "VAE decoder on the DiT's denoised latents of rendered clips this long (encoder and DiT frozen)")
    p.add_argument("--dod-steps", type=int, default=100000)
    p.add_argument("--dod-batch", type=int, default=4)
    p.add_argument("--dod-lr", type=float, default=2e-4)
    p.add_argument("--dod-max-sigma", type=float, default=0.5, help="noise clips to at most this sigma")
    p.add_argument("--dod-backends", default="", help="comma-separated attention backends: each noised clip is "
                   "denoised by sglx's pipeline through the next one in turn, at its registry defaults (empty: "
                   "diffusers' dense transformer)")
    p.add_argument("--dod-clean-share", type=float, default=0.25, help="share of clips decoded from the "
                   "encoder's own latent (plain reconstruction)")
    p.add_argument("--size-range", default="", help="min,max shape extent in pixels for the training clips "
                   "(default: shapes_task.SIZE_RANGE); bigger shapes span more DiT tokens, so corners are whole-token "
                   "features")
    p.add_argument("--speed-range", default="", help="min,max pixels a frame (default: shapes_task.SPEED_RANGE); "
                   "slower keeps a bigger shape's whole track inside the frame")
    args = p.parse_args()
    for flag, name in ((args.size_range, "SIZE_RANGE"), (args.speed_range, "SPEED_RANGE")):
        if flag:
            lo, hi = (float(v) for v in flag.split(","))
            setattr(task, name, (lo, hi))
    if args.threads:
        torch.set_num_threads(args.threads)

    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_file = (out / "train_log.txt").open("w")

    def log(msg: str) -> None:
        print(msg, flush=True)
        log_file.write(msg + "\n")
        log_file.flush()

    info: dict = {"args": vars(args), "torch": torch.__version__, "size_range": list(task.SIZE_RANGE),
                  "speed_range": list(task.SPEED_RANGE),
                  "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    if args.resume:
        text_encoder, vae, transformer, scheduler, tokenizer = load_models(Path(args.resume))
        previous = Path(args.resume) / "train_info.json"
        info["resumed_from"] = json.loads(previous.read_text()) if previous.is_file() else {}
        if args.grow_layers:
            log(f"transformer: {len(transformer.blocks)} -> {args.grow_layers} blocks")
            transformer = grow_transformer(transformer, args.grow_layers)
    else:
        tokenizer = word_tokenizer.build_word_tokenizer(task.WORDS)
        text_encoder, vae, transformer, scheduler = build_models(len(tokenizer))
    for name, m in (("text_encoder", text_encoder), ("vae", vae), ("transformer", transformer)):
        log(f"{name}: {sum(x.numel() for x in m.parameters()) / 1e6:.3f}M parameters")
    text_encoder, vae, transformer = text_encoder.to(device), vae.to(device), transformer.to(device)
    t_start = time.time()
    if not args.resume:
        info.update(train_vae(vae, args, device, log))
    elif args.finetune_seconds > 0:
        info.update(finetune_decoder(vae, args, device, log))
    vae.requires_grad_(False)
    if args.resume and args.dit_seconds <= 0:  # no DiT stage: fine-tune the decoder on the DiT's latents
        ema = torch.nn.ModuleDict({"transformer": transformer, "text_encoder": text_encoder}).eval()
        ema.requires_grad_(False)
        if args.dod_seconds > 0:
            info.update(finetune_decoder_on_dit(vae, ema, scheduler, tokenizer, args, device, log))
        info["total_seconds"] = time.time() - t_start
        save_folder(out, tokenizer, ema, vae, scheduler, info)
        log(f"saved {out} ({info['total_seconds']:.0f}s)")
        return

    t = time.time()
    latents, specs = encode_dataset(vae, args, device)
    if not args.resume:  # a resumed run keeps the statistics its DiT was trained with
        vae.register_to_config(latents_mean=[round(float(v), 5) for v in latents.mean(dim=(0, 2, 3, 4))],
                               latents_std=[round(float(v), 5) for v in latents.std(dim=(0, 2, 3, 4)).clamp_min(1e-3)])
    mean = torch.tensor(vae.config.latents_mean, device=device).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std, device=device).view(1, -1, 1, 1, 1)
    latents = (latents - mean) / std
    info["encode_seconds"] = time.time() - t
    log(f"encoded {len(specs)} clips in {info['encode_seconds']:.0f}s; latent std {std.mean():.3f}")

    def checkpoint(ema, step: int) -> None:  # noqa: ANN001
        folder = Path(args.checkpoint_dir)
        save_folder(folder, tokenizer, ema, vae, scheduler, {**info, "checkpoint_dit_step": step})
        if args.checkpoint_tar:  # written aside, then renamed: a reader never sees half a tar
            partial = Path(args.checkpoint_tar + ".partial")
            with tarfile.open(partial, "w") as tar:
                tar.add(folder, arcname=folder.name)
            partial.replace(args.checkpoint_tar)
        log(f"checkpoint at dit step {step} -> {folder}")

    contrast = None
    if args.contrast_weight > 0:
        t = time.time()
        contrast = contrast_maps(args, specs).to(device)
        log(f"contrast maps of {len(specs)} clips in {time.time() - t:.0f}s; mean {contrast.mean():.4f}")
    dit_info, ema = train_dit(transformer, text_encoder, tokenizer, latents, specs, args, device, log,
                              checkpoint if args.checkpoint_dir else None, contrast)
    info.update(dit_info)
    info["total_seconds"] = time.time() - t_start

    save_folder(out, tokenizer, ema, vae, scheduler, info)
    log(f"saved {out} ({info['total_seconds']:.0f}s)")


if __name__ == "__main__":
    main()
