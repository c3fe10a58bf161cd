"""sglx's Llama-family models against Hugging Face transformers, through the real loader and paged KV.

Every model here is a tiny randomly initialised transformers model saved with save_pretrained; sglx
loads it from disk and runs it through ForwardBatch + the torch_native backend over scattered pages.
HF (float32, eager attention) is the independent reference for every logit and every greedy token.
"""

from __future__ import annotations

import json
import shutil
from functools import lru_cache
from pathlib import Path

import pytest
import torch

from llm_test_utils import PagedKVHarness, hf_greedy, load_hf_model, make_tiny_model
from sglx.errors import SglxError
from sglx.llm.model_config import load_model_config, shipped_configs
from sglx.llm.models import build_model, load_model, resolve_dtype
from sglx.llm.tokenizer import IncrementalDecoder, Tokenizer

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
STEPS = 32
TOL = {"atol": 1e-4, "rtol": 1e-4}
TEXTS = [
    "The quick brown fox",
    "Attention reads keys and values through a table that maps positions to slots.",
    "Radix trees share the prefix of prompts: the system prompt is computed once and reused many times, "
    "and sliding window attention only looks at the most recent tokens.",
]


pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny_models")


_MODELS: dict[tuple, tuple] = {}


def tiny(workdir: Path, arch: str, **overrides) -> tuple:
    """(model dir, sglx model, HF model, tokenizer), built once per module and configuration."""
    key = (arch, json.dumps(overrides, sort_keys=True))
    if key not in _MODELS:
        model_dir = make_tiny_model(workdir, arch, **json.loads(key[1]))  # a copy: HF edits dicts in place
        model, _ = load_model(model_dir, torch.float32, "cpu")
        _MODELS[key] = (model_dir, model, load_hf_model(model_dir), Tokenizer.from_dir(model_dir))
    return _MODELS[key]


@lru_cache(maxsize=64)
def _hf_greedy_cached(arch_key: tuple, prompt: tuple[int, ...], steps: int) -> tuple[list[int], torch.Tensor]:
    return hf_greedy(_MODELS[arch_key][2], list(prompt), steps)


def reference_greedy(arch: str, prompt: list[int], steps: int = STEPS, **overrides) -> tuple[list[int], torch.Tensor]:
    return _hf_greedy_cached((arch, json.dumps(overrides, sort_keys=True)), tuple(prompt), steps)


@torch.no_grad()
def hf_all_logits(hf_model, ids: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([ids])).logits[0].float()


def greedy_decode(harness: PagedKVHarness, rows: list[int], first_logits: torch.Tensor, steps: int,
                  ref_logits: list[torch.Tensor]) -> list[list[int]]:
    """Greedy tokens for each row; every step's logits are checked against HF's for that step."""
    tokens = [[int(t)] for t in first_logits.argmax(-1)]
    for step in range(1, steps):
        logits = harness.decode([(row, toks[-1]) for row, toks in zip(rows, tokens)])
        for i, ref in enumerate(ref_logits):
            torch.testing.assert_close(logits[i], ref[step], **TOL, msg=lambda m, s=step, i=i: f"step {s} req {i}: {m}")
        for toks, t in zip(tokens, logits.argmax(-1).tolist()):
            toks.append(t)
    return tokens


# ---------------------------------------------------------------- parity


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("arch", ARCHS)
def test_batched_prefill_and_decode_match_hf(workdir: Path, arch: str, page_size: int) -> None:
    _, model, hf, tok = tiny(workdir, arch)
    prompts = [tok.encode(t) for t in TEXTS]
    assert len({len(p) for p in prompts}) == 3
    if arch == "mistral":
        assert model.config.sliding_window == 8 and min(len(p) for p in prompts[1:]) > 20
    harness = PagedKVHarness(model, page_size=page_size)
    rows = [harness.new_request() for _ in prompts]
    all_logits = harness.extend(list(zip(rows, prompts)), return_all_logits=True)
    assert all_logits.dtype == torch.float32 and all_logits.shape == (sum(map(len, prompts)), model.config.vocab_size)
    for prompt, ours in zip(prompts, all_logits.split([len(p) for p in prompts])):
        torch.testing.assert_close(ours, hf_all_logits(hf, prompt), **TOL)

    refs = [reference_greedy(arch, p) for p in prompts]
    last = all_logits[torch.tensor([len(p) for p in prompts]).cumsum(0) - 1]
    tokens = greedy_decode(harness, rows, last, STEPS, [r[1] for r in refs])
    assert tokens == [r[0] for r in refs]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
