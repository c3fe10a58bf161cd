"""The `flex_attention` LLM backend against float64 and against torch_native, step by step on paged batches.

Each case replays a request mix (cached prefixes, ragged extends, decode, mixed) on shuffled pages and
checks every output against the float64 reference of tests/triton_interpreted/paged.py; one case has two
requests of one batch read the same radix-shared prefix pages. Eager flex ignores the block lists (it
applies the mask everywhere), so their coverage is checked on its own, and one case runs compiled on
CPU, where the fused kernel visits only the listed blocks (the path CUDA runs).
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from sglx import platform
from sglx.attention.checks import run_check
from sglx.attention.config import validate_config
from sglx.attention.llm.base import BackendContext, LayerSpec
from sglx.attention.llm.flex import FlexAttentionBackend, decode_bucket, resolve_compile
from sglx.attention.llm.flex_masks import KV_BLOCK, Q_BLOCK
from sglx.attention.llm.torch_native import TorchNativeBackend
from sglx.attention.registry import find
from sglx.errors import BackendUnavailableError, ConfigError
from sglx.llm.forward_batch import ForwardMode
from triton_interpreted.paged import PagedCache, make_paged_cache, reference_attention, step_batch

DIM = 16
PREFIX = [0, 13, 37, 5]
STEPS = [(ForwardMode.EXTEND, [21, 6, 1, 140]), (ForwardMode.DECODE, [1, 1, 1, 1]),
         (ForwardMode.MIXED, [1, 4, 1, 2]), (ForwardMode.DECODE, [1, 1, 1, 1])]
TOL = 2e-5


def _ctx(cache: PagedCache, hq: int, hkv: int, page: int, **config) -> BackendContext:
    return BackendContext(torch.device("cpu"), torch.float32, hq, hkv, DIM, page, cache.r2t, cache.pool, config)


def _share_prefix(cache: PagedCache, src: int, dst: int, n: int) -> None:
    """Request dst now reads request src's first n slots, as after a radix-cache hit (same K/V there)."""
    cache.r2t.req_to_token[cache.rows[dst], :n] = cache.r2t.req_to_token[cache.rows[src], :n]
    for seq in (cache.keys, cache.values, cache.raw_keys, cache.raw_values):
        seq[dst][:n] = seq[src][:n]


def _total(prefix: list[int], steps: list) -> list[int]:
    return [p + sum(s[1][i] for s in steps) for i, p in enumerate(prefix)]


def _replay(page: int, hq: int, hkv: int, window: int | None, cap: float, shared: int = 0,
            compile: str = "off", prefix: list[int] = PREFIX, steps: list = STEPS) -> float:
    """Run the steps through flex and torch_native on twin pools; return flex's worst error vs float64."""
    caches = [make_paged_cache(_total(prefix, steps), page, hkv, DIM, torch.float32, fill=prefix, seed=page + hq)
              for _ in range(2)]
    if shared:
        for c in caches:
            _share_prefix(c, 1, 2, shared)
    flex = FlexAttentionBackend(_ctx(caches[0], hq, hkv, page, compile=compile))
    native = TorchNativeBackend(_ctx(caches[1], hq, hkv, page))
    layer = LayerSpec(0, hq, hkv, DIM, DIM ** -0.5, sliding_window=window, logit_cap=cap)
    gen = torch.Generator().manual_seed(7)
    lo, worst = list(prefix), 0.0
    for mode, new in steps:
        q = torch.randn(sum(new), hq, DIM, generator=gen)
        outs = []
        for cache, backend in zip(caches, (flex, native)):
            batch = step_batch(cache, mode, lo, new)
            k = torch.cat([kk[a:a + n] for kk, a, n in zip(cache.raw_keys, lo, new)])
            v = torch.cat([vv[a:a + n] for vv, a, n in zip(cache.raw_values, lo, new)])
            backend.init_forward_metadata(batch)
            outs.append(backend.forward(q, k, v, layer, batch))
        assert outs[0].shape == q.shape
        assert (outs[0] - outs[1]).abs().max().item() <= TOL, mode
        row = 0
        for i, (a, n) in enumerate(zip(lo, new)):
            c = caches[0]
            ref = reference_attention(q[row:row + n], c.keys[i][:a + n], c.values[i][:a + n], torch.arange(a, a + n),
                                      layer.scaling, window, cap)
            worst = max(worst, (outs[0][row:row + n].double() - ref).abs().max().item())
            row += n
        lo = [a + n for a, n in zip(lo, new)]
    return worst


