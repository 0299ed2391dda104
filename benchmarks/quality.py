#!/usr/bin/env python
"""The default orders beat 90-100% of random orders on every GDN axis and on MLP channels; compensation cuts 15-22% more loss.

Three parts (``python -m benchmarks quality PART``), each the validation loss after cutting a model in memory
(nats/byte, the loss increase over the unpruned model):

``gdn``: the GDN axes' orders on the bundled demo model. For each axis alone (key groups, value heads per group, key head dim, value head dim) at 50% and 25% kept
(where representable: the model has r = 2 lanes per group, so 25% of lanes is not), and for one combined
target, every GDN layer is permuted by an order and sliced to the target in memory with the core API
(``slice_gated_delta_net_state_dict(..., permutation=...)``: permute + slice in one gather), loaded into a
model built from the edited config, and scored on the validation text. Reported: the validation loss
increase over the unpruned model for

* each scoring method (``projection`` = the default, ``activation``) and projection variants that justify
  the default's choices (the measures of :func:`gdnprune.scoring.score_model`); the identity order and the
  reversed default order;
* ``--random-orders`` random orders: mean, standard deviation, best, and for each method the share of
  random orders it beats;
* reference optima, searched on ``--search-windows`` evenly spaced windows of the training text (the
  text the scorer calibrates on), not on the validation text, so the references do not fit the
  evaluation windows:
  - per-layer optimum, the issue's definition: every layer searched alone with the others unpruned
    (key groups: every subset; lanes: every choice per group), the per-layer winners combined;
  - joint optimum: key groups, every subset of every layer jointly (exhaustive); lanes, coordinate
    descent over the layers with every per-layer choice (two sweeps);
  - channels: a leave-one-out ranking (loss when only that channel is removed: key channels zeroed in
    q and k per key head, value channels sliced out of every head);

and "gap closed" = (random mean - method) / (random mean - optimum). Calibration uses the training text.
Targets at 50% kept: the default beats at least 90% of the random orders on all four axes, closes at
least 70% of the gap on key groups and lanes, and is no worse than ``activation`` on at least 3 of the
4 axes.

``dense``: which order wins for MLP channels and attention heads. On the bundled demo model (or ``--model``: a byte-level model folder such as the deeper model of
``scripts/train_demo_model.py``), the sub-blocks are scored on training text with
``score_model(...)`` (every kind by default) by both methods, then cut in memory (:func:`gdnprune.slice_model`):

* every MLP to 1/2, 1/4 and 1/8 of its channels;
* every full-attention layer to one key-value group (all its query heads), to one query head per group,
  and to one head in all;

each with the ``projection`` order (the default), the ``activation`` baseline (Minitron), the identity
order, the reversed projection order, and ``--random-orders`` random orders (mean, standard deviation,
and the share of them each method beats). For attention, where few choices exist, also the best and the
worst of every possible kept set (exhaustive, on the validation text itself: an upper bound no order
can beat). Reported: validation loss (nats/byte) minus the unpruned model's.

``methods``: measured lane choice and least-squares compensation on several models. For every model, every axis at 50 % and 25 % kept (where representable) and one combined target, the
validation loss increase of

* ``default``: the ``projection`` scores; ``refined``: the same with measured lane orders
  (:func:`gdnprune.quality.lane_search.refine_lane_orders`); ``compensated``: the default cut with ``out_proj`` refitted
  by least squares (:mod:`gdnprune.quality.compensate`); ``refined+comp.``; ``sequential``: the default cut with
  ``out_proj`` refitted layer by layer on the cut model's own hidden states against the full model's
  residual stream (:func:`gdnprune.quality.compensate.sequential_refit`; ``--references`` adds columns for its
  other references); ``activation``;
* ``--random-orders`` random orders (mean, and the share each method beats);
* for lanes and key groups, the per-layer optimum (every choice of each layer alone, searched on training
  windows; as in ``gdn``) and the gap each method closes.

Models: ``bundled`` (the demo model) and model folders trained with ``scripts/train_demo_model.py`` (the
corpus is read from their ``training.json``). Calibration, statistics and searches use training text;
losses use held-out text.

Usage::

    python -m benchmarks quality gdn --threads 1 --json quality.json             # 10-25 minutes on 2 shared cores
    python -m benchmarks quality gdn --no-optimum --no-variants                  # about 2 minutes
    python -m benchmarks quality dense --threads 1 --json dense_orders.json      # about 13 minutes
    python -m benchmarks quality methods --threads 1 --models bundled,benchmarks/_work/models/seed1 --json one_shot.json
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import _common  # noqa: F401  (the repository's src first on sys.path)
import torch

from gdnprune import demo_data
from gdnprune.gated_delta_net import GDNPermutation, GDNShape, slice_gated_delta_net_state_dict
from gdnprune.io.loading import load_pretrained, slice_model
from gdnprune.model.layouts import find_gdn_modules
from gdnprune.model.subblock_geometry import orders_to_payload
from gdnprune.model.subblock_surgery import find_model_blocks, random_orders
from gdnprune.quality import compensate
from gdnprune.quality.lane_search import refine_lane_orders
from gdnprune.scoring import GDN_ONLY, score_model, scores_to_permutations

# ---- gdn: the GDN axes' orders -------------------------------------------------------------------------------

AXES = ("key_groups", "value_lanes", "key_dim", "value_dim")
AXIS_FIELD = {"key_groups": "num_key_heads", "key_dim": "key_head_dim", "value_dim": "value_head_dim"}
AXIS_LABEL = {
    "key_groups": "key groups",
    "value_lanes": "value heads per group",
    "key_dim": "key head dim",
    "value_dim": "value head dim",
}
# name -> score_model keyword arguments
METHODS = {
    "projection": dict(method="projection"),
    "activation": dict(method="activation"),
}
VARIANTS = {
    "proj., lanes by energy Gram": dict(method="projection", lane_measure="energy_gram"),
    "proj., lanes by loss Gram on every token": dict(method="projection", loss_token_stride=1),
    "proj., key groups by loss Gram": dict(method="projection", key_group_measure="loss_gram"),
    "proj., value dims by loss Gram": dict(method="projection", value_dim_measure="loss_gram"),
    "proj., value dims by energy": dict(method="projection", value_dim_measure="energy"),
    "proj., value dims by full Gram": dict(method="projection", value_dim_measure="gram"),
    "proj., key dims by q^.k^ Gram": dict(method="projection", key_dim_measure="qk_gram"),
    "proj., key dims by E[q^2]E[k^2]": dict(method="projection", key_dim_measure="qk_energy"),
    "proj., key dims by E[q^2]": dict(method="projection", key_dim_measure="q_energy"),
    "proj., key dims by E[k^2]": dict(method="projection", key_dim_measure="k_energy"),
}


class Evaluator:
    """Slices the model in memory and measures the loss on a text (one cached model per geometry)."""

    def __init__(self, model, *, text: str, windows: int, seq_len: int, cache: dict | None = None) -> None:
        self.model = model
        self.config = model.config
        self.base_sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.layers = [prefix for prefix, _ in find_gdn_modules(model)]
        self.shape = GDNShape.from_config(model.config)
        self.text, self.windows, self.seq_len = text, windows, seq_len
        self._models = cache if cache is not None else {}
        self._models.setdefault(self.shape, model)
        self.evals = 0
        self.base = self.loss(None, self.shape)

    def _model_for(self, target: GDNShape):
        if target not in self._models:
            config = copy.deepcopy(self.config)
            for key, value in target.config_updates().items():
                setattr(config, key, value)
            self._models[target] = type(self.model)(config).eval()
        return self._models[target]

    def loss_of_state_dict(self, sd, target: GDNShape) -> float:
        model = self._model_for(target)
        model.load_state_dict(sd, strict=True)
        self.evals += 1
        return demo_data.validation_loss(
            model, seq_len=self.seq_len, num_windows=self.windows, text=self.text
        )

    def loss(self, perms: dict[str, GDNPermutation] | None, target: GDNShape) -> float:
        """Loss after permuting every layer by ``perms`` (None = identity) and slicing to ``target``."""
        sd = dict(self.base_sd)
        for prefix in self.layers:
            slice_gated_delta_net_state_dict(
                sd,
                prefix=prefix,
                shape=self.shape,
                target=target,
                permutation=None if perms is None else perms[prefix],
            )
        return self.loss_of_state_dict(sd, target)

    def loss_without_heads(self, prefix: str, heads) -> float:
        """Loss with the given value heads of one layer removed (their out_proj columns zeroed: exact)."""
        sd = dict(self.base_sd)
        dv = self.shape.value_head_dim
        w = sd[f"{prefix}.out_proj.weight"].clone()
        for h in heads:
            w[:, h * dv : (h + 1) * dv] = 0
        sd[f"{prefix}.out_proj.weight"] = w
        return self.loss_of_state_dict(sd, self.shape)


def _replace(perm: GDNPermutation, **orders) -> GDNPermutation:
    fields = {a: getattr(perm, a) for a in AXES}
    fields.update({k: torch.as_tensor(v) for k, v in orders.items()})
    return GDNPermutation(**fields)


def reversed_perms(perms):
    return {p: GDNPermutation(*(getattr(x, a).flip(-1) for a in AXES)) for p, x in perms.items()}


def identity_perms(ev):
    return {p: GDNPermutation.identity(ev.shape) for p in ev.layers}


def _order(kept, n):
    return list(kept) + [i for i in range(n) if i not in kept]


# --------------------------------------------------------------------------------------------------
# reference optima (searched on the search evaluator)


def per_layer_key_groups(ev: Evaluator, keep: int) -> dict:
    """Issue's reference: every key-group subset of each layer alone (others unpruned), winners combined."""
    Hk, r = ev.shape.num_key_heads, ev.shape.value_heads_per_group
    perms = identity_perms(ev)
    for prefix in ev.layers:
        best = min(
            itertools.combinations(range(Hk), keep),
            key=lambda kept: ev.loss_without_heads(
                prefix, [g * r + j for g in range(Hk) if g not in kept for j in range(r)]
            ),
        )
        perms[prefix] = _replace(perms[prefix], key_groups=_order(best, Hk))
    return perms


