"""Write docs/models.md, the table of the Qwen hybrid models gdnprune records, from ``gdnprune.model.family``.

    python scripts/models_doc.py            # rewrite docs/models.md
    python scripts/models_doc.py --check    # exit 1 when docs/models.md is out of date

``tests/test_family.py`` runs the check.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gdnprune.model.family import models_markdown

DOC = Path(__file__).resolve().parent.parent / "docs" / "models.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/models.md is out of date")
    args = parser.parse_args(argv)
    text = models_markdown()
    if args.check:
        current = DOC.read_text(encoding="utf-8") if DOC.exists() else ""
        return 0 if current == text else 1
    DOC.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
