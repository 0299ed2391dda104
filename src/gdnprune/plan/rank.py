"""Rank after a short recovery (issue 31): the plan that wins after a few distillation steps, not one-shot.

The one-shot ranking of pruned architectures does not predict their ranking after retraining, and a short
retraining of the best few candidates makes it stable (Minitron, arXiv 2407.14679). :func:`rank_by_distill`
takes candidate plans (the MILP's best distinct choices, :func:`~gdnprune.plan.stages.choose_plans`, the
evolutionary search's best plans, and the best uniform cut), cuts each in memory (:func:`cut_model`),
distils it for a few steps from the unpruned model with one recipe for all
(:func:`gdnprune.distill.distill`, forward KL), and measures the KL to the unpruned model on held-out
windows (windows the distillation did not train on) before (one-shot) and after (recovered). The plan with
the least recovered KL wins.

Under ``torchrun`` every rank distils its own candidates (candidate ``i`` on rank ``i % world``) as one
process (:func:`single_process`), and the results are exchanged, so every rank returns the same ranking.
The cost (candidates x steps, and the seconds that predicts from the first step, timed) is reported through
``on_cost`` before the rest of the work; the library never prints.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from transformers import PreTrainedModel, TrainerCallback

from ..distill import DistillConfig, distill
from ..gated_delta_net import GDNPermutation
from ..io.loading import per_layer_gdn_modules, slice_model
from ..model.layer_removal import removal_name_map, remove_layers_from_config
from ..runtime import distributed
from .choose.evolve import REMOVED
from .choose.solve import BudgetError
from .measure.halving import windows_of
from .measure.problem import PlanProblem, block_entry
from .report.results import Choice, Sensitivities
from .stages import choose_plans, uniform_choice

__all__ = [
    "RANK_LR",
    "RANK_STEPS",
    "RankCost",
    "RankedPlan",
    "Ranking",
    "candidate_plans",
    "check_rank_options",
    "cut_model",
    "rank_by_distill",
    "rank_plans",
    "rank_recipe",
    "single_process",
    "split_windows",
]

#: the default distillation steps per candidate (``--rank-steps``)
RANK_STEPS = 100
#: the default learning rate of the ranking's distillation (``--rank-lr``)
RANK_LR = 1e-4
#: the launcher's variables that make transformers' Trainer and accelerate train over several processes
_LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK")


@dataclass(frozen=True)
class RankCost:
    """What the ranking costs: candidates x steps distillation steps over ``processes`` processes; after the
    first step, its seconds and the estimate of the whole ranking they give (None before)."""

    candidates: int
    steps: int
    processes: int
    seconds_per_step: float | None = None
    estimate_seconds: float | None = None

    @property
    def total_steps(self) -> int:
        return self.candidates * self.steps

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total_steps": self.total_steps}


@dataclass(frozen=True)
class RankedPlan:
    """One candidate of the ranking: where it comes from, its choice, its summed sensitivity (the MILP's
    objective), its held-out KL one-shot and after the distillation, and the seconds that took."""

    name: str
    choice: Choice
    summed_sensitivity: float
    one_shot_kl: float
    recovered_kl: float
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "removed_layers": self.choice.removed,
            "summed_sensitivity": self.summed_sensitivity,
            "one_shot_kl": self.one_shot_kl,
            "recovered_kl": self.recovered_kl,
            "seconds": round(self.seconds, 3),
        }


@dataclass
class Ranking:
    """The ranking's result: every candidate (in the order given) and the winner's index."""

    plans: list[RankedPlan]
    winner: int
    steps: int
    train_windows: int
    heldout_windows: int
    recipe: dict[str, Any]
    cost: RankCost
    seconds: float

    @property
    def best(self) -> RankedPlan:
        return self.plans[self.winner]

    def as_dict(self) -> dict[str, Any]:
        """The report's ``ranking`` section (the winner's picks are the plan's)."""
        return {
            "winner": self.best.name,
            "steps": self.steps,
            "train_windows": self.train_windows,
            "heldout_windows": self.heldout_windows,
            "recipe": self.recipe,
            "cost": self.cost.as_dict(),
            "seconds": round(self.seconds, 3),
            "plans": [p.as_dict() for p in self.plans],
        }


