"""Generate static bash, zsh and fish completion scripts by walking sglx's click command tree.

Static scripts (no Python at <TAB> time) stay instant even though importing sglx pulls in torch.
They are regenerated from the typer app, so every subcommand (nested groups too), option, short
flag and choice value appears without anyone restating it: `python -m sglx.completions` rewrites
`completions/`, `--check` exits 1 when a committed script is stale.

Completion values come from each parameter's own `shell_complete(ctx, "")`, which is how click and
typer themselves complete: Enum / Literal / click.Choice options yield their choices, Path options
yield file (or directory) completion, anything else completes nothing. Declare path-like options as
`pathlib.Path` to get file completion.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GENERATE_COMMAND = "python -m sglx.completions"
SHELLS = ("bash", "zsh", "fish")
FILE, DIR = "@file", "@dir"  # value kinds besides a choice list; () choices + "" kind = complete nothing


# ---------------------------------------------------------------- the command tree, as plain data


@dataclass(frozen=True)
class Values:
    """What to offer for an option's value or a positional argument."""

    choices: tuple[str, ...] = ()
    kind: str = ""  # FILE, DIR or "" (choices only)


@dataclass(frozen=True)
class OptionSpec:
    flags: tuple[str, ...]  # every spelling: long, short, and secondary (--no-x) forms
    nargs: int  # values the option consumes; 0 for flags
    values: Values
    help: str


@dataclass(frozen=True)
class ArgumentSpec:
    name: str
    nargs: int  # -1 = any number
    values: Values


@dataclass(frozen=True)
class CommandSpec:
    path: tuple[str, ...]  # ("sglx",), ("sglx", "doctor"), ("sglx", "bench", "attention")
    help: str
    options: tuple[OptionSpec, ...]
    arguments: tuple[ArgumentSpec, ...]
    subcommands: tuple[CommandSpec, ...]

    @property
    def key(self) -> str:
        return " ".join(self.path)

    def walk(self) -> list[CommandSpec]:
        """This command and every command below it, depth first, in declaration order."""
        out = [self]
        for sub in self.subcommands:
            out += sub.walk()
        return out


def _one_line(text: str | None) -> str:
    """First sentence of a help text, on one line, short enough for a completion menu."""
    text = " ".join((text or "").split())
    text = re.split(r"(?<=\.)\s", text, maxsplit=1)[0]
    return text if len(text) <= 100 else text[:97].rstrip() + "..."


def _is_path_param(param: Any) -> bool:
    """Typer >= 0.20 keeps `pathlib.Path` parameters off click.Path, and their shell_complete offers nothing."""
    return bool(getattr(getattr(param, "type_descriptor", None), "is_path", False))


def _path_kind(param: Any) -> str:
    info = param.type_descriptor.parameter_info
    return DIR if getattr(info, "dir_okay", True) and not getattr(info, "file_okay", True) else FILE


def _values(param: Any, ctx: Any) -> Values:
    try:
        items = param.shell_complete(ctx, "")
    except Exception:  # a custom completer that needs a live context: offer nothing rather than fail
        return Values()
    kinds = {getattr(i, "type", "plain") for i in items}
    if "dir" in kinds:
        return Values(kind=DIR)
    if "file" in kinds:
        return Values(kind=FILE)
    if not items and _is_path_param(param):
        return Values(kind=_path_kind(param))
    choices = tuple(dict.fromkeys(str(i.value) for i in items if getattr(i, "type", "plain") == "plain"))
    for choice in choices:
        if not choice or any(c.isspace() or c in "'\"\\$`" for c in choice):
            raise ValueError(f"completion value {choice!r} of {param.name!r} cannot be written into a static script")
    return Values(choices=choices)


def _is_group(command: Any) -> bool:
    return hasattr(command, "list_commands") and hasattr(command, "get_command")


