#!/usr/bin/env python3
"""Train the embedded sglx model (``src/sglx/llm/embedded/tiny-kv-recall``) from scratch.

The model is a Hugging Face ``LlamaForCausalLM`` (GQA, RoPE, RMSNorm, SiLU MLP) trained on the
key-value recall task of ``sglx.llm.embedded.task``: the answer is only recoverable by attending
back across the whole prompt, so the shipped model is a checkable end-to-end test of attention
backends, paged KV caches and RoPE. Everything is seeded and uses deterministic algorithms, so a
rerun on the same machine gives the same weights.

    # the shipped model (one GPU, about 4 minutes; prints the accuracy table at the end)
    python scripts/train_tiny_model.py --device cuda --attn sdpa --out /tmp/tiny-kv-recall
    # smoke test on CPU
    python scripts/train_tiny_model.py --device cpu --steps 20 --batch-size 8 --eval-examples 8 --out /tmp/smoke

Only config.json, model.safetensors, tokenizer.json, tokenizer_config.json, generation_config.json
and README.md are copied into the package; train_info.json and train_log.txt stay with the run.
"""

from __future__ import annotations

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before torch: deterministic cuBLAS

import argparse
import hashlib
import importlib.util
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors


def _load_task():
    """Load task.py by path: the script must not depend on the rest of sglx importing cleanly."""
    path = Path(__file__).resolve().parents[1] / "src" / "sglx" / "llm" / "embedded" / "task.py"
    spec = importlib.util.spec_from_file_location("sglx_embedded_task", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


task = _load_task()
MAX_PAIRS, NUM_KEYS, QUERY_TOKENS = task.MAX_PAIRS, task.NUM_KEYS, task.QUERY_TOKENS
TOKENS_PER_PAIR, VALUE_ALPHABET, VALUE_LEN = task.TOKENS_PER_PAIR, task.VALUE_ALPHABET, task.VALUE_LEN
make_example, prompt_num_tokens, score = task.make_example, task.prompt_num_tokens, task.score
format_key = task.format_key

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
PUNCT = (" ", ";", "=", "?")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% endif %}"
    "{% endfor %}"
)
EVAL_PAIRS = (1, 8, 16, 32, 48, MAX_PAIRS)


# ----------------------------------------------------------------------------- tokenizer


def build_vocab() -> dict[str, int]:
    """Specials, punctuation, letters, then one token per key with its ``=`` (``k0=``..``k63=``)."""
    tokens = [PAD, BOS, EOS, UNK, *PUNCT, *VALUE_ALPHABET]
    tokens += [f"{format_key(i)}=" for i in range(NUM_KEYS)]
    return {t: i for i, t in enumerate(tokens)}


def build_tokenizer() -> Tokenizer:
    """Word-level tokenizer: a key with its ``=`` (``k37=``) is one token, every other character one.

    Why: the value's first letter then directly follows the key token and the query ends on that
    same token, so recall is the classic induction pattern (find the earlier occurrence of the
    current token, copy what followed). In CPU trials a separate ``=`` token, and two-digit keys
    spelled in characters, were not learned at all in 1000 steps, while this layout learned letter
    copying quickly. The post-processor prepends BOS like Llama tokenizers do; the decoder joins
    tokens with no separator, so decode(encode(text)) == text for task text.
    """
    vocab = build_vocab()
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"k\d+=|."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([PAD, BOS, EOS, UNK])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return tok


VOCAB = build_vocab()
ID = {name: VOCAB[name] for name in (PAD, BOS, EOS, UNK, *PUNCT)}
LETTER_IDS = torch.tensor([VOCAB[c] for c in VALUE_ALPHABET])
KEY_IDS = torch.tensor([[VOCAB[f"{format_key(i)}="]] for i in range(NUM_KEYS)])  # (keys, 1)


# ----------------------------------------------------------------------------- data


