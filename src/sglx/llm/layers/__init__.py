"""Building blocks of sglx's LLMs: norms, rotary embeddings, gated MLP and the backend-dispatching attention."""

from sglx.llm.layers.attention import Attention
from sglx.llm.layers.mlp import GatedMLP
from sglx.llm.layers.norm import RMSNorm
from sglx.llm.layers.rotary import SUPPORTED_ROPE_TYPES, RotaryEmbedding, rope_inv_freq

__all__ = ["Attention", "GatedMLP", "RMSNorm", "RotaryEmbedding", "SUPPORTED_ROPE_TYPES", "rope_inv_freq"]
