"""Self-contained outputs (``--self-contained``): a folder that loads without gdnprune.

A heterogeneous output (``per_layer_config`` in ``config.json``) loads with :func:`gdnprune.load_pretrained`.
A self-contained output also loads with plain
``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` where gdnprune is not installed
(lm-evaluation-harness, TRL, PEFT, ...), as NVIDIA's heterogeneous Nemotron-NAS checkpoints do: the folder
holds a small modeling file (:data:`MODELING_NAME`, gdnprune's package data, importing only transformers)
and ``config.json`` an ``auto_map`` that points the Auto classes to it. ``model_type`` stays, so
``AutoConfig`` is transformers' own config class; only the model class comes from the folder, and it is
transformers' class of the same name built layer by layer. Saving such a model with ``save_pretrained``
writes the file and ``auto_map`` again (transformers copies the code of remote classes).

Writing it is idempotent: a self-contained folder sliced again keeps the file (rewritten with this version)
and its ``auto_map``. No torch here: the file is copied as bytes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from ..runtime.fileio import write_json_atomic
from .folder import CONFIG_NAME

__all__ = ["MODELING_NAME", "SelfContainedError", "auto_map", "modeling_source", "make_self_contained"]

MODELING_NAME = "modeling_gdnprune.py"
_MODULE = MODELING_NAME[: -len(".py")]

# model_type of config.json -> the class the folder loads as (for vision-language folders: the whole
# model, which is also what AutoModelForCausalLM gives, as gdnprune.load_pretrained does)
MODEL_CLASSES = {
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
    "qwen3_next": "Qwen3NextForCausalLM",
    "olmo_hybrid": "OlmoHybridForCausalLM",
}


class SelfContainedError(ValueError):
    """A folder that cannot be made self-contained (another family, or modeling code of its own)."""


def modeling_source() -> bytes:
    """The modeling file written into self-contained folders (gdnprune's package data)."""
    return (resources.files("gdnprune") / "data" / MODELING_NAME).read_bytes()


def auto_map(config: Mapping[str, Any]) -> dict[str, str]:
    """The ``auto_map`` entries a self-contained folder with ``config`` gets.

    Raises:
        SelfContainedError: a ``model_type`` of another family, or an ``auto_map`` that already points an
            Auto class to other modeling code (it would be replaced).
    """
    model_type = config.get("model_type")
    if model_type not in MODEL_CLASSES:
        raise SelfContainedError(
            f"--self-contained: expected a model_type of {sorted(MODEL_CLASSES)} in "
            f"{CONFIG_NAME}, found {model_type!r}"
        )
    name = f"{_MODULE}.{MODEL_CLASSES[model_type]}"
    entries = {"AutoModelForCausalLM": name}
    if name.endswith("ForConditionalGeneration"):
        entries["AutoModelForImageTextToText"] = name
    existing = config.get("auto_map") or {}
    if not isinstance(existing, Mapping):
        raise SelfContainedError(
            f"--self-contained: expected auto_map in {CONFIG_NAME} to be an object, found "
            f"{type(existing).__name__}"
        )
    foreign = {k: v for k, v in existing.items() if k in entries and v != entries[k]}
    if foreign:
        raise SelfContainedError(
            f"--self-contained: {CONFIG_NAME} already maps {foreign} to modeling code of its "
            f"own; expected no auto_map entry for these classes or {entries}"
        )
    return entries


def make_self_contained(folder: str | Path) -> dict[str, str]:
    """Write :data:`MODELING_NAME` into the model folder ``folder`` and the ``auto_map`` into its config (left
    byte for byte when it already has it). Returns the ``auto_map`` entries."""
    folder = Path(folder)
    text = (folder / CONFIG_NAME).read_text(encoding="utf-8")
    config = json.loads(text)
    entries = auto_map(config)
    (folder / MODELING_NAME).write_bytes(modeling_source())
    existing = config.get("auto_map") or {}
    if any(existing.get(k) != v for k, v in entries.items()):
        config["auto_map"] = {**existing, **entries}
        write_json_atomic(folder / CONFIG_NAME, config, indent=2)
    return entries
