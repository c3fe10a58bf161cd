"""Declarations of every diffusion (DiT) attention backend, with their config parameters."""

from __future__ import annotations

from sglx.attention.registry import BackendSpec, ConfigParam, DiffusionFeatures, register
from sglx.attention.requirements import (
    AnyVariant,
    Capability,
    CapabilityIn,
    Dtypes,
    HeadDims,
    OnlyOn,
    OnPlatform,
    Package,
    Variant,
)

CUDA = OnPlatform(("cuda",))

# sglx's sparse backends: the Triton block-sparse kernel on CUDA, the plain-PyTorch masked reference elsewhere.
SPARSE_KERNEL = (
    OnPlatform(("cuda", "mps", "npu", "xpu", "cpu")),  # ROCm torch calls devices "cuda": kernel untested there
    OnlyOn(("cuda",), Package(("triton",))),
    OnlyOn(("cuda",), Dtypes(("float16", "bfloat16"))),
    OnlyOn(("cuda",), HeadDims(allowed=(64, 128))),
)

# FlashAttention's kernels, best first: FA3 (Hopper's own kernel), FA4 (CuTe DSL: Hopper and Blackwell), FA2.
FA_VARIANTS = AnyVariant("FlashAttention", (
    Variant("FA3", "flash_attn_interface",
            (CUDA, Capability(min=(8, 0), max=(9, 0)), Package(("flash_attn_interface",)))),
    Variant("FA4", "flash_attn.cute", (CUDA, CapabilityIn(((9, 0), (10, None))), Package(("flash_attn.cute",)))),
    Variant("FA2", "flash_attn", (OnPlatform(("cuda", "rocm")), OnlyOn(("cuda",), Capability(min=(8, 0))),
                                  Package(("flash_attn",)))),
))

register(BackendSpec(
    name="fa", family="diffusion", kind="dit", title="FlashAttention",
    aliases=("fa3", "fa4"),
    summary="FlashAttention: FA3 on Hopper, FA4 on Hopper and Blackwell, FA2 elsewhere (the best one installed); "
            "preferred on CUDA when it runs.",
    requires=(
        OnPlatform(("cuda", "rocm")),
        Dtypes(("float16", "bfloat16")),
        HeadDims(max=256, multiple_of=8),
        FA_VARIANTS,
    ),
    features=DiffusionFeatures(notes="fp16/bf16 only; GQA and any sequence length. FA3 needs SM80-SM90, "
                                     "FA4 SM90 or SM10x (head dim <= 128 on SM10x), FA2 SM80+ or ROCm.",
                               lse=True),
    factory="sglx.attention.diffusion.flash_attn:FlashAttentionBackend",
))

register(BackendSpec(
    name="torch_sdpa", family="diffusion", kind="dit", title="PyTorch SDPA",
    summary="torch.nn.functional.scaled_dot_product_attention; the most compatible option.",
    requires=(OnPlatform(("cuda", "rocm", "mps", "npu", "xpu", "cpu")),),
    features=DiffusionFeatures(notes="Most compatible option across platforms; GQA supported.", lse=True),
    factory="sglx.attention.diffusion.sdpa:TorchSDPABackend",
))

register(BackendSpec(
    name="sliding_tile_attn", family="diffusion", kind="dit", title="Sliding Tile Attention (STA)",
    summary="3D sliding-tile sparse attention over the video latent grid (sglx's block-sparse kernel).",
    requires=(
        OnPlatform(("cuda", "mps", "npu", "xpu", "cpu")),  # ROCm torch calls devices "cuda": kernel untested there
        OnlyOn(("cuda",), Package(("triton",))),
        OnlyOn(("cuda",), Dtypes(("float16", "bfloat16"))),
        OnlyOn(("cuda",), HeadDims(allowed=(64, 128))),
    ),
    features=DiffusionFeatures(
        sparse=True, needs_grid=True,
        notes="sglx's Triton block-sparse kernel on CUDA (fp16/bf16, head dim 64/128); elsewhere the plain-PyTorch "
              "masked reference (same output, dense cost). Any (T, H, W) grid: 6x8x8-token tiles, edge tiles "
              "padded (padding never attended). Windows per step/layer/head from a FastVideo mask strategy JSON "
              "(sliding_tile.write_uniform_strategy writes a uniform one; sta_mode STA_searching generates densely and "
              "writes the smallest window per step/layer/head within 5% of dense); STA_tuning is not implemented."),
    factory="sglx.attention.diffusion.sparse.sliding_tile:SlidingTileAttentionBackend",
    config=(
        ConfigParam("mask_strategy_file_path", "str", "Path to the mask strategy JSON file.", required=True),
        ConfigParam("sta_mode", "str", "Mode of STA.", default="STA_inference"),
        ConfigParam("skip_time_steps", "int",
                    "Number of steps to use full attention before switching to sparse attention.", default=15),
    ),
))

register(BackendSpec(
    name="sage_attn", family="diffusion", kind="dit", title="SageAttention",
    summary="Quantized (INT8 QK, fp16 PV) attention from thu-ml/SageAttention 1.x (Triton).",
    requires=(CUDA, CapabilityIn(((8, 0), (8, 6), (8, 9), (9, 0), (12, 0))), HeadDims(allowed=(64, 96, 128)),
              Package(("sageattention",))),
    features=DiffusionFeatures(
        notes="Lossy: Q and K are rounded to INT8 per block and V to fp16, so outputs differ from exact attention "
              "by about 1e-2 (checked at a wider tolerance than exact kernels). sageattention 1.0.6 leaves its last "
              "64-key block unmasked; sglx pads and corrects it exactly, at twice the cost on such key counts. "
              "On H100 it is slower than cuDNN.",
        check_tolerance=6e-2),
    factory="sglx.attention.diffusion.sage:SageAttentionBackend",
))

