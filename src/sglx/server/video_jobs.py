"""Video jobs of /v1/videos: their lifecycle (queued -> in_progress -> completed | failed) and storage.

Finished videos (MP4 bytes) stay in memory until deleted; beyond MAX_FINISHED_VIDEOS the oldest
finished ones are dropped, so a long-running server does not grow without bound.
"""

from __future__ import annotations

import collections
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from sglx.server.diffusion_queue import Job
from sglx.server.errors import APIError

MAX_FINISHED_VIDEOS = 64
FINISHED = ("completed", "failed")


@dataclass(eq=False)
class VideoJob:
    """One video: what was asked (resolved), where it stands, and its MP4 once completed."""

    model: str
    prompt: str
    width: int
    height: int
    num_frames: int
    fps: int
    seed: int
    id: str = field(default_factory=lambda: "video_" + secrets.token_hex(12))
    created_at: int = field(default_factory=lambda: int(time.time()))
    status: str = "queued"
    progress: int = 0
    completed_at: int | None = None
    error: dict[str, Any] | None = None
    content: bytes | None = None
    job: Job | None = None

    @property
    def seconds(self) -> str:
        """The clip's length: num_frames / fps, as OpenAI's string field (e.g. "4.06" for 65 frames at 16 fps)."""
        return f"{round(self.num_frames / self.fps, 2):g}"

    def step(self, done: int, total: int) -> None:
        """Progress from the denoising steps (called in the worker thread); 100 only once the MP4 is ready."""
        self.status = "in_progress"
        self.progress = min(99, int(100 * done / max(total, 1)))

    def complete(self, content: bytes) -> None:
        self.content, self.status, self.progress = content, "completed", 100
        self.completed_at = int(time.time())

    def fail(self, code: str, message: str) -> None:
        self.status, self.error = "failed", {"code": code, "message": message}
        self.completed_at = int(time.time())

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "object": "video", "status": self.status, "progress": self.progress,
                "created_at": self.created_at, "completed_at": self.completed_at, "expires_at": None,
                "model": self.model, "prompt": self.prompt, "size": f"{self.width}x{self.height}",
                "seconds": self.seconds, "error": self.error, "remixed_from_video_id": None,
                # extensions: what was actually run
                "num_frames": self.num_frames, "fps": self.fps, "seed": self.seed}


class VideoStore:
    """Video jobs by id, in creation order."""

    def __init__(self, max_finished: int = MAX_FINISHED_VIDEOS) -> None:
        self.max_finished = max_finished
        self.jobs: collections.OrderedDict[str, VideoJob] = collections.OrderedDict()

    def add(self, video: VideoJob) -> None:
        self.jobs[video.id] = video
        self.evict()

    def get(self, video_id: str) -> VideoJob:
        video = self.jobs.get(video_id)
        if video is None:
            raise APIError(404, f"no video with id '{video_id}' (unknown, deleted, or dropped after "
                                f"{self.max_finished} newer finished videos)", "video_id", "video_not_found")
        return video

    def remove(self, video_id: str) -> VideoJob:
        video = self.get(video_id)
        del self.jobs[video_id]
        return video

    def page(self, after: str | None, limit: int, order: str) -> tuple[list[VideoJob], bool]:
        """OpenAI's cursor pagination: up to `limit` videos after the one with id `after`."""
        items = list(self.jobs.values())
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [v.id for v in items]
            if after not in ids:
                raise APIError(400, f"after: no video with id '{after}'", "after", "invalid_cursor")
            items = items[ids.index(after) + 1:]
        return items[:limit], len(items) > limit

    def counts(self) -> dict[str, int]:
        return dict(collections.Counter(v.status for v in self.jobs.values()))

    def evict(self) -> None:
        """Drop the oldest finished videos beyond max_finished (called when one is added or finishes)."""
        finished = [v for v in self.jobs.values() if v.status in FINISHED]
        for video in finished[:max(0, len(finished) - self.max_finished)]:
            del self.jobs[video.id]
