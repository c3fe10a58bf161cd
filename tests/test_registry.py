"""The backend registry against the seeds: every backend declared once, with the published matrix values.

The reference tables below restate SGLang's support matrix (shared/SUPPORT_MATRIX.md) and the diffusion
seed's platform matrix and config parameters, so a wrong declaration fails here rather than in `doctor`.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from sglx.attention import registry
from sglx.attention.registry import (
    NOT_IMPLEMENTED,
    BackendSpec,
    LLMFeatures,
    all_backends,
    availability,
    backend_names,
    find,
)
from sglx.attention.request import AttentionRequest
from sglx.attention.requirements import OnlyOn, Package, Requirement
from sglx.platform import PACKAGES_BY_MODULE, fake

MHA_NAMES = {"flashinfer", "fa3", "fa4", "triton", "torch_native", "flex_attention", "trtllm_mha",
             "dual_chunk_flash_attn", "aiter", "wave", "ascend", "intel_xpu", "intel_amx"}
# the seed's eight MLA backends, plus sglx's own torch_native MLA reference
MLA_NAMES = {"flashinfer", "flashmla", "cutlass_mla", "trtllm_mla", "fa3", "triton", "fa4", "ascend", "torch_native"}
DIFFUSION_NAMES = {"fa", "torch_sdpa", "sliding_tile_attn", "sage_attn", "sage_attn_3", "video_sparse_attn",
                   "vmoba_attn", "aiter", "sparse_video_gen_2_attn"}
IMPLEMENTED = {("llm", "mha", "torch_native"), ("llm", "mha", "triton"), ("llm", "mha", "flex_attention"),
               ("llm", "mha", "flashinfer"), ("llm", "mha", "trtllm_mha"),
               ("llm", "mha", "fa3"), ("llm", "mha", "fa4"),
               ("llm", "mla", "torch_native"), ("llm", "mla", "triton"), ("llm", "mla", "flashinfer"),
               ("llm", "mla", "fa4"),
               ("diffusion", "dit", "torch_sdpa"),
               ("diffusion", "dit", "fa"), ("diffusion", "dit", "sage_attn"), ("diffusion", "dit", "sliding_tile_attn"),
               ("diffusion", "dit", "video_sparse_attn"), ("diffusion", "dit", "vmoba_attn"),
               ("diffusion", "dit", "sparse_video_gen_2_attn")}

SNAPSHOTS = {
    "h100": fake("cuda", gpu="NVIDIA H100", capability=(9, 0), cuda="12.4"),
    "b200": fake("cuda", gpu="NVIDIA B200", capability=(10, 0), cuda="12.8"),
    "mi300": fake("rocm", gpu="AMD Instinct MI300X", capability=(9, 4)),
    "mps": fake("mps"),
    "ascend": fake("npu", packages=["torch_npu"]),
    "xpu": fake("xpu"),
    "cpu": fake("cpu"),
}


def spec(family: str, kind: str, name: str) -> BackendSpec:
    found = find(name, family, kind)  # type: ignore[arg-type]
    assert found is not None, (family, kind, name)
    return found


@pytest.mark.parametrize(("family", "kind", "names"), [
    ("llm", "mha", MHA_NAMES), ("llm", "mla", MLA_NAMES), ("diffusion", "dit", DIFFUSION_NAMES),
])
def test_every_seed_backend_is_declared_once(family: str, kind: str, names: set[str]) -> None:
    declared = [s.name for s in all_backends(family, kind)]  # type: ignore[arg-type]
    assert sorted(declared) == sorted(names)
    assert all(s.family == family and s.kind == kind for s in all_backends(family, kind))  # type: ignore[arg-type]


def test_names_and_aliases_are_unique_within_family_and_kind() -> None:
    seen: dict[tuple[str, str, str], str] = {}
    for s in all_backends():
        for name in s.names():
            assert name == name.lower() and name.strip() == name
            key = (s.family, s.kind, name)
            assert key not in seen, f"{name} declared by {seen[key]} and {s.name}"
            seen[key] = s.name
    for family in ("llm", "diffusion"):
        names = backend_names(family)  # type: ignore[arg-type]
        assert len(names) == len(set(names))


def test_registering_a_clashing_name_is_refused() -> None:
    before = dict(registry._REGISTRY)
    torch_native = spec("llm", "mha", "torch_native")
    with pytest.raises(ValueError, match="name clash"):
        registry.register(dataclasses.replace(torch_native, name="my_native", aliases=("torch_native",)))
    assert before == registry._REGISTRY


@pytest.mark.parametrize(("query", "family", "kind", "expected"), [
    ("fa3", "diffusion", "dit", "fa"), ("FA4", "diffusion", "dit", "fa"), (" fa ", "diffusion", "dit", "fa"),
    ("fa3", "llm", "mha", "fa3"), ("fa3", "llm", "mla", "fa3"), ("Torch_Native", "llm", "mha", "torch_native"),
    ("torch_native", "llm", "mla", "torch_native"), ("flash_mla", "llm", "mla", None),
    ("flashmla", "llm", "mha", None), ("torch_sdpa", "llm", "mha", None),
    ("flashinfer", "diffusion", "dit", None), ("nope", "llm", "mha", None),
])
def test_find(query: str, family: str, kind: str, expected: str | None) -> None:
    found = find(query, family, kind)  # type: ignore[arg-type]
    assert (found.name if found else None) == expected


def test_backend_names_include_aliases_for_cli_choices() -> None:
    names = backend_names("diffusion")
    assert names[:3] == ("fa", "fa3", "fa4")
    assert set(backend_names("llm")) == MHA_NAMES | MLA_NAMES
    assert set(backend_names("llm", "mla")) == MLA_NAMES


# SGLang's published matrix: (native paging, fp8 KV, fp4 KV, spec topk=1, spec topk>1, sliding window, multimodal)
MHA_MATRIX = {
    "dual_chunk_flash_attn": (True, False, False, False, False, False, False),
    "aiter": (True, True, False, True, True, True, True),
    "wave": (True, False, False, False, False, False, False),
    "ascend": (True, False, False, True, False, True, True),
    "intel_xpu": (True, False, False, False, False, True, False),
    "intel_amx": (False, False, False, False, False, False, False),
}
# (fp8 KV, fp4 KV, chunked prefix cache, spec topk=1, spec topk>1)
MLA_MATRIX = {
    "flashmla": (True, True, True, True, False),
    "cutlass_mla": (True, True, True, True, False),
    "trtllm_mla": (True, True, True, True, False),
    "fa3": (False, False, True, True, "page_size=1 only"),
    "ascend": (False, False, False, False, False),
}


@pytest.mark.parametrize("name", sorted(MHA_MATRIX))
def test_mha_features_match_support_matrix(name: str) -> None:
    f = spec("llm", "mha", name).features
    assert isinstance(f, LLMFeatures)
    got = (f.native_paging, f.fp8_kv, f.fp4_kv, f.spec_topk1, f.spec_topk_gt1, f.sliding_window, f.multimodal)
    assert got == MHA_MATRIX[name]


@pytest.mark.parametrize("name", sorted(MLA_MATRIX))
def test_mla_features_match_support_matrix(name: str) -> None:
    f = spec("llm", "mla", name).features
    assert isinstance(f, LLMFeatures)
    assert (f.fp8_kv, f.fp4_kv, f.chunked_prefix_cache, f.spec_topk1, f.spec_topk_gt1) == MLA_MATRIX[name]


def test_fa4_mla_declares_sglx_s_implementation_and_its_decode_rule() -> None:
    """The matrix's fa4 MLA row (fp4 KV, chunked prefix cache) is SGLang's; sglx's fa4 MLA expands whole prefixes and
    reads latents in the model dtype, and its decode needs Blackwell and DeepSeek's latent (the absorbed kernels)."""
    s = spec("llm", "mla", "fa4")
    f = s.features
    assert isinstance(f, LLMFeatures) and s.implemented
    assert (f.fp8_kv, f.fp4_kv, f.chunked_prefix_cache, f.spec_topk1, f.spec_topk_gt1) == (False,) * 5
    assert [r.describe() for r in s.decode_requires] == ["SM 10.x", "MLA latent dim (kv_lora_rank + "
                                                                    "qk_rope_head_dim) 576"]