def describe_command(command: Any, path: tuple[str, ...], parent_ctx: Any = None) -> CommandSpec:
    """Walk one click (or typer's vendored click) command and everything below it into plain data."""
    ctx = command.context_class(command, info_name=path[-1], parent=parent_ctx)
    options, arguments = [], []
    for param in command.get_params(ctx):
        if getattr(param, "hidden", False):
            continue
        if getattr(param, "param_type_name", "") == "argument":
            arguments.append(ArgumentSpec(param.name or "arg", param.nargs, _values(param, ctx)))
            continue
        takes_value = not (getattr(param, "is_flag", False) or getattr(param, "count", False))
        flags = tuple(dict.fromkeys([*param.opts, *param.secondary_opts]))
        options.append(OptionSpec(flags, max(param.nargs, 1) if takes_value else 0,
                                  _values(param, ctx) if takes_value else Values(), _one_line(param.help)))
    subcommands = []
    if _is_group(command):
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            if sub is not None and not getattr(sub, "hidden", False):
                subcommands.append(describe_command(sub, (*path, name), ctx))
    help_text = command.get_short_help_str(limit=100) if hasattr(command, "get_short_help_str") else command.help
    return CommandSpec(path, _one_line(help_text), tuple(options), tuple(arguments), tuple(subcommands))


def sglx_tree() -> CommandSpec:
    """The command tree of the real `sglx` executable."""
    import typer

    from sglx.cli.app import app

    command = typer.main.get_command(app)
    return describe_command(command, (command.name or "sglx",))


def _positional_values(cmd: CommandSpec) -> Values:
    """Values for a positional word of a leaf command: union of its arguments' choices, or files."""
    choices = tuple(dict.fromkeys(c for a in cmd.arguments for c in a.values.choices))
    kinds = {a.values.kind for a in cmd.arguments}
    kind = DIR if kinds == {DIR} else (FILE if kinds & {FILE, DIR} else "")
    return Values(choices, kind)


# ---------------------------------------------------------------- bash


def _sq(text: str) -> str:
    """A single-quoted word for sh-like shells."""
    return "'" + text.replace("'", "'\\''") + "'"


def _bash_case(name: str, doc: str, entries: list[tuple[str, str]], default: str = "") -> list[str]:
    lines = [f"# {doc}", f"{name}() {{", '    case "$1" in']
    lines += [f"        {_sq(key)}) echo {_sq(value)} ;;" for key, value in entries]
    lines += [f"        *) echo {_sq(default)} ;;" if default else "        *) ;;", "    esac", "}", ""]
    return lines


def _values_word(values: Values) -> str:
    return values.kind or " ".join(values.choices)


