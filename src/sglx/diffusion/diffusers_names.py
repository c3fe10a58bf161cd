"""Names diffusers' `set_attention_backend` accepts; torch-free so the CLI can list them cheaply."""

from __future__ import annotations

# diffusers' AttentionBackendName values (0.42); a test keeps this list equal to the installed diffusers'.
DIFFUSERS_ATTENTION_BACKENDS: tuple[str, ...] = (
    "flash", "flash_hub", "flash_varlen", "flash_varlen_hub", "flash_4_hub", "_flash_3", "_flash_varlen_3",
    "_flash_3_hub", "_flash_3_varlen_hub", "aiter_fa2_hub", "flex", "native", "_native_cudnn",
    "_native_efficient", "_native_flash", "_native_math", "_native_npu", "_native_xla", "sage", "sage_hub",
    "sage_blackwell_hub", "sage_varlen", "_sage_qk_int8_pv_fp8_cuda", "_sage_qk_int8_pv_fp8_cuda_sm90",
    "_sage_qk_int8_pv_fp16_cuda", "_sage_qk_int8_pv_fp16_triton", "xformers",
)
