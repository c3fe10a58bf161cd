"""The compute floor of one prefill, measured in the same run: the model's GEMMs plus plain vendor attention.

A prefill of `batch_size` prompts of `input_len` tokens cannot beat the time its matrix products and
its attention take when each runs alone through the best library call on this device. So the floor
times, with torch directly on the model's own weights and dtype:

- every linear layer of one forward at the prefill's token count: qkv, o, gate/up and down of each
  decoder layer (one of each per distinct shape, multiplied by how many layers have it), and the LM
  head for the last token of each request only, as the engine computes it;
- causal self-attention of the same prefill per layer: SDPA on contiguous [B, H, L, D] tensors, on CUDA
  the fastest of cuDNN, flash and memory-efficient SDPA that accepts the call (GQA K/V expanded to the
  query heads beforehand, outside the timing), on a CPU PyTorch's own SDPA.

Norms, rotary, activation, the K/V store and launch gaps are not in it: the floor is a lower bound, and
the ratio prefill / floor says how much of a prefill is spent outside the two things it cannot avoid.
Only dense Llama-family decoders (Llama, Mistral, Qwen2, Qwen3) are counted; for others (MLA/MoE) the
floor is absent with the reason. Under tensor parallelism the shapes are this rank's (communication
not counted).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from sglx.bench.timing import TimingBudget, median_ms

PROJECTIONS = (("qkv", "self_attn", "qkv_proj"), ("o", "self_attn", "o_proj"), ("gate_up", "mlp", "gate_up_proj"),
               ("down", "mlp", "down_proj"))


@dataclass(frozen=True)
class GemmPart:
    """`count` products [m, k] x [k, n] (weight [n, k]) of one projection, timed once each."""

    name: str
    m: int
    n: int
    k: int
    count: int
    ms_per_call: float = 0.0

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k * self.count


@dataclass(frozen=True)
class AttentionPart:
    """`count` layers' causal attention over `batch` requests of `tokens` tokens (one call per layer)."""

    batch: int
    tokens: int
    q_heads: int
    kv_heads: int
    head_dim: int
    window: int | None
    count: int
    call: str = ""  # which SDPA kernel won
    ms_per_call: float = 0.0

    @property
    def flops(self) -> int:
        """QK^T and PV over the causally visible (and in-window) keys only."""
        n, w = self.tokens, self.window
        visible = sum(min(i + 1, w) for i in range(n)) if w else n * (n + 1) // 2
        return 4 * self.batch * self.q_heads * self.head_dim * visible * self.count


@dataclass(frozen=True)
class PrefillFloor:
    gemms: tuple[GemmPart, ...]
    attention: tuple[AttentionPart, ...]

    @property
    def gemm_ms(self) -> float:
        return sum(g.ms_per_call * g.count for g in self.gemms)

    @property
    def attention_ms(self) -> float:
        return sum(a.ms_per_call * a.count for a in self.attention)

    @property
    def floor_ms(self) -> float:
        return self.gemm_ms + self.attention_ms

    def as_dict(self) -> dict[str, object]:
        return {
            "prefill_floor_ms": self.floor_ms, "prefill_floor_gemm_ms": self.gemm_ms,
            "prefill_floor_attention_ms": self.attention_ms,
            "prefill_gemm_flops": sum(g.flops for g in self.gemms),
            "prefill_attention_flops": sum(a.flops for a in self.attention),
            "prefill_floor_gemms": [dict(name=g.name, m=g.m, n=g.n, k=g.k, count=g.count, ms_per_call=g.ms_per_call)
                                    for g in self.gemms],
            "prefill_floor_attention": [dict(batch=a.batch, tokens=a.tokens, q_heads=a.q_heads, kv_heads=a.kv_heads,
                                             head_dim=a.head_dim, window=a.window, count=a.count, call=a.call,
                                             ms_per_call=a.ms_per_call) for a in self.attention],
        }


def unsupported_reason(model: nn.Module) -> str | None:
    """Why the floor cannot be counted for this model (None: it can)."""
    from sglx.llm.models.llama import LlamaForCausalLM

    if isinstance(model, LlamaForCausalLM):
        return None
    return (f"the prefill floor counts dense Llama-family decoders (qkv, o, gate/up, down); "
            f"{type(model).__name__} has other layers (MLA/MoE)")


def _layers(model: nn.Module) -> list[nn.Module]:
    return list(model.model.layers)  # type: ignore[union-attr]


