"""/metrics of a diffusion server: HTTP counters, images made, video jobs by status, step and queue latency.

Updated only on the event loop (job results are recorded when their future completes there).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from sglx.diffusion.request import DiffusionResult
from sglx.server.metrics import E2E_BUCKETS, Histogram, HttpMetrics, PromText

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
VIDEO_STATUSES = ("queued", "in_progress", "completed", "failed")


class DiffusionMetrics(HttpMetrics):
    def __init__(self) -> None:
        super().__init__()
        self.images = 0
        self.video_jobs: Counter[str] = Counter()  # finished video jobs by final status
        self.step = Histogram(STEP_BUCKETS)
        self.generation = Histogram(E2E_BUCKETS)
        self.queue_wait = Histogram(E2E_BUCKETS)

    def record(self, result: DiffusionResult) -> None:
        """One finished generation: its mean denoising step and its engine time."""
        steps = max(result.request.num_inference_steps, 1)
        self.step.observe(result.timings.denoise / steps)
        self.generation.observe(result.timings.total)

    def render(self, queued: int, running: int, videos_now: Mapping[str, int]) -> str:
        out = PromText()
        self.render_http(out)
        out.value("sglx_diffusion_images_total", "counter", "Images generated (n per request).", self.images)
        out.head("sglx_diffusion_video_jobs_total", "counter", "Finished video jobs by final status.")
        for status in ("completed", "failed", "cancelled"):
            out.lines.append(f'sglx_diffusion_video_jobs_total{{status="{status}"}} {self.video_jobs[status]}')
        out.head("sglx_diffusion_video_jobs", "gauge", "Video jobs held by the server now, by status.")
        for status in VIDEO_STATUSES:
            out.lines.append(f'sglx_diffusion_video_jobs{{status="{status}"}} {videos_now.get(status, 0)}')
        out.value("sglx_diffusion_queued_jobs", "gauge", "Generation jobs waiting for the engine.", queued)
        out.value("sglx_diffusion_running_jobs", "gauge", "Generation jobs running now (at most 1).", running)
        out.histogram("sglx_diffusion_step_seconds", "Mean denoising step time of each generation.", self.step)
        out.histogram("sglx_diffusion_generation_seconds", "Engine time of each generation (text encode + "
                      "denoise + VAE decode).", self.generation)
        out.histogram("sglx_diffusion_queue_wait_seconds", "Time a job waited before the engine took it.",
                      self.queue_wait)
        return out.text()
