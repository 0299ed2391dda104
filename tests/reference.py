"""Independent references for slicing GDN layers, written from the architecture, not from gdnprune.

Nothing here imports gdnprune's index code (``geometry``, ``layouts``, ``gated_delta_net``): the heads and
channels a cut keeps are picked by the formulas of the model itself (value head ``h = g*r + j`` reads key
head ``g = h // r``; q/k channel ``(g, d)``; v/z channel ``(h, e)``), by reshaping each tensor into its heads.

Two references:

- :func:`zero_removed_heads`: removing key groups or value heads (``dk`` and ``dv`` kept) is exactly zeroing
  the removed value heads' ``out_proj`` columns in the full model: every value head runs its own recurrence
  on its own key head's q/k, the depthwise conv is per channel and the gated RMSNorm normalises each head
  alone, so a removed head only ever reaches the output through its ``dv`` columns of ``out_proj``.
- :func:`hand_cut`: the tensors of a smaller layer picked by hand, head by head (any cut, ``dk``/``dv`` too).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: the three tensor layouts of the tiny models, named by the tensors that tell them apart
FAMILY_OF_MODEL = {
    "qwen3_5": "qwen3_5",
    "qwen3_5_vl": "qwen3_5",
    "qwen3_5_moe": "qwen3_5",
    "qwen4_exp": "qwen3_5",
    "qwen3_next": "qwen3_next",
    "olmo_hybrid": "olmo_hybrid",
}


def family_of(names) -> str:
    """``qwen3_next`` (fused qkvz), ``olmo_hybrid`` (FLA names) or ``qwen3_5``, from a layer's tensor names."""
    names = set(names)
    if any(n.startswith("in_proj_qkvz") for n in names):
        return "qwen3_next"
    if any(n.startswith("q_proj") for n in names):
        return "olmo_hybrid"
    return "qwen3_5"


@dataclass
class Geometry:
    Hk: int
    Hv: int
    dk: int
    dv: int

    @property
    def r(self) -> int:
        return self.Hv // self.Hk

    @classmethod
    def of(cls, shape) -> Geometry:
        """From anything with the four GDNShape fields (a GDNShape, or a transformers GDN module)."""
        if hasattr(shape, "num_k_heads"):
            return cls(shape.num_k_heads, shape.num_v_heads, shape.head_k_dim, shape.head_v_dim)
        return cls(shape.num_key_heads, shape.num_value_heads, shape.key_head_dim, shape.value_head_dim)


def _rows(order, n):
    return [int(x) for x in list(order)[:n]]


@dataclass
class Picks:
    """What a cut keeps, in the order of the smaller layer: key groups, and for each kept group its lanes
    and key dims; one value-dim list for all heads."""

    groups: list[int]
    lanes: dict[int, list[int]]
    key_dims: dict[int, list[int]]
    value_dims: list[int]

    def value_heads(self, r: int) -> list[int]:
        """Canonical value heads kept, in the new order: lane ``j`` of group ``g`` is head ``g*r + j``."""
        return [g * r + j for g in self.groups for j in self.lanes[g]]


def picks(shape, target, permutation=None) -> Picks:
    """The prefix of ``target`` after ``permutation`` (a GDNPermutation or None: identity), read off its
    four orders: new group ``p`` is old group ``key_groups[p]``; row ``g`` of ``value_lanes`` and ``key_dim``
    orders old group ``g``'s lanes and key dims; ``value_dim`` orders the value dims of every head."""
    s, t = Geometry.of(shape), Geometry.of(target)
    if permutation is None:
        key_groups, lanes = range(s.Hk), [range(s.r)] * s.Hk
        key_dim, value_dim = [range(s.dk)] * s.Hk, range(s.dv)
    else:
        key_groups, lanes = permutation.key_groups.tolist(), permutation.value_lanes.tolist()
        key_dim, value_dim = permutation.key_dim.tolist(), permutation.value_dim.tolist()
    groups = _rows(key_groups, t.Hk)
    return Picks(
        groups,
        {g: _rows(lanes[g], t.r) for g in groups},
        {g: _rows(key_dim[g], t.dk) for g in groups},
        _rows(value_dim, t.dv),
    )


# ---- the zeroing reference -----------------------------------------------------------------------------


def out_projection(module) -> torch.nn.Linear:
    return module.out_proj if hasattr(module, "out_proj") else module.o_proj


@torch.no_grad()
def zero_removed_heads(model, kept: dict[str, list[int]]) -> None:
    """Zero, in place, the ``out_proj`` columns of every value head of GDN layer ``prefix`` that is not in
    ``kept[prefix]`` (column ``h*dv + e`` belongs to value head ``h``)."""
    modules = dict(model.named_modules())
    for prefix, heads in kept.items():
        module = modules[prefix]
        g = Geometry.of(module)
        weight = out_projection(module).weight  # [hidden, Hv*dv]
        per_head = weight.view(weight.shape[0], g.Hv, g.dv)
        removed = [h for h in range(g.Hv) if h not in set(heads)]
        per_head[:, removed, :] = 0


