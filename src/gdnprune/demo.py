"""The demo: the whole pipeline, score -> sort -> slice -> plan, on the bundled model.

:func:`run_demo` runs on the bundled byte-level Qwen3.5 model (no download, no training): it scores the GDN
layers on the training text, sorts the model (checking that the sorted model computes the same
function), slices it to a chain of nested targets that shrink every axis, and measures the validation
loss of each slice for the importance order, the identity order and a few random orders. It prints a
table, writes ``results.json``, a plot ``loss_vs_params.png``, the scores, and the sorted and one
sliced checkpoint (through the streaming checkpoint API) into ``output``. Then it plans the whole model
(GDN layers, attention heads and MLP channels) at a fraction of ALL its parameters and prints how the plan
splits them over the sub-blocks. Messages go to the ``log`` callback (the command line passes ``print``).
"""

from __future__ import annotations

import json
import math
import tempfile
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .checkpoint import slice_checkpoint, sort_checkpoint
from .checkpoint.output import Staging, check_output_folder
from .demo_data import (
    build_byte_tokenizer,
    byte_windows,
    demo_model_path,
    load_demo_model,
    train_text,
    validation_loss,
    validation_text,
)
from .distill import DistillConfig, distill
from .evaluation.api import EvalOptions, MissingExtraError, evaluate_model, require_lm_eval, task_manager
from .evaluation.report import markdown_table, plot_report
from .evaluation.tasks import write_task_folder
from .gated_delta_net import GDNPermutation, GDNShape, slice_gated_delta_net_state_dict
from .io.loading import load_pretrained, slice_model
from .model.layouts import find_gdn_modules
from .plan import BudgetError, plan_model, plot_sensitivity
from .quality.probes import MIN_LENGTH
from .runtime.figures import new_figure
from .scoring import GDN_ONLY, score_model

if TYPE_CHECKING:  # torch and transformers load inside the commands, so `gdnprune --help` stays fast
    import torch

    from .gated_delta_net import GDNPermutation, GDNShape

#: documents per built-in task in the demo's eval table (keeps the demo fast)
EVAL_LIMIT = 16

# Nested targets, as (key groups, lanes per group, key dim, value dim) fractions of the full geometry.
DEMO_FRACTIONS = [
    (1.0, 1.0, 1.0, 1.0),
    (1.0, 1.0, 0.75, 0.75),
    (0.75, 1.0, 0.75, 0.75),
    (0.75, 1.0, 0.5, 0.75),
    (0.5, 1.0, 0.5, 0.5),
    (0.5, 0.5, 0.5, 0.5),
    (0.5, 0.5, 0.25, 0.25),
    (0.25, 0.5, 0.25, 0.25),
]


def nested_targets(shape: GDNShape, fractions=DEMO_FRACTIONS) -> list[GDNShape]:
    """A chain of targets, each nested in the previous one (sizes rounded up, at least 1, never growing)."""

    out: list[GDNShape] = []
    for fk, fr, fdk, fdv in fractions:
        prev = out[-1] if out else shape
        hk = min(prev.num_key_heads, max(1, math.ceil(shape.num_key_heads * fk)))
        r = min(prev.value_heads_per_group, max(1, math.ceil(shape.value_heads_per_group * fr)))
        dk = min(prev.key_head_dim, max(1, math.ceil(shape.key_head_dim * fdk)))
        dv = min(prev.value_head_dim, max(1, math.ceil(shape.value_head_dim * fdv)))
        target = GDNShape(hk, hk * r, dk, dv)
        if target not in out:
            out.append(target)
    return out


def gdn_parameter_count(model: torch.nn.Module) -> int:
    """Parameters held by the GDN layers of ``model``."""

    return sum(p.numel() for _, m in find_gdn_modules(model) for p in m.parameters())


def _sliced_model(model, permutations: dict[str, GDNPermutation] | None, shape: GDNShape, target: GDNShape):
    """A new model holding the nested prefix ``target`` of ``model`` (after ``permutations``, if given)."""

    state = dict(model.state_dict())
    for prefix, _ in find_gdn_modules(model):
        perm = None if permutations is None else permutations[prefix]
        slice_gated_delta_net_state_dict(state, prefix=prefix, shape=shape, target=target, permutation=perm)
    small = type(model)(target.apply_to_config(model.config)).eval()
    small.load_state_dict(state, strict=True)
    return small


