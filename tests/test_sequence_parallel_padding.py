"""Sequence parallelism with latent token counts that do not divide by the ranks: the last rank's chunk is
zero-padded, attention leaves the padded keys out, and the gathered output drops them, so SP 2 equals SP 1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sglx.distributed.spawn import spawn_workers
from sp_padding_workers import padded_attention_cases, padded_pipeline_cases

TOL = 2e-5  # fp32 against float64


def test_padded_attention_ulysses_and_ring_match_float64_sdpa() -> None:
    """9 latent tokens over 2 ranks (5 + 4 real, 1 padded; the padding holds large values so a key that was not
    left out would show), with no text, prefix text (FLUX) and suffix text, under Ulysses 2 and ring 2."""
    res = spawn_workers(padded_attention_cases, 2, ([(2, 1), (1, 2)],), timeout_s=180)[0]
    assert len(res) == 6
    for case, err in res.items():
        assert err < TOL, (case, err)


def _short_text(path: Path) -> Path:
    (path / "sglx.json").write_text(json.dumps({"defaults": {"max_sequence_length": 16}}))
    return path


def test_odd_token_grids_sp2_equal_sp1(tmp_path: Path) -> None:
    """A tiny Wan at 24x24 (9 latent tokens) and a tiny FLUX at 48x48 (9 latent tokens): odd counts at SP 2 under
    Ulysses 2 and ring 2 give SP 1's frames; each rank's DiT holds ceil(tokens / 2) tokens."""
    from diffusion_test_utils import make_tiny_flux, make_tiny_wan
    from sp_workers import model_frames

    wan = str(_short_text(make_tiny_wan(tmp_path / "wan")))
    flux = str(_short_text(make_tiny_flux(tmp_path / "flux")))
    wan_req = dict(prompt="a red circle moving right", negative_prompt="blue", height=24, width=24, num_frames=1,
                   num_inference_steps=2, guidance_scale=4.0, seed=3)
    flux_req = dict(prompt="a green square on black", height=48, width=48, num_inference_steps=2, seed=4)
    refs = {}
    for name, path, req, tokens in (("wan", wan, wan_req, 9), ("flux", flux, flux_req, 9)):
        frames, seen = model_frames(path, req)
        assert seen == tokens and frames.std() > 0.01  # odd, and a picture with content
        refs[name] = frames
    cases = [("wan_u2", wan, wan_req, 2, 1), ("wan_r2", wan, wan_req, 1, 2), ("flux_u2", flux, flux_req, 2, 1)]
    ranks = spawn_workers(padded_pipeline_cases, 2, (cases,), timeout_s=300)
    for name, _, _, _, _ in cases:
        ref = refs[name.split("_")[0]]
        got = torch.from_numpy(ranks[0][name])
        want_tokens = {"wan": 5, "flux": 5}[name.split("_")[0]]
        assert ranks[0][name + "_tokens"] == ranks[1][name + "_tokens"] == want_tokens, name
        assert got.shape == ref.shape and (got - ref).abs().max() < 1e-4, (name, float((got - ref).abs().max()))


@pytest.mark.parametrize(("tokens", "world", "want"), [(9, 2, 10), (8, 2, 8), (3, 4, 4), (1, 2, 2)])
def test_padded_len(tokens: int, world: int, want: int) -> None:
    from sglx.diffusion.parallel.sharding import padded_len

    assert padded_len(tokens, world) == want
