"""Native sglx pipelines: diffusers' components, sglx's attention and denoising loop."""
