"""`sglx serve` with a diffusion model, through the official `openai` client: images, video jobs, bad input, queueing.

A tiny random Wan pipeline is served by a real `python -m sglx serve` subprocess on loopback; images must equal
what DiffusionEngine.generate makes in this process with the same seed, videos must decode (PyAV) to the asked
frame count and size. The queue tests run the app in a thread over an engine whose generations wait on a gate,
so "one at a time", "waits its turn" and "queue full" are observed, not timed.
"""

from __future__ import annotations

import base64
import contextlib
import io
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from diffusion_test_utils import make_tiny_wan
from server_test_utils import ServerProcess, free_port
from sglx.diffusion.engine import DiffusionEngine
from sglx.diffusion.output import encode_frames
from sglx.diffusion.request import DiffusionRequest, DiffusionResult
from sglx.llm.engine_config import EngineConfig

KEY = "diffusion-key-0123"
AUTH = {"Authorization": f"Bearer {KEY}"}
NAME = "tiny-wan"
ENGINE_ARGS = ("--dtype", "float32", "--device", "cpu")
FAST = {"num_inference_steps": 2}
pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")


@pytest.fixture(scope="module")
def wan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_wan(tmp_path_factory.mktemp("served_wan") / "wan")


@pytest.fixture(scope="module")
def engine(wan: Path) -> Iterator[DiffusionEngine]:
    with DiffusionEngine(EngineConfig(model_path=str(wan), dtype="float32", device="cpu")) as eng:
        yield eng


@pytest.fixture(scope="module")
def server(wan: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(wan, "--api-key", KEY, "--served-model-name", NAME, log_dir=tmp_path_factory.mktemp("logs"),
                         engine_args=ENGINE_ARGS).wait_ready()
    yield proc
    assert proc.stop() == 0, proc.log()
    assert "Traceback" not in proc.log(), proc.log()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=120) as c:
        yield c


