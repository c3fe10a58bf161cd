"""`sglx bench offline-throughput`: the engine's throughput in-process, on the prompts `sglx bench serving` sends.

Like SGLang's bench_offline_throughput: no server, no HTTP; the engine is built from the same engine flags
as `sglx serve`, warmed up the way `sglx serve` warms up before it opens its port, and then given every
prompt at once (one `Engine.generate` batch; the scheduler admits them as KV memory allows) or, with
`max_concurrency`, at most that many at a time (each finished request lets the next one in, as the serving
bench's concurrency cap does). The prompt set is `sglx.bench.serving.build_prompts` of the same dataset
options and seed, with the vocabulary size the server would report, so a serving run and an offline run of
the same options send identical requests; both reports carry `prompts_sha256` to prove it.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

from sglx.bench.serving import (
    BenchPrompt,
    ServingBenchConfig,
    build_prompts,
    prompts_fingerprint,
    throughput_fields,
)
from sglx.llm.engine_config import EngineConfig
from sglx.llm.sampling import SamplingParams


@dataclass(frozen=True)
class OfflineBenchConfig:
    """The dataset options of `sglx bench serving` (same names, same defaults) plus the concurrency cap."""

    num_prompts: int = 200
    input_len: int = 256
    output_len: int = 128
    range_ratio: float = 1.0
    length_dist: str = "uniform"
    prompt_kind: str = "auto"
    tokenizer: str | None = None
    vocab_size: int | None = None
    ignore_eos: bool = True
    temperature: float = 0.0
    seed: int = 0
    max_concurrency: int | None = None  # None: every prompt submitted at once
    warmup: bool = True

    def __post_init__(self) -> None:
        self.dataset()  # the serving bench's checks of the same options

    def dataset(self) -> ServingBenchConfig:
        """The serving bench configuration that builds the same prompts (completions endpoint)."""
        return ServingBenchConfig(num_prompts=self.num_prompts, input_len=self.input_len, output_len=self.output_len,
                                  range_ratio=self.range_ratio, length_dist=self.length_dist,
                                  prompt_kind=self.prompt_kind, tokenizer=self.tokenizer, vocab_size=self.vocab_size,
                                  ignore_eos=self.ignore_eos, temperature=self.temperature, seed=self.seed,
                                  max_concurrency=self.max_concurrency)


def offline_prompts(config: OfflineBenchConfig, model_vocab_size: int) -> list[BenchPrompt]:
    """What `sglx bench serving` sends to a server of this model: it asks /server_info for the vocabulary size
    (the engine's) unless --vocab-size is given or the prompts are text."""
    vocab = config.vocab_size
    if vocab is None and config.prompt_kind != "text":
        vocab = model_vocab_size
    return build_prompts(config.dataset(), vocab)


def sampling_params(config: OfflineBenchConfig, prompt: BenchPrompt) -> SamplingParams:
    """The parameters the server builds for the serving bench's request (sglx.server.openai_api)."""
    return SamplingParams(max_new_tokens=prompt.output_len, temperature=config.temperature,
                          ignore_eos=config.ignore_eos)


def _generate_all(engine: Any, prompts: Sequence[BenchPrompt], params: list[SamplingParams],
                  max_concurrency: int | None) -> list[dict[str, Any]]:
    """Every prompt through the engine; results in prompt order. Token-id prompts go in as ids, text is
    encoded by the engine (inside the timed region, as the server encodes inside its request)."""

    def one_batch(idx: list[int]) -> list[dict[str, Any]]:
        batch = [prompts[i].prompt for i in idx]
        ps = [params[i] for i in idx]
        if isinstance(batch[0], list):
            return list(engine.generate(input_ids=batch, sampling_params=ps))
        return list(engine.generate(batch, sampling_params=ps))

    if max_concurrency is None or max_concurrency >= len(prompts):
        return one_batch(list(range(len(prompts))))
    with ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="sglx-offline") as pool:
        return [r[0] for r in pool.map(lambda i: one_batch([i]), range(len(prompts)))]


def run_offline(engine: Any, config: OfflineBenchConfig) -> dict[str, Any]:
    """Time every prompt through a running engine and return the report (the serving report's throughput keys)."""
    prompts = offline_prompts(config, engine.model_config.vocab_size)
    params = [sampling_params(config, p) for p in prompts]
    start, cpu_start = time.perf_counter(), time.process_time()
    results = _generate_all(engine, prompts, params, config.max_concurrency)
    duration = max(time.perf_counter() - start, 1e-9)
    cpu_s = time.process_time() - cpu_start  # every thread of this process: on a shared host, the work done
    ok = [r for r in results if r.get("finish_reason") not in (None, "abort") and not r.get("error")]
    errors = [str(r.get("error") or r.get("finish_reason")) for r in results if r not in ok]
    input_tokens = sum(int(r["prompt_tokens"]) for r in ok)
    output_tokens = sum(int(r["completion_tokens"]) for r in ok)
    return {
        "backend": "engine",
        "config": asdict(config),
        "prompts_sha256": prompts_fingerprint(prompts),
        **throughput_fields(len(ok), errors, duration, input_tokens, output_tokens),
        "cpu_s": cpu_s,
    }


def environment() -> dict[str, Any]:
    import torch

    return {"python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine(),
            "processor": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "cuda_device": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def run_offline_throughput(engine_config: EngineConfig, config: OfflineBenchConfig,
                           progress: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    """Build the engine from the serve flags, warm it up as `sglx serve` does, run the bench, shut it down."""
    from sglx.llm.engine import Engine
    from sglx.server.runner import warm_up

    progress("loading the engine")
    engine = Engine(engine_config)
    try:
        if config.warmup:
            progress("warming up (as sglx serve does before it opens its port)")
            warm_up(engine)
        progress(f"generating {config.num_prompts} requests")
        report = run_offline(engine, config)
        info = engine.info
    finally:
        engine.shutdown()
    report["model"] = os.path.basename(str(info["model_path"]).rstrip("/"))
    report["engine"] = {k: (str(v) if not isinstance(v, (int, float, str, bool, type(None))) else v)
                        for k, v in info.items()}
    report["environment"] = environment()
    return report


def offline_table(report: dict[str, Any]) -> Any:
    from rich.table import Table

    cfg = report["config"]
    title = (f"sglx bench offline-throughput: {report['model']} ({report['engine'].get('device', '')}, "
             f"max concurrency {cfg['max_concurrency'] or 'none'})")
    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for label, value in (("successful requests", f"{report['completed']}"),
                         ("failed requests", f"{report['failed']}"),
                         ("duration (s)", f"{report['duration_s']:.2f}"),
                         ("total input tokens", f"{report['total_input_tokens']}"),
                         ("total output tokens", f"{report['total_output_tokens']}"),
                         ("request throughput (req/s)", f"{report['request_throughput']:.2f}"),
                         ("input token throughput (tok/s)", f"{report['input_token_throughput']:.2f}"),
                         ("output token throughput (tok/s)", f"{report['output_token_throughput']:.2f}"),
                         ("total token throughput (tok/s)", f"{report['total_token_throughput']:.2f}")):
        table.add_row(label, value)
    return table

