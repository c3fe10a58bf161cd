"""Helpers for LLM tests: tiny Hugging Face models + tokenizers in temp dirs, and a paged-KV driver.

Nothing is downloaded: the tokenizer is a byte-level BPE trained on the small corpus below, and the
models are randomly initialised transformers models saved with `save_pretrained`, so sglx's real
loader reads exactly what a user's checkpoint directory holds.
"""

from __future__ import annotations

import copy
import random
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
SPECIAL_TOKENS = [UNK, BOS, EOS, PAD]
TOKENIZER_VOCAB = 384

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] | trim }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

CORPUS = """\
The quick brown fox jumps over the lazy dog. A paged key value cache stores every token of a request.
Attention reads keys and values through a table that maps positions to slots, one page at a time.
Continuous batching mixes prefill and decode steps so the accelerator never waits for a slow request.
Radix trees share the prefix of prompts: the system prompt is computed once and reused many times.
Sliding window attention only looks at the most recent tokens, which keeps long contexts cheap.
Rotary position embeddings rotate queries and keys by an angle that grows with the position.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 2024. Keys: alpha beta gamma delta epsilon zeta.
Café, naïve, über, façade, jalapeño; Grüße aus München. Ελληνικά και русский текст.
user: hello there! assistant: hi, how can I help you today? system: you are a helpful model.
""" * 3


@lru_cache(maxsize=4)
def train_tiny_tokenizer(vocab_size: int = TOKENIZER_VOCAB) -> Any:
    """A byte-level BPE `tokenizers.Tokenizer` trained on CORPUS that prepends BOS like Llama's does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS.splitlines(), trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, bos_id)])
    return tok


def save_tiny_tokenizer(model_dir: Path, chat_template: str | None = CHAT_TEMPLATE) -> Any:
    """Write tokenizer.json + tokenizer_config.json (with the chat template) via transformers; returns it."""
    from transformers import PreTrainedTokenizerFast

    kwargs: dict[str, Any] = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK}
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=train_tiny_tokenizer(), **kwargs)
    hf_tok.save_pretrained(str(model_dir))
    return hf_tok


# DeepSeek-shaped tiny MLA models: 1 dense + 2 MoE layers, 8 routed experts (top 2), latent 32 + rope 8.
_DEEPSEEK_TINY: dict[str, Any] = dict(
    num_hidden_layers=3, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
    head_dim=8, v_head_dim=16, max_position_embeddings=128, n_routed_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=32, first_k_dense_replace=1,
)
ARCH_CONFIGS = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {"sliding_window": 8}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {}),
    # DeepSeek-V2-Lite's shape: no q LoRA, greedy softmax routing, 2 shared experts, YaRN (mscale 0.707)
    "deepseek_v2": ("DeepseekV2Config", {
        **_DEEPSEEK_TINY, "q_lora_rank": None, "n_shared_experts": 2, "topk_method": "greedy",
        "routed_scaling_factor": 1.0, "norm_topk_prob": False,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}}),
    # DeepSeek-V3's shape: q LoRA, sigmoid noaux_tc routing over 4 groups (top 2), bias, scaled and renormalized
    "deepseek_v3": ("DeepseekV3Config", {
        **_DEEPSEEK_TINY, "q_lora_rank": 24, "n_shared_experts": 1, "n_group": 4, "topk_group": 2,
        "routed_scaling_factor": 2.5, "norm_topk_prob": True,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}}),
}


def tiny_hf_config(arch: str = "llama", **overrides: Any) -> Any:
    """A transformers config of `arch` with tiny dims (hidden 64, 2 layers, GQA 4/2 heads of 16)."""
    import transformers

    tok = train_tiny_tokenizer()
    class_name, arch_defaults = ARCH_CONFIGS[arch]
    params: dict[str, Any] = dict(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
        bos_token_id=tok.token_to_id(BOS), eos_token_id=tok.token_to_id(EOS), pad_token_id=tok.token_to_id(PAD),
    )
    params.update(copy.deepcopy(arch_defaults))  # transformers edits nested dicts (rope) in place
    params.update(overrides)
    return getattr(transformers, class_name)(**params)


def randomize_(model: torch.nn.Module, seed: int = 0, std: float = 0.08) -> None:
    """Random values in EVERY tensor, norms (around 1) and biases included, so a tensor sglx fails to
    load (or loads into the wrong place) changes the logits instead of silently matching HF's init."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                param.copy_(1.0 + 0.1 * noise)
            else:
                param.copy_(std * noise)
        for name, buf in sorted(model.named_buffers()):  # DeepSeek-V3's router bias is a buffer in transformers
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.05 * torch.randn(buf.shape, generator=gen))


