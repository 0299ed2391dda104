"""Blockwise local distillation (BLD) as a sensitivity: every candidate recovered a little before it is measured.

Puzzle (Bercovich et al. 2024) builds its library of block variants by *blockwise local distillation*: each
variant is trained, alone, to reproduce its parent block's output on the parent's inputs, and only then
scored. Here every candidate of every group (a GDN layer cut to a geometry, an attention / MLP / expert
sub-block cut to one) is:

1. built as the measured sensitivity builds it (:func:`gdnprune.plan.measure.sensitivity.candidate_module`: the
   sorted weights cut to the candidate), its parameters copied and trained in float32;
2. trained for ``steps`` AdamW steps (no weight decay) to minimise the block's relative output error
   ``sum ||f_c(x) - f(x)||^2 / sum ||f(x)||^2`` against the unpruned block ``f``, on the inputs ``x`` the
   block receives in the calibration batches (one batch per step, in turn); the trained weights are kept
   only if they lower that error (else the one-shot cut is measured);
3. measured exactly as the measured sensitivity measures (:class:`gdnprune.model.forwards.Forwards`: the KL from
   the unpruned model per token, every other layer intact, every calibration window), so the exact choice
   sums recovered losses instead of one-shot ones.

A candidate equal to the full geometry is the sorted block, the same function: KL 0 and the base loss, not
trained or measured (as the measured sensitivity does). Under ``torchrun`` every rank holds every batch and
takes its share of each group's candidates; the results are gathered, so every rank returns the same table.
The cost: per group, one forward up to the block per batch (its inputs, kept for all its candidates) and, per
candidate, ``steps`` forward and backward passes of the block alone (one batch each), two block evaluations of
all the batches (the error before and after; the batches joined into as few calls as ``max_tokens`` allows),
then the measurement's forwards from the block on (what the measured sensitivity costs). The steps dominate:
on the bundled model (CPU, transformers' reference GDN kernels) a GDN candidate's training takes 4-8x its
measurement, the block's forward and backward grow in proportion to the tokens per step (a larger batch per
step saves nothing), and fewer steps or a higher learning rate leave a higher block error (BENCHMARKS.md,
"BLD sensitivity (issue 31): its cost").
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from ...model.forwards import Forwards, Stop, model_inputs, parent_and_name, run_with_hooks
from .halving import gather_over_ranks, rank_share
from .sensitivity import LayerToPlan, candidate_module, sorted_state

__all__ = [
    "DEFAULT_LR",
    "DEFAULT_STEPS",
    "bld_sensitivity",
    "block_error",
    "block_inputs",
    "distill_block",
    "evaluation_batches",
]

#: default BLD steps per candidate and AdamW learning rate
DEFAULT_STEPS, DEFAULT_LR = 20, 1e-3


def _map(value: Any, fn: Any) -> Any:
    """``fn`` applied to every tensor in ``value`` (tuples, lists and dicts of them; anything else kept)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple | list):
        return type(value)(_map(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: _map(v, fn) for k, v in value.items()}
    return value


def _output(result: Any) -> torch.Tensor:
    """A block's output tensor (the first element when it returns a tuple, as attention does)."""
    return result[0] if isinstance(result, tuple | list) else result


@torch.no_grad()
def block_inputs(forwards: Forwards, module: torch.nn.Module) -> list[tuple[tuple, dict, torch.Tensor]]:
    """``(args, kwargs, output)`` of ``module`` (a block of the unpruned model) on every calibration batch of
    ``forwards``, on the CPU: the inputs it receives and what it returns. Each batch runs up to the block."""
    seen: list[tuple[tuple, dict]] = []

    def hook(_module, args, kwargs):
        seen.append((_map(args, lambda t: t.detach().cpu()), _map(kwargs, lambda t: t.detach().cpu())))
        raise Stop

    out = []
    for ids, mask in forwards.data:
        run_with_hooks(forwards.decoder, (), model_inputs(ids, mask, forwards.device), [(module, hook)])
        args, kwargs = seen.pop()
        result = _call(module, args, kwargs, next(module.parameters()).dtype)
        out.append((args, kwargs, result.detach().cpu()))
    return out


def _device_of(module: torch.nn.Module) -> torch.device:
    param = next(module.parameters(), None)
    return torch.device("cpu") if param is None or param.device.type == "meta" else param.device


def _call(module: torch.nn.Module, args: tuple, kwargs: dict, dtype: torch.dtype) -> torch.Tensor:
    """``module``'s output on cached inputs, floating tensors moved to its device in ``dtype``."""
    device = _device_of(module)

    def move(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype) if t.is_floating_point() else t.to(device)

    return _output(module(*_map(args, move), **_map(kwargs, move)))


class _Apart(Exception):
    """Cached batches that do not join into one."""


def _joined(values: Sequence[Any], sizes: Sequence[int]) -> Any:
    """One value from the same argument of several batches (``sizes``: their windows): tensors with a first
    dimension of their batch's size concatenated along it, anything else kept when every batch has it the same."""
    first = values[0]
    if isinstance(first, torch.Tensor):
        if all(isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == n for v, n in zip(values, sizes)):
            if any(v.shape[1:] != first.shape[1:] for v in values):
                raise _Apart
            return torch.cat(list(values))
        if all(
            isinstance(v, torch.Tensor) and v.shape == first.shape and torch.equal(v, first) for v in values
        ):
            return first
        raise _Apart
    if isinstance(first, tuple | list):
        if any(not isinstance(v, type(first)) or len(v) != len(first) for v in values):
            raise _Apart
        return type(first)(_joined([v[k] for v in values], sizes) for k in range(len(first)))
    if isinstance(first, dict):
        if any(not isinstance(v, dict) or v.keys() != first.keys() for v in values):
            raise _Apart
        return {key: _joined([v[key] for v in values], sizes) for key in first}
    if all(v is first or v == first for v in values):
        return first
    raise _Apart


def _join(entries: Sequence[tuple[tuple, dict, torch.Tensor]]) -> tuple[tuple, dict, torch.Tensor] | None:
    """Cached ``(args, kwargs, output)`` batches as one batch (:func:`_joined`), None where they do not join."""
    if len(entries) == 1:
        return entries[0]
    sizes = [int(e[2].shape[0]) if e[2].dim() else 0 for e in entries]
    try:
        args = _joined([e[0] for e in entries], sizes)
        kwargs = _joined([e[1] for e in entries], sizes)
        return args, kwargs, _joined([e[2] for e in entries], sizes)
    except _Apart:
        return None


def evaluation_batches(
    data: Sequence[tuple[tuple, dict, torch.Tensor]], max_tokens: int = 1 << 16
) -> list[tuple[tuple, dict, torch.Tensor]]:
    """The cached batches joined into as few as possible (consecutive batches, at most ``max_tokens`` tokens
    each, where they join: :func:`_join`); a block evaluation over them equals one over ``data`` to float
    rounding, in fewer calls (a GDN block's forward on 16 windows at once costs ~70 % of four calls on 4; its
    backward saves nothing, so the training steps keep one batch each)."""
    out: list[tuple[tuple, dict, torch.Tensor]] = []
    group: list[tuple[tuple, dict, torch.Tensor]] = []
    tokens = 0

    def flush() -> None:
        if group:
            joined = _join(group)
            out.extend([joined] if joined is not None else group)
            group.clear()

    for entry in data:
        n = int(entry[2][..., 0].numel())
        if group and tokens + n > max_tokens:
            flush()
            tokens = 0
        group.append(entry)
        tokens += n
    flush()
    return out


def block_error(
    module: torch.nn.Module, data: Sequence[tuple[tuple, dict, torch.Tensor]], dtype: torch.dtype
) -> float:
    """The relative output error ``sum ||module(x) - y||^2 / sum ||y||^2`` over cached ``(args, kwargs, y)``."""
    num = den = 0.0
    with torch.no_grad():
        for args, kwargs, target in data:
            y = _call(module, args, kwargs, dtype).double()
            t = target.to(y.device).double()
            num += float((y - t).pow(2).sum())
            den += float(t.pow(2).sum())
    return num / max(den, 1e-300)


def distill_block(
    module: torch.nn.Module,
    data: Sequence[tuple[tuple, dict, torch.Tensor]],
    *,
    steps: int = DEFAULT_STEPS,
    lr: float = DEFAULT_LR,
    evaluation: Sequence[tuple[tuple, dict, torch.Tensor]] | None = None,
) -> tuple[torch.nn.Module, float, float]:
    """A copy of ``module`` trained for ``steps`` AdamW steps (float32, no weight decay) to reproduce the cached
    outputs from the cached inputs (one batch per step, in turn); ``(trained module, error before, error
    after)`` (:func:`block_error` over ``evaluation``: the same batches joined, by default
    :func:`evaluation_batches` of ``data``). The module is returned in its own dtype; ``module`` is not
    changed."""
    dtype = next(module.parameters()).dtype
    evaluation = evaluation_batches(data) if evaluation is None else evaluation
    student = copy.deepcopy(module).float().train()
    for p in student.parameters():
        p.data = p.data.detach().clone()
        p.requires_grad_(True)
    before = block_error(student, evaluation, torch.float32)
    if steps > 0 and before > 0:
        optimizer = torch.optim.AdamW(student.parameters(), lr=lr, weight_decay=0.0)
        scale = sum(float(y.double().pow(2).sum()) for _, _, y in data) / len(data)
        with torch.enable_grad():
            for step in range(steps):
                args, kwargs, target = data[step % len(data)]
                y = _call(student, args, kwargs, torch.float32)
                loss = (y - target.to(y.device, torch.float32)).pow(2).sum() / max(scale, 1e-30)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
    student.eval()
    for p in student.parameters():
        p.requires_grad_(False)
    after = block_error(student, evaluation, torch.float32) if steps > 0 and before > 0 else before
    return student.to(dtype), before, after


# long: the docstring documents the returned table; the loop is one group after another
def bld_sensitivity(
    model: torch.nn.Module,
    batches: Iterable[Any],
    layers: Sequence[LayerToPlan],
    *,
    steps: int = DEFAULT_STEPS,
    lr: float = DEFAULT_LR,
    progress: bool = True,
    max_logits: int = 1 << 24,
    max_tokens: int = 1 << 16,
) -> dict[str, Any]:
    """KL from the unpruned model (per token) of every candidate of every group, cut alone and recovered by
    blockwise local distillation (``steps`` AdamW steps at ``lr`` on the block's own output).

    Args:
        model, batches, layers: as :func:`~gdnprune.plan.measure.sensitivity.measured_sensitivity` (GDN layers and
            sub-blocks alike).
        steps: BLD steps per candidate (0: the measured sensitivity, one-shot).
        lr: AdamW learning rate of the BLD steps.
        progress: a tqdm bar over the candidates.
        max_logits: logits computed at a time (chunks of tokens).
        max_tokens: tokens per block call of the block errors (:func:`evaluation_batches`: the calibration
            batches joined; 0: batch by batch, the same numbers to float rounding, slower).

    Returns:
        ``measured_sensitivity``'s dict (``kl``, ``loss``, ``base_loss``, ``tokens``, ``forwards``,
        ``seconds``) with ``teacher_seconds`` (the teacher pass: one forward over the calibration batches)
        and ``bld``: ``{"steps", "lr", "error_one_shot": {prefix: [...]}, "error": {prefix: [...]}}``, the
        relative block output error of every candidate before and after (the one measured).
    """
    if steps < 0:
        raise ValueError(f"BLD steps must be 0 or more, got {steps}")
    start_time = time.perf_counter()
    forwards = Forwards(model, batches, max_logits=max_logits, shard=False)  # every rank: every batch
    config: Any = model.config  # a transformers config (nn.Module's stubs type attributes as Tensor | Module)
    text_config = config.get_text_config(decoder=True)
    index = [forwards.decoder_index(layer.module) for layer in layers]
    teacher_start = time.perf_counter()
    forwards.teacher(index)
    result: dict[str, Any] = {
        "kl": {},
        "loss": {},
        "base_loss": forwards.base_loss,
        "tokens": forwards.tokens,
        "teacher_seconds": time.perf_counter() - teacher_start,
        "bld": {"steps": int(steps), "lr": float(lr), "error_one_shot": {}, "error": {}},
    }
    bar = tqdm(
        total=sum(len(layer.candidates) for layer in layers), disable=not progress, desc="BLD", unit="cand"
    )
    try:
        for layer, i in zip(layers, index):
            mine = _layer_candidates(forwards, layer, i, text_config, (steps, lr, max_tokens), bar)
            table = gather_over_ranks(mine)
            values = [table[c] for c in range(len(layer.candidates))]
            result["kl"][layer.prefix] = [v[0] for v in values]
            result["loss"][layer.prefix] = [v[1] for v in values]
            result["bld"]["error_one_shot"][layer.prefix] = [v[2] for v in values]
            result["bld"]["error"][layer.prefix] = [v[3] for v in values]
    finally:
        bar.close()
    result["forwards"] = sum(len(layer.candidates) for layer in layers) * len(forwards.data)
    result["seconds"] = time.perf_counter() - start_time
    return result


def _layer_candidates(
    forwards: Forwards, layer: Any, i: int, text_config: Any, how: tuple[int, float, int], bar: Any
) -> dict[int, tuple[float, float, float, float]]:
    """This rank's share of one group's candidates: ``{candidate: (KL, loss, error one-shot, error)}``;
    ``how``: BLD steps, learning rate and tokens per evaluation call."""
    steps, lr, max_tokens = how
    state = sorted_state(layer)
    device = next(iter(state.values())).device
    data = block_inputs(forwards, layer.module)
    joined = evaluation_batches(data, max_tokens) if max_tokens > 0 else data
    dtype = next(layer.module.parameters()).dtype
    if len(joined) < len(data) and block_error(layer.module, joined, dtype) > 1e-4:
        joined = data  # the joined batches do not give the block's own outputs: evaluate batch by batch
    parent, attr = parent_and_name(forwards.decoder.layers[i], layer.module)
    mine: dict[int, tuple[float, float, float, float]] = {}
    with forwards.from_layer(i) as measure:
        try:
            for c in rank_share(len(layer.candidates)):
                # the sorted block: the same function, nothing to learn
                if layer.candidates[c] == layer.shape:
                    mine[c] = (0.0, forwards.base_loss, 0.0, 0.0)
                    bar.update(1)
                    continue
                cut = candidate_module(layer, state, layer.candidates[c], text_config, device)
                trained, before, after = distill_block(cut, data, steps=steps, lr=lr, evaluation=joined)
                chosen, error = (trained, after) if after <= before else (cut, before)
                setattr(parent, attr, chosen)
                kl, loss = measure()
                mine[c] = (kl, loss, before, error)
                bar.update(1)
        finally:
            setattr(parent, attr, layer.module)
    return mine
