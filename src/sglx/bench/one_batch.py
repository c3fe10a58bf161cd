"""`sglx bench one-batch`: the latency of one static batch through the model runner, no scheduler or server.

Like SGLang's bench_one_batch: `batch_size` random prompts of `input_len` tokens are prefilled in
one EXTEND step, then decoded greedily for `output_len - 1` DECODE steps (the prefill already
yields the first token), each step timed on the host with the device synchronized, so a step's
time is what a user waits for, launch overhead and CUDA-graph replay included.

The prefill is timed `prefill_runs` times after a warm-up prefill (which compiles and autotunes, and is
reported apart as `prefill_first_ms`) and reported as the median, next to its compute floor measured in
the same run (sglx.bench.prefill_floor: the model's GEMMs plus SDPA attention at the same shapes). The
timed part runs with Python's cyclic garbage collector paused (collected just before), as timeit does: a
full collection over what torch, Triton and the model keep alive takes far longer than a decode step, and
a single timed prefill once measured 4x its usual time (cause unproven; docs/benchmarks.md, one-batch).

The decode-step floor is the memory roofline: every weight a step multiplies with (all parameters
but the embedding table, of which only the batch's rows are read) plus every K/V byte the step's
attention reads, divided by the bandwidth of a device-to-device copy measured in the same run.
"""

from __future__ import annotations

import gc
import platform as py_platform
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch

from sglx.bench.prefill_floor import measure_prefill_floor, unsupported_reason
from sglx.bench.timing import TimingBudget, copy_bandwidth
from sglx.errors import SglxError
from sglx.llm.engine_config import EngineConfig
from sglx.llm.forward_batch import ForwardBatch, ForwardMode

POOL_ROUND = 256  # per-request KV capacity is rounded up to this (a multiple of every page size)
WARMUP_DECODE_STEPS = 3
PREFILL_RUNS = 5


@dataclass(frozen=True)
class OneBatchConfig:
    batch_sizes: tuple[int, ...] = (1,)
    input_len: int = 512
    output_len: int = 16
    prefill_runs: int = PREFILL_RUNS  # timed prefills after the warm-up one; the report gives their median
    prefill_floor: bool = True  # also time the prefill's GEMMs and attention alone (its compute floor)

    def __post_init__(self) -> None:
        problems = []
        if not self.batch_sizes or any(b < 1 for b in self.batch_sizes):
            problems.append(f"--batch-size {','.join(map(str, self.batch_sizes))}: give sizes >= 1")
        if self.input_len < 1:
            problems.append(f"--input-len {self.input_len}: must be >= 1")
        if self.output_len < 2:
            problems.append(f"--output-len {self.output_len}: must be >= 2 (the prefill yields the first token; "
                            "decode steps yield the rest)")
        if self.prefill_runs < 1:
            problems.append(f"--prefill-runs {self.prefill_runs}: must be >= 1")
        if problems:
            raise SglxError("invalid benchmark options:\n" + "\n".join(f"  - {p}" for p in problems))

    @property
    def tokens_per_request(self) -> int:
        return self.input_len + self.output_len


