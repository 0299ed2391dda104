"""Per-layer sensitivity of every candidate: measured with real forwards, or a proxy from the scores.

**Measured** (Puzzle's replace-one-block scoring): cut one layer of the sorted model to a candidate, keep
every other layer intact, and measure the next-token KL divergence ``KL(teacher || cut)`` from the unpruned
model, per token, on calibration windows (and the cut model's next-token loss). The work is shared:

* one teacher pass per batch keeps, for every GDN layer, the hidden state that enters its decoder layer,
  and the final hidden state (after the final norm); teacher log-probabilities are recomputed from it with
  ``lm_head``, a chunk of tokens at a time, so memory never holds tokens x vocabulary;
* a candidate of layer ``i`` runs from layer ``i``'s cached input: the decoder layers before it are swapped
  for a pass-through, a pre-hook hands layer ``i`` its cached input, and the model's own forward does the
  rest (masks, rotary embeddings, the later layers). The candidate GDN module is built from that layer's
  config with the candidate geometry and the sorted weights cut to it — the module a sliced checkpoint
  will load — so the measurement is of the real cut, eps and scale changes included.

**Proxy** (no forward): the output energy a cut removes, from the scores file's raw per-element scores —
key groups' energy times the kept share of their lanes, key channels and value channels.
"""

from __future__ import annotations

import contextlib
import copy
import time
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..geometry import GDNShape, orders_from_payload

__all__ = ["LayerToPlan", "Forwards", "measured_sensitivity", "proxy_sensitivity"]


class LayerToPlan:
    """One GDN layer of a loaded model to plan: its module, name, orders and candidate geometries."""

    def __init__(self, prefix: str, module: torch.nn.Module, orders: Mapping[str, np.ndarray] | None,
                 candidates: Sequence[GDNShape]):
        self.prefix, self.module, self.orders, self.candidates = prefix, module, orders, list(candidates)
        self.shape = GDNShape.from_module(module)


class _Passthrough(torch.nn.Module):
    """Stands in for a decoder layer before the one measured: hands its input on unchanged."""

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return args[0] if args else kwargs["hidden_states"]