def render_bash(tree: CommandSpec) -> str:
    prog = tree.path[0]
    fn = "_" + re.sub(r"\W", "_", prog)
    cmds = tree.walk()
    subs = [(c.key, " ".join(s.path[-1] for s in c.subcommands)) for c in cmds if c.subcommands]
    opts = [(c.key, " ".join(f for o in c.options for f in o.flags)) for c in cmds if c.options]
    nargs = [(f"{c.key} {f}", str(o.nargs)) for c in cmds for o in c.options if o.nargs for f in o.flags]
    values = [(f"{c.key} {f}", _values_word(o.values)) for c in cmds for o in c.options
              if o.nargs and _values_word(o.values) for f in o.flags]
    args = [(c.key, _values_word(_positional_values(c))) for c in cmds
            if c.arguments and not c.subcommands and _values_word(_positional_values(c))]
    head = [
        f"# bash completion for {prog}. GENERATED by `{GENERATE_COMMAND}` from the CLI; do not edit.",
        f"# Install: add `source /path/to/completions/{prog}.bash` to ~/.bashrc.",
        "",
    ]
    tables = [
        *_bash_case(f"{fn}_subcommands", "subcommands of a command path", subs),
        *_bash_case(f"{fn}_options", "options of a command path", opts),
        *_bash_case(f"{fn}_nargs", "how many values an option takes ('path option'); 0 for flags", nargs, "0"),
        *_bash_case(f"{fn}_values", "an option's values: words, @file or @dir ('path option')", values),
        *_bash_case(f"{fn}_arguments", "positional values of a leaf command: words, @file or @dir", args),
    ]
    body = f"""# COMPREPLY from compgen, one entry per line (keeps file names with spaces whole)
{fn}_compgen() {{
    COMPREPLY=()
    local line
    while IFS= read -r line; do
        [[ -n $line ]] && COMPREPLY+=("$line")
    done < <(compgen "$@")
}}

# offer a value list (words, @file or @dir) for the word being completed
{fn}_offer() {{
    case "$1" in
        @file) compopt -o filenames 2>/dev/null; {fn}_compgen -f -- "$2" ;;
        @dir) compopt -o filenames 2>/dev/null; {fn}_compgen -d -- "$2" ;;
        *) {fn}_compgen -W "$1" -- "$2" ;;
    esac
}}

{fn}() {{
    local cur="${{COMP_WORDS[COMP_CWORD]}}"
    local path={_sq(prog)} word opt='' pending=0 i=1
    # Walk the words before the cursor: descend into subcommands, skip the values options consume.
    while (( i < COMP_CWORD )); do
        word="${{COMP_WORDS[i]}}"
        if [[ $word == '=' && -n $opt ]]; then
            :
        elif (( pending > 0 )); then
            pending=$(( pending - 1 ))
        elif [[ $word == -* ]]; then
            opt="$word"
            [[ $word == *=* ]] || pending=$({fn}_nargs "$path $word")
        elif [[ " $({fn}_subcommands "$path") " == *" $word "* ]]; then
            path="$path $word"
        fi
        (( i++ ))
    done
    # The value of an option: `--opt VALUE`, `--opt=VALUE` split at '=', or `--opt=VALUE` as one word.
    if (( pending > 0 )) || [[ $cur == '=' && -n $opt ]] || [[ ${{COMP_WORDS[COMP_CWORD-1]}} == '=' && -n $opt ]]; then
        [[ $cur == '=' ]] && cur=''
        {fn}_offer "$({fn}_values "$path $opt")" "$cur"
        return 0
    fi
    if [[ $cur == --*=* ]]; then
        local prefix="${{cur%%=*}}="
        {fn}_offer "$({fn}_values "$path ${{cur%%=*}}")" "${{cur#*=}}"
        local j
        for j in "${{!COMPREPLY[@]}}"; do COMPREPLY[j]="$prefix${{COMPREPLY[j]}}"; done
        return 0
    fi
    if [[ $cur == -* ]]; then
        {fn}_compgen -W "$({fn}_options "$path")" -- "$cur"
        return 0
    fi
    local subs
    subs="$({fn}_subcommands "$path")"
    if [[ -n $subs ]]; then
        {fn}_compgen -W "$subs" -- "$cur"
        return 0
    fi
    local positional
    positional="$({fn}_arguments "$path")"
    if [[ -n $positional ]]; then
        {fn}_offer "$positional" "$cur"
    else
        {fn}_compgen -W "$({fn}_options "$path")" -- "$cur"
    fi
    return 0
}}

complete -F {fn} {prog}
"""
    return "\n".join(head + tables) + "\n" + body


# ---------------------------------------------------------------- zsh


def _zsh_desc(text: str) -> str:
    """Text for inside an _arguments [description] or a _describe 'name:description' entry."""
    return text.replace("\\", "\\\\").replace("[", "\\[").replace("]", "\\]").replace("'", "'\\''")


def _zsh_action(values: Values) -> str:
    if values.kind == FILE:
        return "_files"
    if values.kind == DIR:
        return "_path_files -/"
    return f"({' '.join(values.choices)})" if values.choices else " "


def _zsh_function(cmd: CommandSpec) -> str:
    return "_" + "_".join(re.sub(r"\W", "_", p) for p in cmd.path)


def _zsh_option_specs(option: OptionSpec) -> list[str]:
    exclusive = f"({' '.join(option.flags)})" if len(option.flags) > 1 else ""
    long = [f for f in option.flags if f.startswith("--")]
    metavar = (long or list(option.flags))[0].lstrip("-").replace(":", "_")
    specs = []
    for flag in option.flags:
        eq = "=" if flag.startswith("--") and option.nargs else ""
        spec = f"{exclusive}{flag}{eq}[{_zsh_desc(option.help)}]"
        if option.nargs:
            spec += f":{metavar}:{_zsh_action(option.values)}" * option.nargs
        specs.append("'" + spec + "'")
    return specs