def test_mla_backends_sglx_implements_declare_what_they_do() -> None:
    """triton and torch_native MLA: any page size through kv_indices, fp8 latents, no speculative decoding."""
    for name, graphs in (("triton", True), ("torch_native", False)):
        s = spec("llm", "mla", name)
        f = s.features
        assert isinstance(f, LLMFeatures) and s.implemented
        assert (f.page_sizes, f.fp8_kv, f.fp4_kv, f.spec_topk1, f.spec_topk_gt1) == (None, True, False, False, False)
        assert f.cuda_graph == graphs == s.load().supports_cuda_graph
    fi = spec("llm", "mla", "flashinfer")
    assert fi.implemented and fi.factory == "sglx.attention.llm.flashinfer_mla:FlashInferMLABackend"
    assert isinstance(fi.features, LLMFeatures) and fi.features.page_sizes is not None
    assert (fi.features.page_sizes.sizes, fi.features.fp8_kv, fi.features.cuda_graph) == ((1,), False, True)
    assert fi.load().supports_cuda_graph  # importing the module needs no flashinfer


def test_torch_native_declares_what_sglx_implements() -> None:
    """sglx's own torch_native masks sliding windows and reads fp8 KV (tests/test_doctor and its kernel tests)."""
    f = spec("llm", "mha", "torch_native").features
    assert isinstance(f, LLMFeatures)
    assert (f.sliding_window, f.fp8_kv, f.spec_topk1, f.cuda_graph) == (True, True, False, False)


