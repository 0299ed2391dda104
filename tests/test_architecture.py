"""The invariants of ARCHITECTURE.md that code can check: the import graph, who prints, who needs torch."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import gdnprune

PACKAGE = Path(gdnprune.__file__).parent
MAX_LINES = 650


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, *, top_level_only: bool) -> set[str]:
    """The gdnprune modules that module ``name`` imports (at module level only, or anywhere)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    modules = _modules()
    return {m for m in found if m in modules and m != name}


def test_the_module_level_import_graph_has_no_cycle():
    modules = _modules()
    graph = {name: _imports(name, path, top_level_only=True) for name, path in modules.items()}
    # a package imports its submodules; a submodule importing its own package's __init__ is the usual
    # Python pattern only for the parent's names, so drop edges to ancestors before looking for cycles
    graph = {n: {m for m in deps if not n.startswith(m + ".")} for n, deps in graph.items()}
    state: dict[str, int] = {}

    def visit(node, path):
        state[node] = 1
        for dep in graph[node]:
            if state.get(dep) == 1:
                raise AssertionError(f"import cycle: {' -> '.join(path + [node, dep])}")
            if dep not in state:
                visit(dep, path + [node])
        state[node] = 2

    for node in graph:
        if node not in state:
            visit(node, [])


def test_the_library_never_imports_the_cli_or_argparse_and_never_prints():
    for name, path in _modules().items():
        if name.startswith("gdnprune.cli") or name == "gdnprune.__main__":
            continue
        assert not any(m.startswith("gdnprune.cli") for m in _imports(name, path, top_level_only=False)), name
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                assert "argparse" not in names, f"{name} imports argparse"
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id != "print", f"{name}:{node.lineno} prints"


def test_no_module_is_much_over_600_lines():
    sizes = {name: len(path.read_text().splitlines()) for name, path in _modules().items()}
    assert {n: s for n, s in sizes.items() if s > MAX_LINES} == {}


def test_inspect_sort_and_slice_never_import_torch_nor_start_blas_threads(tmp_path):
    sys.path.insert(0, str(Path(__file__).parent))
    from test_byte_identity import TARGET, build_source, scores_for

    src = build_source(tmp_path / "src", "qwen3_next")
    (tmp_path / "scores.json").write_text(json.dumps(scores_for(src, "qwen3_next")))
    target = [a for k, v in TARGET.items() for a in (f"--{k.replace('_', '-')}", str(v))]
    script = f"""
import json, os, sys
from gdnprune.cli import main
codes = [main(["inspect", {str(src)!r}]),
         main(["sort", {str(src)!r}, "--scores", {str(tmp_path / "scores.json")!r}, "-o", {str(tmp_path / "sorted")!r}, "-q"]),
         main(["slice", {str(tmp_path / "sorted")!r}, "-o", {str(tmp_path / "sliced")!r}, "-q", *{target!r}])]
print(json.dumps({{"codes": codes, "loaded": sorted(m for m in ("torch", "transformers") if m in sys.modules),
                  "blas_threads": os.environ.get("OPENBLAS_NUM_THREADS")}}))
"""
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {"codes": [0, 0, 0], "loaded": [], "blas_threads": "1"}  # numpy's pool would only spin
    assert (tmp_path / "sliced" / "config.json").is_file()