# ---- the hand-built smaller layer ----------------------------------------------------------------------


def _q(x, s: Geometry, p: Picks):
    """Rows of a q (or k) block [Hk*dk, ...]: kept groups, their kept key dims."""
    heads = x.reshape(s.Hk, s.dk, *x.shape[1:])
    return torch.cat([heads[g][p.key_dims[g]] for g in p.groups])


def _v(x, s: Geometry, p: Picks):
    """Rows of a v (or z) block [Hv*dv, ...]: kept heads (group-major), their kept value dims."""
    heads = x.reshape(s.Hk, s.r, s.dv, *x.shape[1:])
    return torch.cat([heads[g][p.lanes[g]][:, p.value_dims].reshape(-1, *x.shape[1:]) for g in p.groups])


def _h(x, s: Geometry, p: Picks):
    """Rows of a per-value-head tensor [Hv, ...]."""
    heads = x.reshape(s.Hk, s.r, *x.shape[1:])
    return torch.cat([heads[g][p.lanes[g]] for g in p.groups])


def _qkv(x, s: Geometry, p: Picks):
    """Rows of a [q | k | v] tensor (fused projection, depthwise conv)."""
    q, k, v = x.split([s.Hk * s.dk, s.Hk * s.dk, s.Hv * s.dv])
    return torch.cat([_q(q, s, p), _q(k, s, p), _v(v, s, p)])


def _qkvz_grouped(x, s: Geometry, p: Picks):
    """Qwen3-Next ``in_proj_qkvz``: per key group g the rows [q_g (dk), k_g (dk), v_g (r*dv), z_g (r*dv)]."""
    per_group = x.reshape(s.Hk, 2 * s.dk + 2 * s.r * s.dv, *x.shape[1:])
    out = []
    for g in p.groups:
        q, k, v, z = per_group[g].split([s.dk, s.dk, s.r * s.dv, s.r * s.dv])
        for block in (q, k):
            out.append(block[p.key_dims[g]])
        for block in (v, z):
            out.append(
                block.reshape(s.r, s.dv, *x.shape[1:])[p.lanes[g]][:, p.value_dims].reshape(-1, *x.shape[1:])
            )
    return torch.cat(out)


def _ba_grouped(x, s: Geometry, p: Picks):
    """Qwen3-Next ``in_proj_ba``: per key group g the rows [b_g (r), a_g (r)]."""
    per_group = x.reshape(s.Hk, 2 * s.r, *x.shape[1:])
    return torch.cat(
        [torch.cat([per_group[g][: s.r][p.lanes[g]], per_group[g][s.r :][p.lanes[g]]]) for g in p.groups]
    )


def _dims(x, s: Geometry, p: Picks):
    """The gated RMSNorm weight [dv], shared by all heads."""
    return x[p.value_dims]


def _columns(x, s: Geometry, p: Picks):
    """``out_proj`` [hidden, Hv*dv]: its columns are v channels."""
    return _v(x.t(), s, p).t()


_TABLES = {
    "qwen3_5": {
        "in_proj_qkv": _qkv,
        "in_proj_z": _v,
        "in_proj_b": _h,
        "in_proj_a": _h,
        "conv1d": _qkv,
        "A_log": _h,
        "dt_bias": _h,
        "norm": _dims,
        "out_proj": _columns,
    },
    "qwen3_next": {
        "in_proj_qkvz": _qkvz_grouped,
        "in_proj_ba": _ba_grouped,
        "conv1d": _qkv,
        "A_log": _h,
        "dt_bias": _h,
        "norm": _dims,
        "out_proj": _columns,
    },
    "olmo_hybrid": {
        "q_proj": _q,
        "k_proj": _q,
        "v_proj": _v,
        "g_proj": _v,
        "a_proj": _h,
        "b_proj": _h,
        "conv1d": _qkv,
        "A_log": _h,
        "dt_bias": _h,
        "o_norm": _dims,
        "o_proj": _columns,
    },
}


def hand_cut(tensors: dict[str, torch.Tensor], shape, target, permutation=None) -> dict[str, torch.Tensor]:
    """The tensors (names relative to the layer) of the layer cut to ``target`` after ``permutation``."""
    family = family_of(tensors)
    s, p = Geometry.of(shape), picks(shape, target, permutation)
    out = {}
    for name, tensor in tensors.items():
        module = name.rsplit(".", 1)[0] if name.endswith((".weight", ".bias")) else name
        out[name] = _TABLES[family][module](tensor, s, p).contiguous()
    return out


def hand_cut_state_dict(state: dict[str, torch.Tensor], layers: dict[str, tuple], permutations=None) -> dict:
    """A copy of ``state`` whose GDN layer ``prefix`` is cut by hand to ``layers[prefix] = (shape, target)``."""
    out = dict(state)
    for prefix, (shape, target) in layers.items():
        head = prefix + "."
        tensors = {k[len(head) :]: v for k, v in state.items() if k.startswith(head)}
        perm = None if permutations is None else permutations.get(prefix)
        out.update({head + k: v for k, v in hand_cut(tensors, shape, target, perm).items()})
    return out
