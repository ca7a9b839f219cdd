"""Render every `pdserve` command's flags into docs/configuration.md from the parser the CLI
itself runs (`pdserve.cli.build_parser`), so the page cannot drift from the code.

    .venv/bin/python docs/gen_config.py      # rewrites docs/configuration.md

tests/unit/test_docs.py fails while the committed page differs from what this renders.
Only the parser's public content is read (option strings, metavar, choices, default, help),
and the layout is this file's own, so the page does not change with Python's argparse.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from unittest import mock

PAGE = Path(__file__).resolve().parent / "configuration.md"
REGENERATE = ".venv/bin/python docs/gen_config.py"

# Read from the environment when the parser is built: rendered as if unset, so the page
# does not depend on the shell that made it.
_ENV_DEFAULTS = ("PDSERVE_API_KEY", "PDSERVE_ADMIN_API_KEY")

_HEADER = f"""# Configuration

Every flag of every `pdserve` command, with its default. This page is generated from the
parser the CLI runs (`pdserve/cli.py` `build_parser`) by `docs/gen_config.py`, and
`tests/unit/test_docs.py` fails while the two differ: after changing a flag, run
`{REGENERATE}`. What the main `serve` options do together is in
[serving.md](serving.md).

A blank default means the flag is unset and the component's own default applies; the
description gives it.
"""


def build_parser() -> argparse.ArgumentParser:
    from pdserve.cli import build_parser as cli_parser

    with mock.patch.dict(os.environ):
        for name in _ENV_DEFAULTS:
            os.environ.pop(name, None)
        return cli_parser()


def _subcommands(parser: argparse.ArgumentParser, prog: str):
    """(command line, parser, one-line help) of `parser`'s subcommands, depth first."""
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        helps = {a.dest: a.help for a in action._choices_actions}
        for name, sub in action.choices.items():
            yield f"{prog} {name}", sub, helps.get(name) or ""
            yield from _subcommands(sub, f"{prog} {name}")


def _metavar(action: argparse.Action) -> str:
    if action.metavar is not None:
        name = action.metavar
    elif action.choices is not None:
        name = "{" + ",".join(map(str, action.choices)) + "}"
    else:
        name = action.dest.upper() if action.option_strings else action.dest
    return {None: name, "?": f"[{name}]", "*": f"[{name} ...]",
            "+": f"{name} [{name} ...]"}.get(action.nargs, name)


def _usage(action: argparse.Action) -> str:
    if not action.option_strings:
        return _metavar(action)
    flags = ", ".join(action.option_strings)
    return flags if action.nargs == 0 else f"{flags} {_metavar(action)}"


def _default(action: argparse.Action) -> str:
    if action.required or not action.option_strings and action.nargs is None:
        return "required"
    d = action.default
    if d is None or d is argparse.SUPPRESS:
        return ""
    if isinstance(d, bool):
        return "on" if d else "off"
    return f"`{d}`"


def _help(action: argparse.Action, prog: str) -> str:
    text = action.help or ""
    # BooleanOptionalAction appends this in some Python versions; the default column has it.
    text = text.removesuffix(" (default: %(default)s)")
    text = text % dict(vars(action), prog=prog)
    return text.replace("|", "\\|").replace("<", "&lt;").replace("*", "\\*")


def render(parser: argparse.ArgumentParser | None = None) -> str:
    parser = parser or build_parser()
    out = [_HEADER]
    for prog, sub, summary in _subcommands(parser, parser.prog):
        out.append(f"## `{prog}`\n")
        if summary:
            out.append(summary.rstrip(".") + ".\n")
        rows = [a for a in sub._actions if a.help is not argparse.SUPPRESS
                and not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]
        if rows:
            out.append("| flag | default | description |\n|---|---|---|")
            out += [f"| `{_usage(a)}` | {_default(a)} | {_help(a, prog)} |" for a in rows]
            out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


def main() -> int:
    PAGE.write_text(render())
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
