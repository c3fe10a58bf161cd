"""Declarations of every LLM attention backend (MHA and MLA), one `register` call each.

Features of a backend sglx implements state sglx's own implementation; for a backend sglx only
declares, they are SGLang's published support matrix (the reference users know).
"""

from __future__ import annotations

from sglx.attention.registry import BackendSpec, ConfigParam, LLMFeatures, PageSizeRule, register
from sglx.attention.requirements import (
    Capability,
    CapabilityIn,
    CpuFlags,
    Dtypes,
    Explained,
    HeadDims,
    OnPlatform,
    Package,
    TorchAtLeast,
)

CUDA = OnPlatform(("cuda",))
ROCM = OnPlatform(("rocm",))
SM90 = CapabilityIn(((9, 0),))
BLACKWELL_DC = CapabilityIn(((10, None),))
FLASH_DTYPES = Dtypes(("float16", "bfloat16"))
FLASH_HEAD_DIMS = HeadDims(max=256, multiple_of=8)

# ---------------------------------------------------------------- MHA

register(BackendSpec(
    name="flashinfer", family="llm", kind="mha", title="FlashInfer",
    summary="FlashInfer paged prefill/decode kernels; SGLang's default on Ampere/Ada.",
    requires=(CUDA, Capability(min=(8, 0)), Package(("flashinfer",)), Dtypes(("float16", "bfloat16")),
              HeadDims(allowed=(64, 128, 256))),
    features=LLMFeatures(native_paging=True, fp8_kv=True, fp4_kv=False, spec_topk1=False, spec_topk_gt1=False,
                         sliding_window=True, multimodal=False, cuda_graph=True, fp8_kv_dtype_per_layer=True),
    config=(ConfigParam("decode_tensor_cores", "str", "Decode on tensor cores (FlashInfer's prefill template): "
                        "auto uses them for GQA groups >= 4 and fp8 KV, where they win.",
                        default="auto", choices=("auto", "on", "off")),),
    factory="sglx.attention.llm.flashinfer:FlashInferBackend",
    notes="The pool's pages viewed in place (every page size native), ragged prefill without cached prefixes, "
          "paged causal prefill with them, decode on tensor cores for GQA >= 4; one plan per step and layer kind; "
          "fp8 KV with one scale per layer (the checkpoint's, else from the first prefill over rotated keys: 85-88.5% "
          "on the embedded model's recall where per-token scales on triton keep 98.5%; with "
          "--kv-cache-dtype-skip-layers 1 that layer stays in the model dtype with plans of its own: 100% of 2 x 200 "
          "prompts emulated on CPU, unrun on a GPU), sliding window, logit "
          "soft-cap; decode in CUDA graphs. Verified on an H100 "
          "(float64, graph replay, transformers parity); FlashInfer's plan costs ~0.5 ms of host time a decode step.",
))

register(BackendSpec(
    name="fa3", family="llm", kind="mha", title="FlashAttention 3",
    summary="FlashAttention 3 with paged KV; SGLang's default on Hopper with CUDA >= 12.3.",
    requires=(CUDA, Capability(min=(8, 0), max=(9, 0)), Package(("flash_attn_interface", "sgl_kernel")),
              FLASH_DTYPES, FLASH_HEAD_DIMS),
    features=LLMFeatures(native_paging=True, fp8_kv=False, fp4_kv=False, spec_topk1=False, spec_topk_gt1=False,
                         sliding_window=True, multimodal=False, cuda_graph=True),
    factory="sglx.attention.llm.fa3:FA3Backend",
    notes="flash_attn_with_kvcache over the pool's pages (any page size), the metadata shared with fa4; sliding "
          "window, soft-cap, decode in CUDA graphs; no fp8 KV. NOT verified on a GPU: neither flash-attn-3 nor "
          "sgl-kernel (a 535 MB wheel) can be installed on the lent H100 (torch 2.11 + CUDA 13); its call is "
          "tested on CPU against a float64 stand-in of FA3's documented contract.",
))