register(BackendSpec(
    name="sage_attn_3", family="diffusion", kind="dit", title="SageAttention 3",
    summary="FP4 SageAttention3 for Blackwell GPUs.",
    requires=(CUDA, Capability(min=(10, 0)), Package(("sageattn3",))),
    features=DiffusionFeatures(notes="Declared only: sglx has no SageAttention3 wrapper yet (it needs a Blackwell "
                                     "GPU to build and test). Targets SM100/SM120."),
))

register(BackendSpec(
    name="video_sparse_attn", family="diffusion", kind="dit", title="Video Sparse Attention (VSA)",
    summary="Video sparse attention (FastVideo's VSA): top-k 4x4x4-token cubes by mean-pooled scores, "
            "block-sparse over the chosen cubes (sglx's block-sparse kernel).",
    requires=SPARSE_KERNEL,
    features=DiffusionFeatures(
        sparse=True, needs_grid=True,
        notes="sglx's own VSA, no vsa package needed: the Triton block-sparse kernel on CUDA (fp16/bf16, head dim "
              "64/128), the plain-PyTorch masked reference elsewhere. Any grid (the smaller edge cubes of a grid "
              "that does not divide by 4 are packed into full 64-token blocks: no padded work). Each query block "
              "keeps ceil((1 - sparsity) x blocks) key blocks (at least 1); "
              "sparsity 0.0 is dense. Output is the fine branch: the coarse branch is gated by a learned "
              "to_gate_compress that stock checkpoints lack (FastVideo zero-initialises it)."),
    factory="sglx.attention.diffusion.sparse.video_sparse:VideoSparseAttentionBackend",
    config=(ConfigParam("sparsity", "float", "Validation sparsity (0.0 - 1.0).", default=0.0),),
))

register(BackendSpec(
    name="vmoba_attn", family="diffusion", kind="dit", title="VMoBA",
    summary="Mixture-of-block attention for video diffusion (temporal, spatial, spatiotemporal layers) on "
            "sglx's block-sparse kernel.",
    requires=SPARSE_KERNEL,
    features=DiffusionFeatures(
        sparse=True, needs_grid=True,
        notes="sglx's own VMoBA, no upstream package needed: Triton block-sparse kernel on CUDA (fp16/bf16, head "
              "dim 64/128), masked reference elsewhere. Chunks are chosen per (head, query block) from the block's "
              "mean query; moba_select_mode threshold or topk, every upstream moba_threshold_type. Unset chunk "
              "sizes/top-k take FastVideo's Wan2.1-1.3B values (temporal 2 / top 3, spatial [3,4] / top 20, "
              "st [4,6,4] / top 15) cut to the grid; any grid (edge chunks padded; on CUDA 64-token kernel blocks "
              "where they pad a chunk by at most a third, so 4x6x4 chunks take 128 slots)."),
    factory="sglx.attention.diffusion.sparse.vmoba:VMoBABackend",
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
    features=DiffusionFeatures(notes="Declared only: sglx has no AITER wrapper yet (no ROCm GPU to test on). AITER is "
                                     "AMD's ROCm kernel library (SGLang's table lists it under CUDA)."),
))

register(BackendSpec(
    name="sparse_video_gen_2_attn", family="diffusion", kind="dit", title="Sparse VideoGen 2",
    summary="Semantic-aware permutation sparse attention from Sparse-VideoGen 2 (k-means of q and k, top-p "
            "cluster selection) on sglx's block-sparse kernel.",
    requires=SPARSE_KERNEL,
    features=DiffusionFeatures(
        sparse=True, needs_grid=True,
        notes="sglx's own SVG2, no svg package needed: Triton block-sparse kernel on CUDA (fp16/bf16, head dim "
              "64/128), masked reference elsewhere. Query clusters are padded to whole blocks (64 tokens on CUDA, 16 "
              "elsewhere; packed like the keys when that would add over half the sequence); keys are not, so a "
              "block holding several clusters is attended when any of them is kept: density is at least SVG2's. "
              "Centroid counts are capped at the latent token count; k-means warm-started per layer within a "
              "generation, on CUDA with sglx's Triton assignment and atomic-free centroid update "
              "(SGLX_KMEANS_ASSIGN=torch / SGLX_KMEANS_UPDATE=torch fall back to torch's). Defaults: "
              "Sparse-VideoGen's Wan scripts."),
    factory="sglx.attention.diffusion.sparse.svg2:SparseVideoGen2Backend",
    config=(
        ConfigParam("num_q_centroids", "int", "Number of query clusters (k-means centroids) per head.",
                    default=300),
        ConfigParam("num_k_centroids", "int", "Number of key clusters (k-means centroids) per head.", default=1000),
        ConfigParam("top_p_kmeans", "float",
                    "Top-p: probability mass of key clusters each query cluster keeps (0 - 1].", default=0.9),
        ConfigParam("min_kc_ratio", "float", "At least this fraction of key clusters kept per query cluster.",
                    default=0.10),
        ConfigParam("kmeans_iter_init", "int", "K-means iterations the first time a layer clusters.", default=50),
        ConfigParam("kmeans_iter_step", "int", "K-means iterations on later steps (warm-started).", default=2),
        ConfigParam("first_times_fp", "float", "Fraction of the first steps that use full attention.",
                    default=0.2),
        ConfigParam("first_layers_fp", "float", "Fraction of the first layers that use full attention.",
                    default=0.03),
        ConfigParam("zero_step_kmeans_init", "bool",
                    "Also run k-means during the full-attention steps (warm centroids).", default=False),
    ),
))
