"""The ``gdnprune`` command line: a thin layer over the Python API.

Each feature module registers its own subcommands through an ``add_commands(subparsers)`` function; a
subcommand sets ``func`` (called with the parsed arguments, returning an exit code). Heavy libraries
(transformers) are imported inside the commands so that ``--help`` stays fast.

Exit codes: 0 success, 1 a check failed (e.g. ``verify`` beyond tolerance), 2 an input error (the
message is one line on stderr), 130 interrupted.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from . import __version__

# modules that contribute subcommands, in the order they appear in --help
COMMAND_MODULES = ("gdnprune.checkpoint", "gdnprune.scoring", "gdnprune.demo")
# the module of each subcommand: running one imports only its module (checkpoint surgery never loads
# torch before it starts copying, which saves a second or more on every `sort` / `slice`)
MODULE_OF = {
    "inspect": "gdnprune.checkpoint", "sort": "gdnprune.checkpoint", "slice": "gdnprune.checkpoint",
    "verify": "gdnprune.checkpoint", "score": "gdnprune.scoring", "demo": "gdnprune.demo", "prune": "gdnprune.demo",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The top-level parser: with every subcommand, or only those of ``command``'s module."""
    parser = argparse.ArgumentParser(
        prog="gdnprune",
        description="Score, sort and slice the GatedDeltaNet (linear attention) layers of Qwen hybrid models.",
        epilog="Run `gdnprune COMMAND --help` for the options of a command.",
    )
    parser.add_argument("--version", action="version", version=f"gdnprune {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in (MODULE_OF[command],) if command in MODULE_OF else COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue  # feature not built yet
        module.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``gdnprune`` command; returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(next((a for a in argv if not a.startswith("-")), None))
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("gdnprune: interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError) as exc:  # input errors: one line, exit 2
        message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"gdnprune {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
