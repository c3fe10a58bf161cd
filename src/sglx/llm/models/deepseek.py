"""DeepSeek-V2/V3 (and V2-Lite, R1): multi-head latent attention, MoE with shared experts, dense first layers.

Attention: q from `q_proj` (V2-Lite) or the low-rank `q_a_proj -> q_a_layernorm -> q_b_proj` (V2, V3);
`kv_a_proj_with_mqa` gives the latent c_kv (normalized by kv_a_layernorm) and one shared rope key k_pe;
RoPE (YaRN as configured, interleaved pairs as DeepSeek's checkpoints) rotates q_pe and k_pe only. The MLA
backend caches [c_kv, k_pe] per token and applies kv_b_proj (W_UK, W_UV) itself: absorbed for decode,
expanded for prefill. The softmax scale carries YaRN's mscale^2, as the reference models do.
Weights load from the Hugging Face layout (per-expert tensors, or transformers' stacked `experts.gate_up_proj`);
the multi-token-prediction layers some checkpoints append (layer index >= num_hidden_layers) are skipped.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch
from torch import nn

from sglx.attention.llm.mla_base import MLALayerSpec, MLAProjections
from sglx.errors import SglxError
from sglx.llm.forward_batch import ForwardBatch
from sglx.llm.kernels import use_fused
from sglx.llm.layers import GatedMLP, RMSNorm, RotaryEmbedding
from sglx.llm.layers.linear import Linear, linear
from sglx.llm.layers.moe import DeepseekMoE, experts_graph_safe
from sglx.llm.mla_kv_cache import MLATokenKVPool
from sglx.llm.model_config import ModelConfig
from sglx.llm.models.decoder import DecoderBody, logit_hidden, no_logits

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm use the default eps in the reference code


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved pairs (x0, x1), (x2, x3)...; output de-interleaved ([evens', odds']), as HF's
    DeepSeek-V3 does: q and k get the same permutation, so every q.k product is unchanged.
    x [T, h, d], cos/sin [T, d] (NeoX layout: the first half holds each frequency once)."""
    half = x.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def rotate_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class DeepseekMLAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        mla = config.mla
        assert mla is not None
        self.mla = mla
        h = config.num_heads
        hidden = config.hidden_size
        if mla.q_lora_rank:
            self.q_a_proj = nn.Linear(hidden, mla.q_lora_rank, bias=mla.attention_bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, h * mla.qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(hidden, h * mla.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, mla.latent_dim, bias=mla.attention_bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(mla.kv_lora_rank, h * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False)
        self.o_proj = Linear(h * mla.v_head_dim, hidden, bias=mla.attention_bias, skinny=True)
        self.spec = MLALayerSpec(layer_id=layer_id, num_heads=h, qk_nope_head_dim=mla.qk_nope_head_dim,
                                 qk_rope_head_dim=mla.qk_rope_head_dim, v_head_dim=mla.v_head_dim,
                                 kv_lora_rank=mla.kv_lora_rank, scaling=mla.softmax_scale(config.rope_scaling))
        self._rotate: Callable[..., torch.Tensor] = rotate_interleaved if mla.rope_interleave else rotate_neox
        self._fused_in: tuple[torch.Tensor, torch.Tensor | None] | None = None  # see fuse_input_projections

    @property
    def _q_in_proj(self) -> nn.Linear:
        """The projection of the layer input on the query side: q_a_proj (q LoRA) or q_proj."""
        return self.q_a_proj if self.mla.q_lora_rank else self.q_proj

    def fuse_input_projections(self) -> None:
        """After loading: q_proj (or q_a_proj) and kv_a_proj_with_mqa both read the layer's input, so their weights
        (and biases, zeros where one has none) move into one tensor, the two parameters become views of it, and
        forward runs one GEMM instead of two (one launch less a layer; loading into the parameters still works)."""
        q_lin, kv_lin = self._q_in_proj, self.kv_a_proj_with_mqa
        q_out = q_lin.weight.shape[0]
        with torch.no_grad():
            weight = torch.cat([q_lin.weight, kv_lin.weight])
            bias = None
            if q_lin.bias is not None or kv_lin.bias is not None:
                bias = torch.cat([lin.bias if lin.bias is not None else lin.weight.new_zeros(lin.weight.shape[0])
                                  for lin in (q_lin, kv_lin)])
        q_lin.weight.data, kv_lin.weight.data = weight[:q_out], weight[q_out:]
        if bias is not None:
            for lin, part in ((q_lin, bias[:q_out]), (kv_lin, bias[q_out:])):
                if lin.bias is not None:
                    lin.bias.data = part
        self._fused_in = (weight, bias)

    def fused_input_weight(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(weight, bias) of q_proj (or q_a_proj) and kv_a_proj_with_mqa as one product, once
        fuse_input_projections ran and while the parameters still view it (a `.to()` of the module gives them new
        storage: None then, so callers run two GEMMs, never the stale copy)."""
        fused = self._fused_in
        if fused is None or fused[0].data_ptr() != self._q_in_proj.weight.data_ptr():
            return None
        return fused

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        fused = self.fused_input_weight()
        if fused is None:
            return self.attend(self._q_in_proj(x), self.kv_a_proj_with_mqa(x), cos, sin, batch)
        return self.attend_fused(linear(x, *fused, skinny=False), cos, sin, batch)

    def attend_fused(self, q_kv_a: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch
                     ) -> torch.Tensor:
        """The layer after the fused input product (the decoder layer may fold the input norm into it)."""
        q, kv_a = q_kv_a.split([q_kv_a.shape[-1] - self.mla.latent_dim, self.mla.latent_dim], dim=-1)
        return self.attend(q, kv_a, cos, sin, batch)

    def attend(self, q: torch.Tensor, kv_a: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               batch: ForwardBatch) -> torch.Tensor:
        """The layer from q_proj(x) (or q_a_proj(x)) and kv_a_proj_with_mqa(x) on."""
        spec, mla = self.spec, self.mla
        tokens = q.shape[0]
        if mla.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q_nope, q_pe = q.view(tokens, spec.num_heads, mla.qk_head_dim).split(
            [mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        c_kv, k_pe = kv_a.split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        stored = False
        if use_fused(q):  # one launch, in place, bit-identical to the torch path below; with an MLA pool it also
            from sglx.llm.kernels.mla_rotary import apply_mla_rotary_  # norms c_kv and stores the latent row

            pool = batch.token_kv_pool
            norm = self.kv_a_layernorm
            store = kv_norm = None
            if isinstance(pool, MLATokenKVPool) and norm.weight.dtype == c_kv.dtype:
                # what every MLA backend's save_latent would write
                store = (c_kv, pool.kv_buffer[spec.layer_id], batch.out_cache_loc, pool.kv_scale[spec.layer_id],
                         pool.fp8_dtype)
                kv_norm = (norm.weight, norm.eps)
            else:
                c_kv = norm(c_kv)
            apply_mla_rotary_(q_pe, k_pe, cos, sin, mla.rope_interleave, store, kv_norm)
            stored = store is not None
        else:
            c_kv = self.kv_a_layernorm(c_kv)
            q_pe = self._rotate(q_pe, cos, sin)
            k_pe = self._rotate(k_pe[:, None, :], cos, sin)[:, 0]
        backend = batch.attn_backend
        if backend is None or not hasattr(backend, "forward_mla"):
            raise SglxError(f"{type(self).__name__} needs an MLA attention backend, got "
                            f"{getattr(backend, 'name', None)!r}")
        proj = MLAProjections.from_kv_b_proj(self.kv_b_proj.weight, spec)
        out = backend.forward_mla(q_nope, q_pe, c_kv, k_pe, spec, proj, batch, save_kv_cache=not stored)
        return self.o_proj(out.reshape(tokens, spec.num_heads * spec.v_head_dim))


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.self_attn = DeepseekMLAttention(config, layer_id)
        moe = config.moe
        self.mlp: nn.Module = (DeepseekMoE(config.hidden_size, moe) if moe is not None and moe.is_moe_layer(layer_id)
                               else GatedMLP(config.hidden_size, config.intermediate_size))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, residual before adding it): residual adds are folded into the next norm, and each
        norm and the product after it go through `RMSNorm.norm_linear` (at one row, narrow models take the norm
        inside the GEMV)."""
        fused = self.self_attn.fused_input_weight()
        if fused is not None:
            q_kv_a, residual = self.input_layernorm.norm_linear(x, residual, *fused)
            attn = self.self_attn.attend_fused(q_kv_a, cos, sin, batch)
        else:  # no fused input weight (see fused_input_weight): the norm, then two projections
            h, residual = self.input_layernorm.add_to_stream(x, residual)
            attn = self.self_attn(h, cos, sin, batch)
        if isinstance(self.mlp, DeepseekMoE):  # the post-attention norm may run inside its router
            return self.mlp.forward_after_norm(attn, residual, self.post_attention_layernorm)
        return self.mlp.after_norm(self.post_attention_layernorm, attn, residual)


class DeepseekModel(DecoderBody):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        assert config.mla is not None
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.mla.qk_rope_head_dim, config.rope_theta, config.rope_scaling,
                                      config.max_position_embeddings)


class DeepseekV2ForCausalLM(nn.Module):
    """`logits = model(batch)`: float32 [bs, vocab] for each request's last token (or every token)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.num_layers = config.num_layers
        self.model = DeepseekModel(config)
        self.lm_head = None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size,
                                                                         bias=False, skinny=True)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def weights_loaded(self) -> None:
        """Called by load_model once the weights are in: fuse each layer's two input projections."""
        for layer in self.model.layers:
            layer.self_attn.fuse_input_projections()

    def cuda_graph_blocker(self, dtype: torch.dtype, device: torch.device) -> str | None:
        """Why decode cannot be captured in CUDA graphs with these weights here, or None."""
        if self.config.moe is None or experts_graph_safe(dtype, device):
            return None
        return (f"the MoE experts run a per-expert loop in {str(dtype).removeprefix('torch.')} on this device "
                "(the fused Triton experts need a CUDA/ROCm GPU with triton and SGLX_FUSED_KERNELS on; torch's "
                "sync-free grouped GEMM needs bfloat16 on an SM90+ GPU)")

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        hidden = logit_hidden(self.model, batch)
        if hidden is None:
            return no_logits(self.config.vocab_size, batch)
        return linear(hidden, self.lm_head_weight).float()

    # ---------------------------------------------------------------- weights

    def checkpoint_names(self) -> set[str]:
        """The tensor names a Hugging Face checkpoint of this model must contain (per-expert layout)."""
        names: set[str] = set()
        for name, param in self.named_parameters():
            prefix, _, leaf = name.rpartition(".")
            if prefix.endswith(".gate_up_proj"):  # a fused dense / shared-expert MLP
                parent = prefix.rpartition(".")[0]
                names.update(f"{parent}.{part}.weight" for part in ("gate_proj", "up_proj"))
            elif leaf in ("w13", "w2"):
                parts = ("gate_proj", "up_proj") if leaf == "w13" else ("down_proj",)
                names.update(f"{prefix}.{e}.{p}.weight" for e in range(param.shape[0]) for p in parts)
            else:
                names.add(name)
        return names

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> tuple[set[str], list[str]]:
        """Copy checkpoint tensors into the (fused / stacked) parameters; returns (loaded names, unexpected)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        unexpected: list[str] = []
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES) or self._is_extra_layer(name):
                continue
            if self.lm_head is None and name == "lm_head.weight":
                continue
            target = self._target(name, params)
            if target is None:
                unexpected.append(name)
                continue
            dest, covers = target
            if tuple(dest.shape) != tuple(tensor.shape):
                raise SglxError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, but this "
                                f"{self.config.architecture} config expects {tuple(dest.shape)}; "
                                "does config.json belong to these weights?")
            with torch.no_grad():
                dest.copy_(tensor)
            loaded.update(covers)
        return loaded, unexpected

    def _is_extra_layer(self, name: str) -> bool:
        """Multi-token-prediction layers (DeepSeek-V3's layer 61): not part of the decoder sglx runs."""
        m = _LAYER.match(name)
        return m is not None and int(m.group(1)) >= self.num_layers

    def _target(self, name: str, params: dict[str, nn.Parameter]) -> tuple[torch.Tensor, set[str]] | None:
        """(destination view, checkpoint names it covers) for one checkpoint tensor, or None if unknown."""
        m = _EXPERT.match(name)
        if m:
            stack, e, proj = m.group(1), int(m.group(2)), m.group(3)
            w = params.get(f"{stack}.{'w2' if proj == 'down_proj' else 'w13'}")
            if w is None or e >= w.shape[0]:
                return None
            if proj == "down_proj":
                return w[e], {name}
            rows = w.shape[1] // 2
            return w[e].narrow(0, 0 if proj == "gate_proj" else rows, rows), {name}
        if name.endswith(".experts.gate_up_proj") or name.endswith(".experts.down_proj"):  # transformers' stacked
            stack, _, proj = name.rpartition(".")
            w = params.get(f"{stack}.{'w13' if proj == 'gate_up_proj' else 'w2'}")
            if w is None:
                return None
            parts = ("gate_proj", "up_proj") if proj == "gate_up_proj" else ("down_proj",)
            return w, {f"{stack}.{e}.{p}.weight" for e in range(w.shape[0]) for p in parts}
        module_path, _, leaf = name.rpartition(".")
        parent, _, proj = module_path.rpartition(".")
        if proj in ("gate_proj", "up_proj"):
            fused = params.get(f"{parent}.gate_up_proj.{leaf}")
            if fused is None:
                return None
            rows = fused.shape[0] // 2
            return fused.narrow(0, 0 if proj == "gate_proj" else rows, rows), {name}
        param = params.get(name)
        return (param, {name}) if param is not None else None


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3/R1: q LoRA, sigmoid noaux_tc routing with a score-correction bias (all from the config)."""
