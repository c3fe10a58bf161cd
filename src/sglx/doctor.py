"""`sglx doctor`: which attention backends work on this machine, and exactly why the others don't."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from rich.console import Console, Group
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table

from sglx import __version__
from sglx.attention.checks import run_check
from sglx.attention.measured.record import gpu_class
from sglx.attention.registry import BackendSpec, LLMFeatures, all_backends, availability, chosen_variant
from sglx.attention.request import AttentionRequest, Family
from sglx.attention.requirements import device_name
from sglx.attention.selection import LLMBackendArgs, ModelTraits, select_diffusion, select_llm
from sglx.errors import BackendUnavailableError
from sglx.platform import KERNEL_PACKAGES, PlatformSnapshot

SECTIONS: tuple[tuple[str, Family, str], ...] = (
    ("LLM attention backends (MHA)", "llm", "mha"),
    ("LLM attention backends (MLA)", "llm", "mla"),
    ("Diffusion attention backends", "diffusion", "dit"),
)


def _machine(snap: PlatformSnapshot) -> dict[str, Any]:
    return {
        "device_kind": snap.device_kind,
        "gpus": [{"index": g.index, "name": g.name,
                  "capability": f"{g.capability[0]}.{g.capability[1]}" if g.capability else None,
                  "memory_gib": round(g.memory_bytes / 2**30, 1) if g.memory_bytes else None} for g in snap.gpus],
        "python": snap.python_version,
        "os": snap.os,
        "torch": snap.torch_version,
        "cuda": snap.cuda_version,
        "hip": snap.hip_version,
        "cudnn": snap.cudnn_version,
        "driver": snap.driver_version,
        "sglx": __version__,
        "gpu_class": gpu_class(snap),  # names the measured record auto ranks by (sglx/attention/measured/)
    }


def _packages(snap: PlatformSnapshot) -> list[dict[str, Any]]:
    out = []
    for pkg in KERNEL_PACKAGES:
        st = snap.package(pkg.module)
        out.append({"module": pkg.module, "installed": st.installed, "version": st.version, "error": st.error,
                    "install": None if st.installed else pkg.install_hint})
    return out


def _runs_prefill(spec: BackendSpec, snap: PlatformSnapshot) -> bool:
    """Whether some phase of `spec` runs here (prefill asks the least: `decode_requires` do not apply)."""
    return availability(spec, snap, AttentionRequest(family=spec.family, kind=spec.kind, phase="prefill")).ok


def _backend_rows(snap: PlatformSnapshot, family: Family, kind: str) -> list[dict[str, Any]]:
    rows = []
    for spec in all_backends(family, kind):  # type: ignore[arg-type]
        avail = availability(spec, snap, AttentionRequest(family=family, kind=spec.kind))
        row: dict[str, Any] = {"name": spec.name, "aliases": list(spec.aliases), "title": spec.title,
                               "implemented": spec.implemented, "usable": avail.ok, "reasons": list(avail.reasons),
                               # usable as --prefill-attention-backend only
                               "prefill_only": not avail.ok and _runs_prefill(spec, snap)}
        variant = chosen_variant(spec, snap) if avail.ok else None
        if variant is not None:  # which kernel of a several-kernel backend (fa: FA3 | FA4 | FA2) runs here
            row["variant"] = f"{variant.name} ({variant.module})"
        if isinstance(spec.features, LLMFeatures):
            row["cuda_graph"] = spec.features.cuda_graph
            rule = spec.page_size_rule(snap)
            row["page_sizes"] = list(rule.sizes) if rule else None
        else:  # what --ring-degree > 1 does with it: its own LSE kernel, PyTorch SDPA's (fallback), or refused
            row["ring_attention"] = spec.features.ring_attention
        rows.append(row)
    return rows


def _auto(snap: PlatformSnapshot, family: Family, kind: str) -> dict[str, Any]:
    try:
        if family == "llm":
            sel = select_llm(snap, ModelTraits(mla=kind == "mla"), LLMBackendArgs())
            considered = sel.considered
            result: dict[str, Any] = {"backend": sel.label, "page_size": sel.page_size, "why": sel.why}
            if sel.measured:  # the recorded medians behind the pick, each with its file, date and device
                result["measured"] = [{**asdict(r), "explanation": r.lines()} for r in sel.measured]
        else:
            dsel = select_diffusion(snap)
            considered = dsel.considered
            result = {"backend": dsel.backend, "why": dsel.why}
    except BackendUnavailableError as exc:
        return {"backend": None, "error": str(exc)}
    result["passed_over"] = [{"name": c.name, "reasons": list(c.reasons)} for c in considered if not c.ok]
    return result


def build_report(snap: PlatformSnapshot, family: Family | None = None, check: bool = False,
                 on_check: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Everything doctor shows, as plain data (what --json prints)."""
    report: dict[str, Any] = {"machine": _machine(snap), "packages": _packages(snap), "sections": []}
    for title, fam, kind in SECTIONS:
        if family and fam != family:
            continue
        section = {"title": title, "family": fam, "kind": kind, "backends": _backend_rows(snap, fam, kind),
                   "auto": _auto(snap, fam, kind)}
        if check:
            results = []
            for spec in all_backends(fam, kind):  # type: ignore[arg-type]
                if spec.implemented and _runs_prefill(spec, snap):  # a prefill-only backend's check: its prefill
                    if on_check:
                        on_check(f"{fam}/{kind}/{spec.name}")
                    results.append(asdict(run_check(spec, snap)))
            section["checks"] = results
        report["sections"].append(section)
    if family in (None, "diffusion"):
        report["diffusion_runtime"] = _diffusion_runtime(snap)
    return report


