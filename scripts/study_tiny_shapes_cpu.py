#!/usr/bin/env python3
"""CPU study: why the tiny-shapes DiT draws every square as a circle, and which training change fixes it.

Small enough for a shared 2-core CPU: still pictures only (one frame: latent 16 x 1 x 16 x 16, DiT grid
1 x 8 x 8 = 64 tokens), encoded once by the shipped VAE, judged by the same pixel checker after the VAE
decodes the sample. Three parts (results appended to one JSON file):

  cache     render and encode still pictures (random place/size/colour/shape) plus matched pairs
            (circle, square, triangle at the same place, size and colour) for the analysis.
  analyse   how far apart the VAE puts a square and a circle (latent distance), how precisely a latent
            must be hit for the decoder to draw a square (interpolation circle -> square, added noise),
            and how much the shipped DiT's clean-latent prediction changes between the "square" and the
            "circle" prompt compared with that distance.
  train     resume the shipped DiT (+ text encoder) on pictures for a fixed CPU budget under one variant
            of the recipe, then sample 16-step Euler with CFG 4 (as the pipeline does) for 4 seeds x 12
            still prompts and count what the checker sees per shape.

    nice -n 10 python scripts/study_tiny_shapes_cpu.py cache --n 4096
    nice -n 10 python scripts/study_tiny_shapes_cpu.py analyse
    nice -n 10 python scripts/study_tiny_shapes_cpu.py train --variant recipe --seconds 480
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "src/sglx/diffusion/embedded/tiny-shapes"
RESULTS = ROOT / "benchmarks/results/tiny_shapes_study_cpu_s6.json"
CACHE = Path("/tmp/ts_study_stills.pt")


def _load(name: str, rel: str):  # noqa: ANN202
    spec = importlib.util.spec_from_file_location(name, ROOT / rel)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


tts = _load("train_tiny_shapes", "scripts/train_tiny_shapes.py")
task = tts.task
STILLS = task.still_specs()  # 12: shape-major (circle x4 colours, square x4, triangle x4)


def record(key: str, value) -> None:  # noqa: ANN001
    data = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    data[key] = value
    RESULTS.write_text(json.dumps(data, indent=1) + "\n")


def norm_stats(vae) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    return mean, std


@torch.no_grad()
def encode(vae, frames: np.ndarray) -> torch.Tensor:  # noqa: ANN001
    """uint8 [B, H, W, 3] pictures -> normalised latents [B, 16, 1, 16, 16]."""
    x = torch.from_numpy(frames).permute(0, 3, 1, 2).unsqueeze(2).float().div(127.5).sub(1.0)
    mean, std = norm_stats(vae)
    out = [vae._encode(x[i:i + 256])[:, :tts.Z_DIM] for i in range(0, len(x), 256)]
    return (torch.cat(out) - mean) / std


@torch.no_grad()
def decode_judge(vae, z: torch.Tensor) -> list:  # noqa: ANN001
    """Normalised latents -> checker judgements (one per picture)."""
    mean, std = norm_stats(vae)
    out = []
    for i in range(0, len(z), 64):
        rec = vae._decode(z[i:i + 64] * std + mean, return_dict=False)[0]
        frames = ((rec.clamp(-1, 1) + 1) * 127.5).round().byte().permute(0, 2, 3, 4, 1).numpy()
        out += [task.judge(f) for f in frames]
    return out


def fill_of(vae, z: torch.Tensor) -> list[float]:  # noqa: ANN001
    """Fill of the lit blob's bounding box (the checker's square test is >= 0.875)."""
    mean, std = norm_stats(vae)
    rec = vae._decode(z * std + mean, return_dict=False)[0]
    frames = ((rec.clamp(-1, 1) + 1) * 127.5).round().byte().permute(0, 2, 3, 4, 1).numpy()
    fills = []
    for f in frames:
        blob = task._largest_component(f.max(-1) >= task.LIT)[0]
        ys, xs = np.nonzero(blob)
        fills.append(float(ys.size / ((ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1))) if ys.size else 0.0)
    return fills


# ------------------------------------------------------------------------------------------ cache


def cmd_cache(args) -> None:  # noqa: ANN001
    torch.set_num_threads(1)
    _, vae, _, _, _ = tts.load_models(MODEL)
    vae.eval()
    rng = np.random.default_rng(args.seed)
    specs = [STILLS[i] for i in rng.integers(len(STILLS), size=args.n)]
    frames = np.stack([task.render_random(s, rng, 1)[0] for s in specs])
    t = time.time()
    z = encode(vae, frames)
    # matched pairs: the same place, size and colour drawn as each shape
    pairs = []
    for _ in range(args.pairs):
        colour = list(task.COLOURS)[rng.integers(4)]
        p = task.random_params(task.ShapeSpec("circle", colour), rng, 1)
        pairs.append([task.render(task.ClipParams(task.ShapeSpec(s, colour), p.size, p.x0, p.y0, 0.0), 1)[0]
                      for s in task.SHAPES])
    pz = encode(vae, np.stack([f for trio in pairs for f in trio])).view(args.pairs, 3, tts.Z_DIM, 1, 16, 16)
    torch.save({"latents": z, "labels": torch.tensor([STILLS.index(s) for s in specs]), "pairs": pz}, CACHE)
    print(f"encoded {args.n} pictures + {args.pairs} matched trios in {time.time() - t:.0f}s -> {CACHE}")


# ---------------------------------------------------------------------------------------- analyse


def x0_pred(transformer, xt: torch.Tensor, sigma: float, ctx: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    v = transformer(hidden_states=xt, timestep=torch.full((len(xt),), sigma * 1000.0), encoder_hidden_states=ctx,
                    return_dict=False)[0]
    return xt - sigma * v


@torch.no_grad()
def cmd_analyse(args) -> None:  # noqa: ANN001
    torch.set_num_threads(1)
    te, vae, dit, _, tok = tts.load_models(MODEL)
    for m in (te, vae, dit):
        m.eval()
    data = torch.load(CACHE)
    pz = data["pairs"]  # [P, 3, 16, 1, 16, 16]
    ci, sq, tr = pz[:, 0], pz[:, 1], pz[:, 2]
    bg = data["latents"].median(dim=0).values.unsqueeze(0)
    lit = ((ci - bg).norm(dim=1, keepdim=True) > 0.5) | ((sq - bg).norm(dim=1, keepdim=True) > 0.5)
    d_sq_ci = (sq - ci).flatten(1).norm(dim=1)
    d_shape = (ci - bg).flatten(1).norm(dim=1)
    out: dict = {"pairs": len(pz),
                 "latent_l2_square_minus_circle_median": float(d_sq_ci.median()),
                 "latent_l2_circle_minus_background_median": float(d_shape.median()),
                 "latent_l2_triangle_minus_circle_median": float((tr - ci).flatten(1).norm(dim=1).median()),
                 "ratio_square_circle_over_shape_median": float((d_sq_ci / d_shape).median()),
                 "lit_latent_positions_median": float(lit.float().sum(dim=(1, 2, 3, 4)).median())}
    # decoder: how close to the square latent a sample must land
    interp = {}
    for a in (0.0, 0.25, 0.5, 0.625, 0.75, 0.875, 1.0):
        j = decode_judge(vae, (1 - a) * ci + a * sq)
        interp[str(a)] = {"square": sum(x.shape == "square" for x in j) / len(j),
                          "fill_median": float(np.median(fill_of(vae, (1 - a) * ci + a * sq)))}
    out["decode_interp_circle_to_square"] = interp
    g = torch.Generator().manual_seed(0)
    noisy = {}
    for eps in (0.0, 0.05, 0.1, 0.2, 0.3):
        z = sq + eps * torch.randn(sq.shape, generator=g)
        j = decode_judge(vae, z)
        noisy[str(eps)] = sum(x.shape == "square" for x in j) / len(j)
    out["decode_square_plus_gaussian_rms_eps"] = noisy
    # the shipped DiT: clean-latent prediction error, and how much the shape word moves it
    colours = list(task.COLOURS)
    sq_prompts, ci_prompts = [], []
    j_ci = decode_judge(vae, ci)
    for jj in j_ci:
        c = jj.colour or colours[0]
        sq_prompts.append(f"a {c} square")
        ci_prompts.append(f"a {c} circle")
    ctx_sq = tts.encode_text(tok, te, sq_prompts, torch.device("cpu"))
    ctx_ci = tts.encode_text(tok, te, ci_prompts, torch.device("cpu"))
    dit_rows = {}
    for sigma in (0.1, 0.2, 0.3, 0.5, 0.7):
        noise = torch.randn(sq.shape, generator=g)
        xt = (1 - sigma) * sq + sigma * noise
        p_sq = x0_pred(dit, xt, sigma, ctx_sq)
        p_ci = x0_pred(dit, xt, sigma, ctx_ci)
        xtc = (1 - sigma) * ci + sigma * noise
        pc_ci = x0_pred(dit, xtc, sigma, ctx_ci)
        dit_rows[str(sigma)] = {
            "x0_err_l2_square_pictures": float((p_sq - sq).flatten(1).norm(dim=1).median()),
            "x0_err_l2_circle_pictures": float((pc_ci - ci).flatten(1).norm(dim=1).median()),
            "x0_pred_l2_square_prompt_minus_circle_prompt": float((p_sq - p_ci).flatten(1).norm(dim=1).median()),
            "x0_pred_from_square_closer_to_circle_latent_share": float(
                ((p_sq - ci).flatten(1).norm(dim=1) < (p_sq - sq).flatten(1).norm(dim=1)).float().mean()),
            "square_judged_on_decoded_x0_pred": sum(x.shape == "square" for x in decode_judge(vae, p_sq)) / len(pz),
        }
    out["shipped_dit_x0_prediction"] = dit_rows
    e = lambda ps: F.normalize(tts.encode_text(tok, te, ps, torch.device("cpu")).flatten(1), dim=1)  # noqa: E731
    out["prompt_cosine_circle_square"] = float((e(["a red circle"]) * e(["a red square"])).sum())
    out["prompt_cosine_red_blue"] = float((e(["a red circle"]) * e(["a blue circle"])).sum())
    print(json.dumps(out, indent=1))
    record("analysis", out)


# ------------------------------------------------------------------------------------------ train


class FreeContext(torch.nn.Module):
    """A learned text context per still prompt (and one for ""), initialised from the text encoder's output:
    conditioning that can separate circle from square as far as the DiT needs, by construction."""

    def __init__(self, te, tok) -> None:  # noqa: ANN001
        super().__init__()
        with torch.no_grad():
            ctx = tts.encode_text(tok, te, [s.prompt for s in STILLS] + [""], torch.device("cpu"))
        self.table = torch.nn.Parameter(ctx.clone())

    def forward(self, labels: torch.Tensor) -> torch.Tensor:  # labels: 0..11, 12 = ""
        return self.table[labels]


class TextContext(torch.nn.Module):
    def __init__(self, te, tok, trainable: bool) -> None:  # noqa: ANN001
        super().__init__()
        self.te, self.tok = te, tok
        self.prompts = [s.prompt for s in STILLS] + [""]
        te.requires_grad_(trainable)

    def forward(self, labels: torch.Tensor) -> torch.Tensor:
        return tts.encode_text(self.tok, self.te, [self.prompts[i] for i in labels.tolist()], torch.device("cpu"))


VARIANTS = {
    # name: (context kind, text-encoder lr mult, train shift, fg weight, loss)
    "recipe": ("text", 1.0, 2.0, 0.0, "v"),
    "te_frozen": ("text", 0.0, 2.0, 0.0, "v"),
    "te_x5_fg4_shift1": ("text", 5.0, 1.0, 4.0, "v"),
    "free_ctx": ("free", 1.0, 2.0, 0.0, "v"),
    "free_ctx_x10": ("free", 10.0, 2.0, 0.0, "v"),
    "fg4_shift1": ("text", 1.0, 1.0, 4.0, "v"),
    "x0_loss": ("text", 1.0, 2.0, 0.0, "x0"),
    "te_x5_shift05_fg4": ("text", 5.0, 0.5, 4.0, "v"),
    "no_train": ("text", 0.0, 2.0, 0.0, "none"),
    # extra loss weight on the latent positions where this picture's shape differs from the other two
    # shapes drawn at the same place and size (corners of a square, apex and base corners of a triangle)
    "contrast10": ("text", 1.0, 2.0, 0.0, "contrast10"),
    "contrast10_te_x5": ("text", 5.0, 2.0, 0.0, "contrast10"),
    "contrast10_shift1": ("text", 1.0, 1.0, 0.0, "contrast10"),
    "contrast30": ("text", 1.0, 2.0, 0.0, "contrast30"),
    "contrast100": ("text", 1.0, 2.0, 0.0, "contrast100"),
    "contrast30_te_x5_fg4_shift1": ("text", 5.0, 1.0, 4.0, "contrast30"),
    "contrast100_te_x5_fg4_shift1": ("text", 5.0, 1.0, 4.0, "contrast100"),
    # + a shape-swap hinge: on the contrast cells, the prediction under a wrong shape word (same colour) must be
    # at least 10% worse than under the right one
    "swap_te_x5_fg4_shift1": ("text", 5.0, 1.0, 4.0, "swap"),
}


def contrast_maps(n: int, seed: int) -> torch.Tensor:
    """[n, 1, 1, 16, 16] in [0, 1]: per latent position (a 4x4 pixel cell), the share of its pixels where the
    cached picture's shape differs from the other two shapes drawn at the same place and size (a square's
    corners, a triangle's flanks). Replays cmd_cache's rng, so row k belongs to cached picture k."""
    rng = np.random.default_rng(seed)
    specs = [STILLS[i] for i in rng.integers(len(STILLS), size=n)]
    out = np.zeros((n, 16, 16), np.float32)
    for k, s in enumerate(specs):
        p = task.random_params(s, rng, 1)
        masks = {sh: task.shape_mask(sh, np.array([p.x0]), np.array([p.y0]), p.size)[0] for sh in task.SHAPES}
        diff = np.zeros((64, 64), bool)
        for sh in task.SHAPES:
            if sh != s.shape:
                diff |= masks[sh] != masks[s.shape]
        out[k] = diff.reshape(16, 4, 16, 4).mean(axis=(1, 3))
    return torch.from_numpy(out).view(n, 1, 1, 16, 16)


@torch.no_grad()
def sample(dit, ctx_mod, labels: torch.Tensor, seeds: list[int], guidance: float = 4.0,  # noqa: ANN001
           steps: int = 16) -> torch.Tensor:
    """The pipeline's sampler on one latent frame: shifted sigmas, Euler, batched CFG against ""."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = FlowMatchEulerDiscreteScheduler.from_pretrained(str(MODEL / "scheduler"))
    sched.set_timesteps(steps)
    sigmas, ts = sched.sigmas, sched.timesteps
    lat = torch.stack([torch.randn((tts.Z_DIM, 1, 16, 16), generator=torch.Generator().manual_seed(s))
                       for s in seeds])
    cond, uncond = ctx_mod(labels), ctx_mod(torch.full_like(labels, len(STILLS)))
    ctx = torch.cat([cond, uncond])
    for k in range(steps):
        pred = dit(hidden_states=torch.cat([lat, lat]), timestep=ts[k].expand(2 * len(lat)),
                   encoder_hidden_states=ctx, return_dict=False)[0]
        pc, pu = pred.chunk(2)
        lat = lat + (sigmas[k + 1] - sigmas[k]) * (pu + guidance * (pc - pu))
    return lat


