"""The synthetic key-value recall task the embedded model was trained on.

A prompt lists ``num_pairs`` pairs ``k<id>=<value>; `` with unique keys and random five-letter
values, then asks ``? k<id>=`` for one of them (e.g. ``k37=qxztb; k5=abcde; ? k37=`` -> ``qxztb``).
The answer (the value, then EOS) can only be found by attending back to wherever that pair sits,
possibly the very first tokens of the prompt, so a broken attention backend, KV cache or position
encoding shows up as wrong answers.

The training script builds the same token sequences directly as ids; ``format_prompt`` is the
single definition of the text layout both sides agree on.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

NUM_KEYS = 64
"""Keys are ``k0`` .. ``k63``; a key with its ``=`` (``k37=``) is one token."""

VALUE_ALPHABET = "abcdefghijklmnopqrstuvwxyz"
VALUE_LEN = 5
"""Each value is five letters, one token per letter, so answering takes several decode steps."""

MAX_PAIRS = 62
"""Longest trained prompt: 8 tokens per pair + 3 for the query (+ BOS) = 500 tokens; 506 with the answer."""

TOKENS_PER_PAIR = 8
QUERY_TOKENS = 3


def format_key(key: int) -> str:
    return f"k{key}"


def format_pair(key: int, value: str) -> str:
    return f"{format_key(key)}={value}; "


def format_prompt(pairs: Sequence[tuple[int, str]], query_key: int) -> str:
    """The prompt text: every pair, then the question; the model continues with the value."""
    return "".join(format_pair(k, v) for k, v in pairs) + f"? {format_key(query_key)}="


def prompt_num_tokens(num_pairs: int, bos: bool = True) -> int:
    """Token count of a prompt with ``num_pairs`` pairs (every example of that size has the same length)."""
    return TOKENS_PER_PAIR * num_pairs + QUERY_TOKENS + int(bos)


def make_example(
    rng: random.Random,
    num_pairs: int,
    query_index: int | None = None,
) -> tuple[str, str]:
    """One (prompt, answer) example.

    ``query_index`` picks which pair is asked for (0 = the very first pair, farthest back);
    by default it is uniform over the pairs.
    """
    if not 1 <= num_pairs <= NUM_KEYS:
        raise ValueError(f"num_pairs must be in [1, {NUM_KEYS}], got {num_pairs}")
    keys = rng.sample(range(NUM_KEYS), num_pairs)
    values = ["".join(rng.choice(VALUE_ALPHABET) for _ in range(VALUE_LEN)) for _ in range(num_pairs)]
    if query_index is None:
        query_index = rng.randrange(num_pairs)
    if not 0 <= query_index < num_pairs:
        raise ValueError(f"query_index must be in [0, {num_pairs}), got {query_index}")
    prompt = format_prompt(list(zip(keys, values)), keys[query_index])
    return prompt, values[query_index]


def normalize_output(text: str) -> str:
    """Generated text as compared with the answer: EOS text (if not skipped) and whitespace removed."""
    return text.replace("</s>", "").strip()


def score(outputs: Sequence[str], answers: Sequence[str]) -> float:
    """Exact-match accuracy of generated continuations against the answers."""
    if len(outputs) != len(answers):
        raise ValueError(f"{len(outputs)} outputs for {len(answers)} answers")
    if not answers:
        raise ValueError("nothing to score")
    correct = sum(normalize_output(o) == a for o, a in zip(outputs, answers))
    return correct / len(answers)
