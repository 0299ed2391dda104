"""Least-squares compensation: refit ``out_proj``'s kept columns so the cut layer reproduces the full output.

A GDN layer writes ``y = W o`` into the residual stream (``W`` = ``out_proj.weight`` [H, Hv*dv], ``o`` its
input after the gated RMSNorm). Cutting value heads or value channels keeps the columns ``K`` and drops
``R``. Instead of keeping ``W_K`` as is, choose ``W'`` to reconstruct the full output on calibration tokens,
with a ridge pull towards ``W_K``:

    min_W'  sum_t |W o_t - W' o_K,t|^2 + lam |W' - W_K|^2     =>     W' = W_K + W_R C_RK (C_KK + lam I)^-1

with ``C = sum_t o_t o_t^T`` (float64, collected on calibration tokens). ``W' = W_K`` is always a feasible
choice, so the reconstruction error on the calibration tokens never increases, and with nothing removed
(``R`` empty) ``W' = W_K`` exactly. It is exact for removed value heads and key groups (the kept heads'
``o`` does not change); for value-channel cuts it is an approximation (the gated RMSNorm renormalises the
kept channels). This is the closed-form compensation of FLAP / ZipLM / SlimGPT-style structured pruning.

Compensated outputs are no longer nested across targets: each target gets its own refit.

:func:`sequential_refit` is the cut-aware variant, for when the cut model is in memory: it refits the layers
in order on the cut model's own hidden states (earlier layers already refitted), against the full model's
residual stream, so it also sees the value-channel renormalisation, key-dim cuts and the error earlier
layers pass on (``prune --compensate sequential``).

The statistics file (``*.compensation.safetensors``, written by :func:`save_statistics`): per GDN layer,
``{prefix}.out_moment`` (``C``, float64 [Hv*dv, Hv*dv], in the layer's *unsorted* channel order) and
``{prefix}.tokens``; the metadata names the format and the model. Reading it needs no torch.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save
from tqdm.auto import tqdm

from ..model.geometry import GDNShape
from ..model.layouts import find_gdn_modules
from ..runtime.fileio import file_sha256, write_bytes_atomic

__all__ = [
    "STATS_FORMAT",
    "DEFAULT_RIDGE",
    "compensated_columns",
    "reconstruction_error",
    "collect_statistics",
    "sequential_refit",
    "REFERENCES",
    "save_statistics",
    "load_statistics",
    "model_identity",
    "statistics_model",
]

#: what :func:`sequential_refit` can reconstruct (see there)
REFERENCES = ("stream", "full", "cut")

STATS_FORMAT = "gdnprune-compensation"
#: ridge strength, relative to the mean diagonal of ``C_KK``
DEFAULT_RIDGE = 1e-3


def compensated_columns(
    weight: np.ndarray, moment: np.ndarray, kept: np.ndarray, *, ridge: float = DEFAULT_RIDGE
) -> np.ndarray:
    """``W'`` [H, |K|] (float64) for ``out_proj`` ``weight`` [H, V], input second moment ``moment`` [V, V] and
    the kept columns ``kept`` (indices into V, in their output order)."""
    weight = np.asarray(weight, dtype=np.float64)
    moment = np.asarray(moment, dtype=np.float64)
    kept = np.asarray(kept, dtype=np.int64)
    removed = np.setdiff1d(np.arange(weight.shape[1]), kept)
    base = weight[:, kept]
    if removed.size == 0:
        return base.copy()
    c_kk = moment[np.ix_(kept, kept)]
    lam = ridge * max(float(np.mean(np.diag(c_kk))), 1e-30)
    c_rk = moment[np.ix_(removed, kept)]
    # W_R C_RK (C_KK + lam I)^-1, through a solve on the symmetric positive definite system
    rhs = (weight[:, removed] @ c_rk).T  # [K, H]
    correction = np.linalg.solve(c_kk + lam * np.eye(kept.size), rhs).T
    return base + correction


def reconstruction_error(
    weight: np.ndarray, moment: np.ndarray, kept: np.ndarray, columns: np.ndarray
) -> float:
    """``sum_t |W o_t - W' o_K,t|^2`` from the second moment alone."""
    weight = np.asarray(weight, dtype=np.float64)
    columns = np.asarray(columns, dtype=np.float64)
    moment = np.asarray(moment, dtype=np.float64)
    full = np.einsum("hi,ij,hj->", weight, moment, weight)
    cross = np.einsum("hi,ik,hk->", weight, moment[:, kept], columns)
    own = np.einsum("hk,kl,hl->", columns, moment[np.ix_(kept, kept)], columns)
    return float(full - 2 * cross + own)