@torch.no_grad()
def shape_word_effect(dit, ctx_mod, pairs: torch.Tensor) -> dict:  # noqa: ANN001
    """How far the clean-latent prediction moves when only the shape word changes (square vs circle prompt,
    same noisy square picture), as a share of the latent distance between that square and its circle."""
    g = torch.Generator().manual_seed(7)
    ci, sq = pairs[:, 0], pairs[:, 1]
    # pair k is shape-checked by position only: any colour label does; use red (0) for every pair
    lab_sq = torch.full((len(sq),), STILLS.index(task.ShapeSpec("square", "red")))
    lab_ci = torch.full((len(sq),), STILLS.index(task.ShapeSpec("circle", "red")))
    out = {}
    for sigma in (0.3, 0.5, 0.7, 0.9):
        xt = (1 - sigma) * sq + sigma * torch.randn(sq.shape, generator=g)
        d = x0_pred(dit, xt, sigma, ctx_mod(lab_sq)) - x0_pred(dit, xt, sigma, ctx_mod(lab_ci))
        out[str(sigma)] = round(float((d.flatten(1).norm(dim=1) / (sq - ci).flatten(1).norm(dim=1)).median()), 4)
        # the part of that move that points from the circle's latent to the square's (1.0: all the way)
        gap = (sq - ci).flatten(1)
        out[f"toward_square_{sigma}"] = round(float(((d.flatten(1) * gap).sum(1) / gap.square().sum(1)).median()), 4)
    return out