def _hidden_argument(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


def _with_hidden(args: tuple, kwargs: dict, hidden: torch.Tensor) -> tuple[tuple, dict]:
    if args:
        return (hidden, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}


def _parts(model: torch.nn.Module):
    decoder = model.get_decoder()
    head = model.get_output_embeddings()
    if decoder is None or head is None or not hasattr(decoder, "layers"):
        raise ValueError(f"{type(model).__name__}: measured sensitivity needs a decoder with .layers and an "
                         f"lm_head; use the proxy sensitivity")
    return decoder, head


def _input_device(model: torch.nn.Module) -> torch.device:
    embeddings = model.get_input_embeddings()
    device = embeddings.weight.device
    hook = getattr(embeddings, "_hf_hook", None)
    if device.type == "meta" and hook is not None:
        device = torch.device(getattr(hook, "execution_device", "cpu"))
    return device


def _sorted_state(layer: LayerToPlan) -> dict[str, torch.Tensor]:
    """The layer's weights (materialised if offloaded), permuted by its orders (a function-preserving sort)."""
    from ..gated_delta_net import GDNPermutation, permute_gated_delta_net_state_dict
    from ..scoring.hooks import materialized_weight

    state = {}
    for name, _ in layer.module.named_parameters():
        owner, _, leaf = name.rpartition(".")
        state[f"layer.{name}"] = materialized_weight(layer.module.get_submodule(owner) if owner else layer.module,
                                                     leaf).detach()
    if layer.orders is not None:
        permutation = GDNPermutation(**{k: torch.as_tensor(v) for k, v in layer.orders.items()})
        permute_gated_delta_net_state_dict(state, prefix="layer", shape=layer.shape, permutation=permutation)
    return state


def _candidate_module(layer: LayerToPlan, state: Mapping[str, torch.Tensor], target: GDNShape,
                      text_config: Any, device: torch.device) -> torch.nn.Module:
    """The GDN module of ``layer`` cut to ``target``: built from the layer's config with that geometry."""
    from ..gated_delta_net import slice_gated_delta_net_state_dict

    index = layer.module.layer_idx
    config = text_config.per_layer_config[index] if getattr(text_config, "is_heterogeneous", False) else \
        copy.copy(text_config)
    for key, value in target.config_updates().items():
        setattr(config, key, value)
    cut = dict(state)
    slice_gated_delta_net_state_dict(cut, prefix="layer", shape=layer.shape, target=target)
    with torch.device("meta"):
        module = type(layer.module)(config, index)
    module.load_state_dict({k[len("layer."):]: v.to(device) for k, v in cut.items()}, strict=True, assign=True)
    return module.eval()


def _divergence(head: torch.nn.Module, student: torch.Tensor, teacher: torch.Tensor, ids: torch.Tensor,
                mask: torch.Tensor | None, max_logits: int) -> tuple[float, float, int, int]:
    """Summed KL(teacher || student) over tokens, summed next-token loss, and their token counts."""
    hidden = student.shape[-1]
    student, teacher = student.reshape(-1, hidden), teacher.reshape(-1, hidden)
    targets = torch.full_like(ids, -100)
    targets[:, :-1] = ids[:, 1:]
    valid = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    if mask is not None:
        targets[:, :-1][~(valid[:, :-1] & valid[:, 1:])] = -100
    targets, valid = targets.reshape(-1), valid.reshape(-1)
    chunk = max(1, max_logits // max(1, head.weight.shape[0]))
    kl = ce = 0.0
    for start in range(0, student.shape[0], chunk):
        rows = slice(start, start + chunk)
        log_s = head(student[rows]).float().log_softmax(-1)
        log_t = head(teacher[rows].to(student.device)).float().log_softmax(-1)
        keep = valid[rows].to(log_s.device)
        kl += float((log_t.exp() * (log_t - log_s)).sum(-1)[keep].sum())
        ce += float(F.nll_loss(log_s, targets[rows].to(log_s.device), reduction="sum", ignore_index=-100))
    return kl, ce, int(valid.sum()), int((targets != -100).sum())


def _batches(batches: Iterable[Any]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    from ..scoring.api import _unpack_batch

    return [_unpack_batch(batch) for batch in batches]


class Forwards:
    """Forward passes that share one teacher pass: the machinery behind every measured sensitivity.

    :meth:`teacher` runs the calibration batches once and keeps, per batch, the input of the chosen decoder
    layers and the final hidden state; :meth:`from_layer` then runs a batch from decoder layer ``i``'s kept
    input (the layers before it are passed through), so that a change to layer ``i`` (a swapped module, a
    hook) costs only the layers from ``i`` on; :meth:`divergence` compares a final hidden state with the
    teacher's. The model is left as it was.

    Under ``torchrun`` / ``accelerate launch`` (a process group of several ranks, :mod:`gdnprune.distributed`)
    every rank takes its share of the batches and the sums behind every KL and loss are added over the
    ranks, so every rank gets the same numbers as one process would.
    """

    def __init__(self, model: torch.nn.Module, batches: Iterable[Any], *, max_logits: int = 1 << 24,
                 shard: bool = True):
        from .. import distributed

        self.model = model.eval()
        self.decoder, self.head = _parts(model)
        self.device = _input_device(model)
        data = _batches(batches)
        if not data:
            raise ValueError("a measured sensitivity needs at least one calibration batch")
        self.several = shard and distributed.is_distributed()  # shard=False: every rank holds every batch
        if self.several:
            data = [data[i] for i in distributed.shard_indices(len(data), distributed.rank(), distributed.world_size())]
        self.data = data
        self.max_logits = max_logits
        self.captured: list[dict[int, torch.Tensor]] = []
        self.finals: list[torch.Tensor] = []
        self.base_loss = float("nan")
        self.forwards = 0
        self._tokens = 0

    def _total(self, *values: float) -> list[float]:
        """``values`` summed over the ranks (as they are with one process)."""
        if not self.several:
            return list(values)
        from .. import distributed

        total = torch.tensor(values, dtype=torch.float64)
        distributed.all_reduce_sum([total])
        return total.tolist()

    @contextlib.contextmanager
    def _together(self) -> Iterator[None]:
        """A block that may fail on one rank only: all ranks raise together (then a sum may follow)."""
        if not self.several:
            yield
            return
        from .. import distributed

        with distributed.fail_together():
            yield

    def decoder_index(self, module: torch.nn.Module) -> int:
        """The index of the decoder layer that holds ``module``."""
        for i, block in enumerate(self.decoder.layers):
            if any(sub is module for sub in block.modules()):
                return i
        raise ValueError("the GDN layer is not inside one of the decoder's layers")

    def _kwargs(self, mask: torch.Tensor | None) -> dict:
        return {"use_cache": False, **({} if mask is None else {"attention_mask": mask.to(self.device).long()})}

    @torch.no_grad()
    def teacher(self, layer_indices: Iterable[int]) -> None:
        """The teacher pass: keep the input of decoder layers ``layer_indices`` and the final hidden state."""
        self.captured, self.finals = [], []

        def capture(i):
            def hook(module, args, kwargs):
                self.captured[-1][i] = _hidden_argument(args, kwargs).detach().cpu()
            return hook

        ce = n = 0.0
        with self._together():
            if self.data:
                probe = self.data[0][0][:1, :16].to(self.device)
                logits = self.model(input_ids=probe, use_cache=False).logits.float()
                direct = self.head(self.decoder(input_ids=probe, use_cache=False).last_hidden_state).float()
                if (direct - logits).abs().max() > 1e-3 * (1 + logits.abs().max()):
                    raise ValueError(f"{type(self.model).__name__}: its logits are not lm_head(last hidden state), "
                                     f"which a measured sensitivity needs; use the proxy sensitivity")
            handles = [self.decoder.layers[i].register_forward_pre_hook(capture(i), with_kwargs=True)
                       for i in sorted(set(layer_indices))]
            try:
                for ids, mask in self.data:
                    self.captured.append({})
                    final = self.decoder(input_ids=ids.to(self.device), **self._kwargs(mask)).last_hidden_state
                    self.finals.append(final.detach().cpu())
                    _, c, _, k = _divergence(self.head, final, final, ids, mask, self.max_logits)
                    ce, n = ce + c, n + k
            finally:
                for handle in handles:
                    handle.remove()
        ce, n, self._tokens = self._total(ce, n, sum(int(f.shape[0] * f.shape[1]) for f in self.finals))
        self.base_loss = ce / max(n, 1)

    @contextlib.contextmanager
    def from_layer(self, index: int) -> Iterator[Callable[[], tuple[float, float]]]:
        """Within the block, a call ``measure()`` runs every batch (``measure(indices)``: those batches) from
        decoder layer ``index``'s kept input and returns ``(KL per token, loss per token)`` against the teacher."""
        current = {"k": 0}

        def inject(module, args, kwargs):
            cached = self.captured[current["k"]][index]
            return _with_hidden(args, kwargs, cached.to(_hidden_argument(args, kwargs).device))

        originals = [self.decoder.layers[j] for j in range(index)]
        handle = self.decoder.layers[index].register_forward_pre_hook(inject, with_kwargs=True)
        for j in range(index):
            self.decoder.layers[j] = _Passthrough()

        @torch.no_grad()
        def measure(batches: Sequence[int] | None = None) -> tuple[float, float]:
            kl = ce = 0.0
            n_kl = n_ce = 0
            with self._together():
                for k in range(len(self.data)) if batches is None else batches:
                    ids, mask = self.data[k]
                    current["k"] = k
                    out = self.decoder(input_ids=ids.to(self.device), **self._kwargs(mask)).last_hidden_state
                    a, b, c, d = _divergence(self.head, out, self.finals[k], ids, mask, self.max_logits)
                    kl, ce, n_kl, n_ce = kl + a, ce + b, n_kl + c, n_ce + d
                    self.forwards += 1
            kl, ce, n_kl, n_ce = self._total(kl, ce, n_kl, n_ce)
            return kl / max(n_kl, 1), ce / max(n_ce, 1)

        try:
            yield measure
        finally:
            for j, original in enumerate(originals):
                self.decoder.layers[j] = original
            handle.remove()

    @torch.no_grad()
    def layer_inputs(self, index: int) -> None:
        """Recompute the kept input of decoder layer ``index`` with the model as it is now (e.g. with other
        layers cut by hooks), replacing the teacher's."""
        for k, (ids, mask) in enumerate(self.data):
            seen = {}

            def capture(module, args, kwargs):
                seen["hidden"] = _hidden_argument(args, kwargs).detach().cpu()
                raise _Stop

            handle = self.decoder.layers[index].register_forward_pre_hook(capture, with_kwargs=True)
            try:
                self.decoder(input_ids=ids.to(self.device), **self._kwargs(mask))
            except _Stop:
                pass
            finally:
                handle.remove()
            self.captured[k][index] = seen["hidden"]

    @property
    def tokens(self) -> int:
        """Calibration tokens of the teacher pass (over all ranks)."""
        return int(self._tokens)


class _Stop(Exception):
    """Ends a forward pass once the wanted layer input is seen."""


@torch.no_grad()
def measured_sensitivity(model: torch.nn.Module, batches: Iterable[Any], layers: Sequence[LayerToPlan], *,
                         progress: bool = True, max_logits: int = 1 << 24) -> dict[str, Any]:
    """KL divergence from the unpruned model (per token) of every candidate of every layer, cut alone.

    Under ``torchrun`` every rank measures its share of the batches; the sums are added over the ranks.

    Args:
        model: a transformers causal LM with GDN layers (possibly dispatched with a device map).
        batches: calibration ``input_ids`` [B, T] tensors, or mappings with ``input_ids`` and an optional
            ``attention_mask``.
        layers: the layers to measure, with their orders (None: as they are) and candidate geometries.
        progress: a tqdm bar over the candidates.
        max_logits: logits computed at a time (chunks of tokens).

    Returns:
        ``{"kl": {prefix: [per candidate]}, "loss": {prefix: [...]}, "base_loss", "tokens", "seconds",
        "forwards"}``; a candidate equal to the layer's full geometry is the sorted (same-function) layer:
        KL 0 and the base loss, not measured.

    Raises:
        ValueError: a model whose logits are not ``lm_head`` of the decoder's last hidden state.
    """
    from tqdm.auto import tqdm

    start_time = time.perf_counter()
    forwards = Forwards(model, batches, max_logits=max_logits)
    text_config = model.config.get_text_config(decoder=True)
    index = [forwards.decoder_index(layer.module) for layer in layers]
    forwards.teacher(index)
    result = {"kl": {}, "loss": {}, "base_loss": forwards.base_loss, "tokens": forwards.tokens}
    bar = tqdm(total=sum(len(layer.candidates) for layer in layers), disable=not progress, desc="sensitivity",
               unit="cand")
    try:
        for layer, i in zip(layers, index):
            state = _sorted_state(layer)
            device = next(iter(state.values())).device
            parent_name, _, attr = _relative_name(forwards.decoder.layers[i], layer.module)
            parent = forwards.decoder.layers[i].get_submodule(parent_name) if parent_name else forwards.decoder.layers[i]
            kl, loss = [], []
            with forwards.from_layer(i) as measure:
                try:
                    for target in layer.candidates:
                        if target == layer.shape:  # the sorted layer computes the same function
                            kl.append(0.0)
                            loss.append(forwards.base_loss)
                        else:
                            setattr(parent, attr, _candidate_module(layer, state, target, text_config, device))
                            a, b = measure()
                            kl.append(a)
                            loss.append(b)
                        bar.update(1)
                finally:
                    setattr(parent, attr, layer.module)
            result["kl"][layer.prefix] = kl
            result["loss"][layer.prefix] = loss
    finally:
        bar.close()
    result["forwards"] = forwards.forwards
    result["seconds"] = time.perf_counter() - start_time
    return result


def _relative_name(root: torch.nn.Module, module: torch.nn.Module) -> tuple[str, str, str]:
    """``(parent path, ".", attribute)`` of ``module`` inside ``root``."""
    for name, sub in root.named_modules():
        if sub is module:
            return name.rpartition(".")
    raise ValueError("the GDN module is not inside its decoder layer")


def proxy_sensitivity(payload: Mapping[str, Any], shape: GDNShape, candidates: Sequence[GDNShape]) -> list[float]:
    """The output energy each candidate removes, from one layer's scores payload (no forward pass).

    Kept energy = sum over kept key groups of (group energy ``key_group_scores``) x (kept share of its lane
    scores) x (kept share of its key channels' squared scores) x (kept share of the value channels' squared
    scores); the proxy is the total group energy minus the kept energy. Meant for ``projection`` scores
    (energies per token); other methods give a relative measure.
    """
    orders = orders_from_payload(payload, shape)
    try:
        groups = np.asarray(payload["key_group_scores"], dtype=np.float64).reshape(shape.num_key_heads)
        lanes = np.asarray(payload["value_lane_scores"], dtype=np.float64).reshape(
            shape.num_key_heads, shape.value_heads_per_group)
        key_dims = np.asarray(payload["key_dim_scores"], dtype=np.float64).reshape(
            shape.num_key_heads, shape.key_head_dim) ** 2
        value_dims = np.asarray(payload["value_dim_scores"], dtype=np.float64).reshape(shape.value_head_dim) ** 2
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"the proxy sensitivity needs the raw *_scores of a scores file: {exc}") from None
    groups, lanes = np.abs(groups), np.abs(lanes)

    def share(values: np.ndarray, order: np.ndarray, keep: int) -> float:
        total = values.sum()
        return 1.0 if total <= 0 else float(values[order[:keep]].sum() / total)

    out = []
    for t in candidates:
        kept = 0.0
        for g in orders["key_groups"][: t.num_key_heads]:
            kept += (groups[g] * share(lanes[g], orders["value_lanes"][g], t.value_heads_per_group)
                     * share(key_dims[g], orders["key_dim"][g], t.key_head_dim))
        kept *= share(value_dims, orders["value_dim"], t.value_head_dim)
        out.append(max(0.0, float(groups.sum() - kept)))
    return out
