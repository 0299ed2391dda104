"""Figures for the plots gdnprune writes (plan, demo, distillation), with matplotlib as an optional extra.

The library draws on a :class:`matplotlib.figure.Figure` of its own and saves it: it never imports pyplot
nor calls ``matplotlib.use``, so a notebook's backend and its open figures stay as they were.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["NO_MATPLOTLIB", "new_figure"]

#: why a plot was not drawn, for the messages of the commands
NO_MATPLOTLIB = "matplotlib is not installed (pip install 'gdnprune[plot]', or pip install matplotlib)"


def new_figure(**kwargs: Any) -> Figure | None:
    """A new figure (``Figure(**kwargs)``, e.g. ``figsize``, ``dpi``) to draw on with ``fig.subplots()`` and
    save with ``fig.savefig(path)``; None when matplotlib is not installed."""
    try:
        import matplotlib  # lazy: optional extra (gdnprune[plot]); the package itself, whose submodules may be cached
        from matplotlib.figure import Figure  # lazy: as above
    except ImportError:
        return None
    del matplotlib
    return Figure(**kwargs)