def judge_model(dit, ctx_mod, vae, seeds_per_prompt: int) -> dict:  # noqa: ANN001
    labels = torch.arange(len(STILLS)).repeat_interleave(seeds_per_prompt)
    seeds = [1000 + i for i in range(len(labels))]
    z = sample(dit, ctx_mod, labels, seeds)
    js = decode_judge(vae, z)
    res: dict = {"shape_right": {}, "colour_right": 0, "judged_as": {}}
    for sh in task.SHAPES:
        idx = [i for i, lab in enumerate(labels.tolist()) if STILLS[lab].shape == sh]
        res["shape_right"][sh] = f"{sum(js[i].shape == sh for i in idx)}/{len(idx)}"
        res["judged_as"][sh] = {str(k): sum(js[i].shape == k for i in idx) for k in (*task.SHAPES, None)}
    colour_ok = sum(js[i].colour == STILLS[lab].colour for i, lab in enumerate(labels.tolist()))
    res["colour_right"] = f"{colour_ok}/{len(js)}"
    res["shape_total"] = sum(js[i].shape == STILLS[lab].shape for i, lab in enumerate(labels.tolist()))
    res["pictures"] = len(js)
    return res


def cmd_train(args) -> None:  # noqa: ANN001
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    kind, te_mult, shift, fg, loss_kind = VARIANTS[args.variant]
    te, vae, dit, _, tok = tts.load_models(MODEL)
    vae.eval().requires_grad_(False)
    data = torch.load(CACHE)
    z_all, lab_all = data["latents"], data["labels"]
    bg = z_all.median(dim=0).values.unsqueeze(0)
    cmaps = contrast_maps(len(z_all), 0) if loss_kind.startswith(("contrast", "swap")) else None
    ctx_mod = FreeContext(te, tok) if kind == "free" else TextContext(te, tok, te_mult > 0)
    dit.train()
    groups = [{"params": list(dit.parameters()), "lr_mult": 1.0}]
    ctx_params = [p for p in ctx_mod.parameters() if p.requires_grad]
    if ctx_params and te_mult > 0:
        groups.append({"params": ctx_params, "lr_mult": te_mult})
    opt = torch.optim.AdamW(groups, lr=args.lr, weight_decay=0.01)
    ema = copy.deepcopy(torch.nn.ModuleDict({"dit": dit, "ctx": ctx_mod})).eval().requires_grad_(False)
    models = torch.nn.ModuleDict({"dit": dit, "ctx": ctx_mod})
    rng = np.random.default_rng(args.seed)
    gen = torch.Generator().manual_seed(args.seed + 1)
    t0, step, losses = time.time(), 0, []
    while loss_kind != "none" and time.time() - t0 < args.seconds:
        step += 1
        lr = args.lr * tts.schedule(step, 30, (time.time() - t0) / args.seconds)
        for gr in opt.param_groups:
            gr["lr"] = lr * gr["lr_mult"]
        idx = torch.as_tensor(rng.integers(len(z_all), size=args.batch))
        x0, labels = z_all[idx], lab_all[idx].clone()
        labels[torch.as_tensor(rng.random(args.batch) < 0.1)] = len(STILLS)
        b = len(x0)
        perm = torch.rand(b, generator=gen).argsort()
        u = (perm + torch.rand(b, generator=gen)) / b
        sigma = shift * u / (1 + (shift - 1) * u)
        noise = torch.randn(x0.shape, generator=gen)
        s = sigma.view(b, 1, 1, 1, 1)
        xt = (1 - s) * x0 + s * noise
        pred = dit(hidden_states=xt, timestep=sigma * 1000, encoder_hidden_states=ctx_mod(labels), return_dict=False)[0]
        if loss_kind == "swap":
            loss = tts.weighted_mse(pred, noise - x0, x0, bg, fg)
            keep = labels < len(STILLS)  # pictures that kept their prompt
            wrong = labels.clone()
            for i in torch.nonzero(keep).flatten().tolist():
                sp = STILLS[int(labels[i])]
                other = [sh for sh in task.SHAPES if sh != sp.shape][int(rng.integers(2))]
                wrong[i] = STILLS.index(task.ShapeSpec(other, sp.colour))
            pred_w = dit(hidden_states=xt[keep], timestep=sigma[keep] * 1000,
                         encoder_hidden_states=ctx_mod(wrong[keep]), return_dict=False)[0]
            c = cmaps[idx][keep]
            denom = c.sum(dim=(1, 2, 3, 4)).clamp_min(1e-3) * x0.shape[1]
            err_r = ((pred[keep] - (noise - x0)[keep]).square() * c).sum(dim=(1, 2, 3, 4)) / denom
            err_w = ((pred_w - (noise - x0)[keep]).square() * c).sum(dim=(1, 2, 3, 4)) / denom
            loss = loss + F.relu(1.1 * err_r - err_w).mean()
        elif cmaps is not None:
            loss = tts.weighted_mse(pred, noise - x0, x0, bg, fg, cmaps[idx], float(loss_kind[len("contrast"):]))
        elif loss_kind == "x0":  # error of the clean-latent estimate xt - s*v, i.e. v error scaled by s,
            # renormalised so its mean weight is 1 (emphasises the low-noise steps where corners are drawn)
            w = s.square() / s.square().mean()
            loss = tts.weighted_mse(pred * w.sqrt(), (noise - x0) * w.sqrt(), x0, bg, fg)
        else:
            loss = tts.weighted_mse(pred, noise - x0, x0, bg, fg)
        tts.optimizer_step(opt, models.parameters(), loss)
        tts.ema_update(ema, models, step, args.ema)
        losses.append(loss.item())
        if step % 50 == 0:
            print(f"{args.variant} step {step} loss {np.mean(losses[-50:]):.4f} lr {lr:.1e} {time.time() - t0:.0f}s",
                  flush=True)
    train_s = time.time() - t0
    t = time.time()
    res = judge_model(ema["dit"], ema["ctx"], vae, args.seeds_per_prompt)
    res["shape_word_effect"] = shape_word_effect(ema["dit"], ema["ctx"], data["pairs"])
    if kind == "text":
        e = lambda p: F.normalize(tts.encode_text(tok, ema["ctx"].te, [p], torch.device("cpu")).flatten(1), dim=1)  # noqa: E731
    else:
        e = lambda p: F.normalize(ema["ctx"].table[[s.prompt for s in STILLS].index(p)].flatten()[None], dim=1)  # noqa: E731
    with torch.no_grad():
        res["cosine_red_circle_square"] = float((e("a red circle") * e("a red square")).sum())
    res.update({"variant": args.variant, "context": kind, "te_lr_mult": te_mult, "train_shift": shift,
                "fg_weight": fg, "loss": loss_kind, "steps": step, "batch": args.batch, "lr": args.lr,
                "train_seconds": round(train_s), "judge_seconds": round(time.time() - t),
                "final_loss": float(np.mean(losses[-50:])) if losses else None})
    print(json.dumps(res, indent=1))
    record(f"train/{args.variant}/{args.tag}" if args.tag else f"train/{args.variant}", res)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("cache")
    c.add_argument("--n", type=int, default=4096)
    c.add_argument("--pairs", type=int, default=64)
    c.add_argument("--seed", type=int, default=0)
    sub.add_parser("analyse")
    t = sub.add_parser("train")
    t.add_argument("--variant", choices=sorted(VARIANTS), required=True)
    t.add_argument("--seconds", type=float, default=480.0)
    t.add_argument("--batch", type=int, default=32)
    t.add_argument("--lr", type=float, default=2e-4)
    t.add_argument("--ema", type=float, default=0.99)
    t.add_argument("--seeds-per-prompt", type=int, default=4)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--tag", default="")
    args = p.parse_args()
    {"cache": cmd_cache, "analyse": cmd_analyse, "train": cmd_train}[args.cmd](args)


if __name__ == "__main__":
    main()
