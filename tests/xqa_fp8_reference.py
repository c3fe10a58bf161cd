"""What TRT-LLM's XQA SM90 decode kernel computes over fp8_e4m3 KV, in float64, for judging trtllm_mha on the GPU.

XQA's Hopper kernel for an fp8 cache (FlashInfer 0.5.3 `csrc/xqa/mha_sm90.cu`, run by
`trtllm_batch_decode_with_kv_cache` on SM90) multiplies in fp8, so its error against exact attention is set by
its arithmetic, not by sglx:
- the bf16 query is converted to e4m3 as it is (`F16QToF8Converter`, no scale; q_scale is applied to Q.K^T after);
- scores come from 64-token tiles; each tile's probabilities are exp(s - running max) times 448 (`kE4M3_MAX`),
  rounded to e4m3 for the P.V product, while the softmax denominator sums the unrounded fp32 probabilities;
- with more than one tile, a sequence is split over up to `xqa_sub_seqs(...)` CTAs that take tiles in turn
  (`launchHopperF8MHAFlashInfer`), each writes its normalised partial output in the model dtype with its row
  max and sum, and the last CTA merges them in fp32.
With 3 mantissa bits in q and p, a decode row over a few keys errs by up to ~0.25 against float64 (4 keys: q's
rounding moves each score by ~0.05 and the weights follow), while a wrong page or scale errs against this model
by far more than its bf16 output rounding. tests/test_xqa_fp8_reference.py checks the model against two errors
recorded on the lent H100.

What the model leaves out: Hopper's fp8 tensor cores accumulate with about 14 significant bits (DeepSeek-V3
technical report, section 3.3.2), so each Q.K^T score carries an error near 2^-14 of its sum of |products|, and
e4m3's coarse p turns that into output errors of a few 1e-3. Session 10 dumped two XQA rows on the H100 (603 and
301 keys): every variant of the arithmetic above fits worse, and the residual (0.0040 / 0.0049 at most, spread over
every head) matches what score noise of that size moves the model by (0.003-0.007 over draws). So a row is judged
by `xqa_fp8_check`: its excess over the model within twice the model's own movement under that noise, and no
overall scale error (the least-squares slope of out on the model within `SLOPE_TOL` of 1), which a wrong v_scale
would show while staying inside the noise.
"""

from __future__ import annotations

import math

import torch

TILE = 64  # gemm0CtaTileNbTokens
E4M3_MAX = 448.0