def test_triton_declares_what_sglx_implements() -> None:
    """sglx's own Triton kernels: any page size via kv_indices, fp8 KV, sliding window, CUDA graphs; no fp4 or spec."""
    f = spec("llm", "mha", "triton").features
    assert isinstance(f, LLMFeatures)
    got = (f.native_paging, f.fp8_kv, f.fp4_kv, f.spec_topk1, f.spec_topk_gt1, f.sliding_window, f.multimodal)
    assert got == (True, True, False, False, False, True, False)
    assert f.cuda_graph


def test_fa_backends_declare_what_sglx_implements() -> None:
    """sglx's fa3/fa4: paged, sliding window, graphs; no fp8/fp4 KV (not wired) or spec decoding; fp16/bf16 only."""
    for name in ("fa3", "fa4"):
        s = spec("llm", "mha", name)
        f = s.features
        assert isinstance(f, LLMFeatures) and s.implemented and s.load().supports_cuda_graph
        got = (f.native_paging, f.fp8_kv, f.fp4_kv, f.spec_topk1, f.spec_topk_gt1, f.sliding_window, f.multimodal)
        assert got == (True, False, False, False, False, True, False) and f.cuda_graph
        reasons = availability(s, SNAPSHOTS["h100"], AttentionRequest(dtype="float32", head_dim=264))
        assert any("dtype float32 is not supported" in r for r in reasons.reasons)
        assert any("head dim 264 is not supported: needs <= 256" in r for r in reasons.reasons)
    assert "NOT verified" in spec("llm", "mha", "fa3").notes and "535 MB" in spec("llm", "mha", "fa3").notes


def test_flex_attention_declares_what_sglx_implements() -> None:
    """sglx's flex backend reads pages in place (any size) and masks sliding windows; no fp8/fp4 KV, spec or graphs.

    SGLang's matrix row (no native paging, fp4 KV) describes SGLang's backend, not this one.
    """
    s = spec("llm", "mha", "flex_attention")
    f = s.features
    assert isinstance(f, LLMFeatures) and s.implemented
    got = (f.native_paging, f.fp8_kv, f.fp4_kv, f.spec_topk1, f.spec_topk_gt1, f.sliding_window, f.multimodal)
    assert got == (True, False, False, False, False, True, False)
    assert f.page_sizes is None and not f.cuda_graph
    assert not s.load().supports_cuda_graph
    assert [p.name for p in s.config] == ["compile"]


# The seeds' hard page-size constraints: (kind, backend, machine, allowed sizes or None = any)
PAGE_RULES = [
    ("mha", "fa4", "h100", (128,)), ("mha", "fa4", "b200", None),
    ("mha", "trtllm_mha", "b200", (16, 32, 64)), ("mha", "trtllm_mha", "h100", (16, 32, 64)),
    ("mha", "ascend", "ascend", (128,)), ("mla", "ascend", "ascend", (128,)),
    ("mla", "flashmla", "h100", (64,)), ("mla", "cutlass_mla", "b200", (128,)),
    ("mla", "trtllm_mla", "b200", (32, 64)), ("mla", "flashinfer", "h100", (1,)),
    ("mla", "fa4", "b200", None),  # native 1, but the seeds pair fa4 prefill with trtllm_mla (32/64) decode
    ("mha", "flashinfer", "h100", None), ("mha", "fa3", "h100", None), ("mha", "triton", "h100", None),
    ("mha", "torch_native", "cpu", None), ("mha", "flex_attention", "cpu", None),
    ("mha", "flex_attention", "h100", None), ("mla", "triton", "h100", None), ("mla", "fa3", "h100", None),
]


