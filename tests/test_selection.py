"""Decision tables for attention-backend selection on fake machines (issue 2, items 3-4).

The reference is the seeds' rules (SGLang's documented auto-selection, page-size constraints and
diffusion priority), restated here as tables. sglx implements only torch_native and torch_sdpa today,
so the rule tables run with the `all_implemented` fixture (every declared backend marked implemented);
separate tests on the real registry check that unimplemented backends are never chosen.
"""

from __future__ import annotations

import dataclasses

import pytest

from sglx.attention import registry
from sglx.attention.registry import NOT_IMPLEMENTED
from sglx.attention.request import AttentionRequest
from sglx.attention.selection import (
    DiffusionSelection,
    LLMBackendArgs,
    LLMSelection,
    ModelTraits,
    diffusion_auto_candidates,
    forced_attn_backend,
    global_force_attn_backend,
    global_force_attn_backend_context_manager,
    llm_auto_candidates,
    select_diffusion,
    select_llm,
)
from sglx.errors import BackendUnavailableError
from sglx.platform import PlatformSnapshot, fake

# name -> (device kind, GPU name, compute capability, CUDA version)
MACHINES: dict[str, tuple[str, str | None, tuple[int, int] | None, str | None]] = {
    "h100_cu124": ("cuda", "NVIDIA H100 80GB HBM3", (9, 0), "12.4"),
    "h100_cu122": ("cuda", "NVIDIA H100 80GB HBM3", (9, 0), "12.2"),
    "a100": ("cuda", "NVIDIA A100-SXM4-80GB", (8, 0), "12.4"),
    "l40s": ("cuda", "NVIDIA L40S", (8, 9), "12.4"),
    "b200": ("cuda", "NVIDIA B200", (10, 0), "12.8"),
    "rtx5090": ("cuda", "NVIDIA GeForce RTX 5090", (12, 0), "12.8"),
    "t4": ("cuda", "Tesla T4", (7, 5), "12.4"),
    "mi300": ("rocm", "AMD Instinct MI300X", (9, 4), None),  # gfx942 reports 9.4: must not look like Hopper
    "mps": ("mps", "Apple M3 Max", None, None),
    "ascend": ("npu", "Ascend910B", None, None),
    "xpu": ("xpu", "Intel Data Center GPU Max 1550", None, None),
    "cpu": ("cpu", None, None, None),
}

# Every kernel package a backend on that device kind could use.
ALL_PACKAGES = {
    "cuda": ("flashinfer", "flash_attn_interface", "flash_attn.cute", "flash_attn", "triton", "flash_mla",
             "sgl_kernel"),
    "rocm": ("aiter", "triton", "flash_attn", "wave_lang"),
    "npu": ("torch_npu",),
    "xpu": ("sgl_kernel", "triton"),
    "mps": (),
    "cpu": ("sgl_kernel",),
}
ALL = "ALL"
BROKEN_FA3 = "ImportError: libflash_attn_3.so: undefined symbol: _ZN3c104cuda9SetDevice"


def machine(name: str, packages: str | tuple[str, ...] = ALL, *, without: tuple[str, ...] = (),
            broken: dict[str, str] | None = None) -> PlatformSnapshot:
    """A fake snapshot of one named machine; packages=ALL installs every package usable on its device kind."""
    kind, gpu, cc, cuda = MACHINES[name]
    pkgs = ALL_PACKAGES[kind] if packages == ALL else packages
    pkgs = tuple(p for p in pkgs if p not in without and p not in (broken or {}))
    return fake(kind, gpu=gpu, capability=cc, cuda=cuda, packages=pkgs, broken=broken)


def passed_over(considered) -> dict[str, str]:  # type: ignore[no-untyped-def]
    return {c.name: " | ".join(c.reasons) for c in considered if not c.ok}


def assert_passed_over(considered, expected: dict[str, tuple[str, ...]]) -> None:  # type: ignore[no-untyped-def]
    """Exactly the expected candidates lost, each with a reason containing every expected substring."""
    got = passed_over(considered)
    assert set(got) == set(expected), got
    for name, needles in expected.items():
        for needle in needles:
            assert needle in got[name], (name, needle, got[name])


def raises_unavailable(fn, *args, **kwargs) -> str:  # type: ignore[no-untyped-def]
    """Exactly BackendUnavailableError (not a subclass, not another SglxError); returns its message."""
    with pytest.raises(BackendUnavailableError) as info:
        fn(*args, **kwargs)
    assert type(info.value) is BackendUnavailableError
    return str(info.value)