def per_layer_lanes(ev: Evaluator, keep: int) -> dict:
    """Issue's reference: every lane choice per group of each layer alone (others unpruned), winners combined."""
    Hk, r = ev.shape.num_key_heads, ev.shape.value_heads_per_group
    choices = list(itertools.product(itertools.combinations(range(r), keep), repeat=Hk))
    perms = identity_perms(ev)
    for prefix in ev.layers:
        best = min(
            choices,
            key=lambda ch: ev.loss_without_heads(
                prefix, [g * r + j for g, kept in enumerate(ch) for j in range(r) if j not in kept]
            ),
        )
        perms[prefix] = _replace(perms[prefix], value_lanes=[_order(kept, r) for kept in best])
    return perms


def joint_key_groups(ev: Evaluator, keep: int) -> dict:
    """Exhaustive joint search over the kept key-group subset of every layer."""
    Hk, r = ev.shape.num_key_heads, ev.shape.value_heads_per_group
    target = ev.shape.replace(num_key_heads=keep, num_value_heads=keep * r)
    base = identity_perms(ev)
    best, best_perms = float("inf"), None
    for choice in itertools.product(itertools.combinations(range(Hk), keep), repeat=len(ev.layers)):
        perms = {p: _replace(base[p], key_groups=_order(kept, Hk)) for p, kept in zip(ev.layers, choice)}
        loss = ev.loss(perms, target)
        if loss < best:
            best, best_perms = loss, perms
    return best_perms


