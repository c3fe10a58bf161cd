"""The tiny-shapes task: prompts, the clip renderer that makes training data, and the pixel checker.

One shape (circle, square, triangle) of one colour (red, green, blue, yellow) on black, 64x64 pixels,
moving left, right, up or down ("a red circle moving right"), or standing still ("a red circle").
The checker judges colour, shape and direction from uint8 frames alone, so a test of any attention
backend can tell whether the embedded model still draws what it was asked for. Pure numpy: the
training script, the tests and the checker need no torch from this module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

SHAPES = ("circle", "square", "triangle")
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255), "yellow": (255, 255, 0),
}
DIRECTIONS = ("left", "right", "up", "down")
STEP: dict[str, tuple[float, float]] = {"left": (-1.0, 0.0), "right": (1.0, 0.0), "up": (0.0, -1.0),
                                        "down": (0.0, 1.0)}  # (dx, dy) per unit of speed; y grows downwards
WORDS = ("a", *COLOURS, *SHAPES, "moving", *DIRECTIONS)
HEIGHT = WIDTH = 64
NUM_FRAMES = 17
SIZE_RANGE = (20.0, 26.0)  # shape extent in pixels (circle diameter, square side, triangle base and height);
# 12-18 px until session 7: a shape then spanned ~2x2 DiT tokens (8x8 px each) and the DiT rounded squares
SPEED_RANGE = (1.0, 1.5)  # pixels per frame (slower since session 7, so a bigger shape's track fits the frame)
MARGIN = 1.0

# Checker thresholds (see judge_frame): a pixel is "lit" when its brightest channel reaches LIT.
LIT = 100
MIN_PIXELS = 12
MAX_COLOUR_DISTANCE = 110.0
SQUARE_FILL = 0.875  # fill of the bounding box: square 1.0, circle pi/4 = 0.785, triangle 0.5
TRIANGLE_TOP = 0.38  # share of the shape's pixels in the top half of its box: triangle 0.25, others 0.5
STILL_PIXELS = 3.0  # a centroid that moves less than this over the clip is standing still


@dataclass(frozen=True)
class ShapeSpec:
    """What a prompt asks for; direction None means a still shape."""

    shape: str
    colour: str
    direction: str | None = None

    @property
    def prompt(self) -> str:
        base = f"a {self.colour} {self.shape}"
        return base if self.direction is None else f"{base} moving {self.direction}"


def motion_specs() -> list[ShapeSpec]:
    """The 48 moving prompts (3 shapes x 4 colours x 4 directions)."""
    return [ShapeSpec(s, c, d) for s in SHAPES for c in COLOURS for d in DIRECTIONS]


def still_specs() -> list[ShapeSpec]:
    """The 12 still prompts ("a blue square")."""
    return [ShapeSpec(s, c) for s in SHAPES for c in COLOURS]


def parse_prompt(prompt: str) -> ShapeSpec | None:
    """The spec a prompt of this grammar names, or None when it names no colour and shape."""
    words = prompt.lower().replace(",", " ").replace(".", " ").split()
    shape = next((w for w in words if w in SHAPES), None)
    colour = next((w for w in words if w in COLOURS), None)
    if shape is None or colour is None:
        return None
    direction = next((w for w in words if w in DIRECTIONS), None)
    return ShapeSpec(shape, colour, direction)


# ------------------------------------------------------------------------------------------ rendering


@dataclass(frozen=True)
class ClipParams:
    """Everything that fixes one rendered clip: the spec, size, start centre (x, y) and speed."""

    spec: ShapeSpec
    size: float
    x0: float
    y0: float
    speed: float


def random_params(spec: ShapeSpec, rng: np.random.Generator, num_frames: int = NUM_FRAMES,
                  height: int = HEIGHT, width: int = WIDTH) -> ClipParams:
    """A random size, speed and start position whose whole track stays inside the frame."""
    size = float(rng.uniform(*SIZE_RANGE))
    speed = float(rng.uniform(*SPEED_RANGE)) if spec.direction is not None else 0.0
    dx, dy = STEP[spec.direction] if spec.direction is not None else (0.0, 0.0)
    travel_x, travel_y = dx * speed * (num_frames - 1), dy * speed * (num_frames - 1)
    half = size / 2 + MARGIN

    def start(travel: float, extent: int) -> float:
        lo, hi = half - min(travel, 0.0), extent - half - max(travel, 0.0)
        return float(rng.uniform(lo, max(lo, hi)))

    return ClipParams(spec, size, start(travel_x, width), start(travel_y, height), speed)


def shape_mask(shape: str, cx: np.ndarray, cy: np.ndarray, size: float, height: int = HEIGHT,
               width: int = WIDTH) -> np.ndarray:
    """Boolean [N, H, W] masks of `shape` centred at each (cx[i], cy[i]) (pixel centres at i + 0.5)."""
    ys = np.arange(height, dtype=np.float32)[None, :, None] + 0.5 - np.asarray(cy, np.float32)[:, None, None]
    xs = np.arange(width, dtype=np.float32)[None, None, :] + 0.5 - np.asarray(cx, np.float32)[:, None, None]
    r = size / 2
    if shape == "circle":
        return xs * xs + ys * ys <= r * r
    if shape == "square":
        return (np.abs(xs) <= r) & (np.abs(ys) <= r)
    if shape == "triangle":  # apex up, base at the bottom: half-width grows from 0 to r over the height
        return (ys <= r) & (np.abs(xs) <= (ys + r) / 2)
    raise ValueError(f"unknown shape {shape!r}")


def render(params: ClipParams, num_frames: int = NUM_FRAMES, height: int = HEIGHT, width: int = WIDTH) -> np.ndarray:
    """uint8 [F, H, W, 3]: the shape in its colour on black, moving `speed` pixels a frame."""
    spec = params.spec
    dx, dy = STEP[spec.direction] if spec.direction is not None else (0.0, 0.0)
    t = np.arange(num_frames, dtype=np.float32)
    mask = shape_mask(spec.shape, params.x0 + dx * params.speed * t, params.y0 + dy * params.speed * t,
                      params.size, height, width)
    colour = np.asarray(COLOURS[spec.colour], np.uint8)
    return mask[..., None].astype(np.uint8) * colour


def render_random(spec: ShapeSpec, rng: np.random.Generator, num_frames: int = NUM_FRAMES) -> np.ndarray:
    return render(random_params(spec, rng, num_frames), num_frames)


# -------------------------------------------------------------------------------------------- checker


@dataclass(frozen=True)
class Judgement:
    """What the pixels show; None where they show nothing recognisable (direction None for one frame)."""

    colour: str | None
    shape: str | None
    direction: str | None  # one of DIRECTIONS, "still", or None


def _largest_component(mask: np.ndarray) -> np.ndarray:
    """The largest 4-connected component of each [H, W] mask in a [F, H, W] stack (label propagation)."""
    f, h, w = mask.shape
    big = np.iinfo(np.int64).max
    labels = np.where(mask, np.arange(f * h * w, dtype=np.int64).reshape(f, h, w), big)
    while True:
        best = labels.copy()
        best[:, 1:] = np.minimum(best[:, 1:], labels[:, :-1])
        best[:, :-1] = np.minimum(best[:, :-1], labels[:, 1:])
        best[:, :, 1:] = np.minimum(best[:, :, 1:], labels[:, :, :-1])
        best[:, :, :-1] = np.minimum(best[:, :, :-1], labels[:, :, 1:])
        best = np.where(mask, best, big)
        if np.array_equal(best, labels):
            break
        labels = best
    out = np.zeros_like(mask)
    for i in range(f):
        lab = labels[i][mask[i]]
        if lab.size:
            values, counts = np.unique(lab, return_counts=True)
            out[i] = labels[i] == values[np.argmax(counts)]
    return out


def _frame_shape(blob: np.ndarray) -> str | None:
    """circle | square | triangle from one frame's blob: fill of its box, and how top-heavy it is."""
    ys, xs = np.nonzero(blob)
    if ys.size < MIN_PIXELS:
        return None
    top, bottom, left, right = ys.min(), ys.max(), xs.min(), xs.max()
    fill = ys.size / float((bottom - top + 1) * (right - left + 1))
    mid = (top + bottom) / 2.0
    top_share = (np.count_nonzero(ys < mid) + 0.5 * np.count_nonzero(ys == mid)) / ys.size
    if top_share < TRIANGLE_TOP:
        return "triangle"
    return "square" if fill >= SQUARE_FILL else "circle"


