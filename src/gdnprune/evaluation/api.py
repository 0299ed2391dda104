"""``evaluate_models``: several model folders on the same lm-eval tasks, side by side.

lm-evaluation-harness is the engine (the optional extra ``gdnprune[eval]``): task names are lm-eval's,
resolved by its ``TaskManager`` over gdnprune's built-in tasks (written for this run by
:func:`gdnprune.evaluation.tasks.write_task_folder`) and the user's folders of YAML tasks; each model is
loaded by :func:`gdnprune.io.loading.load_causal_lm` (per-layer geometries included) and handed to lm-eval's
``HFLM`` as a model object, and lm-eval scores the tasks (:mod:`.harness`: ``simple_evaluate``'s numbers
without its chatter; data parallel under ``torchrun`` / ``accelerate launch``). Every input is checked
before any model loads. The output folder (``results.json``, ``results.md``, ``results.png``, ``tasks/``)
is built in a temporary folder and moved into place at the end (by rank 0 alone), with ``needle.png`` (the
needle-in-a-haystack grid, one panel per model) when the grid was run.

The recall probes' lengths default to what the models hold (:func:`default_context_lengths`): 4K, 8K, ...
128K tokens up to the smallest ``max_position_embeddings`` of the models, in characters of the probes as
their tokenizers count them.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import transformers

from ..checkpoint.output import Staging, check_output_folder
from ..io.loading import load_causal_lm
from ..model.subblock_surgery import find_model_blocks
from ..quality import probes
from ..runtime.distributed import exchange, is_main_process
from .report import ModelResult, markdown_table, plot_needles, plot_report
from .tasks import DEFAULT_CONTEXT_LENGTHS, NEEDLE, PROBE_KINDS, write_task_folder

__all__ = [
    "EvalError",
    "MissingExtraError",
    "EvalOptions",
    "EvalReport",
    "RESULTS_NAME",
    "evaluate_models",
    "evaluate_model",
    "task_manager",
    "check_task_folder",
    "require_lm_eval",
    "model_parameters",
    "default_context_lengths",
    "TOKEN_LENGTHS",
]

RESULTS_NAME = "results.json"
OUTPUT_MARKERS = frozenset({RESULTS_NAME})
#: tasks gdnprune writes for a run, and the tags over them
BUILTIN_NAMES = ("nats_per_byte", *PROBE_KINDS, NEEDLE)
_PROBE_NAME = re.compile(rf"^({'|'.join((*PROBE_KINDS, NEEDLE))})(_\d+)*$")
#: the recall probes' default lengths in tokens: those a model holds (none: a quarter, half and all of its
#: positions)
TOKEN_LENGTHS = (4096, 8192, 16384, 32768, 65536, 131072)


class EvalError(ValueError):
    """An input of ``evaluate_models`` is wrong (a task, a model folder, a length, a task folder)."""


class MissingExtraError(ImportError):
    """lm-eval is not installed."""


@dataclass
class EvalOptions:
    """What ``evaluate_models`` runs: the tasks and lm-eval's settings (the CLI fills it from its flags)."""

    tasks: Sequence[str]
    include_path: Sequence[str | os.PathLike] = ()
    data: str | os.PathLike | None = None
    context_lengths: Sequence[int] | None = None  # None: default_context_lengths of the models
    limit: int | float | None = None
    num_fewshot: int | None = None
    batch_size: int = 8
    device: str | None = None
    dtype: str = "float32"
    seed: int = 0


@dataclass
class EvalReport:
    """The finished output: its folder, the rows (one per model) and whether the plot was drawn."""

    out_dir: Path
    rows: list[ModelResult] = field(default_factory=list)
    plotted: bool = False
    needles: bool = False  # needle.png was drawn

    @property
    def table(self) -> str:
        return markdown_table(self.rows)


def require_lm_eval() -> None:
    """Raise :class:`MissingExtraError` naming the extra when lm-eval cannot be imported."""
    try:
        import lm_eval  # noqa: F401  # lazy: optional extra
    except ImportError:
        raise MissingExtraError("lm-eval is not installed: pip install 'gdnprune[eval]'") from None


def check_task_folder(path: str | os.PathLike) -> Path:
    """``path`` must be a folder holding at least one YAML task (searched recursively, as lm-eval does)."""
    folder = Path(path)
    if not folder.is_dir():
        raise EvalError(f"`include_path`: expected a folder of YAML tasks, got {folder} (not a folder)")
    if not any(folder.rglob("*.yaml")) and not any(folder.rglob("*.yml")):
        raise EvalError(f"`include_path`: expected a folder of YAML tasks, found no .yaml file in {folder}")
    return folder


