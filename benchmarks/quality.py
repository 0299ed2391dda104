#!/usr/bin/env python
"""Quality of the importance orders on the bundled demo model: validation loss after slicing.

For each axis alone (key groups, value heads per group, key head dim, value head dim) at 50% and 25% kept
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

Usage::

    python benchmarks/quality.py                     # defaults: 10-25 minutes on 2 shared CPU cores
    python benchmarks/quality.py --search-windows 8  # noisier optimum searches, about 9 minutes
    python benchmarks/quality.py --no-optimum --no-variants        # about 2 minutes
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from gdnprune import demo_data  # noqa: E402
from gdnprune.gated_delta_net import GDNPermutation, GDNShape, slice_gated_delta_net_state_dict  # noqa: E402
from gdnprune.model.layouts import find_gdn_modules  # noqa: E402
from gdnprune.scoring import GDN_ONLY, score_model, scores_to_permutations  # noqa: E402

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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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


if __name__ == "__main__":
    sys.exit(main())
