"""Evaluation: recall probes, built-in lm-eval tasks and the side-by-side table of ``gdnprune eval``."""
