"""DeepSeek mixture of experts: grouped top-k routing, routed experts as stacked weights, shared experts.

Routing follows the reference implementations exactly (float32 router logits):
- greedy (V2): softmax scores, top-k experts.
- group_limited_greedy (V2): softmax; keep the top `topk_group` groups by their best expert, then top-k.
- noaux_tc (V3): sigmoid scores; choose with scores + e_score_correction_bias, groups ranked by the sum of
  their two best biased scores; weights are the UNbiased scores of the chosen experts.
Weights are renormalized when norm_topk_prob (V3; V2 only with top_k > 1, where it replaces the scaling
as in DeepSeek's V2 code) and multiplied by routed_scaling_factor otherwise / afterwards (V3).
On a CUDA/ROCm GPU the experts run as sglx's fused Triton MoE (`kernels/fused_moe.py`: pairs sorted by
expert on the device, gate/up GEMM with SiLU fused, down GEMM times the routing weight; four launches,
no host sync, so CUDA graphs capture it, in any dtype). The shared experts join those launches as experts
E.. of weight 1 (their float32 output is summed with the routed ones before the one rounding), and V2's
greedy softmax router of a decode-sized step is one more kernel (`kernels/moe_router.py`; for one token it
also lays out the expert blocks, so the sort launch is skipped; up to 8 tokens it also forms the post-attention
residual add and RMSNorm, `forward_after_norm`). Without it (SGLX_FUSED_KERNELS=0) they run as
one grouped GEMM pair (`torch._grouped_mm`) where torch has its sync-free fast path (bfloat16 on CUDA
SM90+); elsewhere, and on CPU, as one small GEMM pair per expert that received tokens (exact, HF's
order, but it reads the token counts on the host, so no graphs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglx.llm.deepseek_config import MoEConfig
from sglx.llm.kernels import fused_kernels_enabled, triton_available
from sglx.llm.layers.mlp import GatedMLP
from sglx.llm.layers.norm import RMSNorm

ROUTER_MAX_TOKENS = 256  # = sglx.llm.kernels.moe_router.MAX_TOKENS (that module imports triton)
# the post-attention add + RMSNorm inside the router up to this many tokens: every router program re-reads the row
# and norms it. V2-Lite step profiles (session 15): batch 1, H200, router 7.3 us a layer against 4.9 + the norm's 2.4,
# one launch less; batch 32, H100, its first version 10.9 against 6.4 + 2.7. Between 1 and 32 the limit is a choice.
ROUTER_ADD_NORM_MAX_TOKENS = 8


def select_experts(router_logits: torch.Tensor, cfg: MoEConfig,
                   correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] float32 -> (weights [T, k] float32, expert ids [T, k])."""
    k, groups, experts = cfg.num_experts_per_tok, cfg.n_group, cfg.n_routed_experts
    if cfg.scoring_func == "sigmoid":
        scores = router_logits.sigmoid()
    else:
        scores = router_logits.softmax(dim=-1, dtype=torch.float32)
    if cfg.topk_method == "greedy":
        weights, ids = torch.topk(scores, k=k, dim=-1, sorted=False)
    elif cfg.topk_method == "group_limited_greedy":
        group_scores = scores.view(-1, groups, experts // groups).max(dim=-1).values
        masked = scores.masked_fill(~_group_mask(group_scores, cfg), 0.0)
        weights, ids = torch.topk(masked, k=k, dim=-1, sorted=False)
    else:  # noaux_tc
        choice = scores + correction_bias if correction_bias is not None else scores
        group_scores = choice.view(-1, groups, experts // groups).topk(2, dim=-1)[0].sum(dim=-1)
        choice = choice.masked_fill(~_group_mask(group_scores, cfg), float("-inf"))
        ids = torch.topk(choice, k=k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
    if cfg.topk_method == "noaux_tc":
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return _scaled(weights, cfg.routed_scaling_factor), ids
    if k > 1 and cfg.norm_topk_prob:
        return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20), ids
    return _scaled(weights, cfg.routed_scaling_factor), ids


def _scaled(weights: torch.Tensor, factor: float) -> torch.Tensor:
    return weights if factor == 1.0 else weights * factor  # x * 1.0 == x: one kernel less per layer


def _group_mask(group_scores: torch.Tensor, cfg: MoEConfig) -> torch.Tensor:
    """[T, G] group scores -> [T, E] bool: experts of each token's top `topk_group` groups."""
    top = torch.topk(group_scores, k=cfg.topk_group, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, top, True)
    return mask.repeat_interleave(cfg.n_routed_experts // cfg.n_group, dim=1)


def grouped_gemm_graph_safe(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether torch._grouped_mm runs its fast path here: no host sync, so CUDA graphs can capture it."""
    return (device.type == "cuda" and dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and torch.version.hip is None and torch.cuda.get_device_capability(device)[0] >= 9)


def fused_moe_applies(device: torch.device) -> bool:
    """Whether the fused Triton experts run on tensors of this device (CUDA/ROCm, triton, switch on)."""
    return device.type == "cuda" and fused_kernels_enabled() and triton_available()


def experts_graph_safe(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the routed experts run without a host sync here, so CUDA graphs can capture decode."""
    return fused_moe_applies(device) or grouped_gemm_graph_safe(dtype, device)


class RoutedExperts(nn.Module):
    """E gated experts as stacked weights: w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                add: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H], weights/ids [T, k] -> sum_k weights * expert_ids(x) [T, H] (+ add, after the sum)."""
        if fused_moe_applies(x.device):
            return self.forward_fused(x, weights, ids, add)
        aligned = x.shape[-1] % 8 == 0 and self.intermediate_size % 8 == 0  # 16-byte rows for the fast path
        if aligned and grouped_gemm_graph_safe(x.dtype, x.device):
            out = self.forward_grouped(x, weights, ids)
        else:
            out = self.forward_loop(x, weights, ids)
        return out if add is None else out + add

    def forward_fused(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                      add: torch.Tensor | None = None, shared: tuple[torch.Tensor, torch.Tensor] | None = None,
                      aligned: tuple | None = None) -> torch.Tensor:
        """sglx's Triton MoE: expert sort and both GEMMs on the device, no host sync (CUDA/ROCm, or interpreted);
        `add` joins in the kernel that sums the top-k outputs; `shared` (gate_up, down weights of the shared
        experts) runs them as experts E.. in the same launches (ids/weights carry them: fused_moe); `aligned`:
        the expert blocks the fused router already laid out."""
        from sglx.llm.kernels.fused_moe import fused_moe

        return fused_moe(x, self.w13, self.w2, weights, ids, interpret=x.device.type == "cpu", add=add,
                         shared=shared, aligned=aligned)

    def forward_grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """All experts in two grouped GEMMs over the (token, choice) rows sorted by expert; no host sync."""
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token_of = order // ids.shape[1]
        experts = torch.arange(self.num_experts, device=x.device, dtype=flat.dtype)
        offs = torch.searchsorted(flat[order], experts, right=True).to(torch.int32)  # end row of each expert
        gate, up = torch._grouped_mm(x[token_of], self.w13.transpose(1, 2), offs=offs).chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(gate) * up, self.w2.transpose(1, 2), offs=offs)
        out = torch.zeros_like(x)
        return out.index_add_(0, token_of, (y * weights.reshape(-1)[order][:, None]).to(out.dtype))

    def forward_loop(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """One GEMM pair per expert that received tokens, in expert order (HF's summation order)."""
        out = torch.zeros_like(x)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token_of = order // ids.shape[1]
        w_sorted = weights.reshape(-1)[order]
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = token_of[start:start + n]
            gate, up = F.linear(x[rows], self.w13[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.w2[e])
            out.index_add_(0, rows, (y * w_sorted[start:start + n, None]).to(out.dtype))
            start += n
        return out


class DeepseekMoE(nn.Module):
    """Routed experts (weighted top-k) plus always-on shared experts."""

    def __init__(self, hidden_size: int, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, hidden_size), requires_grad=False)
        if cfg.topk_method == "noaux_tc":
            self.gate.e_score_correction_bias = nn.Parameter(torch.empty(cfg.n_routed_experts), requires_grad=False)
        self.experts = RoutedExperts(cfg.n_routed_experts, hidden_size, cfg.moe_intermediate_size)
        self.shared_experts = (GatedMLP(hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)
                               if cfg.n_shared_experts else None)
        self._tickets: torch.Tensor | None = None  # the fused router's (see _router_tickets)

    def _fused_router_applies(self, x: torch.Tensor) -> bool:
        """V2's greedy softmax router on a decode-sized step on a GPU: one launch (sglx.llm.kernels.moe_router)."""
        cfg = self.cfg
        return (cfg.topk_method == "greedy" and cfg.scoring_func == "softmax" and fused_moe_applies(x.device)
                and x.shape[0] <= ROUTER_MAX_TOKENS)

    def route(self, x: torch.Tensor, shared: int = 0, add_norm: tuple | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, tuple | None, tuple | None]:
        """(weights [T, k + shared] float32, expert ids [T, k + shared], fused_moe's expert blocks or None,
        (normed x, new residual) or None): the top k, then `shared` always-chosen experts E.. of weight 1. One
        fused launch where `_fused_router_applies` (for one token it lays out the expert blocks too; with
        add_norm = (residual, norm weight, eps) it also forms the routed row RMSNorm(residual + x) and returns
        it), else select_experts on float32 logits (no add_norm there)."""
        cfg = self.cfg
        if self._fused_router_applies(x):
            from sglx.llm.kernels.fused_moe import moe_block_m
            from sglx.llm.kernels.moe_router import greedy_router

            k = cfg.num_experts_per_tok
            align = moe_block_m(k + shared, x.device.type == "cpu") if x.shape[0] == 1 else 0
            return greedy_router(x, self.gate.weight, k, k > 1 and cfg.norm_topk_prob, cfg.routed_scaling_factor,
                                 self._router_tickets(x.device), shared=shared, align_block_m=align,
                                 add_norm=add_norm)
        if add_norm is not None:
            raise ValueError("add_norm needs the fused router (V2's greedy softmax routing on a GPU)")
        logits = F.linear(x.float(), self.gate.weight.float())
        bias = getattr(self.gate, "e_score_correction_bias", None)
        weights, ids = select_experts(logits, cfg, bias.float() if bias is not None else None)
        if shared:
            extra = torch.arange(cfg.n_routed_experts, cfg.n_routed_experts + shared, device=ids.device)
            ids = torch.cat([ids, extra.to(ids.dtype).expand(ids.shape[0], shared)], dim=1)
            weights = torch.cat([weights, weights.new_ones(weights.shape[0], shared)], dim=1)
        return weights, ids, None, None

    def _router_tickets(self, device: torch.device) -> torch.Tensor | None:
        """int32 zeros the fused router leaves zero, kept across steps; made outside any CUDA-graph capture (one
        made inside would be zeroed only by replays), so None there until an eager step made them."""
        tickets = self._tickets
        if tickets is None or tickets.device != device:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return None
            tickets = self._tickets = torch.zeros(ROUTER_MAX_TOKENS, dtype=torch.int32, device=device)
        return tickets

    def _shared_in_kernel(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The shared experts' (gate_up, down) weights where they can run inside fused_moe's launches."""
        mlp = self.shared_experts
        if mlp is None or mlp.gate_up_proj.bias is not None or mlp.down_proj.bias is not None:
            return None
        return mlp.gate_up_proj.weight, mlp.down_proj.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mlp = self.shared_experts
        if not fused_moe_applies(x.device):
            weights, ids, _, _ = self.route(x)
            return self.experts(x, weights, ids, add=mlp(x) if mlp is not None else None)
        shared = self._shared_in_kernel()
        if shared is not None:
            weights, ids, aligned, _ = self.route(x, self.cfg.n_shared_experts)
            return self.experts.forward_fused(x, weights, ids, shared=shared, aligned=aligned)
        weights, ids, aligned, _ = self.route(x)
        return self.experts.forward_fused(x, weights, ids, add=mlp(x) if mlp is not None else None, aligned=aligned)

    def forward_after_norm(self, delta: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """(forward(h), residual + delta) for h = norm(residual + delta): the decoder layer's
        post-attention add-and-norm and this layer in one call. Where the fused router runs with the shared
        experts in fused_moe (V2-Lite's decode), the add and the norm happen inside the router's launch."""
        shared = self._shared_in_kernel()
        if (shared is not None and self._fused_router_applies(delta) and delta.shape == residual.shape
                and delta.shape[0] <= ROUTER_ADD_NORM_MAX_TOKENS
                and norm.weight.dtype == delta.dtype == residual.dtype):
            weights, ids, aligned, (h, residual) = self.route(delta, self.cfg.n_shared_experts,
                                                              add_norm=(residual, norm.weight, norm.eps))
            return self.experts.forward_fused(h, weights, ids, shared=shared, aligned=aligned), residual
        h, residual = norm.add_and_norm(delta, residual)
        return self.forward(h), residual
