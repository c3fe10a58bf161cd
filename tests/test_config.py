"""`--attention-backend-config`: valid configs round-trip through every textual form; bad ones raise only ConfigError.

Expected values are computed here from the generated input and the declared parameters, not by the parser, and
compared type-strictly (so 1, 1.0 and True are different).
"""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglx.attention.config import (
    BackendConfig,
    format_config,
    load_backend_config,
    parse_config_text,
    validate_config,
)
from sglx.attention.registry import BackendSpec, ConfigParam, DiffusionFeatures, find
from sglx.errors import ConfigError

SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _spec(name: str) -> BackendSpec:
    spec = find(name, "diffusion", "dit")
    assert spec is not None and spec.config, name
    return spec


# Every declared type, a required key and a list default, which the real backends do not all have.
ALL_TYPES = BackendSpec(
    name="all_types", family="diffusion", kind="dit", title="test", summary="test", features=DiffusionFeatures(),
    config=(
        ConfigParam("path", "str", "a required string", required=True),
        ConfigParam("mode", "str", "a string with a default", default="fast"),
        ConfigParam("steps", "int", "an int", default=3),
        ConfigParam("ratio", "float", "a float", default=0.5),
        ConfigParam("enabled", "bool", "a bool", default=False),
        ConfigParam("tiles", "list[int]", "a list with a default", default=(2, 2)),
        ConfigParam("window", "list[int]", "a list without a default"),
        ConfigParam("topk", "int", "an int without a default"),
    ),
)
SPECS = [_spec("sliding_tile_attn"), _spec("video_sparse_attn"), _spec("vmoba_attn"), ALL_TYPES]
SPEC_IDS = [s.name for s in SPECS]

TRICKY_TEXT = ["true", "FALSE", "1", "-2", "1.5", "1e3", "[1]", "a,b", ' "q" ', "", " pad ", "x.json", "{", "null",
               "a=b", "back\\slash", 'quote"inside', "多语言", "tab\there", "nan"]
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=16) | st.sampled_from(TRICKY_TEXT)
FINITE = st.floats(allow_nan=False, allow_infinity=False)
VALUES: dict[str, st.SearchStrategy[Any]] = {
    "str": TEXT,
    "int": st.integers(-(2**70), 2**70),
    "float": FINITE | st.integers(-1000, 1000),
    "bool": st.booleans(),
    "list[int]": st.lists(st.integers(-(10**9), 10**9), max_size=5),
}
NON_INT_ITEM = FINITE | st.booleans() | TEXT | st.lists(st.integers(), max_size=2)
WRONG: dict[str, st.SearchStrategy[Any]] = {
    "str": st.integers() | FINITE | st.booleans() | st.lists(st.integers(), max_size=3) | st.just({"a": 1}),
    "int": FINITE | st.booleans() | TEXT | st.lists(st.integers(), max_size=3) | st.just({"a": 1}),
    "float": st.booleans() | TEXT | st.lists(FINITE, max_size=3) | st.sampled_from([math.nan, math.inf, -math.inf]),
    "bool": st.integers() | FINITE | TEXT | st.lists(st.booleans(), max_size=3),
    "list[int]": st.integers() | FINITE | st.booleans() | TEXT | st.just({"a": 1})
    | st.tuples(st.lists(st.integers(), max_size=3), NON_INT_ITEM).map(lambda t: [*t[0], t[1]]),
}
KEY = st.from_regex(r"[a-z_][a-z0-9_]{0,12}", fullmatch=True)


def valid_raw(spec: BackendSpec) -> st.SearchStrategy[dict[str, Any]]:
    required = {p.name: VALUES[p.type] for p in spec.config if p.required}
    optional = {p.name: VALUES[p.type] for p in spec.config if not p.required}
    return st.fixed_dictionaries(required, optional=optional)


def expected_values(spec: BackendSpec, raw: Mapping[str, Any]) -> dict[str, Any]:
    """What validation must produce, derived from the declarations alone."""
    out: dict[str, Any] = {}
    for p in spec.config:
        value = raw.get(p.name, p.default)
        if value is None:
            continue
        out[p.name] = float(value) if p.type == "float" else tuple(value) if p.type == "list[int]" else value
    return out


