"""The video API, shaped like OpenAI's (Sora) Videos API: jobs that are created, polled and downloaded.

POST /v1/videos answers at once with the job (status "queued"); the generation queue runs it, its
progress follows the denoising steps, and GET /v1/videos/{id}/content returns the MP4 once completed.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from sglx.diffusion.output import encode_frames
from sglx.errors import SglxError
from sglx.server.diffusion_protocol import VideoCreateRequest
from sglx.server.diffusion_queue import JobCancelled, StepFn
from sglx.server.diffusion_requests import resolve, video_request
from sglx.server.diffusion_state import DiffusionServerState
from sglx.server.errors import APIError, bad_request
from sglx.server.form_body import parse_json_or_form
from sglx.server.request_body import validate_body
from sglx.server.video_jobs import VideoJob

log = logging.getLogger("sglx.server")
MAX_LIST_LIMIT = 100


def _state(request: Request) -> DiffusionServerState:
    return request.app.state.sglx


def _finished(state: DiffusionServerState, video: VideoJob, future: asyncio.Future[Any]) -> None:
    """The job's future completed (on the event loop): record the outcome on the video and in the metrics."""
    job = video.job
    if job is not None and job.started is not None:
        state.metrics.queue_wait.observe(job.started - job.submitted)
    exc = JobCancelled("cancelled") if future.cancelled() else future.exception()
    if exc is None:
        result, content = future.result()
        video.complete(content)
        state.metrics.record(result)
        state.metrics.video_jobs["completed"] += 1
    elif isinstance(exc, JobCancelled):
        video.fail("cancelled", f"the video was cancelled: {exc}")
        state.metrics.video_jobs["cancelled"] += 1
    else:
        if not isinstance(exc, SglxError):
            log.error("video %s failed", video.id, exc_info=exc)
        message = str(exc) if isinstance(exc, SglxError) else f"internal error: {type(exc).__name__}: {exc}"
        video.fail("generation_failed", message)
        state.metrics.video_jobs["failed"] += 1
    video.job = None
    state.videos.evict()


async def create(request: Request) -> Response:
    state = _state(request)
    data, is_form = await parse_json_or_form(request)
    body = validate_body(VideoCreateRequest, data, lax=is_form)
    state.check_model(body.model)
    engine = state.engine
    req = video_request(engine, body)
    resolved = resolve(engine, req, body.size)
    video = VideoJob(model=state.model_name, prompt=body.prompt, width=resolved.width, height=resolved.height,
                     num_frames=resolved.num_frames, fps=resolved.fps, seed=resolved.seed)

    def work(step: StepFn) -> tuple[Any, bytes]:
        video.status = "in_progress"
        result = engine.generate(req, step)
        return result, encode_frames(result.frames, ".mp4", result.request.fps)

    video.job = state.queue.submit("video", work, on_step=video.step)  # 503 when the queue is full
    state.videos.add(video)
    video.job.future.add_done_callback(lambda fut: _finished(state, video, fut))
    return JSONResponse(video.to_dict())


async def retrieve(request: Request, video_id: str) -> Response:
    return JSONResponse(_state(request).videos.get(video_id).to_dict())


async def content(request: Request, video_id: str) -> Response:
    video = _state(request).videos.get(video_id)
    variant = request.query_params.get("variant", "video")
    if variant != "video":
        raise bad_request(f"variant '{variant}' is not available: this server stores the video only "
                          "(variant=video)", "variant", "invalid_value")
    if video.status != "completed" or video.content is None:
        detail = (f"it failed: {video.error['message']}" if video.status == "failed" and video.error
                  else f"it is {video.status} ({video.progress}%); poll GET /v1/videos/{video_id} until its status "
                       "is completed")
        raise APIError(409, f"video {video_id} has no content: {detail}", "video_id", "video_not_ready")
    return Response(video.content, media_type="video/mp4",
                    headers={"Content-Disposition": f'attachment; filename="{video_id}.mp4"'})


def _int_query(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise bad_request(f"{name}: must be an integer (got {raw!r})", name, "invalid_value") from None
    if not low <= value <= high:
        raise bad_request(f"{name}: must be in {low}..{high} (got {value})", name, "invalid_value")
    return value


async def list_videos(request: Request) -> Response:
    state = _state(request)
    limit = _int_query(request, "limit", 20, 1, MAX_LIST_LIMIT)
    order = request.query_params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request(f"order: must be 'asc' or 'desc' (got {order!r})", "order", "invalid_value")
    page, has_more = state.videos.page(request.query_params.get("after"), limit, order)
    data = [v.to_dict() for v in page]
    return JSONResponse({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                         "last_id": data[-1]["id"] if data else None, "has_more": has_more})


async def delete(request: Request, video_id: str) -> Response:
    """Forget the video; a queued or running one is cancelled first (a running one stops at its next step)."""
    state = _state(request)
    video = state.videos.remove(video_id)
    if video.job is not None:
        state.queue.cancel(video.job, "it was deleted")
    return JSONResponse({"id": video_id, "object": "video.deleted", "deleted": True})
