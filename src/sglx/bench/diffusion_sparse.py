"""`sglx bench diffusion --attention-backend ...`: sparse and dense DiT backends side by side on one canvas.

One self-attention call of a video DiT on a chosen latent canvas (T x H x W tokens after patchify, optional
joint text prefix), with step metadata past every warm-up (step `num_steps - 1`, a chosen layer), so a sparse
backend runs its sparse path. q and k are clustered (tokens scattered around a few centres per head, as real
DiT activations are) so data-dependent selection (VSA, VMoBA, SVG2) has structure to find; v is Gaussian.

Rows, all on the same numbers in one process:
- each requested backend through `forward` with its `--attention-backend-config` (registry-validated);
- dense baselines: SDPA pinned to cuDNN, SDPA flash and FA4 direct on CUDA (`sglx.bench.diffusion`), plain
  SDPA elsewhere;
- per sparse backend, anchors at the same mask: FlexAttention with the backend's layout as its block mask on
  the backend's permuted tokens (kernel only, no reordering), and upstream fastvideo-kernel (STA on its three
  canvases, VSA) where it imports.
Each output is checked on sampled query rows against float64: `err` = max |out - float64 attention under the
mask the backend's own plan chose| (correctness; a row over tolerance is not timed) and `rel err vs dense` =
||out - dense float64|| / ||dense float64|| on those rows (what the sparsity costs on these inputs).
`density` = share of (query block, key block) pairs computed. `x dense` = dense baseline time / this time,
the baseline being cuDNN SDPA on CUDA, SDPA elsewhere.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

from sglx.attention.checks import TOLERANCE, tolerance
from sglx.attention.diffusion.metadata import DiTAttnMetadata
from sglx.attention.registry import all_backends, availability, find
from sglx.attention.request import AttentionRequest
from sglx.bench.diffusion import DTYPES, SAMPLED_ROWS, sampled_reference
from sglx.bench.sparse_plan import PlanView, from_slots, masked_rows_reference, plan_view, rows_mask, to_slots
from sglx.bench.timing import TimingBudget, median_ms
from sglx.errors import ConfigError, SglxError

DENSE_BASELINE = {"cuda": "sdpa cudnn", "cpu": "sdpa"}


@dataclass(frozen=True)
class BackendRequest:
    """One backend of the comparison and its `--attention-backend-config` text (None: registry defaults)."""

    name: str
    config: str | None = None

    @property
    def label(self) -> str:
        return self.name + (f" [{self.config}]" if self.config else "")


@dataclass(frozen=True)
class SparseCompareConfig:
    canvas: tuple[int, int, int]  # latent token grid (T, H, W) after patchify
    backends: tuple[BackendRequest, ...]
    heads: int = 12
    head_dim: int = 128
    text_tokens: int = 0  # joint text tokens before the video tokens (MM-DiT); 0: none
    batch: int = 1
    num_steps: int = 50  # the call is step num_steps - 1 (past every warm-up) ...
    num_layers: int = 30
    layer: int | None = None  # ... of this layer (default: the last one)
    dtype: str | None = None  # CUDA bfloat16, elsewhere float32
    baselines: bool = True  # dense cuDNN/flash/FA4 (CUDA) or SDPA (elsewhere); the dense one for `x dense` stays
    anchors: bool = True  # FlexAttention and upstream fastvideo-kernel at each sparse backend's mask
    rows: int = SAMPLED_ROWS
    centres: int = 64  # clusters of q and k per head
    # std of the logits q.k/sqrt(D) of the synthetic inputs: top-p selection (SVG2) keeps more blocks when they
    # are flat (std 1: density 0.53 on Wan-1.3B's canvas; 5, what benchmarks/bench_sparse_backends.py feeds: 0.084)
    logit_std: float = 1.0
    warmup_ms: float | None = None
    rep_ms: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if len(self.canvas) != 3 or min(self.canvas) < 1:
            raise SglxError(f"--canvas {'x'.join(map(str, self.canvas))}: give three positive sizes T x H x W")
        if self.heads < 1 or self.head_dim < 1 or self.batch < 1 or self.text_tokens < 0:
            raise SglxError("--heads, --head-dim and the batch must be positive and --text-tokens at least 0")
        if not self.backends:
            raise SglxError("--attention-backend: name at least one backend to compare")
        if not self.logit_std > 0:
            raise SglxError(f"--logit-std {self.logit_std}: give a positive spread of the synthetic logits, "
                            "e.g. 1 or 5")
        if self.num_steps < 1 or self.num_layers < 1:
            raise SglxError("--num-steps and --num-layers (sparse comparison) must be positive")
        if self.layer is not None and not 0 <= self.layer < self.num_layers:
            raise SglxError(f"--layer {self.layer}: choose 0 .. {self.num_layers - 1} (--num-layers "
                            f"{self.num_layers})")

    @property
    def tokens(self) -> int:
        t, h, w = self.canvas
        return t * h * w + self.text_tokens

    def metadata(self) -> DiTAttnMetadata:
        return DiTAttnMetadata(grid=self.canvas, num_heads=self.heads, head_dim=self.head_dim,
                               text_tokens=self.text_tokens, text_position="prefix" if self.text_tokens else "none",
                               batch_size=self.batch, step_index=self.num_steps - 1, num_steps=self.num_steps,
                               num_layers=self.num_layers)

    def budget(self, device: torch.device) -> TimingBudget:
        cpu = device.type != "cuda"
        return TimingBudget(warmup_ms=self.warmup_ms if self.warmup_ms is not None else (5.0 if cpu else 100.0),
                            rep_ms=self.rep_ms if self.rep_ms is not None else (20.0 if cpu else 1000.0),
                            min_runs=3 if cpu else 10, max_runs=50 if cpu else 200)


def canvas_from_video(frames: int, height: int, width: int) -> tuple[int, int, int]:
    """Wan's latent grid for a video: VAE 4x in time (4k+1 frames), 8x in space, then 1x2x2 patches."""
    if (frames - 1) % 4 or height % 16 or width % 16:
        raise SglxError(f"{frames}x{height}x{width}: Wan's canvas needs 4k+1 frames and height/width multiples of "
                        "16; or give the latent grid with --canvas TxHxW")
    return (frames - 1) // 4 + 1, height // 16, width // 16


