"""What the whole-model benchmarks share (``whole_model.py``, ``after_recovery.py``): the budgets, the one
distillation recipe, the paired difference over held-out windows, the command-line options both take and
the models they run on (the bundled demo model; ``--deep FOLDER``: the deeper benchmark model, whose
``training.json`` names its corpus).

Import it after the scripts have put ``src/`` on ``sys.path`` (they run from a checkout).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import transformers

from gdnprune import demo_data
from gdnprune.io.loading import load_pretrained

BUDGETS = (0.75, 0.5, 0.35)
"""Fractions of the decoder's parameters (embeddings and final norm excluded)."""
RECIPE = dict(batch_size=4, lr=1e-3, warmup=0.03, seed=0, kd_weight=1.0, lm_weight=0.0)
"""The distillation recipe every compared plan gets (forward KL, AdamW, cosine after the warmup)."""
SEQ = 256
"""Bytes per window."""


def paired(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """Mean and standard error of ``a - b`` over windows."""
    d = np.asarray(a) - np.asarray(b)
    return float(d.mean()), float(d.std(ddof=1) / math.sqrt(len(d)))


def budget_list(text: str) -> list[float]:
    """``"0.75,0.5"`` -> ``[0.75, 0.5]``."""
    return [float(v) for v in text.split(",")]


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The options both scripts take: which models, budgets, held-out windows, threads, output."""
    parser.add_argument(
        "--deep", type=Path, default=None, help="folder of the deeper model (benchmarks/plans.py says how)"
    )
    parser.add_argument("--skip-bundled", action="store_true", help="only the --deep model")
    parser.add_argument(
        "--budgets",
        type=budget_list,
        default=list(BUDGETS),
        help="fractions of the decoder's parameters (default 0.75,0.5,0.35)",
    )
    parser.add_argument(
        "--validation-windows", type=int, default=32, help="held-out windows of 256 bytes (32)"
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--quiet", action="store_true")


def set_up(args: argparse.Namespace) -> None:
    """Torch's threads, transformers quiet (no progress bars, no warnings)."""
    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


@dataclass(frozen=True)
class BenchModel:
    """A model to benchmark: its name, how to load it (float32, eval mode), the corpus it was trained on."""

    name: str
    load: Callable[[], torch.nn.Module]
    corpus: str


def benchmark_models(args: argparse.Namespace) -> list[BenchModel]:
    """The bundled demo model (unless ``--skip-bundled``) and the ``--deep`` model, if given."""
    models = []
    if not args.skip_bundled:
        models.append(BenchModel("bundled", lambda: demo_data.load_demo_model()[0], "pydoc"))
    if args.deep is not None:
        folder = args.deep
        record = json.loads((folder / "training.json").read_text())
        models.append(
            BenchModel(
                folder.name,
                lambda: load_pretrained(folder, dtype=torch.float32).eval(),
                record["corpus"].get("name", "pydoc"),
            )
        )
    return models


def load_average() -> float:
    """The 1-minute load average (printed beside timings: the machine is shared)."""
    return os.getloadavg()[0]
