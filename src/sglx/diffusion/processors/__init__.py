"""Attention processors that route a diffusers DiT's attention through sglx's DiT attention layer."""
