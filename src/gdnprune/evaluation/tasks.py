"""gdnprune's built-in lm-eval tasks: recall probes and nats per byte, as a folder lm-eval reads.

A task folder holds one YAML per task and ``gdnprune_tasks.py``, the hooks the YAMLs name with lm-eval's
``!function`` (they import this module). Its documents are made when lm-eval loads the task: probes from
``(kind, length, seed)`` (:mod:`gdnprune.quality.probes`), text windows from a file. So a folder needs
no download and can be moved: ``lm_eval --include_path FOLDER --tasks passkey`` runs it as
``gdnprune eval`` does.

Tasks (one per context length ``L``, in characters; the tag names all lengths of a kind):

* ``passkey_L`` (tag ``passkey``): exact match of the hidden number (lm-eval ``acc`` of a
  ``loglikelihood`` request: 1 when every answer token is the model's greedy choice);
* ``mqar_L`` (tag ``mqar``): exact match of each query's value, one document per query;
* ``multikey_L`` (tag ``multikey``) and ``vartrack_L`` (tag ``vartrack``): RULER's multi-key needle and
  variable tracking, exact match of the whole answer (from 256 characters on);
* ``needle_L_D`` (tag ``needle``): the passkey with its needle at depth ``D`` % of the filler, ``D`` in
  :data:`NEEDLE_DEPTHS`: the needle-in-a-haystack grid (depth x length);
* ``nats_per_byte``: the text file cut into non-overlapping windows of ``window`` bytes (ends moved back
  to a character boundary); each window is scored on its next-token predictions after its first
  character (after its leading whitespace and first other character, when it starts with whitespace:
  lm-eval cannot take a context of whitespace only), summed in nats and divided by the UTF-8 bytes
  predicted. With a byte tokenizer this is ``demo_data.validation_loss`` (mean next-byte cross entropy over
  all windows) for every window that starts with a visible character; across tokenizers it stays per byte.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..quality import probes

__all__ = [
    "PROBE_KINDS",
    "NEEDLE",
    "NEEDLE_DEPTHS",
    "DEFAULT_CONTEXT_LENGTHS",
    "NATS_WINDOW",
    "PROBES_PER_TASK",
    "TaskFolder",
    "write_task_folder",
    "text_windows",
    "probe_docs",
    "load_probe_docs",
    "load_text_docs",
    "nats_per_byte_results",
    "nats_per_byte_aggregate",
    "shipped_task_folder",
]

PROBE_KINDS = probes.KINDS
#: the tag of the needle-in-a-haystack grid, and its depths (% of the filler before the needle)
NEEDLE = "needle"
NEEDLE_DEPTHS = (0, 25, 50, 75, 100)
DEFAULT_CONTEXT_LENGTHS = (256, 1024, 4096)
#: bytes per window of ``nats_per_byte`` (the demo's window)
NATS_WINDOW = 256
#: probes per task: documents are one per query (mqar: ``probes.MQAR_QUERIES``; the others 1)
PROBES_PER_TASK = {"passkey": 100, "mqar": 12, "multikey": 100, "vartrack": 100, NEEDLE: 20}
HOOKS = "gdnprune_tasks"

_HOOKS_SOURCE = '''"""lm-eval hooks of gdnprune's built-in tasks (written by gdnprune.evaluation.tasks)."""

