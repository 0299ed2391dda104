"""What the benchmarks share: the models they build or load, the held-out measures, timing, tables, JSON
output, child processes, and the recipe of the whole-model benchmarks.

* models: :func:`qwen35_config` / :func:`random_qwen35` (random Qwen3.5 text models of a given geometry, where
  compute dominates), :func:`benchmark_models` (the bundled demo model; ``--deep FOLDER``: a deeper trained
  benchmark model, whose ``training.json`` names its corpus);
* measures on held-out windows: :func:`window_losses` (nats/byte per window), :func:`paired` (the mean and
  standard error of a paired difference), :func:`joint_kl`, :func:`spearman`;
* timing: :func:`interleaved_medians` (modes timed in turn, round by round, so a shared machine's slow phases
  hit all of them alike), :func:`load_average` and :func:`load_text` (printed beside every timing);
* output: :func:`markdown_table`, :func:`write_json`;
* child processes: :func:`child_env` (the repository's ``src`` first, threads set, no launcher variables),
  :func:`torchrun` (``torch.distributed.run --standalone`` with N processes);
* the whole-model benchmarks' recipe (``whole_model.py``, ``after_recovery.py``): :data:`BUDGETS`,
  :data:`RECIPE`, :data:`SEQ`, :func:`add_model_arguments`, :func:`set_up`.

Every script runs through the runner (``python -m benchmarks NAME``) or alone (``python benchmarks/NAME.py``);
both put ``benchmarks/`` on ``sys.path``, so a script imports this module as ``_common``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO / "src") not in sys.path:  # a checkout without `pip install -e .` runs too
    sys.path.insert(0, str(REPO / "src"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from gdnprune import demo_data  # noqa: E402
from gdnprune.io.loading import load_pretrained  # noqa: E402

BUDGETS = (0.75, 0.5, 0.35)
"""Fractions of the decoder's parameters (embeddings and final norm excluded)."""
RECIPE = dict(batch_size=4, lr=1e-3, warmup=0.03, seed=0, kd_weight=1.0, lm_weight=0.0)
"""The distillation recipe every compared plan gets (forward KL, AdamW, cosine after the warmup)."""
SEQ = 256
"""Bytes per window."""
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


# ---- measures on held-out windows ------------------------------------------------------------------------


def paired(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """Mean and standard error of ``a - b`` over windows."""
    d = np.asarray(a) - np.asarray(b)
    return float(d.mean()), float(d.std(ddof=1) / math.sqrt(len(d)))


def window_losses(model, windows: torch.Tensor, batch: int = 16) -> np.ndarray:
    """Mean next-token cross entropy of every window (nats/byte)."""
    out = []
    with torch.no_grad():
        for start in range(0, windows.shape[0], batch):
            x = windows[start : start + batch]
            logits = model(input_ids=x, use_cache=False).logits[:, :-1].float()
            ce = (
                torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="none"
                )
                .reshape(x.shape[0], -1)
                .mean(1)
            )
            out.append(ce)
    return torch.cat(out).numpy()


def joint_kl(model, teacher_logp: list[torch.Tensor], windows: list[torch.Tensor]) -> float:
    """The KL from the teacher's log-probabilities to ``model``'s, per token, over ``windows``."""
    total, n = 0.0, 0
    with torch.no_grad():
        for x, t in zip(windows, teacher_logp):
            s = model(input_ids=x).logits.float().log_softmax(-1)
            total += float((t.exp() * (t - s)).sum())
            n += x.numel()
    return total / n


def spearman(a, b) -> float:
    """Spearman's rank correlation of two sequences."""
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


# ---- models ----------------------------------------------------------------------------------------------


def qwen35_config(
    *,
    hidden: int = 1024,
    layers: int = 4,
    intermediate: int | None = None,
    vocab: int = 32000,
    attention_heads: int = 8,
    kv_heads: int = 2,
    head_dim: int = 128,
    key_heads: int = 16,
    value_heads: int = 16,
    gdn_head_dim: int = 128,
    tie: bool = False,
) -> transformers.Qwen3_5TextConfig:
    """A Qwen3.5 text config: every 4th layer full attention (``GGGA``), the rest GDN; MLP ``intermediate``
    (default ``3 * hidden``)."""
    return transformers.Qwen3_5TextConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=3 * hidden if intermediate is None else intermediate,
        num_hidden_layers=layers,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        num_attention_heads=attention_heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        linear_num_key_heads=key_heads,
        linear_num_value_heads=value_heads,
        linear_key_head_dim=gdn_head_dim,
        linear_value_head_dim=gdn_head_dim,
        linear_conv_kernel_dim=4,
        tie_word_embeddings=tie,
    )


def random_qwen35(seed: int = 0, **geometry: Any) -> transformers.Qwen3_5ForCausalLM:
    """A random Qwen3.5 text model of :func:`qwen35_config`'s geometry, in eval mode."""
    torch.manual_seed(seed)
    return transformers.Qwen3_5ForCausalLM(qwen35_config(**geometry)).eval()


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


# ---- timing ----------------------------------------------------------------------------------------------


def load_average() -> float:
    """The 1-minute load average (printed beside timings: the machine is shared)."""
    return os.getloadavg()[0]


def load_text() -> str:
    """The 1-, 5- and 15-minute load averages, as ``/proc/loadavg`` shows them."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def interleaved_medians(
    modes: dict[str, Callable[[], object]], rounds: int, warmup: int = 1
) -> dict[str, float]:
    """Median seconds of every mode over ``rounds`` rounds (after ``warmup`` untimed ones), the modes timed
    in turn within each round."""
    times: dict[str, list[float]] = {name: [] for name in modes}
    for r in range(warmup + rounds):
        for name, fn in modes.items():
            start = time.perf_counter()
            fn()
            if r >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


# ---- output ----------------------------------------------------------------------------------------------


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]], align: str | None = None) -> str:
    """A markdown table; ``align`` one letter per column (``l`` left, ``r`` right; default: the first left,
    the others right)."""
    align = align or "l" + "r" * (len(header) - 1)
    rule = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(rule) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(path: str | os.PathLike | None, data: object) -> None:
    """``data`` as indented JSON into ``path`` (nothing when ``path`` is None)."""
    if path is not None:
        Path(path).write_text(json.dumps(data, indent=1, default=str) + "\n")


# ---- child processes -------------------------------------------------------------------------------------


def child_env(threads: int = 1, **extra: str) -> dict[str, str]:
    """The environment of a child process: the repository's ``src`` first on ``PYTHONPATH``, ``threads``
    OpenMP threads, no variable of an enclosing launcher."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = str(threads)
    env.update(extra)
    return env


def torchrun(
    args: Sequence[str], nproc: int = 2, env: dict[str, str] | None = None
) -> tuple[float, subprocess.CompletedProcess]:
    """``python -m torch.distributed.run --standalone --nproc_per_node NPROC ARGS``: its seconds and result;
    a failure stops the benchmark with the launch's last lines."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    start = time.perf_counter()
    done = subprocess.run(
        [*cmd, *args], env=child_env() if env is None else env, capture_output=True, text=True
    )
    if done.returncode:
        raise SystemExit(f"{' '.join(args)} failed:\n{done.stderr[-4000:]}")
    return time.perf_counter() - start, done