def collect_statistics(model: Any, batches: Iterable[Any], *, progress: bool = False) -> dict[str, dict]:
    """``{prefix: {"out_moment": C (float64 numpy), "tokens": n}}`` for every GDN layer of ``model``, from
    forward passes over calibration ``batches`` (hooks on the ``out_proj`` / ``o_proj`` input)."""
    import torch  # lazy: torch; checkpoint/ (torch-free) imports this module

    # lazy: torch; checkpoint/ (torch-free) imports this module
    from ..model.forwards import input_device, model_inputs, output_projection, unpack_batch

    stats: dict[str, dict] = {}
    handles = []
    current: dict[str, Any] = {"mask": None}

    def hook(prefix):
        def record(module, args):
            o = args[0].detach().reshape(-1, args[0].shape[-1])
            mask = current["mask"]
            if mask is not None:
                o = o[mask.to(o.device).reshape(-1)]
            o = o.to(torch.float64)
            entry = stats.setdefault(prefix, {"out_moment": 0, "tokens": 0})
            entry["out_moment"] = entry["out_moment"] + (o.T @ o).cpu()
            entry["tokens"] += int(o.shape[0])

        return record

    for prefix, module in find_gdn_modules(model):
        handles.append(output_projection(module).register_forward_pre_hook(hook(prefix)))
    device = input_device(model)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for batch in tqdm(
                list(batches), disable=not progress, desc="compensation statistics", unit="batch"
            ):
                ids, mask = unpack_batch(batch)
                current["mask"] = mask
                model(**model_inputs(ids, mask, device))
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    return {p: {"out_moment": v["out_moment"].numpy(), "tokens": v["tokens"]} for p, v in stats.items()}


def _tokens(x: Any, mask: Any, device: Any) -> Any:
    """``x`` [B, T, C] as float64 [tokens, C] on ``device``, the padding positions of ``mask`` dropped."""
    import torch  # lazy: torch; checkpoint/ (torch-free) imports this module

    x = x.detach().reshape(-1, x.shape[-1])
    if mask is not None:
        x = x[mask.to(x.device).reshape(-1)]
    return x.to(device=device, dtype=torch.float64)


