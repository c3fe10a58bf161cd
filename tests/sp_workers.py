"""Worker functions for the sequence-parallel tests: run in spawned ranks (gloo on CPU, NCCL on GPUs)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from sglx.attention.diffusion.metadata import DiTAttnMetadata
from sglx.attention.diffusion.sdpa import TorchSDPABackend
from sglx.diffusion.parallel.attention import SequenceParallelBackend
from sglx.diffusion.parallel.collectives import gather_seq
from sglx.diffusion.parallel.degrees import SPDegrees
from sglx.diffusion.parallel.groups import sp_groups
from sglx.distributed.group import destroy_distributed, init_distributed

GRID = (2, 4, 8)  # 64 latent tokens
VSA_GRID = (4, 4, 8)  # two whole 4x4x4 cubes (GRID's two 2x4x4 edge cubes pack into one block: dense)
HEADS, DIM, BATCH = 4, 16, 2
STA_WINDOWS = ((1, 1, 1), (1, 1, 3), (2, 1, 1), (2, 2, 3))  # one per head, so each rank's heads differ


def sdpa64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Float64 reference over [B, S, H, D]."""
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    out = F.scaled_dot_product_attention(*(t.double().transpose(1, 2) for t in (q, k, v)))
    return out.transpose(1, 2)


def write_sta_strategy(path: Path, layers: int = 1) -> Path:
    data = {f"0_{layer}_{h}": list(w) for layer in range(layers) for h, w in enumerate(STA_WINDOWS)}
    path.write_text(json.dumps(data))
    return path


SPARSE = ("sta", "vsa", "vmoba", "svg2")


def sparse_backend(name: str, strategy: str):  # type: ignore[no-untyped-def]
    """Each sparse backend configured to be really sparse on GRID at step 0, layer 0."""
    if name == "sta":
        return sta_backend(Path(strategy))
    if name == "vsa":
        from sglx.attention.diffusion.sparse.video_sparse import VideoSparseAttentionBackend

        return VideoSparseAttentionBackend({"sparsity": 0.5})  # VSA_GRID's 2 cubes: each query cube keeps 1
    if name == "vmoba":
        from sglx.attention.diffusion.sparse.vmoba import VMoBABackend

        return VMoBABackend({"first_full_step": 0, "temporal_chunk_size": 1, "temporal_topk": 1})
    from sglx.attention.diffusion.sparse.svg2 import SparseVideoGen2Backend

    return SparseVideoGen2Backend({"num_q_centroids": 4, "num_k_centroids": 4, "top_p_kmeans": 0.5,
                                   "min_kc_ratio": 0.0, "first_times_fp": 0.0, "first_layers_fp": 0.0})


def sta_backend(strategy: Path):  # type: ignore[no-untyped-def]
    from sglx.attention.diffusion.sparse.sliding_tile import SlidingTileAttentionBackend

    return SlidingTileAttentionBackend({"mask_strategy_file_path": str(strategy), "skip_time_steps": 0},
                                       tile=(1, 2, 2), block=4)


def _inputs(seed: int, text: int, kv_heads: int, dtype: torch.dtype, grid: tuple[int, int, int] = GRID
            ) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    s = grid[0] * grid[1] * grid[2] + text
    q = torch.randn(BATCH, s, HEADS, DIM, generator=gen).to(dtype)
    k = torch.randn(BATCH, s, kv_heads, DIM, generator=gen).to(dtype)
    v = torch.randn(BATCH, s, kv_heads, DIM, generator=gen).to(dtype)
    return q, k, v


def _shard(x: torch.Tensor, meta: DiTAttnMetadata, rank: int, world: int) -> torch.Tensor:
    """This rank's input: all text tokens (in place) plus its chunk of the latent tokens."""
    t, n = meta.text_tokens, x.shape[1]
    text, img = (x[:, :t], x[:, t:]) if meta.text_position == "prefix" else (x[:, n - t:], x[:, :n - t])
    img = img.chunk(world, dim=1)[rank]
    return torch.cat([text, img] if meta.text_position == "prefix" else [img, text], dim=1)


