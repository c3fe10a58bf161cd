"""sglx.Engine with `--attention-backend flex_attention` against Hugging Face transformers, on CPU.

Greedy tokens must equal HF's `generate` and every chosen token's log-probability HF's logits, through
the real scheduler, allocator and radix cache, for page sizes 1 and 16, a sliding-window model
(mistral), a radix-cache hit, chunked prefill with mixed steps and a flex/torch_native hybrid; the
embedded tiny-kv-recall model must recall through it from the `sglx generate` command line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llm_test_utils import hf_greedy, load_hf_model, make_tiny_model
from sglx.attention.llm.flex import FlexAttentionBackend
from sglx.attention.llm.hybrid import HybridAttentionBackend
from sglx.attention.llm.torch_native import TorchNativeBackend
from sglx.errors import SglxError
from sglx.llm.engine import Engine
from sglx.llm.tokenizer import Tokenizer

STEPS = 24
GREEDY = {"max_new_tokens": STEPS, "temperature": 0.0, "ignore_eos": True}
TEXTS = [
    "The quick brown fox",
    "Attention reads keys and values through a table that maps positions to slots.",
    "Radix trees share the prefix of prompts: the system prompt is computed once and reused many times, "
    "and sliding window attention only looks at the most recent tokens.",
]
LOGPROB_ATOL = 2e-4

pytestmark = pytest.mark.usefixtures("single_torch_thread")

_CACHE: dict[str, tuple] = {}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("flex_models")


def model(workdir: Path, arch: str) -> tuple[Path, list[list[int]], list[tuple[list[int], torch.Tensor]]]:
    """(model dir, prompt ids, HF greedy (tokens, logits) per prompt), built once per arch."""
    if arch not in _CACHE:
        path = make_tiny_model(workdir, arch)
        tok = Tokenizer.from_dir(path)
        prompts = [tok.encode(t) for t in TEXTS]
        hf = load_hf_model(path)
        _CACHE[arch] = (path, prompts, [hf_greedy(hf, p, STEPS) for p in prompts])
    return _CACHE[arch]


def flex_engine(path: Path, **flags) -> Engine:
    flags.setdefault("attention_backend", "flex_attention")
    return Engine(model_path=str(path), dtype="float32", max_total_tokens=2048, **flags)


def check_against_hf(result: dict, ref: tuple[list[int], torch.Tensor]) -> None:
    tokens, logits = ref
    assert result["output_ids"] == tokens
    hf_logprobs = torch.log_softmax(logits.double(), -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(result["output_logprobs"], dtype=torch.float64), hf_logprobs,
                               atol=LOGPROB_ATOL, rtol=0)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])  # mistral: sliding window 8
def test_flex_greedy_matches_hf(workdir: Path, arch: str, page_size: int) -> None:
    path, prompts, refs = model(workdir, arch)
    with flex_engine(path, page_size=page_size) as eng:
        assert eng.info["attention_backend"] == "flex_attention"
        assert isinstance(eng.runner.backend, FlexAttentionBackend)
        results = eng.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    for result, ref in zip(results, refs):
        check_against_hf(result, ref)


@pytest.mark.parametrize("page_size", [1, 16])
def test_flex_radix_cache_hit_matches_hf(workdir: Path, page_size: int) -> None:
    path, prompts, _ = model(workdir, "llama")
    shared = (prompts[2] * 2)[:48]
    first, second = shared + prompts[0][1:4], shared + prompts[1][1:6]
    ref_second = hf_greedy(load_hf_model(path), second, STEPS)
    with flex_engine(path, page_size=page_size) as eng:
        eng.generate(input_ids=first, sampling_params=GREEDY)
        hit = eng.generate(input_ids=second, sampling_params=GREEDY, return_logprob=True)
        # both at once: two requests of one batch read the same cached pages
        both = eng.generate(input_ids=[first, second], sampling_params=GREEDY)
    assert hit["cached_tokens"] == 48
    check_against_hf(hit, ref_second)
    assert both[1]["output_ids"] == hit["output_ids"] and all(r["cached_tokens"] >= 48 for r in both)


def test_flex_chunked_prefill_with_mixed_steps_matches_hf(workdir: Path) -> None:
    path, prompts, refs = model(workdir, "mistral")
    with flex_engine(path, chunked_prefill_size=16, page_size=1, enable_mixed_chunk=True) as eng:
        eng.scheduler.record_modes = True
        results = eng.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
        stats = eng.scheduler.stats
    assert stats.chunked_steps >= 2 and "mixed" in stats.modes
    for result, ref in zip(results, refs):
        check_against_hf(result, ref)


def test_flex_prefill_with_torch_native_decode(workdir: Path) -> None:
    path, prompts, refs = model(workdir, "qwen3")
    with flex_engine(path, attention_backend=None, prefill_attention_backend="flex_attention",
                     decode_attention_backend="torch_native") as eng:
        backend = eng.runner.backend
        assert isinstance(backend, HybridAttentionBackend)
        assert isinstance(backend.prefill, FlexAttentionBackend) and isinstance(backend.decode, TorchNativeBackend)
        results = eng.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    for result, ref in zip(results, refs):
        check_against_hf(result, ref)


def test_flex_refuses_fp8_kv_before_loading_weights(workdir: Path) -> None:
    path, _, _ = model(workdir, "llama")
    with pytest.raises(SglxError, match="fp8 KV cache.*not supported by flex_attention") as info:
        flex_engine(path, kv_cache_dtype="fp8_e4m3")
    assert "torch_native" in str(info.value)


def test_flex_compile_config_is_validated(workdir: Path) -> None:
    path, prompts, refs = model(workdir, "llama")
    # checked against the registry's choices before any weight loads
    with pytest.raises(SglxError, match="'compile' for flex_attention must be one of auto, on, off, got str 'some"):
        flex_engine(path, attention_backend_config="compile=sometimes")
    with flex_engine(path, attention_backend_config='{"compile": "off"}') as eng:
        assert eng.runner.backend.compiled is False
        assert eng.generate(input_ids=prompts[0], sampling_params=GREEDY)["output_ids"] == refs[0][0]


def test_a_prefixed_config_goes_to_that_backend_of_a_hybrid_pair(workdir: Path) -> None:
    """`flex_attention:compile=off` configures the flex prefill of a flex + torch_native pair, strictly."""
    path, prompts, refs = model(workdir, "llama")
    pair = dict(attention_backend=None, prefill_attention_backend="flex_attention",
                decode_attention_backend="torch_native")
    with flex_engine(path, attention_backend_config="flex_attention:compile=off", **pair) as eng:
        assert eng.runner.backend.prefill.compiled is False
        assert eng.generate(input_ids=prompts[0], sampling_params=GREEDY)["output_ids"] == refs[0][0]
    with pytest.raises(SglxError, match="'compile' for flex_attention must be one of auto, on, off"):
        flex_engine(path, attention_backend_config="flex_attention:compile=sometimes", **pair)
    with pytest.raises(SglxError, match=r"flashinfer is not a backend of this run \(prefill flex_attention, "
                                        r"decode torch_native\)"):
        flex_engine(path, attention_backend_config="flashinfer:decode_tensor_cores=off", **pair)


def _embedded_ready() -> bool:
    from sglx.llm.embedded import default_model_path

    return (default_model_path() / "model.safetensors").is_file()


@pytest.mark.skipif(not _embedded_ready(), reason="the embedded model is not built yet")
def test_embedded_model_recalls_through_flex_from_the_command_line() -> None:
    """tiny-kv-recall at its longest trained context, served by `sglx generate --attention-backend flex_attention`."""
    import random

    from sglx.llm.embedded.task import MAX_PAIRS, make_example, normalize_output

    rng = random.Random(11)
    examples = [make_example(rng, MAX_PAIRS, query_index=0 if i == 0 else None) for i in range(4)]
    args = [a for prompt, _ in examples for a in ("--prompt", prompt)]
    proc = subprocess.run([sys.executable, "-m", "sglx", "generate", *args, "--max-new-tokens", "8", "--json",
                           "--attention-backend", "flex_attention", "--page-size", "16"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    assert all(r["attention_backend"]["decode"] == "flex_attention" for r in records)
    assert [normalize_output(r["text"]) for r in records] == [answer for _, answer in examples]
