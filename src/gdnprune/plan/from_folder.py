"""``plan_checkpoint``: a plan search (or a snap to a servable plan) on a model folder and a calibration file."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from ..checkpoint import read_manifest
from ..io.loading import empty_causal_lm, load_causal_lm
from ..quality.calibration import calibration_windows, iter_batches
from ..runtime.fileio import file_sha256
from ..scoring.from_folder import default_seq_len
from .api import plan_model
from .snap import snap_servable

__all__ = ["plan_checkpoint"]


def _scores_hash(scores: Any) -> str | None:
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
    snap: str | Path | Mapping | None = None,
    **options: Any,
) -> tuple[dict, dict]:
    """:func:`plan_model` on a model folder and a calibration file (read as ``gdnprune score`` reads it).

    The folder's tokenizer gives the recall windows their numbers (:func:`plan_model`'s ``tokenizer``).
    When the folder is a ``gdnprune sort`` output of these very scores (its manifest records their hash),
    the orders are not applied a second time. ``model``: the folder's model already loaded
    (:func:`gdnprune.io.loading.load_causal_lm`; then ``device``, ``dtype`` and ``device_map`` are not used).
    The proxy sensitivity needs no weights: without ``model`` it builds the model on the ``meta`` device
    from the config (:func:`gdnprune.io.loading.empty_causal_lm`) and reads no tensor. ``snap``: a heterogeneous
    plan to snap to the best servable plan near it (:func:`~gdnprune.plan.snap.snap_servable`; the budgets and
    grid are the plan's, ``options`` gives ``sensitivity`` and ``progress``); with ``snap_quant`` in ``options``,
    to the best plan whose cut widths fit quantization tiles of that size (servable too with ``servable``).
    """
    model_dir = Path(model_dir)
    manifest = read_manifest(model_dir) or {}
    applied = (
        not isinstance(scores, Mapping)
        and manifest.get("sorted")
        and (manifest.get("scores") or {}).get("sha256") == _scores_hash(scores)
    )
    batches, tokenizer = None, None
    if options.get("sensitivity", "halving") != "proxy":
        if data is None:
            raise ValueError("measured sensitivity needs calibration data (`data`)")
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        if seq_len is None:
            seq_len = default_seq_len(json.loads((model_dir / "config.json").read_text()), tokenizer)[0]
        windows = calibration_windows(data, tokenizer, seq_len=seq_len, num_samples=num_samples)
        batches = list(iter_batches(windows, batch_size))
    if model is None:
        model = (
            load_causal_lm(model_dir, dtype=dtype, device=device, device_map=device_map)
            if batches is not None
            else empty_causal_lm(model_dir)
        )
    if snap is not None:
        if batches is None:
            raise ValueError("--snap-servable measures both plans: it needs calibration data")
        plan, report = snap_servable(
            model,
            batches,
            scores,
            snap,
            sensitivity=options.get("sensitivity", "halving"),
            orders_applied=bool(applied),
            progress=options.get("progress", True),
            servable=bool(options.get("servable")) or not options.get("snap_quant"),
            snap_quant=options.get("snap_quant"),
        )
    else:
        plan, report = plan_model(
            model, batches, scores, orders_applied=bool(applied), tokenizer=tokenizer, **options
        )
    plan["model"] = str(model_dir)
    if batches is not None:
        plan["calibration"] = {
            "data": str(data),
            "num_samples": sum(int(b.shape[0]) for b in batches),
            "seq_len": int(seq_len or 0),
            "batch_size": batch_size,
        }
    return plan, report
