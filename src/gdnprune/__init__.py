"""gdnprune: score, sort and slice the GatedDeltaNet layers of Qwen hybrid language models."""

__version__ = "0.1.0"
