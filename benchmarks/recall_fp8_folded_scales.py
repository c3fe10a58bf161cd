"""Experiment: can static per-channel (or any static linear) key/value transforms, folded outside a kernel that takes
one K and one V scale per layer (FlashInfer, XQA), bring the embedded model's fp8_e4m3 recall to 98%?

Usage: PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/recall_fp8_folded_scales.py --prompts 200 --seed 11
Each scheme stores K' = fp8(((k - mu_k) M) / s_k) and V' = fp8((v - mu_v) / s_v) and reads back
K' s_k M^-1 + mu_k, V' s_v + mu_v through torch_native (model in float32): exactly what a scalar-scale kernel
computes when the query is multiplied by M^-T before it and mu_v added / the per-channel V scale multiplied after
it (q . k is unchanged by M; a constant key shift mu_k shifts every score of a query by q . mu_k, which softmax
ignores; the output is a convex combination of the values, so a V shift or per-channel V scale folds out).
All transforms are calibrated on the first prefill (per layer and kv head), like `--kv-cache-scales calibrate`.

Schemes:
  per_layer_rotated   M = R (the pool's fixed rotation), one scale per layer: today's `calibrate`
  per_channel         M = diag(1 / s_c), s_c = per (kv head, channel) amax / 200; V per channel too; no rotation
  per_channel_rotated M = R diag(1 / s_c): per-channel amax in the rotated basis
  mean_rotated        M = R with mu_k, mu_v = the first prefill's mean key / value per kv head
  balanced_rotated    M = Ck^-1/2 (Ck^1/2 Cq Ck^1/2)^1/4 R per kv head, from the first prefill's queries and
                      (mean-removed) keys: the M minimizing tr(M^-1 Cq M^-T) tr(M^T Ck M), the expected squared
                      score error under a relative rounding error that is the same for every channel
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

import torch

SCHEMES = ("per_layer_rotated", "per_channel", "per_channel_rotated", "mean_rotated", "balanced_rotated")
K_RANGE, V_RANGE = 200.0, 100.0  # vLLM's K/V_SCALE_CONSTANT, as kv_scale_calibration


def sym_pow(c: torch.Tensor, p: float) -> torch.Tensor:
    w, u = torch.linalg.eigh(c)
    return (u * w.clamp_min(1e-30) ** p) @ u.t()


def balanced_transform(q: torch.Tensor, k: torch.Tensor, eps_rel: float = 1e-3) -> torch.Tensor:
    """float64 [D, D]: Ck^-1/2 (Ck^1/2 Cq Ck^1/2)^1/4 from q [N, D], k [M, D] (ridge eps_rel * trace / D)."""
    eye = torch.eye(k.shape[-1], dtype=torch.float64)
    ck, cq = k.t() @ k / k.shape[0], q.t() @ q / q.shape[0]
    ck = ck + eps_rel * torch.trace(ck) / k.shape[-1] * eye
    cq = cq + eps_rel * torch.trace(cq) / q.shape[-1] * eye
    root = sym_pow(ck, 0.5)
    return sym_pow(ck, -0.5) @ sym_pow(root @ cq @ root, 0.25)


class FoldedScheme:
    """Per layer: (M [H, D, D], M^-1, mu_k [H, D], mu_v [H, Dv], s_k scalar or [H, D], s_v scalar or [H, Dv])."""

    def __init__(self, name: str, rotation: torch.Tensor) -> None:
        self.name, self.rot, self.layers = name, rotation.double(), {}

    def calibrate(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        heads, dim = k.shape[1], k.shape[2]
        group = q.shape[1] // heads
        eye = torch.eye(dim, dtype=torch.float64)
        mu_k = k.mean(0) if self.name in ("mean_rotated", "balanced_rotated") else torch.zeros_like(k[0])
        mu_v = v.mean(0) if self.name == "mean_rotated" else torch.zeros_like(v[0])
        mats = []
        for h in range(heads):
            m = eye
            if self.name == "balanced_rotated":
                m = balanced_transform(q[:, h * group:(h + 1) * group].reshape(-1, dim), k[:, h] - mu_k[h])
            mats.append(m if self.name == "per_channel" else m @ self.rot)
        m = torch.stack(mats)
        kt = torch.einsum("thd,hde->the", k - mu_k, m)
        if self.name.startswith("per_channel"):
            s_k, s_v = kt.abs().amax(0) / K_RANGE, (v - mu_v).abs().amax(0) / V_RANGE
        else:
            if self.name == "balanced_rotated":  # heads to one range, so one scalar per layer fits all
                m = m / kt.abs().amax(dim=(0, 2))[:, None, None]
                kt = torch.einsum("thd,hde->the", k - mu_k, m)
            s_k, s_v = kt.abs().amax() / K_RANGE, (v - mu_v).abs().amax() / V_RANGE
        self.layers[layer] = (m, torch.linalg.inv(m), mu_k, mu_v, s_k.clamp_min(1e-30), s_v.clamp_min(1e-30))

    def round_trip(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m, m_inv, mu_k, mu_v, s_k, s_v = self.layers[layer]
        f8 = torch.float8_e4m3fn
        kt = torch.einsum("thd,hde->the", k - mu_k, m)
        k_held = torch.einsum("the,hed->thd", (kt / s_k).to(f8).double() * s_k, m_inv) + mu_k
        return k_held, ((v - mu_v) / s_v).to(f8).double() * s_v + mu_v


def install(engine, scheme: FoldedScheme) -> None:  # noqa: ANN001
    """Route the engine's torch_native KV through the scheme (the first prefill of each layer calibrates it)."""
    pool, backend = engine.runner.token_kv_pool, engine.runner.backend
    heads, rows = pool.num_kv_heads, pool.k_buffer[0].shape[0]
    held = {i: (torch.zeros(rows, heads, pool.head_dim), torch.zeros(rows, heads, pool.v_head_dim))
            for i in range(pool.num_layers)}
    queries: dict[int, torch.Tensor] = {}
    forward_extend = backend.forward_extend

    def remember_query(q, k, v, layer, batch, save_kv_cache=True):  # noqa: ANN001, ANN202
        if layer.layer_id not in scheme.layers:
            queries[layer.layer_id] = q.reshape(q.shape[0], layer.num_q_heads, layer.head_dim).double()
        return forward_extend(q, k, v, layer, batch, save_kv_cache)

    def set_kv(layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        k, v = k.reshape(k.shape[0], heads, -1).double(), v.reshape(v.shape[0], heads, -1).double()
        if layer_id not in scheme.layers:
            scheme.calibrate(layer_id, queries[layer_id], k, v)
        k_held, v_held = scheme.round_trip(layer_id, k, v)
        held[layer_id][0][loc], held[layer_id][1][loc] = k_held.float(), v_held.float()

    def get_kv(layer_id: int, loc: torch.Tensor, dtype: torch.dtype | None = None):  # noqa: ANN202
        return held[layer_id][0][loc].to(dtype or pool.dtype), held[layer_id][1][loc].to(dtype or pool.dtype)

    backend.forward_extend, pool.set_kv, pool.get_kv = remember_query, set_kv, get_kv


def recall(name: str, prompts: list[str], answers: list[str]) -> dict:
    from sglx.llm.embedded.task import normalize_output
    from sglx.llm.engine import Engine
    from sglx.llm.kv_cache import kv_rotation

    start = time.perf_counter()
    with Engine(attention_backend="torch_native", kv_cache_dtype="fp8_e4m3", kv_cache_scales="one",
                device="cpu") as eng:
        install(eng, FoldedScheme(name, kv_rotation(eng.runner.token_kv_pool.head_dim)))
        results = eng.generate(prompts, {"max_new_tokens": 8, "temperature": 0.0})
    right = sum(normalize_output(r["text"]) == a for r, a in zip(results, answers))
    return dict(scheme=name, prompts=len(prompts), correct=right, accuracy=right / len(prompts),
                seconds=round(time.perf_counter() - start, 1))


def main() -> None:
    from sglx.llm.embedded.task import MAX_PAIRS, make_example

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--output", default="recall_fp8_folded_scales_cpu.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = random.Random(args.seed)
    examples = [make_example(rng, MAX_PAIRS) for _ in range(args.prompts)]
    out = Path(args.output)
    result: dict = (json.loads(out.read_text()) if out.exists() else
                    dict(device="cpu", processor=platform.processor() or platform.machine(), torch=torch.__version__,
                         threads=1, model="embedded tiny-kv-recall, float32, torch_native, fp8_e4m3, 62 pairs, "
                         "8 new tokens greedy", rows=[]))
    for name in args.schemes.split(","):
        row = dict(recall(name, [p for p, _ in examples], [a for _, a in examples]), prompt_seed=args.seed)
        print(row, flush=True)
        result["rows"].append(row)
        out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
