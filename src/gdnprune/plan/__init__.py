"""The plan search: every layer's own width, or its removal, chosen by measured sensitivity under budgets.

A plan cuts every kind of block the model has: GDN layers (key heads, lanes, head dims), attention heads,
MLP and shared-expert channels, routed-expert counts, and whole decoder layers. For every block, a grid of
nested-prefix candidates (:mod:`.candidates` for GDN layers, :mod:`.subblocks` and :mod:`.depth` for the
rest; kept parameters, recurrent state and KV cache of each); their sensitivity (:mod:`.sensitivity`: the
KL divergence from the unpruned model when that block alone is cut or that layer alone skipped, measured
with real forwards that share the teacher pass and start from the layer's cached input — or a proxy from
the scores); the exact multiple-choice knapsack under the budgets (:mod:`.solve`, scipy's MILP); the plan
and a report (:mod:`.api`), and a plot (:mod:`.plot`). The plan file format is :mod:`gdnprune.io.plan_file`.
This package imports torch (the candidates and the solver do not).
"""

from .api import (
    SENSITIVITIES,
    STATE_BYTES,
    PlanOptions,
    budget_limit,
    check_budgets,
    plan_model,
    uniform_plans,
)
from .choose.solve import BudgetError, choose, choose_uniform, uniform_choices
from .from_folder import plan_checkpoint
from .measure.candidates import AXES, Candidate, layer_candidates, parse_dim_step
from .report.plot import plot_sensitivity
from .snap import snap_servable

__all__ = [
    "AXES",
    "SENSITIVITIES",
    "STATE_BYTES",
    "BudgetError",
    "Candidate",
    "PlanOptions",
    "budget_limit",
    "check_budgets",
    "choose",
    "choose_uniform",
    "layer_candidates",
    "parse_dim_step",
    "plan_checkpoint",
    "plan_model",
    "plot_sensitivity",
    "snap_servable",
    "uniform_choices",
    "uniform_plans",
]
