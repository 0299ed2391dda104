"""``plan_model`` / ``plan_checkpoint``: the best per-layer widths under a budget.

Candidates per layer (:mod:`.candidates`), their sensitivity (:mod:`.sensitivity`), the exact choice
(:mod:`.solve`); the result is a plan file (:mod:`gdnprune.plans`) and a report of every candidate.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from ..geometry import GDNShape, orders_from_payload
from ..plans import PLAN_FORMAT, PLAN_VERSION, kernel_warnings
from ..scores import match_layers, read_scores
from .candidates import AXES, layer_candidates, parse_dim_step
from .solve import BudgetError, choose, choose_uniform

__all__ = ["SENSITIVITIES", "STATE_BYTES", "BudgetError", "plan_model", "plan_checkpoint", "budget_limit"]

#: how sensitivity is obtained, the default first
SENSITIVITIES = ("measured", "proxy")
#: bytes per recurrent-state element in budgets and reports (the delta-rule state is kept in float32)
STATE_BYTES = 4


def budget_limit(value: float | None, total: int, what: str) -> float | None:
    """A budget as an absolute amount: ``value`` <= 1 is a fraction of ``total``, larger values are absolute."""
    if value is None:
        return None
    if isinstance(value, bool) or not value > 0:
        raise ValueError(f"`budget_{what}` must be a positive fraction (<= 1) or an absolute amount, got {value!r}")
    return float(value) * total if value <= 1 else float(value)


def plan_model(
    model: Any,
    batches: Iterable[Any] | None,
    scores: str | Path | Mapping,
    *,
    budget_params: float | None = None,
    budget_state: float | None = None,
    sensitivity: str = "measured",
    dim_step: str | float | int = "1/8",
    axes: Sequence[str] = AXES,
    tp: int | None = None,
    multiple_of: int | None = None,
    uniform: bool = False,
    orders_applied: bool = False,
    progress: bool = True,
) -> tuple[dict, dict]:
    """Choose every GDN layer's target under the budgets; returns ``(plan, report)``.

    Args:
        model: a loaded transformers model with GDN layers (the unsorted model the scores describe).
        batches: calibration batches for the measured sensitivity (unused by ``"proxy"``).
        scores: the scores file (or dict) of ``model``; its orders sort each layer before it is cut, and the
            proxy reads its raw scores.
        budget_params: GDN parameters kept: a fraction of the model's (<= 1) or a count.
        budget_state: recurrent-state bytes per sequence (float32) kept: a fraction (<= 1) or bytes.
        sensitivity: ``"measured"`` (KL of real cuts) or ``"proxy"`` (output energy removed, from the scores).
        dim_step: head-dim grid step: a fraction of the dim (``"1/8"``) or a channel count.
        axes: the axes the search may cut (:data:`~gdnprune.plan.candidates.AXES`).
        tp, multiple_of: serving constraints every candidate meets.
        uniform: one geometry for all layers (the best one under the budgets).
        orders_applied: the model is already sorted by these scores (e.g. a ``gdnprune sort`` output).
        progress: a progress bar over the measured candidates.

    Returns:
        The plan (a :mod:`gdnprune.plans` dict with the budgets, the predicted summed sensitivity and the
        totals) and the report (every candidate of every layer: target, parameters, state, sensitivity,
        loss, and the chosen one).

    Raises:
        ValueError: bad options, a scores file that does not fit the model, or budgets no plan meets
            (:class:`~gdnprune.plan.solve.BudgetError`).
    """
    from ..layouts import LAYOUTS, detect_layout, find_gdn_modules
    from .sensitivity import LayerToPlan, measured_sensitivity, proxy_sensitivity

    if sensitivity not in SENSITIVITIES:
        raise ValueError(f"unknown sensitivity {sensitivity!r}; expected one of {list(SENSITIVITIES)}")
    if budget_params is None and budget_state is None:
        raise ValueError("give a budget: `budget_params` and/or `budget_state`")
    step = parse_dim_step(dim_step)
    data = read_scores(scores)
    modules = find_gdn_modules(model)
    if not modules:
        raise ValueError(f"{type(model).__name__} has no GDN layers to plan")
    payload_of = match_layers(data["layers"], [p for p, _ in modules])
    missing = [p for p, _ in modules if p not in payload_of]
    if missing:
        raise ValueError(f"the scores have no entry for the GDN layers {missing[:3]}; score this model first")
    key_of = {}  # module prefix -> the prefix the scores use (checkpoint names: the plan file uses them)
    for key in data["layers"]:
        key_of.update({p: key for p in match_layers({key: None}, [p for p, _ in modules])})

    layers, table = [], []
    for prefix, module in modules:
        shape = GDNShape.from_module(module)
        tensors = {name: tuple(p.shape) for name, p in module.named_parameters()}
        layout = detect_layout(tensors)
        if layout is None:
            raise ValueError(f"{prefix}: a {type(module).__name__} of no known GDN layout (tensors {sorted(tensors)}; "
                             f"expected one of {sorted(LAYOUTS)})")
        candidates = layer_candidates(prefix, shape, tensors, layout.name, int(module.conv_kernel_size), dim_step=step,
                                      axes=axes, tp=tp, multiple_of=multiple_of)
        orders = None if orders_applied else orders_from_payload(payload_of[prefix], shape)
        layers.append(LayerToPlan(prefix, module, orders, [c.target for c in candidates]))
        table.append(candidates)

    start = time.perf_counter()
    if sensitivity == "measured":
        if batches is None:
            raise ValueError("measured sensitivity needs calibration batches")
        measured = measured_sensitivity(model, batches, layers, progress=progress)
        values = [measured["kl"][layer.prefix] for layer in layers]
        losses = [measured["loss"][layer.prefix] for layer in layers]
        extra = {"base_loss": measured["base_loss"], "tokens": measured["tokens"], "forwards": measured["forwards"]}
    else:
        # the scores' own orders and raw scores, both in the unsorted indexing: right whether or not the
        # model was sorted since
        values = [proxy_sensitivity(payload_of[layer.prefix], layer.shape, layer.candidates) for layer in layers]
        losses, extra = None, {}
    seconds = time.perf_counter() - start

    totals = {"params": sum(c[0].params for c in table), "state": sum(c[0].state for c in table) * STATE_BYTES}
    budgets = {name: limit for name, limit in (
        ("params", budget_limit(budget_params, totals["params"], "params")),
        ("state", budget_limit(budget_state, totals["state"], "state"))) if limit is not None}
    costs = {"params": [[c.params for c in cands] for cands in table],
             "state": [[c.state * STATE_BYTES for c in cands] for cands in table]}
    if uniform:
        picks = choose_uniform([[c.target for c in cands] for cands in table], values, costs, budgets)
    else:
        picks = choose(values, costs, budgets)
    chosen = {layer.prefix: table[i][pick] for i, (layer, pick) in enumerate(zip(layers, picks))}
    kept = {"params": sum(c.params for c in chosen.values()),
            "state": sum(c.state for c in chosen.values()) * STATE_BYTES}
    given = {"params": budget_params, "state": budget_state}
    plan = {
        "format": PLAN_FORMAT,
        "version": PLAN_VERSION,
        "layers": {key_of[p]: c.target.as_dict() for p, c in chosen.items()},
        "sensitivity": sensitivity,
        "uniform": bool(uniform),
        "budgets": {name: {"given": given[name], "limit": round(limit, 3)} for name, limit in budgets.items()},
        "predicted": {"summed_sensitivity": float(sum(v[pick] for v, pick in zip(values, picks))),
                      **({"measured_losses_of_chosen": [losses[i][pick] for i, pick in enumerate(picks)]}
                         if losses else {})},
        "totals": {"gdn_params": totals["params"], "gdn_params_kept": kept["params"],
                   "gdn_params_fraction": kept["params"] / totals["params"],
                   "state_bytes": totals["state"], "state_bytes_kept": kept["state"],
                   "state_fraction": kept["state"] / totals["state"]},
        "grid": {"dim_step": str(step), "axes": list(axes), "tp": tp, "multiple_of": multiple_of},
        "scores": {"sha256": _scores_hash(scores), "method": data.get("method")},
        "kernel_warnings": kernel_warnings({key_of[p]: c.target for p, c in chosen.items()}),
    }
    report = {
        "sensitivity": sensitivity,
        "seconds": round(seconds, 3),
        **extra,
        "layers": {
            key_of[layer.prefix]: {
                "shape": layer.shape.as_dict(),
                "chosen": picks[i],
                "candidates": [
                    {"target": c.target.as_dict(), "params": c.params, "state_bytes": c.state * STATE_BYTES,
                     "sensitivity": values[i][k], **({"loss": losses[i][k]} if losses else {})}
                    for k, c in enumerate(table[i])
                ],
            }
            for i, layer in enumerate(layers)
        },
    }
    return plan, report


def _scores_hash(scores: Any) -> str | None:
    from ..fileio import file_sha256

    return None if isinstance(scores, Mapping) else file_sha256(scores)


def plan_checkpoint(
    model_dir: str | Path,
    data: str | Path | None,
    scores: str | Path | Mapping,
    *,
    num_samples: int = 16,
    seq_len: int | None = None,
    batch_size: int = 4,
    device: str | None = None,
    dtype: str = "float32",
    device_map: str | None = None,
    model: Any = None,
    **options: Any,
) -> tuple[dict, dict]:
    """:func:`plan_model` on a model folder and a calibration file (read as ``gdnprune score`` reads it).

    When the folder is a ``gdnprune sort`` output of these very scores (its manifest records their hash),
    the orders are not applied a second time. ``model``: the folder's model already loaded
    (:func:`gdnprune.loading.load_causal_lm`; then ``device``, ``dtype`` and ``device_map`` are not used).
    The proxy sensitivity needs no weights: without ``model`` it builds the model on the ``meta`` device
    from the config (:func:`gdnprune.loading.empty_causal_lm`) and reads no tensor.
    """
    from ..checkpoint import read_manifest
    from ..loading import empty_causal_lm, load_causal_lm
    from ..scoring.api import default_seq_len

    model_dir = Path(model_dir)
    manifest = read_manifest(model_dir) or {}
    applied = (not isinstance(scores, Mapping) and manifest.get("sorted")
               and (manifest.get("scores") or {}).get("sha256") == _scores_hash(scores))
    batches = None
    if options.get("sensitivity", "measured") == "measured":
        import json

        from transformers import AutoTokenizer

        from ..calibration import calibration_windows, iter_batches

        if data is None:
            raise ValueError("measured sensitivity needs calibration data (`data`)")
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        if seq_len is None:
            seq_len = default_seq_len(json.loads((model_dir / "config.json").read_text()), tokenizer)[0]
        windows = calibration_windows(data, tokenizer, seq_len=seq_len, num_samples=num_samples)
        batches = list(iter_batches(windows, batch_size))
    if model is None:
        model = load_causal_lm(model_dir, dtype=dtype, device=device, device_map=device_map) if batches is not None \
            else empty_causal_lm(model_dir)
    plan, report = plan_model(model, batches, scores, orders_applied=bool(applied), **options)
    plan["model"] = str(model_dir)
    if batches is not None:
        plan["calibration"] = {"data": str(data), "num_samples": sum(int(b.shape[0]) for b in batches),
                               "seq_len": int(seq_len), "batch_size": batch_size}
    return plan, report
