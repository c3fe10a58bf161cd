"""POST /v1/images/generations: OpenAI's Images API (b64_json) on the diffusion engine.

n images are n generations with seeds seed, seed+1, ... (seed: the request's, else the server's
--random-seed), so image i of an n-image request equals a one-image request with seed + i. A video
model renders one frame. The request waits its turn in the generation queue.
"""

from __future__ import annotations

import asyncio
import base64
import time
from dataclasses import replace
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from sglx.diffusion.output import encode_frames
from sglx.errors import SglxError
from sglx.server.diffusion_protocol import ImageGenerationRequest
from sglx.server.diffusion_queue import JobCancelled, StepFn
from sglx.server.diffusion_requests import base_request, resolve
from sglx.server.diffusion_state import DiffusionServerState
from sglx.server.errors import APIError
from sglx.server.request_body import parse_body

SUFFIXES = {"png": ".png", "jpeg": ".jpg", "webp": ".webp"}


def _state(request: Request) -> DiffusionServerState:
    return request.app.state.sglx


async def run_job(state: DiffusionServerState, kind: str, work: Any) -> Any:
    """Queue `work`, wait for it; a client that goes away (or a shutdown) takes its job out of the queue."""
    job = state.queue.submit(kind, work)
    try:
        return await job.future
    except asyncio.CancelledError:
        state.queue.cancel(job, "the client went away")
        raise
    except JobCancelled as exc:
        raise APIError(503, f"the generation was cancelled: {exc}", code="server_shutdown") from None
    except SglxError as exc:
        raise APIError(500, f"the generation failed: {exc}", code="generation_failed") from None
    finally:
        if job.started is not None:
            state.metrics.queue_wait.observe(job.started - job.submitted)


async def generations(request: Request) -> Response:
    state = _state(request)
    body = await parse_body(request, ImageGenerationRequest)
    state.check_model(body.model)
    n = body.n or 1
    base = base_request(body, num_frames=1)
    resolved = resolve(state.engine, base, body.size)
    suffix = SUFFIXES[body.output_format or "png"]
    engine = state.engine

    def work(step: StepFn) -> list[tuple[Any, bytes]]:
        out = []
        for i in range(n):
            result = engine.generate(replace(base, seed=resolved.seed + i), step)
            out.append((result, encode_frames(result.frames, suffix)))
        return out

    results = await run_job(state, "image", work)
    for result, _ in results:
        state.metrics.record(result)
    state.metrics.images += len(results)
    data = [{"b64_json": base64.b64encode(content).decode("ascii"), "revised_prompt": None,
             "seed": result.request.seed} for result, content in results]
    return JSONResponse({"created": int(time.time()), "data": data, "size": f"{resolved.width}x{resolved.height}",
                         "output_format": body.output_format or "png"})
