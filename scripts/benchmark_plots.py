#!/usr/bin/env python
"""Draw the headline plots of BENCHMARKS.md into ``docs/benchmarks/img/`` from the numbers of its tables.

The numbers below are copied from BENCHMARKS.md (and its history pages in ``docs/benchmarks/``), where each
table names the command and commit that measured it; this script only draws them, so the plots can be
redrawn without rerunning a benchmark.

    python scripts/benchmark_plots.py          # needs matplotlib (pip install 'gdnprune[plot]')
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks" / "img"

#: checkpoint surgery, 6 layers (2.82 GB), ext4: wall time as a multiple of `cp -r` (medians of 6 rounds)
SURGERY = {
    "commands": ["gdnprune sort", "gdnprune slice", "sort (API)", "slice (API)", "naive sort"],
    "calm": [0.45, 0.36, 0.50, 0.36, 2.70],
    "calm, best round": [0.99, 0.94, 0.96, 0.91, 6.22],
    "busy": [1.24, 1.16, 1.36, 1.18, 5.47],
}

#: whole-model plans: (decoder parameters kept %, one-shot, after 300 distillation steps) in nats/byte
PLANS = {
    "bundled model (4 layers)": {
        "unpruned": 1.0657,
        "searched": [(74.4, 1.1374, 1.0920), (49.6, 1.5223, 1.1171), (35.0, 2.0520, 1.1676)],
        "best uniform": [(73.5, 1.1367, 1.0869), (49.2, 1.5140, 1.1234), (33.9, 2.0278, 1.1857)],
        "GDN only": [(75.0, 1.6045, 1.1243)],
        "depth only": [(73.0, 1.6960, 1.1341), (46.0, 3.2597, 1.2679)],
    },
    "8-layer model": {
        "unpruned": 1.3530,
        "searched": [(74.4, 1.3878, 1.3626), (49.9, 1.5754, 1.3748), (35.0, 1.9572, 1.4145)],
        "best uniform": [(71.8, 1.4048, 1.3597), (49.1, 1.6085, 1.3804), (33.7, 1.9911, 1.4169)],
        "GDN only": [(75.0, 1.7787, 1.3918)],
        "depth only": [(73.4, 1.6847, 1.3906), (46.8, 2.5102, 1.4571)],
    },
}

#: training peak per process (GB, the larger rank), 2 CPU processes
FSDP = {
    "129M teacher\n(CLI's allocator)": {"DDP": 3.56, "FSDP2, student": None, "FSDP2, both": 2.30},
    "129M teacher,\ncheckpointing": {"DDP": 3.13, "FSDP2, student": None, "FSDP2, both": 1.75},
    "428M teacher\n(glibc default)": {"DDP": 9.46, "FSDP2, student": 6.52, "FSDP2, both": 5.77},
}

#: recall model (GGGG), each GDN axis halved: passkey and MQAR exact match at 256 characters, nats/byte
RECALL = {
    "unpruned": (0.97, 0.88, 1.426),
    "key heads /2": (0.34, 0.41, 2.035),
    "lanes /2": (0.0, 0.41, 1.978),
    "key dim /2": (0.84, 0.31, 1.489),
    "value dim /2": (0.06, 0.66, 1.935),
    "uniform": (0.13, 0.19, 1.894),
    "state plan 0.5": (0.0, 0.03, 1.457),
    "uniform + KD": (1.00, 0.34, 1.512),
    "value dim + KD": (0.97, 0.72, 1.504),
    "state plan + KD": (0.44, 0.09, 1.433),
}


def surgery() -> None:
    fig, ax = plt.subplots(figsize=(6.4, 3.0), dpi=100)
    names = SURGERY["commands"]
    width = 0.27
    for k, key in enumerate(("calm", "calm, best round", "busy")):
        xs = [i + (k - 1) * width for i in range(len(names))]
        ax.bar(xs, SURGERY[key], width, label=key)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--", label="cp -r")
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set_ylabel("wall time / cp -r")
    ax.set_title("Sort and slice of a 2.82 GB checkpoint against cp -r", fontsize=10)
    ax.legend(fontsize=7, ncol=4, loc="upper left")
    ax.set_ylim(0, 7)
    fig.tight_layout()
    fig.savefig(OUT / "surgery.png")


def plans() -> None:
    fig, axes = plt.subplots(1, 2, figsize=(7.2, 3.2), dpi=100, sharey=False)
    styles = {"searched": "C0", "best uniform": "C1", "GDN only": "C2", "depth only": "C3"}
    for ax, (model, rows) in zip(axes, PLANS.items()):
        for name, color in styles.items():
            points = sorted(rows[name])
            kept = [p[0] for p in points]
            ax.plot(kept, [p[1] for p in points], "o--", color=color, alpha=0.6, markersize=3)
            ax.plot(kept, [p[2] for p in points], "o-", color=color, label=name, markersize=4)
        ax.axhline(rows["unpruned"], color="black", linewidth=0.8, linestyle=":", label="unpruned")
        ax.set_title(model, fontsize=9)
        ax.set_xlabel("decoder parameters kept (%)")
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(matplotlib.ticker.FixedLocator([1.1, 1.2, 1.4, 1.6, 2.0, 2.5, 3.0]))
        ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.invert_xaxis()
    axes[0].set_ylabel("held-out loss (nats/byte)")
    axes[0].legend(fontsize=7, loc="upper left")
    fig.suptitle("Whole-model plans: one-shot (dashed) and after 300 distillation steps (solid)", fontsize=9)
    fig.tight_layout()
    fig.savefig(OUT / "plans.png")


def fsdp() -> None:
    fig, ax = plt.subplots(figsize=(6.4, 3.0), dpi=100)
    engines = ("DDP", "FSDP2, student", "FSDP2, both")
    width = 0.27
    for k, engine in enumerate(engines):
        xs, ys = [], []
        for i, case in enumerate(FSDP.values()):
            if case[engine] is not None:
                xs.append(i + (k - 1) * width)
                ys.append(case[engine])
        bars = ax.bar(xs, ys, width, label=engine)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks(range(len(FSDP)), list(FSDP), fontsize=8)
    ax.set_ylabel("training peak per process (GB)")
    ax.set_title("Distillation on 2 processes: DDP against FSDP2", fontsize=10)
    ax.legend(fontsize=7)
    ax.set_ylim(0, 11)
    fig.tight_layout()
    fig.savefig(OUT / "fsdp_memory.png")


def recall() -> None:
    fig, ax = plt.subplots(figsize=(7.2, 3.2), dpi=100)
    names = list(RECALL)
    width = 0.4
    for k, (label, col) in enumerate((("passkey", 0), ("MQAR", 1))):
        ax.bar(
            [i + (k - 0.5) * width for i in range(len(names))],
            [RECALL[n][col] for n in names],
            width,
            label=label,
        )
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("exact match at 256 characters")
    ax.set_ylim(0, 1.05)
    loss = ax.twinx()
    loss.plot(range(len(names)), [RECALL[n][2] for n in names], "kD", markersize=4, label="nats/byte")
    loss.set_ylabel("nats/byte (diamonds)")
    ax.legend(fontsize=7, loc="upper center", ncol=2)
    ax.set_title("Recall model: each GDN axis halved, a state budget, and 300 KD steps", fontsize=10)
    fig.tight_layout()
    fig.savefig(OUT / "recall.png")


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    for draw in (surgery, plans, fsdp, recall):
        draw()
        plt.close("all")
    print(f"wrote {', '.join(sorted(p.name for p in OUT.glob('*.png')))} in {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