def gemm_parts(model: nn.Module, batch_size: int, input_len: int) -> tuple[tuple[GemmPart, ...], dict]:
    """The prefill's GEMMs grouped by (projection, shape), and one weight (and bias) per group to time with."""
    tokens = batch_size * input_len
    counts: dict[tuple[str, int, int, int], int] = {}
    weights: dict[tuple[str, int, int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}
    for layer in _layers(model):
        for name, block, proj in PROJECTIONS:
            linear = getattr(getattr(layer, block), proj)
            n, k = linear.weight.shape
            key = (name, tokens, n, k)
            counts[key] = counts.get(key, 0) + 1
            weights.setdefault(key, (linear.weight, linear.bias))
    head = model.lm_head_weight  # type: ignore[attr-defined]  # the LM head runs on each request's last token
    key = ("lm_head", batch_size, head.shape[0], head.shape[1])
    counts[key], weights[key] = 1, (head, None)
    parts = tuple(GemmPart(name, m, n, k, count) for (name, m, n, k), count in counts.items())
    return parts, weights


def attention_parts(model: nn.Module, batch_size: int, input_len: int) -> tuple[AttentionPart, ...]:
    """One part per distinct attention layer shape (heads, head dim, sliding window) and its layer count."""
    counts: dict[tuple, int] = {}
    for layer in _layers(model):
        spec = layer.self_attn.attn.spec
        window = spec.sliding_window if spec.sliding_window and spec.sliding_window < input_len else None
        key = (spec.num_q_heads, spec.num_kv_heads, spec.head_dim, window)
        counts[key] = counts.get(key, 0) + 1
    return tuple(AttentionPart(batch_size, input_len, hq, hkv, d, w, count)
                 for (hq, hkv, d, w), count in counts.items())


def _sdpa_choices(device: torch.device) -> list[tuple[str, Callable[[], contextlib.AbstractContextManager]]]:
    if device.type != "cuda":
        return [("sdpa (PyTorch's choice)", contextlib.nullcontext)]
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return [(f"sdpa {label}", lambda b=backend: sdpa_kernel([b]))  # type: ignore[misc]
            for label, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                                   ("efficient", SDPBackend.EFFICIENT_ATTENTION))]


def _time_attention(part: AttentionPart, dtype: torch.dtype, device: torch.device, budget: TimingBudget,
                    gen: torch.Generator) -> AttentionPart:
    b, n, hq, d = part.batch, part.tokens, part.q_heads, part.head_dim
    q, k, v = (torch.randn(b, hq, n, d, generator=gen, device=device, dtype=dtype) for _ in range(3))
    mask = None
    if part.window:  # query i sees keys i - window < j <= i
        i = torch.arange(n, device=device)
        mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - part.window)
    scale = d ** -0.5

    def call() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale)

    best: tuple[float, str] | None = None
    refusals = []
    for label, context in _sdpa_choices(device):
        try:
            with context():
                call()
                ms = median_ms(call, device, budget).median_ms
        except RuntimeError as exc:  # this SDPA kernel refuses the shape, dtype or mask
            refusals.append(f"{label}: {str(exc).splitlines()[0][:80]}")
            continue
        if best is None or ms < best[0]:
            best = (ms, label)
    if best is None:
        raise RuntimeError("no SDPA kernel ran the prefill attention: " + "; ".join(refusals))
    return AttentionPart(b, n, hq, part.kv_heads, d, part.window, part.count, best[1], best[0])


def measure_prefill_floor(model: nn.Module, batch_size: int, input_len: int, device: torch.device,
                          budget: TimingBudget = TimingBudget(), seed: int = 0) -> PrefillFloor:
    """Time the prefill's GEMMs (on the model's own weights) and its attention (SDPA); see the module doc."""
    parts, weights = gemm_parts(model, batch_size, input_len)
    dtype = next(iter(weights.values()))[0].dtype
    gen = torch.Generator(device=device).manual_seed(seed)  # inputs made on the device (bs64: GBs)
    timed = []
    with torch.inference_mode():
        for part in parts:
            weight, bias = weights[(part.name, part.m, part.n, part.k)]
            x = torch.randn(part.m, part.k, generator=gen, device=device, dtype=dtype)
            ms = median_ms(lambda x=x, w=weight, b=bias: F.linear(x, w, b), device, budget).median_ms
            timed.append(GemmPart(part.name, part.m, part.n, part.k, part.count, ms))
            del x
        attention = tuple(_time_attention(a, dtype, device, budget, gen)
                          for a in attention_parts(model, batch_size, input_len))
    return PrefillFloor(tuple(timed), attention)