def test_cached_prefix_extend_matches_hf(workdir: Path, arch: str, page_size: int) -> None:
    """A second request reuses the first's KV slots for a shared 32-token prefix (a radix cache hit)."""
    _, model, hf, tok = tiny(workdir, arch)
    first = tok.encode(TEXTS[2])
    second = first[:32] + tok.encode(" keys alpha beta gamma delta", add_special_tokens=False)
    other = tok.encode(TEXTS[1])
    harness = PagedKVHarness(model, page_size=page_size, seed=1)
    row_a = harness.new_request()
    harness.extend([(row_a, first)])
    row_b = harness.new_request(share_from=row_a, shared_len=32)
    row_c = harness.new_request()
    logits = harness.extend([(row_b, second[32:]), (row_c, other)], return_all_logits=True)
    ours_b, ours_c = logits.split([len(second) - 32, len(other)])
    torch.testing.assert_close(ours_b, hf_all_logits(hf, second)[32:], **TOL)
    torch.testing.assert_close(ours_c, hf_all_logits(hf, other), **TOL)

    ref_b, ref_c = reference_greedy(arch, second, 16), reference_greedy(arch, other, 16)
    tokens = greedy_decode(harness, [row_b, row_c], torch.stack([ours_b[-1], ours_c[-1]]), 16, [ref_b[1], ref_c[1]])
    assert tokens == [ref_b[0], ref_c[0]]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_chunked_prefill_matches_hf(workdir: Path, arch: str, page_size: int) -> None:
    """One prompt prefilled in three chunks (not page aligned), the middle one batched with another request."""
    _, model, hf, tok = tiny(workdir, arch)
    prompt = tok.encode(TEXTS[2])
    other = tok.encode(TEXTS[0])
    cuts = [0, 11, 28, len(prompt)]
    harness = PagedKVHarness(model, page_size=page_size, seed=2)
    row, row_other = harness.new_request(), harness.new_request()
    chunks = [harness.extend([(row, prompt[cuts[0]:cuts[1]])], return_all_logits=True)]
    mixed = harness.extend([(row, prompt[cuts[1]:cuts[2]]), (row_other, other)], return_all_logits=True)
    chunks.append(mixed[:cuts[2] - cuts[1]])
    chunks.append(harness.extend([(row, prompt[cuts[2]:])], return_all_logits=True))
    torch.testing.assert_close(torch.cat(chunks), hf_all_logits(hf, prompt), **TOL)
    torch.testing.assert_close(mixed[cuts[2] - cuts[1]:], hf_all_logits(hf, other), **TOL)

    ref = reference_greedy(arch, prompt)
    tokens = greedy_decode(harness, [row], chunks[-1][-1:], STEPS, [ref[1]])
    assert tokens == [ref[0]]


ROPE_SCALINGS = {
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
}


@pytest.mark.parametrize("kind", list(ROPE_SCALINGS))
def test_rope_scaling_matches_hf(workdir: Path, kind: str) -> None:
    scaling = ROPE_SCALINGS[kind]
    _, model, hf, tok = tiny(workdir, "llama", rope_scaling=scaling)
    assert model.config.rope_type == kind
    plain = tiny(workdir, "llama")[1]
    assert not torch.equal(model.model.rotary.inv_freq(torch.device("cpu")),
                           plain.model.rotary.inv_freq(torch.device("cpu")))
    prompt = tok.encode(TEXTS[2] + " " + TEXTS[1])
    assert len(prompt) > 50  # beyond the 32-token original context
    harness = PagedKVHarness(model, page_size=16)
    row = harness.new_request()
    logits = harness.extend([(row, prompt)], return_all_logits=True)
    torch.testing.assert_close(logits, hf_all_logits(hf, prompt), **TOL)
    ref = reference_greedy("llama", prompt, 12, rope_scaling=scaling)
    assert greedy_decode(harness, [row], logits[-1:], 12, [ref[1]]) == [ref[0]]


