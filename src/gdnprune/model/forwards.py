"""Running models: the one place that feeds batches to a model, finds its layers and stops or replays forwards.

Scoring, plan sensitivity, the lane search and compensation all run calibration batches through a
transformers model and look inside it; this module is what they share:

* batches: :func:`unpack_batch` (``input_ids`` and an optional ``attention_mask`` from a tensor or a
  mapping), :func:`unpack_weight` (an optional per-position weight of the KL, :data:`KL_WEIGHT`),
  :func:`input_device` (where the ids go, also when accelerate offloaded the embedding to
  ``meta``), :func:`model_inputs` (the keyword arguments of one forward);
* where things are: :func:`decoder_layers` (the decoder's layer list), :func:`final_norm` (the norm
  before the LM head), :func:`layer_index` /
  :func:`layer_of` (the decoder layer that holds a sub-module: a GDN module, an attention or MLP module, an
  expert), :func:`parent_and_name` (where to swap a sub-module), :func:`output_projection` (the linear that
  writes a sub-block's output into the residual stream);
* the hidden-state argument of a layer call: :func:`hidden_argument`, :func:`with_hidden`;
* stopping a forward: :class:`Stop`, :func:`record_input` (a pre-hook that keeps a module's input and may
  stop the pass), :func:`run_with_hooks` (any module), :func:`run_model` (a model on one batch);
* :class:`Forwards`: one teacher pass that keeps the inputs of chosen layers, then runs from any of them
  with the layers before it passed through, and compares with the teacher (KL and loss per token). Plan
  sensitivity and the lane search run on it.

Nothing here knows GDN geometry: a "module" is any sub-module of a decoder layer. ("Layer" here is always a
decoder layer, ``model.layers.N``; the old names ``decoder_blocks``, ``block_index``, ``block_of`` remain as
aliases for one release, with a ``FutureWarning``.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from ..runtime import distributed
from ..runtime.deprecation import renamed_function

__all__ = [
    "unpack_batch",
    "unpack_batches",
    "unpack_weight",
    "KL_WEIGHT",
    "input_device",
    "model_inputs",
    "decoder_layers",
    "final_norm",
    "layer_index",
    "layer_of",
    "decoder_blocks",
    "block_index",
    "block_of",
    "parent_and_name",
    "output_projection",
    "OUTPUT_PROJECTIONS",
    "hidden_argument",
    "with_hidden",
    "Stop",
    "record_input",
    "run_with_hooks",
    "run_model",
    "Passthrough",
    "Forwards",
]

#: names of the linear that writes a sub-block's output into the residual stream, tried in this order
#: (GDN ``out_proj``, attention ``o_proj``, MLP and expert ``down_proj``)
OUTPUT_PROJECTIONS = ("out_proj", "o_proj", "down_proj")


def unpack_batch(batch: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``input_ids`` [B, T] (int64) and an optional boolean ``attention_mask`` [B, T] (None when every token
    counts) from an ids tensor (or [T]) or a mapping with ``input_ids`` and ``attention_mask``."""
    if isinstance(batch, Mapping):
        ids, mask = batch.get("input_ids"), batch.get("attention_mask")
    else:
        ids, mask = batch, None
    ids = torch.as_tensor(ids)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"a calibration batch must be integer input_ids [B, T], got {ids.dtype} {list(ids.shape)}"
        )
    if mask is not None:
        mask = torch.as_tensor(mask).reshape(ids.shape).bool()
        if bool(mask.all()):
            mask = None
    return ids.long(), mask


