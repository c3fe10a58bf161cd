"""The DeepSeek-V2/V3 parts of a config.json: MLA attention shape and MoE routing, normalized once.

V2 and V3 share one layout; they differ in defaults (V2 routes with softmax scores and `greedy` or
`group_limited_greedy`; V3 with sigmoid scores, `noaux_tc` and a per-expert score-correction bias) and in
whether q goes through a low-rank projection (`q_lora_rank`; None for DeepSeek-V2-Lite).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from sglx.errors import SglxError

TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention shape of one DeepSeek model."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True  # DeepSeek checkpoints rotate interleaved pairs (x0, x1), (x2, x3), ...
    attention_bias: bool = False

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def attention_parameters(self, hidden: int, heads: int) -> int:
        """Weights of one MLA layer (q path, kv_a + its norm, kv_b, o_proj; biases when attention_bias)."""
        if self.q_lora_rank:
            q = hidden * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * heads * self.qk_head_dim
        else:
            q = hidden * heads * self.qk_head_dim
        kv = hidden * self.latent_dim + self.kv_lora_rank + self.kv_lora_rank * heads * (
            self.qk_nope_head_dim + self.v_head_dim)
        bias = (self.q_lora_rank or 0) + self.latent_dim + hidden if self.attention_bias else 0
        return q + kv + heads * self.v_head_dim * hidden + bias

    def softmax_scale(self, rope_scaling: dict[str, Any] | None) -> float:
        """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (DeepSeek's long-context fix)."""
        scale = self.qk_head_dim ** -0.5
        params = rope_scaling or {}
        if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
            m = yarn_mscale(float(params["factor"]), float(params["mscale_all_dim"]))
            scale = scale * m * m
        return scale


@dataclass(frozen=True)
class MoEConfig:
    """Routed + shared experts and how tokens pick them."""

    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int
    first_k_dense_replace: int
    moe_layer_freq: int
    topk_method: str
    scoring_func: str  # "softmax" (V2) | "sigmoid" (V3)
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id >= self.first_k_dense_replace and layer_id % self.moe_layer_freq == 0


def parse_deepseek(raw: dict[str, Any], architecture: str, source: str) -> tuple[MLAConfig, MoEConfig | None]:
    """MLA and MoE configs from a DeepSeek-V2/V3 config.json; SglxError for what sglx cannot run."""
    where = source or "config.json"
    quant = raw.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise SglxError(f"{where}: quantized checkpoints ({method}) are not supported; sglx loads bf16/fp16/fp32 "
                        "weights (DeepSeek-V3's fp8 release must be dequantized to bf16 first).")
    v3 = architecture == "DeepseekV3ForCausalLM"
    try:
        mla = MLAConfig(
            q_lora_rank=int(raw["q_lora_rank"]) if raw.get("q_lora_rank") else None,
            kv_lora_rank=int(raw["kv_lora_rank"]),
            qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
            qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
            v_head_dim=int(raw["v_head_dim"]),
            rope_interleave=bool(raw.get("rope_interleave", True)) if v3 else True,
            attention_bias=bool(raw.get("attention_bias", False)),
        )
    except KeyError as exc:
        raise SglxError(f"{where}: missing required MLA field {exc.args[0]!r}") from exc
    n_experts = int(raw.get("n_routed_experts") or 0)
    if not n_experts:
        return mla, None
    method = raw.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    if method not in TOPK_METHODS:
        raise SglxError(f"{where}: topk_method {method!r} is not supported; sglx routes with "
                        f"{', '.join(TOPK_METHODS)}.")
    scoring = raw.get("scoring_func") or ("sigmoid" if v3 else "softmax")
    if scoring not in ("softmax", "sigmoid"):
        raise SglxError(f"{where}: scoring_func {scoring!r} is not supported (softmax or sigmoid).")
    n_group = int(raw.get("n_group") or 1)
    topk_group = int(raw.get("topk_group") or n_group)
    if n_experts % n_group or topk_group > n_group:
        raise SglxError(f"{where}: {n_experts} routed experts cannot form {n_group} groups with top {topk_group}.")
    try:
        moe = MoEConfig(
            n_routed_experts=n_experts,
            num_experts_per_tok=int(raw["num_experts_per_tok"]),
            moe_intermediate_size=int(raw["moe_intermediate_size"]),
            n_shared_experts=int(raw.get("n_shared_experts") or 0),
            first_k_dense_replace=int(raw.get("first_k_dense_replace") or 0),
            moe_layer_freq=int(raw.get("moe_layer_freq") or 1),
            topk_method=method,
            scoring_func=scoring,
            n_group=n_group,
            topk_group=topk_group,
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(raw.get("norm_topk_prob", v3)),
        )
    except KeyError as exc:
        raise SglxError(f"{where}: missing required MoE field {exc.args[0]!r}") from exc
    return mla, moe