def _model_config(path: Path) -> dict[str, Any]:
    config = path / "config.json"
    if not config.is_file():
        raise EvalError(f"model {path}: expected a model folder with a config.json, found none")
    try:
        value = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise EvalError(f"model {path}: config.json cannot be read ({exc})") from None
    if not isinstance(value, dict):
        raise EvalError(f"model {path}: config.json is not a JSON object")
    return value


def _max_positions(config: dict[str, Any]) -> int | None:
    nested = config.get("text_config")
    text: dict[str, Any] = nested if isinstance(nested, dict) else config
    value = text.get("max_position_embeddings", config.get("max_position_embeddings"))
    return int(value) if isinstance(value, int) else None


def _uses_probes(tasks: Sequence[str]) -> bool:
    return any(_PROBE_NAME.match(t) for t in tasks)


def _characters_per_token(path: Path) -> float:
    """The fewest characters per token of the model's tokenizer over one probe of each kind (so that a probe
    of ``n * ratio`` characters is at most ``n`` tokens)."""
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001 - whatever transformers raises, the folder is the problem
        raise EvalError(f"model {path}: its tokenizer does not load ({' '.join(str(exc).split())})") from None
    ratios = []
    for kind in PROBE_KINDS:
        text = probes.probe(kind, 0, 2048).text
        ratios.append(len(text) / max(1, len(tokenizer(text, add_special_tokens=False)["input_ids"])))
    return min(ratios)


def default_context_lengths(max_positions: int | None, characters_per_token: float = 1.0) -> list[int]:
    """The recall probes' lengths in characters for a model of ``max_positions`` positions: the
    :data:`TOKEN_LENGTHS` it holds (none: a quarter, half and all of its positions), each times
    ``characters_per_token`` (rounded down to 64 characters), from the probes' shortest (128) on; without
    ``max_positions``, ``DEFAULT_CONTEXT_LENGTHS``."""
    if max_positions is None:
        return list(DEFAULT_CONTEXT_LENGTHS)
    tokens = [n for n in TOKEN_LENGTHS if n <= max_positions] or [
        max_positions // 4,
        max_positions // 2,
        max_positions,
    ]
    lengths = sorted({math.floor(n * characters_per_token / 64) * 64 for n in tokens})
    return [n for n in lengths if n >= probes.MIN_LENGTH] or [probes.MIN_LENGTH]


def _context_lengths(models: Sequence[Path], options: EvalOptions) -> list[int]:
    """The lengths the run's probes take: the options', or those every model holds."""
    if options.context_lengths is not None:
        return list(options.context_lengths)
    limits = [_max_positions(_model_config(path)) for path in models]
    known = [n for n in limits if n is not None]
    if not _uses_probes(options.tasks) or not known:
        return list(DEFAULT_CONTEXT_LENGTHS)
    ratio = min(_characters_per_token(path) for path in models)
    return default_context_lengths(min(known), ratio)


def _check_inputs(models: Sequence[Path], options: EvalOptions) -> None:
    if not models:
        raise EvalError("`models`: expected at least one model folder, got none")
    if not options.tasks:
        raise EvalError("`tasks`: expected at least one task name, got none")
    lengths = options.context_lengths
    if lengths is not None and (not lengths or any(n < 1 for n in lengths)):
        raise EvalError(f"`context_lengths`: expected positive lengths, got {list(lengths)}")
    for path in options.include_path:
        check_task_folder(path)
    if "nats_per_byte" in options.tasks:
        if options.data is None:
            raise EvalError("`data`: the task nats_per_byte needs a text file, none given")
        if not Path(options.data).is_file():
            raise EvalError(f"`data`: expected a UTF-8 text file, got {options.data} (not a file)")
    longest = max(lengths) if lengths is not None and _uses_probes(options.tasks) else None
    for path in models:
        limit = _max_positions(_model_config(path))
        if longest is not None and limit is not None and longest > limit:
            raise EvalError(
                f"`context_lengths`: {longest} is beyond the max_position_embeddings of {path} ({limit})"
            )