def sequential_refit(
    model: Any,
    small: Any,
    batches: Iterable[Any],
    *,
    reference: str = "stream",
    ridge: float = DEFAULT_RIDGE,
    progress: bool = False,
) -> dict[str, dict]:
    """Refit the ``out_proj`` of the cut model ``small`` layer by layer, in place, against ``model``.

    ``small`` is ``model`` sorted and cut (:func:`gdnprune.io.loading.slice_model`; per-layer widths are fine).
    Going through the GDN layers in order, from the first one whose geometry differs, each layer's
    ``out_proj`` is refitted on the calibration ``batches`` *as the cut model computes them*, the earlier
    layers already cut and refitted (sequential layer-wise reconstruction, as in SparseGPT / SlimGPT). With
    ``o`` the cut layer's ``out_proj`` input on the cut model's hidden states and ``y`` the reference::

        min_W'  sum_t |y_t - W' o_t|^2 + lam |W' - W_K|^2   =>   W' = (C_yo + lam W_K) (C_oo + lam I)^-1

    (float64 moments; ``W_K`` the plain cut columns; ``lam`` = ``ridge`` times the mean diagonal of
    ``C_oo``). A batch mapping with a per-position weight (:data:`gdnprune.model.forwards.KL_WEIGHT`, as the
    recall windows carry) weights each token's squared error by it: ``sum_t w_t |y_t - W' o_t|^2``, so the
    refit reconstructs the positions the plan was measured on, as much as they counted there. ``reference``:

    * ``"stream"`` (default): what the full model's residual stream holds after the layer, ``y = W o_full
      + (x_full - x_cut)`` with ``x`` the decoder layer's input: the layer also takes back the error the
      earlier layers left in the stream (pre-norm residual blocks, ``x + GDN(norm(x))``, as in Qwen3.5,
      Qwen3-Next and OLMo-hybrid);
    * ``"full"``: the full model's layer output on its own hidden states, ``W o_full``;
    * ``"cut"``: the full layer's output on the cut model's hidden states.

    Unlike :func:`compensated_columns` this sees what the cut does to the kept channels (the gated RMSNorm
    renormalises over the value channels; a key-dim cut changes every output), and layers after a cut are
    refitted even when they keep their width. It needs both models in memory and one pass over the
    batches per refitted layer (stopped at that layer). ``W_K`` is feasible, so each layer's error on the
    inputs it sees never increases; nothing cut leaves the model as it is.

    Returns ``{prefix: {"columns": W' (float64 numpy [H, K]), "error_plain": ..., "error_refit": ...,
    "tokens": n}}`` for every refitted layer (the summed, weighted, squared errors of ``W_K`` and ``W'``).
    """
    import torch  # lazy: torch; checkpoint/ (torch-free) imports this module

    from ..model.forwards import unpack_batch, unpack_weight  # lazy: torch; checkpoint/ imports this module

    if reference not in REFERENCES:
        raise ValueError(f"unknown reference {reference!r}; expected one of {REFERENCES}")
    full_layers, cut_layers = find_gdn_modules(model), dict(find_gdn_modules(small))
    if [p for p, _ in full_layers] != list(cut_layers):
        raise ValueError("the cut model's GDN layers are not those of the full model")
    changed = [GDNShape.from_module(m) != GDNShape.from_module(cut_layers[p]) for p, m in full_layers]
    if not any(changed):
        return {}
    data = [(*unpack_batch(batch), unpack_weight(batch)) for batch in batches]
    result: dict[str, dict] = {}
    states = model.training, small.training
    model.eval()
    small.eval()
    try:
        with torch.no_grad():
            todo = full_layers[changed.index(True) :]
            for prefix, full in tqdm(todo, disable=not progress, desc="sequential refit", unit="layer"):
                models = (model, small)
                result[prefix] = _refit_layer(models, full, cut_layers[prefix], data, reference, ridge)
    finally:
        model.train(states[0])
        small.train(states[1])
    return result


def _refit_layer(
    models: tuple[Any, Any], full: Any, cut: Any, data: list, reference: str, ridge: float
) -> dict[str, Any]:
    """One step of :func:`sequential_refit`: the moments of ``cut``'s ``out_proj`` input against the
    reference on every batch, the ridge solve, the refitted weight copied into ``cut``; its result entry."""
    import torch  # lazy: torch; checkpoint/ (torch-free) imports this module

    # lazy: torch; checkpoint/ (torch-free) imports this module
    from ..model.forwards import layer_of, output_projection, record_input, run_model, run_with_hooks

    model, small = models
    weight = output_projection(full).weight.detach().to(torch.float64)
    plain = output_projection(cut).weight.detach().to(torch.float64)
    cross = torch.zeros_like(plain)
    auto = torch.zeros(plain.shape[1], plain.shape[1], dtype=torch.float64, device=plain.device)
    energy, tokens = 0.0, 0

    def full_on_cut_inputs(module, args, kwargs, seen):
        inner: dict = {}
        run_with_hooks(full, args, kwargs, [(output_projection(full), record_input(inner, "o", stop=True))])
        seen["o_full"] = inner["o"]

    for ids, mask, kl_weight in data:
        seen: dict = {}
        hooks = [(output_projection(cut), record_input(seen, "o", stop=True))]
        if reference == "cut":
            hooks.insert(0, (cut, lambda m, a, k, seen=seen: full_on_cut_inputs(m, a, k, seen)))
        else:
            teacher = [(output_projection(full), record_input(seen, "o_full", stop=True))]
            if reference == "stream":
                teacher.insert(0, (layer_of(model, full), record_input(seen, "x_full")))
                hooks.insert(0, (layer_of(small, cut), record_input(seen, "x_cut")))
            run_model(model, ids, mask, teacher)
        run_model(small, ids, mask, hooks)
        o = _tokens(seen["o"], mask, plain.device)
        y = _tokens(seen["o_full"], mask, weight.device) @ weight.T
        y = y.to(plain.device)
        if reference == "stream":
            y += _tokens(seen["x_full"], mask, plain.device) - _tokens(seen["x_cut"], mask, plain.device)
        w = (
            o.new_ones(o.shape[0])
            if kl_weight is None
            else _tokens(kl_weight[..., None], mask, o.device)[:, 0]
        )
        cross += (y * w[:, None]).T @ o
        auto += (o * w[:, None]).T @ o
        energy += float((w * (y * y).sum(1)).sum())
        tokens += int(o.shape[0])
    lam = ridge * max(float(torch.diagonal(auto).mean()), 1e-30)
    eye = torch.eye(auto.shape[0], dtype=torch.float64, device=auto.device)
    refit = torch.linalg.solve(auto + lam * eye, (cross + lam * plain).T).T

    def error(w):
        return energy - 2 * float((w * cross).sum()) + float(((w @ auto) * w).sum())

    output_projection(cut).weight.copy_(refit.to(output_projection(cut).weight.dtype))
    return {
        "columns": refit.cpu().numpy(),
        "error_plain": error(plain),
        "error_refit": error(refit),
        "tokens": tokens,
    }