def _random_permutations(model, shape: GDNShape, seed: int) -> dict[str, GDNPermutation]:
    g = torch.Generator().manual_seed(seed)
    return {prefix: GDNPermutation.random(shape, generator=g) for prefix, _ in find_gdn_modules(model)}


#: what the demo says when it cannot draw its plot
NO_PLOT = "no plot: matplotlib is not installed (pip install 'gdnprune[plot]', or pip install matplotlib)"


def _plot(rows: list[dict], orderings: list[str], path: Path, title: str) -> bool:
    """Validation loss against kept GDN parameters, one curve per ordering; False when matplotlib is missing."""
    fig = new_figure(figsize=(7, 4.5), dpi=120)
    if fig is None:
        return False
    from matplotlib.ticker import FuncFormatter  # lazy: optional extra (matplotlib is there: fig is drawn)

    ax = fig.subplots()
    styles = {"importance": "o-", "activation": "s--", "identity": "^:", "random": "x-."}
    for name in orderings:
        xs = [row["gdn_params"] for row in rows]
        ys = [row["loss"][name] for row in rows]
        (line,) = ax.plot(xs, ys, styles.get(name, "o-"), label=name)
        if name == "random" and rows[0].get("random_std") is not None:
            std = [row["random_std"] for row in rows]
            low, high = [y - s for y, s in zip(ys, std)], [y + s for y, s in zip(ys, std)]
            band = "random: \u00b1 1 std over the random orders"
            ax.fill_between(xs, low, high, alpha=0.2, color=line.get_color(), label=band)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:,.0f}"))
    ax.set_xlabel("kept GDN parameters (right: cut deeper)")
    ax.set_ylabel("validation loss (nats/byte)")
    ax.set_title(title)
    ax.invert_xaxis()
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return True


