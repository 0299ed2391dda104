"""The evolutionary search's fitness: the KL of the whole cut model, per calibration window.

:class:`JointKL` measures a whole plan (every layer at its candidate): the teacher pass keeps every planned
layer's input once; a plan is then run from the input of its first cut layer (the layers before it are
unchanged), with each cut layer's module swapped for the candidate module (the module a sliced checkpoint
loads, built as the sensitivity builds it), and compared with the teacher window by window. A group whose
pick is :data:`~gdnprune.plan.choose.evolve.REMOVED` has its decoder layer skipped (its output is its input). Cut
modules are swapped outermost first, each into the layer as it is by then (a cut MoE block is a copy that holds
its shared expert, which a shared-expert candidate then replaces inside the copy).
:func:`evolve_plan` runs the search (:func:`gdnprune.plan.choose.evolve.evolve`) with it (``refine_plan``: its old
name, with a ``FutureWarning``).

Under ``torchrun`` every rank holds every window and measures its share of the plans of a generation; the
values are exchanged, so every rank takes the same decisions as one process.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from ...model.forwards import Forwards
from ...runtime.deprecation import renamed_function
from ..choose.depth import skipped_output
from ..choose.evolve import REMOVED, evolve
from .halving import gather_over_ranks, rank_share, token_counts, windows_of
from .sensitivity import LayerToPlan, candidate_module, sorted_state

__all__ = ["JointKL", "evolve_plan", "refine_plan"]


class JointKL:
    """``fitness(plans, lo, hi)``: per plan (a candidate index per layer of ``layers``), the KL per token of
    the whole cut model on each calibration window ``lo..hi-1`` (the model is left as it was)."""

    def __init__(
        self,
        model: torch.nn.Module,
        batches: Iterable[Any],
        layers: Sequence[LayerToPlan],
        *,
        max_logits: int = 1 << 24,
    ):
        self.layers = list(layers)
        self.windows = windows_of(batches)
        self.forwards = Forwards(model, self.windows, max_logits=max_logits, shard=False)
        self.index = [self.forwards.decoder_index(layer.module) for layer in self.layers]
        self.forwards.teacher(self.index)
        # a transformers config (nn.Module's stubs type attributes as Tensor | Module)
        config: Any = model.config
        self.text_config = config.get_text_config(decoder=True)
        self.weights = [token_counts(w)[0] for w in self.windows]
        self.paths = []  # each group's module path inside its decoder layer ("" for the layer itself)
        for layer, i in zip(self.layers, self.index):
            names = {id(m): n for n, m in self.forwards.decoder.layers[i].named_modules()}
            self.paths.append(names[id(layer.module)])

    @torch.inference_mode()
    def kl(self, picks: Sequence[int], lo: int, hi: int) -> list[float]:
        """The KL per token of every window ``lo..hi-1`` with every layer cut to its candidate (or skipped)."""
        removed = sorted({self.index[k] for k, c in enumerate(picks) if c == REMOVED})
        cut = [
            k
            for k, (layer, c) in enumerate(zip(self.layers, picks))
            if c != REMOVED and self.index[k] not in removed and layer.candidates[c] != layer.shape
        ]
        if not cut and not removed:
            return [0.0] * (hi - lo)
        cut.sort(key=lambda k: self.paths[k].count("."))  # outer modules first
        swapped, handles = [], []
        try:
            for k in cut:
                layer = self.layers[k]
                state = sorted_state(layer)
                device = next(iter(state.values())).device
                owner, _, attr = self.paths[k].rpartition(".")
                parent = self.forwards.decoder.layers[self.index[k]].get_submodule(owner)
                swapped.append((parent, attr, getattr(parent, attr)))
                setattr(
                    parent,
                    attr,
                    candidate_module(layer, state, layer.candidates[picks[k]], self.text_config, device),
                )
            for i in removed:
                handles.append(
                    self.forwards.decoder.layers[i].register_forward_hook(skipped_output, with_kwargs=True)
                )
            with self.forwards.from_layer(min([self.index[k] for k in cut] + removed)) as measure:
                return [measure([w])[0] for w in range(lo, hi)]
        finally:
            for handle in handles:
                handle.remove()
            for parent, attr, original in reversed(swapped):
                setattr(parent, attr, original)

    def __call__(self, plans: Sequence[Sequence[int]], lo: int, hi: int) -> list[list[float]]:
        mine = {i: self.kl(plans[i], lo, hi) for i in rank_share(len(plans))}
        merged = gather_over_ranks(mine)
        return [merged[i] for i in range(len(plans))]


def evolve_plan(
    model: torch.nn.Module,
    batches: Iterable[Any],
    layers: Sequence[LayerToPlan],
    costs: Mapping[str, Sequence[Sequence[float]]],
    budgets: Mapping[str, float],
    picks: Sequence[int],
    *,
    generations: int,
    offspring: int = 8,
    seed: int = 0,
    progress: bool = True,
    max_logits: int = 1 << 24,
    layer_of: Sequence[int] | None = None,
    removable: Sequence[int] = (),
    keep_one_of: Sequence[int] = (),
) -> dict[str, Any]:
    """The evolutionary search from the plan ``picks`` (:func:`~gdnprune.plan.choose.evolve.evolve` with :class:`JointKL`).

    ``layer_of``, ``removable``, ``keep_one_of``: as :func:`~gdnprune.plan.choose.evolve.evolve` (``picks`` may mark removed layers'
    groups :data:`~gdnprune.plan.choose.evolve.REMOVED`); mutations then move between removal and width.

    Returns :func:`~gdnprune.plan.choose.evolve.evolve`'s result with ``generations``, ``offspring``, ``seed``,
    ``windows`` (calibration windows of the fitness) and ``seconds``.
    """

    start = time.perf_counter()
    fitness = JointKL(model, batches, layers, max_logits=max_logits)
    bar = tqdm(total=generations, disable=not progress, desc="evolution", unit="gen")

    def step(record: dict) -> None:
        bar.set_postfix(kl=f"{record['kl']:.4g}")
        bar.update(1)

    try:
        result = evolve(
            costs,
            budgets,
            picks,
            fitness,
            fitness.weights,
            generations=generations,
            offspring=offspring,
            seed=seed,
            on_generation=step,
            layer_of=layer_of,
            removable=removable,
            keep_one_of=keep_one_of,
        )
    finally:
        bar.close()
    result.update(
        generations=generations,
        offspring=offspring,
        seed=seed,
        windows=len(fitness.windows),
        seconds=round(time.perf_counter() - start, 3),
    )
    result["picks"] = [int(p) for p in result["picks"]]
    return result


def plan_kl(fitness: JointKL, picks: Sequence[int]) -> float:
    """The KL per token of a whole plan on every calibration window (token-weighted)."""
    values = np.asarray(fitness.kl(picks, 0, len(fitness.windows)))
    weights = np.asarray(fitness.weights, dtype=np.float64)
    return float((values * weights).sum() / weights.sum())


#: the old name of :func:`evolve_plan` ("refine" also named the lane search), kept for one release with a warning
refine_plan = renamed_function("refine_plan", evolve_plan)
