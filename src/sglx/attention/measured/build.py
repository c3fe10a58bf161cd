"""Turn raw benchmark reports into a GPU class's record: only sglx backends' medians, each with its provenance.

Four report formats are read: `sglx bench attention --json` (the normal way to record a GPU), `sglx bench
one-batch --json` (the whole engine: its medians become "engine" shapes, which rank.py weighs first), and the two
one-off scripts whose H100 results seeded the packaged record (benchmarks/bench_fa4_llm.py and the MLA
decode sweep of benchmarks/run_mla_device.sh), which carry no date and so need one given.
"""

from __future__ import annotations

import re
from dataclasses import asdict
from typing import Any

from sglx.attention.measured.record import ENGINE_SHAPE, FORMAT, Measurement

SGLX_BENCH = "sglx bench attention"


def _bench_attention(data: dict[str, Any], source: str, date: str | None) -> list[Measurement]:
    env = data["environment"]
    when = env.get("date") or date
    if not when:
        raise ValueError(f"{source}: the report has no date; give one")
    # decode medians of a `--cuda-graph` report are graph replays; say so on each
    graphed_note = f"{SGLX_BENCH} --cuda-graph" if data.get("config", {}).get("cuda_graph", False) else SGLX_BENCH
    out = []
    for case in data["cases"]:
        c = case["case"]
        for row in case["rows"]:
            if row.get("kind") != "sglx" or not row.get("ok") or row.get("median_ms") is None:
                continue  # baselines are vendors' calls, not sglx backends; a failed check has no valid time
            out.append(Measurement("mha", c["phase"], case["label"], int(c["page_size"]), c["kv_cache_dtype"],
                                   row["backend"], float(row["median_ms"]), source, when, env["device_name"],
                                   graphed_note if c["phase"] == "decode" else SGLX_BENCH))
    return out


def _one_batch(data: dict[str, Any], source: str, date: str | None) -> list[Measurement]:
    """A `sglx bench one-batch` report: per batch size, the decode step's median (the decode backend's) and the
    prefill's (the prefill backend's), as the engine runs them (CUDA graphs, fused kernels, host work included)."""
    env = data["environment"]
    when = env.get("date") or date
    if not when:
        raise ValueError(f"{source}: the report has no date; give one")
    model = str(data["model_path"]).rstrip("/").rsplit("/", 1)[-1]
    kind = "mla" if str(data["architecture"]).startswith("Deepseek") else "mha"  # sglx's MLA models: DeepSeek V2/V3
    page, kv = int(data["page_size"]), str(data["kv_cache_dtype"])
    notes = {phase: f"sglx bench one-batch: {what} ({graphs} {'on' if data.get(key) else 'off'})"
             for phase, what, graphs, key in (("decode", "decode step", "CUDA graphs", "cuda_graph"),
                                              ("prefill", "prefill", "prefill CUDA graphs", "prefill_cuda_graph"))}
    out = []
    for r in data["results"]:
        head = f"{ENGINE_SHAPE}{model} B{r['batch_size']}"
        if r.get("decode_step_ms_median") is not None:
            out.append(Measurement(kind, "decode", f"{head} {r['input_len']}+{r['output_len']} step", page, kv,
                                   data["decode_attention_backend"], float(r["decode_step_ms_median"]), source, when,
                                   env["device_name"], notes["decode"]))
        if r.get("prefill_ms") is not None:
            out.append(Measurement(kind, "prefill", f"{head} {r['input_len']}-token prefill", page, kv,
                                   data["prefill_attention_backend"], float(r["prefill_ms"]), source, when,
                                   env["device_name"], notes["prefill"]))
    return out