def parse_canvas(text: str) -> tuple[int, int, int]:
    parts = text.lower().replace(",", "x").split("x")
    try:
        sizes = tuple(int(p) for p in parts)
    except ValueError:
        sizes = ()
    if len(sizes) != 3 or min(sizes) < 1:
        raise SglxError(f"--canvas {text}: give the latent token grid as TxHxW, e.g. 18x48x80")
    return sizes  # type: ignore[return-value]


def pair_backends(names: list[str], configs: list[str]) -> tuple[BackendRequest, ...]:
    """`--attention-backend` values (repeatable, comma lists) with their `--attention-backend-config` values.

    A config may name its backend (`video_sparse_attn:sparsity=0.875`); unnamed ones pair by position with the
    backends in the order given. Several runs of one backend with different configs are fine."""
    flat = [n.strip() for value in names for n in value.split(",") if n.strip()]
    if not flat:
        raise SglxError("--attention-backend: name at least one backend to compare (--canvas and "
                        "--attention-backend-config belong to the sparse comparison)")
    out: list[BackendRequest | None] = [None] * len(flat)
    unnamed: list[str] = []
    for text in configs:
        head, sep, rest = text.partition(":")
        if sep and head.strip() in flat and not head.strip().startswith("{"):
            idx = next((i for i, n in enumerate(flat) if n == head.strip() and out[i] is None), None)
            if idx is None:
                raise SglxError(f"--attention-backend-config {text}: more configs for {head} than --attention-backend "
                                f"{head} entries")
            out[idx] = BackendRequest(flat[idx], rest.strip())
        else:
            unnamed.append(text)
    free = [i for i, r in enumerate(out) if r is None]
    if len(unnamed) > len(free):
        raise SglxError(f"{len(unnamed)} unnamed --attention-backend-config values for {len(free)} backends without "
                        "one; pair them by position or prefix each with its backend (NAME:CONFIG)")
    for i, text in zip(free, unnamed):
        out[i] = BackendRequest(flat[i], text)
    return tuple(r if r is not None else BackendRequest(flat[i]) for i, r in enumerate(out))