def make_tiny_model(tmp_path: Path, arch: str = "llama", seed: int = 0, max_shard_size: str | None = None,
                    chat_template: str | None = CHAT_TEMPLATE, std: float = 0.08, **overrides: Any) -> Path:
    """Save a tiny random `arch` model (+ tokenizer) in tmp_path/<arch>-<seed>; returns the directory.

    std: the weights' spread (`randomize_`; wider models want less to keep bf16 logits near the float32 ones).
    overrides go to the transformers config (e.g. tie_word_embeddings=True, rope_scaling={...}).
    """
    from transformers import AutoModelForCausalLM

    model_dir = Path(tmp_path) / f"{arch}-{seed}"
    suffix = 1
    while model_dir.exists():
        model_dir = Path(tmp_path) / f"{arch}-{seed}-{suffix}"
        suffix += 1
    config = tiny_hf_config(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(model, seed, std)
    if config.tie_word_embeddings:
        model.tie_weights()
    save_kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(str(model_dir), **save_kwargs)
    save_tiny_tokenizer(model_dir, chat_template)
    return model_dir


def load_hf_model(model_dir: Path) -> Any:
    """The saved model through transformers itself (float32, eager attention): the reference."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                attn_implementation="eager").eval()


@torch.no_grad()
def assert_paged_greedy_matches_hf(harness: Any, hf_model: Any, prompt: list[int], steps: int,
                                   tol: float = 1e-4) -> None:
    """One request through a PagedKVHarness: the prefill's logits of every prompt token, then `steps - 1` greedy
    decode steps' logits, and the greedy tokens equal transformers'."""
    row = harness.new_request()
    logits = harness.extend([(row, prompt)], return_all_logits=True)
    with torch.no_grad():
        torch.testing.assert_close(logits, hf_model(torch.tensor([prompt])).logits[0], atol=tol, rtol=tol)
    tokens, ref = hf_greedy(hf_model, prompt, steps)
    got = [int(logits[-1].argmax())]
    for step in range(1, steps):
        step_logits = harness.decode([(row, got[-1])])[0]
        torch.testing.assert_close(step_logits, ref[step], atol=tol, rtol=tol)
        got.append(int(step_logits.argmax()))
    assert got == tokens


def hf_greedy(hf_model: Any, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """HF `generate(do_sample=False)` without EOS stopping: (new tokens, per-step logits [steps, vocab])."""
    from transformers import GenerationConfig

    gen = GenerationConfig(do_sample=False, max_new_tokens=steps, min_new_tokens=0, eos_token_id=None,
                           pad_token_id=hf_model.config.pad_token_id, output_logits=True,
                           return_dict_in_generate=True)
    ids = torch.tensor([prompt])
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, torch.stack([step[0] for step in out.logits]).float()


class PagedKVHarness:
    """Drives an sglx model step by step through ForwardBatch + TorchNativeBackend, like a tiny runner.

    Pages are handed out in a shuffled order, so a request's tokens are scattered over the KV pool
    (and a shared prefix points at another request's slots) exactly as the radix cache leaves them.
    """

    def __init__(self, model: torch.nn.Module, page_size: int = 1, max_requests: int = 8,
                 max_context: int = 256, kv_cache_dtype: str = "auto", seed: int = 0) -> None:
        from sglx.attention.llm.base import BackendContext
        from sglx.attention.llm.torch_native import TorchNativeBackend
        from sglx.attention.llm.torch_native_mla import TorchNativeMLABackend
        from sglx.llm.kv_cache import ReqToTokenPool, TokenKVPool
        from sglx.llm.mla_kv_cache import MLATokenKVPool

        cfg = model.config
        param = next(model.parameters())
        self.model = model
        self.device, self.dtype = param.device, param.dtype
        self.page_size = page_size
        num_pages = max_requests * (-(-max_context // page_size))
        self.req_pool = ReqToTokenPool(max_requests, max_context, self.device)
        if cfg.mla is not None:  # MLA models: one latent per token and layer, the MLA reference backend
            self.kv_pool = MLATokenKVPool(num_pages * page_size, page_size, cfg.num_layers, cfg.mla.kv_lora_rank,
                                          cfg.mla.qk_rope_head_dim, self.dtype, kv_cache_dtype, self.device)
        else:
            self.kv_pool = TokenKVPool(num_pages * page_size, page_size, cfg.num_layers, cfg.num_kv_heads,
                                       cfg.head_dim, self.dtype, kv_cache_dtype, self.device)
        ctx = BackendContext(device=self.device, dtype=self.dtype, num_q_heads=cfg.num_heads,
                             num_kv_heads=self.kv_pool.num_kv_heads, head_dim=self.kv_pool.head_dim,
                             page_size=page_size, req_to_token_pool=self.req_pool,
                             token_kv_pool=self.kv_pool)  # type: ignore[arg-type]
        self.backend = TorchNativeMLABackend(ctx) if cfg.mla is not None else TorchNativeBackend(ctx)
        self.free_pages = list(range(1, num_pages + 1))  # page 0 is the padding page
        random.Random(seed).shuffle(self.free_pages)
        self.seq_lens: dict[int, int] = {}

    def new_request(self, share_from: int | None = None, shared_len: int = 0) -> int:
        """A req_to_token row; optionally reusing the first `shared_len` KV slots of another request."""
        row = self.req_pool.alloc()
        assert row is not None, "harness out of request rows"
        self.seq_lens[row] = 0
        if share_from is not None and shared_len:
            assert shared_len % self.page_size == 0, "prefixes are shared in whole pages"
            table = self.req_pool.req_to_token
            table[row, :shared_len] = table[share_from, :shared_len]
            self.seq_lens[row] = shared_len
        return row

    def _alloc(self, row: int, n: int) -> list[int]:
        table = self.req_pool.req_to_token
        start = self.seq_lens[row]
        slots = []
        for pos in range(start, start + n):
            new_page = pos % self.page_size == 0
            page = self.free_pages.pop() if new_page else int(table[row, pos - 1]) // self.page_size
            slot = page * self.page_size + pos % self.page_size
            table[row, pos] = slot
            slots.append(slot)
        return slots

    def _run(self, mode: Any, rows: list[int], ids: list[list[int]], return_all_logits: bool) -> torch.Tensor:
        batch = self.build_batch(mode, rows, ids, return_all_logits)
        self.backend.init_forward_metadata(batch)
        with torch.no_grad():
            return self.model(batch)

    def build_batch(self, mode: Any, rows: list[int], ids: list[list[int]], return_all_logits: bool = False) -> Any:
        """The step's ForwardBatch with its KV slots allocated (not run): for runners that run it themselves."""
        from sglx.llm.forward_batch import ForwardBatch

        prefix = [self.seq_lens[r] for r in rows]
        slots, positions = [], []
        for row, new, start in zip(rows, ids, prefix):
            slots += self._alloc(row, len(new))
            positions += range(start, start + len(new))
            self.seq_lens[row] = start + len(new)
        dev = self.device
        return ForwardBatch(
            mode=mode,
            input_ids=torch.tensor([t for new in ids for t in new], dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            req_pool_indices=torch.tensor(rows, dtype=torch.long, device=dev),
            seq_lens=torch.tensor([self.seq_lens[r] for r in rows], dtype=torch.long, device=dev),
            out_cache_loc=torch.tensor(slots, dtype=torch.long, device=dev),
            req_to_token_pool=self.req_pool,
            token_kv_pool=self.kv_pool,
            attn_backend=self.backend,
            extend_seq_lens_cpu=[len(new) for new in ids] if mode.is_extend else [],
            extend_prefix_lens_cpu=prefix if mode.is_extend else [],
            return_all_logits=return_all_logits,
        )

    def extend(self, items: list[tuple[int, list[int]]], return_all_logits: bool = False) -> torch.Tensor:
        """One EXTEND step: (row, new token ids) per request, each on top of what the row already holds."""
        from sglx.llm.forward_batch import ForwardMode

        return self._run(ForwardMode.EXTEND, [r for r, _ in items], [list(t) for _, t in items], return_all_logits)

    def decode(self, items: list[tuple[int, int]]) -> torch.Tensor:
        """One DECODE step: (row, token id) per request -> logits [bs, vocab]."""
        from sglx.llm.forward_batch import ForwardMode

        return self._run(ForwardMode.DECODE, [r for r, _ in items], [[t] for _, t in items], False)


def embedded_recall(num_prompts: int = 64, seed: int = 2024, **engine_kwargs: Any) -> tuple[int, int, Any]:
    """Exact answers of the embedded model at its longest trained context (greedy, one thread), through an Engine
    built with `engine_kwargs`; returns (right, asked, the engine's KV pool) so callers can check its scales.
    Skips when the embedded model is not built."""
    import pytest

    from sglx.llm.embedded import default_model_path
    from sglx.llm.embedded.task import MAX_PAIRS, make_example, normalize_output
    from sglx.llm.engine import Engine

    if not (default_model_path() / "model.safetensors").is_file():
        pytest.skip("the embedded model is not built")
    rng = random.Random(seed)
    examples = [make_example(rng, MAX_PAIRS) for _ in range(num_prompts)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with Engine(**engine_kwargs) as eng:
            pool = eng.runner.token_kv_pool
            results = eng.generate([p for p, _ in examples], {"max_new_tokens": 8, "temperature": 0.0})
    finally:
        torch.set_num_threads(threads)
    right = sum(normalize_output(r["text"]) == a for r, (_, a) in zip(results, examples))
    return right, len(examples), pool

