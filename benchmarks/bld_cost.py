#!/usr/bin/env python
"""The cost of the BLD sensitivity (issue 31) against halving and measured, on the bundled demo model.

One scoring pass (``score_model``, default method) on N calibration windows of 256 training bytes, then
``plan_model`` with ``budget_gdn_params=0.5`` and each sensitivity on the same windows; prints each
search's seconds as a multiple of the scoring pass and the plan it chose. ``bld-apart``: the BLD sensitivity
with its block errors computed batch by batch (``max_tokens=0``, the path before the calibration batches were
joined into one call), side by side with ``bld``.

    python benchmarks/bld_cost.py 8 1/2 [OUT.json] [halving,measured,bld-apart,bld]   # windows, dim step
"""

import functools
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import torch  # noqa: E402

from gdnprune import demo_data  # noqa: E402
from gdnprune.io.loading import load_pretrained  # noqa: E402
from gdnprune.plan import plan_model, stages  # noqa: E402
from gdnprune.plan.measure.bld import bld_sensitivity  # noqa: E402
from gdnprune.scoring import score_model  # noqa: E402

torch.set_num_threads(1)
model = load_pretrained(demo_data.demo_model_path(), dtype=torch.float32).eval()
calib = demo_data.byte_windows(demo_data.train_text(), 256, int(sys.argv[1]))
batches = list(calib.split(4))
t = time.perf_counter()
scores = score_model(model, batches, progress=False)
score_s = time.perf_counter() - t
out = {"windows": int(calib.shape[0]), "score_seconds": score_s}
names = sys.argv[4].split(",") if len(sys.argv) > 4 else ["halving", "measured", "bld-apart", "bld"]
print(f"load average {os.getloadavg()[0]:.1f}", flush=True)
for sens in names:
    # bld-apart: the library's BLD with max_tokens=0 (plan_model has no such option; swapped in for this run)
    stages.bld_sensitivity = functools.partial(
        bld_sensitivity, max_tokens=0 if sens == "bld-apart" else 1 << 16
    )
    t = time.perf_counter()
    plan, report = plan_model(
        model,
        batches,
        scores,
        budget_gdn_params=0.5,
        dim_step=sys.argv[2],
        sensitivity=sens.removesuffix("-apart"),
        progress=False,
    )
    s = time.perf_counter() - t
    out[sens] = {
        "seconds": s,
        "x_scoring": s / score_s,
        "teacher_seconds": report.get("teacher_seconds"),
        "layers": plan["layers"],
        "predicted": plan["predicted"],
    }
    print(
        sens,
        f"{s:.1f} s = {s / score_s:.1f}x scoring ({score_s:.1f} s); teacher {report.get('teacher_seconds'):.2f} s",
        plan["predicted"],
        flush=True,
    )
    if sens.startswith("bld"):
        b = report["bld"]
        e0 = [e for v in b["error_one_shot"].values() for e in v]
        e1 = [e for v in b["error"].values() for e in v]
        out[sens]["error"] = [sum(e0) / len(e0), sum(e1) / len(e1)]
        print("mean block error", out[sens]["error"], flush=True)
print(f"load average at the end {os.getloadavg()[0]:.1f}", flush=True)
if len(sys.argv) > 3 and sys.argv[3]:
    Path(sys.argv[3]).write_text(json.dumps(out, indent=1))