def save_statistics(
    stats: Mapping[str, Mapping], path: str | os.PathLike, *, model: Mapping | None = None
) -> None:
    """Write :func:`collect_statistics`' result as safetensors (float64), atomically. ``model`` describes the
    model the statistics come from (see :func:`model_identity`)."""
    tensors = {}
    for prefix, entry in stats.items():
        tensors[f"{prefix}.out_moment"] = np.ascontiguousarray(entry["out_moment"], dtype=np.float64)
        tensors[f"{prefix}.tokens"] = np.asarray([entry["tokens"]], dtype=np.int64)
    write_bytes_atomic(path, save(tensors, metadata={"format": STATS_FORMAT, "model": json.dumps(model)}))


def model_identity(model_dir: str | os.PathLike) -> dict:
    """What identifies the weights of a model folder for its statistics: its config's hash and its gdnprune
    manifest's hash (a sorted output has the same config as its source, not the same manifest)."""
    return {
        "path": os.fspath(model_dir),
        "config_sha256": file_sha256(os.path.join(model_dir, "config.json")),
        "manifest_sha256": file_sha256(os.path.join(model_dir, "gdnprune.json")),
    }


def statistics_model(path: str | os.PathLike) -> dict | None:
    """The ``model`` description a statistics file records (None when it records none)."""
    with safe_open(os.fspath(path), framework="numpy") as f:
        return json.loads((f.metadata() or {}).get("model", "null"))


def load_statistics(path: str | os.PathLike) -> dict[str, dict]:
    """Read a statistics file; ``ValueError`` for anything that is not one."""
    try:
        with safe_open(os.fspath(path), framework="numpy") as f:
            metadata = f.metadata() or {}
            if metadata.get("format") != STATS_FORMAT:
                raise ValueError(
                    f"{path}: not a gdnprune compensation statistics file "
                    f"(format {metadata.get('format')!r}, expected {STATS_FORMAT!r})"
                )
            out: dict[str, dict] = {}
            for key in f.keys():
                prefix, _, name = key.rpartition(".")
                value = f.get_tensor(key)
                out.setdefault(prefix, {})[name] = int(value[0]) if name == "tokens" else value
    except OSError as exc:
        raise ValueError(f"{path}: cannot read compensation statistics ({exc})") from None
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types for corrupt files
        if isinstance(exc, ValueError):
            raise
        raise ValueError(f"{path}: not a valid safetensors file ({exc})") from None
    for prefix, entry in out.items():
        moment = entry.get("out_moment")
        if moment is None or moment.ndim != 2 or moment.shape[0] != moment.shape[1] or "tokens" not in entry:
            raise ValueError(f"{path}: layer {prefix!r} lacks a square out_moment and a token count")
    return out
