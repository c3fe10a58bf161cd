"""The torch_native MLA backend against the float64 expanded-latent reference on random paged batches.

Ragged requests with cached prefixes on scattered pages (page sizes 1, 4, 16), an EXTEND step (non-absorbed
path: prefix + new latents expanded per head) then DECODE steps (absorbed path: W_UK folded into q, attention
over the 576-wide latents, W_UV after), float32 / bfloat16 and an fp8 latent cache.
"""

from __future__ import annotations

import pytest
import torch

from sglx.attention.llm.base import BackendContext
from sglx.attention.llm.mla_base import MLALayerSpec, MLAProjections, absorb_q, apply_uv, expand_latent
from sglx.attention.llm.mla_reference import reference_mla
from sglx.attention.llm.torch_native_mla import TorchNativeMLABackend
from sglx.llm.forward_batch import ForwardBatch, ForwardMode
from sglx.llm.kv_cache import ReqToTokenPool
from sglx.llm.mla_kv_cache import MLATokenKVPool

H, DN, DR, DV, R = 4, 16, 8, 12, 32
SPEC = MLALayerSpec(layer_id=1, num_heads=H, qk_nope_head_dim=DN, qk_rope_head_dim=DR, v_head_dim=DV,
                    kv_lora_rank=R, scaling=0.7 * (DN + DR) ** -0.5)

pytestmark = pytest.mark.usefixtures("single_torch_thread")


