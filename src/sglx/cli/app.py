"""The `sglx` typer app: one module per subcommand, each only parsing arguments and calling the engine."""

from __future__ import annotations

import typer

from sglx import __version__
from sglx.cli.bench import bench_app
from sglx.cli.doctor import doctor
from sglx.cli.generate import generate
from sglx.cli.serve import serve

app = typer.Typer(
    name="sglx",
    help="Run LLMs and diffusion models fast, built around attention backends.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"sglx {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the sglx version and exit."),
) -> None:
    """sglx: attention backends for LLM serving and diffusion, with one engine behind every command."""


app.command(name="doctor")(doctor)
app.command(name="generate")(generate)
app.command(name="serve")(serve)
app.add_typer(bench_app, name="bench")


def main() -> None:
    app()