def _unshard(out: torch.Tensor, meta: DiTAttnMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Full output in sequence order from every rank's local output; and the largest text-row difference
    between this rank and rank 0 (text outputs must be identical on all ranks)."""
    t = meta.text_tokens
    prefix = meta.text_position == "prefix"
    text, img = (out[:, :t], out[:, t:]) if prefix else (out[:, out.shape[1] - t:], out[:, :out.shape[1] - t])
    img = gather_seq(img)
    text0 = text.clone().contiguous()
    if torch.distributed.is_initialized():
        torch.distributed.broadcast(text0, src=0)
    full = torch.cat([text, img] if prefix else [img, text], dim=1)
    return full, (text - text0).abs().max() if t else torch.zeros(())


def attention_cases(rank: int, world: int, splits: list[tuple[int, int]], device: str,
                    strategy: str | None = None, dtype: str = "float32") -> dict[str, dict[str, float]]:
    """Per (ulysses, ring) split: every case's max |SP output - reference| and the text-row spread across ranks."""
    torch.set_num_threads(1)  # tiny shapes; several ranks share the CPU cores
    ctx = init_distributed(device=device)
    try:
        return {f"u{u}r{r}": _cases(rank, world, u, r, ctx.device, strategy, getattr(torch, dtype))
                for u, r in splits}
    finally:
        destroy_distributed()


def _cases(rank: int, world: int, ulysses: int, ring: int, dev: torch.device, strategy: str | None,
           dtype: torch.dtype) -> dict[str, float]:
    groups = sp_groups(SPDegrees(ulysses, ring))
    results: dict[str, float] = {}
    cases = [("dense", 0, "none", HEADS), ("prefix_text", 6, "prefix", HEADS), ("suffix_text", 5, "suffix", HEADS),
             ("gqa", 0, "none", 2), ("gqa_kv1_text", 3, "prefix", 1)]
    for i, (name, text, pos, kv_heads) in enumerate(cases):
        meta = DiTAttnMetadata(grid=GRID, num_heads=HEADS, head_dim=DIM, text_tokens=text, text_position=pos)
        q, k, v = (t.to(dev) for t in _inputs(i, text, kv_heads, dtype))
        sp = SequenceParallelBackend(TorchSDPABackend(), groups)
        local = [_shard(t, meta, rank, world) for t in (q, k, v)]
        out = sp.forward(*local, meta=meta, layer=0)
        full, spread = _unshard(out, meta)
        results[name] = float((full.double() - sdpa64(q, k, v)).abs().max())
        results[name + "_text_spread"] = float(spread)
    if strategy is not None and ring == 1:  # sparse backends: the full-grid metadata, each rank's heads
        for name in SPARSE:
            grid = VSA_GRID if name == "vsa" else GRID
            meta = DiTAttnMetadata(grid=grid, num_heads=HEADS, head_dim=DIM, text_tokens=4, text_position="prefix",
                                   num_layers=1)
            q, k, v = (t.to(dev) for t in _inputs(99, 4, HEADS, dtype, grid))
            single = sparse_backend(name, strategy).forward(q, k, v, meta=meta, layer=0)
            sp = SequenceParallelBackend(sparse_backend(name, strategy), groups)
            local = [_shard(t, meta, rank, world) for t in (q, k, v)]
            full, _ = _unshard(sp.forward(*local, meta=meta, layer=0), meta)
            results[f"{name}_vs_sp1"] = float((full - single).abs().max())
            results[f"{name}_vs_dense"] = float((full.double() - sdpa64(q, k, v)).abs().max())
    return results


WAN_REQUEST = dict(prompt="a red circle moving right", negative_prompt="blue", height=32, width=32, num_frames=1,
                   num_inference_steps=2, guidance_scale=4.0, seed=3)
WAN_CLI_ARGS = ["--prompt", "a red circle moving right", "--negative-prompt", "blue", "--height", "32", "--width", "32",
                "--num-frames", "1", "--num-inference-steps", "2", "--guidance-scale", "4.0", "--seed", "3"]
FLUX_REQUEST = dict(prompt="a green square on black", height=32, width=48, num_inference_steps=2, seed=4)


def model_frames(model_dir: str, request: dict[str, Any], device: str = "cpu", **sp_flags: int | None
                 ) -> tuple[torch.Tensor, int]:
    """Float frames [F, H, W, 3] for `request` under the given sequence-parallel flags, and the number of latent
    tokens the first DiT block's attention got on this rank (Wan: its self-attention; FLUX: the image stream)."""
    from sglx.diffusion.engine import DiffusionEngine
    from sglx.diffusion.request import DiffusionRequest
    from sglx.llm.engine_config import EngineConfig

    config = EngineConfig(model_path=model_dir, device=device, dtype="float32", **sp_flags)
    with DiffusionEngine(config) as engine:
        seen: list[int] = []  # the shard, not the whole sequence
        model = engine.pipeline.transformer
        attn = model.blocks[0].attn1 if hasattr(model, "blocks") else model.transformer_blocks[0].attn
        hook = attn.register_forward_pre_hook(
            lambda _m, args, kwargs: seen.append(int((args[0] if args else kwargs["hidden_states"]).shape[1])),
            with_kwargs=True)
        frames, _ = engine.pipeline.generate_tensor(engine.resolve(DiffusionRequest(**request)))
        hook.remove()
        return frames, seen[0]


def pipeline_sp_cases(rank: int, world: int, cases: list[tuple[str, str, dict[str, Any], int, int]], device: str,
                      cli_args: list[str] | None = None) -> dict[str, Any]:
    """Per named case (model dir, request, ulysses, ring): rank 0's frames (other ranks skip the VAE: empty) and
    the tokens this rank's DiT saw; numpy, since tensors would travel back through shared memory that the
    exiting rank takes with it. Then `sglx generate cli_args` in this rank, as under torchrun: the exit code."""
    torch.set_num_threads(1)
    init_distributed(device=device)
    try:
        out: dict[str, Any] = {}
        for name, model_dir, request, u, r in cases:
            frames, tokens = model_frames(model_dir, request, device, ulysses_degree=u, ring_degree=r)
            out[name], out[name + "_tokens"] = frames.cpu().numpy(), tokens
        if cli_args is not None:
            from typer.testing import CliRunner

            from sglx.cli.app import app

            res = CliRunner().invoke(app, cli_args)
            out["cli_exit"], out["cli_output"] = res.exit_code, res.output
        return out
    finally:
        destroy_distributed()


def probe_job(config: Any, folder: str) -> None:
    """A job for launch_ranks: each rank writes who it is (rank, world, backend) to a file of its own."""
    import torch.distributed as dist

    rank = dist.get_rank()
    Path(folder, f"rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "world": dist.get_world_size(), "backend": dist.get_backend(), "sp": config.sp_size}))