def _load(req: BackendRequest, snap: Any, dtype: str, head_dim: int) -> Any:
    """The backend instance with its validated config; SglxError (CLI exit 2) for a name, config or platform
    the backend cannot take."""
    from sglx.attention.config import load_backend_config

    spec = find(req.name, "diffusion", "dit")
    if spec is None:
        known = ", ".join(s.name for s in all_backends("diffusion", "dit") if s.implemented)
        raise SglxError(f"--attention-backend {req.name}: no such diffusion attention backend (implemented: {known})")
    if not spec.implemented:
        raise SglxError(f"--attention-backend {req.name} is declared but not implemented in sglx")
    avail = availability(spec, snap, AttentionRequest(family="diffusion", kind="dit", dtype=dtype,
                                                      head_dim=head_dim))
    if not avail.ok:
        raise SglxError(f"--attention-backend {req.name} cannot run here: {'; '.join(avail.reasons)}")
    try:
        cfg = load_backend_config(spec, req.config)
    except ConfigError as exc:
        text = str(exc)
        raise SglxError(text if req.name in text else f"--attention-backend-config for {req.name}: {text}") from None
    return spec, spec.load()(cfg.as_dict())


def clustered(shape: tuple[int, int, int, int], gen: torch.Generator, centres: int, unit: bool = True
              ) -> torch.Tensor:
    """[B, S, H, D]: every token near one of `centres` random centres of its head (structure for selection);
    `unit` scales to unit variance per element (centres 2x the noise: variance 5 before)."""
    b, s, h, d = shape
    c = torch.randn(h, centres, d, generator=gen) * 2
    which = torch.randint(0, centres, (b, s, h), generator=gen)
    x = c[torch.arange(h), which] + torch.randn(b, s, h, d, generator=gen)
    return x / math.sqrt(5.0) if unit else x


@dataclass
class _Row:
    name: str
    kind: str  # "sglx" | "baseline" | "anchor"
    fn: Callable[[], torch.Tensor]  # -> [B, S, H, D] in input order
    tol: float
    allowed: torch.Tensor | None = None  # bool [B, H, R, S]; None: dense
    density: float | None = None
    detail: str = ""
    of: str = ""  # the sglx row an anchor reproduces
    prepare: Callable[[], None] | None = None  # before every call (SVG2: keep k-means warm-started)
    timed: Callable[[], object] | None = None  # what is timed, when not `fn` (anchors: the kernel alone)
    replan: Callable[[], tuple[torch.Tensor, float]] | None = None  # (allowed, density) of the call just made


def _dense_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, tol: float,
                device: torch.device, all_baselines: bool) -> list[_Row]:
    if device.type == "cuda":
        from sglx.bench.diffusion import _baselines

        runs = _baselines(q, k, v, scale, tol)
        runs = runs if all_baselines else runs[:1]
        return [_Row(r.name, "baseline", _in_context(r.fn, r.context), r.tol, detail=r.detail) for r in runs]
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    return [_Row("sdpa", "baseline", lambda: F.scaled_dot_product_attention(
        qh, kh, vh, scale=scale, enable_gqa=qh.shape[1] != kh.shape[1]).transpose(1, 2), tol,
                 detail=f"torch SDPA on {device.type}")]


def _in_context(fn: Callable[[], torch.Tensor], context: Callable[[], Any]) -> Callable[[], torch.Tensor]:
    def call() -> torch.Tensor:
        with context():
            return fn()
    return call


