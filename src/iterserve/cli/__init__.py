"""The `iterserve` command: the root parser and its subcommands (serve, generate, bench,
simulate, flags), each in its own module here; the subcommands' handlers call into the
packages that do the work."""

from iterserve.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