def _diffusion_runtime(snap: PlatformSnapshot) -> dict[str, Any]:
    """Which diffusers families sglx runs natively, whether diffusers is there, and the shipped models."""
    from sglx.diffusion.embedded import embedded_diffusion_models
    from sglx.diffusion.families import NATIVE_PIPELINES

    diffusers = snap.package("diffusers")
    return {"native_pipelines": sorted(NATIVE_PIPELINES), "diffusers": diffusers.version if diffusers.usable else None,
            "diffusers_error": diffusers.error, "embedded_models": sorted(embedded_diffusion_models())}


def _machine_panel(report: dict[str, Any]) -> Panel:
    m = report["machine"]
    lines = [f"[bold]device[/]  {device_name(m['device_kind'])}"]
    for g in m["gpus"]:
        cc = f", compute capability {g['capability']}" if g["capability"] else ""
        mem = f", {g['memory_gib']} GiB" if g["memory_gib"] else ""
        lines.append(f"[bold]gpu {g['index']}[/]   {g['name']}{cc}{mem}")
    versions = [f"sglx {m['sglx']}", f"python {m['python']}", f"torch {m['torch']}"]
    versions += [f"{k} {m[k]}" for k in ("cuda", "hip", "cudnn", "driver") if m[k]]
    lines.append("[bold]versions[/] " + ", ".join(versions))
    lines.append(f"[bold]os[/]      {m['os']}")
    if m.get("gpu_class"):
        lines.append(f"[bold]class[/]   {m['gpu_class']} (the name of its measured attention record)")
    return Panel("\n".join(lines), title="sglx doctor: this machine", expand=False)


def _packages_table(report: dict[str, Any]) -> Table:
    table = Table(title="Kernel packages", title_justify="left")
    table.add_column("package")
    table.add_column("status")
    table.add_column("version")
    table.add_column("detail")
    for p in report["packages"]:
        if p["installed"] and not p["error"]:
            status = "[green]installed[/]"
        elif p["installed"]:
            status = "[red]broken[/]"
        else:
            status = "[dim]not installed[/]"
        table.add_row(p["module"], status, p["version"] or "", escape(p["error"] or p["install"] or ""))
    return table


def _section_table(section: dict[str, Any]) -> Table:
    table = Table(title=section["title"], title_justify="left", show_lines=False)
    table.add_column("backend", no_wrap=True)
    table.add_column("usable", no_wrap=True)
    table.add_column("why not / notes")
    for row in section["backends"]:
        name = row["name"] + (f" ({', '.join(row['aliases'])})" if row["aliases"] else "")
        mark = "[green]yes[/]" if row["usable"] else "[yellow]prefill[/]" if row.get("prefill_only") else "[red]no[/]"
        notes = "; ".join(row["reasons"])
        if row["usable"] and row.get("variant"):
            notes = f"runs {row['variant']}"
        if row["usable"] and row.get("page_sizes"):
            notes = f"page size {', '.join(map(str, row['page_sizes']))}"
        if row["usable"] and row.get("cuda_graph") is False:
            notes = (notes + "; " if notes else "") + "no CUDA graphs"
        if row["usable"] and str(row.get("ring_attention", "")).startswith("fallback"):
            notes = (notes + "; " if notes else "") + "ring attention: PyTorch SDPA's LSE kernels (fallback)"
        table.add_row(name, mark, escape(notes))
    return table


def _auto_text(section: dict[str, Any]) -> str:
    what = {"mha": "an MHA model (Llama, Qwen)", "mla": "an MLA model (DeepSeek)", "dit": "a diffusion model"}
    auto = section["auto"]
    if auto.get("backend") is None:
        return f"[bold]auto for {what[section['kind']]}:[/] [red]nothing runs[/]\n" + escape(auto["error"])
    text = f"[bold]auto for {what[section['kind']]}:[/] [green]{auto['backend']}[/] ({auto['why']})"
    if auto.get("page_size"):
        text += f", page size {auto['page_size']}"
    for c in auto["passed_over"]:
        text += f"\n  passed over {c['name']}: " + escape("; ".join(c["reasons"]))
    for ranking in auto.get("measured", ()):
        text += "\n  " + escape("\n  ".join(ranking["explanation"]))
    return text


def _checks_table(section: dict[str, Any]) -> Table:
    table = Table(title=f"{section['title']}: --check", title_justify="left")
    for col in ("backend", "result", "max |err|", "time (ms, warm)", "problem / error"):
        table.add_column(col)
    for r in section["checks"]:
        color = {"pass": "green", "fail": "red", "broken": "red"}[r["status"]]
        err = f"{r['max_abs_error']:.2e}" if r["max_abs_error"] is not None else ""
        ms = f"{r['ms']:.2f}" if r["ms"] is not None else ""
        table.add_row(r["backend"], f"[{color}]{r['status']}[/]", err, ms, escape(r["error"] or r["problem"]))
    return table


def render(report: dict[str, Any], console: Console) -> None:
    console.print(_machine_panel(report))
    console.print(_packages_table(report))
    for section in report["sections"]:
        parts: list[Any] = [_section_table(section), _auto_text(section)]
        if "checks" in section:
            parts.append(_checks_table(section) if section["checks"] else "[dim]--check: no usable backend[/]")
        console.print(Group(*parts))
        console.print()
    runtime = report.get("diffusion_runtime")
    if runtime:
        have = f"diffusers {runtime['diffusers']}" if runtime["diffusers"] else \
            f"[red]diffusers missing[/] ({escape(runtime['diffusers_error'] or 'not installed')})"
        console.print(f"[bold]diffusion runtime:[/] {have}; native pipelines: "
                      f"{', '.join(runtime['native_pipelines'])} (others: --backend diffusers); embedded models: "
                      f"{', '.join(runtime['embedded_models']) or 'none'}")