class PagedLatents:
    """Requests whose latents live on shuffled pages of an MLA pool (layer 1 of 2)."""

    def __init__(self, totals: list[int], page: int, dtype: torch.dtype, kv_cache_dtype: str, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.page, self.dtype = page, dtype
        pages_needed = sum(-(-t // page) for t in totals)
        num_slots = (pages_needed + 3) * page
        self.r2t = ReqToTokenPool(len(totals) + 1, max(totals) + page)
        self.pool = MLATokenKVPool(num_slots, page, 2, R, DR, dtype, kv_cache_dtype)
        page_ids = (torch.randperm(num_slots // page, generator=self.gen) + 1).tolist()
        self.rows, self.latents = [], []
        for t in totals:
            row = self.r2t.alloc()
            mine = [page_ids.pop() for _ in range(-(-t // page))]
            self.r2t.req_to_token[row, :t] = torch.tensor([p * page + j for p in mine for j in range(page)][:t],
                                                          dtype=torch.int32)
            self.rows.append(row)
            self.latents.append(torch.randn(t, R + DR, generator=self.gen).to(dtype))
        ctx = BackendContext(torch.device("cpu"), dtype, H, 1, R + DR, page, self.r2t, self.pool)  # type: ignore[arg-type]
        self.backend = TorchNativeMLABackend(ctx)
        w = torch.randn(H * (DN + DV), R, generator=self.gen) * R ** -0.5
        self.proj = MLAProjections.from_kv_b_proj(w.to(dtype), SPEC)

    def slots(self, i: int, lo: int, hi: int) -> torch.Tensor:
        return self.r2t.req_to_token[self.rows[i], lo:hi].long()

    def store_prefix(self, i: int, n: int) -> None:
        if n:
            lat = self.latents[i][:n]
            self.pool.set_latent(SPEC.layer_id, self.slots(i, 0, n), lat[:, :R], lat[:, R:])

    def step(self, mode: ForwardMode, lo: list[int], hi: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run one step over tokens lo[i]..hi[i]-1; returns (q_nope, q_pe, output)."""
        n_new = [b - a for a, b in zip(lo, hi)]
        q_nope = torch.randn(sum(n_new), H, DN, generator=self.gen).to(self.dtype)
        q_pe = torch.randn(sum(n_new), H, DR, generator=self.gen).to(self.dtype)
        new = torch.cat([lat[a:b] for lat, a, b in zip(self.latents, lo, hi)])
        loc = torch.cat([self.slots(i, a, b) for i, (a, b) in enumerate(zip(lo, hi))])
        batch = ForwardBatch(
            mode=mode, input_ids=torch.zeros(sum(n_new), dtype=torch.long),
            positions=torch.cat([torch.arange(a, b) for a, b in zip(lo, hi)]),
            req_pool_indices=torch.tensor(self.rows), seq_lens=torch.tensor(hi), out_cache_loc=loc,
            req_to_token_pool=self.r2t, token_kv_pool=self.pool, attn_backend=self.backend,  # type: ignore[arg-type]
            extend_seq_lens_cpu=n_new if mode.is_extend else [],
            extend_prefix_lens_cpu=list(lo) if mode.is_extend else [],
        )
        self.backend.init_forward_metadata(batch)
        out = self.backend.forward_mla(q_nope, q_pe, new[:, :R], new[:, R:], SPEC, self.proj, batch)
        return q_nope, q_pe, out

    def reference(self, i: int, q_nope: torch.Tensor, q_pe: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """float64 expanded attention over what the pool holds for request i (fp8-rounded when the pool is)."""
        latent = self.pool.get_latent(SPEC.layer_id, self.slots(i, 0, hi), torch.float64)
        return reference_mla(q_nope, q_pe, latent, self.proj.w_uk, self.proj.w_uv, torch.arange(lo, hi), SPEC.scaling)


TOLS = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page", [1, 4, 16])
def test_extend_with_prefix_then_decode_matches_float64(page: int, dtype: torch.dtype, kv_cache_dtype: str) -> None:
    prefix, extend, decodes = [0, 13, 37, 16], [21, 6, 1, 9], 3
    totals = [p + e + decodes for p, e in zip(prefix, extend)]
    s = PagedLatents(totals, page, dtype, kv_cache_dtype, seed=page)
    for i, p in enumerate(prefix):
        s.store_prefix(i, p)
    worst = 0.0
    lo, hi = prefix, [p + e for p, e in zip(prefix, extend)]
    mode = ForwardMode.EXTEND
    for _ in range(1 + decodes):
        q_nope, q_pe, out = s.step(mode, lo, hi)
        assert out.shape == (q_nope.shape[0], H, DV) and out.dtype == dtype
        offset = 0
        for i, (a, b) in enumerate(zip(lo, hi)):
            ref = s.reference(i, q_nope[offset:offset + b - a], q_pe[offset:offset + b - a], a, b)
            worst = max(worst, (out[offset:offset + b - a].double() - ref).abs().max().item())
            offset += b - a
        lo, hi, mode = hi, [b + 1 for b in hi], ForwardMode.DECODE
    assert worst < TOLS[dtype], worst


def test_latents_are_stored_where_req_to_token_says() -> None:
    s = PagedLatents([10, 7], 4, torch.float32, "auto", seed=3)
    s.step(ForwardMode.EXTEND, [0, 0], [10, 7])
    for i, t in enumerate([10, 7]):
        torch.testing.assert_close(s.pool.get_latent(SPEC.layer_id, s.slots(i, 0, t)), s.latents[i], rtol=0, atol=0)
    assert s.pool.kv_buffer[0].abs().sum() == 0  # another layer's buffer is untouched
    assert s.pool.bytes_per_token() == 2 * (R + DR) * 4


def test_absorbed_equals_expanded_math() -> None:
    """q_nope W_UK . c == q_nope . (c W_UK^T) and (p c) W_UV^T == p (c W_UV^T): the identity absorption rests on."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(H * (DN + DV), R, generator=gen, dtype=torch.float64)
    proj = MLAProjections.from_kv_b_proj(w, SPEC)
    latent = torch.randn(9, R + DR, generator=gen, dtype=torch.float64)
    q_nope = torch.randn(3, H, DN, generator=gen, dtype=torch.float64)
    keys, values = expand_latent(latent, proj, SPEC)
    torch.testing.assert_close(torch.einsum("thd,lhd->thl", q_nope, keys[..., :DN]),
                               torch.einsum("thr,lr->thl", absorb_q(q_nope, proj), latent[:, :R]))
    probs = torch.softmax(torch.randn(3, H, 9, generator=gen, dtype=torch.float64), -1)
    torch.testing.assert_close(torch.einsum("thl,lhv->thv", probs, values),
                               apply_uv(torch.einsum("thl,lr->thr", probs, latent[:, :R]), proj))


def test_mha_entry_points_refuse() -> None:
    s = PagedLatents([4], 1, torch.float32, "auto", seed=0)
    with pytest.raises(TypeError, match="MLA backend"):
        s.backend.forward_extend(torch.zeros(1), torch.zeros(1), torch.zeros(1), None, None)  # type: ignore[arg-type]