def make_prompts(vocab_size: int, batch_size: int, input_len: int, seed: int) -> torch.Tensor:
    """[batch_size, input_len] random token ids (reproducible from the seed, for tests)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch_size, input_len), generator=gen)


def engine_config_for(base: EngineConfig, config: OneBatchConfig) -> EngineConfig:
    """The engine flags with a KV pool, request table and graph sizes just big enough (unless given)."""
    max_bs = max(config.batch_sizes)
    per_request = -(-config.tokens_per_request // POOL_ROUND) * POOL_ROUND
    return replace(base,
                   max_total_tokens=base.max_total_tokens or max_bs * per_request,
                   max_running_requests=base.max_running_requests or max_bs,
                   cuda_graph_max_bs=base.cuda_graph_max_bs or max_bs)


def weight_bytes_per_step(model: torch.nn.Module, batch_size: int) -> int:
    """Bytes of weights one decode step reads: every parameter, but only `batch_size` rows of the embedding
    table (unless the table doubles as the LM head, which reads all of it), and of a MoE layer's routed
    experts only those its batch_size * top_k choices reach (expected count under uniform routing, which
    dummy weights give: E * (1 - (1 - k/E)^batch_size))."""
    from sglx.llm.layers.moe import DeepseekMoE

    params = {id(p): p for p in model.parameters()}
    total = sum(p.numel() * p.element_size() for p in params.values())
    embed = model.model.embed_tokens.weight  # type: ignore[union-attr]
    if getattr(model, "lm_head", None) is not None:
        total += batch_size * embed.shape[1] * embed.element_size() - embed.numel() * embed.element_size()
    for module in model.modules():
        if isinstance(module, DeepseekMoE):
            e, k = module.cfg.n_routed_experts, module.cfg.num_experts_per_tok
            touched = e * (1 - (1 - k / e) ** batch_size)
            expert_bytes = sum(p.numel() * p.element_size() for p in module.experts.parameters())
            total -= int(expert_bytes * (1 - touched / e))
    return total


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _BatchRun:
    """Rows 1..bs of req_to_token, each request on its own contiguous, page-aligned run of KV slots."""

    def __init__(self, runner: Any, prompts: torch.Tensor, config: OneBatchConfig) -> None:
        self.runner = runner
        self.device = runner.device
        self.bs, self.input_len = prompts.shape
        page = runner.page_size
        per_request = -(-config.tokens_per_request // page) * page
        if (self.bs * per_request) > runner.memory.num_slots:
            raise SglxError(f"the KV pool ({runner.memory.num_slots} tokens) cannot hold {self.bs} requests of "
                            f"{config.tokens_per_request} tokens; raise --max-total-tokens")
        base = page + torch.arange(self.bs)[:, None] * per_request  # page 0 is the padding page
        self.slots = (base + torch.arange(per_request)[None, :]).to(self.device)
        self.rows = torch.arange(1, self.bs + 1, device=self.device)
        table = runner.req_to_token_pool.req_to_token
        table[1:self.bs + 1, :per_request] = self.slots.to(table.dtype)
        self.prompts = prompts.to(self.device)
        # every decode step's positions, seq_lens and KV slots laid out ahead (row = step): a step takes
        # contiguous views instead of launching fills, as a scheduler keeping device-side state would
        steps = torch.arange(self.input_len, per_request, device=self.device)
        self.step_positions = steps[:, None].expand(-1, self.bs).contiguous()
        self.step_seq_lens = self.step_positions + 1
        self.step_slots = self.slots.t()[self.input_len:].contiguous()
        self.prefills = 0  # how many prefills ran (the bench times none before its warm-up one)

    def prefill(self) -> torch.Tensor:
        self.prefills += 1
        bs, n = self.bs, self.input_len
        batch = ForwardBatch(
            mode=ForwardMode.EXTEND, input_ids=self.prompts.reshape(-1),
            positions=torch.arange(n, device=self.device).repeat(bs), req_pool_indices=self.rows,
            seq_lens=torch.full((bs,), n, device=self.device), out_cache_loc=self.slots[:, :n].reshape(-1),
            req_to_token_pool=self.runner.req_to_token_pool, token_kv_pool=self.runner.token_kv_pool,
            seq_lens_cpu=[n] * bs, extend_seq_lens_cpu=[n] * bs, extend_prefix_lens_cpu=[0] * bs)
        return self.runner.forward(batch).argmax(-1)

    def decode(self, tokens: torch.Tensor, step: int) -> torch.Tensor:
        """Decode step `step` (0-based): token at position input_len + step."""
        logits = self.runner.forward(self.decode_batch(tokens, step))
        greedy = self.runner.last_greedy_ids  # computed inside the CUDA graph when one ran
        return greedy if greedy is not None else logits.argmax(-1)

    def decode_batch(self, tokens: torch.Tensor, step: int) -> ForwardBatch:
        pos = self.input_len + step
        return ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=tokens, positions=self.step_positions[step],
            req_pool_indices=self.rows, seq_lens=self.step_seq_lens[step], out_cache_loc=self.step_slots[step],
            req_to_token_pool=self.runner.req_to_token_pool, token_kv_pool=self.runner.token_kv_pool,
            seq_lens_cpu=[pos + 1] * self.bs)


@contextmanager
def gc_paused() -> Iterator[None]:
    """Collect now, then keep Python's cyclic GC from running inside the timed region (as timeit does)."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _timed_prefills(run: _BatchRun, runs: int) -> tuple[torch.Tensor, list[float], list[float]]:
    """(last greedy tokens, host wall ms of each prefill with the device synchronized, device ms (CUDA events))."""
    device = run.device
    wall: list[float] = []
    events = []
    tokens = None
    for _ in range(runs):
        _sync(device)
        t0 = time.perf_counter()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        tokens = run.prefill()
        if device.type == "cuda":
            end.record()
            events.append((start, end))
        _sync(device)
        wall.append((time.perf_counter() - t0) * 1e3)
    assert tokens is not None
    return tokens, wall, [s.elapsed_time(e) for s, e in events]


