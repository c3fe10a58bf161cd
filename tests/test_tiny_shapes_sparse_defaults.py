"""tiny-shapes with every sparse backend at its default configuration meets the diffusion issue's 95%.

The diffusion issue's criterion, exactly, for the sparse backends: all 48 moving prompts at the model's defaults
(seed 0, CPU float32, one thread, the masked-reference route), colour, shape and direction judged by the pixel
checker, at least 95% of the 144 attributes right. At the registry defaults on tiny-shapes' 5x8x8 grid,
vmoba_attn runs sparse in its last 4 of 16 steps (density about 0.46) and sparse_video_gen_2_attn after its
3 warm-up steps (about 0.73); video_sparse_attn (sparsity 0) and sliding_tile_attn (FastVideo's 6x8x8 tile covers
the grid) stay dense here, and the test checks that too, so a change of defaults shows up. sliding_tile_attn has
no default mask strategy (its file is required): it gets a uniform one of 1x1x1 tiles (the grid is one tile),
every other key at its default. tests/test_tiny_shapes_sparse.py runs each backend really sparse on one
prompt. About 1 s a clip (SVG2: 4 s, its k-means).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sglx.attention.diffusion.sparse.density import DensityRecorder
from sglx.diffusion.embedded import TINY_SHAPES
from sglx.diffusion.embedded import shapes_task as task

pytest.importorskip("diffusers")
pytestmark = pytest.mark.usefixtures("single_torch_thread")

# backend -> (runs sparse at its defaults on this grid, share of self-attention calls that run sparse)
SPARSE_AT_DEFAULTS = {
    "vmoba_attn": (True, 0.25),  # first_full_step 12 of 16 steps
    "sparse_video_gen_2_attn": (True, 0.8125),  # first_times_fp 0.2 (3 of 16 steps) and first_layers_fp 0.03 (0)
    "video_sparse_attn": (False, 0.0),
    "sliding_tile_attn": (False, None),
}


@pytest.mark.parametrize("backend", list(SPARSE_AT_DEFAULTS))
def test_sparse_backend_at_its_defaults_meets_the_95_percent_target(backend: str, tmp_path: Path) -> None:
    from sglx.attention.diffusion.sparse.sta_strategy import write_uniform_strategy
    from sglx.diffusion.engine import DiffusionEngine
    from sglx.diffusion.request import DiffusionRequest
    from sglx.llm.engine_config import EngineConfig

    config = None
    if backend == "sliding_tile_attn":
        config = f"mask_strategy_file_path={write_uniform_strategy(tmp_path / 'sta.json', 8, 2, (1, 1, 1))}"
    engine = DiffusionEngine(EngineConfig(model_path=TINY_SHAPES, device="cpu", attention_backend=backend,
                                          attention_backend_config=config))
    try:
        assert engine.attention.name == backend
        recorder = DensityRecorder(engine.pipeline.backend)
        with recorder.recording():
            right = task.judge_moving_prompts(lambda prompt: engine.generate(DiffusionRequest(prompt=prompt)).frames)
        density = recorder.summary()
    finally:
        engine.close()
    sparse, share = SPARSE_AT_DEFAULTS[backend]
    if sparse:
        assert density is not None and density["sparse_calls"] == pytest.approx(share * density["calls"]), density
        assert density["mean"] < 0.8, density
    else:
        assert density is None or density.get("all_dense", density["sparse_calls"] == 0), density
    flat = [ok for oks in right.values() for ok in oks]
    assert len(flat) == 144 and sum(flat) >= 0.95 * len(flat), (backend, {a: sum(v) for a, v in right.items()})
