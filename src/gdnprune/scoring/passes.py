"""The forward passes of scoring: the scorers of a model's sub-blocks, and one pass over the calibration
batches with every scorer's hooks attached (and the loss gradients at the final norm, when a head is
given). :func:`gdnprune.scoring.api.measure_statistics` builds the scorers and reads their sums."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from tqdm.auto import tqdm

from ..model.forwards import input_device, unpack_batch, unpack_weight
from ..model.subblock_geometry import KINDS
from ..model.subblock_surgery import find_model_blocks
from .experts import ExpertScorer
from .hooks import LayerScorer
from .loss_head import LossGradients, loss_positions
from .subblocks import BlockScorer

__all__ = ["make_block_scorers", "supported_kinds", "run_batches"]


def make_block_scorers(
    model: torch.nn.Module, kinds: tuple[str, ...] | None, method: str, expert_sample_tokens: int = 0
) -> list[Any]:
    """The scorers of the sub-blocks of ``kinds`` (None: every kind; ``()``: none) that ``model`` has (the
    experts' with a sample of ``expert_sample_tokens`` routed tokens for the greedy removal)."""
    if kinds == ():
        return []
    block_method = method if method != "random" else "activation"  # random: no statistics are used
    return [
        ExpertScorer(b, model.get_submodule(b.prefix), block_method, expert_sample_tokens)
        if b.kind == "experts"
        else BlockScorer(b, model.get_submodule(b.prefix), block_method)
        for b in find_model_blocks(model, supported_kinds(model, kinds))
    ]


def run_batches(
    model: Any,
    batches: Iterable[Any],
    scorers: list[LayerScorer],
    block_scorers: list[Any],
    head: Any,
    stride: int | None,
    window_offset: int,
    total: int | None,
    progress: bool,
) -> None:
    """The forward passes of :func:`gdnprune.scoring.api.measure_statistics` over ``batches``, with the
    scorers' hooks attached (and with a loss ``head``, the gradients of every ``stride``-th token handed to
    them); the model's training mode is restored."""
    extra: dict[str, Any] = {"use_cache": False}
    try:
        if "logits_to_keep" in inspect.signature(model.forward).parameters:
            extra["logits_to_keep"] = 1  # no need for the full vocabulary projection
    except (TypeError, ValueError):  # pragma: no cover
        pass
    device = input_device(model)
    handles = []
    final: dict[str, torch.Tensor] = {}
    gradients = None if head is None else LossGradients(head, scorers)
    windows_seen = window_offset
    was_training = model.training
    model.eval()
    try:
        for attached in [*scorers, *block_scorers]:
            handles.extend(attached.attach())
        if head is not None:
            handles.append(
                head[0].register_forward_pre_hook(lambda module, args: final.__setitem__("hidden", args[0]))
            )
        with torch.no_grad():
            for batch in tqdm(batches, total=total, disable=not progress, desc="scoring", unit="batch"):
                ids, mask = unpack_batch(batch)
                weight = unpack_weight(batch)
                root = None if weight is None else weight.sqrt().float()
                select = None if stride is None else loss_positions(ids, mask, windows_seen, stride)
                for scorer in scorers:
                    scorer.token_mask = mask
                    scorer.token_root_weight = root
                    scorer.loss_select = select
                for block_scorer in block_scorers:
                    block_scorer.token_mask = mask
                    block_scorer.token_root_weight = root
                    block_scorer.windows = (windows_seen, *ids.shape)  # the experts' token sample
                windows_seen += ids.shape[0]
                kwargs = dict(extra)
                if mask is not None:
                    kwargs["attention_mask"] = mask.to(device).long()
                final.clear()
                model(input_ids=ids.to(device), **kwargs)
                if gradients is not None:
                    assert select is not None  # a loss head selects tokens
                    gradients.add(final.pop("hidden", None), ids, select)
            if gradients is not None:
                gradients.flush()
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)


def supported_kinds(model: torch.nn.Module, asked: tuple[str, ...] | None) -> list[str]:
    """The sub-block kinds of ``asked`` (None: every kind) that fit a layout in ``model`` (an indexed
    attention, say, is left to GDN scoring; a warning says so when the kind was asked for by name)."""
    kinds = []
    for kind in KINDS if asked is None else asked:
        try:
            find_model_blocks(model, (kind,))
        except ValueError as exc:
            if asked is not None:
                warnings.warn(
                    f"gdnprune score: {exc}; its {kind} sub-blocks are not scored",
                    UserWarning,
                    stacklevel=5,  # measure_statistics' caller's caller, through make_block_scorers
                )
            continue
        kinds.append(kind)
    return kinds