def task_manager(options: EvalOptions, folder: str | os.PathLike) -> Any:
    """lm-eval's TaskManager over the run's task ``folder`` and the user's; lm-eval's own tasks only when a
    name needs them (indexing them takes a while). An unknown name raises :class:`EvalError` with the
    closest known ones, at once when no task file of lm-eval's even mentions it (:func:`declared_names`)."""
    import lm_eval.tasks  # lazy: optional extra
    from lm_eval.tasks import TaskManager  # lazy: optional extra

    paths = [str(folder), *(str(p) for p in options.include_path)]
    manager = TaskManager(include_path=paths, include_defaults=False)
    ours = set(manager.all_tasks)
    if set(options.tasks) <= ours:
        return manager
    mentioned = declared_names(Path(lm_eval.tasks.__file__).parent)
    _check_known(options.tasks, ours | mentioned)
    manager = TaskManager(include_path=paths)
    _check_known(options.tasks, set(manager.all_tasks))
    return manager


def _check_known(tasks: Sequence[str], known: set[str]) -> None:
    for name in tasks:
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known | set(BUILTIN_NAMES)), n=3, cutoff=0.6)
            hint = f"; closest: {', '.join(close)}" if close else ""
            raise EvalError(f"`tasks`: unknown task {name!r}{hint}")


#: a key that names a task, group or tag in an lm-eval YAML, with its value (a name, a flow list, or nothing:
#: a block list follows)
_NAMING_KEY = re.compile(r"^\s*(?:-\s*)?([\"']?)(?:task|group|tag)\1\s*:\s*(.*?)\s*(?:#.*)?$")
_LIST_ITEM = re.compile(r"^\s*-\s*(.*?)\s*(?:#.*)?$")


def declared_names(root: Path) -> set[str]:
    """Every name a ``task:``, ``group:`` or ``tag:`` key gives (a value, a flow list, or a block list, whose
    items may be mappings with a ``task:`` of their own) in the YAML files under ``root`` and the templates
    they include. Lines are read as text, not parsed: 14,000 files in under a second, where lm-eval's index
    takes 9 s. It holds what lm-eval's index of ``root`` holds, and more: a name outside it is unknown to
    lm-eval."""
    names: set[str] = set()
    for path in root.rglob("*"):
        if not (path.name.endswith("yaml") or path.suffix == "") or not path.is_file():
            continue  # lm-eval's task files and the templates they include (``_default_template_yaml``)
        opened_at: int | None = None  # the indentation of the key whose block list is being read
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            text = line.lstrip()
            indent = len(line) - len(text)
            if opened_at is not None and text[:1] not in ("", "#", "-") and indent <= opened_at:
                opened_at = None  # a key beside the list's own: the list has ended
            key = _NAMING_KEY.match(line)
            if key is not None and key.group(2):
                value = key.group(2)
                names.update(value.strip("[]").split(",") if value.startswith("[") else [value])
            elif key is not None and opened_at is None:
                opened_at = indent
            elif opened_at is not None and (item := _LIST_ITEM.match(line)) is not None:
                names.add(item.group(1))
    return {name.strip().strip("'\"") for name in names} - {""}


def model_parameters(model: Any) -> tuple[int, int]:
    """(parameters, active parameters per token): routed experts count ``num_experts_per_tok`` of their
    experts' weights (every router row counts), as the plan's active-parameter budget counts them."""

    total = sum(p.numel() for n, p in model.named_parameters() if not n.endswith(QUANTIZATION_PARAMETERS))
    active = float(total)
    for block in find_model_blocks(model, ("experts",)):
        experts = model.get_submodule(f"{block.prefix}.experts")
        size = sum(p.numel() for p in experts.parameters())
        active -= size * (1 - block.shape.num_experts_per_tok / block.shape.num_experts)
    return total, int(round(active))


#: the parameters a compressed-tensors model holds besides its weights (not counted as parameters)
QUANTIZATION_PARAMETERS = ("_scale", "_zero_point", "_global_scale", "weight_shape")


def _name(path: Path) -> str:
    """The folder's name; for a `gdnprune quantize` output, its source's name and the scheme."""
    try:
        manifest = json.loads((path / "gdnprune.json").read_text())
        if manifest.get("operation") == "quantize":
            return f"{Path(manifest['source']['path']).name} + {manifest['scheme']}"
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return path.name or str(path)


def _names(models: Sequence[Path]) -> list[str]:
    names = [_name(p) for p in models]
    return [str(p) if names.count(n) > 1 else n for p, n in zip(models, names, strict=True)]


