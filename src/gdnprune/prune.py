"""``prune``: score a checkpoint folder on calibration text, then sort and slice it in one streaming pass."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["prune_checkpoint"]


def prune_checkpoint(
    model_dir: str | Path,
    data: str | Path,
    output_dir: str | Path,
    target: Any,
    *,
    overwrite: bool = False,
    progress: bool = True,
    **scoring: Any,
) -> dict[str, Any]:
    """Score ``model_dir`` on ``data``, then sort and slice it to ``target`` in one streaming pass.

    ``target`` is a ``GDNShape`` or a mapping of some of its fields (axes not given keep their size);
    ``scoring`` takes the options of :func:`gdnprune.scoring.score_checkpoint` (``method``,
    ``num_samples``, ``seq_len``, ``batch_size``, ``device``, ``dtype``, ``device_map``, ``seed``). The
    output path and the target are checked before the (long) scoring starts. Returns the manifest.
    """
    from .checkpoint import find_gdn_layers, open_checkpoint, transform_checkpoint
    from .checkpoint.output import check_paths, clear_stale
    from .scoring import score_checkpoint
    from .targets import resolve_target

    clear_stale(Path(output_dir))
    check_paths(Path(model_dir), Path(output_dir), overwrite)
    layers, _ = find_gdn_layers(open_checkpoint(model_dir))
    resolve_target(layers[0].shape, target)  # raises TargetError (a ValueError) for an illegal target
    scores = score_checkpoint(model_dir, data, progress=progress, **scoring)
    extra = {"scores": {k: v for k, v in scores.items() if k != "layers"}}
    return transform_checkpoint(model_dir, output_dir, permutations=scores["layers"], target=target,
                                operation="prune", overwrite=overwrite, progress=progress, manifest_extra=extra)