register(BackendSpec(
    name="fa4", family="llm", kind="mha", title="FlashAttention 4",
    summary="FlashAttention 4 (CuTe DSL) for SM90 and SM100; decode has no split-KV on Hopper.",
    requires=(CUDA, CapabilityIn(((9, 0), (10, None))), Package(("flash_attn.cute",)), FLASH_DTYPES,
              FLASH_HEAD_DIMS),
    features=LLMFeatures(native_paging=True, fp8_kv=False, fp4_kv=False, spec_topk1=False, spec_topk_gt1=False,
                         sliding_window=True, multimodal=False, page_sizes=PageSizeRule((128,), on=SM90),
                         cuda_graph=True),
    factory="sglx.attention.llm.fa4:FA4Backend",
    notes="flash_attn.cute.flash_attn_varlen_func over the pool's pages (prefix hits, GQA, sliding window, "
          "soft-cap), decode in CUDA graphs. On SM90 page_size must be 128 (auto picks it); no split-KV on SM90, "
          "so decode slows down with context at small batch (slower than fa3 at long context on Hopper).",
))

register(BackendSpec(
    name="triton", family="llm", kind="mha", title="Triton",
    summary="Portable Triton kernels (split-KV decode, extend); runs on any CUDA or ROCm GPU.",
    requires=(OnPlatform(("cuda", "rocm", "xpu")), Package(("triton",))),
    features=LLMFeatures(native_paging=True, fp8_kv=True, fp4_kv=False, spec_topk1=False, spec_topk_gt1=False,
                         sliding_window=True, multimodal=False, cuda_graph=True, fp8_per_token_scales=True),
    factory="sglx.attention.llm.triton:TritonBackend",
    notes="sglx's own kernels: any page size through kv_indices, fp8 KV with per-token scales (or a checkpoint's "
          "per-layer k_scale/v_scale), logit soft-cap; "
          "decode runs in CUDA graphs.",
))

register(BackendSpec(
    name="torch_native", family="llm", kind="mha", title="Torch Native (SDPA)",
    summary="PyTorch scaled_dot_product_attention over KV gathered from the paged pool; runs everywhere.",
    requires=(),
    features=LLMFeatures(native_paging=False, fp8_kv=True, fp4_kv=False, spec_topk1=False, spec_topk_gt1=False,
                         sliding_window=True, multimodal=False, cuda_graph=False, fp8_per_token_scales=True,
                         fp8_kv_dtype_per_layer=True),
    factory="sglx.attention.llm.torch_native:TorchNativeBackend",
    notes="Reference backend: correct on every device and page size, not tuned for speed; no CUDA graphs.",
))

register(BackendSpec(
    name="flex_attention", family="llm", kind="mha", title="FlexAttention (PyTorch)",
    summary="torch.nn.attention.flex_attention reading K/V in place from the paged pool through block masks.",
    requires=(TorchAtLeast((2, 5)),),
    features=LLMFeatures(native_paging=True, fp8_kv=False, fp4_kv=False, spec_topk1=False, spec_topk_gt1=False,
                         sliding_window=True, multimodal=False, cuda_graph=False),
    config=(ConfigParam("compile", "str", "Run flex_attention through torch.compile: on, off, or auto (eager "
                        "for now: compiled CUDA extend failed to lower on torch 2.11). CPU compiles static "
                        "shapes only (each new batch shape recompiles).",
                        default="auto", choices=("auto", "on", "off")),),
    factory="sglx.attention.llm.flex:FlexAttentionBackend",
    notes="sglx's flex backend: one flex_attention call per layer over the pool's own K/V (any page size, "
          "prefix hits, GQA, sliding window, logit soft-cap); eager by default, compiled opt-in; no fp8 KV "
          "(flex reads the pool's dtype), no CUDA graphs (block masks are rebuilt every step).",
))

