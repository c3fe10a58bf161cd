"""`sglx doctor`: argument handling only; the report is built by sglx.doctor."""

from __future__ import annotations

import json
from enum import Enum

import typer
from rich.console import Console


class FamilyChoice(str, Enum):
    llm = "llm"
    diffusion = "diffusion"


def doctor(
    json_output: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    family: FamilyChoice | None = typer.Option(None, "--family", help="Only LLM or only diffusion backends."),
    check: bool = typer.Option(False, "--check",
                               help="Run every usable backend on a small random problem against a float64 reference."),
) -> None:
    """Which attention backends work on this machine, why the others don't, and what auto-selection picks."""
    from sglx import doctor as engine
    from sglx import platform

    snap = platform.current()
    fam = family.value if family else None
    if json_output:
        report = engine.build_report(snap, fam, check)  # type: ignore[arg-type]
        typer.echo(json.dumps(report, indent=2))
        return
    console = Console()
    with console.status("checking backends...") as status:
        report = engine.build_report(snap, fam, check,  # type: ignore[arg-type]
                                     on_check=lambda name: status.update(f"--check: running {name}"))
    engine.render(report, console)
