"""`iterserve flags`: every `iterserve serve` flag, with its default and help, as Markdown.

Rendered from the serve parser itself (server flags plus one flag per EngineConfig field),
so docs/flags.md, which is this output, cannot drift from the code: tests/cli/test_flags_doc.py
renders it again and compares.
"""

from __future__ import annotations

import argparse
from typing import Any

from iterserve.cli import serve as server_cli

REGENERATE = "iterserve flags > docs/flags.md"
# Argparse names a parser's ungrouped options "options"; here they are the server's.
_GROUP_TITLES = {
    "options": "Server",
    "positional arguments": "Model",
    "EngineConfig": "Engine",
    "CacheConfig": "KV cache",
    "SchedulerConfig": "Scheduler",
    "SpeculativeConfig": "Speculative decoding",
}


def serve_parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="iterserve")
    server_cli.add_subcommands(root.add_subparsers())
    parser: argparse.ArgumentParser = root._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    return parser


def _flag_cell(action: argparse.Action) -> str:
    if not action.option_strings:  # a positional: `iterserve serve MODEL`
        return f"`{action.metavar or action.dest}`"
    if isinstance(action, argparse.BooleanOptionalAction):
        return "`--[no-]" + action.option_strings[0].removeprefix("--") + "`"
    return ", ".join(f"`{s}`" for s in action.option_strings)


def _default_cell(action: argparse.Action) -> str:
    default: Any = action.default
    if isinstance(action, argparse._StoreFalseAction) or default is None:
        return ""
    if isinstance(default, bool):
        return "on" if default else "off"
    return f"`{default}`"


def _help_cell(action: argparse.Action) -> str:
    text = " ".join((action.help or "").split()).replace("|", "\\|")
    if action.choices is not None:
        text += " (" + ", ".join(f"`{c}`" for c in action.choices) + ")"
    return text


def render_markdown(parser: argparse.ArgumentParser | None = None) -> str:
    parser = parser or serve_parser()
    lines = [
        "# `iterserve serve` flags",
        "",
        "Generated from the parser (`src/iterserve/config.py` and `src/iterserve/cli/serve.py`)"
        f" by `{REGENERATE}`; a test fails when this file is stale. `iterserve generate` takes "
        "the same engine flags (every group but Server). Every engine setting is also a "
        "keyword of `LLM(...)` and `EngineConfig`, with `-` written `_`.",
    ]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if not isinstance(a, argparse._HelpAction)]
        if not actions:
            continue
        title = _GROUP_TITLES.get(group.title or "", (group.title or "").capitalize())
        lines += ["", f"## {title}", "", "| flag | default | meaning |", "|---|---|---|"]
        lines += [f"| {_flag_cell(a)} | {_default_cell(a)} | {_help_cell(a)} |" for a in actions]
    return "\n".join(lines) + "\n"


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("flags", help="print every `iterserve serve` flag as Markdown")
    p.set_defaults(func=lambda _args: print(render_markdown(), end=""))