def _zsh_command(cmd: CommandSpec) -> list[str]:
    specs = [s for o in cmd.options for s in _zsh_option_specs(o)]
    name = _zsh_function(cmd)
    if cmd.subcommands:
        specs += ["'1:command:->command'", "'*::argument:->argument'"]
        entries = [_sq(s.path[-1].replace(":", "\\:") + ":" + s.help) for s in cmd.subcommands]
        cases = [f"                {_sq(s.path[-1])}) {_zsh_function(s)} ;;" for s in cmd.subcommands]
        return [
            f"{name}() {{",
            '    local curcontext="$curcontext" state state_descr line ret=1',
            "    typeset -A opt_args",
            "    _arguments -C -s \\",
            *[f"        {s} \\" for s in specs[:-1]], f"        {specs[-1]} && ret=0",
            "    case $state in",
            "        command)",
            "            local -a commands",
            "            commands=(",
            *[f"                {e}" for e in entries],
            "            )",
            f"            _describe -t commands {_sq(cmd.key + ' command')} commands && ret=0",
            "            ;;",
            "        argument)",
            '            curcontext="${curcontext%:*:*}:' + "-".join(cmd.path) + '-${words[1]}:"',
            "            case ${words[1]} in",
            *cases,
            "            esac",
            "            ret=$?",
            "            ;;",
            "    esac",
            "    return ret",
            "}",
            "",
        ]
    for i, arg in enumerate(cmd.arguments, start=1):
        pos = "*" if arg.nargs < 0 else str(i)
        specs.append(f"'{pos}:{arg.name.replace(':', '_')}:{_zsh_action(arg.values)}'")
    if not specs:
        return [f"{name}() {{", "    _message 'no arguments'", "}", ""]
    return [f"{name}() {{", "    _arguments -s \\", *[f"        {s} \\" for s in specs[:-1]],
            f"        {specs[-1]}", "}", ""]


def render_zsh(tree: CommandSpec) -> str:
    prog = tree.path[0]
    top = _zsh_function(tree)
    lines = [
        f"#compdef {prog}",
        f"# zsh completion for {prog}. GENERATED by `{GENERATE_COMMAND}` from the CLI; do not edit.",
        f"# Install: copy to a directory in $fpath as _{prog}, or `source` it from ~/.zshrc after compinit.",
        "",
    ]
    for cmd in tree.walk():
        lines += _zsh_command(cmd)
    lines += [
        'if [[ "${zsh_eval_context[-1]}" == loadautofunc ]]; then',
        f'    {top} "$@"',
        "else",
        f"    compdef {top} {prog}",
        "fi",
    ]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- fish