def joint_lanes(ev: Evaluator, keep: int, start: dict, sweeps: int = 2) -> dict:
    """Coordinate descent over layers, every lane choice per group of the layer, from ``start``."""
    Hk, r = ev.shape.num_key_heads, ev.shape.value_heads_per_group
    target = ev.shape.replace(num_value_heads=Hk * keep)
    choices = list(itertools.product(itertools.combinations(range(r), keep), repeat=Hk))
    perms = dict(start)
    best = ev.loss(perms, target)
    for _ in range(sweeps):
        for prefix in ev.layers:
            for choice in choices:
                trial = dict(perms)
                trial[prefix] = _replace(perms[prefix], value_lanes=[_order(kept, r) for kept in choice])
                loss = ev.loss(trial, target)
                if loss < best:
                    best, perms = loss, trial
    return perms


def leave_one_out_key_dims(ev: Evaluator) -> dict:
    """Per layer and key head, the key channels ranked by the loss increase when zeroed alone in q and k."""
    s = ev.shape
    Hk, dk = s.num_key_heads, s.key_head_dim
    perms = identity_perms(ev)
    for prefix in ev.layers:
        losses = torch.zeros(Hk, dk)
        for g in range(Hk):
            for d in range(dk):
                sd = dict(ev.base_sd)
                rows = [g * dk + d, s.key_dim + g * dk + d]
                for name in ("in_proj_qkv.weight", "conv1d.weight"):
                    t = sd[f"{prefix}.{name}"].clone()
                    t[rows] = 0
                    sd[f"{prefix}.{name}"] = t
                losses[g, d] = ev.loss_of_state_dict(sd, s)
        perms[prefix] = _replace(perms[prefix], key_dim=losses.argsort(dim=-1, descending=True, stable=True))
    return perms


def leave_one_out_value_dims(ev: Evaluator) -> dict:
    """Per layer, the value channels ranked by the loss increase when sliced out (of every head) alone."""
    s = ev.shape
    dv = s.value_head_dim
    target = s.replace(value_head_dim=dv - 1)
    perms = identity_perms(ev)
    for prefix in ev.layers:
        losses = torch.zeros(dv)
        for e in range(dv):
            trial = identity_perms(ev)
            trial[prefix] = _replace(trial[prefix], value_dim=[x for x in range(dv) if x != e] + [e])
            losses[e] = ev.loss(trial, target)
        perms[prefix] = _replace(perms[prefix], value_dim=losses.argsort(descending=True, stable=True))
    return perms


# --------------------------------------------------------------------------------------------------


def targets(shape: GDNShape, combined: GDNShape) -> list[tuple[str, str, GDNShape]]:
    """``(axis, label, target)`` for every axis at 50% and 25% kept (where representable) + the combined one."""
    out = []
    for axis in AXES:
        full = shape.value_heads_per_group if axis == "value_lanes" else getattr(shape, AXIS_FIELD[axis])
        for frac in (0.5, 0.25):
            keep = full * frac
            if keep < 1 or keep != int(keep):
                continue
            keep = int(keep)
            if axis == "value_lanes":
                t = shape.replace(num_value_heads=shape.num_key_heads * keep)
            elif axis == "key_groups":
                t = shape.replace(num_key_heads=keep, num_value_heads=keep * shape.value_heads_per_group)
            else:
                t = shape.replace(**{AXIS_FIELD[axis]: keep})
            out.append((axis, f"{AXIS_LABEL[axis]} {keep}/{full} ({frac:.0%})", t))
    out.append(
        (
            "combined",
            f"combined Hk {combined.num_key_heads}, r {combined.value_heads_per_group}, "
            f"dk {combined.key_head_dim}, dv {combined.value_head_dim}",
            combined,
        )
    )
    return out


