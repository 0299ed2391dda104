#!/usr/bin/env python
"""Write the task folder shipped in the package, ``src/gdnprune/data/tasks``.

The recall probes (passkey and MQAR) at the default context lengths (256, 1024, 4096 characters), seed 0:
YAMLs and the hooks file; the documents are generated from the seed when lm-eval loads a task, so the
folder holds no data. ``nats_per_byte`` needs a text file: ``gdnprune eval --data FILE`` writes that task
into its output's ``tasks/``. Run it again after changing ``gdnprune.evaluation.tasks``
(``tests/test_eval_tasks.py`` checks that the shipped folder is what this script writes).

Usage::

    python scripts/make_eval_tasks.py
    lm_eval --model hf --model_args pretrained=MODEL --include_path src/gdnprune/data/tasks --tasks passkey
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "src"))  # use the checkout even when gdnprune is not installed

from gdnprune.evaluation.tasks import shipped_task_folder, write_task_folder  # noqa: E402


def main() -> int:
    out = shipped_task_folder()
    if out.exists():
        shutil.rmtree(out)
    folder = write_task_folder(out)
    print(f"wrote {out}: {', '.join(folder.tasks)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
