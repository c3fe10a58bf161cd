"""One Llama-family decoder for Llama 2/3/3.1, Mistral, Qwen2/2.5 and Qwen3.

The variants differ only in switches read from ModelConfig: qkv bias (Qwen2), per-head q/k RMSNorm
(Qwen3), sliding window (Mistral), RoPE scaling (Llama 3.1) and tied embeddings. q/k/v and gate/up
projections are fused into single matmuls (one launch each per layer); `load_weights` maps Hugging
Face's separate tensors into the fused ones. Each residual add is folded into the RMSNorm after it
(`RMSNorm.add_and_norm`), so on CUDA a layer is GEMMs, attention and four fused Triton kernels
(two add+norms, rotary, SiLU-and-mul: see sglx.llm.kernels); each add+norm and the product after it go through
`RMSNorm.norm_linear` (at one row, narrow models take the norm inside the GEMV). At one row on wider models the
qkv GEMV rotates q/k and stores K/V, and the gate_up GEMV applies SiLU-and-mul, in their epilogues
(`LlamaSelfAttention.attend_one_row`, `GatedMLP.after_norm`); with the norm scales folded into qkv and gate_up at
load (sglx.llm.layers.norm_folding) those GEMVs also norm their input and o_proj / down add to the residual stream,
so such a step launches no norm kernel inside the layers; batched decode steps of a folded model read the stream
unnormed too, with each row's 1 / rms applied by the rotary and SiLU kernels and o_proj / down adding into the
stream in place (`LlamaDecoderLayer.row_scaled`). CPU runs the same math in torch.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from sglx.attention.llm.base import LayerSpec
from sglx.attention.llm.kv_store import StepKVSlots, rotary_and_store
from sglx.errors import SglxError
from sglx.llm.forward_batch import ForwardBatch
from sglx.llm.layers import Attention, GatedMLP, RMSNorm, RotaryEmbedding
from sglx.llm.layers.linear import linear
from sglx.llm.layers.norm import epilogue_gemv_applies
from sglx.llm.layers.norm_folding import fold_norm_into, folding_applies, row_scale_dtype, row_scaled_applies
from sglx.llm.layers.parallel import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    current_tp,
    lm_logits,
)
from sglx.llm.model_config import ModelConfig
from sglx.llm.models.decoder import DecoderBody, logit_hidden, no_logits

# checkpoint projection name -> (fused parameter name, shard index)
_STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# tensors some checkpoints carry that are recomputed, never loaded
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


class LlamaSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        d = config.head_dim
        tp = current_tp()  # this rank's heads: num_heads / tp; KV heads split, or one replicated per rank
        q_start, q_heads = tp.split(config.num_heads)
        kv_start, kv_heads = tp.kv_heads(config.num_kv_heads)
        self.q_size = q_heads * d
        self.kv_size = kv_heads * d
        q_part = (config.num_heads * d, (q_start * d, self.q_size))
        kv_part = (config.num_kv_heads * d, (kv_start * d, self.kv_size))
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, [q_part, kv_part, kv_part], config.qkv_bias, tp)
        self.o_proj = RowParallelLinear(config.num_heads * d, config.hidden_size, config.o_bias, tp, skinny=True)
        self.q_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None
        self.attn = Attention(LayerSpec(
            layer_id=layer_id,
            num_q_heads=q_heads,
            num_kv_heads=kv_heads,
            head_dim=d,
            scaling=d**-0.5,
            sliding_window=config.sliding_window_for_layer(layer_id),
        ))

    def shard_sizes(self, fused: str) -> list[int]:
        assert fused == "qkv_proj"
        return [self.q_size, self.kv_size, self.kv_size]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.attend(self.qkv_proj(x), cos, sin, batch)

    def one_row_slots(self, x: torch.Tensor, cos: torch.Tensor, batch: ForwardBatch) -> StepKVSlots | None:
        """The pool slots for `attend_one_row` when this step may take it (one decode token on CUDA, the qkv product
        fit for the GEMV and too wide for the norm inside it, no q/k norm, a backend that lends its slots), else
        None."""
        qkv = self.qkv_proj
        if not (batch.mode.is_decode and self.q_norm is None and batch.attn_backend is not None
                and cos.dtype == x.dtype and epilogue_gemv_applies(x, qkv.weight, qkv.bias)):
            return None
        return batch.attn_backend.step_kv_slots(self.attn.spec, batch)

    def attend_one_row(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch,
                       slots: StepKVSlots, rms_eps: float | None = None) -> torch.Tensor:
        """The layer from its normed input h for one decode token: the qkv GEMV rotates q and k and stores K/V to
        `slots` in its epilogue (sglx.llm.kernels.gemv_rotary: the rotary kernel's launch saved), then attention
        over the pool and o_proj. rms_eps (norms folded, sglx.llm.layers.norm_folding): h is the unnormed residual
        stream, the qkv GEMV norms it, and the result is h + the layer's output (added in o_proj's epilogue)."""
        from sglx.llm.kernels.gemv import gemv
        from sglx.llm.kernels.gemv_rotary import gemv_rotary_store

        spec = self.attn.spec
        q = gemv_rotary_store(h, self.qkv_proj.weight, self.qkv_proj.bias, cos, sin, spec.num_q_heads,
                              spec.num_kv_heads, slots, rms_eps=rms_eps)
        out = self.attn.attend_stored(q.view(1, spec.num_q_heads, spec.head_dim), batch)
        if rms_eps is None:
            return self.o_proj(out)
        return gemv(out, self.o_proj.weight, self.o_proj.bias, add_to=h)[0]

    def add_row_scaled(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch,
                       rms_eps: float) -> None:
        """h += this attention of rmsnorm(h), in place, for a batched decode step with the norm's scale folded into
        qkv (`LlamaDecoderLayer.row_scaled`): the qkv product reads h unnormed (without its bias), the rotary kernel
        scales each token's q, k and v by its 1 / rms(h) and adds the bias (and stores K/V where the backend lends its
        slots), o_proj adds into h."""
        from sglx.llm.kernels.rotary import RowScale, apply_rotary_, apply_rotary_and_store_

        spec = self.attn.spec
        tokens = h.shape[0]
        bias = self.qkv_proj.bias
        q, k, v = linear(h, self.qkv_proj.weight, skinny=False).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(tokens, spec.num_q_heads, spec.head_dim)
        k = k.view(tokens, spec.num_kv_heads, spec.head_dim)
        v = v.view(tokens, spec.num_kv_heads, spec.head_dim)
        backend = batch.attn_backend
        slots = backend.step_kv_slots(spec, batch) if backend is not None else None
        if slots is None:  # the backend stores K/V itself (per-token fp8 scales, key rotation, calibration)
            apply_rotary_(q, k, cos, sin, RowScale(h, v, rms_eps, bias))
            out = self.attn(q, k, v, batch)
        else:
            apply_rotary_and_store_(q, k, v, cos, sin, slots.k_buffer, slots.v_buffer, slots.loc, slots.k_scale,
                                    slots.v_scale, slots.fp8_dtype, rms_of=h, eps=rms_eps, bias=bias)
            out = self.attn(q, k, v, batch, save_kv_cache=False)
        h.addmm_(out, self.o_proj.weight.t())

    def attend(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The layer after its qkv product (the decoder layer fuses the input norm into that product)."""
        spec = self.attn.spec
        tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(tokens, spec.num_q_heads, spec.head_dim)
        k = k.reshape(tokens, spec.num_kv_heads, spec.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        backend = batch.attn_backend
        slots = backend.step_kv_slots(spec, batch) if backend is not None else None
        if slots is not None and rotary_and_store(q, k, v, cos, sin, slots):
            return self.o_proj(self.attn(q, k, v, batch, save_kv_cache=False))  # K/V already in the pool
        q, k = RotaryEmbedding.apply(q, k, cos, sin)
        return self.o_proj(self.attn(q, k, v, batch))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.self_attn = LlamaSelfAttention(config, layer_id)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, bias=config.mlp_bias, tp=current_tp())
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norms_folded = False  # set by fold_norms: the norm scales live in qkv_proj and gate_up_proj
        self.row_scale_dtype: torch.dtype | None = None  # set by fold_norms where batched steps may take `row_scaled`

    def fold_norms(self) -> None:
        """Fold both norms' scales into the projections they feed (sglx.llm.layers.norm_folding)."""
        fold_norm_into(self.input_layernorm, self.self_attn.qkv_proj.weight)
        fold_norm_into(self.post_attention_layernorm, self.mlp.gate_up_proj.weight)
        self.norms_folded = True
        attn, mlp = self.self_attn, self.mlp
        if attn.q_norm is None:
            self.row_scale_dtype = row_scale_dtype([attn.o_proj, mlp.gate_up_proj, mlp.down_proj], attn.qkv_proj)

    def row_scaled(self, x: torch.Tensor, cos: torch.Tensor, batch: ForwardBatch) -> bool:
        """Whether this step runs the layer with its folded norms as row scales after the products
        (sglx.llm.layers.norm_folding.row_scaled_applies: a batched CUDA decode step; what the weights allow was
        settled at fold time: no q/k norms, a qkv bias (Qwen2) added by the rotary kernel, no bias after attention):
        no add + norm kernel, the residual adds done by o_proj's and down's products in place."""
        return cos.dtype == x.dtype and row_scaled_applies(x, batch, self.row_scale_dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(this layer's MLP output, residual stream before adding it): each residual add is folded into the
        norm that follows it (one fused kernel on CUDA); the caller adds the last MLP output in the final norm.
        A decode step with folded norms (one row, or several: `row_scaled`) returns (the residual stream with the
        MLP output added, None).

        x is the previous layer's MLP output (added to `residual` here), or the stream itself when residual is None
        (the embeddings, or a folded layer's output).
        """
        attn = self.self_attn
        if self.row_scaled(x, cos, batch):  # the stream is updated in place: x is a fresh tensor or the stream itself
            stream = x if residual is None else residual + x
            attn.add_row_scaled(stream, cos, sin, batch, self.input_layernorm.eps)
            self.mlp.add_row_scaled(stream, self.post_attention_layernorm.eps)
            return stream, None
        slots = attn.one_row_slots(x, cos, batch)
        if slots is not None and self.norms_folded:  # one row, no norm launches: the stream goes on as x
            stream = x if residual is None else residual + x
            h = attn.attend_one_row(stream, cos, sin, batch, slots, self.input_layernorm.eps)
            return self.mlp.add_one_row(h, self.post_attention_layernorm.eps), None
        if slots is None:
            qkv, residual = self.input_layernorm.norm_linear(x, residual, attn.qkv_proj.weight, attn.qkv_proj.bias)
            out = attn.attend(qkv, cos, sin, batch)
        else:
            h, residual = self.input_layernorm.add_to_stream(x, residual)
            out = attn.attend_one_row(h, cos, sin, batch, slots)
        return self.mlp.after_norm(self.post_attention_layernorm, out, residual)


class LlamaModel(DecoderBody):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, current_tp())
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling,
                                      config.max_position_embeddings)


class LlamaForCausalLM(nn.Module):
    """`logits = model(batch)`: float32 [bs, vocab] for each request's last token (or every token)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.num_layers = config.num_layers
        self.tp = current_tp()
        self.model = LlamaModel(config)
        # tied models read the embedding matrix directly, so no second parameter can drift from it
        self.lm_head = None if config.tie_word_embeddings else ParallelLMHead(config.vocab_size, config.hidden_size,
                                                                                 self.tp)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def weights_loaded(self) -> None:
        """Called by load_model once the weights are in: fold the norm scales into the projections where batch-1
        decode steps can then skip the norm kernels (sglx.llm.layers.norm_folding; not with q/k norms, whose
        layers keep the norm-then-GEMV route)."""
        layers = list(self.model.layers)
        if (layers and not self.config.qk_norm
                and folding_applies(self.config.hidden_size, layers[0].self_attn.qkv_proj.weight, self.tp.size)):
            for layer in layers:
                layer.fold_norms()

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        hidden = logit_hidden(self.model, batch)
        if hidden is None:
            return no_logits(self.config.vocab_size, batch)
        return lm_logits(hidden, self.lm_head_weight, self.tp, self.config.vocab_size).float()

    # ---------------------------------------------------------------- weights

    def checkpoint_names(self) -> set[str]:
        """The tensor names a Hugging Face checkpoint of this model must contain."""
        names = set()
        for name, _ in self.named_parameters():
            module_path, _, leaf = name.rpartition(".")
            parent, _, proj = module_path.rpartition(".")
            if proj in _FUSED:
                names.update(f"{parent}.{part}.{leaf}" for part in _FUSED[proj])
            else:
                names.add(name)
        return names

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> tuple[set[str], list[str]]:
        """Copy checkpoint tensors into the (fused) parameters; returns (loaded names, unexpected names)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        unexpected: list[str] = []
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if self.lm_head is None and name == "lm_head.weight":
                continue  # tied: some checkpoints still store a copy of the embedding
            target, rows = self._target(name, params)
            if target is None:
                unexpected.append(name)
                continue
            module_path, _, leaf = target.rpartition(".")
            module = self.get_submodule(module_path)
            if hasattr(module, "load_part"):  # tensor-parallel layers keep their rank's slice of the tensor
                proj = name.rpartition(".")[0].rpartition(".")[2]
                try:
                    module.load_part(leaf, _STACKED[proj][1] if proj in _STACKED else 0, tensor)
                except ValueError as exc:
                    raise SglxError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, which does not "
                                    f"fit this {self.config.architecture} config ({exc}); "
                                    "does config.json belong to these weights?") from None
                loaded.add(name)
                continue
            dest = params[target]
            if rows is not None:
                dest = dest.narrow(0, rows[0], rows[1])
            if tuple(dest.shape) != tuple(tensor.shape):
                raise SglxError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, but this "
                                f"{self.config.architecture} config expects {tuple(dest.shape)}; "
                                "does config.json belong to these weights?")
            with torch.no_grad():
                dest.copy_(tensor)
            loaded.add(name)
        return loaded, unexpected

    def _target(self, name: str, params: dict[str, nn.Parameter]) -> tuple[str | None, tuple[int, int] | None]:
        """(parameter name, (row offset, rows) inside a fused parameter or None) for a checkpoint tensor."""
        module_path, _, leaf = name.rpartition(".")
        parent, _, proj = module_path.rpartition(".")
        if proj not in _STACKED:
            return (name if name in params else None), None
        fused, shard = _STACKED[proj]
        target = f"{parent}.{fused}.{leaf}"
        if target not in params:
            return None, None
        if fused == "qkv_proj":
            sizes = self.get_submodule(parent).shard_sizes(fused)
        else:
            sizes = [self.config.intermediate_size] * 2
        return target, (sum(sizes[:shard]), sizes[shard])


class MistralForCausalLM(LlamaForCausalLM):
    """Llama with a sliding attention window on every layer (from config.sliding_window)."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama with biases on q/k/v."""


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Llama with per-head RMSNorm on q and k before RoPE."""
