"""What the decoder-only models share: the body's forward and the choice of which rows become logits.

Both bodies embed, compute the rotary tables once for the step, run layers that fold each residual add into the
next RMSNorm (`layer(x, residual, cos, sin, batch) -> (x, residual)`), and finish with the final norm; they differ
only in what they build (parallel embeddings, MLA rotary width), so that stays in each model's file.
"""

from __future__ import annotations

import torch
from torch import nn

from sglx.llm.forward_batch import ForwardBatch
from sglx.llm.layers import RMSNorm, RotaryEmbedding


class DecoderBody(nn.Module):
    """Subclasses set `embed_tokens`, `layers`, `norm` and `rotary` in their __init__."""

    embed_tokens: nn.Module
    layers: nn.ModuleList
    norm: RMSNorm
    rotary: RotaryEmbedding

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, batch)
        if residual is None:  # no layers, or the last layer returned the stream itself (folded norms, one row)
            return self.norm(x)
        return self.norm.add_and_norm(x, residual)[0]


def logit_hidden(body: DecoderBody, batch: ForwardBatch) -> torch.Tensor | None:
    """The hidden rows that become logits: each request's last token in prefill, every token in decode (one a
    request already) or when the batch asks for all logits; None on an IDLE step (no tokens: nothing to run)."""
    if batch.num_tokens == 0:
        return None
    hidden = body(batch.input_ids, batch.positions, batch)
    if not batch.return_all_logits and not batch.mode.is_decode:
        hidden = hidden[batch.last_token_indices()]
    return hidden


def no_logits(vocab_size: int, batch: ForwardBatch) -> torch.Tensor:
    """An IDLE step's logits: [0, vocab] float32."""
    return torch.empty((0, vocab_size), dtype=torch.float32, device=batch.input_ids.device)
