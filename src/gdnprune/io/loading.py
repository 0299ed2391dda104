"""``load_pretrained``: a normal transformers model from a checkpoint whose GDN layers differ in width.

A per-layer plan writes transformers' own convention into ``config.json``: ``per_layer_config``
(``{layer index: {linear_*: value}}``, transformers' ``HeterogeneousConfigMixin``). transformers 5.x
parses it, but its Qwen and OLMo modeling still builds every GDN layer from the global config, and
reading a per-layer attribute globally raises ``AmbiguousGlobalPerLayerAttributeError`` — so plain
``from_pretrained`` fails loudly instead of loading wrong shapes. :func:`load_pretrained` builds each GDN
module from its own layer's config (``config.per_layer_config[i]``) for the duration of
``from_pretrained``, then returns the model: every other module, the weight loading, dtypes, device maps,
the cache and ``save_pretrained`` are transformers' own. The recurrent cache sizes its conv and delta-rule
states from the tensors each layer passes it, so cached generation works with per-layer shapes.

A checkpoint with one GDN geometry loads exactly as ``from_pretrained`` loads it.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import transformers
from accelerate.utils import get_max_memory

from ..gated_delta_net import GDNPermutation, slice_gated_delta_net_state_dict
from ..model.geometry import GDNShape, apply_targets_to_config, layer_index_of
from ..model.hidden import (
    ORDER_KEY,
    apply_hidden_to_config,
    norm_factors,
    norm_offset,
    orders_from_payload,
    rescaled_norm,
    resolve_hidden_target,
)
from ..model.layouts import find_gdn_modules
from ..model.model_config import config_value, text_config
from ..model.subblock_geometry import (
    BLOCK_FIELDS,
    KINDS,
    apply_block_targets_to_config,
    block_kinds_of,
    resolve_block_target,
)
from ..model.subblock_surgery import (
    find_model_blocks,
    find_model_hidden,
    slice_block_state_dict,
    slice_hidden_state_dict,
)
from ..model.targets import resolve_target
from ..runtime.distributed import launch_info
from .model_classes import empty_pretrained, heterogeneous, per_layer_gdn_modules, resolve_class
from .scores_file import matching_prefixes
from .sharded_loading import ShardedLoadingError, load_sharded

__all__ = [
    "load_pretrained",
    "empty_pretrained",
    "load_causal_lm",
    "empty_causal_lm",
    "slice_model",
    "per_layer_gdn_modules",
]


def load_pretrained(
    path: str | os.PathLike, *, model_class: Any = None, **from_pretrained_kwargs: Any
) -> Any:
    """Load a Hugging Face model folder, with per-layer GDN geometries when ``config.json`` has them.

    Args:
        path: the model folder (a gdnprune output or any checkpoint ``from_pretrained`` reads).
        model_class: the transformers class to load with (default: the config's ``architectures`` entry,
            e.g. ``Qwen3_5ForConditionalGeneration`` for a vision-language checkpoint, else
            ``AutoModelForCausalLM``). An Auto class works too.
        **from_pretrained_kwargs: passed to ``from_pretrained`` (``dtype``, ``device_map``,
            ``output_loading_info``, ...).

    Returns:
        What ``model_class.from_pretrained`` returns: a normal transformers model whose GDN modules have
        their own geometry (``module.num_v_heads`` etc.), and whose config keeps ``per_layer_config``.
    """
    config = from_pretrained_kwargs.pop("config", None) or transformers.AutoConfig.from_pretrained(path)
    loader, concrete = resolve_class(config, model_class)
    text = text_config(config)
    if not heterogeneous(text) and not heterogeneous(config):
        return loader.from_pretrained(path, config=config, **from_pretrained_kwargs)
    with per_layer_gdn_modules(concrete):
        return loader.from_pretrained(path, config=config, **from_pretrained_kwargs)


def load_causal_lm(
    model_dir: str | os.PathLike,
    *,
    dtype: str = "float32",
    device: str | None = None,
    device_map: str | None = None,
    gpus: list[int] | None = None,
) -> Any:
    """A causal LM from ``model_dir`` in eval mode, for calibration forwards (the text part of a
    vision-language checkpoint; per-layer GDN geometries as :func:`load_pretrained` reads them; a
    ``compressed-tensors`` checkpoint with its weights dequantized, its activations quantized as its scheme
    says).

    ``dtype``: ``"float32"`` or ``"bfloat16"``. ``device``: where the model goes without a ``device_map``
    (default: the local rank's GPU when CUDA is available, else cpu). ``gpus``: with a ``device_map``, the
    only GPUs it may use (this rank's block, :func:`gdnprune.runtime.distributed.local_gpus`).
    """
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    model = _read_moe(model_dir, torch_dtype) if device_map is None else None
    if model is not None:
        return model.to(device or _default_device()).eval()
    kwargs: dict[str, Any] = {"dtype": torch_dtype}
    if device_map is not None:
        kwargs["device_map"] = device_map
        if gpus is not None:
            available = get_max_memory()
            kwargs["max_memory"] = {k: v for k, v in available.items() if not isinstance(k, int) or k in gpus}
    config = os.path.join(model_dir, "config.json")
    quantized = os.path.isfile(config) and '"quantization_config"' in open(config, encoding="utf-8").read()
    # compressed-tensors draws bars as it loads a quantized folder, and has no switch for them
    with without_bars() if quantized else contextlib.nullcontext():
        try:
            model = load_pretrained(model_dir, model_class=transformers.AutoModelForCausalLM, **kwargs)
        except ValueError as first:
            try:
                model = load_pretrained(model_dir, **kwargs)  # the class in config.json's architectures
            except ValueError:
                raise ValueError(f"{model_dir}: cannot load a causal language model ({first})") from None
        compressor = getattr(getattr(model, "hf_quantizer", None), "compressor", None)
        if compressor is not None:  # compressed-tensors: dense weights now, not at the first forward
            compressor.decompress_model(model)
    if device_map is None:
        model.to(device or _default_device())
    return model.eval()


@contextlib.contextmanager
def without_bars() -> Iterator[None]:
    """Leave tqdm progress bars out of what is written to stderr inside (a dependency's, drawn while a model
    loads); anything else written there passes, once the block ends."""
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stderr(buffer):
            yield
    finally:
        lines = buffer.getvalue().replace("\r", "\n").splitlines()
        kept = [line for line in lines if line.strip() and not BAR.search(line)]
        if kept:
            sys.stderr.write("\n".join(kept) + "\n")


#: a tqdm progress bar's line
BAR = re.compile(r"\d+%\|")


def _read_moe(model_dir: str | os.PathLike, dtype: torch.dtype) -> Any:
    """An MoE model read straight from its files into a model built on ``meta`` (sharded loading's reader, one
    process holding every row), or None when the folder is not an MoE model's or stores something that reader
    cannot read. transformers' loading converts the one-tensor-per-expert form of released MoE checkpoints
    with a copy of its conversion operations per tensor: seconds per thousand experts, minutes for a model of
    48 layers of 512 experts; this reads the same tensors in the time their bytes take."""
    try:
        config = transformers.AutoConfig.from_pretrained(model_dir)
    except (OSError, ValueError):
        return None
    if not config_value(text_config(config), "num_experts"):
        return None
    for model_class in (transformers.AutoModelForCausalLM, None):  # as load_causal_lm tries them
        try:
            return load_sharded(model_dir, lambda model: None, model_class=model_class, dtype=dtype)
        except (ShardedLoadingError, ValueError, KeyError):
            continue
    return None


def empty_causal_lm(model_dir: str | os.PathLike) -> Any:
    """The causal LM that :func:`load_causal_lm` would load, built on the ``meta`` device from the folder's
    config alone: every module with its shapes and per-layer GDN geometry, no weight read or allocated.
    For what needs the structure only (the plan's proxy sensitivity)."""
    config = transformers.AutoConfig.from_pretrained(model_dir)
    text = text_config(config)
    try:
        loader, concrete = resolve_class(config, transformers.AutoModelForCausalLM)
    except ValueError as first:
        try:
            loader, concrete = resolve_class(config, None)  # the class in config.json's architectures
        except ValueError:
            raise ValueError(f"{model_dir}: cannot build a causal language model ({first})") from None
    per_layer = heterogeneous(text) or heterogeneous(config)
    with per_layer_gdn_modules(concrete) if per_layer else contextlib.nullcontext(), torch.device("meta"):
        model = loader.from_config(config) if loader is not concrete else concrete(config)
    return model.eval()


def _default_device() -> str:
    """cuda (the local rank's GPU under a launcher) when CUDA is available, else cpu."""
    if not torch.cuda.is_available():
        return "cpu"
    info = launch_info()
    return f"cuda:{(info.local_rank if info else 0) % max(1, torch.cuda.device_count())}"


def slice_model(
    model: Any,
    targets: Any = None,
    permutations: Any = None,
    *,
    blocks: Any = None,
    block_orders: Any = None,
    hidden_size: int | None = None,
    hidden_order: Mapping[str, Any] | None = None,
    rescale_norms: bool = False,
) -> Any:
    """A new model: ``model`` with every GDN layer sorted by ``permutations`` and cut to its target, in memory,
    and its attention and MLP sub-blocks sorted by ``block_orders`` and cut to ``blocks``.

    Args:
        model: a loaded transformers model with GDN layers.
        targets: one target for every GDN layer (a ``GDNShape`` or a mapping of some of its fields), or
            ``{module prefix: target}`` (layers not named keep their geometry); None: GDN layers keep theirs.
        permutations: ``{module prefix: GDNPermutation or score payload}`` (None: no sorting).
        blocks: sub-block target fields (``intermediate_size``, ``shared_expert_intermediate_size``,
            ``num_attention_heads``, ``num_key_value_heads``) for every sub-block that has them, or
            ``{sub-block prefix: fields}`` (e.g. ``"model.layers.3.self_attn"``); None: no cut.
        block_orders: ``{sub-block prefix: orders or score payload}`` (:mod:`gdnprune.model.subblock_surgery`).
        hidden_size: the hidden size (the residual stream's width) to keep (:mod:`gdnprune.model.hidden`);
            None: no cut.
        hidden_order: the hidden channels' order (a scores file's ``hidden`` payload, or ``{"channels": [H]}``).
        rescale_norms: with a hidden cut, the correction of the RMS norms on the stream for the mean over fewer
            channels (:func:`gdnprune.model.hidden.norm_factors`, from ``hidden_order``'s ``norm_input_sq``).

    The new model's config records the per-layer geometry as a sliced checkpoint does (the plain keys
    when the layers agree, ``per_layer_config`` when they differ), so ``save_pretrained`` writes a folder
    that :func:`load_pretrained` reads back.
    """
    modules = find_gdn_modules(model)
    per_layer = (
        isinstance(targets, dict)
        and all(isinstance(v, (GDNShape, dict)) for v in targets.values())
        and set(targets) <= {p for p, _ in modules}
    )
    state = dict(model.state_dict())
    chosen = {}
    for prefix, module in modules:
        shape = GDNShape.from_module(module)
        target = resolve_target(shape, (targets or {}).get(prefix) if per_layer else targets)
        perm = None if permutations is None else permutations.get(prefix)
        if isinstance(perm, dict):
            perm = GDNPermutation.from_score_payload(perm, shape)
        slice_gated_delta_net_state_dict(state, prefix=prefix, shape=shape, target=target, permutation=perm)
        chosen[layer_index_of(prefix)] = target
    config = apply_targets_to_config(model.config.to_dict(), chosen)
    if blocks is not None or block_orders:
        per_block = isinstance(blocks, Mapping) and not set(blocks) <= set(BLOCK_FIELDS)
        named = set(block_orders or {}) | (set(blocks) if per_block else set())
        kinds = {kind.name for p in named for kind in block_kinds_of(p)}
        kinds |= {k.name for k in KINDS.values() if not per_block and set(blocks or {}) & set(k.config_keys)}
        found = find_model_blocks(model, sorted(kinds))  # only the kinds asked for: others may be unsupported
        by_prefix = {b.prefix: b for b in found}
        unknown = sorted(named - set(by_prefix))
        absent = (
            []
            if per_block
            else sorted(f for f in (blocks or {}) if not any(f in KINDS[b.kind].config_keys for b in found))
        )
        if absent:
            raise ValueError(
                f"no sub-block of this model has {absent} (its sub-blocks: "
                f"{sorted({b.kind for b in found}) or 'none'})"
            )
        if unknown:
            raise ValueError(
                f"{unknown} are not sub-blocks of this model (its sub-blocks: {sorted(by_prefix)[:4]} ...)"
            )
        cut: dict[str, dict[int, Any]] = {}
        for block in found:
            fields = (blocks or {}).get(block.prefix) if per_block else blocks
            target = resolve_block_target(block, fields)
            slice_block_state_dict(state, block, target, orders=(block_orders or {}).get(block.prefix))
            cut.setdefault(block.kind, {})[layer_index_of(block.prefix)] = target
        for kind, kind_targets in cut.items():
            config = apply_block_targets_to_config(config, kind, kind_targets)
    if hidden_size is not None or hidden_order is not None:
        residual = find_model_hidden(model)
        orders = hidden_order
        if orders is not None and ORDER_KEY in orders:
            orders = orders_from_payload(orders, residual.shape)
        kept = resolve_hidden_target(residual.shape, hidden_size)
        slice_hidden_state_dict(state, residual, kept, orders=orders)
        config = apply_hidden_to_config(config, kept)
        if rescale_norms:
            if hidden_order is None:
                raise ValueError("`rescale_norms` reads the norms' statistics of the scores' hidden order")
            offset = norm_offset(model.config)
            factors = norm_factors(hidden_order, kept.hidden_size)
            names = {n: matching_prefixes(n, list(residual.rules)) for n in factors}
            unknown = sorted(n for n, found in names.items() if len(found) != 1)
            if unknown:
                raise ValueError(f"the scores' norms {unknown[:3]} are not norms of this model")
            for name, factor in factors.items():
                key = names[name][0]
                weight = state[key]
                state[key] = torch.from_numpy(
                    rescaled_norm(weight.double().cpu().numpy(), factor, offset)
                ).to(weight.dtype)
    config = type(model.config).from_dict(config)
    with per_layer_gdn_modules(type(model)):
        new = type(model)(config)
    new.load_state_dict(state, strict=True)
    return new.to(next(model.parameters()).dtype).eval()
