"""Split a DiT's latent token sequence across the sequence-parallel ranks, and gather its output.

Forward hooks on the diffusers transformer (no copy of its forward): each rank keeps chunk `rank` of the
latent tokens, in row-major (t, h, w) order, from the patch embedding to the output projection; text tokens
stay whole on every rank. A token count that does not divide by the ranks is zero-padded at the end (the last
rank(s) hold the padding; attention.py leaves padded keys out, the gather cuts their outputs off). The output
projection's result is gathered, so every rank gets the whole prediction, runs the same scheduler step and holds
the whole latents for the VAE.

- Wan: rotary tables [1, S, 1, D] (`rope` output), the tokens entering `blocks[0]` and, for Wan2.2 TI2V's
  per-token timesteps, the time embeddings are split; cross-attention reads the replicated text.
- FLUX: the packed latents `hidden_states` [B, S, C] and their `img_ids` [S, 3] are split on the way in, so the
  rotary tables are [text rows, this rank's image rows], as the joint attention expects.
"""

from __future__ import annotations

from typing import Any

import torch

from sglx.diffusion.parallel.collectives import gather_seq
from sglx.errors import SglxError


def padded_len(tokens: int, world: int) -> int:
    """The latent length every rank's chunk adds up to: `tokens` rounded up to a multiple of `world`."""
    return -(-tokens // world) * world


def _chunk(x: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    """Chunk `rank` of `x` along `dim`, zero-padded at the end to a multiple of `world` (attention leaves the
    padded keys out; their outputs are cut off after the gather)."""
    pad = padded_len(x.shape[dim], world) - x.shape[dim]
    if pad:
        shape = list(x.shape)
        shape[dim] = pad
        x = torch.cat([x, x.new_zeros(shape)], dim=dim)
    return x.chunk(world, dim=dim)[rank].contiguous()


def _gather(out: torch.Tensor, tokens: int) -> torch.Tensor:
    """Every rank's chunk along dim 1, the padding cut off."""
    return gather_seq(out, dim=1)[:, :tokens]


def shard_wan(transformer: Any, rank: int, world: int) -> list[Any]:
    seen = {"tokens": 0}  # this forward's latent tokens before padding (the rotary tables cover all of them)

    def rope_out(_module: Any, _args: Any, out: Any) -> Any:
        seen["tokens"] = out[0].shape[1]
        return tuple(_chunk(t, 1, rank, world) for t in out)

    def first_block_in(_module: Any, args: tuple, kwargs: dict) -> Any:
        return (_chunk(args[0], 1, rank, world), *args[1:]), kwargs

    def per_token_time(_module: Any, _args: Any, out: tuple) -> tuple:
        """Wan2.2 TI2V (expand_timesteps): temb [B, S, D] and its projection [B, S, 6D] are per latent token."""
        temb, proj, *rest = out
        if temb.ndim == 3:
            temb, proj = _chunk(temb, 1, rank, world), _chunk(proj, 1, rank, world)
        return (temb, proj, *rest)

    def proj_out(_module: Any, _args: Any, out: torch.Tensor) -> torch.Tensor:
        return _gather(out, seen["tokens"])

    return [transformer.rope.register_forward_hook(rope_out),
            transformer.condition_embedder.register_forward_hook(per_token_time),
            transformer.blocks[0].register_forward_pre_hook(first_block_in, with_kwargs=True),
            transformer.proj_out.register_forward_hook(proj_out)]


def shard_flux(transformer: Any, rank: int, world: int) -> list[Any]:
    seen = {"tokens": 0}  # this forward's latent tokens before padding

    def inputs(_module: Any, args: tuple, kwargs: dict) -> Any:
        if args or "hidden_states" not in kwargs or "img_ids" not in kwargs:
            raise RuntimeError("sequence-parallel FLUX expects hidden_states= and img_ids= keyword arguments")
        seen["tokens"] = kwargs["hidden_states"].shape[1]
        img_ids = kwargs["img_ids"]
        img_ids = img_ids[0] if img_ids.ndim == 3 else img_ids
        return args, {**kwargs, "hidden_states": _chunk(kwargs["hidden_states"], 1, rank, world),
                      "img_ids": _chunk(img_ids, 0, rank, world)}

    def proj_out(_module: Any, _args: Any, out: torch.Tensor) -> torch.Tensor:
        return _gather(out, seen["tokens"])

    return [transformer.register_forward_pre_hook(inputs, with_kwargs=True),
            transformer.proj_out.register_forward_hook(proj_out)]


SHARDERS = {"wan": shard_wan, "flux": shard_flux}


def shard_pipeline(pipeline: Any, rank: int, world: int) -> list[Any]:
    """Install the hooks on every transformer of a native pipeline; returns their handles."""
    sharder = SHARDERS.get(pipeline.family)
    if sharder is None:
        raise SglxError(f"sequence parallelism is not implemented for the {pipeline.family} family; use --sp-size 1")
    handles = []
    for name in ("transformer", "transformer_2"):
        model = getattr(pipeline, name, None)
        if model is not None:
            handles += sharder(model, rank, world)
    return handles

