"""One attention benchmark case: its shape, random inputs on a scattered paged KV pool, and a float64 reference.

Every backend and baseline of a case reads the same numbers: K/V are stored once into a one-layer
paged pool on shuffled pages (page 0 stays the padding page, as in the engine), and the reference is
computed in float64 from what the pool holds (dequantized for fp8), so an fp8 row is checked against
its own quantized keys, not against values it never saw.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglx.llm.kv_cache import ReqToTokenPool, TokenKVPool

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 1e-2}  # max |out - float64 reference|
REFERENCE_CHUNK_BYTES = 1 << 30  # float64 score block of one reference step


@dataclass(frozen=True)
class AttentionCase:
    """`batch` requests, each with `kv_len` keys of which the last `new` are this step's queries (decode: 1)."""

    phase: str  # "decode" | "prefill"
    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int
    kv_len: int
    new: int
    page_size: int
    dtype: str
    kv_cache_dtype: str = "auto"

    @property
    def prefix(self) -> int:
        return self.kv_len - self.new

    @property
    def num_tokens(self) -> int:
        return self.batch * self.new

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5

    def label(self) -> str:
        heads = f"B{self.batch} H{self.q_heads}/{self.kv_heads} D{self.head_dim}"
        if self.phase == "decode":
            return f"{heads} ctx {self.kv_len}"
        return f"{heads} {self.prefix}+{self.new} causal"

    def flops(self) -> float:
        """Multiply-adds x 2 of QK^T and PV over the causally visible keys only."""
        visible = self.new * self.prefix + self.new * (self.new + 1) / 2
        return 4.0 * self.batch * self.q_heads * self.head_dim * visible

    def kv_bytes(self, kv_cache_dtype: str | None = None) -> int:
        """Bytes of K and V a kernel must read once (the decode roofline)."""
        kv = self.kv_cache_dtype if kv_cache_dtype is None else kv_cache_dtype
        elem = 1 if kv.startswith("fp8") else torch.tensor([], dtype=DTYPES[self.dtype]).element_size()
        return 2 * self.batch * self.kv_len * self.kv_heads * self.head_dim * elem

    def to_dict(self) -> dict:
        return {"phase": self.phase, "batch": self.batch, "q_heads": self.q_heads, "kv_heads": self.kv_heads,
                "head_dim": self.head_dim, "context": self.kv_len, "prefix": self.prefix, "new": self.new,
                "page_size": self.page_size, "dtype": self.dtype, "kv_cache_dtype": self.kv_cache_dtype,
                "causal": True}


@dataclass
class CaseInputs:
    """Tensors of one case; `slots[b, i]` is the KV slot of request b's token i (row b + 1 of req_to_token)."""

    q: torch.Tensor  # [batch * new, Hq, D], request after request
    k_new: torch.Tensor  # [batch * new, Hkv, D]: this step's keys (already in the pool)
    v_new: torch.Tensor
    keys: torch.Tensor  # [batch, kv_len, Hkv, D] in the compute dtype, as the pool returns them
    values: torch.Tensor
    slots: torch.Tensor  # [batch, kv_len] int64
    req_to_token_pool: ReqToTokenPool
    token_kv_pool: TokenKVPool
    reference: torch.Tensor  # [batch * new, Hq, D] float64


def make_inputs(case: AttentionCase, device: torch.device, seed: int = 0) -> CaseInputs:
    dtype = DTYPES[case.dtype]
    gen = torch.Generator(device=device).manual_seed(seed)
    b, n, length, page = case.batch, case.new, case.kv_len, case.page_size
    k_all = torch.randn(b * length, case.kv_heads, case.head_dim, generator=gen, device=device, dtype=dtype)
    v_all = torch.randn(b * length, case.kv_heads, case.head_dim, generator=gen, device=device, dtype=dtype)
    q = torch.randn(b * n, case.q_heads, case.head_dim, generator=gen, device=device, dtype=dtype)
    per_req = -(-length // page)
    order = torch.randperm(b * per_req, generator=torch.Generator().manual_seed(seed)) + 1  # page 0: padding
    slots = (order.view(b, per_req, 1) * page + torch.arange(page)).view(b, -1)[:, :length].to(device)
    r2t = ReqToTokenPool(b, length + 1, device=device)
    r2t.req_to_token[1:b + 1, :length] = slots.int()
    pool = TokenKVPool(b * per_req * page, page, 1, case.kv_heads, case.head_dim, dtype, case.kv_cache_dtype, device)
    flat = slots.reshape(-1)
    pool.set_kv(0, flat, k_all, v_all)
    keys, values = pool.get_kv(0, flat, dtype)
    keys = keys.view(b, length, case.kv_heads, case.head_dim)
    values = values.view(b, length, case.kv_heads, case.head_dim)
    new_rows = k_all.view(b, length, case.kv_heads, case.head_dim)[:, case.prefix:].reshape(b * n, case.kv_heads, -1)
    new_vals = v_all.view(b, length, case.kv_heads, case.head_dim)[:, case.prefix:].reshape(b * n, case.kv_heads, -1)
    inputs = CaseInputs(q, new_rows, new_vals, keys, values, slots, r2t, pool, torch.empty(0))
    inputs.reference = reference_attention(case, q, keys, values)
    return inputs


def reference_attention(case: AttentionCase, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
                        ) -> torch.Tensor:
    """float64 causal attention (new query i at position prefix + i), a few KV heads at a time."""
    b_total, n, length = case.batch, case.new, case.kv_len
    group = case.q_heads // case.kv_heads
    out = torch.empty(b_total * n, case.q_heads, case.head_dim, dtype=torch.float64, device=q.device)
    q_pos = torch.arange(n, device=q.device) + case.prefix
    visible = torch.arange(length, device=q.device)[None, :] <= q_pos[:, None]  # [n, L]
    chunk = max(1, min(case.kv_heads, REFERENCE_CHUNK_BYTES // (group * n * length * 8)))
    for b in range(b_total):
        for h in range(0, case.kv_heads, chunk):
            c = min(chunk, case.kv_heads - h)
            qs = q[b * n:(b + 1) * n, h * group:(h + c) * group].double().view(n, c, group, -1)
            ks = keys[b, :, h:h + c].double()
            vs = values[b, :, h:h + c].double()
            scores = torch.einsum("nhgd,lhd->hgnl", qs, ks) * case.scale
            scores = scores.masked_fill(~visible, float("-inf"))
            o = torch.einsum("hgnl,lhd->nhgd", torch.softmax(scores, dim=-1), vs)
            out[b * n:(b + 1) * n, h * group:(h + c) * group] = o.reshape(n, c * group, -1)
    return out


def max_abs_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    return float((out.double() - reference).abs().max().item())
