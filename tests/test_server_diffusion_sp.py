"""`sglx serve --sp-size 2` with a diffusion model: a real server subprocess drives 2 gloo ranks on CPU.

Images through the official `openai` client must equal what DiffusionEngine makes in this process at SP 1 (one
uint8 step apart at most: two ranks add float32 partial sums in another order). A video job deleted while it
runs must stop every rank at the same step: the next image is still SP 1's picture (a rank left behind in a
collective would hang it or shift its steps). Then a follower rank is killed: /health answers 503 with the
failure's one line, requests fail with it, and the server still stops with no process left behind.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from diffusion_test_utils import make_tiny_wan
from server_test_utils import ServerProcess
from sglx.diffusion.engine import DiffusionEngine
from sglx.diffusion.request import DiffusionRequest
from sglx.llm.engine_config import EngineConfig
from test_server_diffusion import decode_png, one_thread, same_picture

ENGINE_ARGS = ("--dtype", "float32", "--device", "cpu")
FAST = {"num_inference_steps": 2}
pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")


@pytest.fixture(scope="module")
def wan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_tiny_wan(tmp_path_factory.mktemp("served_wan_sp") / "wan")
    (path / "sglx.json").write_text(json.dumps({"defaults": {"max_sequence_length": 16}}))  # fast text encoder
    return path


@pytest.fixture(scope="module")
def sp1(wan: Path) -> Iterator[DiffusionEngine]:
    with DiffusionEngine(EngineConfig(model_path=str(wan), dtype="float32", device="cpu")) as eng:
        yield eng


def test_sp2_server_images_equal_sp1_and_a_dead_rank_shows(wan: Path, sp1: DiffusionEngine, tmp_path: Path) -> None:
    server = ServerProcess(wan, "--sp-size", "2", log_dir=tmp_path, engine_args=ENGINE_ARGS).wait_ready(timeout=240)
    try:
        children = psutil.Process(server.proc.pid).children(recursive=True)
        _serve_and_cancel(server, sp1)
        _kill_a_rank(server, children)
    finally:
        server.stop(timeout=60)
    _, alive = psutil.wait_procs(children, timeout=15)
    assert not alive, alive  # no rank (or helper process) outlives the server
    assert "Traceback" not in server.log(), server.log()


def _serve_and_cancel(server: ServerProcess, sp1: DiffusionEngine) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=120)
    assert "sp 2 (ulysses 2 x ring 1)" in server.log()  # the banner names the split
    info = httpx.get(f"{server.base_url}/server_info", timeout=30).json()
    assert "sp 2" in json.dumps(info)

    def image(prompt: str, seed: int) -> object:
        resp = client.images.generate(prompt=prompt, size="32x16", extra_body={**FAST, "seed": seed})
        return decode_png(resp.data[0].b64_json or "")

    def reference(prompt: str, seed: int) -> object:
        with one_thread():
            req = DiffusionRequest(prompt, height=16, width=32, num_frames=1, seed=seed, **FAST)
            return sp1.generate(req).frames[0]

    got, want = image("a red circle moving right", 7), reference("a red circle moving right", 7)
    assert same_picture(got, want)  # type: ignore[arg-type]
    assert not same_picture(got, reference("a red circle moving right", 8))  # type: ignore[arg-type]

    # a long video job, deleted while it runs: every rank leaves it at the same step
    http = httpx.Client(base_url=server.base_url, timeout=60)
    video = http.post("/v1/videos", json={"prompt": "a blue square", "size": "32x16", "num_frames": 1,
                                          "num_inference_steps": 1000}).json()
    deadline = time.monotonic() + 60
    while http.get(f"/v1/videos/{video['id']}").json()["progress"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert http.get(f"/v1/videos/{video['id']}").json()["status"] == "in_progress"
    assert http.delete(f"/v1/videos/{video['id']}").status_code == 200
    got = image("a green triangle", 3)
    assert same_picture(got, reference("a green triangle", 3))  # type: ignore[arg-type]
    assert http.get("/health").status_code == 200


def _kill_a_rank(server: ServerProcess, children: list[psutil.Process]) -> None:
    """The follower rank killed while the server idles: /health answers 503 with the one line naming it, and a
    request fails with that line instead of hanging."""
    (rank1,) = [c for c in children if "spawn_main" in " ".join(c.cmdline())
                and "resource_tracker" not in " ".join(c.cmdline())]
    rank1.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 30
    resp = httpx.get(f"{server.base_url}/health", timeout=10)
    while resp.status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.1)
        resp = httpx.get(f"{server.base_url}/health", timeout=10)
    assert resp.status_code == 503, resp.text
    error = resp.json()["error"]
    assert "rank 1 of 2" in error and "SIGKILL" in error and "\n" not in error, error
    image = httpx.post(f"{server.base_url}/v1/images/generations", timeout=60,
                       json={"prompt": "a red circle", "size": "32x16", **FAST})
    assert image.status_code == 500 and "rank 1 of 2" in image.json()["error"]["message"], image.text