from gdnprune.evaluation.tasks import (  # noqa: F401
    load_probe_docs,
    load_text_docs,
    nats_per_byte_aggregate,
    nats_per_byte_results,
)
'''


@dataclass(frozen=True)
class TaskFolder:
    """A written task folder and the task names in it."""

    path: Path
    tasks: tuple[str, ...]
    tags: tuple[str, ...]


def _probe_yaml(kind: str, length: int, seed: int, count: int, depth: int | None = None) -> str:
    name = f"{kind}_{length}" if depth is None else f"{kind}_{length}_{depth}"
    where = "" if depth is None else f"\n  depth: {depth}"
    return f"""task: {name}
tag:
  - {kind}
custom_dataset: !function {HOOKS}.load_probe_docs
dataset_kwargs:
  kind: {kind}
  length: {length}
  seed: {seed}
  count: {count}{where}
test_split: test
output_type: loglikelihood
doc_to_text: context
doc_to_target: answer
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def _nats_yaml(data: Path, window: int) -> str:
    return f"""task: nats_per_byte
custom_dataset: !function {HOOKS}.load_text_docs
dataset_kwargs:
  data: {str(data)!r}
  window: {window}
test_split: test
output_type: loglikelihood
doc_to_text: context
doc_to_target: answer
target_delimiter: ""
process_results: !function {HOOKS}.nats_per_byte_results
metric_list:
  - metric: nats_per_byte
    aggregation: !function {HOOKS}.nats_per_byte_aggregate
    higher_is_better: false
metadata:
  version: 1.0
"""


def write_task_folder(
    folder: str | os.PathLike,
    *,
    context_lengths: Iterable[int] = DEFAULT_CONTEXT_LENGTHS,
    seed: int = 0,
    data: str | os.PathLike | None = None,
    window: int = NATS_WINDOW,
    probes_per_task: dict[str, int] | None = None,
    kinds: Sequence[str] | None = None,
) -> TaskFolder:
    """Write the YAMLs of the probe tasks at ``context_lengths`` (each kind from its shortest length,
    ``probes.MIN_LENGTHS``; the needle grid at every length and :data:`NEEDLE_DEPTHS`), ``nats_per_byte``
    on ``data`` (an absolute path is written) and the hooks file into ``folder`` (created if missing).
    ``kinds``: the probe kinds and ``needle`` to write (default all)."""
    wanted = (*PROBE_KINDS, NEEDLE) if kinds is None else tuple(kinds)
    unknown = sorted(set(wanted) - {*PROBE_KINDS, NEEDLE})
    if unknown:
        raise ValueError(f"`kinds`: expected some of {[*PROBE_KINDS, NEEDLE]}, got {unknown}")
    lengths = sorted(set(int(n) for n in context_lengths))
    for n in lengths:
        if n < probes.MIN_LENGTH:
            raise ValueError(f"`context_lengths`: each must be at least {probes.MIN_LENGTH}, got {n}")
    counts = {**PROBES_PER_TASK, **(probes_per_task or {})}
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    (path / f"{HOOKS}.py").write_text(_HOOKS_SOURCE, encoding="utf-8")
    names = []
    for kind in (k for k in PROBE_KINDS if k in wanted):
        for n in lengths:
            if n >= probes.MIN_LENGTHS[kind]:
                (path / f"{kind}_{n}.yaml").write_text(
                    _probe_yaml(kind, n, seed, counts[kind]), encoding="utf-8"
                )
                names.append(f"{kind}_{n}")
    for n in lengths if NEEDLE in wanted else ():
        for depth in NEEDLE_DEPTHS:
            (path / f"{NEEDLE}_{n}_{depth}.yaml").write_text(
                _probe_yaml(NEEDLE, n, seed, counts[NEEDLE], depth), encoding="utf-8"
            )
            names.append(f"{NEEDLE}_{n}_{depth}")
    if data is not None:
        (path / "nats_per_byte.yaml").write_text(_nats_yaml(Path(data).resolve(), window), encoding="utf-8")
        names.append("nats_per_byte")
    return TaskFolder(path, tuple(names), wanted)


def probe_docs(
    kind: str, length: int, seed: int, count: int, depth: int | None = None
) -> list[dict[str, Any]]:
    """The documents of task ``{kind}_{length}``: one per query of probes ``0..count-1`` (kind ``needle``:
    passkeys at ``depth`` % of the filler, task ``needle_{length}_{depth}``)."""
    docs = []
    for index in range(count):
        if kind == NEEDLE:
            p = probes.passkey(seed, length, index, depth=(depth or 0) / 100)
        else:
            p = probes.probe(kind, seed, length, index)
        for q, query in enumerate(p.queries):
            docs.append(
                {
                    "probe": index,
                    "query": q,
                    "length": length,
                    "context": query.context,
                    "answer": query.answer,
                    "answer_start": len(query.context),
                }
            )
    return docs


def _dataset(docs: list[dict[str, Any]]) -> Any:
    """The documents as a ``datasets`` split. Its fingerprint is the documents' hash: ``datasets`` would
    otherwise hash the table with dill, which fails on some installs (pyarrow's ``MonthDayNano``)."""
    import datasets  # lazy: lm-eval's dependency, needed only when lm-eval loads a task
    import pyarrow  # lazy: as datasets

    digest = hashlib.sha256(json.dumps(docs, sort_keys=True).encode()).hexdigest()[:32]
    table = datasets.table.InMemoryTable(pyarrow.Table.from_pylist(docs))
    return datasets.DatasetDict({"test": datasets.Dataset(table, fingerprint=digest)})


def load_probe_docs(
    *, kind: str, length: int, seed: int, count: int, depth: int | None = None, **_: Any
) -> Any:
    """lm-eval ``custom_dataset`` of a probe task (``_``: lm-eval's metadata, unused)."""
    where = None if depth is None else int(depth)
    return _dataset(probe_docs(kind, int(length), int(seed), int(count), where))


def text_windows(text: str, window: int = NATS_WINDOW) -> list[tuple[str, str]]:
    """``text`` cut into non-overlapping windows of at most ``window`` UTF-8 bytes (each end moved back to a
    character boundary; the tail shorter than a window dropped), each split into (context, predicted)."""
    raw = text.encode("utf-8")
    out = []
    start = 0
    while start + window <= len(raw):
        end = start + window
        while start < end < len(raw) and (raw[end] & 0xC0) == 0x80:
            end -= 1  # a continuation byte: the character starts earlier
        chunk = raw[start:end].decode("utf-8")
        lead = len(chunk) - len(chunk.lstrip())
        if lead < len(chunk):
            out.append((chunk[: lead + 1], chunk[lead + 1 :]))
        start = end
    return out


def load_text_docs(*, data: str, window: int = NATS_WINDOW, **_: Any) -> Any:
    """lm-eval ``custom_dataset`` of ``nats_per_byte``: the windows of the text file ``data``."""
    text = Path(data).read_text(encoding="utf-8")
    docs = [{"context": c, "answer": a} for c, a in text_windows(text, int(window))]
    return _dataset(docs)


def nats_per_byte_results(doc: dict[str, Any], results: Sequence[Any]) -> dict[str, Any]:
    """lm-eval ``process_results``: (nats, bytes) of one window."""
    loglikelihood, _greedy = results[0]
    return {"nats_per_byte": (-float(loglikelihood), len(doc["answer"].encode("utf-8")))}


def nats_per_byte_aggregate(items: Sequence[tuple[float, int]]) -> float:
    """lm-eval aggregation: summed nats over summed bytes."""
    nats = math.fsum(n for n, _ in items)
    size = sum(b for _, b in items)
    return nats / size if size else float("nan")


def shipped_task_folder() -> Path:
    """The task folder shipped in the package (``gdnprune/data/tasks``: the probes at the default lengths,
    seed 0; ``nats_per_byte`` needs a file, so ``gdnprune eval --data`` writes it)."""
    return Path(__file__).resolve().parent.parent / "data" / "tasks"
