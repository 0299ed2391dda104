"""Write docs/cli.md, the options table of every ``gdnprune`` command, from the argparse parsers themselves.

    python scripts/cli_doc.py            # rewrite docs/cli.md
    python scripts/cli_doc.py --check    # exit 1 when docs/cli.md is out of date

``tests/test_cli_options.py`` runs the check, and checks that one concept has one name across the commands.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "cli.md"

HEADER = """# Command-line options

Generated from the parsers by `python scripts/cli_doc.py` (a test fails when it is out of date): do not
edit by hand. `gdnprune COMMAND --help` says the same.

## One name per concept

The same option means the same thing, takes the same kind of value and has the same spelling in every
command (`tests/test_cli_options.py` checks it):

* `-o/--output` is what a command writes (a folder, or a file for `score` and `plan`); `--overwrite`
  replaces an earlier output; `-q/--quiet` hides progress bars (transformers' included) and notes.
* `--num-samples N` is the number of windows (of `--seq-len` tokens) of the command's own stage. Its
  default differs because the cost per window differs: `score` and `prune` sum statistics over many
  windows (128), the measured sensitivity of `plan` runs one forward per candidate width and layer (16),
  `verify` compares logits (4), the `demo` model is tiny (64), `distill` trains on all of them.
  A second stage in the same command has its own `--STAGE-samples`: `--lane-search-samples` (the lane
  search), `--plan-samples` (`prune`'s plan search, `plan --num-samples`), `--eval-samples`
  (held-out windows).
* Compensation (a least-squares refit of `out_proj` after the cut): `--compensate [statistics|sequential]`
  chooses how (`prune`, which scores and cuts in one run); `--compensation-stats FILE` is the file of
  calibration statistics that `score` writes and `slice` refits from. (In Python: `prune_checkpoint(compensate=)`,
  `score_checkpoint(compensate=True)` returns the statistics, `slice_checkpoint(compensation_stats=STATS)`.)
* `--blocks LIST` names kinds of block: `gdn`, `attention`, `mlp`, `shared_expert`, `experts` (routed
  experts) and `depth` (whole decoder layers). The default is every kind the model has, in `score` (the
  kinds whose orders it writes; GDN always, `depth` has nothing to order) as in `plan` and `prune` (the
  kinds a whole-model budget may shrink). A "layer" is a decoder layer (`model.layers.N`); a "block" is
  one of its parts of those kinds.
* Two searches, two words: `--lane-search` (`score`, `prune`) orders the value heads of each key group by
  measured KL; `--evolve-generations/-offspring/-seed` (`plan`, `prune`) improve a whole plan by an
  evolutionary search.
* Old spellings still work for one release and print a warning: `--refine lanes` (`--lane-search`),
  `--refine-samples`, `--refine-generations/-offspring/-seed` (`--evolve-...`), `--sub-blocks` (`--blocks`,
  whose default now covers it), `--compensation`, `--compensate` of `slice`, `--calibration-windows`,
  `--validation-windows`, `--num-sequences`.
* Every flag is the keyword argument of the Python function under the command (`--num-samples` is
  `num_samples`); a library error names the keyword (`` `overwrite=True` ``) and the command shows the flag.
* `--dtype {float32,bfloat16}` is the weights dtype; `--threads N` torch's CPU threads; `--seed` the seed of
  what is random in the command; `--dist-timeout SECONDS` how long a rank waits for the others under
  `torchrun` / `accelerate launch` (`score`, `plan`).
* Numbers are checked when the command line is read: a count must be a positive integer, a ridge, a
  tolerance or a timeout a finite non-negative (or positive) number; the error says what was expected and
  what was found, with exit code 2.

Exit codes: 0 success; 1 a check failed (`verify` beyond tolerance) or the environment failed (a full
disk, an I/O error: an `OSError` not about the paths given); 2 the user's mistake (an input error, a path
that does not exist or may not be written), one line on stderr.
"""


def _value(action: argparse.Action) -> str:
    if action.nargs == 0:
        return ""
    if action.choices:
        text = "{" + ",".join(map(str, action.choices)) + "}"
    else:
        text = action.metavar or action.dest.upper()
    if action.nargs == "?":
        return f"[{text}]"
    if action.nargs == "+":
        return f"{text} [{text} ...]"
    return text


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [
        a for a in parser._actions if a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)
    ]


def subparsers() -> dict[str, argparse.ArgumentParser]:
    """Every command's parser, in the order of ``gdnprune --help``."""
    sys.path.insert(0, str(ROOT / "src"))
    from gdnprune.cli import build_parser

    parser = build_parser()
    return dict(parser._subparsers._group_actions[0].choices)


def render() -> str:
    commands = subparsers()
    lines = [HEADER]
    lines.append("## Which command has which option\n")
    names: dict[str, list[str]] = {}
    for name, parser in commands.items():
        for action in _options(parser):
            if action.option_strings:
                flag = "/".join(sorted(action.option_strings, key=len))
                names.setdefault(flag, []).append(name)
    lines.append("| option | " + " | ".join(commands) + " |")
    lines.append("|---|" + "---|" * len(commands))
    for flag in sorted(names, key=lambda f: f.lstrip("-").lower()):
        lines.append(f"| `{flag}` | " + " | ".join("x" if c in names[flag] else "" for c in commands) + " |")
    for name, parser in commands.items():
        lines.append(f"\n## `gdnprune {name}`\n")
        lines.append(_cell(parser.description or "") + "\n")
        lines.append("| option | value | default | meaning |")
        lines.append("|---|---|---|---|")
        for action in _options(parser):
            flag = (
                ", ".join(f"`{o}`" for o in sorted(action.option_strings, key=len)) or f"`{action.metavar}`"
            )
            default = (
                ""
                if action.default in (None, False, argparse.SUPPRESS) or action.required
                else f"`{action.default}`"
            )
            if not action.option_strings:
                default = "(optional)" if action.nargs == "?" else ""
            elif action.required:
                default = "required"
            value = _value(action)
            lines.append(
                f"| {flag} | {'`' + value + '`' if value else ''} | {default} | {_cell(action.help or '')} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/cli.md is out of date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = DOC.read_text() if DOC.is_file() else ""
        if current != text:
            print(f"{DOC} is out of date: run python scripts/cli_doc.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
