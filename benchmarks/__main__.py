"""``python -m benchmarks [NAME [ARGS...]]``: list the benchmarks with their claims, or run one.

Without a name (or with ``--list``) it prints every script's name and its claim, the first paragraph of its
docstring (read with ``ast``: nothing is imported). With a name it puts ``benchmarks/`` first on ``sys.path`` (as running the
script alone does), imports the script and returns its ``main(ARGS)``.
"""

from __future__ import annotations

import ast
import difflib
import importlib
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def suites() -> dict[str, str]:
    """Every benchmark script's name -> the first paragraph of its docstring (its claim), on one line."""
    out = {}
    for path in sorted(HERE.glob("*.py")):
        if path.name.startswith("_"):
            continue
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        out[path.stem] = " ".join(doc.strip().split("\n\n")[0].split())  # the first paragraph, one line
    return out


def usage() -> str:
    found = suites()
    width = max(map(len, found))
    lines = [
        "usage: python -m benchmarks NAME [ARGS...]   (python -m benchmarks NAME --help: its options)",
        "",
    ]
    lines += [f"  {name:<{width}}  {claim}" for name, claim in found.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "--list"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    found = suites()
    if name not in found:
        close = difflib.get_close_matches(name, found, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        print(f"python -m benchmarks: no benchmark {name!r}{hint}\n\n{usage()}", file=sys.stderr)
        return 2
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    sys.argv = [str(HERE / f"{name}.py"), *rest]  # what the script sees when it runs alone
    module = importlib.import_module(name)
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