register(BackendSpec(
    name="trtllm_mha", family="llm", kind="mha", title="TRT-LLM MHA",
    summary="TensorRT-LLM MHA kernels via FlashInfer; SGLang's default on Blackwell (XQA decode on SM90/SM120).",
    requires=(CUDA, CapabilityIn(((9, 0), (10, None), (12, None))), Package(("flashinfer",)),
              Dtypes(("float16", "bfloat16")), HeadDims(allowed=(64, 128, 256))),
    features=LLMFeatures(native_paging=True, fp8_kv=True, fp4_kv=False, spec_topk1=False, spec_topk_gt1=False,
                         sliding_window=True, multimodal=False, page_sizes=PageSizeRule((16, 32, 64)),
                         cuda_graph=True, fp8_kv_dtype_per_layer=True),
    factory="sglx.attention.llm.trtllm_mha:TrtllmMHABackend",
    notes="Decode: flashinfer's trtllm_batch_decode_with_kv_cache (XQA on SM90/SM120, trtllm-gen on SM100) over "
          "the pool's pages in place, block tables built on the device, CUDA graphs; prefill is FlashInfer's "
          "(as in SGLang). fp8 KV as e4m3 only, one scale per layer as in flashinfer "
          "(--kv-cache-dtype-skip-layers too), and XQA's SM90 fp8 kernel "
          "computes in fp8, queries and probabilities rounded to e4m3 (against float64 the H100 measured 0.036 "
          "on a 202-token context and 0.14 on a 4-token one); no logit soft-cap. Verified on SM90 (H100) only.",
))

register(BackendSpec(
    name="dual_chunk_flash_attn", family="llm", kind="mha", title="Dual Chunk FlashAttention",
    summary="Dual-chunk attention for million-token-context Qwen2.5-1M models.",
    requires=(CUDA, Capability(min=(8, 0)), Package(("sgl_kernel",))),
    features=LLMFeatures(native_paging=True, fp8_kv=False, fp4_kv=False, spec_topk1=False, spec_topk_gt1=False),
))

register(BackendSpec(
    name="aiter", family="llm", kind="mha", title="AITER (ROCm)",
    summary="AMD AITER kernels; SGLang's default on ROCm.",
    requires=(ROCM, Package(("aiter",))),
    features=LLMFeatures(native_paging=True, fp8_kv=True, fp4_kv=False, spec_topk1=True, spec_topk_gt1=True,
                         sliding_window=True, multimodal=True, cuda_graph=True),
))

register(BackendSpec(
    name="wave", family="llm", kind="mha", title="Wave (ROCm)",
    summary="AMD Wave DSL kernels.",
    requires=(ROCM, Package(("wave_lang",))),
    features=LLMFeatures(native_paging=True, fp8_kv=False, fp4_kv=False, spec_topk1=False, spec_topk_gt1=False),
))

register(BackendSpec(
    name="ascend", family="llm", kind="mha", title="Ascend (NPU)",
    summary="Huawei Ascend NPU attention via torch_npu.",
    requires=(OnPlatform(("npu",)), Package(("torch_npu",))),
    features=LLMFeatures(native_paging=True, fp8_kv=False, fp4_kv=False, spec_topk1=True, spec_topk_gt1=False,
                         sliding_window=True, multimodal=True, page_sizes=PageSizeRule((128,))),
))

register(BackendSpec(
    name="intel_xpu", family="llm", kind="mha", title="Intel XPU",
    summary="Intel GPU (XPU) attention kernels.",
    requires=(OnPlatform(("xpu",)), Package(("sgl_kernel",))),
    features=LLMFeatures(native_paging=True, fp8_kv=False, fp4_kv=False, spec_topk1=False, spec_topk_gt1=False,
                         sliding_window=True),
))

register(BackendSpec(
    name="intel_amx", family="llm", kind="mha", title="Intel AMX (CPU)",
    summary="CPU attention using Intel AMX tiles (sgl-kernel CPU build).",
    requires=(OnPlatform(("cpu",)), CpuFlags(("amx_bf16", "amx_tile")), Package(("sgl_kernel",))),
    features=LLMFeatures(native_paging=False, fp8_kv=False, fp4_kv=False, spec_topk1=False, spec_topk_gt1=False),
))

# ---------------------------------------------------------------- MLA