def _fq(text: str) -> str:
    """A single-quoted fish word."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _fish_switch(name: str, doc: str, entries: list[tuple[str, list[str]]], default: str | None = None) -> list[str]:
    lines = [f"# {doc}", f"function {name}", "    switch $argv[1]"]
    for key, words in entries:
        lines += [f"        case {_fq(key)}", *[f"            echo {_fq(w)}" for w in words]]
    if default is not None:
        lines += ["        case '*'", f"            echo {default}"]
    return [*lines, "    end", "end", ""]


def _fish_flag_args(flag: str) -> str:
    if flag.startswith("--"):
        return f"-l {_fq(flag[2:])}"
    if len(flag) == 2:
        return f"-s {_fq(flag[1:])}"
    return f"-o {_fq(flag[1:])}"


def _fish_value_args(values: Values) -> str:
    if values.kind == FILE:
        return "-r -F"
    if values.kind == DIR:
        return "-x -a '(__fish_complete_directories (commandline -ct))'"
    return f"-x -a {_fq(' '.join(values.choices))}" if values.choices else "-x"


def render_fish(tree: CommandSpec) -> str:
    prog = tree.path[0]
    fn = "__" + re.sub(r"\W", "_", prog)
    cmds = tree.walk()
    subs = [(c.key, [s.path[-1] for s in c.subcommands]) for c in cmds if c.subcommands]
    nargs = [(f"{c.key} {f}", [str(o.nargs)]) for c in cmds for o in c.options if o.nargs for f in o.flags]
    lines = [
        f"# fish completion for {prog}. GENERATED by `{GENERATE_COMMAND}` from the CLI; do not edit.",
        f"# Install: copy to ~/.config/fish/completions/{prog}.fish",
        "",
        *_fish_switch(f"{fn}_subcommands", "subcommands of a command path", subs),
        *_fish_switch(f"{fn}_nargs", "how many values an option takes ('path option'); 0 for flags", nargs, "0"),
        "# the command path at the cursor: subcommands descended into, option values skipped",
        f"function {fn}_path",
        "    set -l words (commandline -opc)",
        f"    set -l path {_fq(prog)}",
        "    set -l skip 0",
        "    for word in $words[2..-1]",
        "        if test $skip -gt 0",
        "            set skip (math $skip - 1)",
        "        else if string match -q -- '-*' $word",
        "            if not string match -q -- '*=*' $word",
        f'                set skip ({fn}_nargs "$path $word")',
        "            end",
        f'        else if contains -- $word ({fn}_subcommands "$path")',
        '            set path "$path $word"',
        "        end",
        "    end",
        "    echo $path",
        "end",
        "",
        f"function {fn}_at",
        f'    test ({fn}_path) = "$argv[1]"',
        "end",
        "",
        f"complete -c {prog} -f",
    ]
    for cmd in cmds:
        cond = f"-n {_fq(f'{fn}_at {_fq(cmd.key)}')}"
        lines.append(f"# {cmd.key}")
        for sub in cmd.subcommands:
            lines.append(f"complete -c {prog} {cond} -a {_fq(sub.path[-1])} -d {_fq(sub.help)}")
        for option in cmd.options:
            flag_args = " ".join(_fish_flag_args(f) for f in option.flags)
            value_args = f" {_fish_value_args(option.values)}" if option.nargs else ""
            lines.append(f"complete -c {prog} {cond} {flag_args}{value_args} -d {_fq(option.help)}")
        if cmd.arguments and not cmd.subcommands:
            pos = _positional_values(cmd)
            if pos.kind == FILE:
                lines.append(f"complete -c {prog} {cond} -F")
            elif pos.kind == DIR:
                lines.append(f"complete -c {prog} {cond} -a '(__fish_complete_directories (commandline -ct))'")
            elif pos.choices:
                lines.append(f"complete -c {prog} {cond} -a {_fq(' '.join(pos.choices))}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- command

RENDERERS: dict[str, Callable[[CommandSpec], str]] = {"bash": render_bash, "zsh": render_zsh, "fish": render_fish}


def render_all(tree: CommandSpec | None = None) -> dict[str, str]:
    """File name -> script text for every shell."""
    tree = tree or sglx_tree()
    prog = tree.path[0]
    return {f"{prog}.{shell}": RENDERERS[shell](tree) for shell in SHELLS}


def default_dir() -> Path:
    """completions/ of the source checkout when running from one (editable install), else under cwd."""
    root = Path(__file__).resolve().parents[2]
    return (root if (root / "pyproject.toml").is_file() else Path.cwd()) / "completions"


def stale(directory: Path, scripts: dict[str, str]) -> list[str]:
    """One message per script that is missing or differs from the generated text."""
    problems = []
    for name, text in scripts.items():
        path = directory / name
        if not path.is_file():
            problems.append(f"{path} does not exist")
            continue
        actual = path.read_text(encoding="utf-8")
        if actual != text:
            diff = list(difflib.unified_diff(actual.splitlines(), text.splitlines(), "on disk", "generated",
                                             lineterm="", n=0))
            problems.append(f"{path} is stale:\n" + "\n".join(diff[:20]) + ("\n..." if len(diff) > 20 else ""))
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=GENERATE_COMMAND, description="Generate shell completions from the CLI.")
    parser.add_argument("--check", action="store_true", help="exit 1 if a committed script is stale; write nothing")
    parser.add_argument("--output-dir", type=Path, default=None, help="directory (default: completions/)")
    args = parser.parse_args(argv)
    directory = args.output_dir or default_dir()
    scripts = render_all()
    if args.check:
        problems = stale(directory, scripts)
        if problems:
            print("\n".join(problems) + f"\nrun {GENERATE_COMMAND}", file=sys.stderr)
            return 1
        print(f"completions in {directory} are up to date")
        return 0
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in scripts.items():
        path = directory / name
        if path.is_file() and path.read_text(encoding="utf-8") == text:
            continue
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
