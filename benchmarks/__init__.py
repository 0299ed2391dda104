"""The benchmarks: one script per claim of BENCHMARKS.md, run by ``python -m benchmarks NAME [ARGS]``.

Each script ``NAME.py`` (a file not starting with ``_``) has a module docstring whose first line is its claim
and a ``main(argv: list[str] | None = None) -> int``; ``_common.py`` holds what they share. The runner
(``__main__.py``) lists them and calls ``main`` of the one named.
"""