register(BackendSpec(
    name="flashinfer", family="llm", kind="mla", title="FlashInfer MLA",
    summary="FlashInfer's paged MLA kernel (absorbed weights) over the latent pool, one token per page.",
    requires=(CUDA, Capability(min=(8, 0)), Package(("flashinfer",)), Dtypes(("float16", "bfloat16")),
              HeadDims(allowed=(576,), what="MLA latent dim (kv_lora_rank + qk_rope_head_dim)")),
    features=LLMFeatures(native_paging=True, fp8_kv=False, fp4_kv=False, spec_topk1=False, spec_topk_gt1=False,
                         chunked_prefix_cache=False, page_sizes=PageSizeRule((1,)), cuda_graph=True),
    factory="sglx.attention.llm.flashinfer_mla:FlashInferMLABackend",
    notes="BatchMLAPagedAttentionWrapper for decode and (causal) extend, latent 512 + rope 64 (head dim 576); "
          "CUDA-graph decode on one wrapper per batch size (planned on the host before each replay). Wrapper "
          "logic tested on CPU against a stand-in of its documented contract; the kernel is judged on a GPU by "
          "tests/gpu/test_mla_gpu.py (float64, transformers, graphs) and doctor --check: all passed on an H100, "
          "where it decodes B64 H128 ctx 4096 in 0.155 ms.",
))

register(BackendSpec(
    name="flashmla", family="llm", kind="mla", title="FlashMLA",
    summary="DeepSeek FlashMLA decode kernels for Hopper.",
    requires=(CUDA, CapabilityIn(((9, 0), (10, None))), Package(("flash_mla", "sgl_kernel"))),
    features=LLMFeatures(native_paging=True, fp8_kv=True, fp4_kv=True, spec_topk1=True, spec_topk_gt1=False,
                         chunked_prefix_cache=True, page_sizes=PageSizeRule((64,)), cuda_graph=True),
))

register(BackendSpec(
    name="cutlass_mla", family="llm", kind="mla", title="Cutlass MLA",
    summary="CUTLASS MLA decode for Blackwell.",
    requires=(CUDA, BLACKWELL_DC, Package(("sgl_kernel",))),
    features=LLMFeatures(native_paging=True, fp8_kv=True, fp4_kv=True, spec_topk1=True, spec_topk_gt1=False,
                         chunked_prefix_cache=True, page_sizes=PageSizeRule((128,)), cuda_graph=True),
))

register(BackendSpec(
    name="trtllm_mla", family="llm", kind="mla", title="TRT-LLM MLA (Blackwell)",
    summary="TensorRT-LLM MLA kernels via FlashInfer; SGLang's MLA default on Blackwell.",
    requires=(CUDA, BLACKWELL_DC, Package(("flashinfer",))),
    features=LLMFeatures(native_paging=True, fp8_kv=True, fp4_kv=True, spec_topk1=True, spec_topk_gt1=False,
                         chunked_prefix_cache=True, page_sizes=PageSizeRule((32, 64)), cuda_graph=True),
))

register(BackendSpec(
    name="fa3", family="llm", kind="mla", title="FlashAttention 3 (MLA)",
    summary="FlashAttention 3 MLA path; SGLang's MLA default on Hopper with CUDA >= 12.3.",
    requires=(CUDA, Capability(min=(8, 0), max=(9, 0)), Package(("flash_attn_interface",))),
    features=LLMFeatures(native_paging=True, fp8_kv=False, fp4_kv=False, spec_topk1=True,
                         spec_topk_gt1="page_size=1 only", chunked_prefix_cache=True, cuda_graph=True),
))

register(BackendSpec(
    name="triton", family="llm", kind="mla", title="Triton (MLA)",
    summary="Portable Triton MLA kernels: split-KV absorbed decode over the latent cache, expanded extend.",
    requires=(OnPlatform(("cuda", "rocm", "xpu")), Package(("triton",))),
    features=LLMFeatures(native_paging=True, fp8_kv=True, fp4_kv=False, spec_topk1=False, spec_topk_gt1=False,
                         chunked_prefix_cache=False, cuda_graph=True),
    factory="sglx.attention.llm.triton_mla:TritonMLABackend",
    notes="sglx's own kernels: decode reads each [c_kv, k_pe] latent tile once for scores and values (W_UK "
          "folded into q, W_UV after); extend expands prefix + new latents per head for the MHA extend kernel (the "
          "192-wide heads as 128 + 64 tiles); "
          "any page size through kv_indices, fp8 latents. On SM90 the 64-head decode runs a Gluon kernel that "
          "double-buffers the latent tiles by hand (Triton 3.6). Verified under the Triton interpreter and on an "
          "H100/H200 (float64 kernel tests, transformers tokens, CUDA graphs); decode B64 H128 ctx 4096 on an H200: "
          "0.195 ms, 1.36x the time of FlashInfer MLA in the same run (tl.dot kernel alone: 0.303 ms, 2.1x); fp8 "
          "latents 0.339 ms (docs/benchmarks.md).",
))

