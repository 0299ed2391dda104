"""Old spellings of the Python API kept working for one release: a renamed keyword warns and is passed on,
a renamed module imports as its new name with a warning.

The command line has its own deprecated aliases (``cli/_options.add_deprecated_alias``). Imports nothing of
gdnprune (a renamed module is imported only when its old name is).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, TypeVar

__all__ = [
    "RENAMED_MODULES",
    "folded_keywords",
    "install_module_aliases",
    "renamed_function",
    "renamed_keywords",
]

#: old module name -> new one (issue 27: names that read as twins of a package, or meant two things;
#: issue 40: modules moved into the packages of their job)
RENAMED_MODULES = {
    "gdnprune.blocks": "gdnprune.model.subblock_geometry",
    "gdnprune.block_surgery": "gdnprune.model.subblock_surgery",
    "gdnprune.scoring.blocks": "gdnprune.scoring.subblocks",
    "gdnprune.scores": "gdnprune.io.scores_file",
    "gdnprune.plans": "gdnprune.io.plan_file",
    "gdnprune.depth": "gdnprune.model.layer_removal",
    "gdnprune.refine": "gdnprune.quality.lane_search",
    # issue 43: the probes serve the plan's recall windows too
    "gdnprune.evaluation.probes": "gdnprune.quality.probes",
    # issue 40: the loose modules grouped into packages by job, plan/ split into measure / choose / report
    "gdnprune.deprecation": "gdnprune.runtime.deprecation",
    "gdnprune.fileio": "gdnprune.runtime.fileio",
    "gdnprune.interrupts": "gdnprune.runtime.interrupts",
    "gdnprune.figures": "gdnprune.runtime.figures",
    "gdnprune.distributed": "gdnprune.runtime.distributed",
    "gdnprune.model_config": "gdnprune.model.model_config",
    "gdnprune.geometry": "gdnprune.model.geometry",
    "gdnprune.layouts": "gdnprune.model.layouts",
    "gdnprune.subblock_shapes": "gdnprune.model.subblock_shapes",
    "gdnprune.subblock_geometry": "gdnprune.model.subblock_geometry",
    "gdnprune.subblock_surgery": "gdnprune.model.subblock_surgery",
    "gdnprune.targets": "gdnprune.model.targets",
    "gdnprune.layer_removal": "gdnprune.model.layer_removal",
    "gdnprune.forwards": "gdnprune.model.forwards",
    "gdnprune.latency": "gdnprune.model.latency",
    "gdnprune.safetensors_io": "gdnprune.io.safetensors_io",
    "gdnprune.scores_file": "gdnprune.io.scores_file",
    "gdnprune.plan_file": "gdnprune.io.plan_file",
    "gdnprune.loading": "gdnprune.io.loading",
    "gdnprune.sharded_loading": "gdnprune.io.sharded_loading",
    "gdnprune.calibration": "gdnprune.quality.calibration",
    "gdnprune.compensate": "gdnprune.quality.compensate",
    "gdnprune.lane_search": "gdnprune.quality.lane_search",
    "gdnprune.plan.solve": "gdnprune.plan.choose.solve",
    "gdnprune.plan.servable": "gdnprune.plan.choose.servable",
    "gdnprune.plan.depth": "gdnprune.plan.choose.depth",
    "gdnprune.plan.evolve": "gdnprune.plan.choose.evolve",
    "gdnprune.plan.candidates": "gdnprune.plan.measure.candidates",
    "gdnprune.plan.sensitivity": "gdnprune.plan.measure.sensitivity",
    "gdnprune.plan.subblocks": "gdnprune.plan.measure.subblocks",
    "gdnprune.plan.problem": "gdnprune.plan.measure.problem",
    "gdnprune.plan.halving_bounds": "gdnprune.plan.measure.halving_bounds",
    "gdnprune.plan.halving": "gdnprune.plan.measure.halving",
    "gdnprune.plan.bld": "gdnprune.plan.measure.bld",
    "gdnprune.plan.joint": "gdnprune.plan.measure.joint",
    "gdnprune.plan.latency_costs": "gdnprune.plan.measure.latency_costs",
    "gdnprune.plan.plot": "gdnprune.plan.report.plot",
}

F = TypeVar("F", bound=Callable[..., Any])


def renamed_keywords(**renames: str | tuple[str, Callable[[Any], Any]]) -> Callable[[F], F]:
    """Decorator: keyword ``old`` of the function is now ``new`` (``old="new"``), or ``new`` with the value
    converted (``old=("new", convert)``, when the old keyword took another kind of value). A call with an
    old keyword warns (``FutureWarning``) and goes on with the new one; with both, a ``TypeError``."""

    def wrap(func: F) -> F:
        @functools.wraps(func)
        def call(*args: Any, **kwargs: Any) -> Any:
            for old, rename in renames.items():
                if old not in kwargs:
                    continue
                new, convert = (rename, None) if isinstance(rename, str) else rename
                if new in kwargs:
                    raise TypeError(
                        f"{func.__name__}() got `{old}` and `{new}`: `{old}` is the old name of `{new}`"
                    )
                warnings.warn(
                    f"{func.__name__}: `{old}` is deprecated and will be removed; use `{new}`",
                    FutureWarning,
                    stacklevel=2,
                )
                value = kwargs.pop(old)
                kwargs[new] = value if convert is None else convert(value)
            return func(*args, **kwargs)

        return call  # type: ignore[return-value]

    return wrap


def folded_keywords(name: str, options: type) -> Callable[[F], F]:
    """Decorator: the function's keywords that became the fields of the dataclass ``options``, now given as one
    object under the keyword ``name``. A call with any of the old keywords warns (``FutureWarning``) and goes
    on with ``name=options(**those)``; with ``name`` too, a ``TypeError``."""
    fields = [field.name for field in dataclasses.fields(options)]

    def wrap(func: F) -> F:
        @functools.wraps(func)
        def call(*args: Any, **kwargs: Any) -> Any:
            old = {key: kwargs.pop(key) for key in fields if key in kwargs}
            if old:
                if kwargs.get(name) is not None:
                    raise TypeError(
                        f"{func.__name__}() got `{name}` and {sorted(old)}: give them all in `{name}`"
                    )
                warnings.warn(
                    f"{func.__name__}: {', '.join(f'`{k}`' for k in old)} {'is' if len(old) == 1 else 'are'} "
                    f"deprecated and will be removed; use "
                    f"`{name}={options.__name__}({', '.join(f'{k}=...' for k in old)})`",
                    FutureWarning,
                    stacklevel=2,
                )
                kwargs[name] = options(**old)
            return func(*args, **kwargs)

        return call  # type: ignore[return-value]

    return wrap


def renamed_function(old: str, new: F) -> F:
    """``new`` under its old name ``old``: each call warns (``FutureWarning``) and calls ``new``."""

    @functools.wraps(new)
    def call(*args: Any, **kwargs: Any) -> Any:
        warnings.warn(
            f"{old} is deprecated and will be removed; use {new.__name__}", FutureWarning, stacklevel=2
        )
        return new(*args, **kwargs)

    call.__name__ = call.__qualname__ = old
    return call  # type: ignore[return-value]


class _RenamedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import gdnprune.plans`` gives :mod:`gdnprune.io.plan_file` itself (one module object under both names),
    with a ``FutureWarning``."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in RENAMED_MODULES:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = RENAMED_MODULES[spec.name]
        warnings.warn(
            f"module `{spec.name}` is deprecated and will be removed; use `{new}`",
            FutureWarning,
            stacklevel=2,
        )
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        """The new module is already executed."""


def install_module_aliases() -> None:
    """Let the old module names import (once per interpreter; ``gdnprune/__init__`` calls it)."""
    if not any(isinstance(finder, _RenamedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(_RenamedModuleFinder())
