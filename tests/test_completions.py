"""Shell completions are generated from the CLI: current, valid in each shell, and they really complete.

Behaviour is checked in the real shells (bash always; zsh and fish when installed), both on the committed
`sglx` scripts and on a throwaway CLI with a nested group, Path options and positional choices, so the
generator is exercised on command shapes sglx will grow into.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
from enum import Enum
from pathlib import Path

import pytest
import typer

from sglx import completions
from sglx.completions import CommandSpec, describe_command, render_all

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "completions"
needs_zsh = pytest.mark.skipif(shutil.which("zsh") is None, reason="zsh is not installed")
needs_fish = pytest.mark.skipif(shutil.which("fish") is None, reason="fish is not installed")


# ---------------------------------------------------------------- a CLI shaped like sglx's future


class Kind(str, Enum):
    mha = "mha"
    mla = "mla"


fake_app = typer.Typer(name="sglx", add_completion=False)
bench_app = typer.Typer(help="Benchmarks.")
fake_app.add_typer(bench_app, name="bench")


@fake_app.callback()
def _root(version: bool = typer.Option(False, "--version", help="Print the version.")) -> None:
    """Root."""


@fake_app.command()
def doctor(family: Kind = typer.Option(None, "--family", "-f", help="Which [family]: it's 'quoted'.")) -> None:
    """Doctor."""


@bench_app.command("attention")
def attention(
    backend: Kind = typer.Argument(..., help="Backend."),
    kind: Kind = typer.Option(Kind.mha, "--kind", "-k", help="Kind."),
    out: Path = typer.Option(None, "--out", "-o", help="Output file."),
    cache: Path = typer.Option(None, "--cache-dir", file_okay=False, help="A directory."),
    steps: int = typer.Option(3, "--steps", help="Steps."),
    verbose: bool = typer.Option(False, "--verbose/--quiet", "-v", help="Verbosity."),
    secret: int = typer.Option(0, "--secret", hidden=True),
) -> None:
    """Attention kernels."""


@bench_app.command("hidden-one", hidden=True)
def hidden_one() -> None:
    """Never offered."""


@pytest.fixture(scope="module")
def fake_tree() -> CommandSpec:
    return describe_command(typer.main.get_command(fake_app), ("sglx",))


@pytest.fixture(scope="module")
def fake_scripts(tmp_path_factory: pytest.TempPathFactory, fake_tree: CommandSpec) -> Path:
    out = tmp_path_factory.mktemp("fake_completions")
    for name, text in render_all(fake_tree).items():
        (out / name).write_text(text, encoding="utf-8")
    work = out / "cwd"
    (work / "subdir").mkdir(parents=True)
    (work / "afile.txt").write_text("x", encoding="utf-8")
    return out


# ---------------------------------------------------------------- shell drivers


def bash_complete(script: Path, line: str, cwd: Path | None = None) -> list[str]:
    """COMPREPLY of the generated function for `line` (the cursor is at its end)."""
    words = line.split(" ")
    program = "\n".join([
        f"source {shlex.quote(str(script))}",
        f"COMP_WORDS=({' '.join(shlex.quote(w) for w in words)})",
        f"COMP_CWORD={len(words) - 1}",
        "_sglx",
        'printf "%s\\n" "${COMPREPLY[@]}"',
    ])
    proc = subprocess.run(["bash", "--norc", "--noprofile", "-c", program], capture_output=True, text=True,
                          timeout=30, cwd=cwd, check=False)
    assert proc.returncode == 0 and not proc.stderr, proc.stderr
    return [w for w in proc.stdout.splitlines() if w]


def fish_complete(script: Path, line: str, cwd: Path | None = None) -> list[str]:
    program = f"source {shlex.quote(str(script))}; complete -C {shlex.quote(line)}"
    proc = subprocess.run(["fish", "--no-config", "-c", program], capture_output=True, text=True, timeout=30,
                          cwd=cwd, check=False)
    assert proc.returncode == 0 and not proc.stderr, proc.stderr
    return [w.split("\t")[0] for w in proc.stdout.splitlines() if w]


# Drives an interactive zsh through zpty: a widget runs completion, compadd is wrapped to print the matches.
ZSH_DRIVER = r"""
zmodload zsh/zpty
zpty z zsh -f -i
zpty -w z 'PROMPT= ; RPROMPT= ; autoload -U compinit; compinit -u -D'
zpty -w z "source ${(q)1}"
zpty -w z 'compadd () { if [[ ${@[1,(i)(-|--)]} == *-(O|A|D)\ * ]]; then builtin compadd "$@"; return $?; fi; typeset -a __hits; builtin compadd -A __hits "$@"; local h; for h in $__hits; do print -r -- "<HIT>$h</HIT>"; done; }'
zpty -w z '_capture() { zle complete-word; print -r -- "<DO""NE>"; }; zle -N _capture; bindkey "^T" _capture'
shift
local line cmd
for cmd in "$@"; do
  zpty -w -n z "$cmd"$'\C-t'
  print -r -- "<CASE>"
  while zpty -r z line; do
    [[ $line == *'<HIT>'* && $line != *'print -r'* ]] && print -r -- "${${line##*<HIT>}%%</HIT>*}"
    [[ $line == *'<DONE>'* ]] && break
  done
  zpty -w z $'\C-u'