@pytest.mark.parametrize(("kind", "name", "machine", "sizes"), PAGE_RULES)
def test_page_size_rules(kind: str, name: str, machine: str, sizes: tuple[int, ...] | None) -> None:
    rule = spec("llm", kind, name).page_size_rule(SNAPSHOTS[machine])
    assert (rule.sizes if rule else None) == sizes


def test_native_page_sizes_text_for_docs() -> None:
    texts = {(s.kind, s.name): s.features.native_page_sizes() for s in all_backends("llm")}  # type: ignore[union-attr]
    assert texts[("mha", "fa4")] == "128 on SM 9.0"
    assert texts[("mha", "trtllm_mha")] == "16, 32, 64"
    assert texts[("mla", "trtllm_mla")] == "32, 64"
    assert texts[("mla", "fa4")] == "1"
    assert texts[("mha", "triton")] == "any"
    assert texts[("mha", "flashinfer")] == "any"


def _requirements(s: BackendSpec) -> list[Requirement]:
    out: list[Requirement] = []
    for r in s.requires:
        out.append(r)
        if isinstance(r, OnlyOn):
            out.append(r.inner)
    return out


@pytest.mark.parametrize("s", all_backends(), ids=lambda s: f"{s.family}-{s.kind}-{s.name}")
def test_declarations_are_complete_and_describable(s: BackendSpec) -> None:
    assert s.title and s.summary
    for r in _requirements(s):
        text = r.describe()
        assert isinstance(text, str) and text.strip(), r
        if isinstance(r, Package):
            for module in r.modules:
                assert module in PACKAGES_BY_MODULE, f"{module} is not probed by sglx.platform"
    if isinstance(s.features, LLMFeatures):
        assert s.features.native_page_sizes().strip()
        if s.features.page_sizes is not None:
            assert s.features.page_sizes.describe().strip()
    assert s.implemented == (s.key in IMPLEMENTED)


@pytest.mark.parametrize("s", all_backends(), ids=lambda s: f"{s.family}-{s.kind}-{s.name}")
def test_unimplemented_backends_are_never_usable(s: BackendSpec) -> None:
    if s.implemented:
        assert inspect.isclass(s.load())
        return
    for snap in SNAPSHOTS.values():
        avail = availability(s, snap)
        assert not avail.ok and avail.reasons[0] == NOT_IMPLEMENTED
    with pytest.raises(RuntimeError, match=NOT_IMPLEMENTED):
        s.load()


@pytest.mark.parametrize("machine", sorted(SNAPSHOTS))
def test_implemented_backends_run_everywhere(machine: str) -> None:
    snap = SNAPSHOTS[machine]
    assert availability(spec("llm", "mha", "torch_native"), snap) == registry.Availability(True, ())
    assert availability(spec("diffusion", "dit", "torch_sdpa"), snap).ok


def test_availability_lists_every_reason_not_just_the_first() -> None:
    reasons = availability(spec("llm", "mha", "dual_chunk_flash_attn"), fake("mps")).reasons
    assert reasons[0] == NOT_IMPLEMENTED
    assert "runs on CUDA only; this machine is MPS" in reasons
    assert any("sgl_kernel is not installed" in r for r in reasons)
    fa3 = availability(spec("llm", "mha", "fa3"), fake("mps")).reasons
    assert "runs on CUDA only; this machine is MPS" in fa3
    assert any("flash_attn_interface or sgl_kernel is not installed" in r and "535 MB" in r for r in fa3)


def test_availability_reports_a_broken_package_with_its_import_error() -> None:
    snap = fake("cuda", gpu="NVIDIA A100", capability=(8, 0), cuda="12.4",
                broken={"flashinfer": "OSError: libnvrtc.so.12: cannot open shared object file"})
    reasons = availability(spec("llm", "mha", "flashinfer"), snap).reasons
    assert any("flashinfer is installed but fails to import: OSError: libnvrtc.so.12" in r for r in reasons)