def test_per_layer_sliding_window_matches_hf(workdir: Path) -> None:
    """Qwen2 with use_sliding_window: only layers >= max_window_layers slide (HF's layer_types)."""
    _, model, hf, tok = tiny(workdir, "qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1)
    assert model.config.layer_sliding_windows == (None, 8)
    assert [layer.self_attn.attn.spec.sliding_window for layer in model.model.layers] == [None, 8]
    prompt = tok.encode(TEXTS[2])
    harness = PagedKVHarness(model, page_size=4)
    row = harness.new_request()
    logits = harness.extend([(row, prompt)], return_all_logits=True)
    torch.testing.assert_close(logits, hf_all_logits(hf, prompt), **TOL)
    ref = reference_greedy("qwen2", prompt, 12, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    assert greedy_decode(harness, [row], logits[-1:], 12, [ref[1]]) == [ref[0]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_close_to_hf(workdir: Path, dtype: torch.dtype) -> None:
    """bf16/fp16 follow HF's casts (norms and RoPE in float32, cast back): logits agree to a few ulps."""
    from transformers import AutoModelForCausalLM

    model_dir, _, _, tok = tiny(workdir, "qwen3")
    model, _ = load_model(model_dir, dtype, "cpu")
    assert next(model.parameters()).dtype == dtype
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, attn_implementation="eager").eval()
    prompt = tok.encode(TEXTS[1])
    harness = PagedKVHarness(model, page_size=16)
    logits = harness.extend([(harness.new_request(), prompt)], return_all_logits=True)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, hf_all_logits(hf, prompt), atol=0.06, rtol=0)


def test_tied_embeddings(workdir: Path) -> None:
    from safetensors import safe_open

    model_dir, model, hf, tok = tiny(workdir, "qwen2", tie_word_embeddings=True)
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in set(f.keys())
    assert model.config.tie_word_embeddings and model.lm_head is None
    prompt = tok.encode(TEXTS[1])
    harness = PagedKVHarness(model)
    logits = harness.extend([(harness.new_request(), prompt)], return_all_logits=True)
    torch.testing.assert_close(logits, hf_all_logits(hf, prompt), **TOL)


def test_sharded_checkpoint_loads_and_mismatches_are_reported(workdir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    model_dir = make_tiny_model(workdir, "qwen3", seed=3, max_shard_size="60KB")
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2
    model, _ = load_model(model_dir, "float32", "cpu", show_progress=True)
    hf = load_hf_model(model_dir)
    prompt = Tokenizer.from_dir(model_dir).encode(TEXTS[1])
    harness = PagedKVHarness(model, page_size=16)
    logits = harness.extend([(harness.new_request(), prompt)], return_all_logits=True)
    torch.testing.assert_close(logits, hf_all_logits(hf, prompt), **TOL)

    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    tensors = load_file(str(broken / shards[-1]))
    dropped = sorted(tensors)[0]
    del tensors[dropped]
    tensors["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(2)
    save_file(tensors, str(broken / shards[-1]), metadata={"format": "pt"})
    with pytest.raises(SglxError) as err:
        load_model(broken, "float32", "cpu")
    assert dropped in str(err.value) and "model.layers.0.mlp.extra_proj.weight" in str(err.value)

    for f in broken.glob("*.safetensors*"):
        f.unlink()
    with pytest.raises(SglxError, match="--load-format dummy"):
        load_model(broken, "float32", "cpu")


# ---------------------------------------------------------------- configs and dummy weights

EXPECTED_SHIPPED = {
    "llama-3.1-8b": dict(architecture="LlamaForCausalLM", num_layers=32, num_kv_heads=8, head_dim=128,
                         rope_theta=500000.0, vocab_size=128256, sliding_window=None),
    "llama-3.2-1b": dict(architecture="LlamaForCausalLM", num_layers=16, hidden_size=2048, head_dim=64,
                         tie_word_embeddings=True),
    "qwen2.5-7b": dict(architecture="Qwen2ForCausalLM", num_layers=28, num_kv_heads=4, qkv_bias=True,
                       sliding_window=None, intermediate_size=18944),
    "qwen3-8b": dict(architecture="Qwen3ForCausalLM", num_layers=36, head_dim=128, qk_norm=True, qkv_bias=False),
    "mistral-7b": dict(architecture="MistralForCausalLM", num_layers=32, sliding_window=4096, num_kv_heads=8),
    # MLA models: their shapes are checked in test_deepseek.py
    "deepseek-v2-lite": dict(architecture="DeepseekV2ForCausalLM", num_layers=27),
    "deepseek-v3": dict(architecture="DeepseekV3ForCausalLM", num_layers=61),
}


def test_shipped_configs_parse() -> None:
    assert set(shipped_configs()) == set(EXPECTED_SHIPPED)
    for name, expected in EXPECTED_SHIPPED.items():
        cfg = load_model_config(name)
        assert cfg.torch_dtype == "bfloat16" and cfg.eos_token_ids
        for field, value in expected.items():
            assert getattr(cfg, field) == value, (name, field)
    assert load_model_config("llama-3.1-8b").rope_scaling["rope_type"] == "llama3"
    assert load_model_config("mistral-7b").attention_traits("bfloat16").sliding_window
    assert not load_model_config("qwen2.5-7b").attention_traits("bfloat16").sliding_window
    traits = load_model_config("qwen3-8b").attention_traits("float16")
    assert (traits.head_dim, traits.dtype, traits.mla) == (128, "float16", False)
    with pytest.raises(SglxError, match="--load-format dummy"):
        load_model("qwen3-8b", "auto", "cpu")


@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen2.5-7b", "qwen3-8b", "mistral-7b"])
def test_dummy_weights_for_shrunk_shipped_config(tmp_path: Path, name: str) -> None:
    """Dummy-load a shipped config shrunk to CPU size (the real 7-8B ones do not fit a CI runner)."""
    from sglx.llm.model_config import SHIPPED_CONFIG_DIR

    raw = json.loads((SHIPPED_CONFIG_DIR / f"{name}.json").read_text())
    raw.update(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=200)
    if "head_dim" in raw:
        raw["head_dim"] = 16
    if raw.get("sliding_window") and name.startswith("mistral"):
        raw["sliding_window"] = 6
    (tmp_path / "config.json").write_text(json.dumps(raw))
    model, cfg = load_model(tmp_path, "auto", "cpu", load_format="dummy", seed=0)
    assert next(model.parameters()).dtype == torch.bfloat16  # auto keeps the config's bf16 on CPU
    again, _ = load_model(tmp_path, "auto", "cpu", load_format="dummy", seed=0)
    other, _ = load_model(tmp_path, "auto", "cpu", load_format="dummy", seed=1)
    for (n, a), b, c in zip(model.state_dict().items(), again.state_dict().values(), other.state_dict().values()):
        assert torch.equal(a, b), n
        assert torch.equal(a, c) == n.endswith("norm.weight"), n
    harness = PagedKVHarness(model, page_size=4)
    logits = harness.extend([(harness.new_request(), list(range(3, 23)))])
    assert logits.shape == (1, 200) and torch.isfinite(logits).all()


def test_unsupported_architecture_and_rope_are_clear_errors(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "n_embd": 64}))
    with pytest.raises(SglxError) as err:
        load_model_config(tmp_path)
    assert "GPT2LMHeadModel" in str(err.value) and "LlamaForCausalLM" in str(err.value)

    cfg = load_model_config("llama-3.2-1b")
    from dataclasses import replace

    small = replace(cfg, hidden_size=32, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                    head_dim=16, vocab_size=16, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(SglxError, match="dynamic.*not supported.*llama3"):
        build_model(small, torch.float32, "cpu")
    with pytest.raises(SglxError, match="no such directory"):
        load_model_config(tmp_path / "nope")


def test_resolve_dtype() -> None:
    cfg = load_model_config("qwen3-8b")
    assert resolve_dtype("auto", cfg) == torch.bfloat16
    assert resolve_dtype("float32", cfg) == torch.float32
    from dataclasses import replace

    fp16 = replace(cfg, torch_dtype="float16")
    assert resolve_dtype("auto", fp16, "cpu") == torch.float32
    assert resolve_dtype("auto", fp16, "cuda") == torch.float16
    assert resolve_dtype("auto", replace(cfg, torch_dtype=None)) == torch.float32
    with pytest.raises(SglxError, match="--dtype"):
        resolve_dtype("float64", cfg)


# ---------------------------------------------------------------- tokenizer

MESSAGES = [
    {"role": "system", "content": "You are a helpful model."},
    {"role": "user", "content": "Hello there! Café?"},
    {"role": "assistant", "content": "Hi, how can I help you today?"},
    {"role": "user", "content": "  Recall key alpha.  "},
]


@pytest.mark.parametrize("layout", ["chat_template.jinja", "tokenizer_config.json"])
def test_chat_template_matches_hf(workdir: Path, tmp_path: Path, layout: str) -> None:
    from transformers import AutoTokenizer

    model_dir = tiny(workdir, "llama")[0]
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(model_dir / name, tok_dir / name)
    if layout == "tokenizer_config.json":  # the pre-2024 layout: template inside tokenizer_config.json
        config = json.loads((tok_dir / "tokenizer_config.json").read_text())
        config["chat_template"] = (tok_dir / "chat_template.jinja").read_text()
        (tok_dir / "tokenizer_config.json").write_text(json.dumps(config))
        (tok_dir / "chat_template.jinja").unlink()
    ours, theirs = Tokenizer.from_dir(tok_dir), AutoTokenizer.from_pretrained(str(tok_dir))
    for gen_prompt in (True, False):
        expected = theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen_prompt)
        assert ours.apply_chat_template(MESSAGES, add_generation_prompt=gen_prompt) == expected
    assert ours.apply_chat_template(MESSAGES).startswith("<s><|system|>\nYou are")
    with pytest.raises(SglxError, match="Unknown role: tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])

    (tok_dir / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(SglxError, match="no chat template"):
        Tokenizer.from_dir(tok_dir).apply_chat_template(MESSAGES)


def test_tokenizer_matches_hf_and_incremental_decoder(workdir: Path) -> None:
    from transformers import AutoTokenizer

    model_dir, _, _, tok = tiny(workdir, "llama")
    theirs = AutoTokenizer.from_pretrained(str(model_dir))
    text = "Grüße aus München 🦊 日本語, naïve café! The fox</s> jumps."
    for special in (True, False):
        assert tok.encode(text, add_special_tokens=special) == theirs.encode(text, add_special_tokens=special)
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id and tok.eos_token_ids == (theirs.eos_token_id,)
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)

    assert any("\ufffd" in tok.decode([i]) for i in ids)  # some characters span several tokens
    for skip in (True, False):
        decoder = IncrementalDecoder(tok, skip_special_tokens=skip)
        pieces = [decoder.push(i) for i in ids]
        assert not any("\ufffd" in p for p in pieces)
        assert "" in pieces  # held back while a character was incomplete
        assert "".join(pieces) + decoder.flush() == tok.decode(ids, skip_special_tokens=skip)
    decoder = IncrementalDecoder(tok)
    partial = tok.encode("🦊", add_special_tokens=False)
    assert [decoder.push(i) for i in partial[:-1]] == [""] * (len(partial) - 1)
    assert decoder.flush() == tok.decode(partial[:-1])  # an unfinished character is still flushed at the end


# ---------------------------------------------------------------- GPU tier (pytest -m gpu on a lent GPU)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
def test_gpu_matches_hf(workdir: Path, arch: str) -> None:
    """Same parity on CUDA: float32 tight, bfloat16 within a few ulps; weights built on meta then CUDA."""
    from transformers import AutoModelForCausalLM

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model_dir, _, _, tok = tiny(workdir, arch)
    prompts = [tok.encode(t) for t in TEXTS]
    for dtype, tol in ((torch.float32, {"atol": 1e-3, "rtol": 1e-3}), (torch.bfloat16, {"atol": 0.08, "rtol": 0})):
        model, _ = load_model(model_dir, dtype, "cuda")
        hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, attn_implementation="eager")
        hf = hf.to("cuda").eval()
        harness = PagedKVHarness(model, page_size=16)
        rows = [harness.new_request() for _ in prompts]
        logits = harness.extend(list(zip(rows, prompts)), return_all_logits=True)
        for prompt, ours in zip(prompts, logits.split([len(p) for p in prompts])):
            with torch.no_grad():
                ref = hf(torch.tensor([prompt], device="cuda")).logits[0].float()
            torch.testing.assert_close(ours, ref, **tol)


@pytest.mark.gpu
def test_gpu_dummy_shipped_config_runs() -> None:
    """A real shipped config (llama-3.2-1b, 1.2B params) dummy-loads on CUDA in its bf16 and runs a step."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model, cfg = load_model("llama-3.2-1b", "auto", "cuda", load_format="dummy", seed=0)
    assert next(model.parameters()).dtype == torch.bfloat16 and model.lm_head is None
    harness = PagedKVHarness(model, page_size=16, max_requests=2, max_context=128)
    row = harness.new_request()
    logits = harness.extend([(row, list(range(100, 164)))])
    assert logits.shape == (1, cfg.vocab_size) and torch.isfinite(logits).all()
    logits = harness.decode([(row, int(logits.argmax()))])
    assert torch.isfinite(logits).all()
