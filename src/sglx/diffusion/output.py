"""Write generated frames to PNG / JPEG / WebP (stills), MP4 or GIF, chosen by the output file's suffix.

Files are written to a temporary name beside the target and renamed into place, so a failure never
leaves a half-written output.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import numpy as np

from sglx.errors import SglxError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
VIDEO_SUFFIXES = (".mp4", ".gif")
SUFFIXES = IMAGE_SUFFIXES + VIDEO_SUFFIXES


def check_output_path(path: str | Path, num_frames: int | None = None) -> Path:
    """Validate an --output path before any work: known suffix, stills for one frame, a writable folder."""
    out = Path(path).expanduser()
    suffix = out.suffix.lower()
    if suffix not in SUFFIXES:
        raise SglxError(f"--output {path}: unknown format {suffix or '(no suffix)'!r}; use one of "
                        f"{', '.join(SUFFIXES)}")
    if suffix in IMAGE_SUFFIXES and num_frames is not None and num_frames > 1:
        raise SglxError(f"--output {path}: a {suffix} holds one image but {num_frames} frames were asked for; "
                        "use .mp4 or .gif, or --num-frames 1")
    if out.parent.exists() and not out.parent.is_dir():
        raise SglxError(f"--output {path}: {out.parent} is not a directory")
    return out


def default_suffix(num_frames: int) -> str:
    return ".png" if num_frames == 1 else ".mp4"


def _write_video_mp4(frames: np.ndarray, target: str, fps: int) -> None:
    try:
        import av
    except ImportError as exc:  # pragma: no cover - av is a dependency
        raise SglxError("writing .mp4 needs PyAV (pip install av)") from exc
    height, width = frames.shape[1:3]
    with av.open(target, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height = width + width % 2, height + height % 2
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "12"}
        for frame in frames:
            if frame.shape[0] % 2 or frame.shape[1] % 2:  # yuv420p needs even sides: repeat the last row/column
                frame = np.pad(frame, ((0, frame.shape[0] % 2), (0, frame.shape[1] % 2), (0, 0)), mode="edge")
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def _write(frames: np.ndarray, target: str, suffix: str, fps: int) -> None:
    from PIL import Image

    if suffix in IMAGE_SUFFIXES:
        kind = {".jpg": "JPEG", ".jpeg": "JPEG"}.get(suffix, suffix[1:].upper())
        Image.fromarray(frames[0]).save(target, format=kind)
    elif suffix == ".gif":
        images = [Image.fromarray(f) for f in frames]
        images[0].save(target, format="GIF", save_all=True, append_images=images[1:], duration=round(1000 / fps),
                       loop=0)
    else:
        _write_video_mp4(frames, target, fps)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_frames(frames: np.ndarray, path: str | Path, fps: int = 16) -> Path:
    """Write uint8 frames [F, H, W, 3] to `path` atomically; returns the path written."""
    out = check_output_path(path, frames.shape[0])
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=out.suffix, dir=out.parent)
    os.close(fd)
    try:
        _write(frames, tmp, out.suffix.lower(), fps)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; a written file gets the usual permissions
        os.replace(tmp, out)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return out


def encode_frames(frames: np.ndarray, suffix: str, fps: int = 16) -> bytes:
    """The file bytes `write_frames` would write, for the HTTP server."""
    with tempfile.TemporaryDirectory() as tmp:
        path = write_frames(frames, Path(tmp) / f"out{suffix}", fps)
        return path.read_bytes()