def typed(value: Any) -> Any:
    """A type-strict view for comparison: 1, 1.0, True and "1" all differ; list and tuple do too."""
    if isinstance(value, Mapping):
        return {k: typed(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [typed(v) for v in value])
    return (type(value).__name__, value)


def textual_forms(raw: dict[str, Any], folder: Path) -> dict[str, str]:
    json_file, yaml_file, yml_file = folder / "cfg.json", folder / "cfg.yaml", folder / "cfg.YML"
    json_file.write_text(json.dumps(raw), encoding="utf-8")
    # PyYAML's emitter writes NEL/LS/PS raw when allow_unicode=True and its reader then folds them to a space:
    # a PyYAML writer bug, not ours, so such strings use the escaped (.yml) form only.
    readable = not any(c in json.dumps(raw, ensure_ascii=False) for c in "\x85\u2028\u2029")
    yaml_file.write_text(yaml.safe_dump(raw, allow_unicode=readable), encoding="utf-8")
    yml_file.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return {
        "json string": json.dumps(raw),
        "k=v": format_config(raw),
        "json file": str(json_file),
        "yaml file": str(yaml_file),
        "yml file": str(yml_file),
    }


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_valid_configs_round_trip_through_every_form(spec: BackendSpec) -> None:
    @SETTINGS
    @given(raw=valid_raw(spec))
    def check(raw: dict[str, Any]) -> None:
        want = typed(expected_values(spec, raw))
        assert typed(validate_config(spec, raw).values) == want
        with tempfile.TemporaryDirectory() as folder:
            for form, text in textual_forms(raw, Path(folder)).items():
                config = load_backend_config(spec, text)
                assert config.backend == spec.name
                assert typed(config.values) == want, (form, text)
        # The validated result written back as k=v reads back to itself.
        again = load_backend_config(spec, format_config(config))
        assert typed(again.values) == want

    check()


SCALAR = st.booleans() | st.integers(-(10**30), 10**30) | FINITE | TEXT
ANY_VALUE = st.recursive(SCALAR, lambda inner: st.lists(inner, max_size=4), max_leaves=8)


@SETTINGS
@given(values=st.dictionaries(KEY, ANY_VALUE, max_size=5))
def test_format_config_parses_back_to_the_same_values(values: dict[str, Any]) -> None:
    assert typed(parse_config_text(format_config(values))) == typed(values)


# ------------------------------------------------------------------------------------------- invalid configs


def _raises_for_key(spec: BackendSpec, key: str, *texts_or_raws: str | dict[str, Any]) -> list[ConfigError]:
    errors = []
    for item in texts_or_raws:
        with pytest.raises(ConfigError) as info:
            if isinstance(item, str):
                load_backend_config(spec, item)
            else:
                validate_config(spec, item)
        assert info.value.key == key, (item, str(info.value))
        assert repr(key) in str(info.value), (item, str(info.value))
        assert str(info.value).startswith("--attention-backend-config: ")
        errors.append(info.value)
    return errors


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_unknown_keys_are_named_with_the_valid_ones(spec: BackendSpec) -> None:
    names = [p.name for p in spec.config]

    @SETTINGS
    @given(raw=valid_raw(spec), key=KEY.filter(lambda k: k not in names), value=ANY_VALUE)
    def check(raw: dict[str, Any], key: str, value: Any) -> None:
        raw = {**raw, key: value}
        for error in _raises_for_key(spec, key, raw, json.dumps(raw), format_config(raw)):
            assert "unknown key" in str(error)
            assert all(name in str(error) for name in names)

    check()


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_wrong_types_are_named_with_the_expected_type(spec: BackendSpec) -> None:
    @SETTINGS
    @given(raw=valid_raw(spec), data=st.data())
    def check(raw: dict[str, Any], data: st.DataObject) -> None:
        param = data.draw(st.sampled_from(spec.config))
        raw = {**raw, param.name: data.draw(WRONG[param.type])}
        for error in _raises_for_key(spec, param.name, raw, json.dumps(raw)):
            assert f"must be {param.type}" in str(error)

    check()


@pytest.mark.parametrize("spec", [_spec("sliding_tile_attn"), ALL_TYPES], ids=["sliding_tile_attn", "all_types"])
def test_missing_required_key_is_named(spec: BackendSpec) -> None:
    required = [p.name for p in spec.config if p.required]

    @SETTINGS
    @given(raw=valid_raw(spec), data=st.data())
    def check(raw: dict[str, Any], data: st.DataObject) -> None:
        missing = data.draw(st.sampled_from(required))
        raw = {k: v for k, v in raw.items() if k != missing}
        _raises_for_key(spec, missing, raw, json.dumps(raw), format_config(raw), {**raw, missing: None})

    check()
    _raises_for_key(spec, required[0], "")
    with pytest.raises(ConfigError):
        load_backend_config(spec, None)


@pytest.mark.parametrize("name", ["torch_sdpa", "fa"])
def test_backend_without_parameters_rejects_any_config(name: str) -> None:
    spec = find(name, "diffusion", "dit")
    assert spec is not None and not spec.config
    assert load_backend_config(spec, None).values == {}
    assert load_backend_config(spec, "  ").values == {}
    (error,) = _raises_for_key(spec, "sparsity", "sparsity=0.5")
    assert f"{spec.name} takes no config" in str(error)


GARBAGE = st.text(max_size=40) | st.text(st.sampled_from('{}[]",=:ab1.eE-+tTrueFalsn \\\n'), max_size=30)


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_garbage_text_raises_only_config_error(spec: BackendSpec, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # relative names that look like files resolve in an empty folder

    @SETTINGS
    @given(text=GARBAGE)
    def check(text: str) -> None:
        try:
            config = load_backend_config(spec, text)
        except ConfigError as error:
            if error.key is not None:
                assert repr(error.key) in str(error)
        else:
            assert isinstance(config, BackendConfig)

    check()


# ------------------------------------------------------------------------------------------ explicit examples


def test_kv_coercion_examples() -> None:
    parsed = parse_config_text(
        'a=true, b=FALSE ,c=1,d=1.5,e=[4,8,8],f=STA inference mode,g="x,y",h=[],i=1e3,j=-7,k=none,l=[a, "b]"],m='
    )
    assert typed(parsed) == typed({
        "a": True, "b": False, "c": 1, "d": 1.5, "e": [4, 8, 8], "f": "STA inference mode", "g": "x,y", "h": [],
        "i": 1000.0, "j": -7, "k": "none", "l": ["a", "b]"], "m": "",
    })
    assert parse_config_text("") == {} and parse_config_text("  \n") == {}
    assert parse_config_text('{"sparsity": 0.5}') == {"sparsity": 0.5}


def test_validation_examples() -> None:
    vsa, vmoba = _spec("video_sparse_attn"), _spec("vmoba_attn")
    assert typed(load_backend_config(vsa, "sparsity=1").values) == typed({"sparsity": 1.0})  # int is fine for float
    assert typed(load_backend_config(vsa, None).values) == typed({"sparsity": 0.0})
    config = load_backend_config(vmoba, "st_chunk_size=[4,8,8],temporal_topk=3")
    assert config["st_chunk_size"] == (4, 8, 8) and config.get("temporal_topk") == 3
    assert "spatial_topk" not in config and config.get("spatial_topk") is None  # default None: absent
    assert config["moba_threshold"] == 0.25 and config["first_full_step"] == 12
    with pytest.raises(TypeError):
        config.values["st_topk"] = 1  # type: ignore[index]


def test_messages_are_actionable() -> None:
    vsa, sta, vmoba = _spec("video_sparse_attn"), _spec("sliding_tile_attn"), _spec("vmoba_attn")
    (error,) = _raises_for_key(vsa, "sparsityy", "sparsityy=0.5")
    assert str(error) == (
        "--attention-backend-config: unknown key 'sparsityy' for video_sparse_attn (did you mean 'sparsity'?); "
        "valid keys: sparsity"
    )
    (error,) = _raises_for_key(vmoba, "temporal_topk", "temporal_topk=true")  # bool is not an int
    assert "must be int, got bool True" in str(error)
    (error,) = _raises_for_key(sta, "mask_strategy_file_path", "mask_strategy_file_path=2024")
    assert 'mask_strategy_file_path="2024"' in str(error)  # tells how to pass it as text
    (error,) = _raises_for_key(vmoba, "st_chunk_size", "st_chunk_size=[4,8.5,8]")
    assert "element 1 is float 8.5" in str(error)


@pytest.mark.parametrize(("text", "key"), [
    ("sparsity", None), ("=1", None), ("a=[1,2", None), ("a=1]", None), ('a="open', None), ('{"a":', None),
    ("[1, 2]", None), ('"just a string"', None), ('{"a": 1} trailing', None), ("[1]", None), ("{}", "-"),
    ("missing.json", None), ("missing.yml", None), ('{"a": ' + "9" * 5000 + "}", None),
    # Malformed values of a known key name the key.
    ("a=[1]x", "a"), ('a="x"y', "a"), ("a=1,a=2", "a"), ('{"sparsity": 1, "sparsity": 2}', "sparsity"),
    ("a=" + "9" * 5000, "a"),
])
def test_malformed_text_raises_config_error(text: str, key: str | None, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    if key == "-":  # not malformed after all: an empty JSON object is "no settings"
        assert load_backend_config(_spec("video_sparse_attn"), text).values == {"sparsity": 0.0}
        return
    with pytest.raises(ConfigError) as info:
        load_backend_config(_spec("video_sparse_attn"), text)
    assert info.value.key == key
    if key is not None:
        assert repr(key) in str(info.value)


@pytest.mark.parametrize(("name", "content"), [
    ("list.yaml", "- 1\n- 2\n"),
    ("bad.yaml", "a: [1, 2\n"),
    ("scalar.json", "3"),
    ("bad.json", "{sparsity: 1}"),
    ("notes.txt", "sparsity: 1\n"),
    ("intkey.yml", "1: 2\n"),
])
def test_bad_files_raise_config_error(name: str, content: str, tmp_path: Path) -> None:
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_backend_config(_spec("video_sparse_attn"), str(path))
    assert name in str(info.value)


def test_files_undecodable_or_empty(tmp_path: Path) -> None:
    vsa = _spec("video_sparse_attn")
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00sparsity")
    with pytest.raises(ConfigError, match="cannot read"):
        load_backend_config(vsa, str(binary))
    empty = tmp_path / "empty.yaml"
    empty.write_text("", encoding="utf-8")
    assert load_backend_config(vsa, str(empty)).values == {"sparsity": 0.0}
    real = tmp_path / "vsa.yml"
    real.write_text("sparsity: 0.9\n", encoding="utf-8")
    assert load_backend_config(vsa, f"  {real}  ").values == {"sparsity": 0.9}
