"""``inspect_checkpoint``: what a checkpoint folder holds that gdnprune can cut — every GDN layer, every
attention / MLP / shared-expert / routed-expert block, every decoder layer — with the parameters of each, as
the plan counts them. Reads ``config.json`` and the shard headers only (no tensor data, no torch)."""

from __future__ import annotations

import collections
import os
import re
from typing import Any

from ..io.plan_file import state_elements
from ..model.hidden import find_hidden
from ..model.layer_removal import attention_layers, num_layers_of, removal_name_map
from ..model.model_config import text_config
from ..model.subblock_geometry import KINDS, names_under
from .folder import (
    Checkpoint,
    CheckpointError,
    find_block_layers,
    find_gdn_layers,
    open_checkpoint,
    tile_size,
)

__all__ = ["inspect_checkpoint"]


def _inspect_sub_blocks(ckpt: Checkpoint) -> tuple[list[dict], dict[str, int]]:
    """The sub-blocks of every kind for :func:`inspect_checkpoint`, and their parameters per kind."""
    out: list[dict[str, Any]] = []
    by_kind: dict[str, int] = {}
    ordered = sorted(ckpt.names)
    for kind in KINDS:
        try:
            layers = find_block_layers(ckpt, (kind,))
        except CheckpointError as exc:
            out.append({"kind": kind, "unsupported": str(exc)})
            continue
        for layer in layers:
            fixed = [
                n
                for n in names_under(ordered, layer.prefix)
                if n[len(layer.prefix) + 1 :] not in layer.tensors
                and not n[len(layer.prefix) + 1 :].startswith(KINDS[kind].excludes)
            ]
            parameters = layer.parameters + sum(ckpt.tensor(n).numel for n in fixed)
            out.append(
                {
                    "prefix": layer.prefix,
                    "kind": kind,
                    "layout": layer.layout,
                    **layer.shape.as_dict(),
                    "parameters": parameters,
                }
            )
            by_kind[kind] = by_kind.get(kind, 0) + parameters
    return out, by_kind


def _inspect_hidden(ckpt: Checkpoint) -> dict:
    """The hidden size and the parameters on the residual stream (a cut to ``K`` keeps ``K / H`` of them), or
    ``{"unsupported": reason}`` where the hidden-size table does not describe the checkpoint."""
    try:
        residual = find_hidden(ckpt.shapes, ckpt.config, tile_size=tile_size(ckpt))
    except ValueError as exc:
        return {"unsupported": str(exc)}
    return {**residual.shape.as_dict(), "parameters": sum(ckpt.tensor(n).numel for n in residual.rules)}


_LAYER_NUMBER = re.compile(r"(?:^|\.)layers\.(\d+)\.")  # the decoder layer of a tensor, as depth numbers it


def _inspect_decoder_layers(ckpt: Checkpoint) -> list[dict]:
    """Every decoder layer with all of its parameters (what removing it takes off the budget): ``index``,
    ``type`` (``layer_types``), ``parameters``, ``removable`` (a plan keeps one full-attention layer)."""
    try:
        num_layers = num_layers_of(ckpt.config)
    except (KeyError, TypeError, ValueError):
        return []
    sizes: collections.Counter = collections.Counter()
    for name, new in removal_name_map(ckpt.names, num_layers, range(num_layers)).items():
        match = _LAYER_NUMBER.search(name)
        assert match is not None  # removal_name_map names only layer tensors
        sizes[int(match.group(1))] += ckpt.tensor(name).numel if new is None else 0
    text = text_config(ckpt.config)
    types = dict(enumerate(text.get("layer_types") or []))
    keep = attention_layers(ckpt.config)
    return [
        {"index": i, "type": types.get(i), "parameters": sizes[i], "removable": keep != [i]}
        for i in range(num_layers)
    ]


def inspect_checkpoint(model_dir: str | os.PathLike) -> dict:
    """Describe a checkpoint folder: every GDN layer and the parameter totals (reads headers only).

    Returns a JSON-ready dict with ``model_dir``, ``model_type``, ``format`` (``sharded`` or
    ``single-file``), ``shards``, ``dtypes`` (tensor count per dtype), ``gdn_shape`` (None when the layers
    differ: ``heterogeneous``), ``layers`` (one dict per GDN layer: ``prefix``, ``layout``, the four geometry
    fields, ``parameters``, ``state_elements`` (recurrent state per sequence), ``shards``),
    ``gdn_parameters``, ``sub_blocks`` (the attention / MLP / shared-expert blocks: prefix, kind, layout,
    geometry, parameters; a kind whose modules fit no layout gives ``{"kind", "unsupported": reason}``),
    ``decoder_layers`` (``index``, ``type``, ``parameters``, ``removable``), ``hidden`` (``hidden_size`` and
    the ``parameters`` of every tensor on the residual stream, or ``unsupported``), ``parameters_by_kind`` (``gdn``,
    each sub-block kind, ``other``: embeddings, norms, vision tower, ``mtp.*``), ``other_parameters`` (everything but GDN), ``total_parameters``, ``total_bytes``, ``passthrough`` and
    ``manifest`` (operation and sorted flag of a gdnprune output, else None).

    Raises:
        CheckpointError: as :func:`open_checkpoint` and :func:`find_gdn_layers`.
    """
    ckpt = open_checkpoint(model_dir)
    layers, skipped = find_gdn_layers(ckpt)
    total = sum(ckpt.tensor(n).numel for n in ckpt.names)
    gdn = sum(layer.parameters for layer in layers)
    dtypes = collections.Counter(ckpt.tensor(n).dtype for n in ckpt.names)
    config = ckpt.config
    sub_blocks, by_kind = _inspect_sub_blocks(ckpt)
    return {
        "model_dir": str(ckpt.path),
        "model_type": config.get("model_type"),
        "architectures": config.get("architectures"),
        "format": "sharded" if ckpt.index is not None else "single-file",
        "shards": len(ckpt.shards),
        "dtypes": dict(sorted(dtypes.items())),
        "gdn_shape": layers[0].shape.as_dict() if len({layer.shape for layer in layers}) == 1 else None,
        "heterogeneous": len({layer.shape for layer in layers}) > 1,
        "layers": [
            {
                "prefix": layer.prefix,
                "layout": layer.layout,
                **layer.shape.as_dict(),
                "parameters": layer.parameters,
                "state_elements": state_elements(layer.shape, layer.conv_kernel),
                "quantized": layer.quantized,
                "shards": sorted(
                    {
                        os.path.basename(ckpt.shards[ckpt.shard_of(t.name)].path)
                        for t in layer.tensors.values()
                    }
                ),
            }
            for layer in layers
        ],
        "gdn_parameters": gdn,
        "sub_blocks": sub_blocks,
        "decoder_layers": _inspect_decoder_layers(ckpt),
        "hidden": _inspect_hidden(ckpt),
        "parameters_by_kind": {"gdn": gdn, **by_kind, "other": total - gdn - sum(by_kind.values())},
        "other_parameters": total - gdn,
        "total_parameters": total,
        "total_bytes": ckpt.total_bytes,
        "passthrough": skipped,
        "manifest": None
        if ckpt.manifest is None
        else {
            "operation": ckpt.manifest.get("operation"),
            "sorted": ckpt.is_sorted,
        },
    }
