"""The triton backend's CUDA-graph metadata hooks, under TRITON_INTERPRET=1 (no GPU needed).

Launched by tests/test_cuda_graph.py. A decode batch padded to its bucket the way the graph runner
pads it, with metadata built by the capture/replay hooks and the in-graph build that a replay
re-runs on the static buffers (splits for the longest context), must give the eager path's outputs
for the real requests, and padding must only ever address slot 0, the reserved padding page.
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover - guarded by the launcher
    pytest.skip("run through tests/test_cuda_graph.py (needs TRITON_INTERPRET=1)", allow_module_level=True)

from sglx.attention.llm.base import BackendContext, LayerSpec  # noqa: E402
from sglx.attention.llm.triton import TritonBackend  # noqa: E402
from sglx.llm.cuda_graph_runner import DecodeInputBuffers, bucket_for, capture_batch_sizes  # noqa: E402
from sglx.llm.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from triton_interpreted.paged import make_paged_cache, reference_attention  # noqa: E402

HQ, HKV, DIM = 4, 2, 64


class _Runner:
    """What DecodeInputBuffers.batch reads from a model runner."""

    def __init__(self, cache, backend) -> None:
        self.req_to_token_pool, self.token_kv_pool, self.backend = cache.r2t, cache.pool, backend


@pytest.mark.parametrize("page,lens", [(1, [5, 40, 17]), (16, [33, 1, 70, 9, 2])])
def test_replay_metadata_gives_the_eager_outputs_and_padding_stays_on_slot_0(page, lens):
    cache = make_paged_cache(lens, page, HKV, DIM, torch.float32, seed=page)
    ctx = BackendContext(torch.device("cpu"), torch.float32, HQ, HKV, DIM, page, cache.r2t, cache.pool)
    eager, graphed = TritonBackend(ctx), TritonBackend(ctx)
    buckets = capture_batch_sizes(8)
    graphed.init_cuda_graph_state(8, 8)
    buffers = DecodeInputBuffers(8, torch.device("cpu"))
    for bucket in buckets:  # what the runner does at capture time: the static buffers, all padding
        graphed.init_forward_metadata_capture_cuda_graph(bucket, buffers.req_pool_indices[:bucket],
                                                         buffers.seq_lens[:bucket])
        graphed.init_forward_metadata_in_graph(bucket)  # the part the graph captures
    bs = len(lens)
    batch = ForwardBatch(
        mode=ForwardMode.DECODE, input_ids=torch.zeros(bs, dtype=torch.long), positions=torch.tensor(lens) - 1,
        req_pool_indices=torch.tensor(cache.rows), seq_lens=torch.tensor(lens),
        out_cache_loc=torch.stack([cache.slots(i, n - 1, n)[0] for i, n in enumerate(lens)]),
        req_to_token_pool=cache.r2t, token_kv_pool=cache.pool, seq_lens_cpu=list(lens))
    bucket = bucket_for(bs, buckets)
    assert bucket == 4 if bs == 3 else bucket == 8
    padded_lens = buffers.fill(batch, bucket, graphed.get_cuda_graph_seq_len_fill_value())
    padded = buffers.batch(bucket, _Runner(cache, graphed), padded_lens)
    graphed.init_forward_metadata_replay_cuda_graph(bucket, padded.req_pool_indices, padded.seq_lens, padded_lens)
    graphed.init_forward_metadata_in_graph(bucket)  # what a replay of the graph re-runs on the filled buffers
    meta = graphed.meta
    assert meta.mid_o.shape[:2] == (bucket, HQ) and meta.kv_indptr.shape == (bucket + 1,)
    total = sum(lens)
    expected = torch.cat([cache.slots(i, 0, n) for i, n in enumerate(lens)]).int()
    assert torch.equal(meta.kv_indices[:total], expected)
    assert torch.equal(meta.kv_indices[total:total + bucket - bs], torch.zeros(bucket - bs, dtype=torch.int32))
    assert meta.kv_indptr.tolist() == [0, *torch.tensor(padded_lens).cumsum(0).tolist()]

    layer = LayerSpec(0, HQ, HKV, DIM, DIM ** -0.5)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(bs, HQ, DIM, generator=gen)
    k = torch.stack([kk[n - 1] for kk, n in zip(cache.raw_keys, lens)])
    v = torch.stack([vv[n - 1] for vv, n in zip(cache.raw_values, lens)])
    eager.init_forward_metadata(batch)
    want = eager.forward(q, k, v, layer, batch)
    pad_q = torch.cat([q, torch.randn(bucket - bs, HQ, DIM, generator=gen)])
    pad_kv = torch.randn(bucket - bs, HKV, DIM, generator=gen)
    got = graphed.forward(pad_q, torch.cat([k, pad_kv]), torch.cat([v, pad_kv]), layer, padded)
    torch.testing.assert_close(got[:bs], want, atol=1e-5, rtol=0)
    for i, n in enumerate(lens):
        ref = reference_attention(q[i:i + 1], cache.keys[i], cache.values[i], torch.tensor([n - 1]), DIM ** -0.5)
        torch.testing.assert_close(got[i:i + 1].double(), ref, atol=1e-5, rtol=0)
    # padding wrote its K/V into slot 0 only: every real slot holds what it held
    real = expected.long()
    assert torch.equal(cache.pool.k_buffer[0][0], pad_kv[-1])
    torch.testing.assert_close(cache.pool.k_buffer[0][real], torch.cat(cache.keys).float())
