"""Declarations of every diffusion (DiT) attention backend, with their config parameters."""

from __future__ import annotations

from sglx.attention.registry import BackendSpec, ConfigParam, DiffusionFeatures, register
from sglx.attention.requirements import (
    Capability,
    CapabilityIn,
    Dtypes,
    HeadDims,
    OnlyOn,
    OnPlatform,
    Package,
)

CUDA = OnPlatform(("cuda",))

register(BackendSpec(
    name="fa", family="diffusion", kind="dit", title="FlashAttention",
    aliases=("fa3", "fa4"),
    summary="FlashAttention (FA3 on Hopper, FA4 on Blackwell, FA2 elsewhere); preferred on CUDA when it runs.",
    requires=(
        OnPlatform(("cuda", "rocm")),
        OnlyOn(("cuda",), Capability(min=(8, 0))),
        Dtypes(("float16", "bfloat16")),
        HeadDims(max=256, multiple_of=8),
        Package(("flash_attn_interface", "flash_attn.cute", "flash_attn")),
    ),
    features=DiffusionFeatures(notes="CUDA requires SM80+ and fp16/bf16; falls back to torch_sdpa in auto mode."),
))

register(BackendSpec(
    name="torch_sdpa", family="diffusion", kind="dit", title="PyTorch SDPA",
    summary="torch.nn.functional.scaled_dot_product_attention; the most compatible option.",
    requires=(OnPlatform(("cuda", "rocm", "mps", "npu", "xpu", "cpu")),),
    features=DiffusionFeatures(notes="Most compatible option across platforms; GQA supported."),
    factory="sglx.attention.diffusion.sdpa:TorchSDPABackend",
))

register(BackendSpec(
    name="sliding_tile_attn", family="diffusion", kind="dit", title="Sliding Tile Attention (STA)",
    summary="3D sliding-tile sparse attention over the video latent grid.",
    requires=(CUDA, Package(("st_attn",))),
    features=DiffusionFeatures(sparse=True, needs_grid=True, notes="CUDA-only. Requires st_attn."),
    config=(
        ConfigParam("mask_strategy_file_path", "str", "Path to the mask strategy JSON file.", required=True),
        ConfigParam("sta_mode", "str", "Mode of STA.", default="STA_inference"),
        ConfigParam("skip_time_steps", "int",
                    "Number of steps to use full attention before switching to sparse attention.", default=15),
    ),
))

register(BackendSpec(
    name="sage_attn", family="diffusion", kind="dit", title="SageAttention",
    summary="Quantized (INT8 QK) attention from thu-ml/SageAttention.",
    requires=(CUDA, CapabilityIn(((8, 0), (8, 6), (8, 9), (9, 0), (12, 0))), Package(("sageattention",))),
    features=DiffusionFeatures(notes="CUDA-only; upstream kernels target SM80/86/89/90/120."),
))

register(BackendSpec(
    name="sage_attn_3", family="diffusion", kind="dit", title="SageAttention 3",
    summary="FP4 SageAttention3 for Blackwell GPUs.",
    requires=(CUDA, Capability(min=(10, 0)), Package(("sageattn3",))),
    features=DiffusionFeatures(notes="CUDA-only; SageAttention3 targets Blackwell (SM100/SM120)."),
))

register(BackendSpec(
    name="video_sparse_attn", family="diffusion", kind="dit", title="Video Sparse Attention (VSA)",
    summary="Trainable block-sparse video attention (coarse + fine stages).",
    requires=(CUDA, Package(("vsa",))),
    features=DiffusionFeatures(sparse=True, needs_grid=True, notes="CUDA-only. Requires vsa."),
    config=(ConfigParam("sparsity", "float", "Validation sparsity (0.0 - 1.0).", default=0.0),),
))

register(BackendSpec(
    name="vmoba_attn", family="diffusion", kind="dit", title="VMoBA",
    summary="Mixture-of-block attention for video diffusion (temporal, spatial, spatiotemporal layers).",
    requires=(CUDA, Package(("kernel.attn.vmoba_attn.vmoba",))),
    features=DiffusionFeatures(sparse=True, needs_grid=True, notes="CUDA-only."),
    config=(
        ConfigParam("temporal_chunk_size", "int", "Chunk size for temporal dimension."),
        ConfigParam("temporal_topk", "int", "Top-K tokens to select in temporal dimension."),
        ConfigParam("spatial_chunk_size", "list[int]", "Chunk size for spatial dimension (H, W)."),
        ConfigParam("spatial_topk", "int", "Top-K tokens to select in spatial dimension."),
        ConfigParam("st_chunk_size", "list[int]", "Chunk size for spatiotemporal dimension (T, H, W)."),
        ConfigParam("st_topk", "int", "Top-K tokens to select in spatiotemporal dimension."),
        ConfigParam("moba_select_mode", "str", "Selection mode (e.g., threshold).", default="threshold"),
        ConfigParam("moba_threshold", "float", "Threshold value for selection.", default=0.25),
        ConfigParam("moba_threshold_type", "str", "Type of thresholding (e.g., query_head).", default="query_head"),
        ConfigParam("first_full_step", "int", "Number of initial steps to use full attention.", default=12),
        ConfigParam("first_full_layer", "int", "Number of initial layers to use full attention.", default=0),
        ConfigParam("temporal_layer", "int", "Number of temporal layers.", default=1),
        ConfigParam("spatial_layer", "int", "Number of spatial layers.", default=1),
        ConfigParam("st_layer", "int", "Number of spatiotemporal layers.", default=1),
    ),
))

register(BackendSpec(
    name="aiter", family="diffusion", kind="dit", title="AITER",
    summary="AMD AITER attention kernels.",
    requires=(OnPlatform(("rocm",)), Package(("aiter",))),
    features=DiffusionFeatures(notes="AITER is AMD's ROCm kernel library (SGLang's table lists it under CUDA)."),
))

register(BackendSpec(
    name="sparse_video_gen_2_attn", family="diffusion", kind="dit", title="Sparse VideoGen 2",
    summary="Semantic-aware permutation sparse attention from Sparse-VideoGen.",
    requires=(CUDA, Package(("svg",))),
    features=DiffusionFeatures(sparse=True, needs_grid=True, notes="CUDA-only. Requires svg."),
))