@pytest.fixture
def all_implemented(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mark every declared backend implemented, so the tables test the seeds' rules, not sglx's progress."""
    registry.all_backends()
    for key, spec in list(registry._REGISTRY.items()):
        if not spec.implemented:
            monkeypatch.setitem(registry._REGISTRY, key, dataclasses.replace(spec, factory="tests.dummy:Backend"))


@pytest.fixture(autouse=True)
def _sglang_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tables are SGLang's fixed rules: no measured record (tests/test_auto_measured.py covers the H100's)."""
    monkeypatch.setenv("SGLX_ATTENTION_RECORDS", "off")


@pytest.fixture(autouse=True)
def _no_forced_backend():
    """The forced diffusion backend is process-global: every test starts and ends without one."""
    global_force_attn_backend(None)
    yield
    global_force_attn_backend(None)


MHA = ModelTraits()
MLA = ModelTraits(mla=True)
NOT_INSTALLED = "is not installed"

# ---------------------------------------------------------------- LLM auto, rules (all implemented)

# (machine, packages, without, broken, chosen, page size, {passed-over name: reason substrings})
AUTO_MHA = [
    pytest.param("h100_cu124", ALL, (), None, "fa3", 1, {}, id="h100-cu124-fa3"),
    pytest.param("h100_cu124", ALL, ("flash_attn_interface", "sgl_kernel"), None, "flashinfer", 1,
                 {"fa3": ("flash_attn_interface or sgl_kernel is not installed",)}, id="h100-cu124-no-fa3-pkg"),
    pytest.param("h100_cu124", ALL, ("sgl_kernel",), {"flash_attn_interface": BROKEN_FA3}, "flashinfer", 1,
                 {"fa3": ("fails to import", "undefined symbol")}, id="h100-cu124-broken-fa3-pkg"),
    pytest.param("h100_cu122", ALL, (), None, "flashinfer", 1,
                 {"fa3": ("CUDA >= 12.3", "12.2")}, id="h100-cu122-flashinfer"),
    pytest.param("h100_cu122", ("triton",), (), None, "triton", 1,
                 {"fa3": ("CUDA >= 12.3",), "flashinfer": ("flashinfer " + NOT_INSTALLED,)}, id="h100-cu122-triton"),
    pytest.param("a100", ALL, (), None, "flashinfer", 1, {}, id="a100-flashinfer"),
    pytest.param("a100", ("triton",), (), None, "triton", 1,
                 {"flashinfer": ("flashinfer " + NOT_INSTALLED, "sglx[flashinfer]")}, id="a100-triton"),
    pytest.param("a100", ALL, (), {"flashinfer": "OSError: libcudart.so.13: cannot open"}, "triton", 1,
                 {"flashinfer": ("fails to import", "libcudart.so.13")}, id="a100-broken-flashinfer"),
    pytest.param("a100", (), (), None, "torch_native", 1,
                 {"flashinfer": (NOT_INSTALLED,), "triton": ("triton " + NOT_INSTALLED,)}, id="a100-bare"),
    pytest.param("l40s", ALL, (), None, "flashinfer", 1, {}, id="l40s-flashinfer"),
    pytest.param("l40s", ("triton",), (), None, "triton", 1, {"flashinfer": (NOT_INSTALLED,)}, id="l40s-triton"),
    pytest.param("b200", ALL, (), None, "trtllm_mha", 64, {}, id="b200-trtllm_mha"),
    pytest.param("b200", ALL, ("flashinfer",), None, "triton", 1,
                 {"trtllm_mha": ("flashinfer " + NOT_INSTALLED,), "flashinfer": (NOT_INSTALLED,)},
                 id="b200-no-flashinfer"),
    pytest.param("rtx5090", ALL, (), None, "flashinfer", 1, {}, id="rtx5090-flashinfer"),
    pytest.param("rtx5090", ("triton",), (), None, "triton", 1, {"flashinfer": (NOT_INSTALLED,)},
                 id="rtx5090-triton"),
    pytest.param("t4", ALL, (), None, "triton", 1, {"flashinfer": ("compute capability >= 8.0", "7.5")},
                 id="t4-triton"),
    pytest.param("mi300", ALL, (), None, "aiter", 1, {}, id="mi300-aiter"),
    pytest.param("mi300", ("triton",), (), None, "triton", 1, {"aiter": ("aiter " + NOT_INSTALLED,)},
                 id="mi300-triton"),
    pytest.param("mi300", (), (), None, "torch_native", 1,
                 {"aiter": (NOT_INSTALLED,), "triton": (NOT_INSTALLED,)}, id="mi300-bare"),
    pytest.param("ascend", ALL, (), None, "ascend", 128, {}, id="ascend-ascend"),
    pytest.param("ascend", (), (), None, "torch_native", 1, {"ascend": ("torch_npu " + NOT_INSTALLED,)},
                 id="ascend-no-torch_npu"),
    pytest.param("xpu", ALL, (), None, "intel_xpu", 1, {}, id="xpu-intel_xpu"),
    pytest.param("xpu", ("triton",), (), None, "triton", 1, {"intel_xpu": ("sgl_kernel " + NOT_INSTALLED,)},
                 id="xpu-triton"),
    pytest.param("mps", ALL, (), None, "torch_native", 1, {}, id="mps-torch_native"),
    pytest.param("cpu", ALL, (), None, "torch_native", 1, {}, id="cpu-torch_native"),
]


@pytest.mark.usefixtures("all_implemented")
@pytest.mark.parametrize(("name", "packages", "without", "broken", "chosen", "page", "lost"), AUTO_MHA)
def test_auto_mha(name, packages, without, broken, chosen, page, lost) -> None:  # type: ignore[no-untyped-def]
    sel = select_llm(machine(name, packages, without=without, broken=broken), MHA, LLMBackendArgs())
    assert (sel.prefill, sel.decode, sel.page_size, sel.source, sel.hybrid) == (chosen, chosen, page, "auto", False)
    assert_passed_over(sel.considered, lost)
    assert sel.considered[-1].name == chosen and sel.considered[-1].ok
    assert sel.why


AUTO_MLA = [
    pytest.param("h100_cu124", ALL, (), "fa3", 1, {}, id="h100-cu124-fa3"),
    pytest.param("h100_cu122", ALL, (), "flashinfer", 1, {"fa3": ("CUDA >= 12.3", "12.2")},
                 id="h100-cu122-flashinfer"),
    pytest.param("h100_cu124", ALL, ("flash_attn_interface",), "flashinfer", 1,
                 {"fa3": ("flash_attn_interface " + NOT_INSTALLED,)}, id="h100-no-fa3-pkg"),
    pytest.param("h100_cu124", ALL, ("flash_attn_interface", "flashinfer"), "triton", 1,
                 {"fa3": ("flash_attn_interface " + NOT_INSTALLED,), "flashinfer": ("flashinfer " + NOT_INSTALLED,)},
                 id="h100-no-fa3-no-flashinfer"),
    pytest.param("a100", ALL, (), "triton", 1, {}, id="a100-triton"),
    pytest.param("l40s", ALL, (), "triton", 1, {}, id="l40s-triton"),
    pytest.param("b200", ALL, (), "trtllm_mla", 64, {}, id="b200-trtllm_mla"),
    pytest.param("b200", ALL, ("flashinfer",), "triton", 1, {"trtllm_mla": ("flashinfer " + NOT_INSTALLED,)},
                 id="b200-no-flashinfer"),
    pytest.param("rtx5090", ALL, (), "triton", 1, {}, id="rtx5090-triton"),
    pytest.param("mi300", ALL, (), "triton", 1, {}, id="mi300-triton"),
    pytest.param("ascend", ALL, (), "ascend", 128, {}, id="ascend-ascend"),
    pytest.param("xpu", ALL, (), "triton", 1, {}, id="xpu-triton"),
    pytest.param("cpu", ALL, (), "torch_native", 1, {}, id="cpu-torch_native"),
    pytest.param("mps", ALL, (), "torch_native", 1, {}, id="mps-torch_native"),
    pytest.param("a100", ALL, ("triton",), "torch_native", 1, {"triton": ("triton " + NOT_INSTALLED,)},
                 id="a100-no-triton-torch_native"),
    pytest.param("ascend", ALL, ("torch_npu",), "torch_native", 1, {"ascend": ("torch_npu " + NOT_INSTALLED,)},
                 id="ascend-no-torch_npu-torch_native"),
]


@pytest.mark.usefixtures("all_implemented")
@pytest.mark.parametrize(("name", "packages", "without", "chosen", "page", "lost"), AUTO_MLA)
def test_auto_mla(name, packages, without, chosen, page, lost) -> None:  # type: ignore[no-untyped-def]
    sel = select_llm(machine(name, packages, without=without), MLA, LLMBackendArgs())
    assert (sel.prefill, sel.decode, sel.page_size, sel.source) == (chosen, chosen, page, "auto")
    assert_passed_over(sel.considered, lost)


@pytest.mark.usefixtures("all_implemented")
@pytest.mark.parametrize(("name", "packages", "needles"), [
    pytest.param("mps", ALL, ("an MLA model", "MPS", "torch_native: fp4 KV cache"), id="mps"),
    pytest.param("cpu", ALL, ("an MLA model", "CPU", "torch_native: fp4 KV cache"), id="cpu"),
    pytest.param("a100", (), ("triton: package triton " + NOT_INSTALLED, "torch_native: fp4 KV cache"),
                 id="a100-bare"),
    pytest.param("ascend", (), ("ascend: package torch_npu " + NOT_INSTALLED,), id="ascend-bare"),
])
def test_auto_mla_nothing_runs(name, packages, needles) -> None:  # type: ignore[no-untyped-def]
    """torch_native runs MLA everywhere, but not an fp4 latent cache: then nothing runs, and each reason is said."""
    msg = raises_unavailable(select_llm, machine(name, packages), MLA, LLMBackendArgs(kv_cache_dtype="fp4_e2m1"))
    for needle in needles:
        assert needle in msg


@pytest.mark.parametrize(("name", "kind", "order"), [
    ("h100_cu124", "mha", ["fa3", "flashinfer", "triton", "torch_native"]),
    ("b200", "mha", ["trtllm_mha", "flashinfer", "triton", "torch_native"]),
    ("rtx5090", "mha", ["flashinfer", "triton", "torch_native"]),
    ("a100", "mla", ["triton", "torch_native"]),
    ("h100_cu124", "mla", ["fa3", "flashinfer", "triton", "torch_native"]),
    ("b200", "mla", ["trtllm_mla", "triton", "torch_native"]),
    ("mi300", "mha", ["aiter", "triton", "torch_native"]),
    ("ascend", "mla", ["ascend", "torch_native"]),
    ("mps", "mha", ["torch_native"]),
    ("cpu", "mla", ["torch_native"]),
])
def test_auto_candidate_order(name: str, kind: str, order: list[str]) -> None:
    candidates = llm_auto_candidates(machine(name), kind)  # type: ignore[arg-type]
    assert [n for n, _ in candidates] == order
    assert all(rule for _, rule in candidates)


# ---------------------------------------------------------------- auto with a user page size / features

# (machine, traits, args, chosen, page, lost)
AUTO_CONSTRAINED = [
    pytest.param("b200", MHA, LLMBackendArgs(page_size=128), "flashinfer", 128,
                 {"trtllm_mha": ("page size 128 is not supported", "16, 32, 64")}, id="b200-mha-page128"),
    pytest.param("b200", MHA, LLMBackendArgs(page_size=32), "trtllm_mha", 32, {}, id="b200-mha-page32"),
    pytest.param("b200", MLA, LLMBackendArgs(page_size=128), "triton", 128,
                 {"trtllm_mla": ("page size 128 is not supported", "32, 64")}, id="b200-mla-page128"),
    pytest.param("ascend", MHA, LLMBackendArgs(page_size=64), "torch_native", 64,
                 {"ascend": ("page size 64 is not supported", "--page-size 128")}, id="ascend-mha-page64"),
    pytest.param("h100_cu124", MHA, LLMBackendArgs(page_size=16), "fa3", 16, {}, id="h100-any-page"),
    # sglx implements no speculative decoding: every implemented backend declares so, and auto says why
    pytest.param("b200", MHA, LLMBackendArgs(spec_topk=4), None, None,
                 {"trtllm_mha": ("topk>1",), "flashinfer": ("topk>1",)}, id="b200-spec-topk4"),
    pytest.param("b200", MHA, LLMBackendArgs(spec_topk=1), None, None,
                 {"trtllm_mha": ("topk=1",), "flashinfer": ("topk=1",)}, id="b200-spec-topk1"),
    pytest.param("b200", ModelTraits(sliding_window=True), LLMBackendArgs(), "trtllm_mha", 64, {},
                 id="b200-sliding-window"),
    # SGLang takes trtllm_mha here; sglx's auto puts per-token-scale backends first with fp8 KV (accuracy)
    pytest.param("b200", MHA, LLMBackendArgs(kv_cache_dtype="fp8_e4m3"), "triton", 1, {}, id="b200-fp8"),
    pytest.param("a100", MHA, LLMBackendArgs(kv_cache_dtype="fp4_e2m1"), None, None,
                 {"flashinfer": ("fp4 KV cache", "fp4_e2m1"), "triton": ("fp4 KV cache",)}, id="a100-fp4-kv"),
    pytest.param("a100", ModelTraits(multimodal=True), LLMBackendArgs(), None, None,
                 {"flashinfer": ("multimodal",), "triton": ("multimodal",)}, id="a100-multimodal"),
    pytest.param("mps", MHA, LLMBackendArgs(spec_topk=1), None, None,
                 {"torch_native": ("topk=1",)}, id="mps-spec-nothing-runs"),
]


@pytest.mark.usefixtures("all_implemented")
@pytest.mark.parametrize(("name", "traits", "args", "chosen", "page", "lost"), AUTO_CONSTRAINED)
def test_auto_with_constraints(name, traits, args, chosen, page, lost) -> None:  # type: ignore[no-untyped-def]
    snap = machine(name)
    if chosen is None:
        msg = raises_unavailable(select_llm, snap, traits, args)
        for cand, needles in lost.items():
            assert f"{cand}:" in msg and all(n in msg for n in needles)
        return
    sel = select_llm(snap, traits, args)
    assert (sel.decode, sel.prefill, sel.page_size) == (chosen, chosen, page)
    assert_passed_over(sel.considered, lost)


# ---------------------------------------------------------------- explicit requests and page-size rules

# (machine, traits, args, (prefill, decode, page) or None, substrings of the error)
EXPLICIT = [
    # fa4: SM90 needs page 128, SM100 does not
    pytest.param("h100_cu124", MHA, LLMBackendArgs(attention_backend="fa4"), ("fa4", "fa4", 128), (),
                 id="fa4-sm90-page-from-rule"),
    pytest.param("h100_cu124", MHA, LLMBackendArgs(attention_backend="fa4", page_size=128), ("fa4", "fa4", 128), (),
                 id="fa4-sm90-page128"),
    pytest.param("h100_cu124", MHA, LLMBackendArgs(attention_backend="fa4", page_size=64), None,
                 ("--attention-backend fa4 cannot run here", "page size 64 is not supported", "--page-size 128"),
                 id="fa4-sm90-page64"),
    pytest.param("b200", MHA, LLMBackendArgs(attention_backend="fa4", page_size=16), ("fa4", "fa4", 16), (),
                 id="fa4-sm100-page16"),
    pytest.param("b200", MHA, LLMBackendArgs(attention_backend="fa4"), ("fa4", "fa4", 1), (), id="fa4-sm100-default"),
    pytest.param("a100", MHA, LLMBackendArgs(attention_backend="fa4"), None,
                 ("compute capability 9.0, 10.x", "8.0", "Backends that would run here: flashinfer"),
                 id="fa4-a100"),
    # trtllm_mha: 16/32/64 (XQA decode also on SM90 and SM120)
    pytest.param("b200", MHA, LLMBackendArgs(attention_backend="trtllm_mha"), ("trtllm_mha", "trtllm_mha", 64), (),
                 id="trtllm_mha-default"),
    pytest.param("b200", MHA, LLMBackendArgs(attention_backend="trtllm_mha", page_size=16),
                 ("trtllm_mha", "trtllm_mha", 16), (), id="trtllm_mha-page16"),
    pytest.param("b200", MHA, LLMBackendArgs(attention_backend="trtllm_mha", page_size=128), None,
                 ("page size 128 is not supported", "trtllm_mha needs --page-size 16, 32, 64"),
                 id="trtllm_mha-page128"),
    pytest.param("rtx5090", MHA, LLMBackendArgs(attention_backend="trtllm_mha", page_size=1), None,
                 ("page size 1 is not supported", "16, 32, 64"), id="trtllm_mha-sm120-page1"),
    pytest.param("a100", MHA, LLMBackendArgs(attention_backend="trtllm_mha"), None,
                 ("compute capability 9.0, 10.x, 12.x",), id="trtllm_mha-a100"),
    pytest.param("b200", MHA, LLMBackendArgs(attention_backend="trtllm_mha", spec_topk=2), None,
                 ("speculative decoding with topk>1 is not supported by trtllm_mha",), id="trtllm_mha-topk2"),
    # ascend: 128 (MHA and MLA)
    pytest.param("ascend", MHA, LLMBackendArgs(attention_backend="ascend"), ("ascend", "ascend", 128), (),
                 id="ascend-mha-default"),
    pytest.param("ascend", MHA, LLMBackendArgs(attention_backend="ascend", page_size=64), None,
                 ("page size 64 is not supported", "ascend needs --page-size 128"), id="ascend-mha-page64"),
    pytest.param("ascend", MLA, LLMBackendArgs(attention_backend="ascend", page_size=1), None,
                 ("page size 1 is not supported", "--page-size 128"), id="ascend-mla-page1"),
    # MLA: flashmla 64, cutlass_mla 128, trtllm_mla 32/64, flashinfer MLA 1
    pytest.param("h100_cu124", MLA, LLMBackendArgs(attention_backend="flashmla"), ("flashmla", "flashmla", 64), (),
                 id="flashmla-default"),
    pytest.param("h100_cu124", MLA, LLMBackendArgs(attention_backend="flashmla", page_size=32), None,
                 ("page size 32 is not supported", "flashmla needs --page-size 64"), id="flashmla-page32"),
    pytest.param("b200", MLA, LLMBackendArgs(attention_backend="cutlass_mla"), ("cutlass_mla", "cutlass_mla", 128),
                 (), id="cutlass_mla-default"),
    pytest.param("b200", MLA, LLMBackendArgs(attention_backend="cutlass_mla", page_size=64), None,
                 ("page size 64 is not supported", "cutlass_mla needs --page-size 128"), id="cutlass_mla-page64"),
    pytest.param("h100_cu124", MLA, LLMBackendArgs(attention_backend="cutlass_mla"), None,
                 ("compute capability 10.x", "9.0"), id="cutlass_mla-hopper"),
    pytest.param("b200", MLA, LLMBackendArgs(attention_backend="trtllm_mla", page_size=32),
                 ("trtllm_mla", "trtllm_mla", 32), (), id="trtllm_mla-page32"),
    pytest.param("b200", MLA, LLMBackendArgs(attention_backend="trtllm_mla", page_size=16), None,
                 ("page size 16 is not supported", "trtllm_mla needs --page-size 32, 64"), id="trtllm_mla-page16"),
    pytest.param("a100", MLA, LLMBackendArgs(attention_backend="flashinfer"), ("flashinfer", "flashinfer", 1), (),
                 id="flashinfer_mla-default"),
    pytest.param("a100", MLA, LLMBackendArgs(attention_backend="flashinfer", page_size=16), None,
                 ("page size 16 is not supported", "flashinfer needs --page-size 1"), id="flashinfer_mla-page16"),
    pytest.param("a100", ModelTraits(mla=True, head_dim=40, dtype="float32"),
                 LLMBackendArgs(attention_backend="flashinfer"), None,
                 ("MLA latent dim (kv_lora_rank + qk_rope_head_dim) 40 is not supported: needs one of 576",
                  "dtype float32 is not supported"),
                 id="flashinfer_mla-tiny-fp32-model"),
    pytest.param("a100", ModelTraits(mla=True, head_dim=576, dtype="bfloat16"),
                 LLMBackendArgs(attention_backend="flashinfer"), ("flashinfer", "flashinfer", 1), (),
                 id="flashinfer_mla-deepseek-bf16"),
    pytest.param("h100_cu124", MLA, LLMBackendArgs(attention_backend="fa3", spec_topk=2, page_size=16), None,
                 ("topk>1 on fa3 needs --page-size 1",), id="fa3_mla-topk2-page16"),
    pytest.param("h100_cu124", MLA, LLMBackendArgs(attention_backend="fa3", spec_topk=2), ("fa3", "fa3", 1), (),
                 id="fa3_mla-topk2-page1"),
    pytest.param("a100", MLA, LLMBackendArgs(attention_backend="triton", spec_topk=1), None,
                 ("speculative decoding (topk=1) is not supported by triton",), id="triton_mla-sglx-has-no-spec"),
    # features: fp8 KV, sliding window
    pytest.param("b200", MHA, LLMBackendArgs(attention_backend="fa4", kv_cache_dtype="fp8_e4m3"), None,
                 ("fp8 KV cache (--kv-cache-dtype fp8_e4m3) is not supported by fa4",), id="fa4-fp8"),
    pytest.param("a100", MHA, LLMBackendArgs(attention_backend="flex_attention", kv_cache_dtype="fp8_e5m2"), None,
                 ("fp8 KV cache", "flex_attention"), id="flex-fp8"),
    pytest.param("h100_cu124", MLA, LLMBackendArgs(attention_backend="fa3", kv_cache_dtype="fp8_e4m3"), None,
                 ("fp8 KV cache", "fa3"), id="fa3_mla-fp8"),
    pytest.param("b200", ModelTraits(sliding_window=True), LLMBackendArgs(attention_backend="fa4"),
                 ("fa4", "fa4", 1), (), id="fa4-sliding"),
    pytest.param("h100_cu124", ModelTraits(dtype="float32"), LLMBackendArgs(attention_backend="fa4"), None,
                 ("dtype float32 is not supported: needs float16 or bfloat16", "Backends that would run here"),
                 id="fa4-float32"),
    pytest.param("cpu", ModelTraits(sliding_window=True), LLMBackendArgs(attention_backend="flex_attention"),
                 ("flex_attention", "flex_attention", 1), (), id="flex-sliding"),
    pytest.param("cpu", MHA, LLMBackendArgs(attention_backend="flex_attention", kv_cache_dtype="fp8_e4m3"), None,
                 ("fp8 KV cache (--kv-cache-dtype fp8_e4m3) is not supported by flex_attention",
                  "Backends that would run here: torch_native"), id="flex-fp8-cpu"),
    pytest.param("cpu", MHA, LLMBackendArgs(attention_backend="flex_attention", page_size=64),
                 ("flex_attention", "flex_attention", 64), (), id="flex-any-page-size"),
    pytest.param("b200", MLA, LLMBackendArgs(attention_backend="trtllm_mla", kv_cache_dtype="fp8_e4m3"),
                 ("trtllm_mla", "trtllm_mla", 64), (), id="trtllm_mla-fp8"),
    # platforms and other requirements
    pytest.param("h100_cu122", MHA, LLMBackendArgs(attention_backend="fa3"), ("fa3", "fa3", 1), (),
                 id="fa3-cu122-explicit-is-not-the-auto-rule"),
    pytest.param("mps", MHA, LLMBackendArgs(attention_backend="flashinfer"), None,
                 ("runs on CUDA only; this machine is MPS",
                  "Backends that would run here: torch_native, flex_attention"),
                 id="flashinfer-on-mps"),
    pytest.param("cpu", MHA, LLMBackendArgs(attention_backend="intel_amx"), None,
                 ("amx_bf16",), id="intel_amx-without-amx"),
    pytest.param("mi300", MHA, LLMBackendArgs(attention_backend="wave"), ("wave", "wave", 1), (), id="wave-rocm"),
    pytest.param("mi300", MHA, LLMBackendArgs(attention_backend="aiter"), ("aiter", "aiter", 1), (), id="aiter-rocm"),
    pytest.param("xpu", MHA, LLMBackendArgs(attention_backend="intel_xpu"), ("intel_xpu", "intel_xpu", 1), (),
                 id="intel_xpu"),
    pytest.param("a100", MHA, LLMBackendArgs(attention_backend="dual_chunk_flash_attn"),
                 ("dual_chunk_flash_attn", "dual_chunk_flash_attn", 1), (), id="dual_chunk"),
    pytest.param("a100", MHA, LLMBackendArgs(attention_backend="Triton", page_size=16), ("triton", "triton", 16), (),
                 id="triton-any-page-case-insensitive"),
]


@pytest.mark.usefixtures("all_implemented")
@pytest.mark.parametrize(("name", "traits", "args", "expected", "needles"), EXPLICIT)
def test_explicit(name, traits, args, expected, needles) -> None:  # type: ignore[no-untyped-def]
    snap = machine(name)
    if expected is None:
        msg = raises_unavailable(select_llm, snap, traits, args)
        for needle in needles:
            assert needle in msg, msg
        return
    sel = select_llm(snap, traits, args)
    assert (sel.prefill, sel.decode, sel.page_size) == expected
    assert sel.source == "explicit" and sel.considered == ()
    assert sel.why.startswith("--attention-backend")


@pytest.mark.usefixtures("all_implemented")
def test_explicit_page_size_is_never_rewritten() -> None:
    """A user page size that a backend accepts comes back unchanged; one it rejects is an error, not a fix-up."""
    for page in (16, 32, 64):
        sel = select_llm(machine("b200"), MHA, LLMBackendArgs(attention_backend="trtllm_mha", page_size=page))
        assert sel.page_size == page
    for page in (1, 8, 128):
        raises_unavailable(select_llm, machine("b200"), MHA,
                           LLMBackendArgs(attention_backend="trtllm_mha", page_size=page))


@pytest.mark.parametrize("page", [0, -1])
def test_page_size_must_be_positive(page: int) -> None:
    msg = raises_unavailable(select_llm, machine("cpu"), MHA, LLMBackendArgs(page_size=page))
    assert f"--page-size {page}" in msg


@pytest.mark.usefixtures("all_implemented")
def test_explicit_error_lists_every_reason_and_the_alternatives() -> None:
    snap = machine("mps")
    msg = raises_unavailable(select_llm, snap, MHA, LLMBackendArgs(attention_backend="fa3"))
    lines = msg.splitlines()
    assert lines[0] == "--attention-backend fa3 cannot run here:"
    assert "  - runs on CUDA only; this machine is MPS" in lines
    assert any("flash_attn_interface" in line and NOT_INSTALLED in line for line in lines)
    assert lines[-1].startswith("Backends that would run here: torch_native, flex_attention")
    assert "--attention-backend torch_native" in lines[-1]


@pytest.mark.usefixtures("all_implemented")
def test_explicit_with_broken_package_reports_import_error() -> None:
    snap = machine("a100", broken={"flashinfer": "ImportError: cannot import name 'BatchPrefill' from flashinfer"})
    msg = raises_unavailable(select_llm, snap, MHA, LLMBackendArgs(attention_backend="flashinfer"))
    assert "package flashinfer is installed but fails to import: ImportError: cannot import name 'BatchPrefill'" in msg
    assert "Backends that would run here:" in msg and "triton" in msg


@pytest.mark.parametrize(("traits", "name", "needles"), [
    pytest.param(MHA, "flashinfer_v2", ("--attention-backend flashinfer_v2: unknown attention backend",
                                       "Choose one of:", "flashinfer", "torch_native", "trtllm_mha"), id="unknown-mha"),
    pytest.param(MLA, "nsa", ("unknown attention backend", "flashmla", "cutlass_mla"), id="unknown-mla"),
    pytest.param(MLA, "flex_attention", ("flex_attention has no MLA implementation", "an MLA model",
                                        "MLA backends:", "trtllm_mla"), id="mha-only-name-for-mla"),
    pytest.param(MLA, "trtllm_mha", ("trtllm_mha has no MLA implementation",), id="trtllm_mha-for-mla"),
    pytest.param(MHA, "flashmla", ("flashmla has no MHA implementation", "an MHA model", "MHA backends:"),
                 id="mla-only-name-for-mha"),
    pytest.param(MHA, "torch_sdpa", ("torch_sdpa is a diffusion attention backend, and this is an MHA model",
                                     "Choose one of:", "triton"), id="diffusion-name-for-llm"),
])
def test_bad_backend_names(traits: ModelTraits, name: str, needles: tuple[str, ...]) -> None:
    msg = raises_unavailable(select_llm, machine("h100_cu124"), traits, LLMBackendArgs(attention_backend=name))
    for needle in needles:
        assert needle in msg, msg
    msg = raises_unavailable(select_llm, machine("cpu"), traits, LLMBackendArgs(decode_attention_backend=name))
    assert msg.startswith(f"--decode-attention-backend {name}")


# ---------------------------------------------------------------- hybrid (per-phase) requests

# (machine, traits, args, (prefill, decode, page, source), lost)
HYBRID = [
    pytest.param("b200", MLA, LLMBackendArgs(attention_backend="trtllm_mla", prefill_attention_backend="fa4"),
                 ("fa4", "trtllm_mla", 64, "explicit"), {}, id="seed-example-fa4-prefill-trtllm_mla"),
    pytest.param("h100_cu124", MHA, LLMBackendArgs(decode_attention_backend="trtllm_mha"),
                 ("fa3", "trtllm_mha", 64, "mixed"), {}, id="seed-example-xqa-decode-prefill-auto"),
    pytest.param("h100_cu124", MHA, LLMBackendArgs(prefill_attention_backend="fa4"),
                 ("fa4", "fa3", 128, "mixed"), {}, id="fa4-prefill-sm90-page128"),
    pytest.param("a100", MHA, LLMBackendArgs(prefill_attention_backend="triton", decode_attention_backend="flashinfer"),
                 ("triton", "flashinfer", 1, "explicit"), {}, id="both-phases"),
    pytest.param("a100", MHA, LLMBackendArgs(attention_backend="flashinfer", decode_attention_backend="triton"),
                 ("flashinfer", "triton", 1, "explicit"), {}, id="decode-overrides-base"),
    pytest.param("a100", MHA, LLMBackendArgs(attention_backend="triton", prefill_attention_backend="triton"),
                 ("triton", "triton", 1, "explicit"), {}, id="same-backend-not-hybrid"),
    pytest.param("a100", MHA, LLMBackendArgs(prefill_attention_backend="flashinfer",
                                             decode_attention_backend="flashinfer"),
                 ("flashinfer", "flashinfer", 1, "explicit"), {}, id="both-phases-same"),
    pytest.param("a100", MHA, LLMBackendArgs(attention_backend="flashinfer", prefill_attention_backend="triton",
                                             decode_attention_backend="torch_native"),
                 ("triton", "torch_native", 1, "explicit"), {}, id="both-phases-override-base"),
    pytest.param("b200", MLA, LLMBackendArgs(prefill_attention_backend="flashinfer"),
                 ("flashinfer", "triton", 1, "mixed"),
                 {"trtllm_mla": ("32, 64", "--prefill-attention-backend flashinfer needs --page-size 1")},
                 id="auto-phase-agrees-on-page-size"),
    pytest.param("b200", MLA, LLMBackendArgs(decode_attention_backend="cutlass_mla"),
                 ("triton", "cutlass_mla", 128, "mixed"),
                 {"trtllm_mla": ("--decode-attention-backend cutlass_mla needs --page-size 128",)},
                 id="auto-phase-avoids-cutlass-conflict"),
    pytest.param("b200", MLA, LLMBackendArgs(prefill_attention_backend="fa4", page_size=32),
                 ("fa4", "trtllm_mla", 32, "mixed"), {}, id="user-page-size-both-accept"),
]


@pytest.mark.usefixtures("all_implemented")
@pytest.mark.parametrize(("name", "traits", "args", "expected", "lost"), HYBRID)
def test_hybrid(name, traits, args, expected, lost) -> None:  # type: ignore[no-untyped-def]
    sel = select_llm(machine(name), traits, args)
    assert (sel.prefill, sel.decode, sel.page_size, sel.source) == expected
    assert sel.hybrid == (expected[0] != expected[1])
    if sel.hybrid:
        assert sel.label == f"hybrid (prefill={expected[0]}, decode={expected[1]})"
    assert_passed_over(sel.considered, lost)
    if args.prefill_attention_backend and not args.decode_attention_backend:
        assert "the other phase inherits" in sel.why


@pytest.mark.usefixtures("all_implemented")
@pytest.mark.parametrize(("name", "traits", "args", "needles"), [
    pytest.param("b200", MLA, LLMBackendArgs(prefill_attention_backend="flashinfer",
                                             decode_attention_backend="trtllm_mla"),
                 ("page sizes do not overlap", "flashinfer needs --page-size 1", "trtllm_mla needs --page-size 32, 64"),
                 id="flashinfer_mla-vs-trtllm_mla"),
    pytest.param("h100_cu124", MHA, LLMBackendArgs(attention_backend="fa4", decode_attention_backend="trtllm_mha"),
                 ("fa4 needs --page-size 128", "trtllm_mha needs --page-size 16, 32, 64"), id="fa4-sm90-vs-trtllm_mha"),
    pytest.param("b200", MLA, LLMBackendArgs(prefill_attention_backend="flashinfer", page_size=64),
                 ("--prefill-attention-backend flashinfer cannot run here", "flashinfer needs --page-size 1"),
                 id="phase-violates-user-page-size"),
    pytest.param("a100", MHA, LLMBackendArgs(attention_backend="triton", decode_attention_backend="fa3"),
                 ("--decode-attention-backend fa3 cannot run here", "flash_attn_interface"),
                 id="phase-cannot-run"),
    pytest.param("a100", MHA, LLMBackendArgs(prefill_attention_backend="nope"),
                 ("--prefill-attention-backend nope: unknown attention backend",), id="phase-unknown"),
])
def test_hybrid_errors(name, traits, args, needles) -> None:  # type: ignore[no-untyped-def]
    snap = machine(name, without=("flash_attn_interface", "sgl_kernel")) if "fa3" in str(args) else machine(name)
    msg = raises_unavailable(select_llm, snap, traits, args)
    for needle in needles:
        assert needle in msg, msg


# ---------------------------------------------------------------- real registry: unimplemented never chosen

REAL_MACHINES = list(MACHINES)


@pytest.mark.parametrize("name", REAL_MACHINES)
def test_real_registry_mha_picks_only_implemented(name: str) -> None:
    sel = select_llm(machine(name), MHA, LLMBackendArgs())
    chosen = registry.find(sel.decode, "llm", "mha")
    assert chosen is not None and chosen.implemented and sel.prefill == sel.decode
    lost = passed_over(sel.considered)
    order = [n for n, _ in llm_auto_candidates(machine(name), "mha")]
    assert set(lost) == set(order[:order.index(sel.decode)])  # every earlier candidate lost, each with reasons
    if MACHINES[name][0] not in ("cuda", "rocm", "xpu"):
        assert sel.decode == "torch_native"
    if name == "h100_cu124":  # fa3 is implemented and its package installed there: SGLang's Hopper default
        assert (sel.decode, lost) == ("fa3", {})


@pytest.mark.parametrize("name", REAL_MACHINES)
def test_real_registry_mla_picks_only_implemented(name: str) -> None:
    """sglx implements flashinfer, triton and torch_native MLA: auto lands on flashinfer on Hopper (fa3's MLA is
    not implemented), on triton on other GPUs, else on torch_native."""
    sel = select_llm(machine(name), MLA, LLMBackendArgs())
    expected = "triton" if MACHINES[name][0] in ("cuda", "rocm", "xpu") else "torch_native"
    if name.startswith("h100"):
        expected = "flashinfer"
    assert (sel.decode, sel.page_size, sel.source) == (expected, 1, "auto")
    lost = passed_over(sel.considered)
    order = [n for n, _ in llm_auto_candidates(machine(name), "mla")]
    assert set(lost) == set(order[:order.index(expected)])
    assert all(NOT_IMPLEMENTED in reasons for reasons in lost.values())


# machine (every package of its kind installed) -> (auto diffusion backend, the FlashAttention kernel that runs)
REAL_DIFFUSION = {
    "h100_cu124": ("fa", "FA3"), "h100_cu122": ("fa", "FA3"), "a100": ("fa", "FA3"), "l40s": ("fa", "FA3"),
    "b200": ("fa", "FA4"), "rtx5090": ("fa", "FA2"), "t4": ("torch_sdpa", None), "mi300": ("fa", "FA2"),
    "mps": ("torch_sdpa", None), "ascend": ("torch_sdpa", None), "xpu": ("torch_sdpa", None),
    "cpu": ("torch_sdpa", None),
}


@pytest.mark.parametrize("name", REAL_MACHINES)
def test_real_registry_diffusion_prefers_fa(name: str) -> None:
    snap = machine(name)
    sel = select_diffusion(snap, AttentionRequest(dtype="bfloat16", head_dim=128))
    chosen, variant = REAL_DIFFUSION[name]
    assert (sel.backend, sel.source) == (chosen, "auto")
    got = registry.chosen_variant(registry.find("fa", "diffusion", "dit"), snap)
    assert (got.name if got else None) == variant
    if name == "t4":
        assert "needs compute capability >= 8.0" in passed_over(sel.considered)["fa"]


# (machine, packages) -> the FlashAttention kernel fa runs, or the reason substrings when none does
FA_VARIANTS = [
    pytest.param("h100_cu124", ("flash_attn.cute",), "FA4", (), id="h100-fa4-only"),
    pytest.param("h100_cu124", ("flash_attn.cute", "flash_attn_interface", "flash_attn"), "FA3", (), id="h100-all"),
    pytest.param("h100_cu124", ("flash_attn",), "FA2", (), id="h100-fa2-only"),
    pytest.param("h100_cu124", (), None, ("FA4: package flash_attn.cute is not installed", "sglx[fa]",
                                          "FA3: package flash_attn_interface is not installed",
                                          "FA2: package flash_attn is not installed"), id="h100-none"),
    pytest.param("a100", ("flash_attn.cute",), None, ("FA4: needs compute capability 9.0, 10.x", "is 8.0"),
                 id="a100-fa4-needs-hopper"),
    pytest.param("b200", ("flash_attn_interface",), None, ("FA3: needs compute capability <= 9.0",), id="b200-fa3"),
    pytest.param("b200", ("flash_attn_interface", "flash_attn.cute"), "FA4", (), id="b200-fa4"),
    pytest.param("mi300", ("flash_attn",), "FA2", (), id="rocm-fa2"),
    pytest.param("cpu", ("flash_attn",), None, ("runs on CUDA or ROCm only",), id="cpu"),
]


@pytest.mark.parametrize(("name", "packages", "variant", "needles"), FA_VARIANTS)
def test_fa_variant_per_machine(name: str, packages: tuple[str, ...], variant: str | None,
                                needles: tuple[str, ...]) -> None:
    spec = registry.find("fa", "diffusion", "dit")
    snap = machine(name, packages)
    got = registry.chosen_variant(spec, snap)
    assert (got.name if got else None) == variant
    avail = registry.availability(spec, snap, AttentionRequest(family="diffusion", kind="dit", dtype="bfloat16"))
    assert avail.ok == (variant is not None)
    for needle in needles:
        assert needle in " | ".join(avail.reasons), avail.reasons
    if variant is None:  # an explicit request names why and what would run instead
        msg = raises_unavailable(select_diffusion, snap, BF16_128, cli_backend="fa4")
        assert "--attention-backend fa cannot run here" in msg and "torch_sdpa" in msg


@pytest.mark.parametrize(("traits", "backend"), [
    (MHA, "dual_chunk_flash_attn"), (MLA, "flashmla"), (MLA, "trtllm_mla"),
])
def test_real_registry_explicit_unimplemented_is_an_error(traits: ModelTraits, backend: str) -> None:
    snap = machine("b200" if backend == "trtllm_mla" else "h100_cu124")
    msg = raises_unavailable(select_llm, snap, traits, LLMBackendArgs(attention_backend=backend))
    assert f"  - {NOT_IMPLEMENTED}" in msg.splitlines()
    if traits is MHA:
        assert "Backends that would run here: " in msg and "triton, torch_native" in msg
    elif backend == "trtllm_mla":  # a B200 with flash_attn.cute: fa4 MLA's absorbed decode runs there too
        assert "Backends that would run here: flashinfer, triton, fa4, torch_native" in msg
    else:
        assert "Backends that would run here: flashinfer, triton, torch_native" in msg


def test_real_registry_cpu() -> None:
    sel = select_llm(machine("cpu"), MHA, LLMBackendArgs(attention_backend="torch_native", page_size=16))
    assert (sel.decode, sel.page_size, sel.source) == ("torch_native", 16, "explicit")
    msg = raises_unavailable(select_diffusion, machine("cpu"), cli_backend="fa")
    assert "runs on CUDA or ROCm only" in msg and "Backends that would run here: torch_sdpa" in msg


# ---------------------------------------------------------------- diffusion

BF16_128 = AttentionRequest(dtype="bfloat16", head_dim=128)
H100_WITH_SAGE = (*ALL_PACKAGES["cuda"], "sageattention")

# (machine, packages, broken, request, chosen, lost)
DIFFUSION_AUTO = [
    pytest.param("h100_cu124", ("flash_attn_interface",), None, BF16_128, "fa", {}, id="h100-fa3"),
    pytest.param("b200", ("flash_attn.cute",), None, BF16_128, "fa", {}, id="b200-fa4"),
    pytest.param("a100", ("flash_attn",), None, AttentionRequest(dtype="float16", head_dim=64), "fa", {},
                 id="a100-fa2-fp16"),
    pytest.param("l40s", ("flash_attn",), None, AttentionRequest(), "fa", {}, id="l40s-unknown-dtype"),
    pytest.param("h100_cu124", (), None, BF16_128, "torch_sdpa",
                 {"fa": ("flash_attn_interface " + NOT_INSTALLED, "flash_attn.cute " + NOT_INSTALLED,
                         "flash_attn " + NOT_INSTALLED)},
                 id="h100-not-installed"),
    pytest.param("h100_cu124", (), {"flash_attn": "ImportError: flash_attn_2_cuda.so: undefined symbol"}, BF16_128,
                 "torch_sdpa", {"fa": ("fails to import", "flash_attn_2_cuda.so")}, id="h100-broken"),
    pytest.param("t4", ("flash_attn",), None, AttentionRequest(dtype="float16"), "torch_sdpa",
                 {"fa": ("compute capability >= 8.0", "7.5")}, id="t4-sm75"),
    pytest.param("a100", ("flash_attn",), None, AttentionRequest(dtype="float32"), "torch_sdpa",
                 {"fa": ("dtype float32 is not supported",)}, id="a100-fp32"),
    pytest.param("a100", ("flash_attn",), None, AttentionRequest(dtype="bfloat16", head_dim=512), "torch_sdpa",
                 {"fa": ("head dim 512",)}, id="a100-head512"),
    pytest.param("a100", ("flash_attn",), None, AttentionRequest(dtype="bfloat16", head_dim=100), "torch_sdpa",
                 {"fa": ("head dim 100", "multiple of 8")}, id="a100-head100"),
    pytest.param("mi300", ("flash_attn",), None, BF16_128, "fa", {}, id="mi300-fa"),
    pytest.param("mi300", (), None, BF16_128, "torch_sdpa", {"fa": (NOT_INSTALLED,)}, id="mi300-sdpa"),
    pytest.param("mps", ("flash_attn",), None, BF16_128, "torch_sdpa", {}, id="mps"),
    pytest.param("ascend", ("flash_attn", "torch_npu"), None, BF16_128, "torch_sdpa", {}, id="npu"),
    pytest.param("xpu", (), None, BF16_128, "torch_sdpa", {}, id="xpu"),
    pytest.param("cpu", ("flash_attn",), None, BF16_128, "torch_sdpa", {}, id="cpu"),
]


@pytest.mark.usefixtures("all_implemented")
@pytest.mark.parametrize(("name", "packages", "broken", "req", "chosen", "lost"), DIFFUSION_AUTO)
def test_diffusion_auto(name, packages, broken, req, chosen, lost) -> None:  # type: ignore[no-untyped-def]
    sel = select_diffusion(machine(name, packages, broken=broken), req)
    assert (sel.backend, sel.source) == (chosen, "auto")
    assert_passed_over(sel.considered, lost)
    assert sel.why


@pytest.mark.parametrize(("name", "order"), [
    ("h100_cu124", ["fa", "torch_sdpa"]), ("mi300", ["fa", "torch_sdpa"]), ("mps", ["torch_sdpa"]),
    ("ascend", ["torch_sdpa"]), ("cpu", ["torch_sdpa"]),
])
def test_diffusion_candidate_order(name: str, order: list[str]) -> None:
    assert [n for n, _ in diffusion_auto_candidates(machine(name))] == order


@pytest.mark.usefixtures("all_implemented")
@pytest.mark.parametrize("alias", ["fa", "fa3", "fa4", "FA3"])
def test_diffusion_cli_aliases_normalize_to_fa(alias: str) -> None:
    sel = select_diffusion(machine("h100_cu124"), BF16_128, cli_backend=alias)
    assert sel == DiffusionSelection("fa", "cli", f"--attention-backend {alias}")


@pytest.mark.usefixtures("all_implemented")
def test_diffusion_priority_forced_beats_cli_beats_auto() -> None:
    snap = machine("h100_cu124", H100_WITH_SAGE)
    assert select_diffusion(snap, BF16_128).backend == "fa"  # auto
    assert select_diffusion(snap, BF16_128, cli_backend="sage_attn").source == "cli"
    global_force_attn_backend("torch_sdpa")
    sel = select_diffusion(snap, BF16_128, cli_backend="sage_attn")
    assert (sel.backend, sel.source) == ("torch_sdpa", "forced")
    global_force_attn_backend(None)
    assert select_diffusion(snap, BF16_128, cli_backend="sage_attn").backend == "sage_attn"


@pytest.mark.usefixtures("all_implemented")
def test_diffusion_context_manager_restores_previous() -> None:
    snap = machine("h100_cu124", H100_WITH_SAGE)
    global_force_attn_backend("fa3")
    assert forced_attn_backend() == "fa"  # stored normalized
    with global_force_attn_backend_context_manager("torch_sdpa"):
        assert select_diffusion(snap, BF16_128, cli_backend="fa").backend == "torch_sdpa"
        with global_force_attn_backend_context_manager("sage_attn"):
            assert select_diffusion(snap, BF16_128).backend == "sage_attn"
        assert forced_attn_backend() == "torch_sdpa"
    assert forced_attn_backend() == "fa"
    with pytest.raises(RuntimeError), global_force_attn_backend_context_manager(None):
        assert forced_attn_backend() is None
        raise RuntimeError("boom")
    assert forced_attn_backend() == "fa"  # restored even when the block raises


def test_diffusion_force_unknown_name_lists_choices_and_keeps_previous() -> None:
    global_force_attn_backend("torch_sdpa")
    msg = raises_unavailable(global_force_attn_backend, "flashinfer")
    assert "unknown diffusion attention backend 'flashinfer'" in msg
    for name in ("fa", "fa3", "fa4", "torch_sdpa", "sliding_tile_attn", "video_sparse_attn"):
        assert name in msg
    with pytest.raises(BackendUnavailableError), global_force_attn_backend_context_manager("nope"):
        pass  # pragma: no cover
    assert forced_attn_backend() == "torch_sdpa"


@pytest.mark.usefixtures("all_implemented")
@pytest.mark.parametrize(("name", "packages", "forced", "cli", "needles"), [
    pytest.param("mps", (), None, "fa", ("--attention-backend fa cannot run here", "runs on CUDA or ROCm only",
                                        "Backends that would run here: torch_sdpa"), id="cli-fa-on-mps"),
    pytest.param("mps", (), "fa4", None, ("global_force_attn_backend fa cannot run here",), id="forced-fa-on-mps"),
    pytest.param("a100", ("sageattention",), None, "sage_attn_3",
                 ("compute capability >= 10.0", "sageattn3 " + NOT_INSTALLED), id="sage3-on-a100"),
    pytest.param("b200", ("sageattention",), None, "sage_attn", ("compute capability 8.0, 8.6, 8.9, 9.0, 12.0",),
                 id="sage-on-b200"),
    pytest.param("mi300", ("triton",), None, "sliding_tile_attn", ("this machine is ROCm",), id="sta-on-rocm"),
    pytest.param("h100_cu124", (), None, "sliding_tile_attn", ("package triton is not installed",),
                 id="sta-without-triton"),
    pytest.param("h100_cu124", (), None, "video_sparse_attn", ("package triton is not installed",),
                 id="vsa-without-triton"),
    pytest.param("mi300", ("triton",), None, "sparse_video_gen_2_attn", ("this machine is ROCm",), id="svg2-on-rocm"),
    pytest.param("h100_cu124", (), None, "aiter", ("runs on ROCm only",), id="aiter-on-cuda"),
    pytest.param("h100_cu124", (), None, "flashinfer", ("--attention-backend flashinfer: flashinfer is an LLM "
                                                        "attention backend", "torch_sdpa"), id="llm-name"),
])
def test_diffusion_explicit_errors(name, packages, forced, cli, needles) -> None:  # type: ignore[no-untyped-def]
    global_force_attn_backend(forced)
    msg = raises_unavailable(select_diffusion, machine(name, packages), BF16_128, cli_backend=cli)
    for needle in needles:
        assert needle in msg, msg


@pytest.mark.usefixtures("all_implemented")
@pytest.mark.parametrize(("name", "packages", "cli"), [
    ("h100_cu124", ("sageattention",), "sage_attn"),
    ("rtx5090", ("sageattention",), "sage_attn"),
    ("b200", ("sageattn3",), "sage_attn_3"),
    ("h100_cu124", ("triton",), "sliding_tile_attn"),
    ("mps", (), "sliding_tile_attn"),
    ("h100_cu124", ("triton",), "video_sparse_attn"),
    ("h100_cu124", ("triton",), "vmoba_attn"),
    ("h100_cu124", ("triton",), "sparse_video_gen_2_attn"),
    ("cpu", (), "video_sparse_attn"),
    ("mps", (), "vmoba_attn"),
    ("cpu", (), "sparse_video_gen_2_attn"),
    ("mi300", ("aiter",), "aiter"),
    ("mps", (), "torch_sdpa"),
])
@pytest.mark.usefixtures("all_implemented")
def test_diffusion_explicit_runs(name: str, packages: tuple[str, ...], cli: str) -> None:
    sel = select_diffusion(machine(name, packages), BF16_128, cli_backend=cli)
    assert (sel.backend, sel.source) == (cli, "cli")


def test_selection_results_are_plain_values() -> None:
    """Selections are frozen values: two identical questions give equal answers (pure functions)."""
    a = select_llm(machine("cpu"), MHA, LLMBackendArgs())
    b = select_llm(machine("cpu"), MHA, LLMBackendArgs())
    assert isinstance(a, LLMSelection) and a == b
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.decode = "x"  # type: ignore[misc]