def _evaluate_one(path: Path, name: str, options: EvalOptions, manager: Any, progress: bool) -> ModelResult:
    try:
        model = load_causal_lm(path, dtype=options.dtype, device=options.device)
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001 - whatever transformers raises, the folder is the problem
        raise EvalError(f"model {path}: does not load ({' '.join(str(exc).split())})") from None
    return evaluate_model(model, tokenizer, options, manager, name=name, path=str(path), progress=progress)


def evaluate_model(
    model: Any,
    tokenizer: Any,
    options: EvalOptions,
    manager: Any,
    *,
    name: str,
    path: str = "",
    progress: bool = False,
) -> ModelResult:
    """One loaded causal LM on ``options.tasks`` (``manager``: :func:`task_manager`), through lm-eval's
    ``HFLM`` given the model object (:mod:`.harness`: lm-eval's notes, bars and git call kept off the
    terminal; its request bars shown with ``progress``). In a process group of several processes every rank
    scores its share of the documents and every rank returns the gathered result."""
    from . import harness  # lazy: optional extra

    parameters, active = model_parameters(model)
    lm = harness.HarnessLM(model, tokenizer, batch_size=options.batch_size, progress=progress)
    # scoring needs no cache, and transformers' Qwen3.5 cache fails on a model without attention layers
    cached, model.config.use_cache = getattr(model.config, "use_cache", None), False
    try:
        results = harness.run_tasks(
            lm,
            options.tasks,
            manager,
            limit=options.limit,
            num_fewshot=options.num_fewshot,
            seed=options.seed,
        )
    finally:
        model.config.use_cache = cached
    results = exchange(results)[0]  # rank 0 has the results (lm-eval gives the other ranks None)
    return ModelResult(path, name, parameters, active, dict(results or {}))


def evaluate_models(
    models: Sequence[str | os.PathLike],
    options: EvalOptions,
    out_dir: str | os.PathLike,
    *,
    overwrite: bool = False,
    progress: bool = False,
) -> EvalReport:
    """Evaluate every model folder on ``options.tasks`` and write ``out_dir``: ``results.json`` (per model:
    path, name, parameter counts, lm-eval's ``results`` unchanged), ``results.md`` (the table),
    ``results.png`` (the plot, when matplotlib is installed), ``needle.png`` (the needle grid's heat map, when
    it ran) and ``tasks/`` (the built-in tasks of this run, a folder ``lm_eval --include_path`` reads).
    ``options.context_lengths`` None: :func:`default_context_lengths` of the models (the smallest
    ``max_position_embeddings``, the fewest characters per token). ``progress``: lm-eval's request bars, on
    rank 0.

    Under ``torchrun`` / ``accelerate launch`` (a process group of several processes, initialised by the
    caller: :func:`gdnprune.runtime.distributed.process_group`) every rank loads each model and scores its share of
    the documents; rank 0 gathers the results and alone writes ``out_dir``. Every rank returns the report.

    Raises:
        MissingExtraError: lm-eval is not installed.
        EvalError: a wrong input, found before any model loads (a model folder that does not load: when
            it is loaded).
    """
    require_lm_eval()
    paths = [Path(m) for m in models]
    out = Path(out_dir)
    _check_inputs(paths, options)
    lengths = _context_lengths(paths, options)
    main = is_main_process()
    if main:
        check_output_folder(out, overwrite, OUTPUT_MARKERS)
    staging = Staging(out, overwrite, markers=OUTPUT_MARKERS) if main else None
    with staging if staging is not None else tempfile.TemporaryDirectory() as where:
        tmp = Path(where)  # rank 0: the output being built; other ranks: their own copy of the tasks
        folder = write_task_folder(
            tmp / "tasks", context_lengths=lengths, seed=options.seed, data=options.data
        )
        manager = task_manager(options, folder.path)
        report = EvalReport(out)
        for path, name in zip(paths, _names(paths), strict=True):
            report.rows.append(_evaluate_one(path, name, options, manager, progress and main))
        if staging is not None:
            results = {"tasks": list(options.tasks), "models": [row.to_json() for row in report.rows]}
            (tmp / RESULTS_NAME).write_text(
                json.dumps(results, indent=2, default=str) + "\n", encoding="utf-8"
            )
            (tmp / "results.md").write_text(report.table, encoding="utf-8")
            report.plotted = plot_report(report.rows, tmp / "results.png")
            report.needles = plot_needles(report.rows, tmp / "needle.png")
            staging.commit()
    return report