register(BackendSpec(
    name="fa4", family="llm", kind="mla", title="FlashAttention 4 (MLA)",
    summary="FlashAttention 4 MLA: expanded-latent prefill on SM90/SM100, absorbed decode on SM100.",
    requires=(CUDA, CapabilityIn(((9, 0), (10, None))), Package(("flash_attn.cute",)), FLASH_DTYPES),
    # flash-attn-4 4.0.0b36 runs the absorbed MLA form (qv: latent 512 + rope 64) on SM100/SM110 only; its
    # prefill here is the non-absorbed form, an ordinary (192, 128) head-dim kernel that Hopper runs too.
    decode_requires=(Explained(CapabilityIn(((10, None),)), "flash-attn-4's absorbed MLA kernels (qv) are "
                               "Blackwell-only"),
                     HeadDims(allowed=(576,), what="MLA latent dim (kv_lora_rank + qk_rope_head_dim)")),
    # The matrix lists native page size 1; FA4 reads any page size (TMA at 128, cp.async otherwise), and the seeds
    # pair `--prefill-attention-backend fa4` with trtllm_mla decode, which needs page size 32 or 64.
    features=LLMFeatures(native_paging=True, fp8_kv=False, fp4_kv=False, spec_topk1=False, spec_topk_gt1=False,
                         chunked_prefix_cache=False, native_sizes_note="1", cuda_graph=True),
    factory="sglx.attention.llm.fa4_mla:FA4MLABackend",
    notes="Prefill/extend: each request's latents (cached prefix and new) expanded per head to K = [c W_UK, k_pe] "
          "and V = c W_UV, then flash_attn_varlen_func (ragged, causal, queries aligned to the end of their keys). "
          "Decode (SM100): the absorbed form, q_pe / q_nope W_UK as q / qv against the latent pool's pages as "
          "k_pe / c_kv, W_UV after, decode in CUDA graphs. On Hopper only its prefill runs "
          "(--prefill-attention-backend fa4 with triton or flashinfer decode). Prefill verified on an H200 "
          "(float64 extend at DeepSeek-V2-Lite's shape, tiny DeepSeek engines against transformers, doctor --check); "
          "one layer's extend 1.45-1.70x faster than triton's on 4k-token prompts, slower on 512-token ones, and "
          "eager (no prefill graphs; docs/benchmarks.md, session 31). The calls are tested on CPU against a float64 "
          "stand-in of FA4's documented contract; the SM100 decode is NOT verified (no Blackwell GPU is lent).",
))

register(BackendSpec(
    name="torch_native", family="llm", kind="mla", title="Torch Native MLA (SDPA)",
    summary="PyTorch SDPA over the paged latent cache: expanded K/V for prefill, absorbed weights for decode.",
    requires=(),
    features=LLMFeatures(native_paging=False, fp8_kv=True, fp4_kv=False, spec_topk1=False, spec_topk_gt1=False,
                         chunked_prefix_cache=False, cuda_graph=False),
    factory="sglx.attention.llm.torch_native_mla:TorchNativeMLABackend",
    notes="Reference MLA backend: one latent (kv_lora_rank + qk_rope_head_dim) per token and layer; extend "
          "expands prefix + new latents per head, decode folds W_UK into q and applies W_UV after; any page "
          "size, fp8 latents, every device; not tuned for speed, no CUDA graphs.",
))

register(BackendSpec(
    name="ascend", family="llm", kind="mla", title="Ascend MLA (NPU)",
    summary="Huawei Ascend NPU MLA via torch_npu.",
    requires=(OnPlatform(("npu",)), Package(("torch_npu",))),
    features=LLMFeatures(native_paging=True, fp8_kv=False, fp4_kv=False, spec_topk1=False, spec_topk_gt1=False,
                         page_sizes=PageSizeRule((128,))),
))