def xqa_sub_seqs(sm_count: int, batch_size: int, num_kv_heads: int, max_seq_len: int) -> int:
    """CTAs per (request, KV head) that XQA's SM90 launcher allows (`nbSubSeqPerSeq`; C's round: half away)."""
    wanted = math.floor(sm_count * 3 // (batch_size * num_kv_heads) * 0.25 + 0.5)
    return min(max(1, wanted), -(-max_seq_len // TILE))


def xqa_fp8_decode(q: torch.Tensor, k_fp8: torch.Tensor, v_fp8: torch.Tensor, bmm1_scale: float, v_scale: float,
                   max_sub_seqs: int, out_dtype: torch.dtype = torch.bfloat16,
                   score_noise: torch.Tensor | None = None) -> torch.Tensor:
    """One decode row as XQA computes it: q [Hq, D] (what the kernel is given), k_fp8/v_fp8 [L, Hkv, D] the e4m3
    values the cache holds (as floats, before scales), bmm1_scale = sm_scale * k_scale. Returns float64 [Hq, D]
    before the final rounding to out_dtype (partials of a split sequence are rounded to out_dtype, as XQA does)."""
    group = q.shape[0] // k_fp8.shape[1]
    q8 = q.float().to(torch.float8_e4m3fn).double()
    k = k_fp8.double().repeat_interleave(group, 1)
    v = v_fp8.double().repeat_interleave(group, 1)
    scores = torch.einsum("hd,khd->hk", q8, k) * bmm1_scale
    if score_noise is not None:  # [Hq, L], added to the scaled scores (see score_noise_deviation)
        scores = scores + score_noise.to(scores)
    tiles = -(-k.shape[0] // TILE)
    subs = min(tiles, max_sub_seqs) if tiles >= 2 else 1
    parts = []
    like = {"dtype": torch.float64, "device": scores.device}
    for sub in range(subs):
        run_max = torch.full((q.shape[0], 1), -math.inf, **like)
        acc = torch.zeros(q.shape[0], v.shape[-1], **like)
        total = torch.zeros(q.shape[0], 1, **like)
        for t in range(sub, tiles, subs):
            s = scores[:, t * TILE:(t + 1) * TILE]
            new_max = torch.maximum(run_max, s.amax(-1, keepdim=True))
            p = torch.exp(s - new_max)
            rescale = torch.exp(run_max - new_max)
            p8 = (p.float() * E4M3_MAX).to(torch.float8_e4m3fn).double() / E4M3_MAX
            acc = acc * rescale + torch.einsum("hk,khd->hd", p8, v[t * TILE:(t + 1) * TILE])
            total = total * rescale + p.sum(-1, keepdim=True)
            run_max = new_max
        out = acc * v_scale / total
        parts.append((out.to(out_dtype).double() if subs > 1 else out, run_max, total))
    if subs == 1:
        return parts[0][0]
    top = torch.stack([m for _, m, _ in parts]).amax(0)
    weights = [t * torch.exp(m - top) for _, m, t in parts]
    return sum(o * w for (o, _, _), w in zip(parts, weights)) / sum(weights)


MODEL_ATOL, MODEL_RTOL = 2e-3, 2.0 ** -7  # one bf16 rounding of the output plus fp32 summation order
ACCUMULATION_BITS = 14  # significant bits Hopper's fp8 tensor cores keep while accumulating
NOISE_DRAWS = 4
NOISE_FACTOR = 2.0  # the bound: this many times the largest movement over the draws
SLOPE_TOL = 0.003  # |slope - 1|: a v_scale 0.5% off gives 0.005 on the session 10 rows, the right one 0.0004


def score_noise_deviation(q: torch.Tensor, k_fp8: torch.Tensor, v_fp8: torch.Tensor, bmm1_scale: float,
                          v_scale: float, max_sub_seqs: int, seed: int = 0,
                          base: torch.Tensor | None = None) -> float:
    """Largest change of the model's output over NOISE_DRAWS draws of Gaussian score errors with standard deviation
    2^-ACCUMULATION_BITS of each score's sum of |q8 * k8| (times bmm1_scale): how much fp8 accumulation alone may
    move a row. `base`: the model's output for these arguments, when the caller already has it."""
    group = q.shape[0] // k_fp8.shape[1]
    q8 = q.float().to(torch.float8_e4m3fn).double()
    k = k_fp8.double().repeat_interleave(group, 1)
    sigma = torch.einsum("hd,khd->hk", q8.abs(), k.abs()) * bmm1_scale * 2.0 ** -ACCUMULATION_BITS
    if base is None:
        base = xqa_fp8_decode(q, k_fp8, v_fp8, bmm1_scale, v_scale, max_sub_seqs)
    gen = torch.Generator().manual_seed(seed)
    worst = 0.0
    for _ in range(NOISE_DRAWS):
        noise = torch.randn(sigma.shape, generator=gen, dtype=torch.float64) * sigma.cpu()
        moved = xqa_fp8_decode(q, k_fp8, v_fp8, bmm1_scale, v_scale, max_sub_seqs, score_noise=noise.to(sigma))
        worst = max(worst, (moved - base).abs().max().item())
    return worst


def xqa_fp8_check(out: torch.Tensor, q: torch.Tensor, k_fp8: torch.Tensor, v_fp8: torch.Tensor, bmm1_scale: float,
                  v_scale: float, max_sub_seqs: int, atol: float = MODEL_ATOL,
                  rtol: float = MODEL_RTOL) -> dict[str, float]:
    """One XQA fp8 decode row (out [Hq, D]) against the model: excess over rtol, its bound, the output's slope."""
    model = xqa_fp8_decode(q, k_fp8, v_fp8, bmm1_scale, v_scale, max_sub_seqs)
    o = out.double().to(model.device)
    excess = ((o - model).abs() - rtol * model.abs()).max().item()
    noise = score_noise_deviation(q, k_fp8, v_fp8, bmm1_scale, v_scale, max_sub_seqs, base=model)
    bound = max(atol, NOISE_FACTOR * noise)
    slope = ((o * model).sum() / (model * model).sum()).item()
    return {"excess": excess, "bound": bound, "noise": noise, "slope": slope,
            "ok": float(excess <= bound and abs(slope - 1.0) <= SLOPE_TOL)}