@pytest.mark.parametrize(("page", "hq", "hkv", "window", "cap"), [
    (1, 4, 2, None, 0.0),  # GQA, token pages
    (16, 4, 2, 9, 7.0),  # sliding window shorter than most prefixes, logit soft-cap
    (64, 4, 4, None, 0.0),  # MHA, pages wider than short requests
    (128, 8, 2, 33, 0.0),  # a page per kv block, group of 4
])
def test_flex_equals_float64_and_torch_native_step_by_step(page, hq, hkv, window, cap):
    assert _replay(page, hq, hkv, window, cap) <= TOL


@pytest.mark.parametrize("page", [1, 16])
def test_requests_sharing_radix_prefix_pages_in_one_batch(page):
    """Two requests read the same prefix slots (a radix hit); each still sees only its own later tokens."""
    assert _replay(page, 4, 2, None, 0.0, shared=13) <= TOL


LONG_PREFIX, LONG_STEPS = [300, 0], [(ForwardMode.EXTEND, [260, 9]), (ForwardMode.DECODE, [1, 1])]


def _step_mask(page: int, mode: ForwardMode, window: int | None, prefix: list[int] = PREFIX,
               steps: list = STEPS, full_blocks: bool = True):
    steps = steps[:1] if mode.is_extend else steps[:2]
    # a pool several kv blocks long, with requests on shuffled pages of it
    cache = make_paged_cache([*_total(prefix, steps), 600], page, 2, DIM, torch.float32, fill=[*prefix, 0], seed=1)
    cache.rows.pop()  # the last request only spreads the others over a larger pool
    backend = FlexAttentionBackend(_ctx(cache, 4, 2, page, compile="on"))  # compiled: the whole pool is the window
    lo = list(prefix) if mode.is_extend else [p + n for p, n in zip(prefix, steps[0][1])]
    backend.init_forward_metadata(step_batch(cache, mode, lo, steps[-1][1]))
    assert backend.step is not None
    backend.step.full_blocks = full_blocks  # as on CUDA (CPU Inductor cannot build them)
    return backend.step.block_mask(window), backend.step.layout.length