def _prefill_floor(runner: Any, config: OneBatchConfig, bs: int) -> dict[str, Any]:
    """The prefill's compute floor (GEMMs + attention, timed alone now), or why it is absent."""
    why = None if config.prefill_floor else "not measured (--no-prefill-floor)"
    why = why or unsupported_reason(runner.model)
    if why is not None:
        return {"prefill_floor_ms": None, "prefill_floor_why": why}
    budget = TimingBudget() if runner.device.type == "cuda" else TimingBudget(warmup_ms=2.0, rep_ms=10.0, min_runs=3)
    return measure_prefill_floor(runner.model, bs, config.input_len, runner.device, budget).as_dict()


def _one_size(runner: Any, config: OneBatchConfig, bs: int, seed: int, bandwidth: float) -> dict[str, Any]:
    device = runner.device
    prompts = make_prompts(runner.model_config.vocab_size, bs, config.input_len, seed)
    run = _BatchRun(runner, prompts, config)
    _sync(device)
    t0 = time.perf_counter()
    tokens = run.prefill()  # warm-up: kernels compile, allocator and library heuristics settle
    _sync(device)
    prefill_first_ms = (time.perf_counter() - t0) * 1e3
    for step in range(min(WARMUP_DECODE_STEPS, config.output_len - 1)):
        tokens = run.decode(tokens, step)
    _sync(device)
    replays_before = runner.graph_runner.replays if runner.graph_runner is not None else 0
    prefills_before = run.prefills

    with gc_paused():
        tokens, prefill_wall, prefill_device = _timed_prefills(run, config.prefill_runs)
        outputs = [tokens]
        steps = []
        gpu_steps: list[float] = []  # CUDA-event time of the step's device work (the rest of a step is host)
        for step in range(config.output_len - 1):
            t0 = time.perf_counter()
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            tokens = run.decode(tokens, step)
            if device.type == "cuda":
                end.record()
            _sync(device)
            steps.append(time.perf_counter() - t0)
            if device.type == "cuda":
                gpu_steps.append(start.elapsed_time(end) * 1e-3)
            outputs.append(tokens)
    prefill_ms = statistics.median(prefill_wall)
    step_ms = statistics.median(steps) * 1e3
    mid_context = config.input_len + len(steps) // 2 + 1  # keys per request in the median step
    kv_bytes = bs * mid_context * runner.token_kv_pool.bytes_per_token()
    weights = weight_bytes_per_step(runner.model, bs)
    floor_ms = (weights + kv_bytes) / bandwidth * 1e3
    graph_steps = (runner.graph_runner.replays - replays_before) if runner.graph_runner is not None else 0
    floor = _prefill_floor(runner, config, bs)
    prefill_floor_ms = floor["prefill_floor_ms"]
    prefill_device_ms = statistics.median(prefill_device) if prefill_device else None
    return {
        "batch_size": bs, "input_len": config.input_len, "output_len": config.output_len,
        "prefill_ms": prefill_ms, "prefill_tokens_per_s": bs * config.input_len / (prefill_ms * 1e-3),
        "prefill_runs": config.prefill_runs, "prefill_ms_min": min(prefill_wall), "prefill_ms_max": max(prefill_wall),
        "prefill_ms_all": prefill_wall, "prefill_first_ms": prefill_first_ms,
        "prefill_device_ms_median": prefill_device_ms,
        "prefills_before_timing": prefills_before,
        **floor,
        "prefill_ratio_to_floor": prefill_ms / prefill_floor_ms if prefill_floor_ms else None,
        # device time over the floor: how far the kernels are from it, without the host's launch time
        "prefill_device_ratio_to_floor": (prefill_device_ms / prefill_floor_ms
                                          if prefill_floor_ms and prefill_device_ms is not None else None),
        "decode_steps": len(steps), "decode_step_ms_median": step_ms, "decode_step_ms_min": min(steps) * 1e3,
        "decode_step_ms_max": max(steps) * 1e3,
        "decode_step_device_ms_median": statistics.median(gpu_steps) * 1e3 if gpu_steps else None,
        "decode_tokens_per_s": bs / (step_ms * 1e-3),
        "decode_steps_in_cuda_graphs": graph_steps, "total_ms": prefill_ms + sum(steps) * 1e3,
        "weight_bytes_per_step": weights, "kv_bytes_per_step": kv_bytes, "floor_ms": floor_ms,
        "ratio_to_floor": step_ms / floor_ms,
        "output_ids": torch.stack(outputs, 1).tolist()[:4],  # first requests' greedy tokens (for checks)
    }


