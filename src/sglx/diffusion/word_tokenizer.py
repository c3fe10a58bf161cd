"""A word-level T5-style tokenizer built locally, for the embedded tiny-shapes model and for tests.

Real Wan checkpoints ship UMT5's sentencepiece tokenizer; a tiny model needs only a few words, so it
ships a `tokenizers` WordLevel model wrapped as a transformers fast tokenizer (pad 0, eos 1, unk 2,
as T5 numbers them) that `AutoTokenizer.from_pretrained` loads like any other.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

SPECIAL = ("<pad>", "</s>", "<unk>")


def build_word_tokenizer(words: Iterable[str]):  # type: ignore[no-untyped-def]
    """A PreTrainedTokenizerFast over lowercase words and punctuation; appends </s> like T5."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    for word in words:
        vocab.setdefault(word.lower(), len(vocab))
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace()])
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def save_word_tokenizer(words: Iterable[str], folder: str | Path) -> int:
    """Build and `save_pretrained` the tokenizer into `folder`; returns the vocabulary size."""
    tokenizer = build_word_tokenizer(words)
    tokenizer.save_pretrained(str(folder))
    return len(tokenizer)
