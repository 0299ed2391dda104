"""Importance of the hidden channels (the residual stream's width): the hooks, the float64 statistics and
the order.

Every RMS norm on the residual stream (the decoder layers' ``input_layernorm``, ``post_attention_layernorm``,
OLMo-hybrid's post-norms, the final ``norm``) is hooked: per norm ``l`` and channel ``i``, over the
calibration tokens, the sums of ``|n_i|`` and ``n_i^2`` of its output ``n = norm(x)`` (weight included,
zero-centred or not, as the module computes it), of ``x_i^2`` of its input and of ``(x_i / rms(x))^2``; and,
for the ``projection`` measure, the energy every reader of the stream takes from channel ``i``:
``sum_t n_i(t)^2 ||W[:, i]||^2`` over the projections that read it (the LM head through the final norm).

Measures (:data:`HIDDEN_MEASURES`, derived in ``docs/scoring.md``), each a score per channel, the order
descending:

* ``activation`` (Minitron, arXiv 2407.14679): the mean magnitude of the normalised activations, summed over
  the norms: ``sum_l mean_t |n_{l,i}|``;
* ``activation_l2``: ``sum_l sqrt(mean_t n_{l,i}^2)``;
* ``activation_layer``: each norm's mean magnitudes divided by their mean over the channels before the sum
  (every norm weighs the same, whatever its scale);
* ``activation_max``: the largest of those per-norm shares;
* ``stream``: ``sum_l mean_t (x_{l,i} / rms(x_l))^2``, the channel's share of the stream itself (the norm
  weights left out);
* ``projection``: the readers' energy above, the measure the other axes use (what a cut removes from the
  inputs of every projection that reads the stream).

The statistics add up over batches, processes and shares (a sum over tokens each), so the order needs no
model (:func:`gdnprune.scoring.payload.hidden_payload`). The payload joins the scores file under its
top-level ``hidden`` key.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ..io.sharded_loading import sharded_loading_names
from ..model.hidden import HiddenTensors, is_residual_norm
from ..model.subblock_surgery import find_model_hidden
from .hooks import materialized_weight
from .payload import HiddenStatistics

__all__ = ["BY_DEFAULT", "HiddenScorer", "make_hidden_scorer", "hidden_asked", "stored_norms"]


class HiddenScorer:
    """Hooks and float64 statistics of the hidden channels of a loaded model.

    Statistics: ``num_tokens``; per norm (rows in :attr:`norms` order, ``[norms, H]``): ``norm_abs``,
    ``norm_sq``, ``input_sq``, ``unit_sq``; ``reader_sq`` [H] (the readers' energy).
    """

    def __init__(self, model: Any, hidden: HiddenTensors) -> None:
        self.model, self.hidden = model, hidden
        modules = dict(model.named_modules())
        self.norms = [
            n[: -len(".weight")]
            for n in hidden.rules
            if is_residual_norm(n) and n[: -len(".weight")] in modules
        ]
        if not self.norms:
            raise ValueError(
                f"{type(model).__name__}: no RMS norm on the residual stream to score its hidden channels"
            )
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        self.head = head if head is not None and any(m is head for m in modules.values()) else None
        self.final = self._final_norm(modules)
        self.readers = [
            name
            for name, module in modules.items()
            if module is not self.head
            and not isinstance(module, torch.nn.Embedding)  # it writes the stream
            and _is_matrix(getattr(module, "weight", None))
            and any(
                r.axis == 1 and r.ndim == 2 and r.segments == ("hidden",)
                for r in hidden.rules.get(f"{name}.weight", ())
            )
        ]
        size, n = hidden.shape.hidden_size, len(self.norms)
        self.stats: dict[str, torch.Tensor] = {
            "num_tokens": torch.zeros((), dtype=torch.int64),
            **{
                k: torch.zeros(n, size, dtype=torch.float64)
                for k in ("norm_abs", "norm_sq", "input_sq", "unit_sq")
            },
            "reader_sq": torch.zeros(size, dtype=torch.float64),
        }
        self._columns: dict[str, torch.Tensor] = {}
        self.token_mask: torch.Tensor | None = None  # [B, T] bool of the current batch, None = all tokens
        # the current batch (set by the forward passes before each one): a norm counts once per batch (the
        # loss-gradient head runs the final norm again on some tokens)
        self.windows: Any = None
        self._counted: tuple[Any, set[int]] = (None, set())

    def _final_norm(self, modules: Mapping[str, torch.nn.Module]) -> str | None:
        """The norm whose output the LM head reads (the decoder's ``norm``)."""
        decoder = self.model.get_decoder() if hasattr(self.model, "get_decoder") else None
        norm = getattr(decoder, "norm", None)
        return next((name for name in self.norms if modules[name] is norm), None)

    def attach(self) -> list[Any]:
        """Register the hooks; returns the handles."""
        handles = []
        for row, name in enumerate(self.norms):
            handles.append(self.model.get_submodule(name).register_forward_hook(self._on_norm(row, name)))
        for name in self.readers:
            handles.append(self.model.get_submodule(name).register_forward_pre_hook(self._on_reader(name)))
        return handles

    def _tokens(self, x: torch.Tensor) -> torch.Tensor:
        if self.token_mask is not None and x.dim() == 3 and x.shape[:2] == self.token_mask.shape:
            x = x[self.token_mask.to(x.device)]
        return x.reshape(-1, x.shape[-1]).to(torch.float64)

    def _column_sq(self, name: str, module: torch.nn.Module) -> torch.Tensor:
        if name not in self._columns:
            weight = materialized_weight(module).detach().to(torch.float64)
            self._columns[name] = weight.pow(2).sum(0).cpu()
        return self._columns[name]

    def _on_norm(self, row: int, name: str):
        @torch.no_grad()
        def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
            if self._counted[0] != self.windows or self.windows is None:
                self._counted = (self.windows, set())
            if row in self._counted[1]:
                return
            self._counted[1].add(row)
            x, n = self._tokens(args[0].detach()), self._tokens(output.detach())
            if row == 0:
                self.stats["num_tokens"] += x.shape[0]
            rms = x.pow(2).mean(-1, keepdim=True).clamp_min(1e-30).sqrt()
            self.stats["norm_abs"][row] += n.abs().sum(0).cpu()
            self.stats["norm_sq"][row] += n.pow(2).sum(0).cpu()
            self.stats["input_sq"][row] += x.pow(2).sum(0).cpu()
            self.stats["unit_sq"][row] += (x / rms).pow(2).sum(0).cpu()
            if name == self.final and self.head is not None:
                self.stats["reader_sq"] += n.pow(2).sum(0).cpu() * self._column_sq("lm_head", self.head)

        return hook

    def _on_reader(self, name: str):
        @torch.no_grad()
        def hook(module: torch.nn.Module, args: tuple) -> None:
            x = self._tokens(args[0].detach())
            self.stats["reader_sq"] += x.pow(2).sum(0).cpu() * self._column_sq(name, module)

        return hook

    def statistics(self, measure: str) -> HiddenStatistics:
        """The statistics, as the scoring run's result holds them."""
        return HiddenStatistics(self.hidden.shape.hidden_size, list(self.norms), self.stats, measure)


def _is_matrix(weight: Any) -> bool:
    return isinstance(weight, torch.Tensor) and weight.dim() == 2


def make_hidden_scorer(model: torch.nn.Module, asked: bool | None) -> HiddenScorer | None:
    """The hidden channels' scorer of ``model``: ``asked`` True (``blocks`` names ``hidden``), None (the
    default ``blocks``: where the hidden-size table describes the model) or False (none). A model the table
    does not describe gets none (with a warning when ``hidden`` was asked for)."""
    if asked is False:
        return None
    try:
        return HiddenScorer(model, find_model_hidden(model))
    except ValueError as exc:
        if asked:
            warnings.warn(
                f"gdnprune score: {exc}; the hidden channels are not scored", UserWarning, stacklevel=4
            )
        return None


#: whether the default ``blocks`` (None) scores the hidden channels: no, though the plan's default ``blocks``
#: (:data:`gdnprune.plan.measure.subblocks.BLOCK_NAMES`) holds ``hidden``: a sort by a hidden order rewrites every
#: tensor of the model (and an FP8 one's scale tiles refuse it), so the hidden channels are ordered where asked
#: for, and a default plan cuts the hidden size where its scores order them (``prune`` scores them itself
#: under a whole-model budget)
BY_DEFAULT = False


def hidden_asked(blocks: Sequence[str] | bool | None) -> bool | None:
    """Whether ``blocks`` asks to score the hidden channels: True (it names ``hidden``), None (the default
    ``blocks`` with :data:`BY_DEFAULT`: where the model's residual stream is in the hidden-size table), False
    (it leaves it out, or the default does)."""
    if blocks is None or blocks is True:
        return None if BY_DEFAULT else False
    if blocks is False:
        return False
    return "hidden" in ([blocks] if isinstance(blocks, str) else list(blocks))


def stored_norms(model_dir: str | Path, model: Any, norms: list[str]) -> list[str]:
    """The norms' module names as the folder stores their weights (``from_pretrained`` may rename them: a
    vision-language prefix, OLMo-hybrid's ``attention_layer_norm``); unchanged where the folder cannot say."""
    try:
        stored = sharded_loading_names(model_dir, model)
    except ValueError:
        return list(norms)
    out = []
    for norm in norms:
        where = stored.get(f"{norm}.weight")
        name = where.name if where is not None else None
        out.append(name[: -len(".weight")] if name and name.endswith(".weight") else norm)
    return out