@pytest.mark.parametrize(("kind", "name", "req", "needle"), [
    ("mha", "fa4", AttentionRequest(kv_cache_dtype="fp8_e4m3"), "fp8 KV cache"),
    ("mha", "flex_attention", AttentionRequest(kv_cache_dtype="fp8_e5m2"), "fp8 KV cache"),
    ("mha", "flashinfer", AttentionRequest(kv_cache_dtype="fp4_e2m1"), "fp4 KV cache"),
    ("mha", "flex_attention", AttentionRequest(spec_topk=1), "topk=1"),
    ("mha", "trtllm_mha", AttentionRequest(spec_topk=2), "topk>1 is not supported"),
    ("mha", "torch_native", AttentionRequest(spec_topk=1), "topk=1"),
    ("mla", "fa3", AttentionRequest(kind="mla", spec_topk=3, page_size=64), "needs --page-size 1"),
    ("mha", "trtllm_mha", AttentionRequest(page_size=8), "page size 8 is not supported"),
])
def test_feature_reasons(kind: str, name: str, req: AttentionRequest, needle: str) -> None:
    s = spec("llm", kind, name)
    assert any(needle in r for r in registry.iter_feature_reasons(s, SNAPSHOTS["b200"], req))
    plain = AttentionRequest(kind=kind)  # type: ignore[arg-type]
    assert list(registry.iter_feature_reasons(s, SNAPSHOTS["b200"], plain)) == []


# Diffusion platform matrix (CUDA, ROCm, MPS, NPU) from the seed; aiter is AMD's ROCm library (declared ROCm).
DIFFUSION_PLATFORMS = {
    "fa": ("cuda", "rocm"),
    "torch_sdpa": ("cuda", "rocm", "mps", "npu"),
    "sliding_tile_attn": ("cuda", "mps", "npu"), "sage_attn": ("cuda",), "sage_attn_3": ("cuda",),
    "video_sparse_attn": ("cuda", "mps", "npu"), "vmoba_attn": ("cuda", "mps", "npu"),
    "sparse_video_gen_2_attn": ("cuda", "mps", "npu"),
    "aiter": ("rocm",),
}


@pytest.mark.parametrize("name", sorted(DIFFUSION_PLATFORMS))
def test_diffusion_platform_matrix(name: str) -> None:
    platforms = spec("diffusion", "dit", name).platforms
    assert {p for p in platforms if p in ("cuda", "rocm", "mps", "npu")} == set(DIFFUSION_PLATFORMS[name])


# Config parameters from the diffusion seed: name -> (type, default, required)
CONFIG = {
    "sliding_tile_attn": {"mask_strategy_file_path": ("str", None, True), "sta_mode": ("str", "STA_inference", False),
                          "skip_time_steps": ("int", 15, False)},
    "video_sparse_attn": {"sparsity": ("float", 0.0, False)},
    "vmoba_attn": {
        "temporal_chunk_size": ("int", None, False), "temporal_topk": ("int", None, False),
        "spatial_chunk_size": ("list[int]", None, False), "spatial_topk": ("int", None, False),
        "st_chunk_size": ("list[int]", None, False), "st_topk": ("int", None, False),
        "moba_select_mode": ("str", "threshold", False), "moba_threshold": ("float", 0.25, False),
        "moba_threshold_type": ("str", "query_head", False), "first_full_step": ("int", 12, False),
        "first_full_layer": ("int", 0, False), "temporal_layer": ("int", 1, False),
        "spatial_layer": ("int", 1, False), "st_layer": ("int", 1, False),
    },
    # Not in the seed's table: Sparse-VideoGen's own parameters, defaults from its Wan scripts (wan_t2v_720p_sap.sh)
    "sparse_video_gen_2_attn": {
        "num_q_centroids": ("int", 300, False), "num_k_centroids": ("int", 1000, False),
        "top_p_kmeans": ("float", 0.9, False), "min_kc_ratio": ("float", 0.10, False),
        "kmeans_iter_init": ("int", 50, False), "kmeans_iter_step": ("int", 2, False),
        "first_times_fp": ("float", 0.2, False), "first_layers_fp": ("float", 0.03, False),
        "zero_step_kmeans_init": ("bool", False, False),
    },
}


@pytest.mark.parametrize("s", all_backends("diffusion"), ids=lambda s: s.name)
def test_diffusion_config_params_match_seed(s: BackendSpec) -> None:
    got = {p.name: (p.type, p.default, p.required) for p in s.config}
    assert got == CONFIG.get(s.name, {})
    assert all(p.description for p in s.config)