def make_batch(
    gen: torch.Generator, batch: int, num_pairs: int, num_bos: int, extra_queries: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and labels of ``batch`` examples, built directly as tensors.

    Layout: [BOS]*num_bos, the pairs, ``? k<q>=``, the value, EOS: exactly ``task.format_prompt``
    through the tokenizer (checked by ``check_batch_layout``), but fast enough to feed a GPU every
    step. ``extra_queries`` more questions (other keys) may follow the first EOS: generation never
    sees them (it stops at EOS) but they give several answers' worth of gradient per sequence.
    Labels are -100 except on answer letters and EOS.
    """
    extra = min(extra_queries, num_pairs - 1)
    keys = torch.rand(batch, NUM_KEYS, generator=gen).argsort(dim=1)[:, :num_pairs]
    values = torch.randint(0, len(VALUE_ALPHABET), (batch, num_pairs, VALUE_LEN), generator=gen)
    asked = torch.rand(batch, num_pairs, generator=gen).argsort(dim=1)[:, : 1 + extra]
    col = lambda tok, *shape: torch.full((batch, *shape, 1), ID[tok])  # noqa: E731
    pairs = torch.cat(
        [
            KEY_IDS[keys],
            LETTER_IDS[values],
            col(";", num_pairs),
            col(" ", num_pairs),
        ],
        dim=-1,
    )
    rows = torch.arange(batch).unsqueeze(1)
    q_key = KEY_IDS[keys[rows, asked]]
    answer = LETTER_IDS[values[rows, asked]]
    n_q = 1 + extra
    queries = torch.cat([col("?", n_q), col(" ", n_q), q_key, answer, col(EOS, n_q)], dim=-1)
    prefix = torch.cat([torch.full((batch, num_bos), ID[BOS]), pairs.reshape(batch, -1)], dim=1)
    seq = torch.cat([prefix, queries.reshape(batch, -1)], dim=1)
    is_answer = torch.zeros(queries.shape[-1], dtype=torch.bool)
    is_answer[QUERY_TOKENS:] = True
    mask = torch.cat([torch.zeros(prefix.shape[1], dtype=torch.bool), is_answer.repeat(n_q)])
    labels = torch.where(mask, seq, torch.full_like(seq, -100))
    return seq, labels


def check_batch_layout(tok: Tokenizer) -> None:
    """The tensor-built batch must equal what the tokenizer makes of the task's text."""
    gen = torch.Generator().manual_seed(123)
    for num_pairs in (1, 5, MAX_PAIRS):
        seq, labels = make_batch(gen, 3, num_pairs, num_bos=1, extra_queries=3)
        n_q = min(3, num_pairs - 1) + 1
        first_len = prompt_num_tokens(num_pairs) + VALUE_LEN + 1
        assert seq.shape[1] == first_len + (n_q - 1) * (QUERY_TOKENS + VALUE_LEN + 1)
        assert int((labels != -100).sum()) == 3 * n_q * (VALUE_LEN + 1)
        for row, lab in zip(seq.tolist(), labels.tolist()):
            first = row[:first_len]
            text = tok.decode(first, skip_special_tokens=True)
            prompt, answer = text[:-VALUE_LEN], text[-VALUE_LEN:]
            assert tok.encode(prompt).ids + [VOCAB[c] for c in answer] + [ID[EOS]] == first, text
            assert prompt.endswith("=") and prompt.count(";") == num_pairs
            assert (
                lab[first_len - VALUE_LEN - 2] == -100
                and lab[first_len - VALUE_LEN - 1 : first_len] == first[-VALUE_LEN - 1 :]
            )
            pairs = dict(p.split("=") for p in prompt.rsplit("? ", 1)[0].split("; ") if p)
            later = tok.decode(row[first_len:], skip_special_tokens=False).split("</s>")[:-1]
            asked = [prompt.rsplit("? ", 1)[1]] + later
            assert len(set(asked)) == n_q
            for q in later:  # each extra question is "? k<id>=<its value>"
                key, value = q.removeprefix("? ").split("=")
                assert pairs[key] == value


class Curriculum:
    """How many pairs each batch has: short first, longer once the model answers at the current ceiling.

    Induction-style recall is learned quickly on short prompts and then extends to long ones; starting
    long wastes steps (the first run of this script, with a fixed ramp, never learned). The ceiling
    grows when exact accuracy at the ceiling reaches ``advance_at``, and at least linearly so that it
    reaches ``max_pairs`` by ``forced_by`` steps. Half the batches sit at the ceiling, half are uniform
    below it. Decisions depend only on the (deterministic) training run, so reruns repeat them.
    """

    def __init__(self, max_pairs: int, forced_by: int, start: int = 4, advance_at: float = 0.9) -> None:
        self.max_pairs, self.forced_by, self.advance_at = max_pairs, max(1, forced_by), advance_at
        self.start = min(start, max_pairs)
        self.ceiling = self.start

    def at_step(self, step: int) -> int:
        forced = self.start + (self.max_pairs - self.start) * step // self.forced_by
        self.ceiling = min(self.max_pairs, max(self.ceiling, forced))
        return self.ceiling

    def advance(self, accuracy_at_ceiling: float) -> bool:
        """Grow the ceiling by about a quarter if the model solves it; True if it is already at the top."""
        if accuracy_at_ceiling < self.advance_at:
            return False
        if self.ceiling >= self.max_pairs:
            return True
        self.ceiling = min(self.max_pairs, max(self.ceiling + 2, self.ceiling * 5 // 4))
        return False

    def sample(self, gen: torch.Generator) -> tuple[int, int]:
        """(num_pairs, num_bos). BOS count varies so plain and chat-templated prompts both work."""
        at_top, length, bos = torch.rand(3, generator=gen).tolist()
        num_pairs = self.ceiling if at_top < 0.5 else 1 + int(length * self.ceiling)
        num_bos = 0 if bos < 0.3 else (1 if bos < 0.9 else 2)
        return num_pairs, num_bos


# ----------------------------------------------------------------------------- model


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 576  # = input positions of the longest training sequence (577 tokens)
    rope_theta: float = 10000.0


def model_shape(args: argparse.Namespace) -> ModelShape:
    return ModelShape(
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        head_dim=args.head_dim,
    )


def build_model(shape: ModelShape, seed: int, attn: str = "sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(VOCAB),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        rope_theta=shape.rope_theta,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        tie_word_embeddings=False,
        bos_token_id=ID[BOS],
        eos_token_id=ID[EOS],
        pad_token_id=ID[PAD],
        attn_implementation=attn,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # Orthogonal input embeddings (the vocab is smaller than the hidden size): every key token is
    # distinguishable from every other from step 0, so the key-matching attention only has to learn
    # one shared map instead of waiting for rare key embeddings to drift apart.
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        torch.nn.init.orthogonal_(emb)
        emb.mul_(config.initializer_range * math.sqrt(config.hidden_size))
    return model


def rope_theta(config) -> float:
    rope = getattr(config, "rope_parameters", None) or {}
    return float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def state_hash(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


# ----------------------------------------------------------------------------- training


def lr_at(step: int, peak: float, warmup: int, anneal_start: int | None, anneal_steps: int) -> float:
    """Linear warmup, constant while the curriculum grows, then cosine down to 10% over the anneal."""
    factor = min(1.0, (step + 1) / warmup)
    if anneal_start is not None:
        progress = min(1.0, (step - anneal_start) / max(1, anneal_steps))
        factor = min(factor, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
    return peak * factor


def train(args: argparse.Namespace, device: torch.device, log) -> torch.nn.Module:
    model = build_model(model_shape(args), args.seed, args.attn)
    model.to(device).train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.98),
        eps=1e-8,
    )
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp == "bf16")
    gen = torch.Generator().manual_seed(args.seed + 1)
    curriculum = Curriculum(args.max_pairs, forced_by=args.forced_ramp_steps)
    answer_len = VALUE_LEN + 1
    hits, tries = torch.zeros((), device=device), 0
    anneal_start: int | None = None
    start = last_check = time.perf_counter()
    hard_stop = 1.15 * args.time_budget_seconds
    args.trained_steps, args.anneal_start, args.anneal_trigger, args.stopped_at = 0, None, None, None

    def begin_anneal(at: int, trigger: str) -> int:
        args.anneal_trigger = trigger
        log(f"step {at}: anneal starts ({trigger}), ceiling {curriculum.ceiling}")
        return at

    for step in range(args.steps):
        if step == args.stop_at_step or (hard_stop and time.perf_counter() - start > hard_stop):
            args.stopped_at = step
            log(f"STOP at step {step} of {args.steps} (reproduce with --stop-at-step {step})")
            break
        if anneal_start is None and step == args.anneal_at_step:
            anneal_start = begin_anneal(step, "--anneal-at-step")
        if anneal_start is None and step >= args.steps - args.anneal_steps:
            anneal_start = begin_anneal(step, "step budget")
        if anneal_start is not None and step - anneal_start >= args.anneal_steps:
            break
        ceiling = curriculum.at_step(step)
        num_pairs, num_bos = curriculum.sample(gen)
        seq, labels = make_batch(gen, args.batch_size, num_pairs, num_bos, args.extra_queries)
        seq, labels = seq.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.lr, args.warmup, anneal_start, args.anneal_steps)
        # Loss only on the answer letters and EOS: everything before them is random or trivial.
        with amp:
            logits = model(input_ids=seq[:, :-1]).logits
        target = labels[:, 1:]
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        args.trained_steps = step + 1
        if num_pairs == ceiling:  # exact first answer (letters + EOS) on batches at the ceiling
            first = prompt_num_tokens(num_pairs, bos=False) + num_bos - 1  # logit index of the first letter
            pred = logits[:, first : first + answer_len].argmax(-1)
            hits += (pred == seq[:, first + 1 : first + 1 + answer_len]).all(dim=1).float().mean()
            tries += 1
        if (step + 1) % args.check_every == 0:
            acc = hits.item() / max(1, tries)
            hits.zero_()
            tries = 0
            now = time.perf_counter()
            per_step, last_check = (now - last_check) / args.check_every, now
            if curriculum.advance(acc) and anneal_start is None:
                anneal_start = begin_anneal(step + 1, f"solved at {curriculum.max_pairs} pairs")
            budget = args.time_budget_seconds
            if anneal_start is None and budget and now - start + 1.1 * args.anneal_steps * per_step > budget:
                anneal_start = begin_anneal(step + 1, "time budget")
            if (step + 1) % args.log_every == 0 or curriculum.ceiling != ceiling:
                log(
                    f"step {step + 1:6d}  ceiling {ceiling:3d}->{curriculum.ceiling:3d}  acc@ceiling {acc:.3f}  "
                    f"loss {loss.item():.4f}  lr {opt.param_groups[0]['lr']:.2e}  {time.perf_counter() - start:7.1f}s"
                )
    if device.type == "cuda":
        torch.cuda.synchronize()
    args.anneal_start = anneal_start
    log(f"trained {args.trained_steps} steps in {time.perf_counter() - start:.1f}s (anneal from {anneal_start})")
    return model.eval()


# ----------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate(model, tok: Tokenizer, device: torch.device, num_pairs: int, n: int, seed: int, **kw) -> float:
    """Greedy generation through transformers on held-out text examples; strict (value + EOS) accuracy."""
    bos_count = kw.pop("bos_count", 1)
    rng = random.Random(seed)
    examples = [make_example(rng, num_pairs, **kw) for _ in range(n)]
    ids = [[ID[BOS]] * bos_count + tok.encode(p, add_special_tokens=False).ids for p, _ in examples]
    inputs = torch.tensor(ids, device=device)
    out = model.generate(
        input_ids=inputs,
        attention_mask=torch.ones_like(inputs),
        max_new_tokens=VALUE_LEN + 2,
        do_sample=False,
        eos_token_id=ID[EOS],
        pad_token_id=ID[PAD],
    )[:, inputs.shape[1] :].tolist()
    texts, strict = [], 0
    for gen_ids, (_, answer) in zip(out, examples):
        expected = [VOCAB[c] for c in answer] + [ID[EOS]]
        strict += gen_ids[: len(expected)] == expected
        texts.append(tok.decode(gen_ids, skip_special_tokens=True))
    if strict and score(texts, [a for _, a in examples]) < strict / n:
        raise RuntimeError("task.score disagrees with the token-level check")
    return strict / n


def evaluation_table(model, tok: Tokenizer, device: torch.device, n: int) -> list[dict]:
    rows = []
    cases = [(p, {}) for p in EVAL_PAIRS]
    cases += [
        (MAX_PAIRS, {"query_index": 0, "label": "first pair asked (farthest back)"}),
        (MAX_PAIRS, {"bos_count": 0, "label": "no BOS (chat template path)"}),
        (MAX_PAIRS, {"bos_count": 2, "label": "double BOS"}),
    ]
    for i, (num_pairs, kw) in enumerate(cases):
        kw = dict(kw)
        label = kw.pop("label", "")
        acc = evaluate(model, tok, device, num_pairs, n, seed=1_000_000 + 1000 * i, **kw)
        bos = kw.get("bos_count", 1)
        rows.append(
            {
                "pairs": num_pairs,
                "prompt_tokens": prompt_num_tokens(num_pairs, bos=False) + bos,
                "case": label or "random pair asked",
                "examples": n,
                "accuracy": acc,
            }
        )
    return rows


# ----------------------------------------------------------------------------- saving


def save(model, tok: Tokenizer, out: Path) -> None:
    """Hugging Face layout that transformers 4.x/5.x and sglx's own loader all read."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    config = json.loads((out / "config.json").read_text())
    config["rope_theta"] = rope_theta(model.config)  # for readers that predate rope_parameters
    config["torch_dtype"] = "float32"
    config.pop("_attn_implementation", None)
    config.pop("attn_implementation", None)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation = {"bos_token_id": ID[BOS], "eos_token_id": ID[EOS], "pad_token_id": ID[PAD], "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    tok.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": UNK,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": model.config.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def reload(out: Path, device: torch.device):
    """Evaluate exactly what ships: the saved files, loaded the way users load them (float32, sdpa)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).to(device).eval()


def render_readme(model, out: Path, rows: list[dict], info: dict) -> str:
    cfg = model.config
    params = sum(p.numel() for p in model.parameters())
    sizes = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.suffix in (".json", ".safetensors")}
    longest_task = prompt_num_tokens(MAX_PAIRS, bos=False) + 2 + VALUE_LEN + 1
    extra = info["extra_queries"]
    longest_train = longest_task + extra * (QUERY_TOKENS + VALUE_LEN + 1) - 1  # inputs: all but the last EOS
    steps = f"{info['trained_steps']:,} AdamW steps (at most {info['steps']:,}), batch {info['batch_size']}"
    attn = f"SDPA attention{' under bf16 autocast' if info['amp'] == 'bf16' else ''}"
    if info["attn"] == "eager":
        attn = f"eager attention{' under bf16 autocast' if info['amp'] == 'bf16' else ''}"
    table = "\n".join(
        f"| {r['pairs']} | {r['prompt_tokens']} | {r['case']} | {r['examples']} | {100 * r['accuracy']:.1f}% |"
        for r in rows
    )
    attention = (
        f"{cfg.num_attention_heads} query heads, {cfg.num_key_value_heads} KV heads (GQA), head_dim {cfg.head_dim}"
        f" (heads x head_dim = {cfg.num_attention_heads * cfg.head_dim}, not hidden_size: loaders must read `head_dim`)"
    )
    files = "\n".join(f"| `{name}` | {size:,} |" for name, size in sizes.items())
    example_prompt, example_answer = make_example(random.Random(7), 3)
    return f"""# tiny-kv-recall: the embedded sglx model

A {params:,}-parameter Llama (`LlamaForCausalLM`) shipped inside sglx so that `sglx generate` works
without a download and its answers can be checked. Trained from scratch by
`scripts/train_tiny_model.py` (deterministic, seeded).

## Task: key-value recall over the whole context

The prompt lists N pairs `k<id>=<value>; ` (N <= {MAX_PAIRS}, keys unique among `k0`..`k{NUM_KEYS - 1}`,
values {VALUE_LEN} random letters), then asks for one key. The model answers with the value and EOS:

    prompt: {example_prompt}
    answer: {example_answer}

Why this task: the answer is random and appears exactly once, anywhere in the prompt (including the
very first tokens), so it can only be produced by attending back to that pair; and the answer is
{VALUE_LEN} tokens long, so decode steps (not only prefill) must read the KV cache correctly. A wrong
attention backend, paged-KV addressing bug, bad RoPE positions or broken prefix cache shows up as
wrong answers. The definition (`make_example`, `score`) is in `sglx/llm/embedded/task.py`.

## Tokenizer

Word level (`tokenizers` WordLevel, {len(VOCAB)} tokens): a key with its `=` (`k37=`) is one token, every
other character one token, so recall is the classic induction pattern (find the earlier occurrence
of the current token, copy what followed). In CPU trials, a separate `=` token or keys spelled as
digit characters were not learned at all in 1000 steps. Specials: `<pad>`=0, `<s>`=1 (BOS,
prepended by the tokenizer), `</s>`=2 (EOS),
`<unk>`=3. Decoding concatenates tokens. A pair costs {TOKENS_PER_PAIR} tokens, the query {QUERY_TOKENS}, so
N={MAX_PAIRS} pairs make a {prompt_num_tokens(MAX_PAIRS)}-token prompt. The chat template only concatenates
user messages (assistant messages get EOS), so `--chat` yields the same prompt without BOS; the
model was trained with 0, 1 or 2 leading BOS tokens and answers either way.

## Model

| field | value |
| --- | --- |
| architecture | LlamaForCausalLM (RoPE theta {rope_theta(cfg):g}, RMSNorm, SiLU-gated MLP) |
| layers | {cfg.num_hidden_layers} |
| hidden / intermediate | {cfg.hidden_size} / {cfg.intermediate_size} |
| attention | {attention} |
| vocab | {cfg.vocab_size}, untied embeddings |
| max positions | {cfg.max_position_embeddings} (longest task sequence: {longest_task} tokens) |
| parameters | {params:,} (float32) |

| file | bytes |
| --- | --- |
{files}

## Accuracy

Greedy generation with Hugging Face transformers on held-out seeds; an answer counts only if the
{VALUE_LEN} letters and then EOS are generated exactly.

| pairs | prompt tokens | case | examples | accuracy |
| --- | --- | --- | --- | --- |
{table}

## Training

{steps}, peak lr {info["lr"]:g}: linear warmup ({info["warmup"]} steps), constant while the
curriculum grows, then cosine to 10% over {info["anneal_steps"]:,} steps from step {info["anneal_start"]}
(trigger: {info["anneal_trigger"]}). Loss on the answer letters and EOS only, {attn}; input embeddings initialised
orthogonal (the vocab is smaller than the hidden size) so key tokens are distinguishable from step 0.
Curriculum: the number of pairs starts at 4 and grows by about a quarter whenever exact accuracy at
the current ceiling reaches 90% (and at least linearly, to reach {MAX_PAIRS} by step
{info["forced_ramp_steps"]:,}); half the batches sit at the ceiling, half are uniform below it. Each training
sequence asks up to {extra} more keys after the first EOS (denser gradient; generation stops at the
first EOS so it never sees them), so training inputs reach {longest_train} positions. Seed {info["seed"]};
`torch.use_deterministic_algorithms(True)` (strict), so a rerun on the same machine gives the same
weights. Trained on {info["device_name"]} in {info["train_seconds"]:.0f} s (torch {info["torch"]},
transformers {info["transformers"]}); weights hash `{info["state_hash"]}`.

Reproduce (then copy the files into `src/sglx/llm/embedded/tiny-kv-recall/`):

    {info["command"]}
"""


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="output model directory")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=12000, help="most steps (curriculum + anneal)")
    p.add_argument("--anneal-steps", type=int, default=2000, help="cosine lr decay once the longest context is solved")
    p.add_argument("--forced-ramp-steps", type=int, default=8000, help="the curriculum reaches the top by then")
    p.add_argument("--check-every", type=int, default=50, help="steps between curriculum decisions")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--intermediate-size", type=int, default=384)
    p.add_argument("--head-dim", type=int, default=64, help="4 query heads and 2 KV heads of this size")
    p.add_argument("--extra-queries", type=int, default=7, help="more questions after the first EOS (training only)")
    p.add_argument("--attn", choices=("sdpa", "eager"), default="sdpa", help="attention used for training")
    p.add_argument("--amp", choices=("bf16", "none"), default=None, help="autocast (default: bf16 on cuda)")
    p.add_argument(
        "--time-budget-seconds",
        type=float,
        default=0,
        help="start the anneal early enough to finish in this time (the log says how to reproduce)",
    )
    p.add_argument("--anneal-at-step", type=int, default=-1, help="start the anneal here (reproduces a timed run)")
    p.add_argument("--stop-at-step", type=int, default=-1, help="stop here (reproduces a run cut by time)")
    p.add_argument("--max-pairs", type=int, default=MAX_PAIRS, help="cap the curriculum (experiments only)")
    p.add_argument("--eval-examples", type=int, default=200, help="held-out examples per table row")
    p.add_argument("--log-every", type=int, default=500)
    p.add_argument("--warn-only", action="store_true", help="fallback: warn on non-deterministic ops, do not fail")
    p.add_argument("--no-eval", action="store_true", help="skip the accuracy table (hash check runs)")
    return p.parse_args(argv)


