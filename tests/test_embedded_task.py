"""The embedded model and its task, checked with Hugging Face transformers as the independent reference."""

from __future__ import annotations

import json
import random

import pytest

from sglx.llm.embedded import DEFAULT_MODEL_DIR, default_model_path
from sglx.llm.embedded.task import (
    MAX_PAIRS,
    NUM_KEYS,
    VALUE_LEN,
    make_example,
    prompt_num_tokens,
    score,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

MAX_BYTES = 8 * 1024 * 1024


@pytest.fixture(scope="module")
def model():
    m = transformers.AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32)
    return m.eval()


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.PreTrainedTokenizerFast.from_pretrained(default_model_path())


def greedy(model, tokenizer, prompts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
    """Batch greedy generation; every prompt of one example size has the same token length."""
    ids = [tokenizer(p, add_special_tokens=add_special_tokens).input_ids for p in prompts]
    assert len({len(i) for i in ids}) == 1
    inputs = torch.tensor(ids)
    with torch.no_grad():
        out = model.generate(
            input_ids=inputs,
            attention_mask=torch.ones_like(inputs),
            max_new_tokens=VALUE_LEN + 2,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    return out[:, inputs.shape[1] :].tolist()


def accuracy(tokenizer, generated: list[list[int]], answers: list[str]) -> float:
    """Exact value followed by EOS, checked on tokens and (through task.score) on text."""
    eos = tokenizer.eos_token_id
    strict = sum(
        g[: VALUE_LEN + 1] == tokenizer(a, add_special_tokens=False).input_ids + [eos]
        for g, a in zip(generated, answers)
    ) / len(answers)
    texts = tokenizer.batch_decode(generated, skip_special_tokens=True)
    assert score(texts, answers) >= strict
    return strict


def test_package_layout_and_size():
    assert default_model_path() == DEFAULT_MODEL_DIR
    assert DEFAULT_MODEL_DIR.is_dir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (DEFAULT_MODEL_DIR / name).is_file(), name
    total = sum(p.stat().st_size for p in DEFAULT_MODEL_DIR.iterdir() if p.is_file())
    assert total <= MAX_BYTES


def test_config_is_gqa_llama_that_stops_at_eos(tokenizer):
    config = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    assert config["eos_token_id"] == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("</s>")
    assert config["bos_token_id"] == tokenizer.bos_token_id
    assert config["max_position_embeddings"] >= prompt_num_tokens(MAX_PAIRS) + VALUE_LEN + 1
    generation = json.loads((DEFAULT_MODEL_DIR / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tokenizer.eos_token_id


def test_make_example_has_unique_keys_and_one_matching_pair():
    rng = random.Random(0)
    for num_pairs in (1, 7, MAX_PAIRS, NUM_KEYS):
        prompt, answer = make_example(rng, num_pairs)
        body, query = prompt.rsplit("? ", 1)
        pairs = [p.split("=") for p in body.split("; ") if p]
        keys = [k for k, _ in pairs]
        assert len(pairs) == num_pairs and len(set(keys)) == num_pairs
        assert dict(pairs)[query.rstrip("=")] == answer and len(answer) == VALUE_LEN
    prompt, answer = make_example(random.Random(1), 5, query_index=0)
    assert prompt.startswith(prompt.rsplit("? ", 1)[1] + answer + ";")
    with pytest.raises(ValueError):
        make_example(rng, 0)


def test_score_is_exact_match():
    assert score(["abcd", " abcd</s>", "abce"], ["abcd", "abcd", "abcd"]) == pytest.approx(2 / 3)
    with pytest.raises(ValueError):
        score(["a"], [])


def test_tokenizer_round_trips_and_has_fixed_lengths(tokenizer):
    prompt, _ = make_example(random.Random(2), MAX_PAIRS)
    ids = tokenizer(prompt).input_ids
    assert ids[0] == tokenizer.bos_token_id and tokenizer.unk_token_id not in ids
    assert len(ids) == prompt_num_tokens(MAX_PAIRS)
    assert tokenizer.decode(ids, skip_special_tokens=True) == prompt
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    assert chat == prompt


def test_solves_task_at_longest_trained_context(model, tokenizer):
    rng = random.Random(1234)
    examples = [make_example(rng, MAX_PAIRS) for _ in range(50)]
    # The farthest-back pair is the hardest case; make sure it is asked for too.
    examples[:5] = [make_example(rng, MAX_PAIRS, query_index=0) for _ in range(5)]
    generated = greedy(model, tokenizer, [p for p, _ in examples])
    assert accuracy(tokenizer, generated, [a for _, a in examples]) >= 0.95


def test_solves_task_without_bos_as_after_chat_template(model, tokenizer):
    rng = random.Random(99)
    examples = [make_example(rng, 32) for _ in range(20)]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False) for p, _ in examples]
    generated = greedy(model, tokenizer, prompts, add_special_tokens=False)
    assert accuracy(tokenizer, generated, [a for _, a in examples]) >= 0.95