# long: its documented signature and docstring; the body is 46 lines, one step after another
def run_demo(
    output: str | Path | None = "demo_output",
    *,
    model_dir: str | Path | None = None,
    num_samples: int = 64,
    seq_len: int = 256,
    batch_size: int = 8,
    num_random: int = 4,
    eval_samples: int = 32,
    method: str = "projection",
    seed: int = 0,
    write_checkpoints: bool = True,
    recover_steps: int = 40,
    budget_params: float | None = 0.5,
    progress: bool = True,
    threads: int | None = 1,
    overwrite: bool = False,
    log=None,
    eval_limit: int | None = EVAL_LIMIT,
    **deprecated: int,
) -> dict[str, Any]:
    """Score, sort and slice the bundled demo model; return (and write to ``output``) the results.

    ``model_dir`` runs the same demo on another byte-level model folder (token ids = UTF-8 bytes, like the
    bundled model's, e.g. one written by ``scripts/train_demo_model.py --family ...``), loaded in float32
    with :func:`gdnprune.io.loading.load_pretrained`; None (default) is the bundled model.

    Returns a dict with the sort check (``sort_max_abs_logit_diff``), the targets and, per target, the
    kept GDN parameters and the validation loss of each ordering (``importance`` = ``method`` scores,
    ``identity``, ``random`` = mean over ``num_random`` seeded random orders), and ``recovery``: the middle
    target's importance-order slice distilled from the unpruned model for ``recover_steps`` steps
    (:func:`recover_demo_slice`; 0 skips it), and ``whole_model_plan``: the plan of the whole model at
    ``budget_params`` of all its parameters (:func:`whole_model_plan`; None or 0 skips it). ``threads`` sets torch's
    intra-op threads (default 1: the model is tiny, and on a busy machine extra threads spin and can make
    a forward pass tens of times slower); None leaves torch's setting alone.

    ``eval``: the teacher, the middle slice and (with ``recover_steps``) the recovered slice, and that
    quantized (w4a16, with the optional extra ``gdnprune[quantize]``), on gdnprune's
    built-in lm-eval tasks (:mod:`gdnprune.evaluation`: nats_per_byte on the validation text, passkey and MQAR
    at ``seq_len``), ``eval_limit`` documents per task (None: all; 0 skips it; skipped too when lm-eval is
    not installed).

    ``num_samples`` calibration windows score the model; the losses are measured on ``eval_samples``
    held-out windows (``calibration_windows`` and ``validation_windows`` are their deprecated names).

    ``output`` is written like every output of gdnprune: in a temporary folder beside it, moved into place
    when complete; an existing ``output`` is refused, and replaced with ``overwrite`` only when it is an
    earlier demo output (``results.json``) or empty.
    """
    num_samples, eval_samples = _renamed(deprecated, num_samples, eval_samples)
    start = time.perf_counter()
    log = log or (lambda message: None)
    if threads is not None:
        torch.set_num_threads(threads)
    out_dir = None if output is None else Path(output)
    if out_dir is not None:
        check_output_folder(out_dir, overwrite, DEMO_MARKERS)
    model, model_dir, title = _load(model_dir)
    run = _DemoRun(model, Path(model_dir), seq_len, eval_samples, batch_size, seed, progress, log)
    log(f"{title}: {model_dir}  ({len(run.layers)} GDN layers, {run.shape})")
    scores, permutations, calibration, diff = run.score_and_sort(num_samples, method)
    targets = nested_targets(run.shape)
    orderings = ["importance", "identity", "random"]
    rows = run.nested_rows(permutations, targets, num_random)
    _log_rows(rows, orderings, log)
    middle = targets[len(targets) // 2]
    recovery, evals = run.recover_and_evaluate(permutations, middle, recover_steps, eval_limit)
    whole = run.whole_plan(calibration, budget_params, rows) if budget_params else None
    results = {
        "model": str(model_dir),
        "shape": run.shape.as_dict(),
        "method": method,
        "calibration_tokens": int(calibration.numel()),
        "validation_windows": eval_samples,
        "seq_len": seq_len,
        "num_random": num_random,
        "sort_max_abs_logit_diff": diff,
        "rows": rows,
        "recovery": recovery,
        "whole_model_plan": None if whole is None else {k: v for k, v in whole.items() if k != "report"},
        "eval": None if evals is None else [row.to_json() for row in evals],
    }
    if out_dir is None:
        results["seconds"] = time.perf_counter() - start
    else:
        staging = Staging(out_dir, overwrite, markers=DEMO_MARKERS)
        with staging as tmp:
            written = _Written(tmp, out_dir, start, log)
            written.write(results, scores, rows, orderings, title=title, whole=whole, evals=evals)
            if write_checkpoints:
                results["checkpoints"] = _write_checkpoints(model_dir, scores, targets, tmp, out_dir, log)
            written.finish(results)
            staging.commit()
    log(f"done in {results['seconds']:.1f} s")
    return results


#: what makes an existing folder an earlier demo output, which ``overwrite`` may replace
DEMO_MARKERS = frozenset({"results.json"})


def _renamed(deprecated: dict[str, int], num_samples: int, eval_samples: int) -> tuple[int, int]:
    """``num_samples`` and ``eval_samples`` from their deprecated names, with a warning."""
    renamed = {"calibration_windows": "num_samples", "validation_windows": "eval_samples"}
    for old in sorted(set(deprecated) & set(renamed)):
        warnings.warn(f"run_demo: {old} is deprecated, use {renamed[old]}", FutureWarning, stacklevel=3)
    num_samples = deprecated.pop("calibration_windows", num_samples)
    eval_samples = deprecated.pop("validation_windows", eval_samples)
    if deprecated:
        raise TypeError(f"run_demo() got unexpected keyword arguments {sorted(deprecated)}")
    return num_samples, eval_samples


def _load(model_dir: str | Path | None) -> tuple[Any, Path, str]:
    """The model (float32, eval mode), its folder and its title: the bundled model when ``model_dir`` is None."""

    if model_dir is None:
        model, _ = load_demo_model()
        return model, demo_model_path(), "bundled Qwen3.5 demo model"

    model = load_pretrained(Path(model_dir), dtype=torch.float32).eval()
    return model, Path(model_dir), f"{Path(model_dir).name} ({model.config.model_type})"


def _log_rows(rows: list[dict], orderings: list[str], log) -> None:
    """The table of nested slices: geometry, kept GDN parameters, the loss of each ordering."""
    full_params = rows[0]["gdn_params"]
    header = f"{'Hk':>3} {'Hv':>3} {'dk':>3} {'dv':>3} {'GDN params':>11} {'kept':>6} | " + " ".join(
        f"{n:>10}" for n in orderings
    )
    log("validation loss (nats/byte) of nested slices:")
    log(header)
    log("-" * len(header))
    for row in rows:
        t = row["target"]
        cells = " ".join(f"{row['loss'][n]:>10.4f}" for n in orderings)
        log(
            f"{t['num_key_heads']:>3} {t['num_value_heads']:>3} {t['key_head_dim']:>3} {t['value_head_dim']:>3} "
            f"{row['gdn_params']:>11,} {row['gdn_params'] / full_params:>6.1%} | {cells}"
        )


class _DemoRun:
    """The steps of :func:`run_demo` on one loaded model: what they share (model, geometry, settings)."""

    def __init__(self, model, model_dir: Path, seq_len, eval_samples, batch_size, seed, progress, log):
        self.model, self.model_dir, self.seq_len = model, model_dir, seq_len
        self.eval_samples, self.batch_size, self.seed = eval_samples, batch_size, seed
        self.progress, self.log = progress, log
        self.layers = find_gdn_modules(model)
        self.shape = GDNShape.from_module(self.layers[0][1])

    def val(self, model) -> float:
        return validation_loss(model, num_windows=self.eval_samples, seq_len=self.seq_len)

    def score_and_sort(self, num_samples: int, method: str):
        """Score on the training text; sort, and check that the sorted model computes the same function."""

        calibration = byte_windows(train_text(), self.seq_len, num_samples)
        batches = list(calibration.split(self.batch_size))
        scores = score_model(
            self.model, batches, method=method, progress=self.progress, seed=self.seed, blocks=GDN_ONLY
        )
        permutations = {
            p: GDNPermutation.from_score_payload(scores["layers"][p], self.shape) for p, _ in self.layers
        }
        self.log(f"scored {calibration.numel()} calibration tokens with method={method!r}")
        sorted_model = _sliced_model(self.model, permutations, self.shape, self.shape)
        probe = byte_windows(validation_text(), self.seq_len, 8)
        with torch.no_grad():
            diff = (
                (sorted_model(input_ids=probe).logits - self.model(input_ids=probe).logits).abs().max().item()
            )
        self.log(f"sorted model vs original: max |logit difference| = {diff:.2e}")
        if diff > 1e-4:
            raise RuntimeError(
                f"sorted model is not equivalent to the original (max |diff| {diff:.2e} > 1e-4)"
            )
        return scores, permutations, calibration, diff

    def nested_rows(self, permutations, targets: list[GDNShape], num_random: int) -> list[dict]:
        """Per target: kept GDN parameters and the loss of the importance, identity and random orders."""

        orderings = {"importance": permutations, "identity": None}
        random_perms = [
            _random_permutations(self.model, self.shape, self.seed + 1 + i) for i in range(num_random)
        ]
        rows = []
        for target in targets:
            row: dict[str, Any] = {"target": target.as_dict(), "loss": {}}
            for name, perms in orderings.items():
                small = _sliced_model(self.model, perms, self.shape, target)
                row["loss"][name] = self.val(small)
                row["gdn_params"] = gdn_parameter_count(small)
            rand = [self.val(_sliced_model(self.model, p, self.shape, target)) for p in random_perms]
            row["loss"]["random"] = sum(rand) / len(rand) if rand else float("nan")
            row["random_std"] = float(torch.tensor(rand).std()) if len(rand) > 1 else None
            rows.append(row)
        return rows

    def recover_and_evaluate(self, permutations, middle: GDNShape, steps: int, eval_limit: int | None):
        """Distil the middle slice (``steps``; 0 skips it); the eval table of teacher, pruned (the slice),
        recovered and recovered + quantized (:data:`QUANTIZED`)."""
        student = _sliced_model(self.model, permutations, self.shape, middle)
        length = min(
            self.seq_len, getattr(self.model.config, "max_position_embeddings", None) or self.seq_len
        )
        evaluate = _Evaluation.start(length, self.seed, eval_limit, self.log)
        evaluate(self.model, "teacher")
        evaluate(
            student,
            f"pruned ({middle.num_key_heads}/{middle.num_value_heads}/{middle.key_head_dim}/{middle.value_head_dim})",
        )
        recovery = None
        if steps:
            self.log(f"recovery: distilling the slice {middle} from the unpruned model for {steps} steps ...")
            recovery = recover_demo_slice(
                student,
                self.model,
                steps=steps,
                seq_len=self.seq_len,
                validation_windows=self.eval_samples,
                seed=self.seed,
            )
            recovery["target"] = middle.as_dict()
            self.log(
                f"recovery: validation loss {recovery['loss_before']:.4f} -> {recovery['loss_after']:.4f} nats/byte "
                f"(unpruned {recovery['teacher_loss']:.4f}; {recovery['recovered']:.0%} of the loss increase won "
                f"back in {recovery['steps']} steps, {recovery['seconds']:.0f} s)"
            )
            evaluate(student, "recovered")
            evaluate.quantized(student, QUANTIZED)
        return recovery, evaluate.finish()

    def whole_plan(self, calibration, budget_params: float, rows: list[dict]) -> dict | None:
        """The whole-model plan at ``budget_params`` (None when no plan meets it), logged."""

        full_row = next((row for row in rows if row["target"] == self.shape.as_dict()), None)
        try:
            whole = whole_model_plan(
                self.model,
                calibration[:PLAN_SAMPLES],
                budget_params,
                seq_len=self.seq_len,
                eval_samples=self.eval_samples,
                batch_size=self.batch_size,
                seed=self.seed,
                progress=self.progress,
                unpruned_loss=None if full_row is None else full_row["loss"]["importance"],
            )
        except BudgetError as exc:  # e.g. an MoE model whose routed experts alone hold more than the budget
            self.log(f"whole-model plan at {budget_params:g} of all parameters: skipped, {exc}")
            return None
        _log_whole(whole, budget_params, self.log)
        return whole


def _log_whole(whole: dict, budget_params: float, log) -> None:
    totals = whole["plan"]["totals"]
    log(
        f"whole-model plan at {budget_params:g} of all parameters (GDN, attention heads, MLP channels; "
        f"{whole['plan_windows']} calibration windows, {whole['seconds']:.0f} s): "
        f"{whole['params_kept']:,} of {whole['params']:,} parameters kept ({whole['params_kept'] / whole['params']:.1%}); "
        f"validation loss {whole['loss']:.4f} nats/byte (unpruned {whole['unpruned_loss']:.4f})"
    )
    log(
        "  split: "
        + ", ".join(
            f"{kind} {v['params_kept']:,.0f} of {v['params']:,.0f} "
            f"({v['params_kept'] / max(v['params'], 1):.0%})"
            for kind, v in totals["split"].items()
        )
        + "  (other: embeddings and norms)"
    )


#: what the demo says when lm-eval is missing
NO_EVAL = "no eval table: lm-eval is not installed (pip install 'gdnprune[eval]')"
#: ... and when compressed-tensors is
NO_QUANTIZE = "no quantized row: compressed-tensors is not installed (pip install 'gdnprune[quantize]')"
#: the quantized row of the eval table: 4-bit weights in groups of 64 (the middle slice's widths are multiples of
#: 64, not of 128), rounded to nearest (GPTQ would need calibration passes)
QUANTIZED = {"scheme": "w4a16", "size": 64, "calibration": "rtn"}


class _Evaluation:
    """The demo's eval table: models evaluated as they come (a slice before and after its recovery) on the
    built-in tasks, in a temporary task folder (the validation text for ``nats_per_byte``)."""

    def __init__(self, folder, options, manager, log):
        self.folder, self.options, self.manager, self.log = folder, options, manager, log
        self.rows: list = []
        self.tokenizer: Any = None

    @classmethod
    def start(cls, seq_len: int, seed: int, limit: int | None, log):
        """Probes and text windows of ``seq_len`` characters (at most the model's positions)."""

        if limit == 0:
            return _NoEvaluation()
        try:
            require_lm_eval()
        except MissingExtraError:
            log(NO_EVAL)
            return _NoEvaluation()
        folder = tempfile.TemporaryDirectory(prefix="gdnprune-demo-tasks-")
        text = Path(folder.name) / "validation.txt"
        text.write_text(validation_text(), encoding="utf-8")
        lengths = [seq_len] if seq_len >= MIN_LENGTH else []  # shorter windows: nats_per_byte alone
        tasks = write_task_folder(
            Path(folder.name) / "tasks",
            context_lengths=lengths,
            seed=seed,
            data=text,
            window=seq_len,
            kinds=("passkey", "mqar"),
        )
        options = EvalOptions(tasks=list(tasks.tasks), limit=limit, seed=seed, context_lengths=lengths)
        run = cls(folder, options, task_manager(options, tasks.path), log)
        run.tokenizer = build_byte_tokenizer()
        return run

    def __call__(self, model, name: str) -> None:
        self.rows.append(evaluate_model(model, self.tokenizer, self.options, self.manager, name=name))

    def quantized(self, model, scheme: dict) -> None:
        """The row of ``model`` quantized (``scheme``: :func:`gdnprune.quantize.quantize_model`'s keywords)."""
        try:
            from .quantize import quantize_model  # lazy: compressed-tensors is the optional extra [quantize]
        except ModuleNotFoundError:
            self.log(NO_QUANTIZE)
            return
        self(quantize_model(model, **scheme), f"recovered + {scheme['scheme']}")

    def finish(self):
        self.folder.cleanup()
        self.log(f"eval table (gdnprune's built-in lm-eval tasks, {self.options.limit} documents each):")
        for line in markdown_table(self.rows).splitlines():
            self.log(line)
        return self.rows


class _NoEvaluation:
    def __call__(self, model, name: str) -> None:
        pass

    def quantized(self, model, scheme: dict) -> None:
        pass

    def finish(self) -> None:
        return None


class _Written:
    """The demo's files in the staging folder ``tmp``, logged with their places in ``out_dir``."""

    def __init__(self, tmp: Path, out_dir: Path, start: float, log):
        self.tmp, self.out_dir, self.start, self.log = tmp, out_dir, start, log

    def write(self, results, scores, rows, orderings, *, title: str, whole: dict | None, evals) -> None:
        """Scores, the whole-model plan, the loss plot and the eval table."""
        tmp, out_dir, log = self.tmp, self.out_dir, self.log
        (tmp / "scores.json").write_text(json.dumps(scores, indent=1))
        if whole is not None:
            (tmp / "whole_model_plan.json").write_text(json.dumps(whole["plan"], indent=1))
            (tmp / "whole_model_plan.sensitivity.json").write_text(json.dumps(whole["report"], indent=1))
            results["whole_model_plan"]["file"] = str(out_dir / "whole_model_plan.json")
            drawn = plot_sensitivity(whole["report"], tmp / "whole_model_plan.sensitivity.png")
            plot = f" (sensitivity plot: {out_dir / 'whole_model_plan.sensitivity.png'})" if drawn else ""
            log(f"whole-model plan: {out_dir / 'whole_model_plan.json'}{plot}")
        if _plot(rows, orderings, tmp / "loss_vs_params.png", f"{title}: nested GDN slices"):
            results["plot"] = str(out_dir / "loss_vs_params.png")
            log(f"plot: {results['plot']}")
        else:
            log(NO_PLOT)
        if evals:
            (tmp / "eval.md").write_text(markdown_table(evals))
            drawn = plot_report(evals, tmp / "eval.png")
            log(f"eval table: {out_dir / 'eval.md'}" + (f" (plot: {out_dir / 'eval.png'})" if drawn else ""))

    def finish(self, results) -> None:
        results["seconds"] = time.perf_counter() - self.start
        (self.tmp / "results.json").write_text(json.dumps(results, indent=1))
        self.log(f"results: {self.out_dir / 'results.json'}")


def _write_checkpoints(
    model_dir: Path, scores: dict, targets: list[GDNShape], tmp: Path, out_dir: Path, log
) -> dict:
    """Sort the model's checkpoint and slice the sorted one to the middle target, with the streaming API."""

    sort_checkpoint(model_dir, scores, tmp / "sorted", overwrite=True, progress=False)
    middle = targets[len(targets) // 2]
    slice_checkpoint(tmp / "sorted", tmp / "sliced", target=middle, overwrite=True, progress=False)
    sorted_dir, sliced_dir = out_dir / "sorted", out_dir / "sliced"
    log(f"checkpoints: {sorted_dir} (sorted), {sliced_dir} (sliced to {middle})")
    return {"sorted": str(sorted_dir), "sliced": str(sliced_dir), "sliced_target": middle.as_dict()}


#: calibration windows of the demo's whole-model plan (its sub-block scores and measured sensitivities)
PLAN_SAMPLES = 4


def whole_model_plan(
    model,
    windows: torch.Tensor,
    budget_params: float,
    *,
    seq_len: int = 256,
    eval_samples: int | None = 32,
    batch_size: int = 8,
    dim_step: str = "1/2",
    seed: int = 0,
    progress: bool = False,
    unpruned_loss: float | None = None,
) -> dict[str, Any]:
    """Plan the whole model (GDN layers, attention heads, MLP channels) at ``budget_params`` of all its
    parameters, on a coarse grid (``dim_step``) and a few calibration ``windows``; cut it in memory.

    Returns the ``plan`` and its ``report`` (:func:`gdnprune.plan.plan_model`), the parameters of the full
    and of the cut model counted on the models (``params``, ``params_kept``), the validation loss of both
    (``unpruned_loss``, ``loss``, nats/byte on ``eval_samples`` windows; ``unpruned_loss`` given: not measured
    again), ``plan_windows`` and ``seconds``.
    """

    start = time.perf_counter()
    batches = list(windows.split(batch_size))
    scores = score_model(model, batches, progress=progress, seed=seed)  # every kind the model has
    plan, report = plan_model(
        model,
        batches,
        scores,
        budget_params=budget_params,
        dim_step=dim_step,
        blocks=("gdn", "attention", "mlp"),
        sensitivity="halving",
        progress=progress,
    )
    gdn = {p: t for p, t in plan["layers"].items() if p in report["layers"]}
    blocks = {p: t for p, t in plan["layers"].items() if p not in gdn}
    permutations = {
        p: GDNPermutation.from_score_payload(scores["layers"][p], GDNShape(**report["layers"][p]["shape"]))
        for p in gdn
    }
    cut = slice_model(
        model, gdn, permutations, blocks=blocks, block_orders={p: scores["layers"][p] for p in blocks}
    )
    val = lambda m: validation_loss(m, num_windows=eval_samples, seq_len=seq_len)  # noqa: E731
    return {
        "budget_params": budget_params,
        "plan": plan,
        "report": report,
        "params": sum(p.numel() for p in model.parameters()),
        "params_kept": sum(p.numel() for p in cut.parameters()),
        "unpruned_loss": val(model) if unpruned_loss is None else unpruned_loss,
        "loss": val(cut),
        "plan_windows": int(windows.shape[0]),
        "seconds": time.perf_counter() - start,
    }


def recover_demo_slice(
    student,
    teacher,
    *,
    steps: int = 40,
    batch_size: int = 8,
    seq_len: int = 256,
    lr: float = 1e-3,
    validation_windows: int | None = 32,
    seed: int = 0,
    **options: Any,
) -> dict[str, Any]:
    """Distil a slice of the bundled demo model for a few steps; validation loss before and after.

    Trains ``student`` in place on the demo training text (:mod:`gdnprune.demo_data`, byte windows) with
    :func:`gdnprune.distill.distill`, without writing anything unless ``output_dir`` is among ``options``
    (those of ``distill``). Returns ``teacher_loss``, ``loss_before``, ``loss_after`` (nats/byte on
    ``validation_windows`` windows of the validation text), ``recovered`` (share of the slice's loss
    increase won back), ``steps`` and ``seconds``. The default 40 steps take about 30 s on one CPU thread.
    """

    start = time.perf_counter()
    val = lambda m: validation_loss(m, seq_len=seq_len, num_windows=validation_windows)  # noqa: E731
    teacher_loss, before = val(teacher), val(student)
    config = DistillConfig(
        **{"progress": False, **options}, steps=steps, batch_size=batch_size, lr=lr, seed=seed
    )
    result = distill(student, teacher, byte_windows(train_text(), seq_len), config)
    after = val(student)
    gap = before - teacher_loss
    return {
        "teacher_loss": teacher_loss,
        "loss_before": before,
        "loss_after": after,
        "recovered": (before - after) / gap if gap > 0 else float("nan"),
        "steps": result["steps"],
        "seconds": time.perf_counter() - start,
    }
