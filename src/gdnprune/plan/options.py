"""The plan search's :class:`PlanOptions` (its options as one object: what ``prune`` searches a plan with) and
:data:`SENSITIVITIES` (how the candidates' sensitivity is obtained)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from ..model.latency import Workload, parse_workload
from .measure.bld import DEFAULT_STEPS as BLD_STEPS
from .measure.candidates import AXES
from .measure.problem import WHOLE
from .measure.subblocks import BLOCK_NAMES
from .rank import RANK_LR, RANK_STEPS

__all__ = ["SENSITIVITIES", "PlanOptions"]

#: how sensitivity is obtained, the default first (``short``: successive halving on the calibration windows
#: as they are, with no recall windows; the default before recall windows)
SENSITIVITIES = ("halving", "short", "measured", "bld", "proxy")


@dataclass(frozen=True)
class PlanOptions:
    """The budgets and search options of :func:`plan_model` (its keyword arguments, same names and defaults),
    as one object: what ``prune`` searches a plan with.

    Attributes:
        budget_params: every parameter of the model (embeddings included) kept: a fraction (<= 1) or a count.
        budget_gdn_params: GDN parameters kept: a fraction of the GDN layers' (<= 1) or a count.
        budget_active_params: parameters used per token (routed experts count ``num_experts_per_tok`` experts'
            weights and every kept router row; without MoE the same as ``budget_params``): a fraction or a count.
        budget_memory: inference memory per sequence, GDN recurrent state (float32) plus the attention
            layers' KV cache at ``context`` tokens (in the model's dtype): a fraction or bytes.
        budget_state: recurrent-state bytes per sequence (float32) kept: a fraction (<= 1) or bytes.
        budget_latency: the latency kept at ``workload``, a fraction (<= 1) of the unpruned model's: every
            candidate block is timed on the model's device (:mod:`.latency_costs`; a whole-model budget); the
            report gives the predicted latency beside the measured latency of the cut model.
        workload: ``PHASE:BATCH:CONTEXT`` of ``budget_latency`` (:func:`gdnprune.model.latency.parse_workload`).
        context: tokens per sequence of ``budget_memory``'s KV cache.
        blocks: what may shrink under a whole-model budget (:data:`~gdnprune.plan.measure.subblocks.BLOCK_NAMES`, all of
            them by default: ``gdn``, ``attention``, ``mlp``, ``shared_expert``, ``experts``, ``depth`` —
            whole decoder layers removed — and ``hidden``: the hidden size (the residual stream's width, one
            global choice): each size of ``hidden_sizes`` is planned as a model of its own under the same
            budgets, its whole cut model measured against the full model, the least KL kept
            (:mod:`gdnprune.plan.measure.hidden`; the plan's ``default`` then holds ``hidden_size``); the
            default leaves it out where it cannot be planned (:func:`~gdnprune.plan.hidden.hidden_problem`:
            e.g. scores without the hidden order), naming it there is an error.
        sensitivity: ``"halving"`` (KL of real cuts, by successive halving: every candidate on a few windows,
            the choice verified on every window, :mod:`.halving`), ``"short"`` (the same on the calibration
            windows as they are; the others, where GDN layers may shrink, measure on recall windows: each
            calibration window followed by a passkey or MQAR probe of its length, the answers a quarter of
            the KL, :mod:`.measure.recall`), ``"measured"`` (every candidate on every
            window: the exact reference; removals are measured on every window either way), ``"bld"`` (every
            candidate trained ``bld_steps`` steps to reproduce its unpruned block's output, then measured as
            ``"measured"``: the choice sums recovered losses, :mod:`.bld`) or ``"proxy"`` (output energy
            removed, from the scores; GDN layers only).
        dim_step: head-dim grid step: a fraction of the dim (``"1/8"``) or a channel count.
        axes: the axes the search may cut (:data:`~gdnprune.plan.measure.candidates.AXES`).
        uniform: one geometry per kind of block (all GDN layers one, all MLPs one, all attention layers one,
            ...): the best combination under the budgets (:func:`~gdnprune.plan.choose.solve.choose_uniform`). Its
            choice is exact over the sensitivities it is given; successive halving's rungs serve the
            heterogeneous choice, so ``sensitivity="measured"`` is the exact reference of a uniform plan.
        servable: only plans that stock engines load from a standard config: one geometry per kind of block,
            plus whole decoder layers removed where ``blocks`` has ``depth`` (one full-attention layer kept);
            the exact best such plan (:func:`~gdnprune.plan.choose.servable.choose_servable`). The plan file gives
            the geometries as its ``default``, so a removed layer's blocks do not make the config heterogeneous.
        snap_quant: tiles of a quantization scheme (e.g. 128): every width a candidate cuts (GDN key and value
            widths, MLP channels, attention heads) is a multiple of it (:mod:`gdnprune.model.tiles`), so that
            every matrix of the plan can be quantized at that size.
        evolve_generations: generations of the evolutionary search over whole plans (:mod:`.evolve`, fitness
            the KL of the whole cut model on the calibration batches) that starts from the exact choice; its
            mutations also remove decoder layers and bring them back when ``depth`` is planned; 0: none.
            (``refine_generations``, ``refine_offspring``, ``refine_seed``: the old names, with a
            ``FutureWarning``.)
        evolve_offspring, evolve_seed: plans tried per generation, and the search's random seed.
        rank_by_distill: rank after a short recovery (:mod:`.rank`): the MILP's ``rank_by_distill`` best
            distinct plans (with the evolutionary search: its best plans), and the best uniform cut, are each distilled
            ``rank_steps`` steps (AdamW at ``rank_lr``) from the model on three quarters of the calibration
            windows; the least KL on the last quarter wins. 0: the exact choice as it is. The report's
            ``ranking`` lists every candidate with its one-shot and recovered KL.
        bld_steps: the blockwise local distillation steps of every candidate with ``sensitivity="bld"``.
        hidden_sizes: with ``hidden`` in ``blocks``, the hidden sizes to try (default: the full size, 7/8 and 3/4
            of it, multiples of ``multiple_of`` or 8; :func:`~gdnprune.plan.measure.hidden.hidden_candidates`).
        keep_recall: the share (in (0, 1]) of the unpruned model's recall the cut model keeps: the greedy
            exact match of the asked-again facts of held-out recall windows, measured on the whole cut model
            (:class:`~gdnprune.plan.measure.recall.RecallCheck`); when the choice keeps less, the
            sensitivities are measured again with a larger share of the KL on recall and the choice made
            again (at most twice); the report's ``recall`` lists every round.
    """

    budget_params: float | None = None
    budget_gdn_params: float | None = None
    budget_active_params: float | None = None
    budget_memory: float | None = None
    budget_state: float | None = None
    context: int | None = None
    blocks: Sequence[str] = BLOCK_NAMES
    sensitivity: str = "halving"
    dim_step: str | float | int = "1/8"
    axes: Sequence[str] = AXES
    uniform: bool = False
    servable: bool = False
    snap_quant: int | None = None
    budget_latency: float | None = None
    workload: str | None = None
    evolve_generations: int = 0
    evolve_offspring: int = 8
    evolve_seed: int = 0
    rank_by_distill: int = 0
    rank_steps: int = RANK_STEPS
    rank_lr: float = RANK_LR
    bld_steps: int = BLD_STEPS
    hidden_sizes: Sequence[int] | None = None
    keep_recall: float | None = None

    def keywords(self) -> dict[str, Any]:
        """The options as :func:`plan_model`'s keyword arguments."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def whole(self) -> bool:
        """Whether a whole-model budget is given (then the sub-blocks are planned, and scored, too)."""
        return self.budget_latency is not None or any(
            getattr(self, f"budget_{name}") is not None for name in WHOLE
        )

    def recall(self) -> bool:
        """Whether the search measures on recall windows (and ``prune`` scores on them): GDN layers may
        shrink (a GDN budget, or a whole-model one with ``gdn`` in ``blocks``) and the sensitivity is
        measured, not ``short``."""
        gdn = self.budget_state is not None or self.budget_gdn_params is not None
        gdn = gdn or (self.whole() and "gdn" in self.blocks)
        return gdn and self.sensitivity not in ("short", "proxy")

    def parsed_workload(self) -> Workload | None:
        """The workload of the latency budget (None without one). Raises ValueError: a latency budget without
        a workload, a workload without one, or a malformed workload."""
        if self.budget_latency is None:
            if self.workload is not None:
                raise ValueError("`workload` is the workload of `budget_latency`: give both, or neither")
            return None
        if isinstance(self.budget_latency, bool) or not self.budget_latency > 0 or self.budget_latency > 1:
            raise ValueError(
                f"`budget_latency` is a fraction of the unpruned model's latency, in (0, 1]; got {self.budget_latency!r}"
            )
        if self.workload is None:
            raise ValueError(
                "`budget_latency` is a latency at a workload: give `workload` (e.g. prefill:1:2048)"
            )
        return parse_workload(self.workload)
