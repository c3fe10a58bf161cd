"""`--attention-backend-config`: turn the user's text into a typed, validated config for one backend.

The value may be (checked in this order):

1. a path to a ``.json``, ``.yaml`` or ``.yml`` file holding a mapping;
2. a JSON object string, e.g. ``'{"sparsity": 0.5}'`` (anything whose first non-blank char is ``{``);
3. ``k=v`` pairs separated by commas, e.g. ``sparsity=0.5,enable_x=true``.

In the ``k=v`` form values are coerced: ``true``/``false`` (any case) -> bool, ``12``/``-3`` -> int,
``1.5``/``1e3``/``2.`` -> float, ``[4,8,8]`` -> list (elements coerced the same way; commas inside
brackets do not split pairs), ``"..."`` -> the JSON-decoded string (use it for strings that contain
commas or would otherwise be coerced, e.g. ``name="true"``), anything else -> the stripped string.
``none``/``null``/``nan``/``inf`` stay strings.

Validation is against the backend's declared `ConfigParam`s. Every problem raises `ConfigError` (never
anything else) whose ``key`` names the offending key, or is None when the text itself is malformed.
In the result, optional keys the user did not give are filled with their default; keys whose default
is None and that were not given are *absent* from ``values`` (use `BackendConfig.get`). An explicit
JSON/YAML ``null`` counts as "not given".
"""

from __future__ import annotations

import difflib
import json
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

from sglx.attention.registry import BackendSpec, ConfigParam
from sglx.errors import ConfigError

OPTION = "--attention-backend-config"
FILE_SUFFIXES = (".json", ".yaml", ".yml")
PARAM_TYPES = ("str", "int", "float", "bool", "list[int]")

_INT = re.compile(r"[+-]?\d+")
_FLOAT = re.compile(r"[+-]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?")


def _fail(message: str, key: str | None = None) -> ConfigError:
    return ConfigError(f"{OPTION}: {message}", key=key)


@dataclass(frozen=True)
class BackendConfig:
    """A validated config: values have their declared Python types (lists become tuples of int)."""

    backend: str
    values: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # A read-only view over a private copy, so neither the caller nor a backend can mutate it later.
        object.__setattr__(self, "values", MappingProxyType(dict(self.values)))

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    def __contains__(self, name: object) -> bool:
        return name in self.values

    def get(self, name: str, default: Any = None) -> Any:
        return self.values.get(name, default)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.values)


# ---------------------------------------------------------------------------------------------- raw parsing


def parse_config_text(text: str) -> dict[str, Any]:
    """Parse any of the three textual forms into a plain dict, without looking at any backend."""
    stripped = text.strip()
    if not stripped:
        return {}
    path = _as_config_path(stripped)
    if path is not None:
        return _load_file(path)
    if stripped.startswith("{"):
        return _load_json_object(stripped, where="JSON string")
    return _parse_pairs(stripped)


def _as_config_path(text: str) -> Path | None:
    """The text as a config file path, or None when it should be read as JSON or k=v pairs."""
    path = Path(text)
    suffix = path.suffix.lower()
    try:
        path = path.expanduser()
        exists = path.is_file()
    except (OSError, ValueError, RuntimeError):  # name too long, NUL byte, unknown home directory, ...
        exists = False
    if exists:
        if suffix not in FILE_SUFFIXES:
            raise _fail(f"config file {text!r} has unsupported suffix {path.suffix!r}; use .json, .yaml or .yml")
        return path
    if suffix in FILE_SUFFIXES and "=" not in text and not text.startswith("{"):
        raise _fail(f"config file {text!r} does not exist (pass a .json/.yaml/.yml path, a JSON object or k=v pairs)")
    return None


def _load_file(path: Path) -> dict[str, Any]:
    try:
        content = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise _fail(f"cannot read config file {str(path)!r}: {exc}") from None
    if path.suffix.lower() == ".json":
        return _load_json_object(content, where=f"config file {str(path)!r}")
    try:
        data = yaml.safe_load(content)
    except (yaml.YAMLError, ValueError) as exc:  # ValueError: e.g. an integer with too many digits
        raise _fail(f"config file {str(path)!r} is not valid YAML: {exc}") from None
    except RecursionError:
        raise _fail(f"config file {str(path)!r} is nested too deeply") from None
    if data is None:  # an empty file means "no settings"
        return {}
    return _as_mapping(data, where=f"config file {str(path)!r}")