def _blocks(mask: torch.Tensor, nq: int, nk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block of an element mask [b, Q, KV]: (any element set, every element set and the block whole)."""
    b, q_len, kv_len = mask.shape
    padded = torch.zeros(b, nq * Q_BLOCK, nk * KV_BLOCK, dtype=torch.bool)
    padded[:, :q_len, :kv_len] = mask
    tiles = padded.view(b, nq, Q_BLOCK, nk, KV_BLOCK)
    return tiles.any(dim=4).any(dim=2), tiles.all(dim=4).all(dim=2)


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
@pytest.mark.parametrize(("page", "window", "long"), [(1, None, False), (16, 9, False), (64, None, False),
                                                      (1, 3, False), (128, None, True), (128, 100, True)])
def test_block_lists_are_exactly_the_blocks_with_an_allowed_key(page, mode, window, long):
    """Listed blocks hold an allowed pair and every allowed pair is listed; a full block allows all its pairs."""
    args = (LONG_PREFIX, LONG_STEPS) if long else ()
    bm, kv_len = _step_mask(page, mode, window, *args)
    b, q_len = bm.kv_num_blocks.shape[0], bm.seq_lengths[0]
    allowed = create_mask(bm.mask_mod, b, 1, q_len, kv_len, device="cpu")[:, 0]
    assert allowed.any(dim=-1).all()  # every query reads at least itself
    dense = bm.to_dense()[:, 0]  # partial and full blocks together
    nq, nk = dense.shape[-2:]
    needed, whole = _blocks(allowed, nq, nk)
    assert torch.equal(dense.bool(), needed)
    if bm.full_kv_num_blocks is not None:
        full = torch.zeros_like(needed)
        for i in range(b):
            for qb in range(nq):
                n = int(bm.full_kv_num_blocks[i, 0, qb])
                full[i, qb, bm.full_kv_indices[i, 0, qb, :n].long()] = True
        assert not (full & ~whole).any()  # the mask may be skipped only where it holds everywhere
        if long and mode.is_extend and not window:  # queries 300.. over the request's own pages 0..255: full
            assert full.sum() >= 2
    if page >= 16:  # whole pages: the pool has blocks no request of the step reads, and they are skipped
        assert not needed.all()


def test_compiled_on_cpu_over_the_whole_pool_matches():
    """compile=on on CPU: the fused kernel walks the block lists over the whole pool (static shapes), as on CUDA."""
    steps = [(ForwardMode.EXTEND, [21, 6, 140]), (ForwardMode.DECODE, [1, 1, 1])]  # decode padded to 4 rows
    assert _replay(16, 4, 2, None, 0.0, shared=13, compile="on", prefix=PREFIX[:3], steps=steps) <= TOL


def test_compiled_decode_runs_power_of_two_batches():
    assert [decode_bucket(n) for n in (1, 2, 3, 4, 5, 64, 65)] == [1, 2, 4, 4, 8, 64, 128]


def test_doctor_check_passes_with_the_flex_backend():
    result = run_check(find("flex_attention", "llm", "mha"), platform.fake("cpu"))
    assert result.status == "pass", result
    assert result.max_abs_error is not None and result.max_abs_error <= result.tolerance


def test_fp8_pool_is_refused_with_what_would_work():
    cache = make_paged_cache([4], 1, 2, DIM, torch.float32, kv_cache_dtype="fp8_e4m3")
    with pytest.raises(BackendUnavailableError, match="fp8 KV cache.*--kv-cache-dtype auto.*triton or torch_native"):
        FlexAttentionBackend(_ctx(cache, 4, 2, 1))


def test_a_compile_failure_is_one_clear_error_and_other_errors_pass_through():
    """compile=on where torch cannot build the fused kernel (Inductor's NoValidChoicesError on torch 2.11 + H100,
    session 31's GPU tier): the user gets what failed and what runs instead, not Inductor's trace."""
    lowering = type("LoweringException", (RuntimeError,), {"__module__": "torch._inductor.exc"})
    cache = make_paged_cache([8], 16, 2, DIM, torch.float32, fill=[0], seed=1)
    backend = FlexAttentionBackend(_ctx(cache, 4, 2, 16, compile="on"))
    batch = step_batch(cache, ForwardMode.EXTEND, [0], [8])
    layer = LayerSpec(0, 4, 2, DIM, DIM ** -0.5)
    q, k, v = torch.randn(8, 4, DIM), torch.randn(8, 2, DIM), torch.randn(8, 2, DIM)
    for error, expected in ((lowering("NoValidChoicesError: No choices to select\nmore"), BackendUnavailableError),
                            (ValueError("a shape bug"), ValueError)):
        def broken(*args, error=error, **kwargs):  # type: ignore[no-untyped-def]
            raise error
        backend._flex = {False: broken, True: broken}
        backend.init_forward_metadata(batch)
        with pytest.raises(expected) as info:
            backend.forward(q, k, v, layer, batch)
        if expected is BackendUnavailableError:
            assert str(info.value) == (
                f"attention backend flex_attention: compile=on could not compile flex attention with torch "
                f"{torch.__version__} (LoweringException: NoValidChoicesError: No choices to select); use "
                "--attention-backend-config compile=off (the default) or --attention-backend triton")
        else:
            assert str(info.value) == "a shape bug"


def test_compile_setting():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert (resolve_compile("auto", cpu), resolve_compile("auto", cuda)) == (False, False)
    assert resolve_compile("on", cpu) and not resolve_compile("off", cuda) and not resolve_compile(None, cpu)
    with pytest.raises(ConfigError, match="compile='sometimes'.*auto, on, off"):
        resolve_compile("sometimes", cpu)
    spec = find("flex_attention", "llm", "mha")  # the CLI path: the registry's choices, before weights load
    assert validate_config(spec, {"compile": "on"})["compile"] == "on"
    for bad in ("sometimes", True):
        with pytest.raises(ConfigError, match="'compile' for flex_attention must be"):
            validate_config(spec, {"compile": bad})