def _flex_row(view: PlanView, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, of: str,
              tol: float, allowed: torch.Tensor, device: torch.device) -> _Row:
    """FlexAttention with the layout as its BlockMask, on the backend's permuted tokens (kernel only)."""
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention
    except Exception as exc:  # noqa: BLE001 - an old torch: the row says why
        return _Row("flex same mask", "anchor", _raiser(f"flex_attention: {type(exc).__name__}: {exc}"), tol, of=of)
    lay = view.layout
    b, hq, hkv = q.shape[0], q.shape[2], k.shape[2]
    blocks = lay.block_mask().expand(b, hq, lay.num_q_blocks, lay.num_k_blocks).to(q.device)
    valid = lay.key_valid().to(q.device)
    whole = F.pad(valid, (0, lay.num_k_blocks * lay.k_block - lay.seq_len), value=False)
    whole = whole.view(lay.num_k_blocks, lay.k_block).all(-1)  # key blocks without padding: no mask_mod needed
    k_block = torch.arange(lay.seq_len, device=q.device) // lay.k_block

    def in_mask(b_: Any, h_: Any, q_idx: Any, kv_idx: Any) -> Any:  # exact on every element (eager flex uses it)
        return blocks[b_, h_, q_idx // lay.q_block, k_block[kv_idx]] & valid[kv_idx]

    partial, full = _block_lists(blocks & ~whole), _block_lists(blocks & whole)
    mask = BlockMask.from_kv_blocks(*partial, *full, BLOCK_SIZE=(lay.q_block, lay.k_block), mask_mod=in_mask,
                                    seq_lengths=(lay.seq_len, lay.seq_len))
    qs = to_slots(q, view.q_index).transpose(1, 2).contiguous()
    ks = to_slots(k, view.k_index).transpose(1, 2).contiguous()
    vs = to_slots(v, view.k_index).transpose(1, 2).contiguous()
    flex = torch.compile(flex_attention, dynamic=False) if device.type == "cuda" else flex_attention
    gqa = hq != hkv
    options = _flex_kernel_options(lay.q_block, lay.k_block) if device.type == "cuda" else None

    def kernel() -> torch.Tensor:
        with warnings.catch_warnings():  # eager flex (CPU) warns that it is unfused: known, it is the anchor here
            warnings.simplefilter("ignore", UserWarning)
            return flex(qs, ks, vs, block_mask=mask, scale=scale, enable_gqa=gqa, kernel_options=options)

    def in_input_order() -> torch.Tensor:  # for the check only; the timed call is `kernel`
        return from_slots(kernel().transpose(1, 2), view.q_slot)

    return _Row("flex same mask", "anchor", in_input_order, tol, allowed, view.density,
                f"{'compiled' if device.type == 'cuda' else 'eager'} flex_attention on permuted tokens", of,
                timed=kernel)


def _flex_kernel_options(q_block: int, k_block: int) -> dict[str, int] | None:
    """Compiled flex needs the mask's block sizes to be multiples of its kernel tiles. Its default tiles (128 query
    rows x 64 keys on the H100) do not divide the 64-token blocks of VSA/VMoBA/SVG2: session 7's GPU run failed
    there with "Q and KV block size must be divisible"; then the largest tiles that divide them are asked for.
    None keeps flex's own choice where it already fits (STA's tiles)."""
    if q_block % 128 == 0 and k_block % 64 == 0:
        return None

    def tile(block: int) -> int:
        return next(t for t in (128, 64, 32, 16) if block % t == 0) if block % 16 == 0 else block

    return {"BLOCK_M": tile(q_block), "BLOCK_N": min(tile(k_block), 64)}


def _block_lists(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(counts int32 [B, H, nq], indices int32 [B, H, nq, nk]) of a bool block mask, as BlockMask takes them."""
    counts = mask.sum(-1).to(torch.int32)
    order = torch.argsort((~mask).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return counts.contiguous(), order.contiguous()


class Unavailable(RuntimeError):
    """A row that cannot run here (a package missing, a canvas upstream rejects): shown, not a failure."""


def _raiser(message: str) -> Callable[[], torch.Tensor]:
    def call() -> torch.Tensor:
        raise Unavailable(message)
    return call


def _upstream_rows(name: str, view: PlanView, backend: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   meta: DiTAttnMetadata, layer: int, scale: float, of: str, tol: float, allowed: torch.Tensor
                   ) -> list[_Row]:
    """fastvideo-kernel at the same mask where it imports and takes this call; otherwise a row saying why."""
    from sglx.bench.sparse_upstream import UPSTREAM, upstream_call

    if name not in UPSTREAM:
        return []
    try:
        fn, kernel, detail = upstream_call(name, view, backend, q, k, v, meta, layer, scale)
    except Exception as exc:  # noqa: BLE001 - not installed, or a canvas/config upstream rejects: a data point
        return [_Row("fastvideo-kernel", "anchor", _raiser(f"{type(exc).__name__}: {str(exc)[:240]}"), tol, of=of)]
    return [_Row("fastvideo-kernel", "anchor", fn, tol, allowed, view.density, detail, of, timed=kernel)]


def _measure(row: _Row, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, dense: torch.Tensor,
             scale: float, device: torch.device, budget: TimingBudget) -> dict[str, Any]:
    out: dict[str, Any] = {"backend": row.name, "kind": row.kind}
    if row.detail:
        out["detail"] = row.detail
    if row.of:
        out["of"] = row.of
    try:
        if row.prepare is not None:
            row.prepare()
        got = row.fn()[:, rows].double()
        if row.replan is not None:  # a data-dependent plan is made anew by each call: check against this one's
            row.allowed, row.density = row.replan()
        want = dense if row.allowed is None else masked_rows_reference(q, k, v, row.allowed, rows, scale)
        err = (got - want).abs().max().item()
        out.update(density=1.0 if row.allowed is None else row.density, max_abs_err=err, tolerance=row.tol,
                   rel_err_vs_dense=((got - dense).norm() / dense.norm()).item(), ok=err <= row.tol)
        if not out["ok"]:
            out["error"] = f"max |out - float64 under its mask| = {err:.3g} > {row.tol:g}: wrong result, not timed"
            return out
        timed = row.timed or row.fn
        if row.prepare is not None:
            def call(prep: Callable[[], None] = row.prepare) -> torch.Tensor:
                prep()
                return timed()
        else:
            call = timed
        timing = median_ms(call, device, budget)
    except Unavailable as exc:
        out.update(ok=False, skipped=True, error=f"not run: {exc}"[:300])
        return out
    except Exception as exc:  # a backend or anchor that cannot run this canvas is a result, not a crash
        out.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:300])
        return out
    out.update(median_ms=timing.median_ms, min_ms=timing.min_ms, max_ms=timing.max_ms, runs=timing.runs)
    return out


def _backend_rows(req: BackendRequest, spec: Any, backend: Any, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, meta: DiTAttnMetadata, layer: int, scale: float, rows: torch.Tensor,
                  dtype: torch.dtype, device: torch.device, anchors: bool) -> list[_Row]:
    """The backend's row (with its plan's mask for the check) and, for a sparse call, its anchors."""
    tol = tolerance(spec, dtype)

    def call() -> torch.Tensor:
        return backend.forward(q, k, v, scale=scale, meta=meta, layer=layer)

    if not getattr(backend, "sparse", False):
        return [_Row(req.label, "sglx", call, tol, detail=getattr(backend, "variant", "") or "dense")]
    if hasattr(backend, "last_layout"):
        backend.last_layout = None
    call()  # plans this call: its layout and order are what the check and the anchors use
    view = plan_view(backend, q, k, meta, layer, scale)
    prepare = _svg2_warm(backend, meta, layer) if spec.name == "sparse_video_gen_2_attn" else None
    if view is None:  # a config or grid on which this call is dense (warm-up, top-p 1, ...)
        return [_Row(req.label, "sglx", call, tol, detail="ran dense at this step/layer/config", prepare=prepare)]
    allowed = rows_mask(view, rows, q.shape[0], q.shape[2], k.shape[2])
    route = getattr(backend, "route", None)
    detail = f"route {route}" + ("; k-means warm-started (kmeans_iter_step)" if prepare else "")

    def replan() -> tuple[torch.Tensor, float]:
        again = plan_view(backend, q, k, meta, layer, scale)
        if again is None:
            raise RuntimeError(f"{req.label}: the checked call ran dense after a sparse planning call")
        return rows_mask(again, rows, q.shape[0], q.shape[2], k.shape[2]), again.density

    out = [_Row(req.label, "sglx", call, tol, allowed, view.density, detail, prepare=prepare, replan=replan)]
    if anchors:
        out.append(_flex_row(view, q, k, v, scale, req.label, tol, allowed, device))
        out.extend(_upstream_rows(spec.name, view, backend, q, k, v, meta, layer, scale, req.label, tol, allowed))
    return out


def _svg2_warm(backend: Any, meta: DiTAttnMetadata, layer: int) -> Callable[[], None]:
    """Each timed SVG2 call as the next step of a generation: k-means warm-started from the last call's centroids
    (`kmeans_iter_step` iterations), not re-initialised (`kmeans_iter_init`) as a repeat of one step would be."""
    def prepare() -> None:
        state = backend.state.layers.get(layer)
        if state is not None:
            state.step = meta.step_index - 1
    return prepare


def run_sparse_compare(config: SparseCompareConfig, device: torch.device, snap: Any,
                       progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    dtype_name = config.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    if dtype_name not in DTYPES:
        raise SglxError(f"--dtype {dtype_name}: choose one of {', '.join(DTYPES)}")
    dtype = DTYPES[dtype_name]
    loaded = [(req, *_load(req, snap, dtype_name, config.head_dim)) for req in config.backends]
    meta = config.metadata()
    layer = config.num_layers - 1 if config.layer is None else config.layer
    gen = torch.Generator().manual_seed(config.seed)
    shape = (config.batch, config.tokens, config.heads, config.head_dim)
    spread = math.sqrt(config.logit_std)  # unit-variance q and k give logits of std ~1; scale both by sqrt(std)
    q, k = ((clustered(shape, gen, config.centres) * spread).to(device, dtype) for _ in range(2))
    v = torch.randn(shape, generator=gen).to(device, dtype)
    scale = 1 / math.sqrt(config.head_dim)
    rows = torch.randperm(config.tokens, generator=gen)[:config.rows].sort().values.to(device)
    budget = config.budget(device)
    results: list[dict[str, Any]] = []
    with torch.inference_mode():
        dense = sampled_reference(q, k, v, rows, scale)
        todo = _dense_rows(q, k, v, scale, TOLERANCE[dtype], device, config.baselines)
        for req, spec, backend in loaded:
            if progress is not None:
                progress(f"sparse comparison: planning {req.label}")
            todo.extend(_backend_rows(req, spec, backend, q, k, v, meta, layer, scale, rows, dtype, device,
                                      config.anchors))
        for i, row in enumerate(todo):
            if progress is not None:
                progress(f"sparse comparison [{i + 1}/{len(todo)}] {row.name}")
            results.append(_measure(row, q, k, v, rows, dense, scale, device, budget))
    base_name = DENSE_BASELINE["cuda" if device.type == "cuda" else "cpu"]
    base = next((r.get("median_ms") for r in results if r["backend"] == base_name), None)
    for r in results:
        if base and r.get("median_ms"):
            r["x_dense"] = base / r["median_ms"]
    t, h, w = config.canvas
    text = f" + {config.text_tokens} text" if config.text_tokens else ""
    return {"config": {**asdict(config), "backends": [asdict(b) for b in config.backends]},
            "label": f"canvas {t}x{h}x{w}{text} = {config.tokens} tokens, B{config.batch} H{config.heads} "
                     f"D{config.head_dim} {dtype_name}, step {meta.step_index}/{meta.num_steps} layer {layer}, "
                     f"logit std {config.logit_std:g}",
            "dense_baseline": base_name, "rows": results}


def compare_table(report: dict[str, Any]) -> Any:
    from rich.table import Table

    sparse = report["sparse"]
    env = report["environment"]
    table = Table(title=f"Sparse vs dense DiT attention on {env.get('device_name')} (torch {env['torch']}): "
                        f"{sparse['label']}", title_justify="left")
    for col in ("backend", "density", "err vs own mask", "rel err vs dense", "median ms", "x dense", "note"):
        table.add_column(col, justify="left" if col in ("backend", "note") else "right")
    for r in sparse["rows"]:
        name = r["backend"] if r["kind"] == "sglx" else (f"[dim]  {r['backend']}[/]" if r["kind"] == "anchor"
                                                         else f"[dim]{r['backend']}[/]")
        if r.get("error") and "max_abs_err" not in r:
            table.add_row(name, "", "", "", "", "", f"[red]{r['error'][:80]}[/]")
            continue
        note = r.get("detail", "")
        if r.get("error"):
            note = f"[red]{r['error'][:80]}[/]"
        elif r["kind"] == "sglx" and r.get("density", 1.0) >= 1.0 and "route" in note:
            note += "; [yellow]every block pair kept: dense[/]"
        table.add_row(name, f"{r['density']:.3f}", f"{r['max_abs_err']:.1e}", f"{r['rel_err_vs_dense']:.1e}",
                      f"{r['median_ms']:.3f}" if "median_ms" in r else "",
                      f"{r['x_dense']:.2f}x" if r.get("x_dense") else "", note)
    return table


__all__ = ["BackendRequest", "SparseCompareConfig", "canvas_from_video", "compare_table", "pair_backends",
           "parse_canvas", "run_sparse_compare"]