def _fa4_script(data: dict[str, Any], source: str, date: str | None) -> list[Measurement]:
    if not date:
        raise ValueError(f"{source}: benchmarks/bench_fa4_llm.py reports carry no date; give one")
    note = "benchmarks/bench_fa4_llm.py: sglx.bench.timing (L2 flushed, median), metadata built outside the call"
    out = []
    dec = re.fullmatch(r"decode B(\d+) Hq(\d+)/Hkv(\d+) D(\d+) context (\d+) page (\d+) bf16", data["decode"]["shape"])
    pre = re.fullmatch(r"causal prefill B(\d+) H(\d+) D(\d+) seq (\d+) bf16 \(sglx: paged, page (\d+)\)",
                       data["prefill"]["shape"])
    if dec is None or pre is None:
        raise ValueError(f"{source}: unknown bench_fa4_llm shape text")
    b, hq, hkv, d, ctx, page = dec.groups()
    for phase, label, page_size in (("decode", f"B{b} H{hq}/{hkv} D{d} ctx {ctx}", page),
                                    ("prefill", f"B{pre[1]} H{pre[2]}/{pre[2]} D{pre[3]} 0+{pre[4]} causal", pre[5])):
        for key, value in data[phase].items():
            name = key.removeprefix("sglx ")
            if key.startswith("sglx ") and isinstance(value, dict) and " " not in name:  # eager calls only
                out.append(Measurement("mha", phase, label, int(page_size), "auto", name, float(value["ms"]),
                                       source, date, data["device"], note))
    return out


def _mla_sweep(data: dict[str, Any], source: str, date: str | None) -> list[Measurement]:
    if not date:
        raise ValueError(f"{source}: MLA sweep reports carry no date; give one")
    out = []
    for res in data["results"]:
        label = f"B{res['batch']} H{res['heads']} latent {res['r']}+{res['dr']} ctx {res['context']}"
        routes = res["routes"]
        flashinfer = next(r for r in routes if r["route"] == "flashinfer")  # timed first (and again last)
        triton = next(r for r in routes if r["route"] == res["best_triton_route"])
        as_default = ("timed as the default launch" if triton["route"].endswith("(default)")
                      else "the launch sglx's triton MLA uses by default since this sweep "
                           "(not re-timed as the default)")
        for name, route, note in (
                ("flashinfer", flashinfer, "MLA decode sweep: FlashInfer's first timing"),
                ("triton", triton, f"MLA decode sweep: {triton['route']}, {as_default}")):
            if "ms" not in route:  # a route that could not run here (FlashInfer MLA takes no fp8 latents)
                continue
            out.append(Measurement("mla", "decode", label, int(res["page_size"]), res["kv_cache_dtype"], name,
                                   float(route["ms"]), source, date, data["device"], note))
    return out


def measurements(data: dict[str, Any], source: str, date: str | None = None) -> list[Measurement]:
    """The sglx backends' medians in one report, whichever of the four formats it is."""
    if "cases" in data and "environment" in data:
        return _bench_attention(data, source, date)
    if "decode_attention_backend" in data and "results" in data and "environment" in data:
        return _one_batch(data, source, date)
    if "decode" in data and "prefill" in data and "device" in data:
        return _fa4_script(data, source, date)
    if "results" in data and data["results"] and "routes" in data["results"][0]:
        return _mla_sweep(data, source, date)
    raise ValueError(f"{source}: not a report of sglx bench attention, sglx bench one-batch, bench_fa4_llm.py or the "
                     "MLA decode sweep")


def build_record(gpu_class: str, reports: list[tuple[dict[str, Any], str, str | None]]) -> dict[str, Any]:
    """One record from (report, source path, date or None) triples; every report's device must be this class."""
    model = gpu_class.split("-", 1)[-1]
    entries: list[Measurement] = []
    for data, source, date in reports:
        found = measurements(data, source, date)
        for m in found:
            if model not in m.device.lower():
                raise ValueError(f"{source}: measured on {m.device!r}, which is not a {gpu_class} GPU")
        entries.extend(found)
    entries.sort(key=lambda m: (m.kind, m.phase, m.shape, m.kv_cache_dtype, m.page_size, m.backend, m.date))
    return {"format": FORMAT, "gpu_class": gpu_class, "sources": sorted({s for _, s, _ in reports}),
            "entries": [asdict(m) for m in entries]}
