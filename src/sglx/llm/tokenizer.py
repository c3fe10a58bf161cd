"""Tokenizer from a Hugging Face model directory, without importing transformers.

`tokenizer.json` drives encoding/decoding through the `tokenizers` library; `tokenizer_config.json`
(or `chat_template.jinja`) supplies special tokens and the chat template, rendered with the same
sandboxed Jinja environment Hugging Face uses, so prompts match `apply_chat_template` exactly.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from sglx.errors import SglxError

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def _token_content(value: Any) -> str | None:
    """Special tokens are stored as a string or as an AddedToken dict {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise SglxError(f"could not read {path}: {exc}") from exc


def _find_chat_template(model_dir: Path, config: dict[str, Any]) -> str | None:
    """The default chat template: chat_template.jinja (newer HF layout) wins over tokenizer_config.json."""
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template") or _read_json(model_dir / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


@lru_cache(maxsize=16)
def compile_chat_template(template: str) -> Any:
    """Compile like transformers: sandboxed, trim_blocks/lstrip_blocks, loopcontrols, raise_exception, tojson."""
    try:
        import jinja2
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as exc:  # pragma: no cover - jinja2 is a dependency
        raise SglxError("chat templates need jinja2: pip install jinja2") from exc

    class GenerationTag(Extension):
        """Accepts HF's `{% generation %}...{% endgeneration %}` (assistant-mask marker) and renders its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateError as exc:
        raise SglxError(f"the chat template does not parse: {exc}") from exc


class Tokenizer:
    """Encode/decode with a `tokenizers` backend plus the model's special tokens and chat template."""

    def __init__(self, backend: Any, special_tokens: dict[str, str | None], chat_template: str | None = None,
                 eos_token_ids: tuple[int, ...] = (), clean_up_tokenization_spaces: bool = False,
                 source: str = "") -> None:
        self.backend = backend
        self.special_tokens = special_tokens
        self.chat_template = chat_template
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces
        self.source = source
        bos = special_tokens.get("bos_token")
        self.bos_token_id: int | None = backend.token_to_id(bos) if bos else None
        eos = special_tokens.get("eos_token")
        eos_id = backend.token_to_id(eos) if eos else None
        ids = ((eos_id,) if eos_id is not None else ()) + tuple(eos_token_ids)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(ids))

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json + tokenizer_config.json (+ generation_config.json's extra EOS ids)."""
        from tokenizers import Tokenizer as BackendTokenizer

        model_dir = Path(path).expanduser()
        tok_file = model_dir / "tokenizer.json"
        if not tok_file.is_file():
            raise SglxError(f"{model_dir} has no tokenizer.json; sglx needs a Hugging Face fast tokenizer "
                            "(save it with tokenizer.save_pretrained). Without one, pass token ids directly.")
        backend = BackendTokenizer.from_file(str(tok_file))
        config = _read_json(model_dir / "tokenizer_config.json")
        special = {key: _token_content(config.get(key)) for key in _SPECIAL_TOKEN_KEYS}
        special_map = _read_json(model_dir / "special_tokens_map.json")
        for key in _SPECIAL_TOKEN_KEYS:
            if special[key] is None:
                special[key] = _token_content(special_map.get(key))
        generation = _read_json(model_dir / "generation_config.json")
        extra_eos = generation.get("eos_token_id")
        extra_eos = (extra_eos,) if isinstance(extra_eos, int) else tuple(extra_eos or ())
        return cls(backend, special, _find_chat_template(model_dir, config), extra_eos,
                   bool(config.get("clean_up_tokenization_spaces", False)), str(model_dir))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return clean_up_tokenization(text) if self.clean_up_tokenization_spaces else text

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """The prompt text for a conversation, rendered like transformers' apply_chat_template(tokenize=False)."""
        if not self.chat_template:
            raise SglxError(f"{self.source or 'this tokenizer'} has no chat template (no 'chat_template' in "
                            "tokenizer_config.json and no chat_template.jinja); send a plain prompt instead.")
        import jinja2

        variables = {k: v for k, v in self.special_tokens.items() if v is not None}
        variables.update(kwargs)
        variables.setdefault("tools", None)
        variables.setdefault("documents", None)
        try:
            return compile_chat_template(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as exc:
            raise SglxError(f"the chat template rejected these messages: {exc}") from exc


def clean_up_tokenization(text: str) -> str:
    """Hugging Face's legacy space clean-up (" ." -> "."), applied when tokenizer_config asks for it."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text


class IncrementalDecoder:
    """Streaming detokenizer: push token ids, get back only text that can no longer change.

    Decodes a short window (previous chunk + new tokens) instead of the whole output each time, and
    holds text back while it ends in an incomplete UTF-8 sequence (U+FFFD), so multi-token characters
    arrive whole. Concatenating every push() and a final flush() equals decode(all ids).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the window that was already emitted (gives context to the decoder)
        self.read_offset = 0  # end of the text already emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one token; return the newly finalized text (possibly empty)."""
        self.ids.append(int(token_id))
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return new_text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (e.g. an incomplete character at the end of generation)."""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return new_text[len(prefix_text):]
