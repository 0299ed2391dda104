"""Reporting: the results as objects and the plan file they write (``results``), and the plots
(``plot``)."""

from .results import (
    CandidateReport,
    Choice,
    GroupReport,
    MeasureStats,
    PlanReport,
    RemovalReport,
    Sensitivities,
    plan_document,
)

__all__ = [
    "CandidateReport",
    "Choice",
    "GroupReport",
    "MeasureStats",
    "PlanReport",
    "RemovalReport",
    "Sensitivities",
    "plan_document",
]