def reproduce_command(argv: list[str], args: argparse.Namespace) -> str:
    """The command line that repeats this run step for step, with time-based decisions pinned."""
    kept, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item in ("--time-budget-seconds", "--out"):
            skip = True
        elif not item.startswith(("--time-budget-seconds=", "--out=")):
            kept.append(item)
    if args.anneal_trigger == "time budget":
        kept += ["--anneal-at-step", str(args.anneal_start)]
    if args.stopped_at is not None and "--stop-at-step" not in kept:
        kept += ["--stop-at-step", str(args.stopped_at)]
    return " ".join(["python scripts/train_tiny_model.py", *kept, "--out DIR"])


def main(argv: list[str] | None = None) -> int:
    import transformers

    args = parse_args(argv)
    device = torch.device(args.device)
    if args.amp is None:
        args.amp = "bf16" if device.type == "cuda" else "none"
    # Strict: an op without a deterministic implementation raises instead of silently varying;
    # SDPA's flash / memory-efficient backward switch to their deterministic variants in this mode.
    torch.use_deterministic_algorithms(True, warn_only=args.warn_only)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    random.seed(args.seed)
    tok = build_tokenizer()
    check_batch_layout(tok)
    args.out.mkdir(parents=True, exist_ok=True)
    log_file = (args.out / "train_log.txt").open("w")

    def log(msg: str) -> None:
        print(msg, flush=True)
        log_file.write(msg + "\n")

    log(f"device {device} torch {torch.__version__} transformers {transformers.__version__}")
    start = time.perf_counter()
    model = train(args, device, log)
    train_seconds = time.perf_counter() - start
    digest = state_hash(model)
    log(f"weights hash {digest}")
    model.to("cpu")
    save(model, tok, args.out)
    rows = [] if args.no_eval else evaluation_table(reload(args.out, device), tok, device, args.eval_examples)
    info = {
        **{
            k: getattr(args, k)
            for k in (
                "steps",
                "trained_steps",
                "anneal_start",
                "anneal_trigger",
                "anneal_steps",
                "forced_ramp_steps",
                "attn",
                "amp",
                "warn_only",
                "batch_size",
                "lr",
                "warmup",
                "seed",
                "extra_queries",
                "hidden_size",
                "intermediate_size",
                "head_dim",
                "layers",
            )
        },
        "command": reproduce_command(argv if argv is not None else sys.argv[1:], args),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
        "train_seconds": train_seconds,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "state_hash": digest,
        "shape": asdict(model_shape(args)),
    }
    (args.out / "README.md").write_text(render_readme(model, args.out, rows, info))
    (args.out / "train_info.json").write_text(json.dumps({"info": info, "accuracy": rows}, indent=2) + "\n")
    log("| pairs | prompt tokens | case | accuracy |")
    for r in rows:
        log(f"| {r['pairs']} | {r['prompt_tokens']} | {r['case']} | {100 * r['accuracy']:.1f}% |")
    if rows:
        log(f"final accuracy at {MAX_PAIRS} pairs: {100 * rows[len(EVAL_PAIRS) - 1]['accuracy']:.1f}%")
    log_file.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
