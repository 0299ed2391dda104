#!/usr/bin/env python
"""Uniform expert cuts of extra expert orders (issue 31): what ``benchmarks/experts.py``'s uniform part does,
for orders that are not library options (REAP x frequency, rank mean of removal and frequency, ...).

One scoring pass (64 training windows of 256 bytes, ``blocks=True``), then every MoE layer keeps the first
8 and 4 of 16 experts of each order; loss per held-out window (``window_losses``), paired differences with
the removal order. Writes the per-window losses to OUT.json.

    python benchmarks/expert_orders_uniform.py MODEL_DIR 176 OUT.json
"""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402
from experts import cut, paired  # noqa: E402
from plans import window_losses  # noqa: E402

from gdnprune import demo_data  # noqa: E402
from gdnprune.io.loading import load_pretrained  # noqa: E402
from gdnprune.model.subblock_surgery import find_model_blocks  # noqa: E402
from gdnprune.scoring import score_model  # noqa: E402

torch.set_num_threads(1)
path = sys.argv[1]
model = load_pretrained(path, dtype=torch.float32).eval()
prefixes = [b.prefix for b in find_model_blocks(model, ("experts",))]
calibration = demo_data.byte_windows(demo_data.train_text(), 256, 64)
validation = demo_data.byte_windows(demo_data.validation_text(), 256, int(sys.argv[2]))
scores = score_model(model, list(calibration.split(8)), progress=False, blocks=True)
payloads = {p: scores["layers"][p] for p in prefixes}


def score(q: dict, name: str) -> torch.Tensor:
    return torch.tensor(q[f"expert_{name}"])


def order(measure) -> dict:
    return {p: {"experts": torch.argsort(-measure(payloads[p]), stable=True).numpy()} for p in prefixes}


def rank_mean(*names):
    def measure(q: dict) -> torch.Tensor:  # minus the summed ranks (0 = the highest score)
        ranks = [torch.argsort(torch.argsort(-score(q, n), stable=True), stable=True) for n in names]
        return -sum(r.double() for r in ranks)

    return measure


orders = {
    "removal": order(lambda q: score(q, "removal")),
    "reap": order(lambda q: score(q, "reap")),
    "frequency": order(lambda q: score(q, "frequency")),
    "sum": order(lambda q: score(q, "reap") * score(q, "frequency")),
    "rank_removal_freq": order(rank_mean("removal", "frequency")),
    "removal_x_freq": order(lambda q: score(q, "removal") * score(q, "frequency")),
}
base = window_losses(model, validation)
results = {}
for keep in (8, 4):
    losses = {
        n: window_losses(cut(model, o, {p: keep for p in prefixes}), validation) for n, o in orders.items()
    }
    for n, value in losses.items():
        mean, se = paired(value, losses["removal"])
        print(f"{keep} {n} {value.mean() - base.mean():+.4f}  - removal {mean:+.4f} ± {se:.4f}", flush=True)
    results[keep] = {n: v.tolist() for n, v in losses.items()}
Path(sys.argv[3]).write_text(json.dumps({"base": base.tolist(), "results": results}))