def rank_recipe(
    steps: int, lr: float = RANK_LR, train_windows: int = 8, heldout_windows: int = 1
) -> DistillConfig:
    """The ranking's distillation recipe, one for every candidate: forward KL at temperature 1 (no LM loss),
    AdamW at ``lr``, cosine after 3 % warmup, batch ``min(8, train_windows)``, seed 0, no output, no bar.
    The micro batch divides the held-out windows too, so the evaluation (whole batches) sees every one."""
    batch = max(1, min(8, train_windows))
    return DistillConfig(
        steps=steps,
        batch_size=batch,
        micro_batch_size=max(d for d in range(1, batch + 1) if batch % d == 0 and heldout_windows % d == 0),
        lr=lr,
        warmup=0.03,
        seed=0,
        log_every=max(steps, 1),
        progress=False,
    )


def split_windows(batches: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The calibration windows as ``(train, heldout)`` token tensors ``[N, T]``: the last quarter (at least
    one window) held out. Raises ValueError for fewer than 2 windows or windows of different lengths."""
    windows = [w["input_ids"] for w in windows_of(batches)]
    if len(windows) < 2:
        raise ValueError(
            f"ranking by distillation trains on some calibration windows and measures on others: expected "
            f"at least 2 windows, found {len(windows)} (raise the number of calibration samples)"
        )
    if len({w.shape[1] for w in windows}) != 1:
        raise ValueError("ranking by distillation needs calibration windows of one length")
    ids = torch.cat(windows).cpu()
    held = max(1, len(windows) // 4)
    return ids[:-held], ids[-held:]


@contextlib.contextmanager
def single_process(device: torch.device | None = None) -> Iterator[None]:
    """While inside, transformers' Trainer and accelerate see one process, not the launcher's group (the
    launch variables hidden; ``device``: the one to train on): each rank distils its own candidates. The
    environment is restored on exit (the Trainer resets accelerate's state when it is next built)."""
    saved = {k: os.environ.pop(k) for k in _LAUNCH_VARIABLES if k in os.environ}
    device_key = "ACCELERATE_TORCH_DEVICE"
    saved_device = os.environ.get(device_key)
    if device is not None and device.type != "cpu":
        os.environ[device_key] = str(device)
    try:
        yield
    finally:
        os.environ.update(saved)
        if saved_device is None:
            os.environ.pop(device_key, None)
        else:
            os.environ[device_key] = saved_device


def cut_model(model: Any, problem: PlanProblem, choice: Choice) -> PreTrainedModel:
    """A new model: ``model`` sorted by the problem's orders and cut to ``choice`` (GDN layers and sub-blocks,
    :func:`gdnprune.io.loading.slice_model`), its removed decoder layers dropped and the later ones renumbered
    (config and weights, as :func:`gdnprune.model.layer_removal.remove_layers_from_config` describes them)."""
    n = len(problem.layers)
    targets = {
        layer.prefix: problem.table[i][p].target
        for i, (layer, p) in enumerate(zip(problem.layers, choice.picks))
        if p is not None
    }
    permutations = {
        layer.prefix: GDNPermutation(**{k: torch.as_tensor(v) for k, v in layer.orders.items()})
        for layer in problem.layers
        if layer.orders is not None
    }
    blocks = {
        b.prefix: block_entry(b, b.candidates[p])
        for b, p in zip(problem.blocks, choice.picks[n:])
        if p is not None
    }
    orders = {b.prefix: b.orders for b in problem.blocks if b.orders is not None}
    small = slice_model(model, targets, permutations, blocks=blocks or None, block_orders=orders or None)
    if not choice.removed:
        return small
    config = type(small.config).from_dict(remove_layers_from_config(small.config.to_dict(), choice.removed))
    state = small.state_dict()
    names = removal_name_map(state, _num_layers(small), choice.removed)
    kept = {names.get(k, k): v for k, v in state.items() if names.get(k, k) is not None}
    with per_layer_gdn_modules(type(small)):
        new = type(small)(config)
    new.load_state_dict(kept, strict=True)
    return new.to(next(small.parameters()).dtype).eval()


def _num_layers(model: Any) -> int:
    """The number of decoder layers of a loaded model."""
    return int(model.config.get_text_config(decoder=True).num_hidden_layers)


class _FirstStep(TrainerCallback):
    """Times the first optimizer step of a run and hands its seconds on."""

    def __init__(self, report: Callable[[float], None]):
        self.report, self.start = report, 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == 0:
            self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            self.report(time.perf_counter() - self.start)


def _kl_of(history: Sequence[dict], first: bool) -> float:
    """The held-out KL of the first (before training) or last evaluation in a Trainer log history."""
    evals = [h["eval_kd_loss"] for h in history if "eval_kd_loss" in h]
    if not evals:
        raise RuntimeError("the ranking's distillation ran no evaluation of the held-out windows")
    return float(evals[0] if first else evals[-1])


def _recover(model, problem, choice, train, heldout, recipe, callbacks) -> tuple[float, float, float]:
    """``(one-shot KL, recovered KL, seconds)`` of one candidate on the held-out windows."""
    start = time.perf_counter()
    student = cut_model(model, problem, choice)
    student.to(next(model.parameters()).device)
    for p in student.parameters():
        p.requires_grad_(True)
    result = distill(
        student,
        model,
        train,
        recipe.replace(eval_every=recipe.steps),
        eval_data=heldout,
        callbacks=callbacks,
    )
    history = result["history"]
    return _kl_of(history, True), _kl_of(history, False), time.perf_counter() - start


# long: its documented signature and docstring; the body is one loop over this rank's candidates
def rank_by_distill(
    model: Any,
    problem: PlanProblem,
    candidates: Sequence[tuple[str, Choice, float]],
    train: torch.Tensor,
    heldout: torch.Tensor,
    recipe: DistillConfig,
    *,
    on_cost: Callable[[RankCost], None] | None = None,
) -> Ranking:
    """Distil every candidate plan ``(name, choice, summed sensitivity)`` for ``recipe.steps`` steps from
    ``model`` (the unpruned teacher, left unchanged) on the token windows ``train``; the one with the least
    KL to ``model`` on ``heldout`` after it wins (the first of equals).

    ``on_cost`` is called with the cost (:class:`RankCost`) before any candidate is cut, and again after the
    first optimizer step with its seconds and the estimate of the whole ranking; under ``torchrun`` each
    rank distils candidates ``rank, rank + world, ...`` and calls it with its own timing.
    """
    if not candidates:
        raise ValueError("ranking by distillation needs at least one candidate plan")
    start = time.perf_counter()
    rank, world = distributed.rank(), distributed.world_size()
    mine = [i for i in range(len(candidates)) if i % world == rank]
    cost = RankCost(candidates=len(candidates), steps=int(recipe.steps or 0), processes=world)
    if on_cost is not None:
        on_cost(cost)

    def timed(seconds: float) -> None:
        nonlocal cost
        each = math.ceil(len(candidates) / world)
        cost = RankCost(cost.candidates, cost.steps, world, seconds, seconds * cost.steps * each)
        if on_cost is not None:
            on_cost(cost)

    results: dict[int, tuple[float, float, float]] = {}
    device = next(model.parameters()).device
    with distributed.fail_together(), single_process(device):
        for k, i in enumerate(mine):
            callbacks = [_FirstStep(timed)] if k == 0 else []
            results[i] = _recover(model, problem, candidates[i][1], train, heldout, recipe, callbacks)
    merged: dict[int, tuple[float, float, float]] = {}
    for part in distributed.exchange(results):
        merged.update(part)
    plans = [
        RankedPlan(name, choice, float(summed), *merged[i])
        for i, (name, choice, summed) in enumerate(candidates)
    ]
    winner = min(range(len(plans)), key=lambda i: (plans[i].recovered_kl, i))
    return Ranking(
        plans=plans,
        winner=winner,
        steps=cost.steps,
        train_windows=int(train.shape[0]),
        heldout_windows=int(heldout.shape[0]),
        recipe={
            k: getattr(recipe, k) for k in ("steps", "batch_size", "lr", "lr_schedule", "warmup", "seed")
        },
        cost=cost,
        seconds=time.perf_counter() - start,
    )


def check_rank_options(count: int, steps: int, lr: float, *, heterogeneous: bool, measured: bool) -> None:
    """Refuse ranking options that cannot work, before any forward (ValueError naming the keyword)."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"`rank_by_distill` is a number of plans (0: off), got {count!r}")
    if not count:
        return
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"`rank_steps` is a positive number of distillation steps, got {steps!r}")
    if not lr > 0:
        raise ValueError(f"`rank_lr` is a positive learning rate, got {lr!r}")
    if not heterogeneous:
        raise ValueError(
            "`rank_by_distill` ranks heterogeneous plans (not `uniform` or `servable`): the best uniform cut "
            "joins them anyway"
        )
    if not measured:
        raise ValueError(
            "`rank_by_distill` trains and measures on calibration windows: give calibration batches and a "
            'measured sensitivity ("halving" or "measured", not "proxy")'
        )


def summed_sensitivity(sens: Sensitivities, choice: Choice, width_groups: int) -> float:
    """The MILP's objective of ``choice``: its width groups' sensitivities plus its removals'."""
    removal = sens.removal_kl()
    return float(
        sum(v[p] for v, p in zip(sens.values, choice.picks[:width_groups]) if p is not None)
        + sum(removal[i] for i in choice.removed)
    )


def candidate_plans(
    problem: PlanProblem, sens: Sensitivities, choice: Choice, count: int
) -> list[tuple[str, Choice, float]]:
    """The ranking's candidates ``(name, choice, summed sensitivity)``: ``choice`` (the plan as chosen) and the
    next best distinct plans up to ``count`` — the evolutionary search's best (``evolved N``) when it ran,
    else the MILP's solution pool (``milp N``) — then the best uniform cut (``uniform``) unless it is one of
    them or no uniform cut meets the budgets."""
    n = len(problem.groups)
    population = (choice.evolution or {}).get("population")
    if population:
        name = "evolved"
        pool = [
            Choice(picks=[None if p == REMOVED else int(p) for p in picks])
            for picks in population[: count + 1]
        ]
    else:
        name = "milp"
        pool = choose_plans(problem, sens, count + 1)
    plans = [choice] + [c for c in pool if c.picks != choice.picks][: count - 1]
    out = []
    for k, plan in enumerate(plans):
        if plan is not choice and problem.layer_of is not None:
            plan = Choice(
                picks=plan.picks,
                removed=sorted({problem.layer_of[g] for g, p in enumerate(plan.picks) if p is None}),
            )
        out.append((f"{name} {k + 1}", plan, summed_sensitivity(sens, plan, n)))
    try:
        uniform = uniform_choice(problem, sens)
    except BudgetError:
        return out
    if all(uniform.picks != plan.picks for _, plan, _ in out):
        out.append(("uniform", uniform, summed_sensitivity(sens, uniform, n)))
    return out


def rank_plans(
    model: Any,
    batches: Sequence[Any],
    problem: PlanProblem,
    sens: Sensitivities,
    choice: Choice,
    *,
    count: int,
    steps: int,
    lr: float = RANK_LR,
    on_cost: Callable[[RankCost], None] | None = None,
) -> Ranking:
    """The plan search's ranking stage: :func:`candidate_plans` distilled on three quarters of the calibration
    windows and measured on the last quarter (:func:`split_windows`, :func:`rank_by_distill`)."""
    train, heldout = split_windows(batches)
    candidates = candidate_plans(problem, sens, choice, count)
    recipe = rank_recipe(steps, lr, int(train.shape[0]), int(heldout.shape[0]))
    return rank_by_distill(model, problem, candidates, train, heldout, recipe, on_cost=on_cost)
