"""Old spellings of the Python API kept working for one release: a renamed keyword warns and is passed on.

The command line has its own deprecated aliases (``cli/_options.add_deprecated_alias``). Imports nothing of
gdnprune.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["renamed_keywords"]

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