done
zpty -d z
"""  # noqa: E501


def zsh_complete(script: Path, lines: list[str], cwd: Path | None = None) -> list[list[str]]:
    proc = subprocess.run(["zsh", "-f", "-c", ZSH_DRIVER, "driver", str(script), *lines], capture_output=True,
                          text=True, timeout=60, cwd=cwd, check=False)
    assert proc.returncode == 0, proc.stderr
    cases = proc.stdout.split("<CASE>\n")[1:]
    assert len(cases) == len(lines), proc.stdout
    return [[w for w in case.splitlines() if w] for case in cases]


# ---------------------------------------------------------------- the committed scripts


def test_committed_scripts_are_current() -> None:
    for name, text in render_all().items():
        path = COMMITTED / name
        committed = path.read_text(encoding="utf-8") if path.is_file() else ""
        assert committed == text, f"completions/{name} is stale: run python -m sglx.completions"


def test_check_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert completions.main(["--check", "--output-dir", str(tmp_path)]) == 1
    assert "run python -m sglx.completions" in capsys.readouterr().err
    assert completions.main(["--output-dir", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sglx.bash", "sglx.fish", "sglx.zsh"]
    assert completions.main(["--check", "--output-dir", str(tmp_path)]) == 0
    (tmp_path / "sglx.zsh").write_text("# edited\n", encoding="utf-8")
    assert completions.main(["--check", "--output-dir", str(tmp_path)]) == 1
    assert "sglx.zsh is stale" in capsys.readouterr().err


def test_bash_syntax() -> None:
    subprocess.run(["bash", "-n", str(COMMITTED / "sglx.bash")], check=True, timeout=30)


@needs_zsh
def test_zsh_syntax() -> None:
    subprocess.run(["zsh", "-n", str(COMMITTED / "sglx.zsh")], check=True, timeout=30)


@needs_fish
def test_fish_syntax() -> None:
    subprocess.run(["fish", "--no-execute", str(COMMITTED / "sglx.fish")], check=True, timeout=30)


def test_bash_completes_sglx() -> None:
    script = COMMITTED / "sglx.bash"
    assert "doctor" in bash_complete(script, "sglx doc")
    assert bash_complete(script, "sglx doctor --fa") == ["--family"]
    assert bash_complete(script, "sglx doctor --family ") == ["llm", "diffusion"]
    assert bash_complete(script, "sglx doctor --family d") == ["diffusion"]
    assert bash_complete(script, "sglx doctor --family=l") == ["--family=llm"]
    assert bash_complete(script, "sglx doctor --family llm --j") == ["--json"]
    assert "--version" in bash_complete(script, "sglx --")


@needs_fish
def test_fish_completes_sglx() -> None:
    script = COMMITTED / "sglx.fish"
    assert "doctor" in fish_complete(script, "sglx doc")
    assert fish_complete(script, "sglx doctor --fa") == ["--family"]
    assert sorted(fish_complete(script, "sglx doctor --family ")) == ["diffusion", "llm"]


@needs_zsh
def test_zsh_completes_sglx() -> None:
    doc, fa, family = zsh_complete(COMMITTED / "sglx.zsh", ["sglx doc", "sglx doctor --fa", "sglx doctor --family "])
    assert "doctor" in doc and fa == ["--family"] and sorted(family) == ["diffusion", "llm"]


# ---------------------------------------------------------------- the generator, on a nested CLI


def test_tree_walks_nested_groups_and_skips_hidden(fake_tree: CommandSpec) -> None:
    assert [c.key for c in fake_tree.walk()] == ["sglx", "sglx doctor", "sglx bench", "sglx bench attention"]
    leaf = fake_tree.walk()[-1]
    flags = {f: o for o in leaf.options for f in o.flags}
    assert "--secret" not in flags
    assert flags["-k"].values.choices == ("mha", "mla") and flags["-k"] is flags["--kind"]
    assert flags["--out"].values.kind == completions.FILE and flags["--cache-dir"].values.kind == completions.DIR
    assert flags["--quiet"].nargs == 0 and flags["--steps"].nargs == 1 and flags["--steps"].values.choices == ()
    assert leaf.arguments[0].values.choices == ("mha", "mla")


def test_nested_scripts_are_valid(fake_scripts: Path) -> None:
    subprocess.run(["bash", "-n", str(fake_scripts / "sglx.bash")], check=True, timeout=30)
    if shutil.which("zsh"):
        subprocess.run(["zsh", "-n", str(fake_scripts / "sglx.zsh")], check=True, timeout=30)
    if shutil.which("fish"):
        subprocess.run(["fish", "--no-execute", str(fake_scripts / "sglx.fish")], check=True, timeout=30)


def test_bash_completes_nested(fake_scripts: Path) -> None:
    script, cwd = fake_scripts / "sglx.bash", fake_scripts / "cwd"
    assert bash_complete(script, "sglx ") == ["doctor", "bench"]
    assert bash_complete(script, "sglx bench att") == ["attention"]
    assert bash_complete(script, "sglx bench attention --k") == ["--kind"]
    assert bash_complete(script, "sglx bench attention -k ") == ["mha", "mla"]
    assert bash_complete(script, "sglx bench attention -k mla ") == ["mha", "mla"]  # the positional backend
    assert sorted(bash_complete(script, "sglx bench attention --out ", cwd)) == ["afile.txt", "subdir"]
    assert bash_complete(script, "sglx bench attention --cache-dir ", cwd) == ["subdir"]
    assert bash_complete(script, "sglx bench attention --steps ", cwd) == []
    assert "--quiet" in bash_complete(script, "sglx bench attention --steps 3 --")
    assert bash_complete(script, "sglx --version bench ") == ["attention"]
    assert bash_complete(script, "sglx doctor -f ") == ["mha", "mla"]


@needs_fish
def test_fish_completes_nested(fake_scripts: Path) -> None:
    script, cwd = fake_scripts / "sglx.fish", fake_scripts / "cwd"
    assert fish_complete(script, "sglx bench ") == ["attention"]
    assert fish_complete(script, "sglx bench attention -k ") == ["mha", "mla"]
    assert fish_complete(script, "sglx bench attention --cache-dir ", cwd) == ["subdir/"]
    assert "--quiet" in fish_complete(script, "sglx bench attention --steps 3 -")


@needs_zsh
def test_zsh_completes_nested(fake_scripts: Path) -> None:
    bench, kind, cache, doctor_f = zsh_complete(
        fake_scripts / "sglx.zsh",
        ["sglx bench ", "sglx bench attention -k ", "sglx bench attention --cache-dir ", "sglx doctor -f "],
        cwd=fake_scripts / "cwd",
    )
    assert bench == ["attention"] and kind == ["mha", "mla"] and cache == ["subdir"] and doctor_f == ["mha", "mla"]