def unpack_batches(batches: Iterable[Any]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """:func:`unpack_batch` of every batch."""
    return [unpack_batch(batch) for batch in batches]


#: the key of a batch mapping that weights the KL per position: [B, T] non-negative floats, the weight of the
#: KL of the next-token distribution at each position (default 1 everywhere): the KL of a batch is then
#: ``sum(w * KL) / sum(w)`` over its valid positions, and the KL of several batches sums both over them
KL_WEIGHT = "kl_weight"


def unpack_weight(batch: Any) -> torch.Tensor | None:
    """The per-position KL weight of a batch (:data:`KL_WEIGHT`, float64 [B, T]), or None (every position 1)."""
    if not isinstance(batch, Mapping) or batch.get(KL_WEIGHT) is None:
        return None
    ids, _ = unpack_batch(batch)
    weight = torch.as_tensor(batch[KL_WEIGHT], dtype=torch.float64)
    if weight.shape != ids.shape or not bool((weight >= 0).all()):
        raise ValueError(
            f"{KL_WEIGHT}: expected non-negative weights of the input_ids' shape {list(ids.shape)}, got "
            f"{list(weight.shape)}" + ("" if weight.shape != ids.shape else " with a negative one")
        )
    return weight


def input_device(model: Any) -> torch.device:
    """The device the input ids go to: the input embedding's, or its accelerate execution device when a
    device map offloaded the embedding's weights (to ``meta``, with the weights on CPU or disk); a model
    without an input embedding takes its first parameter's device."""
    try:
        embedding = model.get_input_embeddings()
        device = embedding.weight.device
    except (AttributeError, NotImplementedError):
        embedding, device = None, next(model.parameters()).device
    if device.type == "meta":
        execution = getattr(getattr(embedding, "_hf_hook", None), "execution_device", None)
        device = torch.device("cpu" if execution is None else execution)
    return device


def model_inputs(ids: torch.Tensor, mask: torch.Tensor | None, device: torch.device) -> dict[str, Any]:
    """The keyword arguments of one forward on a batch: the ids (and the mask, when there is one) on
    ``device``, no cache."""
    kwargs: dict[str, Any] = {"input_ids": ids.to(device), "use_cache": False}
    if mask is not None:
        kwargs["attention_mask"] = mask.to(device).long()
    return kwargs


def decoder_layers(model: Any) -> torch.nn.ModuleList:
    """The decoder's layers (``model.get_decoder().layers``), in order."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is None or not hasattr(decoder, "layers"):
        raise ValueError(
            f"{type(model).__name__}: expected a decoder with .layers (model.get_decoder().layers)"
        )
    return decoder.layers


def final_norm(model: Any) -> torch.nn.Module | None:
    """The decoder's final norm, before the LM head: ``norm`` of the decoder (``model.model.norm``;
    ``model.model.language_model.norm`` for the vision-language models, found through ``get_decoder()``);
    None when there is none."""
    for get in (lambda: model.get_decoder(), lambda: model.model, lambda: model.model.language_model):
        try:
            decoder = get()
        except (AttributeError, NotImplementedError, TypeError):
            continue
        norm = getattr(decoder, "norm", None)
        if decoder is not None and isinstance(norm, torch.nn.Module):
            return norm
    return None


def layer_index(layers: Iterable[torch.nn.Module], module: torch.nn.Module) -> int:
    """The index of the decoder layer among ``layers`` that holds ``module`` (or is it)."""
    for i, layer in enumerate(layers):
        if any(sub is module for sub in layer.modules()):
            return i
    raise ValueError(f"the {type(module).__name__} module is not inside one of the decoder's layers")


def layer_of(model: torch.nn.Module, module: torch.nn.Module) -> torch.nn.Module:
    """The decoder layer of ``model`` that holds ``module``."""
    layers = decoder_layers(model)
    return layers[layer_index(layers, module)]


# the old names (a decoder layer was called a "block" here), kept for one release with a warning
decoder_blocks = renamed_function("decoder_blocks", decoder_layers)
block_index = renamed_function("block_index", layer_index)
block_of = renamed_function("block_of", layer_of)


def parent_and_name(root: torch.nn.Module, module: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """``(parent, attribute)`` such that ``getattr(parent, attribute) is module`` inside ``root``: where to
    put a replacement."""
    for name, sub in root.named_modules():
        if sub is module and name:
            parent, _, attribute = name.rpartition(".")
            return (root.get_submodule(parent) if parent else root), attribute
    raise ValueError(f"the {type(module).__name__} module is not inside its {type(root).__name__}")


def output_projection(module: torch.nn.Module) -> Any:
    """The linear of ``module`` that writes its output into the residual stream (its input is the
    sub-block's per-head output): the first of :data:`OUTPUT_PROJECTIONS` it has."""
    for name in OUTPUT_PROJECTIONS:
        found = getattr(module, name, None)
        if found is not None:
            return found
    raise ValueError(
        f"{type(module).__name__} has no output projection (expected one of {list(OUTPUT_PROJECTIONS)})"
    )


def hidden_argument(args: tuple, kwargs: Mapping[str, Any]) -> torch.Tensor:
    """The hidden states a layer (or sub-block) is called with: the first positional argument, else
    ``hidden_states``."""
    return args[0] if args else kwargs["hidden_states"]


def with_hidden(args: tuple, kwargs: dict, hidden: torch.Tensor) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of a layer call with the hidden states replaced by ``hidden``."""
    if args:
        return (hidden, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}


class Stop(Exception):
    """Raised by a hook to end a forward pass once what it wanted was seen (:func:`run_with_hooks`)."""


def record_input(seen: dict, key: str, *, stop: bool = False) -> Callable:
    """A forward pre-hook (``with_kwargs=True``) that keeps its module's hidden-state input under
    ``seen[key]``; ``stop`` then ends the pass."""

    def hook(module, args, kwargs):
        seen[key] = hidden_argument(args, kwargs)
        if stop:
            raise Stop

    return hook


def run_with_hooks(module: torch.nn.Module, args: tuple, kwargs: dict, hooks: Iterable[tuple]) -> None:
    """``module(*args, **kwargs)`` with the forward pre-hooks ``[(sub-module, hook)]`` (``with_kwargs=True``),
    until a hook raises :class:`Stop`; the hooks are removed afterwards."""
    handles = [sub.register_forward_pre_hook(fn, with_kwargs=True) for sub, fn in hooks]
    try:
        module(*args, **kwargs)
    except Stop:
        pass
    finally:
        for handle in handles:
            handle.remove()


def run_model(
    model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor | None, hooks: Iterable[tuple]
) -> None:
    """One forward of ``model`` on a batch (on :func:`input_device`) with the pre-hooks ``[(sub-module,
    hook)]``, until a hook stops it."""
    run_with_hooks(model, (), model_inputs(ids, mask, input_device(model)), hooks)


class Passthrough(torch.nn.Module):
    """Stands in for a decoder layer: hands its hidden-state input on unchanged."""

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return hidden_argument(args, kwargs)


def _decoder_and_head(model: Any) -> tuple[Any, Any]:
    decoder = model.get_decoder()
    head = model.get_output_embeddings()
    if decoder is None or head is None or not hasattr(decoder, "layers"):
        raise ValueError(
            f"{type(model).__name__}: measured sensitivity needs a decoder with .layers and an "
            f"lm_head; use the proxy sensitivity"
        )
    return decoder, head


def _divergence(
    head: Any,
    student: torch.Tensor,
    teacher: torch.Tensor,
    ids: torch.Tensor,
    mask: torch.Tensor | None,
    max_logits: int,
    weight: torch.Tensor | None = None,
) -> tuple[float, float, float, int]:
    """Summed KL(teacher || student) over tokens (each times its ``weight``, default 1), summed next-token
    loss, and their counts (the summed weights of the valid positions; the tokens with a next token)."""
    hidden = student.shape[-1]
    student, teacher = student.reshape(-1, hidden), teacher.reshape(-1, hidden)
    targets = torch.full_like(ids, -100)
    targets[:, :-1] = ids[:, 1:]
    valid = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    if mask is not None:
        targets[:, :-1][~(valid[:, :-1] & valid[:, 1:])] = -100
    targets, valid = targets.reshape(-1), valid.reshape(-1)
    scale = (
        valid.double() if weight is None else weight.reshape(-1).double() * valid.double()
    )  # the KL's weight per position
    chunk = max(1, max_logits // max(1, head.weight.shape[0]))
    kl = ce = 0.0
    for start in range(0, student.shape[0], chunk):
        rows = slice(start, start + chunk)
        log_s = head(student[rows]).float().log_softmax(-1)
        log_t = head(teacher[rows].to(student.device)).float().log_softmax(-1)
        w = scale[rows].to(log_s.device)
        kl += float(((log_t.exp() * (log_t - log_s)).sum(-1).double() * w)[w > 0].sum())
        ce += float(F.nll_loss(log_s, targets[rows].to(log_s.device), reduction="sum", ignore_index=-100))
    return kl, ce, float(scale.sum()), int((targets != -100).sum())


class Measure(Protocol):
    """What :meth:`Forwards.from_layer` yields: ``measure()`` (every batch) or ``measure(indices)`` (those
    batches) -> ``(KL per token, loss per token)``."""

    def __call__(self, batches: Sequence[int] | None = None) -> tuple[float, float]: ...


class Forwards:
    """Forward passes that share one teacher pass: the machinery behind every measured sensitivity.

    :meth:`teacher` runs the calibration batches once and keeps, per batch, the input of the chosen decoder
    layers and the final hidden state; :meth:`from_layer` then runs a batch from decoder layer ``i``'s kept
    input (the layers before it are passed through), so that a change to layer ``i`` (a swapped module, a
    hook) costs only the layers from ``i`` on; the result is compared with the teacher's final hidden state
    (KL and next-token loss per token). :meth:`layer_inputs` recomputes a kept input with the model as it is
    now. The model is left as it was.

    Under ``torchrun`` / ``accelerate launch`` (a process group of several ranks, :mod:`gdnprune.runtime.distributed`)
    every rank takes its share of the batches and the sums behind every KL and loss are added over the
    ranks, so every rank gets the same numbers as one process would.

    A batch mapping may weight the KL per position (:data:`KL_WEIGHT`): the KL of every measure is then the
    weighted mean over the batches' positions (the loss stays the plain mean per token).

    Attributes: ``model``, ``decoder``, ``head`` (``lm_head``), ``device`` (of the input ids), ``data`` (this
    rank's ``(ids, mask)`` batches), ``weights`` (their KL weights, None where every position weighs 1), ``base_loss`` (the teacher's loss per token, after :meth:`teacher`),
    ``forwards`` (batches run by :meth:`from_layer` so far), ``tokens``.
    """

    def __init__(
        self, model: torch.nn.Module, batches: Iterable[Any], *, max_logits: int = 1 << 24, shard: bool = True
    ):
        self.model = model.eval()
        self.decoder, self.head = _decoder_and_head(model)
        self.device = input_device(model)
        given = list(batches)
        data = unpack_batches(given)
        weights = [unpack_weight(batch) for batch in given]
        if not data:
            raise ValueError("a measured sensitivity needs at least one calibration batch")
        self.several = shard and distributed.is_distributed()  # shard=False: every rank holds every batch
        if self.several:
            mine = distributed.shard_indices(len(data), distributed.rank(), distributed.world_size())
            data, weights = [data[i] for i in mine], [weights[i] for i in mine]
        self.data = data
        self.weights = weights
        self.max_logits = max_logits
        self.captured: list[dict[int, torch.Tensor]] = []
        self.finals: list[torch.Tensor] = []
        self.base_loss = float("nan")
        self.forwards = 0
        self._tokens = 0

    def total(self, *values: float) -> list[float]:
        """``values`` summed over the ranks (as they are with one process)."""
        if not self.several:
            return list(values)
        total = torch.tensor(values, dtype=torch.float64)
        distributed.all_reduce_sum([total])
        return total.tolist()

    @contextlib.contextmanager
    def _together(self) -> Iterator[None]:
        """A code block that may fail on one rank only: all ranks raise together (then a sum may follow)."""
        if not self.several:
            yield
            return
        with distributed.fail_together():
            yield

    def decoder_index(self, module: torch.nn.Module) -> int:
        """The index of the decoder layer that holds ``module``."""
        return layer_index(self.decoder.layers, module)

    def _kwargs(self, mask: torch.Tensor | None) -> dict:
        return {
            "use_cache": False,
            **({} if mask is None else {"attention_mask": mask.to(self.device).long()}),
        }

    @torch.no_grad()
    def teacher(self, layer_indices: Iterable[int]) -> None:
        """The teacher pass: keep the input of decoder layers ``layer_indices`` and the final hidden state."""
        self.captured, self.finals = [], []

        def capture(i):
            def hook(module, args, kwargs):
                self.captured[-1][i] = hidden_argument(args, kwargs).detach().cpu()

            return hook

        ce = n = 0.0
        with self._together():
            if self.data:
                probe = self.data[0][0][:1, :16].to(self.device)
                logits = self.model(input_ids=probe, use_cache=False).logits.float()
                direct = self.head(self.decoder(input_ids=probe, use_cache=False).last_hidden_state).float()
                if (direct - logits).abs().max() > 1e-3 * (1 + logits.abs().max()):
                    raise ValueError(
                        f"{type(self.model).__name__}: its logits are not lm_head(last hidden state), "
                        f"which a measured sensitivity needs; use the proxy sensitivity"
                    )
            handles = [
                self.decoder.layers[i].register_forward_pre_hook(capture(i), with_kwargs=True)
                for i in sorted(set(layer_indices))
            ]
            try:
                for ids, mask in self.data:
                    self.captured.append({})
                    final = self.decoder(
                        input_ids=ids.to(self.device), **self._kwargs(mask)
                    ).last_hidden_state
                    self.finals.append(final.detach().cpu())
                    _, c, _, k = _divergence(self.head, final, final, ids, mask, self.max_logits)
                    ce, n = ce + c, n + k
            finally:
                for handle in handles:
                    handle.remove()
        ce, n, tokens = self.total(ce, n, sum(int(f.shape[0] * f.shape[1]) for f in self.finals))
        self._tokens = int(tokens)
        self.base_loss = ce / max(n, 1)

    @contextlib.contextmanager
    def from_layer(self, index: int) -> Iterator[Measure]:
        """Within the ``with`` statement, a call ``measure()`` runs every batch (``measure(indices)``: those batches) from
        decoder layer ``index``'s kept input and returns ``(KL per token, loss per token)`` against the teacher."""
        current = {"k": 0}

        def inject(module, args, kwargs):
            cached = self.captured[current["k"]][index]
            return with_hidden(args, kwargs, cached.to(hidden_argument(args, kwargs).device))

        originals = [self.decoder.layers[j] for j in range(index)]
        handle = self.decoder.layers[index].register_forward_pre_hook(inject, with_kwargs=True)
        for j in range(index):
            self.decoder.layers[j] = Passthrough()

        @torch.inference_mode()
        def measure(batches: Sequence[int] | None = None) -> tuple[float, float]:
            kl = ce = 0.0
            n_kl = n_ce = 0.0
            with self._together():
                for k in range(len(self.data)) if batches is None else batches:
                    ids, mask = self.data[k]
                    current["k"] = k
                    out = self.decoder(input_ids=ids.to(self.device), **self._kwargs(mask)).last_hidden_state
                    a, b, c, d = _divergence(
                        self.head, out, self.finals[k], ids, mask, self.max_logits, self.weights[k]
                    )
                    kl, ce, n_kl, n_ce = kl + a, ce + b, n_kl + c, n_ce + d
                    self.forwards += 1
            kl, ce, n_kl, n_ce = self.total(kl, ce, n_kl, n_ce)
            return (kl / n_kl if n_kl > 0 else 0.0), ce / max(n_ce, 1)

        try:
            yield measure
        finally:
            for j, original in enumerate(originals):
                self.decoder.layers[j] = original
            handle.remove()

    @torch.no_grad()
    def layer_call(self, index: int, k: int) -> tuple[tuple, dict]:
        """The arguments decoder layer ``index`` is called with on batch ``k`` (its kept input as the hidden
        states, the position embeddings and mask the model computes for the batch): the layer, or a variant of
        it, called with them gives its output without running the model around it."""
        seen: dict = {}
        ids, mask = self.data[k]
        cached = self.captured[k][index]

        def record(module, args, kwargs):
            seen["call"] = with_hidden(args, kwargs, cached.to(hidden_argument(args, kwargs).device))
            raise Stop

        originals = [self.decoder.layers[j] for j in range(index)]
        for j in range(index):
            self.decoder.layers[j] = Passthrough()
        try:
            run_with_hooks(
                self.decoder,
                (),
                {"input_ids": ids.to(self.device), **self._kwargs(mask)},
                [(self.decoder.layers[index], record)],
            )
        finally:
            for j, original in enumerate(originals):
                self.decoder.layers[j] = original
        return seen["call"]

    @torch.inference_mode()
    def from_hidden(self, index: int, k: int, hidden: torch.Tensor) -> list[tuple[float, float, float, int]]:
        """Batch ``k`` run from decoder layer ``index`` with input ``hidden``: the batch's hidden states of several
        variants stacked along the batch (``copies x batch`` rows; every layer from ``index`` on runs once for
        all of them). Returns per copy the summed KL against the teacher, the summed loss and their token
        counts (added over the ranks by the caller, as :meth:`from_layer`'s sums are); counts as ``copies``
        forwards."""
        ids, mask = self.data[k]
        copies = hidden.shape[0] // ids.shape[0]
        repeated = ids.repeat(copies, 1)
        masks = None if mask is None else mask.repeat(copies, 1)

        def inject(module, args, kwargs):
            return with_hidden(args, kwargs, hidden.to(hidden_argument(args, kwargs).device))

        originals = [self.decoder.layers[j] for j in range(index)]
        handle = self.decoder.layers[index].register_forward_pre_hook(inject, with_kwargs=True)
        for j in range(index):
            self.decoder.layers[j] = Passthrough()
        try:
            out = self.decoder(input_ids=repeated.to(self.device), **self._kwargs(masks)).last_hidden_state
        finally:
            for j, original in enumerate(originals):
                self.decoder.layers[j] = original
            handle.remove()
        self.forwards += copies
        return [
            _divergence(self.head, part, self.finals[k], ids, mask, self.max_logits, self.weights[k])
            for part in out.chunk(copies)
        ]

    @torch.no_grad()
    def layer_inputs(self, index: int) -> None:
        """Recompute the kept input of decoder layer ``index`` with the model as it is now (e.g. with other
        layers cut by hooks), replacing the teacher's."""
        for k, (ids, mask) in enumerate(self.data):
            seen: dict = {}
            run_with_hooks(
                self.decoder,
                (),
                {"input_ids": ids.to(self.device), **self._kwargs(mask)},
                [(self.decoder.layers[index], record_input(seen, "hidden", stop=True))],
            )
            self.captured[k][index] = seen["hidden"].detach().cpu()

    @property
    def tokens(self) -> int:
        """Calibration tokens of the teacher pass (over all ranks)."""
        return int(self._tokens)