def _vote(values: list[str | None]) -> str | None:
    seen = [v for v in values if v is not None]
    if not seen:
        return None
    names, counts = np.unique(np.asarray(seen), return_counts=True)
    return str(names[np.argmax(counts)])


def judge(frames: np.ndarray) -> Judgement:
    """Colour (mean of lit pixels, nearest named colour), shape (vote over frames), direction (centroid track)."""
    frames = np.asarray(frames)
    if frames.ndim == 3:
        frames = frames[None]
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"expected uint8 frames [F, H, W, 3], got shape {frames.shape}")
    lit = frames.max(axis=-1) >= LIT
    blobs = _largest_component(lit)
    colour = None
    if blobs.sum() >= MIN_PIXELS:
        mean = frames[blobs].astype(np.float64).mean(axis=0)
        names = list(COLOURS)
        dist = [float(np.linalg.norm(mean - np.asarray(COLOURS[n], np.float64))) for n in names]
        if min(dist) <= MAX_COLOUR_DISTANCE:
            colour = names[int(np.argmin(dist))]
    shape = _vote([_frame_shape(b) for b in blobs])
    return Judgement(colour, shape, _direction(blobs))


def _direction(blobs: np.ndarray) -> str | None:
    if blobs.shape[0] < 2:
        return None
    t, cx, cy = [], [], []
    for i, blob in enumerate(blobs):
        ys, xs = np.nonzero(blob)
        if ys.size >= MIN_PIXELS:
            t.append(i)
            cx.append(xs.mean())
            cy.append(ys.mean())
    if len(t) < 2:
        return None
    span = float(blobs.shape[0] - 1)
    dx = np.polyfit(t, cx, 1)[0] * span  # displacement over the clip from a least-squares track
    dy = np.polyfit(t, cy, 1)[0] * span
    if max(abs(dx), abs(dy)) < STILL_PIXELS:
        return "still"
    if abs(dx) >= abs(dy):
        return "right" if dx > 0 else "left"
    return "down" if dy > 0 else "up"


def score(spec: ShapeSpec, judgement: Judgement, num_frames: int) -> dict[str, bool]:
    """Attribute -> judged right. A clip is judged on colour, shape and (more than one frame) direction."""
    out = {"colour": judgement.colour == spec.colour, "shape": judgement.shape == spec.shape}
    if num_frames > 1:
        out["direction"] = judgement.direction == (spec.direction or "still")
    return out


def judge_moving_prompts(draw: Callable[[str], np.ndarray]) -> dict[str, list[bool]]:
    """Each attribute judged right or not for the 48 moving prompts, in `motion_specs` order, on the clips that
    `draw(prompt)` makes (the diffusion issue's 144-attribute criterion, shared by the tests)."""
    right: dict[str, list[bool]] = {"colour": [], "shape": [], "direction": []}
    for spec in motion_specs():
        for attr, ok in score(spec, judge(draw(spec.prompt)), NUM_FRAMES).items():
            right[attr].append(ok)
    return right