def gdn(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks quality gdn", description="The GDN axes' orders.")
    p.add_argument(
        "--calib-samples", type=int, default=64, help="calibration windows of training text (default 64)"
    )
    p.add_argument(
        "--calib-seq-len", type=int, default=256, help="tokens per calibration window (default 256)"
    )
    p.add_argument("--val-windows", type=int, default=48, help="validation windows (default 48)")
    p.add_argument(
        "--search-windows",
        type=int,
        default=16,
        help="training-text windows for the optimum searches (default 16)",
    )
    p.add_argument(
        "--seq-len", type=int, default=256, help="tokens per validation / search window (default 256)"
    )
    p.add_argument("--random-orders", type=int, default=20, help="random orders per target (default 20)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random orders (default 0)")
    p.add_argument("--combined", default="3,2,24,24", help="combined target Hk,r,dk,dv (default 3,2,24,24)")
    p.add_argument("--no-optimum", action="store_true", help="skip the reference optimum searches")
    p.add_argument(
        "--no-variants", action="store_true", help="skip the projection variants and the experiment"
    )
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--json", type=Path, default=None, help="also write all numbers to this JSON file")
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="byte-level Qwen3.5 model folder (default: the bundled model)",
    )
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    if args.model is None:
        model, _ = demo_data.load_demo_model()
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    cache: dict = {}
    ev = Evaluator(
        model, text=demo_data.validation_text(), windows=args.val_windows, seq_len=args.seq_len, cache=cache
    )
    sev = Evaluator(
        model, text=demo_data.train_text(), windows=args.search_windows, seq_len=args.seq_len, cache=cache
    )
    Hk, r, dk, dv = (int(x) for x in args.combined.split(","))
    combined = GDNShape(Hk, Hk * r, dk, dv)
    print(
        f"model {args.model or 'bundled'} {ev.shape}, {len(ev.layers)} GDN layers; validation loss {ev.base:.4f} "
        f"nats/byte ({args.val_windows} windows x {args.seq_len}); calibration {args.calib_samples} x "
        f"{args.calib_seq_len} training bytes; {torch.get_num_threads()} threads",
        flush=True,
    )

    calib = demo_data.byte_windows(demo_data.train_text(), args.calib_seq_len, args.calib_samples)
    batches = [calib[i : i + 4] for i in range(0, calib.shape[0], 4)]
    orders: dict[str, dict] = {}
    methods = dict(METHODS) if args.no_variants else {**METHODS, **VARIANTS}
    for name, kwargs in methods.items():
        orders[name] = scores_to_permutations(
            score_model(model, batches, progress=False, blocks=GDN_ONLY, **kwargs)
        )
    orders["identity"] = identity_perms(ev)
    orders["reversed projection"] = reversed_perms(orders["projection"])
    gen = torch.Generator().manual_seed(args.seed)
    randoms = [
        {p: GDNPermutation.random(ev.shape, generator=gen) for p in ev.layers}
        for _ in range(args.random_orders)
    ]
    loo = {}
    if not args.no_optimum:
        loo = {"key_dim": leave_one_out_key_dims(sev), "value_dim": leave_one_out_value_dims(sev)}
        print(f"leave-one-out rankings done ({time.perf_counter() - t0:.0f} s)", flush=True)

    results = {
        "base_loss": ev.base,
        "shape": ev.shape.as_dict(),
        "args": {k: str(v) for k, v in vars(args).items()},
        "targets": [],
    }
    for axis, label, target in targets(ev.shape, combined):
        row = {"axis": axis, "label": label, "target": target.as_dict(), "methods": {}}
        for name, perms in orders.items():
            row["methods"][name] = ev.loss(perms, target) - ev.base
        row["random"] = [ev.loss(perms, target) - ev.base for perms in randoms]
        row["optimum"], row["joint_optimum"] = None, None
        if not args.no_optimum and axis != "combined":
            if axis == "key_groups":
                keep = target.num_key_heads
                row["optimum"] = ev.loss(per_layer_key_groups(sev, keep), target) - ev.base
                row["joint_optimum"] = ev.loss(joint_key_groups(sev, keep), target) - ev.base
            elif axis == "value_lanes":
                keep = target.value_heads_per_group
                per_layer = per_layer_lanes(sev, keep)
                row["optimum"] = ev.loss(per_layer, target) - ev.base
                start = min((per_layer, orders["projection"]), key=lambda x: sev.loss(x, target))
                row["joint_optimum"] = ev.loss(joint_lanes(sev, keep, start), target) - ev.base
            else:
                row["optimum"] = ev.loss(loo[axis], target) - ev.base
        results["targets"].append(row)
        print(
            f"  {label}: done ({ev.evals + sev.evals} evaluations, {time.perf_counter() - t0:.0f} s)",
            flush=True,
        )

    print()
    print(report(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    print(f"\n{ev.evals + sev.evals} evaluations in {time.perf_counter() - t0:.0f} s")
    return 0


def _stats(row):
    rand = row["random"]
    mean = statistics.fmean(rand)
    std = statistics.stdev(rand) if len(rand) > 1 else 0.0
    return mean, std, min(rand)


def _gap(row, value, key="optimum"):
    """(random mean - value) / (random mean - optimum), None when the optimum is not below the random mean."""
    opt = row.get(key)
    mean = _stats(row)[0]
    if opt is None or mean - opt <= 1e-9:
        return None
    return (mean - value) / (mean - opt)


def _fmt_gap(g):
    return "–" if g is None else f"{g:.0%}"


def report(results) -> str:
    """Markdown tables of the loss increases and the checks against the targets."""
    lines = []
    names = list(results["targets"][0]["methods"])
    header = ["target", *names, "random mean ± std (best)", "per-layer optimum", "joint optimum"]
    lines.append(
        f"Validation loss increase over the unpruned model ({results['base_loss']:.4f} nats/byte); lower is better:"
    )
    lines.append("")
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "---|" * len(header))
    for row in results["targets"]:
        mean, std, best = _stats(row)
        opt = "–" if row["optimum"] is None else f"{row['optimum']:.3f}"
        jopt = "–" if row.get("joint_optimum") is None else f"{row['joint_optimum']:.3f}"
        cells = [
            row["label"],
            *(f"{row['methods'][n]:.3f}" for n in names),
            f"{mean:.3f} ± {std:.3f} ({best:.3f})",
            opt,
            jopt,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(
        "Share of random orders beaten / gap closed vs the per-layer optimum / vs the joint optimum "
        "(channels: the leave-one-out ranking):"
    )
    lines.append("")
    scored = [n for n in names if n != "identity"]
    lines.append("| " + " | ".join(["target", *scored]) + " |")
    lines.append("|" + "---|" * (len(scored) + 1))
    for row in results["targets"]:
        cells = [row["label"]]
        for n in scored:
            v = row["methods"][n]
            beaten = sum(v < x for x in row["random"]) / len(row["random"])
            cell = f"{beaten:.0%} / {_fmt_gap(_gap(row, v))}"
            if row.get("joint_optimum") is not None:
                cell += f" / {_fmt_gap(_gap(row, v, 'joint_optimum'))}"
            cells.append(cell)
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    half = {row["axis"]: row for row in results["targets"] if "(50%)" in row["label"]}
    checks = []
    beats = {
        a: sum(half[a]["methods"]["projection"] < x for x in half[a]["random"]) / len(half[a]["random"])
        for a in half
    }
    checks.append(
        (
            "projection beats >= 90% of random orders on all four axes (50%)",
            len(beats) == 4 and all(b >= 0.9 for b in beats.values()),
            ", ".join(f"{a} {b:.0%}" for a, b in beats.items()),
        )
    )
    for key, what in (
        ("optimum", "per-layer optimum, the issue's reference"),
        ("joint_optimum", "joint optimum"),
    ):
        gaps = {
            a: _gap(half[a], half[a]["methods"]["projection"], key)
            for a in ("key_groups", "value_lanes")
            if a in half
        }
        detail = ", ".join(f"{a} {_fmt_gap(g)}" for a, g in gaps.items())
        ok = len(gaps) == 2 and all(g is not None and g >= 0.7 for g in gaps.values())
        if any(half[a].get(key) is None for a in gaps):
            detail = "optimum not computed"
        checks.append(
            (f"projection closes >= 70% of the gap on key groups and lanes (50%, vs the {what})", ok, detail)
        )
    if "activation" in names:
        not_worse = {a: half[a]["methods"]["projection"] <= half[a]["methods"]["activation"] for a in half}
        checks.append(
            (
                "projection no worse than activation on >= 3 of 4 axes (50%)",
                sum(not_worse.values()) >= 3,
                ", ".join(f"{a} {'yes' if v else 'no'}" for a, v in not_worse.items()),
            )
        )
    lines.append("Targets:")
    for text, ok, detail in checks:
        lines.append(f"- {'MET' if ok else 'NOT MET'}: {text} ({detail})")
    return "\n".join(lines)


# ---- dense: MLP channels and attention heads -------------------------------------------------------------------


def _dense_loss(model, args, blocks, orders) -> float:
    cut = slice_model(model, None, blocks=blocks, block_orders=orders)
    return demo_data.validation_loss(cut, seq_len=args.seq_len, num_windows=args.val_windows)


def _reversed(payload: dict) -> dict:
    out = dict(payload)
    for key, value in payload.items():
        if key.endswith("_order_most_important_first"):
            out[key] = [row[::-1] for row in value] if value and isinstance(value[0], list) else value[::-1]
    return out


def _attention_choices(block) -> list[dict]:
    """Orders that put every possible set of key-value groups and query heads first (for exhaustive cuts)."""
    nkv, r = block.shape.num_key_value_heads, block.shape.heads_per_group
    out = []
    for groups in itertools.permutations(range(nkv)):
        for rows in itertools.product(list(itertools.permutations(range(r))), repeat=nkv):
            out.append(orders_to_payload({"kv_groups": list(groups), "query_heads": [list(x) for x in rows]}))
    return out


def dense(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks quality dense", description="MLP channels and attention heads."
    )
    p.add_argument(
        "--model", type=Path, default=None, help="byte-level model folder (default: the bundled model)"
    )
    p.add_argument(
        "--calib-samples", type=int, default=64, help="calibration windows of training text (default 64)"
    )
    p.add_argument("--calib-seq-len", type=int, default=128)
    p.add_argument("--val-windows", type=int, default=48, help="validation windows (default 48)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--random-orders", type=int, default=20)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", type=Path, default=None, help="also write all numbers to this JSON file")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    if args.model is None:
        model, _ = demo_data.load_demo_model()
    else:
        model = load_pretrained(args.model, dtype=torch.float32).eval()
    base = demo_data.validation_loss(model, seq_len=args.seq_len, num_windows=args.val_windows)
    calib = demo_data.byte_windows(demo_data.train_text(), args.calib_seq_len, args.calib_samples)
    batches = [calib[i : i + 4] for i in range(0, calib.shape[0], 4)]
    blocks = find_model_blocks(model)
    orders = {}
    for method in ("projection", "activation"):
        scores = score_model(model, batches, method=method, progress=False)
        orders[method] = {b.prefix: scores["layers"][b.prefix] for b in blocks}
    orders["identity"] = None
    orders["reversed projection"] = {k: _reversed(v) for k, v in orders["projection"].items()}
    g = torch.Generator().manual_seed(0)
    randoms = [
        {b.prefix: orders_to_payload(random_orders(b, generator=g)) for b in blocks}
        for _ in range(args.random_orders)
    ]
    mlp = next((b for b in blocks if b.kind in ("mlp", "shared_expert")), None)
    attention = [b for b in blocks if b.kind == "attention"]
    cuts = []
    if mlp is not None:
        key = "intermediate_size" if mlp.kind == "mlp" else "shared_expert_intermediate_size"
        for frac in (2, 4, 8):
            cuts.append(
                (f"MLPs at 1/{frac} of the channels", {key: mlp.shape.intermediate_size // frac}, "mlp")
            )
    if attention:
        a = attention[0].shape
        cuts += [
            (
                "attention: 1 key-value group",
                {"num_key_value_heads": 1, "num_attention_heads": a.heads_per_group},
                "attention",
            ),
            (
                "attention: 1 query head per group",
                {"num_key_value_heads": a.num_key_value_heads, "num_attention_heads": a.num_key_value_heads},
                "attention",
            ),
            ("attention: 1 head", {"num_key_value_heads": 1, "num_attention_heads": 1}, "attention"),
        ]
    print(
        f"model {args.model or 'bundled'}: {len(blocks)} sub-blocks ({', '.join(sorted({b.kind for b in blocks}))}); "
        f"validation loss {base:.4f} nats/byte ({args.val_windows} windows x {args.seq_len}); calibration "
        f"{args.calib_samples} x {args.calib_seq_len} training bytes",
        flush=True,
    )
    results = []
    for label, target, kind in cuts:
        kind_blocks = [b for b in blocks if (b.kind == "attention") == (kind == "attention")]
        fields = {b.prefix: target for b in kind_blocks}
        row = {"cut": label, "target": target}
        for method, method_orders in orders.items():
            chosen = None if method_orders is None else {p: method_orders[p] for p in fields}
            row[method] = _dense_loss(model, args, fields, chosen) - base
        row["random"] = [_dense_loss(model, args, fields, {p: r[p] for p in fields}) - base for r in randoms]
        if kind == "attention" and len(kind_blocks) == 1:
            block = kind_blocks[0]
            every = [
                _dense_loss(model, args, fields, {block.prefix: c}) - base for c in _attention_choices(block)
            ]
            row["best possible"], row["worst possible"] = min(every), max(every)
        results.append(row)
        print(_dense_format(row), flush=True)
    print(f"({time.perf_counter() - t0:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps({"base_loss": base, "results": results}, indent=1))
    return 0


def _dense_format(row: dict) -> str:
    rnd = row["random"]
    mean, std = statistics.mean(rnd), statistics.pstdev(rnd)
    beats = {m: sum(v > row[m] for v in rnd) / len(rnd) for m in ("projection", "activation")}
    parts = [
        f"{row['cut']:<36}",
        f"projection {row['projection']:+.4f} (beats {beats['projection']:.0%} of random)",
        f"activation {row['activation']:+.4f} (beats {beats['activation']:.0%})",
        f"identity {row['identity']:+.4f}",
        f"reversed {row['reversed projection']:+.4f}",
        f"random {mean:+.4f} +- {std:.4f}",
    ]
    if "best possible" in row:
        parts.append(f"best/worst possible {row['best possible']:+.4f}/{row['worst possible']:+.4f}")
    return "  ".join(parts)


# ---- methods: lane search and compensation on several models -----------------------------------------------------

METHOD_NAMES = ("default", "refined", "compensated", "refined+comp.", "sequential", "activation")


def _seq_name(reference: str) -> str:
    return "sequential" if reference == "stream" else f"seq. ({reference} ref.)"


def compensated_loss(ev: Evaluator, perms, target: GDNShape, stats) -> float:
    """Loss after permuting, slicing and refitting every layer's out_proj for ``target``."""
    sd = dict(ev.base_sd)
    for prefix in ev.layers:
        kept = perms[prefix].indices(ev.shape, target=target)["vidx"].numpy()
        weight = ev.base_sd[f"{prefix}.out_proj.weight"].double().numpy()
        columns = compensate.compensated_columns(weight, stats[prefix]["out_moment"], kept)
        slice_gated_delta_net_state_dict(
            sd, prefix=prefix, shape=ev.shape, target=target, permutation=perms[prefix]
        )
        sd[f"{prefix}.out_proj.weight"] = torch.from_numpy(columns).to(
            ev.base_sd[f"{prefix}.out_proj.weight"].dtype
        )
    return ev.loss_of_state_dict(sd, target)


def sequential_loss(
    ev: Evaluator, model, perms, target: GDNShape, batches, reference: str
) -> tuple[float, float]:
    """Loss after cutting in memory and refitting out_proj layer by layer (and the refit's seconds)."""
    model.load_state_dict(ev.base_sd)  # the evaluators' searches load edited weights into this very model
    small = slice_model(model, target, perms)
    t = time.perf_counter()
    compensate.sequential_refit(model, small, batches, reference=reference)
    seconds = time.perf_counter() - t
    return ev.loss_of_state_dict(small.state_dict(), target), seconds


def methods_model(name: str, args) -> dict:
    t0 = time.perf_counter()
    if name == "bundled":
        model, corpus = demo_data.load_demo_model()[0], "pydoc"
    else:
        model = load_pretrained(name, dtype=torch.float32).eval()
        corpus = json.loads((Path(name) / "training.json").read_text())["corpus"].get("name", "pydoc")
    cache: dict = {}
    ev = Evaluator(
        model, text=demo_data.validation_text(corpus), windows=args.val_windows, seq_len=256, cache=cache
    )
    sev = Evaluator(
        model, text=demo_data.train_text(corpus), windows=args.search_windows, seq_len=256, cache=cache
    )
    calib = demo_data.byte_windows(demo_data.train_text(corpus), 256, args.calib_samples)
    batches = list(calib.split(4))
    t = time.perf_counter()
    scores = score_model(model, batches, progress=False, blocks=GDN_ONLY)
    cost = {"score": time.perf_counter() - t}
    t = time.perf_counter()
    refined, report = refine_lane_orders(model, batches[: args.refine_batches], scores, progress=False)
    cost["refine"] = time.perf_counter() - t
    t = time.perf_counter()
    stats = compensate.collect_statistics(model, batches)
    cost["statistics"] = time.perf_counter() - t
    orders = {
        "default": scores_to_permutations(scores),
        "refined": scores_to_permutations(refined),
        "activation": scores_to_permutations(
            score_model(model, batches, method="activation", progress=False, blocks=GDN_ONLY)
        ),
    }
    gen = torch.Generator().manual_seed(args.seed)
    randoms = [
        {p: GDNPermutation.random(ev.shape, generator=gen) for p in ev.layers}
        for _ in range(args.random_orders)
    ]
    s = ev.shape
    combined = GDNShape(
        max(1, s.num_key_heads * 3 // 4),
        max(1, s.num_key_heads * 3 // 4) * max(1, s.value_heads_per_group // 2),
        s.key_head_dim * 3 // 4,
        s.value_head_dim * 3 // 4,
    )
    rows = []
    for axis, label, target in targets(s, combined):
        row = {"axis": axis, "label": label, "target": target.as_dict(), "methods": {}}
        for n in ("default", "refined", "activation"):
            row["methods"][n] = ev.loss(orders[n], target) - ev.base
        row["methods"]["compensated"] = compensated_loss(ev, orders["default"], target, stats) - ev.base
        row["methods"]["refined+comp."] = compensated_loss(ev, orders["refined"], target, stats) - ev.base
        for reference in args.references.split(","):
            value, seconds = sequential_loss(ev, model, orders["default"], target, batches, reference)
            row["methods"][_seq_name(reference)] = value - ev.base
            cost.setdefault("sequential", []).append(seconds)
        row["random"] = [ev.loss(perms, target) - ev.base for perms in randoms]
        row["optimum"] = None
        if not args.no_optimum and axis in ("key_groups", "value_lanes"):
            search = per_layer_key_groups if axis == "key_groups" else per_layer_lanes
            keep = target.num_key_heads if axis == "key_groups" else target.value_heads_per_group
            row["optimum"] = ev.loss(search(sev, keep), target) - ev.base
        rows.append(row)
        print(f"  {name} {label}: done ({time.perf_counter() - t0:.0f} s)", flush=True)
    return {
        "model": name,
        "corpus": corpus,
        "shape": s.as_dict(),
        "layers": len(ev.layers),
        "base_loss": ev.base,
        "cost_seconds": cost,
        "refine_forwards": report["forwards"],
        "rows": rows,
    }


def _methods_gap(row, value):
    mean = statistics.fmean(row["random"])
    if row["optimum"] is None or mean - row["optimum"] <= 1e-9:
        return None
    return (mean - value) / (mean - row["optimum"])


def print_methods_model(result: dict) -> None:
    s = result["shape"]
    c = result["cost_seconds"]
    print(
        f"\n{result['model']}: {result['layers']} GDN layers, Hk {s['num_key_heads']} Hv {s['num_value_heads']} "
        f"dk {s['key_head_dim']} dv {s['value_head_dim']}, corpus {result['corpus']}, base loss "
        f"{result['base_loss']:.4f}; cost: score {c['score']:.1f} s, refine {c['refine']:.1f} s "
        f"({result['refine_forwards']} partial forwards), statistics {c['statistics']:.1f} s, sequential refit "
        f"{statistics.fmean(c['sequential']):.1f} s per target"
    )
    methods = result["rows"][0]["methods"]
    names = [*(n for n in METHOD_NAMES if n in methods), *(n for n in methods if n not in METHOD_NAMES)]
    header = ["target", *names, "random mean", "optimum", "beaten (def/ref)", "gap (def/ref)"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in result["rows"]:
        m = row["methods"]
        beaten = [sum(m[n] < x for x in row["random"]) / len(row["random"]) for n in ("default", "refined")]
        gaps = [_methods_gap(row, m[n]) for n in ("default", "refined")]
        cells = [
            row["label"],
            *(f"{m[n]:.3f}" for n in names),
            f"{statistics.fmean(row['random']):.3f}",
            "–" if row["optimum"] is None else f"{row['optimum']:.3f}",
            " / ".join(f"{b:.0%}" for b in beaten),
            " / ".join("–" if g is None else f"{g:.0%}" for g in gaps),
        ]
        print("| " + " | ".join(cells) + " |")


def methods(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks quality methods", description="Lane search and compensation."
    )
    p.add_argument("--models", default="bundled", help="comma-separated: bundled and/or model folders")
    p.add_argument("--calib-samples", type=int, default=64)
    p.add_argument(
        "--refine-batches", type=int, default=4, help="calibration batches of 4 windows for refine (4)"
    )
    p.add_argument("--val-windows", type=int, default=32)
    p.add_argument("--search-windows", type=int, default=16)
    p.add_argument("--random-orders", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-optimum", action="store_true")
    p.add_argument(
        "--references",
        default="stream",
        help="comma-separated references of the sequential refit: stream (the 'sequential' column), "
        "full, cut (default stream)",
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"load average {os.getloadavg()[0]:.1f}; threads {args.threads}")
    results = []
    for name in args.models.split(","):
        results.append(methods_model(name.strip(), args))
        print_methods_model(results[-1])
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
    half_lanes = [
        r for res in results for r in res["rows"] if r["axis"] == "value_lanes" and "(50%)" in r["label"]
    ]
    combined = [r for res in results for r in res["rows"] if r["axis"] == "combined"]
    print("\nTargets:")
    for n in ("default", "refined"):
        ok = all(
            sum(r["methods"][n] < x for x in r["random"]) / len(r["random"]) >= 0.9
            and (_methods_gap(r, r["methods"][n]) or 0) >= 0.7
            for r in half_lanes
        )
        print(
            f"- lanes at 50% with {n} orders beat >= 90% of random orders and close >= 70% of the gap on every "
            f"model: {'MET' if ok else 'NOT MET'}"
        )
    cut = [
        1 - r["methods"]["compensated"] / r["methods"]["default"]
        for r in combined
        if r["methods"]["default"] > 0
    ]
    print(
        f"- compensation cuts the combined-target loss increase by {statistics.fmean(cut):.0%} on average "
        f"(target >= 25%): {'MET' if statistics.fmean(cut) >= 0.25 else 'NOT MET'} ({', '.join(f'{c:.0%}' for c in cut)})"
    )
    for reference in args.references.split(","):
        name = _seq_name(reference)
        cut = [
            1 - r["methods"][name] / r["methods"]["default"] for r in combined if r["methods"]["default"] > 0
        ]
        print(
            f"- {name} cuts the combined-target loss increase by {statistics.fmean(cut):.0%} on average "
            f"(target >= 25%): {'MET' if statistics.fmean(cut) >= 0.25 else 'NOT MET'} "
            f"({', '.join(f'{c:.0%}' for c in cut)})"
        )
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    return 0


PARTS = {"gdn": gdn, "dense": dense, "methods": methods}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in PARTS:
        print(
            f"usage: python -m benchmarks quality {{{','.join(PARTS)}}} [--help | OPTIONS]", file=sys.stderr
        )
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    return PARTS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