def run_one_batch(engine_config: EngineConfig, config: OneBatchConfig,
                  progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    from sglx.llm.tp_runtime import build_model_runner

    cfg = engine_config_for(engine_config, config)
    if progress:
        progress(f"loading {cfg.model_path or 'the embedded model'} ({cfg.load_format} weights)")
    runner = build_model_runner(cfg)  # --tp-size N: rank 0 here, the other ranks in worker processes
    try:
        bandwidth = copy_bandwidth(runner.device)
        results = []
        with torch.inference_mode():
            for bs in config.batch_sizes:
                if progress:
                    progress(f"batch size {bs}: prefill {config.input_len} tokens, {config.output_len - 1} "
                             "decode steps")
                results.append(_one_size(runner, config, bs, cfg.seed, bandwidth))
        info = runner.describe()
        env: dict[str, Any] = {"torch": torch.__version__, "python": py_platform.python_version(),
                               "date": time.strftime("%Y-%m-%d %H:%M:%S")}
        if runner.device.type == "cuda":
            env.update(device_name=torch.cuda.get_device_name(runner.device), cuda=torch.version.cuda)
        else:
            env["device_name"] = py_platform.processor() or py_platform.machine()
        try:
            import triton

            env["triton"] = triton.__version__
        except ImportError:
            env["triton"] = None
        n_params = sum(p.numel() for p in runner.model.parameters())
        return {
            "environment": env, "model_path": runner.model_path, "architecture": runner.model_config.architecture,
            "load_format": cfg.load_format, "parameters": n_params, **info,
            "copy_bandwidth_gb_per_s": bandwidth / 1e9,
            "floor": "(weights read per step + K/V read per step) / device-to-device copy bandwidth, same run",
            "prefill_floor": "the prefill's GEMMs (qkv, o, gate/up, down per layer; LM head on the last tokens) "
                             "on the model's weights plus causal SDPA attention per layer, each timed alone in "
                             "this run (CUDA: fastest of cuDNN/flash/efficient SDPA); sglx.bench.prefill_floor",
            "timing": "host wall clock with the device synchronized, Python GC paused; prefill = median of "
                      "prefill_runs after one warm-up prefill (prefill_first_ms); decode = median over steps",
            "results": results,
        }
    finally:
        runner.release_memory()


def report_table(report: dict[str, Any]) -> Any:
    from rich.table import Table

    env = report["environment"]
    graphs = (f"CUDA graphs bs <= {report['cuda_graph_max_bs']}" if report["cuda_graph"]
              else f"CUDA graphs off ({report['cuda_graph_why']})")
    if report.get("prefill_cuda_graph"):  # single-request prefills (batch 1) replay a graph too
        graphs += f", 1-request prefill <= {report['prefill_cuda_graph_max_tokens']} tokens"
    table = Table(title=f"sglx bench one-batch: {report['model_path']} ({report['dtype']}, {report['load_format']}) "
                        f"on {env.get('device_name')} | attention {report['attention_backend']} | {graphs} | "
                        f"copy bandwidth {report['copy_bandwidth_gb_per_s']:.0f} GB/s", title_justify="left")
    for col in ("batch", "input", "output", "prefill ms (median)", "prefill tok/s", "prefill floor ms (GEMM + attn)",
                "prefill / floor", "decode step ms (median)", "decode tok/s", "floor ms", "step / floor"):
        table.add_column(col, justify="right")
    for r in report["results"]:
        table.add_row(str(r["batch_size"]), str(r["input_len"]), str(r["output_len"]),
                      f"{r['prefill_ms']:.2f} ({r['prefill_ms_min']:.2f}-{r['prefill_ms_max']:.2f}, "
                      f"{r['prefill_runs']} runs)", f"{r['prefill_tokens_per_s']:.0f}", *_prefill_floor_cells(r),
                      f"{r['decode_step_ms_median']:.3f}", f"{r['decode_tokens_per_s']:.1f}", f"{r['floor_ms']:.3f}",
                      f"{r['ratio_to_floor']:.2f}x")
    return table


def _prefill_floor_cells(r: dict[str, Any]) -> tuple[str, str]:
    if r.get("prefill_floor_ms") is None:
        return f"n/a: {r.get('prefill_floor_why', '')}", "n/a"
    device = r.get("prefill_device_ratio_to_floor")
    return (f"{r['prefill_floor_ms']:.2f} ({r['prefill_floor_gemm_ms']:.2f} + {r['prefill_floor_attention_ms']:.2f})",
            f"{r['prefill_ratio_to_floor']:.2f}x" + (f" (device {device:.2f}x)" if device is not None else ""))
