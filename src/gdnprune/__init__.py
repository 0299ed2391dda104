"""gdnprune: structured pruning of Qwen hybrid language models. It scores, sorts, plans, slices, distills,
evaluates and benches their GatedDeltaNet layers, attention heads, MLP and shared-expert channels, routed
experts and whole decoder layers; ARCHITECTURE.md maps which package owns which job."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .runtime.deprecation import install_module_aliases

__version__ = "0.1.0"

__all__ = ["__version__", "load_pretrained"]

install_module_aliases()

if TYPE_CHECKING:
    from .io.loading import load_pretrained


def __getattr__(name: str) -> Any:
    """``gdnprune.load_pretrained`` on first use, so that ``import gdnprune`` (and every torch-free command:
    inspect, sort, slice) imports neither torch nor transformers."""
    if name == "load_pretrained":
        from .io.loading import load_pretrained  # lazy: `import gdnprune` stays torch-free

        return load_pretrained
    raise AttributeError(f"module 'gdnprune' has no attribute {name!r}")
