"""Per-layer sensitivity of every candidate: measured with real forwards, or a proxy from the scores.

**Measured** (Puzzle's replace-one-block scoring): cut one layer of the sorted model to a candidate, keep
every other layer intact, and measure the next-token KL divergence ``KL(teacher || cut)`` from the unpruned
model, per token, on calibration windows (and the cut model's next-token loss). The work is shared
(:class:`gdnprune.model.forwards.Forwards`):

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

import copy
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from ...gated_delta_net import (
    GDNPermutation,
    permute_gated_delta_net_state_dict,
    slice_gated_delta_net_state_dict,
)
from ...model.forwards import Forwards, parent_and_name
from ...model.geometry import GDNShape, orders_from_payload
from ...scoring.hooks import materialized_weight

__all__ = ["LayerToPlan", "candidate_module", "measured_sensitivity", "proxy_sensitivity", "sorted_state"]


class LayerToPlan:
    """One GDN layer of a loaded model to plan: its module, name, orders and candidate geometries."""

    def __init__(
        self,
        prefix: str,
        module: torch.nn.Module,
        orders: Mapping[str, np.ndarray] | None,
        candidates: Sequence[GDNShape],
    ):
        self.prefix, self.module, self.orders, self.candidates = prefix, module, orders, list(candidates)
        self.shape = GDNShape.from_module(module)


def sorted_state(layer: LayerToPlan) -> dict[str, torch.Tensor]:
    """The layer's weights (materialised if offloaded), permuted by its orders (a function-preserving sort).
    A sub-block to plan (:class:`gdnprune.plan.measure.subblocks.BlockToPlan`) sorts its own."""
    if not isinstance(layer, LayerToPlan):
        return layer.sorted_state()

    state = {}
    for name, _ in layer.module.named_parameters():
        owner, _, leaf = name.rpartition(".")
        state[f"layer.{name}"] = materialized_weight(
            layer.module.get_submodule(owner) if owner else layer.module, leaf
        ).detach()
    if layer.orders is not None:
        permutation = GDNPermutation(**{k: torch.as_tensor(v) for k, v in layer.orders.items()})
        permute_gated_delta_net_state_dict(state, prefix="layer", shape=layer.shape, permutation=permutation)
    return state


def candidate_module(
    layer: LayerToPlan,
    state: Mapping[str, torch.Tensor],
    target: GDNShape,
    text_config: Any,
    device: torch.device,
) -> torch.nn.Module:
    """The GDN module of ``layer`` cut to ``target``: built from the layer's config with that geometry (a
    sub-block to plan builds its own: :meth:`gdnprune.plan.measure.subblocks.BlockToPlan.build`)."""
    if not isinstance(layer, LayerToPlan):
        return layer.build(state, target, device)

    index = layer.module.layer_idx
    config = (
        text_config.per_layer_config[index]
        if getattr(text_config, "is_heterogeneous", False)
        else copy.copy(text_config)
    )
    for key, value in target.config_updates().items():
        setattr(config, key, value)
    cut = dict(state)
    slice_gated_delta_net_state_dict(cut, prefix="layer", shape=layer.shape, target=target)
    with torch.device("meta"):
        module = type(layer.module)(config, index)
    module.load_state_dict(
        {k[len("layer.") :]: v.to(device) for k, v in cut.items()}, strict=True, assign=True
    )
    return module.eval()


# inference mode, here and in the other measurements of the plan (model/forwards.py, halving, joint, hidden):
# they return numbers, and without autograd's version and view tracking each of a forward's many small ops costs
# less (a prune of the 0.8B member's real-count model: 44.1 to 40.3 s of CPU)
@torch.inference_mode()
def measured_sensitivity(
    model: torch.nn.Module,
    batches: Iterable[Any],
    layers: Sequence[LayerToPlan],
    *,
    progress: bool = True,
    max_logits: int = 1 << 24,
) -> dict[str, Any]:
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
        "forwards", "teacher_seconds"}`` (the last: the teacher pass, one forward over the batches); a candidate equal to the layer's full geometry is the sorted (same-function) layer:
        KL 0 and the base loss, not measured.

    Raises:
        ValueError: a model whose logits are not ``lm_head`` of the decoder's last hidden state.
    """

    start_time = time.perf_counter()
    forwards = Forwards(model, batches, max_logits=max_logits)
    config: Any = model.config  # a transformers config (nn.Module's stubs type attributes as Tensor | Module)
    text_config = config.get_text_config(decoder=True)
    index = [forwards.decoder_index(layer.module) for layer in layers]
    teacher_start = time.perf_counter()
    forwards.teacher(index)
    teacher_seconds = time.perf_counter() - teacher_start
    result: dict[str, Any] = {
        "kl": {},
        "loss": {},
        "base_loss": forwards.base_loss,
        "tokens": forwards.tokens,
        "teacher_seconds": teacher_seconds,
    }
    bar = tqdm(
        total=sum(len(layer.candidates) for layer in layers),
        disable=not progress,
        desc="sensitivity",
        unit="cand",
    )
    try:
        for layer, i in zip(layers, index):
            state = sorted_state(layer)
            device = next(iter(state.values())).device
            parent, attr = parent_and_name(forwards.decoder.layers[i], layer.module)
            kl, loss = [], []
            with forwards.from_layer(i) as measure:
                try:
                    for target in layer.candidates:
                        if target == layer.shape:  # the sorted layer computes the same function
                            kl.append(0.0)
                            loss.append(forwards.base_loss)
                        else:
                            setattr(parent, attr, candidate_module(layer, state, target, text_config, device))
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


def proxy_sensitivity(
    payload: Mapping[str, Any], shape: GDNShape, candidates: Sequence[GDNShape]
) -> list[float]:
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
            shape.num_key_heads, shape.value_heads_per_group
        )
        key_dims = (
            np.asarray(payload["key_dim_scores"], dtype=np.float64).reshape(
                shape.num_key_heads, shape.key_head_dim
            )
            ** 2
        )
        value_dims = (
            np.asarray(payload["value_dim_scores"], dtype=np.float64).reshape(shape.value_head_dim) ** 2
        )
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
            kept += (
                groups[g]
                * share(lanes[g], orders["value_lanes"][g], t.value_heads_per_group)
                * share(key_dims[g], orders["key_dim"][g], t.key_head_dim)
            )
        kept *= share(value_dims, orders["value_dim"], t.value_head_dim)
        out.append(max(0.0, float(groups.sum() - kept)))
    return out
