"""The diffusion runtime: diffusers-format models run by sglx pipelines over sglx's DiT attention backends."""
