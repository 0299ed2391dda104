"""gdnprune: score, sort, plan, slice and distill the GatedDeltaNet layers of Qwen hybrid language models."""

__version__ = "0.1.0"

from .loading import load_pretrained  # noqa: E402  (stdlib-only at import: `import gdnprune` stays light)

__all__ = ["__version__", "load_pretrained"]
