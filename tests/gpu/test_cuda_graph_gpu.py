"""CUDA-graph decode on a real GPU: graphs equal eager decode, triton equals torch_native, padding is harmless.

Tiny random models built here (head dim 64); float32 so greedy tokens are not decided by rounding.
Run on the lent machine: PYTHONPATH=src python3 -m pytest -m gpu tests/gpu/test_cuda_graph_gpu.py -q
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

STEPS = 24
LENGTHS = [5, 40, 17, 63, 9]  # five requests: bucket 8, three padded slots


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from llm_test_utils import make_tiny_model

    root = tmp_path_factory.mktemp("graph_models")
    return {arch: make_tiny_model(root, arch, head_dim=64) for arch in ("llama", "mistral")}


def prompts(vocab: int = 300) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(4, vocab, (n,), generator=gen).tolist() for n in LENGTHS]


def params() -> list[dict]:
    # different lengths: the decode batch shrinks 5 -> 1 and walks through buckets 8, 4, 2, 1
    return [{"max_new_tokens": STEPS - 4 * i, "temperature": 0.0, "ignore_eos": True} for i in range(len(LENGTHS))]


def generate(path: Path, **flags) -> tuple[list[dict], dict, int]:
    from sglx.llm.engine import Engine

    flags = {"dtype": "float32", "device": "cuda", "max_total_tokens": 4096, "cuda_graph_max_bs": 16, **flags}
    with Engine(model_path=str(path), **flags) as eng:
        out = eng.generate(input_ids=prompts(), sampling_params=params(), return_logprob=True)
        runner = eng.runner
        replays = runner.graph_runner.replays if runner.graph_runner is not None else 0
        return out, eng.info, replays


@pytest.mark.parametrize("arch,page_size", [("llama", 1), ("llama", 16), ("mistral", 16)])
def test_graph_decode_equals_eager_decode_token_for_token(models, arch: str, page_size: int) -> None:
    graphed, info, replays = generate(models[arch], attention_backend="triton", page_size=page_size)
    assert info["cuda_graph"] is True and info["cuda_graph_max_bs"] == 16
    assert replays >= STEPS - 1  # every decode step replayed a graph
    eager, info_eager, eager_replays = generate(models[arch], attention_backend="triton", page_size=page_size,
                                                disable_cuda_graph=True)
    assert info_eager["cuda_graph"] is False and "--disable-cuda-graph" in info_eager["cuda_graph_why"]
    assert eager_replays == 0
    for g, e in zip(graphed, eager):
        assert g["output_ids"] == e["output_ids"]
        torch.testing.assert_close(torch.tensor(g["output_logprobs"]), torch.tensor(e["output_logprobs"]),
                                   atol=1e-4, rtol=0)


@pytest.mark.parametrize("splits", ["policy", "one"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_triton_with_graphs_equals_torch_native(models, page_size: int, splits: str, monkeypatch) -> None:
    if splits == "one":  # the one-split launch (stage 1 writes the output) that batches of 1.4+ rows per SM get
        import sglx.attention.llm.triton as triton_backend
        from sglx.attention.kernels.decode_attention import DecodeConfig

        monkeypatch.setattr(triton_backend, "DecodeConfig", lambda: DecodeConfig(one_split_rows_per_sm=1e-9))
    triton_out, _, replays = generate(models["llama"], attention_backend="triton", page_size=page_size)
    assert replays > 0
    native_out, info, _ = generate(models["llama"], attention_backend="torch_native", page_size=page_size)
    assert info["cuda_graph"] is False and "torch_native does not support CUDA graphs" in info["cuda_graph_why"]
    for t, n in zip(triton_out, native_out):
        assert t["output_ids"] == n["output_ids"]
        torch.testing.assert_close(torch.tensor(t["output_logprobs"]), torch.tensor(n["output_logprobs"]),
                                   atol=1e-4, rtol=0)


def test_hybrid_graphs_follow_the_decode_backend(models) -> None:
    out, info, replays = generate(models["llama"], prefill_attention_backend="torch_native",
                                  decode_attention_backend="triton")
    assert info["cuda_graph"] is True and replays > 0
    _, info_rev, replays_rev = generate(models["llama"], prefill_attention_backend="triton",
                                        decode_attention_backend="torch_native")
    assert info_rev["cuda_graph"] is False and replays_rev == 0
    native, _, _ = generate(models["llama"], attention_backend="torch_native")
    assert [r["output_ids"] for r in out] == [r["output_ids"] for r in native]


def test_padded_slots_write_only_the_padding_page(models) -> None:
    """A replay of 3 requests in bucket 4 changes KV slot 0 and the 3 real slots, nothing else."""
    from sglx.llm.engine_config import EngineConfig
    from sglx.llm.forward_batch import ForwardBatch, ForwardMode
    from sglx.llm.model_runner import ModelRunner

    runner = ModelRunner(EngineConfig(model_path=str(models["llama"]), dtype="float32", device="cuda",
                                      attention_backend="triton", max_total_tokens=256, cuda_graph_max_bs=8))
    try:
        assert runner.graph_runner is not None and runner.graph_runner.buckets == [1, 2, 4, 8]
        pool = runner.token_kv_pool
        for buf in (*pool.k_buffer, *pool.v_buffer):
            buf.normal_()
        table = runner.req_to_token_pool.req_to_token
        lens = [7, 12, 3]
        slots = [torch.arange(n, device="cuda") + 1 + 32 * i for i, n in enumerate(lens)]
        for i, s in enumerate(slots):
            table[i + 1, :len(s)] = s.int()
        before = [b.clone() for b in (*pool.k_buffer, *pool.v_buffer)]
        out_loc = torch.stack([s[-1] for s in slots])
        batch = ForwardBatch(mode=ForwardMode.DECODE, input_ids=torch.tensor([5, 6, 7], device="cuda"),
                             positions=torch.tensor([n - 1 for n in lens], device="cuda"),
                             req_pool_indices=torch.tensor([1, 2, 3], device="cuda"),
                             seq_lens=torch.tensor(lens, device="cuda"), out_cache_loc=out_loc,
                             req_to_token_pool=runner.req_to_token_pool, token_kv_pool=pool, seq_lens_cpu=lens)
        graphed = runner.forward(batch).clone()
        assert runner.graph_runner.replays == 1 and graphed.shape[0] == 3
        assert torch.equal(runner.last_greedy_ids, graphed.argmax(-1))  # the argmax captured in the graph
        allowed = {0, *out_loc.tolist()}
        for old, new in zip(before, (*pool.k_buffer, *pool.v_buffer)):
            changed = set((old != new).any(-1).any(-1).nonzero().flatten().tolist())
            assert changed <= allowed and set(out_loc.tolist()) <= changed
        runner.graph_runner, saved = None, runner.graph_runner  # the same step eagerly
        for old, buf in zip(before, (*pool.k_buffer, *pool.v_buffer)):
            buf.copy_(old)
        eager = runner.forward(batch)
        assert runner.last_greedy_ids is None  # eager steps leave the argmax to the sampler
        runner.graph_runner = saved
        torch.testing.assert_close(graphed, eager, atol=1e-4, rtol=0)
    finally:
        runner.release_memory()


@pytest.mark.parametrize("source", ["cpu", "cuda"])
def test_packed_input_fill_from_host_or_device_pads_and_overwrites_stale_values(source: str):
    """One-launch fill (pinned H2D for host inputs, multi-tensor copy for device inputs) equals the per-field copy."""
    from sglx.llm.cuda_graph_runner import DecodeInputBuffers
    from sglx.llm.forward_batch import ForwardBatch, ForwardMode

    buffers = DecodeInputBuffers(8, torch.device("cuda"))
    buffers.packed.fill_(-7)
    for step, (bs, bucket) in enumerate([(3, 4), (5, 8), (1, 1), (2, 4)]):
        ids = [100 * step + i for i in range(bs)]
        fields = {name: torch.tensor([v + k for v in ids], device=source)
                  for k, name in enumerate(DecodeInputBuffers.FIELDS)}
        batch = ForwardBatch(mode=ForwardMode.DECODE, req_to_token_pool=None, token_kv_pool=None,
                             seq_lens_cpu=fields["seq_lens"].tolist(), **fields)
        lens = buffers.fill(batch, bucket, fill_seq_len=1)
        assert lens == fields["seq_lens"].tolist() + [1] * (bucket - bs)
        for k, name in enumerate(DecodeInputBuffers.FIELDS):
            pad = 1 if name == "seq_lens" else 0
            want = [v + k for v in ids] + [pad] * (bucket - bs)
            assert getattr(buffers, name)[:bucket].tolist() == want, (step, name)


def generate_one_by_one(path: Path, **flags) -> tuple[list[dict], dict, int]:
    """Each prompt alone (single-request prefills), then the first again with a suffix (a radix-cache hit)."""
    from sglx.llm.engine import Engine

    flags = {"dtype": "float32", "device": "cuda", "max_total_tokens": 4096, "cuda_graph_max_bs": 16, **flags}
    ps = prompts()
    ps.append(ps[3] + [11, 12, 13, 14, 15])  # 63 cached tokens + 5 new
    sampling = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    with Engine(model_path=str(path), **flags) as eng:
        out = [eng.generate(input_ids=[p], sampling_params=[sampling], return_logprob=True)[0] for p in ps]
        pg = eng.runner.prefill_graph_runner
        return out, eng.info, pg.replays if pg is not None else 0


@pytest.mark.parametrize("page_size", [1, 16])
def test_prefill_graphs_equal_eager_prefill_token_for_token(models, page_size: int) -> None:
    graphed, info, replays = generate_one_by_one(models["llama"], attention_backend="triton", page_size=page_size)
    # the tiny model's context (512) caps the default 1024
    assert info["prefill_cuda_graph"] is True and info["prefill_cuda_graph_max_tokens"] == 512
    assert replays == len(LENGTHS) + 1  # every prefill, the cached-prefix one included, replayed a graph
    eager, info_eager, eager_replays = generate_one_by_one(models["llama"], attention_backend="triton",
                                                           page_size=page_size, cuda_graph_max_prefill_tokens=0)
    assert info_eager["prefill_cuda_graph"] is False and eager_replays == 0
    for g, e in zip(graphed, eager, strict=True):
        assert g["output_ids"] == e["output_ids"]
        torch.testing.assert_close(torch.tensor(g["output_logprobs"]), torch.tensor(e["output_logprobs"]),
                                   atol=1e-4, rtol=0)


def test_prefill_graph_writes_only_the_prompt_slots_and_the_padding_page(models) -> None:
    """A 37-token prefill replays the 64-token graph: its 37 slots and slot 0 change, nothing else."""
    from sglx.llm.engine_config import EngineConfig
    from sglx.llm.forward_batch import ForwardBatch, ForwardMode
    from sglx.llm.model_runner import ModelRunner

    runner = ModelRunner(EngineConfig(model_path=str(models["llama"]), dtype="float32", device="cuda",
                                      attention_backend="triton", max_total_tokens=512, cuda_graph_max_bs=8,
                                      cuda_graph_max_prefill_tokens=128))
    try:
        pg = runner.prefill_graph_runner
        assert pg is not None and pg.buckets == [16, 32, 64, 96, 128]
        pool = runner.token_kv_pool
        for buf in (*pool.k_buffer, *pool.v_buffer):
            buf.normal_()
        n = 37
        slots = torch.randperm(400, device="cuda")[:n] + 50
        runner.req_to_token_pool.req_to_token[2, :n] = slots.int()
        before = [b.clone() for b in (*pool.k_buffer, *pool.v_buffer)]
        batch = ForwardBatch(mode=ForwardMode.EXTEND, input_ids=torch.randint(4, 300, (n,), device="cuda"),
                             positions=torch.arange(n, device="cuda"),
                             req_pool_indices=torch.tensor([2], device="cuda"),
                             seq_lens=torch.tensor([n], device="cuda"), out_cache_loc=slots,
                             req_to_token_pool=runner.req_to_token_pool, token_kv_pool=pool, seq_lens_cpu=[n],
                             extend_seq_lens_cpu=[n], extend_prefix_lens_cpu=[0])
        graphed = runner.forward(batch).clone()
        assert pg.replays == 1 and graphed.shape[0] == 1
        assert torch.equal(runner.last_greedy_ids, graphed.argmax(-1))
        allowed = {0, *slots.tolist()}
        after = [b.clone() for b in (*pool.k_buffer, *pool.v_buffer)]
        for old, new in zip(before, after):
            changed = set((old != new).any(-1).any(-1).nonzero().flatten().tolist())
            assert changed <= allowed and set(slots.tolist()) <= changed
        runner.prefill_graph_runner = None  # the same step eagerly
        for old, buf in zip(before, (*pool.k_buffer, *pool.v_buffer)):
            buf.copy_(old)
        eager = runner.forward(batch)
        runner.prefill_graph_runner = pg
        torch.testing.assert_close(graphed, eager, atol=1e-4, rtol=0)
        for new, buf in zip(after, (*pool.k_buffer, *pool.v_buffer)):
            torch.testing.assert_close(new[1:], buf[1:], atol=1e-5, rtol=0)
    finally:
        runner.release_memory()
