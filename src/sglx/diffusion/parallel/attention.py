"""Sequence-parallel DiT attention (Ulysses, ring, USP) around any registry diffusion backend.

`SequenceParallelBackend` wraps the backend the engine selected and is what every `DiTAttention` of the DiT
calls. Each rank holds `image_tokens / sp` latent tokens plus ALL joint text tokens (FLUX's prefix text is
replicated, not sharded). Self-attention, on each rank:

1. Ulysses (degree u): an all-to-all turns the rank's latent chunk of every head into the Ulysses group's
   latent super-chunk of H/u heads; the text tokens are already whole, so the rank just takes its H/u heads.
2. Ring degree 1: the wrapped backend attends the whole sequence of those heads with the step's full-grid
   DiTAttnMetadata (`head_offset` says which heads), so sparse masks (STA tiles, VSA cubes, ...) are exactly
   those of one process. Ring degree r > 1: key/value super-chunks travel around the ring group, each step
   attends one block on the selected backend's LSE kernel (or the documented PyTorch SDPA fallback for a dense
   backend without one; sparse backends are refused) and the partial results merge by log-sum-exp
   (lse_attention.py); text keys join the rank's own block once.
3. The inverse all-to-all returns the rank's latent chunk of every head; text outputs are gathered over heads.

Cross-attention (latent queries, replicated text keys) needs no communication: `forward_dense` runs locally.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch
import torch.distributed as dist

from sglx.attention.diffusion.base import DiffusionAttentionBackend
from sglx.attention.diffusion.metadata import DiTAttnMetadata
from sglx.diffusion.parallel.collectives import RingExchange, gather_heads, heads_to_seq, seq_to_heads_many
from sglx.diffusion.parallel.groups import SPGroups
from sglx.diffusion.parallel.lse_attention import LSEMerger, RingStepAttention, ring_step_attention
from sglx.errors import SglxError

log = logging.getLogger("sglx.diffusion")

# vmoba thresholds whose top-k / cumulative groups span heads: a rank holding some heads would pick differently.
HEAD_COUPLED_VMOBA = ("block", "overall")


def check_backend_for_sp(backend: DiffusionAttentionBackend, groups: SPGroups) -> None:
    """One-line SglxError when `backend` cannot give the single-process result under this split."""
    deg = groups.degrees
    if deg.ring > 1 and backend.sparse:
        raise SglxError(f"--ring-degree {deg.ring}: ring attention merges dense partial results, but "
                        f"{backend.name} is a sparse backend whose pattern needs the whole sequence; use "
                        f"--ulysses-degree {deg.size} --ring-degree 1 (heads permitting) or a dense backend")
    if deg.ulysses > 1 and backend.name == "sliding_tile_attn" and getattr(backend, "search", None) is not None:
        raise SglxError("sliding_tile_attn sta_mode STA_searching records every head's error in one file; run the "
                        "search with --sp-size 1, then STA_inference runs under sequence parallelism")
    vmoba = getattr(backend, "vmoba", None)
    if deg.ulysses > 1 and vmoba is not None and vmoba.moba_threshold_type in HEAD_COUPLED_VMOBA:
        raise SglxError(f"vmoba moba_threshold_type {vmoba.moba_threshold_type} selects chunks across all heads, but "
                        f"--ulysses-degree {deg.ulysses} gives each rank a slice of the heads; use "
                        "moba_threshold_type query_head or head_global, or --sp-size 1")


class SequenceParallelBackend(DiffusionAttentionBackend):
    """The selected backend, run over the sequence shared by the ranks of `groups`."""

    def __init__(self, inner: DiffusionAttentionBackend, groups: SPGroups) -> None:
        super().__init__(inner.config)
        check_backend_for_sp(inner, groups)
        self.inner = inner
        self.groups = groups
        self.name = inner.name  # type: ignore[misc]  # what the engine reports: the backend doing the work
        self.sparse = inner.sparse  # type: ignore[misc]
        self.ring_step: RingStepAttention | None = None
        if groups.degrees.ring > 1:
            self.ring_step = ring_step_attention(inner)
            log.log(logging.INFO if self.ring_step.own_kernel else logging.WARNING,
                    "ring attention (degree %d): each ring step on %s", groups.degrees.ring,
                    self.ring_step.description)

    def local_seq_len(self, meta: DiTAttnMetadata) -> int:
        return -(-meta.image_tokens // self.groups.world_size) + meta.text_tokens  # padded chunks (sharding.py)

    def forward_dense(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                      scale: float | None = None) -> torch.Tensor:
        """Cross-attention: this rank's latent queries against replicated text keys, no communication."""
        return self.inner.forward_dense(q, k, v, scale=scale)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
                meta: DiTAttnMetadata | None = None, layer: int = 0) -> torch.Tensor:
        u = self.groups.degrees.ulysses
        text, prefix = (meta.text_tokens, meta.text_position == "prefix") if meta is not None else (0, True)
        if meta is not None and q.shape[1] != self.local_seq_len(meta):
            raise RuntimeError(f"DiT layer {layer}: rank {self.groups.rank} holds {q.shape[1]} tokens, expected "
                               f"ceil({meta.image_tokens} / {self.groups.world_size}) latent + {text} text")
        if k.shape[2] != q.shape[2] and k.shape[2] % u:  # too few KV heads to split: give every query head its own
            rep = q.shape[2] // k.shape[2]
            k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)

        def split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            if not text:
                return x[:, :0], x
            return (x[:, :text], x[:, text:]) if prefix else (x[:, -text:], x[:, :-text])

        def join(t: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
            if not text:
                return i
            return torch.cat([t, i] if prefix else [i, t], dim=1)

        def my_heads(x: torch.Tensor) -> torch.Tensor:
            h = x.shape[2] // u
            r = self.groups.ulysses_rank
            return x[:, :, r * h:(r + 1) * h]

        texts, images = zip(*(split(x) for x in (q, k, v)))
        tokens = images[0].shape[1] * self.groups.world_size if meta is None else meta.image_tokens  # unpadded
        gathered = seq_to_heads_many(list(images), self.groups.ulysses_group, u)  # one all-to-all for q, k, v
        if self.groups.degrees.ring > 1:
            qh, kh, vh = (join(my_heads(t), i) for t, i in zip(texts, gathered))
            out = self._ring(qh, kh, vh, scale, text, split, join, tokens)
            out_t, out_i = split(out)
        else:  # the whole latent sequence is here: the padding (its tail) is cut off, the grid's own tokens remain
            padded = gathered[0].shape[1]
            qh, kh, vh = (join(my_heads(t), i[:, :tokens]) for t, i in zip(texts, gathered))
            head_offset = self.groups.ulysses_rank * (q.shape[2] // u)
            sub = None if meta is None else replace(meta, head_offset=head_offset)
            out = self.inner.forward(qh, kh, vh, scale=scale, meta=sub, layer=layer)
            out_t, out_i = split(out)
            if padded > tokens:
                out_i = torch.cat([out_i, out_i.new_zeros(out_i.shape[0], padded - tokens, *out_i.shape[2:])], 1)
        group = self.groups.ulysses_group
        return join(gather_heads(out_t, group, u), heads_to_seq(out_i, group, u))

    def _ring(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, text: int,
              split, join, tokens: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
        """Ring attention over the ring group: q stays, latent key/value blocks go round, results merge by LSE.

        Ring member j's block is the latent super-chunk [j*L, (j+1)*L) of the padded sequence; keys at `tokens`
        and beyond are padding and are left out (a block of padding only adds nothing)."""
        g = self.groups
        assert self.ring_step is not None  # set in __init__ when the ring degree is above 1
        k_text, k_img = split(k)
        v_text, v_img = split(v)
        kv = torch.stack([k_img, v_img])
        exchange = RingExchange(g.ring_group, g.ring_ranks, g.rank)
        merger = LSEMerger()
        steps = g.degrees.ring
        block = k_img.shape[1]
        for step in range(steps):
            incoming = exchange.start(kv) if step < steps - 1 else None
            source = (g.ring_rank - step) % steps  # the ring member whose block this is
            valid = min(max(tokens - source * block, 0), block)
            kb, vb = kv[0][:, :valid], kv[1][:, :valid]
            if step == 0 and text:  # text keys are whole on every rank: attend them once, with the own block
                kb, vb = join(k_text, kb), join(v_text, vb)
            if kb.shape[1]:
                merger.add(*self.ring_step.fn(q, kb, vb, scale))
            if incoming is not None:
                exchange.wait()
                kv = incoming
        out = merger.result(q.dtype)
        if text:  # every ring rank computed the text rows (merged in its own order): keep the first one's
            out_t, out_i = split(out)
            out_t = out_t.contiguous()
            dist.broadcast(out_t, src=g.ring_ranks[0], group=g.ring_group)
            out = join(out_t, out_i)
        return out
