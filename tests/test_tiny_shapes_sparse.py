"""tiny-shapes with each sparse backend (CPU, masked-reference route) keeps the dense backend's attributes.

tiny-shapes' latent grid is 5x8x8 (320 tokens, 2 heads, 8 blocks, 16 steps). Each backend gets a config that is
really sparse on that grid (checked: every plan's block density is below 1 and most self-attention calls run
sparse), with a dense warm-up of 4 of the 16 steps where the backend has one (SVG2: its default 20%, 3 steps).
STA's FastVideo tile (6x8x8) would cover the whole grid, so the test uses 1x4x4 tiles (one 16-token block each,
no padding; the grid is 5x2x2 tiles) with a 3x2x2-tile window (each latent frame sees its neighbours): 60% of
the block pairs. The 12-prompt subset of tests/test_tiny_shapes.py,
measured with scripts/eval_tiny_shapes.py, is in docs/benchmarks.md; here one prompt the dense backend gets fully
right (a triangle, the shape the model finds hardest) keeps the test short: five engines, one clip each.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sglx.attention.diffusion.sparse.density import DensityRecorder
from sglx.diffusion.embedded import TINY_SHAPES
from sglx.diffusion.embedded import shapes_task as task

pytest.importorskip("diffusers")
pytestmark = pytest.mark.usefixtures("single_torch_thread")

PROMPTS = ("a yellow triangle moving down",)
MARGIN = 1  # attributes (of 3) a sparse backend may lose against the dense one on this prompt
CONFIGS = {
    "video_sparse_attn": "sparsity=0.5",
    "vmoba_attn": "first_full_step=4",
    "sparse_video_gen_2_attn": "num_q_centroids=16,num_k_centroids=32",
    "sliding_tile_attn": "mask_strategy_file_path={strategy},skip_time_steps=4",
}


def _judge(backend: str, config: str | None) -> tuple[int, dict | None]:
    from sglx.diffusion.engine import DiffusionEngine
    from sglx.diffusion.request import DiffusionRequest
    from sglx.llm.engine_config import EngineConfig

    engine = DiffusionEngine(EngineConfig(model_path=TINY_SHAPES, device="cpu", attention_backend=backend,
                                          attention_backend_config=config))
    try:
        recorder = DensityRecorder(engine.pipeline.backend)
        right = 0
        for prompt in PROMPTS:
            with recorder.recording():
                frames = engine.generate(DiffusionRequest(prompt=prompt)).frames
            right += sum(task.score(task.parse_prompt(prompt), task.judge(frames), frames.shape[0]).values())
        return right, recorder.summary()
    finally:
        engine.close()


@pytest.fixture(scope="module")
def dense_right() -> int:
    right, density = _judge("torch_sdpa", None)
    assert density is None and right == 3 * len(PROMPTS)  # fully right densely: the baseline has room to lose
    return right


@pytest.mark.parametrize("backend", list(CONFIGS))
def test_sparse_backend_keeps_the_dense_attributes(backend: str, dense_right: int, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from sglx.attention.diffusion.sparse.sliding_tile import SlidingTileAttentionBackend
    from sglx.attention.diffusion.sparse.sta_strategy import write_uniform_strategy

    monkeypatch.setattr(SlidingTileAttentionBackend, "default_tile", (1, 4, 4))
    strategy = write_uniform_strategy(tmp_path / "sta.json", 8, 2, (3, 2, 2))
    right, density = _judge(backend, CONFIGS[backend].format(strategy=strategy))
    assert density is not None and density["sparse_calls"] >= 0.75 * density["calls"], density
    assert density["max"] < 1.0 and density["mean"] < 0.7, density  # really sparse on this grid
    assert right >= dense_right - MARGIN, (backend, right, dense_right, density)
