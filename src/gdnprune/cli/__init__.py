"""The ``gdnprune`` command line: one module per subcommand, over a library that never prints.

Each command module has ``NAME``, ``HELP``, ``add_parser(subparsers)`` and ``run(args) -> exit code``,
and imports the library inside ``run``, so that ``gdnprune --help`` stays fast and ``inspect``, ``sort``
and ``slice`` never load torch. This package owns every message and exit code:

* 0 success, 1 a check failed (``verify`` beyond tolerance), 2 an input error (one line on stderr),
  128 + the signal number when SIGINT (130), SIGTERM (143) or SIGHUP (129) stopped the run — after the
  partial output was removed; a signal that arrives while a finished output is being moved into place is
  held until the move is done, and the run then exits 0 with a note;
* library warnings are shown as one ``gdnprune COMMAND: warning: ...`` line each.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import warnings

from .. import __version__

#: subcommand -> its module, in the order of ``--help``
COMMANDS = {
    "inspect": "gdnprune.cli.inspect",
    "sort": "gdnprune.cli.sort",
    "slice": "gdnprune.cli.slice",
    "verify": "gdnprune.cli.verify",
    "score": "gdnprune.cli.score",
    "plan": "gdnprune.cli.plan",
    "prune": "gdnprune.cli.prune",
    "distill": "gdnprune.cli.distill",
    "demo": "gdnprune.cli.demo",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The top-level parser: with every subcommand, or only ``command`` when it is one."""
    parser = argparse.ArgumentParser(
        prog="gdnprune",
        description="Score, sort and slice the GatedDeltaNet (linear attention) layers of Qwen hybrid models.",
        epilog="Run `gdnprune COMMAND --help` for the options of a command.",
    )
    parser.add_argument("--version", action="version", version=f"gdnprune {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in (command,) if command in COMMANDS else COMMANDS:
        importlib.import_module(COMMANDS[name]).add_parser(sub)
    return parser


class _StderrWarnings:
    """Show warnings as one ``gdnprune CMD: warning: ...`` line on stderr while a command runs."""

    def __init__(self, command: str):
        self.command = command
        self._ctx = warnings.catch_warnings()

    def __enter__(self):
        self._ctx.__enter__()
        warnings.simplefilter("always", UserWarning)

        def show(message, category, filename, lineno, file=None, line=None):
            print(f"gdnprune {self.command}: warning: {message}", file=sys.stderr)

        warnings.showwarning = show
        return self

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``gdnprune`` command; returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        parser = build_parser(next((a for a in argv if not a.startswith("-")), None))
        args = parser.parse_args(argv)
    except KeyboardInterrupt:  # Ctrl-C while starting: no traceback
        print("gdnprune: interrupted", file=sys.stderr)
        return 130
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    from ..interrupts import handle_signals

    try:
        with handle_signals(), _StderrWarnings(args.command):
            return int(args.func(args) or 0)
    except KeyboardInterrupt as exc:
        signum = getattr(exc, "signum", signal.SIGINT)
        name = signal.Signals(signum).name
        if getattr(exc, "output_complete", None):
            print(f"gdnprune {args.command}: {name} arrived while the finished output was moved into place; "
                  f"the move was completed first: {exc.output_complete} is the new output", file=sys.stderr)
            return 0
        print(f"gdnprune {args.command}: interrupted by {name}; stopped without leaving a partial output",
              file=sys.stderr)
        return 128 + signum
    except (ValueError, OSError) as exc:  # input errors: one line, exit 2
        message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"gdnprune {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
