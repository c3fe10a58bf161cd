"""`sglx bench diffusion`: both parts (attention at DiT shapes, one Wan step) in one report, plus its tables."""

from __future__ import annotations

import platform as py_platform
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from sglx.bench.diffusion import DiffusionAttentionBenchConfig, run_attention
from sglx.bench.diffusion_step import StepConfig, run_step

TARGETS = {"fa x cuDNN (attention, at least)": 1.15, "sglx / diffusers step time (at most)": 0.85}


def _versions() -> dict[str, str | None]:
    """Installed versions of the packages the run depends on (None: not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for dist in ("triton", "diffusers", "sageattention", "flash-attn-4", "nvidia-cutlass-dsl"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = None
    return out


def environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {"device": device.type, "torch": torch.__version__, "python": py_platform.python_version(),
                           "date": time.strftime("%Y-%m-%d %H:%M:%S"), **_versions()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(device_name=props.name, cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())
    else:
        env["device_name"] = py_platform.processor() or py_platform.machine()
    return env


def summarize(attention: list[dict[str, Any]], step: dict[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for case in attention:
        for r in case["rows"]:
            if r["kind"] == "sglx" and r.get("x_cudnn"):
                out[f"{r['backend']} x cuDNN, {case['shape']['title']}"] = round(r["x_cudnn"], 3)
    if step is not None:
        out["sglx / diffusers step time"] = round(step["sglx_over_diffusers"], 3)
        out["diffusers baseline attention"] = step["baseline"]
    return out


def run_diffusion_bench(attention: DiffusionAttentionBenchConfig | None, step: StepConfig | None,
                        device: torch.device, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    from sglx.llm.model_runner import snapshot_for

    snap = snapshot_for(device)
    att = run_attention(attention, device, snap, progress) if attention is not None else []
    stp = run_step(step, device, snap, progress) if step is not None else None
    timing = "CUDA events per run, 256 MB L2 flush before each, median" if device.type == "cuda" else "wall clock"
    return {"environment": environment(device), "timing": timing,
            "ratio": "x cuDNN = cuDNN time / this time (above 1 = faster); step ratio = sglx time / diffusers time",
            "targets": TARGETS, "attention_config": asdict(attention) if attention else None,
            "attention": att, "step": stp, "summary": summarize(att, stp),
            "failed": [f"{c['label']}: {r['backend']}: {r['error']}" for c in att for r in c["rows"]
                       if r["kind"] == "sglx" and r.get("error")]}


def attention_table(report: dict[str, Any]) -> Any:
    from rich.table import Table

    env = report["environment"]
    table = Table(title=f"DiT attention on {env.get('device_name')} (torch {env['torch']}, flash-attn-4 "
                        f"{env.get('flash-attn-4')}, sageattention {env.get('sageattention')})", title_justify="left")
    for col in ("shape", "backend", "max |err|", "median ms", "TFLOP/s", "x cuDNN"):
        table.add_column(col, justify="left" if col in ("shape", "backend") else "right")
    for case in report["attention"]:
        first = True
        for r in case["rows"]:
            name = r["backend"] + (f" ({r['detail']})" if r.get("detail") and r["kind"] == "sglx" else "")
            name = name if r["kind"] == "sglx" else f"[dim]{name}[/]"
            if r.get("error"):
                cells = ["", f"[red]{r['error'][:70]}[/]", "", ""]
            else:
                cells = [f"{r['max_abs_err']:.1e}", f"{r['median_ms']:.3f}", f"{r['tflops']:.4g}",
                         f"{r['x_cudnn']:.2f}x" if r.get("x_cudnn") else ""]
            table.add_row(case["label"] if first else "", name, *cells)
            first = False
        table.add_section()
    return table


def step_table(report: dict[str, Any]) -> Any:
    from rich.table import Table

    step = report["step"]
    table = Table(title=f"One Wan denoising step, {step['config']['frames']}x{step['config']['height']}x"
                        f"{step['config']['width']} ({step['tokens']} tokens, {step['model']['num_layers']} layers, "
                        f"dummy weights, {step['config']['dtype']})", title_justify="left")
    for col in ("side", "attention", "median ms", "vs best diffusers", "note"):
        table.add_column(col, justify="right" if col in ("median ms", "vs best diffusers") else "left")
    best = min(r["median_ms"] for r in step["rows"] if r["side"] == "diffusers" and "median_ms" in r)
    for r in step["rows"]:
        if "median_ms" not in r:
            table.add_row(r["side"], r["attention"], "", "", f"[dim]{r.get('error', '')[:70]}[/]")
            continue
        note = f"rel L2 vs baseline {r['rel_l2_vs_baseline']:.1e}" if "rel_l2_vs_baseline" in r else ""
        if r["side"] == "sglx":
            note += "; fused DiT kernels" if r.get("fused_kernels") else "; diffusers' element-wise torch (A/B)"
        if r["side"] == "diffusers" and r["median_ms"] == best:
            note = "baseline (fastest diffusers)"
        attention = r["attention"] + (f" ({r['variant']})" if r.get("variant") else "")
        table.add_row(r["side"], attention, f"{r['median_ms']:.1f}", f"{r['median_ms'] / best:.3f}", note)
    return table


def report_tables(report: dict[str, Any]) -> Any:
    from rich.console import Group

    parts = []
    if report["attention"]:
        parts.append(attention_table(report))
    if report["step"] is not None:
        parts.append(step_table(report))
    return Group(*parts)