def same_picture(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal up to one uint8 step: two processes' float32 math may round a pixel apart; other seeds differ wildly."""
    return a.shape == b.shape and int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max()) <= 1


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """The server runs with OMP_NUM_THREADS=1; the reference does too, so float reductions add up alike."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def decode_png(b64: str) -> np.ndarray:
    image = Image.open(io.BytesIO(base64.b64decode(b64)))
    assert image.format == "PNG"
    return np.asarray(image.convert("RGB"))


def decode_mp4(data: bytes) -> np.ndarray:
    import av

    with av.open(io.BytesIO(data)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def error_of(exc: openai.APIStatusError) -> dict[str, Any]:
    body = exc.response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


# ------------------------------------------------------------------------------------------------------ images


def test_images_equal_the_engine_with_each_seed(client: openai.OpenAI, engine: DiffusionEngine) -> None:
    prompt = "a red circle moving right"
    resp = client.images.generate(model=NAME, prompt=prompt, n=2, size="32x16", response_format="b64_json",
                                  extra_body={**FAST, "seed": 7, "guidance_scale": 3.0})
    assert len(resp.data) == 2 and resp.created > 0
    images = [decode_png(d.b64_json or "") for d in resp.data]
    assert all(img.shape == (16, 32, 3) for img in images)  # size is WIDTHxHEIGHT
    with one_thread():
        refs = [engine.generate(DiffusionRequest(prompt, height=16, width=32, num_frames=1, seed=seed,
                                                 guidance_scale=3.0, **FAST)).frames[0] for seed in (7, 8)]
    for got, want in zip(images, refs):
        assert same_picture(got, want)
    assert not same_picture(images[0], images[1])  # n images: seeds 7 and 8


def test_image_defaults_to_b64_png_and_the_served_seed(client: openai.OpenAI, engine: DiffusionEngine) -> None:
    resp = client.images.generate(prompt="a blue square", size="16x16", extra_body=FAST)  # no model, no format
    (item,) = resp.data
    image = decode_png(item.b64_json or "")
    assert image.shape == (16, 16, 3)
    with one_thread():
        ref = engine.generate(DiffusionRequest("a blue square", height=16, width=16, num_frames=1, **FAST))
    assert same_picture(image, ref.frames[0])  # no seed: the server's --random-seed (0), as `sglx generate`


def test_image_output_format_jpeg(client: openai.OpenAI) -> None:
    resp = client.images.generate(prompt="a green triangle", size="16x16", extra_body={**FAST, "output_format": "jpeg"})
    assert Image.open(io.BytesIO(base64.b64decode(resp.data[0].b64_json or ""))).format == "JPEG"


# ------------------------------------------------------------------------------------------------------ videos


def poll(client: openai.OpenAI, video_id: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    video = client.videos.retrieve(video_id)
    seen = [video.progress]
    while video.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.05)
        video = client.videos.retrieve(video_id)
        seen.append(video.progress)
    assert seen == sorted(seen), seen  # progress never goes back
    return video


def test_video_create_poll_download(client: openai.OpenAI, engine: DiffusionEngine) -> None:
    prompt = "a yellow square moving up"
    video = client.videos.create(model=NAME, prompt=prompt, size="32x16", seconds="1",
                                 extra_body={**FAST, "fps": 8, "seed": 3})
    assert video.object == "video" and video.id.startswith("video_")
    assert video.status in ("queued", "in_progress") and video.error is None and video.completed_at is None
    assert video.size == "32x16" and video.model == NAME
    done = poll(client, video.id)
    assert done.status == "completed" and done.progress == 100 and done.completed_at >= done.created_at
    # 1 s at 8 fps = 8 frames -> the nearest count this model takes (2k+1; ties go longer): 9
    assert done.model_extra["num_frames"] == 9 and done.seconds == "1.12"
    frames = decode_mp4(client.videos.download_content(video.id).content)
    assert frames.shape == (9, 16, 32, 3)
    with one_thread():
        ref: DiffusionResult = engine.generate(DiffusionRequest(prompt, height=16, width=32, num_frames=9, fps=8,
                                                                seed=3, **FAST))
    # The same clip: the server's MP4 decodes like the engine's frames encoded here. Not pixel for pixel: one
    # uint8 step of difference in the server process's float math (its own thread count) changes x264's
    # choices. Another seed's clip is far off, so this still tells clips apart.
    def mean_diff(a: np.ndarray, b: np.ndarray) -> float:
        return float(np.abs(a.astype(np.int16) - b.astype(np.int16)).mean())

    same = mean_diff(frames, decode_mp4(encode_frames(ref.frames, ".mp4", 8)))
    other = engine.generate(DiffusionRequest(prompt, height=16, width=32, num_frames=9, fps=8, seed=4, **FAST))
    apart = mean_diff(frames, decode_mp4(encode_frames(other.frames, ".mp4", 8)))
    assert same < 5.0 and apart > 2 * same + 10, (same, apart)  # measured: 0 (usually) vs 24


def test_video_json_body_and_explicit_frames_win(http: httpx.Client) -> None:
    resp = http.post("/v1/videos", json={"prompt": "a red circle", "size": "16x16", "seconds": 4, "num_frames": 5,
                                         **FAST})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["num_frames"] == 5 and body["fps"] == 16 and body["seconds"] == "0.31"
    deadline = time.monotonic() + 60
    while body["status"] != "completed" and time.monotonic() < deadline:
        time.sleep(0.05)
        body = http.get(f"/v1/videos/{body['id']}").json()
        assert body["status"] != "failed", body
    content = http.get(f"/v1/videos/{body['id']}/content")
    assert content.status_code == 200 and content.headers["content-type"] == "video/mp4"
    assert decode_mp4(content.content).shape == (5, 16, 16, 3)


def test_video_list_and_delete(client: openai.OpenAI) -> None:
    video = client.videos.create(prompt="a blue circle", size="16x16", extra_body={**FAST, "num_frames": 1})
    poll(client, video.id)
    listed = [v.id for v in client.videos.list(limit=100)]
    assert listed[0] == video.id  # newest first
    assert video.id in [v.id for v in client.videos.list(order="asc", limit=100)]
    deleted = client.videos.delete(video.id)
    assert deleted.deleted and deleted.id == video.id
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(video.id)


# --------------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(("size", "words"), [("30x32", "multiple of 8"), ("big", "WIDTHxHEIGHT"),
                                             ("32x0", "positive"), ("99992x99992", "at most 4096")])
def test_bad_image_size(client: openai.OpenAI, size: str, words: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.images.generate(prompt="a red circle", size=size, extra_body=FAST)  # type: ignore[arg-type]
    err = error_of(info.value)
    assert err["param"] == "size" and words in err["message"], err


def test_url_response_format_is_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.images.generate(prompt="a red circle", size="16x16", response_format="url", extra_body=FAST)
    err = error_of(info.value)
    assert err["param"] == "response_format" and "b64_json" in err["message"], err


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"n": 11}, "n", "10"),
    ({"num_inference_steps": 0}, "num_inference_steps", "1"),
    ({"quality": "hd"}, "quality", "unsupported parameter"),
    ({"prompt": ""}, "prompt", "at least 1"),
    ({"model": "dall-e-3"}, "model", NAME),
])
def test_bad_image_fields(http: httpx.Client, body: dict[str, Any], param: str, words: str) -> None:
    resp = http.post("/v1/images/generations", json={"prompt": "a red circle", "size": "16x16", **body})
    assert resp.status_code in (400, 404), resp.text
    err = resp.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_bad_video_input(client: openai.OpenAI, http: httpx.Client) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.videos.create(prompt="a red circle", size="16x16", extra_body={**FAST, "num_frames": 4})
    err = error_of(info.value)  # this tiny VAE halves time: 2k+1 frames (Wan2.1's takes 4k+1)
    assert err["param"] == "num_frames" and "2k+1" in err["message"], err
    with pytest.raises(openai.BadRequestError) as info:
        client.videos.create(prompt="a red circle", size="16x16", seconds="soon")  # type: ignore[arg-type]
    assert error_of(info.value)["param"] == "seconds"
    with pytest.raises(openai.BadRequestError) as info:
        client.videos.create(prompt="a red circle", size="16x16", seconds="3600")  # type: ignore[arg-type]
    err = error_of(info.value)
    assert err["param"] == "seconds" and "at most 1025 frames" in err["message"], err
    resp = http.post("/v1/videos", files={"input_reference": ("ref.png", b"\x89PNG", "image/png")},
                     data={"prompt": "a red circle"})
    assert resp.status_code == 400 and "image-to-video" in resp.json()["error"]["message"], resp.text


def test_unknown_video_id(client: openai.OpenAI, http: httpx.Client) -> None:
    for call in (client.videos.retrieve, client.videos.download_content, client.videos.delete):
        with pytest.raises(openai.NotFoundError) as info:
            call("video_nope")
        assert error_of(info.value)["code"] == "video_not_found"
    assert http.get("/v1/videos", params={"limit": 0}).status_code == 400


def test_api_key_required_except_health(server: ServerProcess) -> None:
    nokey = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        nokey.images.generate(prompt="a red circle", size="16x16")
    with pytest.raises(openai.AuthenticationError):
        nokey.videos.create(prompt="a red circle")
    assert httpx.get(f"{server.base_url}/v1/videos/video_x").status_code == 401
    assert httpx.get(f"{server.base_url}/health").json() == {"status": "ok"}


def test_llm_routes_point_to_the_diffusion_api(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}])
    assert "/v1/images/generations" in error_of(info.value)["message"]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=NAME, prompt="hi")


def test_models_server_info_and_metrics(client: openai.OpenAI, http: httpx.Client, wan: Path) -> None:
    assert [m.id for m in client.models.list()] == [NAME]
    info = http.get("/server_info").json()
    assert info["kind"] == "diffusion" and info["model_path"] == str(wan)
    assert info["engine"]["attention_backend"] == "torch_sdpa" and info["server"]["api_key_required"]
    assert info["queue"]["max_queued"] == 64
    client.images.generate(prompt="a red square", size="16x16", extra_body=FAST)
    metrics = http.get("/metrics").text
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
              if line and not line.startswith("#")}
    assert values["sglx_diffusion_images_total"] >= 1
    assert values['sglx_diffusion_video_jobs_total{status="completed"}'] >= 1
    assert values["sglx_diffusion_step_seconds_count"] >= 2
    assert values['sglx_http_requests_total{method="POST",route="/v1/images/generations",status="200"}'] >= 1
    assert values['sglx_http_requests_total{method="GET",route="/v1/videos/{video_id}",status="200"}'] >= 1


def test_sigterm_while_generating_exits_cleanly(server: ServerProcess, client: openai.OpenAI) -> None:
    """Last in this module: a long job is running when the server is told to stop; it exits 0 promptly."""
    video = client.videos.create(prompt="a red circle", size="16x16", extra_body={"num_inference_steps": 1000,
                                                                                  "num_frames": 5})
    deadline = time.monotonic() + 30
    while client.videos.retrieve(video.id).status == "queued" and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(openai.APIStatusError) as info:
        client.videos.download_content(video.id)
    assert info.value.status_code == 409 and "in_progress" in error_of(info.value)["message"]
    start = time.monotonic()
    server.send_signal()
    assert server.proc.wait(30) == 0, server.log()
    assert time.monotonic() - start < 20


# ------------------------------------------------------------------------------------------------------- queue


class GatedEngine:
    """The real engine, but each generation waits for the gate; records the order and overlap of generations."""

    def __init__(self, engine: DiffusionEngine) -> None:
        self.engine = engine
        self.gate = threading.Event()
        self.order: list[str] = []
        self.active = 0
        self.max_active = 0
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def generate(self, request: DiffusionRequest, progress: Any = None) -> DiffusionResult:
        with self._lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
            self.order.append(request.prompt)
        try:
            assert self.gate.wait(60)
            return self.engine.generate(request, progress)
        finally:
            with self._lock:
                self.active -= 1


@contextlib.contextmanager
def serve_in_thread(engine: Any, **options: Any) -> Iterator[str]:
    """The diffusion app over `engine` in a uvicorn thread on a free loopback port; yields its base URL."""
    import uvicorn

    from sglx.server.config import ServerConfig
    from sglx.server.diffusion_app import create_diffusion_app

    port = free_port()
    app = create_diffusion_app(engine, ServerConfig(port=port, log_level="warning", **options))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture
def gated(engine: DiffusionEngine) -> Iterator[tuple[GatedEngine, str]]:
    gated_engine = GatedEngine(engine)
    try:
        with serve_in_thread(gated_engine, max_queued_requests=1) as base:
            yield gated_engine, base
    finally:
        gated_engine.gate.set()


def wait_for(predicate: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_one_generation_at_a_time_and_a_bounded_queue(gated: tuple[GatedEngine, str]) -> None:
    engine, base = gated
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
    first = client.videos.create(prompt="first", size="16x16", extra_body={**FAST, "num_frames": 1})
    wait_for(lambda: client.videos.retrieve(first.id).status == "in_progress")
    image: dict[str, Any] = {}
    waiter = threading.Thread(target=lambda: image.update(
        resp=client.images.generate(prompt="second", size="16x16", extra_body=FAST)))
    waiter.start()  # the image waits its turn behind the running video
    wait_for(lambda: "sglx_diffusion_queued_jobs 1" in httpx.get(f"{base}/metrics").text)
    with pytest.raises(openai.InternalServerError) as info:  # 503: one running, one waiting, limit 1
        client.videos.create(prompt="third", size="16x16", extra_body=FAST)
    assert info.value.status_code == 503 and error_of(info.value)["code"] == "queue_full"
    assert info.value.response.headers["retry-after"]
    with pytest.raises(openai.InternalServerError):
        client.images.generate(prompt="third", size="16x16", extra_body=FAST)
    assert httpx.get(f"{base}/health").status_code == 200  # the event loop stays free while the engine works
    assert engine.order == ["first"] and "resp" not in image
    engine.gate.set()
    waiter.join(60)
    assert len(image["resp"].data) == 1
    assert poll(client, first.id).status == "completed"
    assert engine.order == ["first", "second"] and engine.max_active == 1


def test_deleting_queued_and_running_videos_cancels_them(gated: tuple[GatedEngine, str]) -> None:
    engine, base = gated
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
    running = client.videos.create(prompt="running", size="16x16", extra_body={**FAST, "num_frames": 1})
    wait_for(lambda: client.videos.retrieve(running.id).status == "in_progress")
    queued = client.videos.create(prompt="queued", size="16x16", extra_body={**FAST, "num_frames": 1})
    with pytest.raises(openai.APIStatusError) as info:
        client.videos.download_content(queued.id)
    assert info.value.status_code == 409 and "queued" in error_of(info.value)["message"]
    assert client.videos.delete(queued.id).deleted
    assert client.videos.delete(running.id).deleted
    engine.gate.set()  # the running job stops at its first step
    wait_for(lambda: 'sglx_diffusion_video_jobs_total{status="cancelled"} 2' in httpx.get(f"{base}/metrics").text)
    assert engine.order == ["running"]
    after = client.videos.create(prompt="after", size="16x16", extra_body={**FAST, "num_frames": 1})
    assert poll(client, after.id).status == "completed"


def test_serve_flags_for_the_wrong_model_kind() -> None:
    from typer.testing import CliRunner

    from sglx.cli.app import app

    result = CliRunner().invoke(app, ["serve", "--backend", "diffusers", "--max-queued-requests", "3"])
    assert result.exit_code == 2
    assert "--backend, --max-queued-requests only apply to diffusion models" in result.output


def test_image_model_serves_images_and_refuses_videos(tmp_path: Path) -> None:
    from diffusion_test_utils import make_tiny_flux

    flux = make_tiny_flux(tmp_path / "flux")
    with DiffusionEngine(EngineConfig(model_path=str(flux), dtype="float32", device="cpu")) as eng, \
            serve_in_thread(eng) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
        resp = client.images.generate(prompt="a red circle", size="32x16", extra_body={**FAST, "seed": 1})
        with one_thread():
            ref = eng.generate(DiffusionRequest("a red circle", height=16, width=32, num_frames=1, seed=1, **FAST))
        assert same_picture(decode_png(resp.data[0].b64_json or ""), ref.frames[0])
        with pytest.raises(openai.BadRequestError) as info:
            client.videos.create(prompt="a red circle", size="32x16")
        assert "/v1/images/generations" in error_of(info.value)["message"]


class FailingEngine:
    """The real engine for validation, but every generation fails as an out-of-memory would."""

    def __init__(self, engine: DiffusionEngine) -> None:
        self.engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def generate(self, request: DiffusionRequest, progress: Any = None) -> DiffusionResult:
        from sglx.errors import SglxError

        raise SglxError("out of GPU memory at 1x16x16: lower --height/--width/--num-frames, or free the GPU")


def test_failed_generations_are_reported_not_raised(engine: DiffusionEngine) -> None:
    with serve_in_thread(FailingEngine(engine)) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
        with pytest.raises(openai.InternalServerError) as info:
            client.images.generate(prompt="a red circle", size="16x16")
        err = error_of(info.value)
        assert err["code"] == "generation_failed" and "out of GPU memory" in err["message"], err
        video = client.videos.create(prompt="a red circle", size="16x16", extra_body={"num_frames": 1})
        done = poll(client, video.id)
        assert done.status == "failed" and done.error is not None
        assert done.error.code == "generation_failed" and "out of GPU memory" in done.error.message
        with pytest.raises(openai.APIStatusError) as info:
            client.videos.download_content(video.id)
        assert info.value.status_code == 409 and "failed" in error_of(info.value)["message"]
        # a urlencoded form works too, and the server keeps serving after failures
        resp = httpx.post(f"{base}/v1/videos", data={"prompt": "a red circle", "size": "16x16", "num_frames": "1"})
        assert resp.status_code == 200 and resp.json()["num_frames"] == 1, resp.text
        assert httpx.get(f"{base}/health").status_code == 200


def test_serve_hands_diffusion_models_to_the_diffusion_server(wan: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    import sglx.server.runner as runner
    from sglx.cli.app import app

    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(runner, "run_diffusion_server", lambda *args: calls.append(args) or 0)
    result = CliRunner().invoke(app, ["serve", "--model-path", str(wan), "--backend", "diffusers",
                                      "--max-queued-requests", "0", "--attention-backend", "native"])
    assert result.exit_code == 0, result.output
    ((engine_config, config, backend),) = calls
    assert backend == "diffusers" and config.max_queued_requests == 0
    assert engine_config.model_path == str(wan) and engine_config.attention_backend == "native"
    result = CliRunner().invoke(app, ["serve", "--model-path", str(wan), "--max-queued-requests", "-1"])
    assert result.exit_code == 2 and "--max-queued-requests -1: must be >= 0" in result.output