def _load_json_object(text: str, where: str) -> dict[str, Any]:
    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise _fail(f"key {key!r} is given twice in the {where}", key=key)
            out[key] = value
        return out

    try:
        data = json.loads(text, object_pairs_hook=no_duplicates)
    except ValueError as exc:  # JSONDecodeError, or an integer with too many digits
        raise _fail(f"the {where} is not valid JSON: {exc}") from None
    except RecursionError:
        raise _fail(f"the {where} is nested too deeply") from None
    return _as_mapping(data, where=f"the {where}")


def _as_mapping(data: Any, where: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise _fail(f"{where} must hold a mapping of keys to values, not {type(data).__name__}")
    for key in data:
        if not isinstance(key, str):
            raise _fail(f"{where} has a non-string key {key!r}; keys are parameter names", key=str(key))
    return dict(data)


def _split_top_level(text: str, what: str) -> list[str]:
    """Split on commas that are outside brackets and double quotes."""
    parts: list[str] = []
    depth = 0
    start = 0
    in_quote = False
    i = 0
    while i < len(text):
        ch = text[i]
        if in_quote:
            if ch == "\\":
                i += 1
            elif ch == '"':
                in_quote = False
        elif ch == '"':
            in_quote = True
        elif ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise _fail(f"unmatched ']' in {what} {text!r}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
        i += 1
    if in_quote:
        raise _fail(f"unterminated '\"' in {what} {text!r}")
    if depth:
        raise _fail(f"unmatched '[' in {what} {text!r}")
    parts.append(text[start:])
    return parts


def _parse_pairs(text: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for part in _split_top_level(text, "k=v pairs"):
        if not part.strip():
            continue  # tolerate "a=1," and "a=1,,b=2"
        key, eq, raw = part.partition("=")
        key = key.strip()
        if not eq:
            raise _fail(
                f"{part.strip()!r} is not a key=value pair; pass k=v pairs (a=1,b=true), "
                "a JSON object or a .json/.yaml/.yml file path"
            )
        if not key:
            raise _fail(f"{part.strip()!r} has an empty key; write name=value")
        if key in out:
            raise _fail(f"key {key!r} is given twice", key=key)
        out[key] = _coerce(raw, key)
    return out


def _coerce(raw: str, key: str | None) -> Any:
    """Turn one k=v value (or list element) into bool, int, float, list or str."""
    value = raw.strip()
    if value.startswith('"'):
        try:
            decoded = json.loads(value)
        except json.JSONDecodeError:
            decoded = None
        if not isinstance(decoded, str):
            raise _fail(f"value {value!r} for {key!r} is not a valid quoted string", key=key)
        return decoded
    if value.startswith("["):
        if not value.endswith("]"):
            raise _fail(f"value {value!r} for {key!r} has text after its closing ']'", key=key)
        inner = value[1:-1]
        if not inner.strip():
            return []
        return [_coerce(item, key) for item in _split_top_level(inner, f"the list for {key!r}")]
    lowered = value.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if _INT.fullmatch(value):
        try:
            return int(value)
        except ValueError:  # more digits than Python will parse
            raise _fail(f"integer for {key!r} is too large ({len(value)} digits)", key=key) from None
    if _FLOAT.fullmatch(value):
        return float(value)
    return value


# ----------------------------------------------------------------------------------------------- validation


def validate_config(spec: BackendSpec, raw: Mapping[str, Any]) -> BackendConfig:
    """Check `raw` against `spec.config`, convert values to their declared types and fill in defaults."""
    for key in raw:
        if not isinstance(key, str):
            raise _fail(f"key {key!r} is not a string; keys are parameter names", key=str(key))
    given = {key: value for key, value in raw.items() if value is not None}
    params = {p.name: p for p in spec.config}
    if not params and given:
        keys = ", ".join(map(repr, given))
        raise _fail(f"{spec.name} takes no config, but got {keys}; drop {OPTION}", key=next(iter(given)))
    for key in given:
        if key not in params:
            raise _fail(_unknown_key_message(spec, key), key=key)
    values: dict[str, Any] = {}
    for param in spec.config:
        if param.name in given:
            values[param.name] = _convert(spec, param, given[param.name])
        elif param.required:
            raise _fail(
                f"{spec.name} needs {param.name!r} ({param.type}: {param.description}); "
                f"add {param.name}=<{param.type}>",
                key=param.name,
            )
        elif param.default is not None:
            values[param.name] = _convert(spec, param, param.default)
    return BackendConfig(backend=spec.name, values=values)


_PREFIX = re.compile(r"^\s*([A-Za-z0-9_]+):(?!//)(.*)$", re.S)


def split_backend_prefix(text: str, known: set[str]) -> tuple[str | None, str]:
    """`name:config` -> (name, config) when `name` is a backend in `known` (one config for one backend of a
    hybrid pair, as the diffusion comparison's per-backend configs); anything else -> (None, text)."""
    m = _PREFIX.match(text)
    if m is None or m.group(1) not in known or _as_config_path(text.strip()) is not None:
        return None, text
    return m.group(1), m.group(2)


def load_backend_config(spec: BackendSpec, text: str | None) -> BackendConfig:
    """Parse and validate the `--attention-backend-config` value for `spec` (None means not given)."""
    return validate_config(spec, parse_config_text(text or ""))


def _unknown_key_message(spec: BackendSpec, key: str) -> str:
    names = [p.name for p in spec.config]
    close = difflib.get_close_matches(key, names, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown key {key!r} for {spec.name}{hint}; valid keys: {', '.join(names)}"


def _describe(value: Any) -> str:
    """`type value` for messages, shortened so a huge value cannot drown the error."""
    try:
        shown = repr(value)
    except ValueError:  # an int with more digits than Python will print
        shown = "<too many digits>"
    return f"{type(value).__name__} {shown if len(shown) <= 80 else shown[:77] + '...'}"


def _convert(spec: BackendSpec, param: ConfigParam, value: Any) -> Any:
    """Return `value` as `param.type`, or raise a ConfigError naming the key, the type and the value."""

    def wrong(extra: str = "") -> ConfigError:
        return _fail(
            f"{param.name!r} for {spec.name} must be {param.type}, got {_describe(value)}{extra}", key=param.name
        )

    kind = param.type
    if kind == "str":
        if isinstance(value, str) and param.choices and value not in param.choices:
            raise _fail(f"{param.name!r} for {spec.name} must be one of {', '.join(param.choices)}, "
                        f"got {_describe(value)}", key=param.name)
        if isinstance(value, str):
            return value
        if isinstance(value, (bool, float)) or isinstance(value, int) and abs(value) < 10**80:
            as_text = str(value).lower() if isinstance(value, bool) else str(value)
            raise wrong(f"; quote it to pass text, e.g. {param.name}={json.dumps(as_text)}")
        raise wrong()
    if kind == "bool":
        if isinstance(value, bool):
            return value
        raise wrong("; use true or false")
    if kind == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise wrong()
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise wrong()
        try:
            number = float(value)
        except OverflowError:
            raise wrong(" (too large for a float)") from None
        if not math.isfinite(number):
            raise wrong(" (must be finite)")
        return number
    if kind == "list[int]":
        if not isinstance(value, (list, tuple)):
            raise wrong(f"; write it as a list, e.g. {param.name}=[4,8,8]")
        for i, item in enumerate(value):
            if isinstance(item, bool) or not isinstance(item, int):
                raise wrong(f" (element {i} is {_describe(item)})")
        return tuple(value)
    # A wrong declaration is a bug in sglx, not in the user's input, so it is not a ConfigError.
    raise ValueError(f"backend {spec.name} declares {param.name!r} with type {kind!r}; types are {PARAM_TYPES}")


# ---------------------------------------------------------------------------------------------- formatting


def format_config(values: Mapping[str, Any] | BackendConfig) -> str:
    """The `k=v` form of `values`, which `parse_config_text` reads back to equal values (None is skipped)."""
    if isinstance(values, BackendConfig):
        values = values.values
    return ",".join(_format_pairs(values))


def _format_pairs(values: Mapping[str, Any]) -> Iterator[str]:
    for key, value in values.items():
        if value is None:
            continue
        bad_key = not isinstance(key, str) or not key or key != key.strip() or key.startswith("{")
        if bad_key or any(c in key for c in '=,[]"'):
            raise _fail(f"key {key!r} cannot be written as k=v", key=str(key))
        yield f"{key}={_format_value(key, value)}"


def _format_value(key: str, value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        try:
            return str(value)
        except ValueError:  # more digits than Python will print
            raise _fail(f"integer for {key!r} is too large to write out", key=key) from None
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _fail(f"value {value!r} for {key!r} cannot be written as k=v (not finite)", key=key)
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_format_value(key, item) for item in value) + "]"
    if isinstance(value, str):
        return value if _reads_back_plain(value) else json.dumps(value, ensure_ascii=False)
    raise _fail(f"value {_describe(value)} for {key!r} cannot be written as k=v", key=key)


def _reads_back_plain(text: str) -> bool:
    """Whether `text` written unquoted as a value (also as a list element) parses back to the same string."""
    if not text or text != text.strip() or any(c in text for c in ',[]"'):  # "[]" is an empty list, not [""]
        return False
    return _coerce(text, None) == text


__all__ = [
    "OPTION",
    "PARAM_TYPES",
    "BackendConfig",
    "format_config",
    "load_backend_config",
    "parse_config_text",
    "validate_config",
]
