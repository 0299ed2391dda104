"""The quantization schemes and which weights each one quantizes: data, no torch.

A scheme is a ``compressed-tensors`` preset (the format vLLM, SGLang and transformers load) and the rule
of which matrices fit it. Engines keep the same parts in high precision (embeddings, the LM head, norms,
routers, the shared-expert gate, the GDN gates and decay parameters, the convolutions, the vision tower):
only the projections named in :data:`PROJECTIONS` are quantized, every other ``Linear`` is listed in the
config's ``ignore``.

A matrix a cut left at a width that its scheme's tiles or groups do not divide is kept in high precision
and named in a warning (:func:`select_modules`): engines merge ``q/k/v`` and ``gate/up`` into one matrix
whose scale rows must line up with each part, and group the activations along the input in whole tiles,
so a partial tile is refused at load or computes wrong; the format has no padding that engines accept.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "SCHEMES",
    "PROJECTIONS",
    "HIGH_PRECISION",
    "Scheme",
    "Selection",
    "QuantizeError",
    "scheme_named",
    "select_modules",
]


class QuantizeError(ValueError):
    """A quantization request that cannot be met (exit 2): an unknown scheme, a size that does not apply,
    an input that is already quantized."""


@dataclass(frozen=True)
class Scheme:
    """One quantization scheme.

    ``preset``: the ``compressed-tensors`` preset it writes. ``size``: what its size option means
    (``"block"``: the edge of the square weight tile and of the activation group; ``"group"``: the input
    channels that share one weight scale; None: no size). ``fixed``: (output, input) multiples every
    quantized matrix needs whatever the size (fp8 matmul kernels work on multiples of 16).
    ``calibration``: the weight rounding methods it takes (the first is the default)."""

    name: str
    preset: str
    size: str | None
    fixed: tuple[int, int]
    calibration: tuple[str, ...]
    summary: str
    experts: bool = True

    def multiples(self, size: int | None) -> tuple[int, int]:
        """(output, input) multiples a matrix needs to be quantized with ``size``."""
        if self.size == "block":
            assert size is not None
            return size, size
        if self.size == "group":
            assert size is not None
            return self.fixed[0], size
        return self.fixed


#: name -> scheme, in the order of ``--help``
SCHEMES: dict[str, Scheme] = {
    s.name: s
    for s in (
        Scheme(
            "fp8-block",
            "FP8_BLOCK",
            "block",
            (1, 1),
            ("rtn",),
            "FP8 (e4m3) weights in square tiles with one scale each (the tiles of Qwen's FP8 checkpoints), "
            "activations in groups of the tile edge, quantized at run time",
            # transformers 5.23 folds only per-channel scales into fused MoE experts; block-scaled experts
            # fail to load there, so routed experts stay in high precision under this scheme
            experts=False,
        ),
        Scheme(
            "fp8-dynamic",
            "FP8_DYNAMIC",
            None,
            (16, 16),
            ("rtn",),
            "FP8 (e4m3) weights with one scale per output channel, activations per token at run time",
        ),
        Scheme(
            "w4a16",
            "W4A16",
            "group",
            (1, 1),
            ("gptq", "rtn"),
            "4-bit integer weights (symmetric) in groups along the input channels, 16-bit activations",
        ),
    )
}

#: the projections a scheme quantizes, by the name of the module's last component; every other Linear
#: (routers, gates, the LM head, the vision tower) keeps its precision
PROJECTIONS = frozenset(
    {
        # attention, and OLMo-hybrid's GDN (FLA names)
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "g_proj",
        # Qwen GDN
        "in_proj_qkv",
        "in_proj_z",
        "in_proj_qkvz",
        "out_proj",
        # MLPs, shared experts, routed experts
        "gate_proj",
        "up_proj",
        "down_proj",
    }
)

#: the high-precision roles written into ``ignore`` as patterns (besides the LM head and every module a
#: cut left unfit, each named): routers, the shared-expert gate, the GDN gate projections, the vision tower
HIGH_PRECISION = (
    "lm_head",
    r"re:.*mlp\.gate$",
    r"re:.*shared_expert_gate$",
    r"re:.*linear_attn\.(in_proj_a|in_proj_b|in_proj_ba|a_proj|b_proj)$",
    r"re:.*visual\..*",
)

_LAYER = re.compile(r"(^|\.)layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.\d+\.")


def scheme_named(
    name: str, size: int | None = None, calibration: str | None = None
) -> tuple[Scheme, int | None, str]:
    """The scheme ``name`` with its size (default 128 where it has one) and calibration checked.

    Raises:
        QuantizeError: an unknown scheme, a size it does not take, a calibration it does not take.
    """
    scheme = SCHEMES.get(name)
    if scheme is None:
        raise QuantizeError(f"unknown scheme {name!r}; expected one of {list(SCHEMES)}")
    if scheme.size is None and size is not None:
        raise QuantizeError(f"`scheme={name}` has no block or group size (got {size})")
    if scheme.size is not None:
        size = 128 if size is None else size
        if size < 16 or size % 16:
            raise QuantizeError(f"the {scheme.size} size must be a multiple of 16, got {size}")
    calibration = calibration or scheme.calibration[0]
    if calibration not in scheme.calibration:
        raise QuantizeError(
            f"`scheme={name}` takes calibration {list(scheme.calibration)}, got {calibration!r}"
        )
    return scheme, size, calibration


@dataclass
class Selection:
    """Which checkpoint matrices a scheme quantizes: ``quantized`` (module names, as on disk), ``unfit``
    (module -> why it stays in high precision: a width its tiles or groups do not divide),
    ``kept_experts`` (routed experts the scheme leaves in high precision), ``ignore`` (the config's list)."""

    quantized: list[str]
    unfit: dict[str, str]
    kept_experts: list[str]
    ignore: list[str]


def _pattern(module: str) -> str:
    """The ``ignore`` entry of one module: a pattern from its ``layers.N.`` on, so that it matches under any
    prefix a loader gives the decoder (``model.``, ``model.language_model.``, vLLM's own)."""
    m = _LAYER.search(module)
    tail = module[m.start() + (1 if m.group(1) else 0) :] if m else module
    return "re:.*" + re.escape(tail) + ("" if tail.endswith(".") else "$") if m else module


def select_modules(
    shapes: Mapping[str, tuple[int, ...]],
    scheme: Scheme,
    size: int | None,
    *,
    prefix_skip: tuple[str, ...] = ("mtp.",),
) -> Selection:
    """The matrices of a checkpoint (``{tensor name: shape}``) that ``scheme`` quantizes at ``size``.

    A matrix is quantized when it is the weight of a projection (:data:`PROJECTIONS`) of a decoder layer,
    and both its output and input widths are multiples of the scheme's (:meth:`Scheme.multiples`).
    """
    out_multiple, in_multiple = scheme.multiples(size)
    quantized, unfit, experts = [], {}, []
    for name, shape in sorted(shapes.items()):
        if not name.endswith(".weight") or len(shape) != 2 or name.startswith(prefix_skip):
            continue
        module = name[: -len(".weight")]
        if module.rsplit(".", 1)[-1] not in PROJECTIONS or not _LAYER.search(module) or "visual." in module:
            continue
        if _EXPERT.search(module) and not scheme.experts:
            experts.append(module)
            continue
        rows, cols = shape
        if rows % out_multiple or cols % in_multiple:
            unfit[module] = (
                f"{rows} x {cols}: {scheme.name} needs output widths in multiples of {out_multiple} and input "
                f"widths in multiples of {in_multiple}"
            )
            continue
        quantized.append(module)
    # a layer's routed experts load as one fused tensor per projection: all of them quantized, or none
    broken = {_EXPERT.split(m)[0] for m in unfit if _EXPERT.search(m)}
    for m in [m for m in quantized if _EXPERT.search(m) and _EXPERT.split(m)[0] in broken]:
        quantized.remove(m)
        unfit[m] = "other expert matrices of its layer do not fit (the layer's experts load as one tensor)"
    ignore = list(HIGH_PRECISION) + [_pattern(m) for m in sorted(unfit) if not _EXPERT.search(m)]
    # routed experts are fused in memory (no Linear modules), so these entries are for engines that keep
    # them per unit: every routed expert when the scheme keeps them, else the layers whose experts are unfit
    if experts:
        ignore.append(r"re:.*mlp\.experts\..*")
    else:
        layers = sorted({_EXPERT.split(m)[0] for m in unfit if _EXPERT.search(m)})
        ignore += [_pattern(f"{layer}.experts.") + ".*" for layer in layers]
    return Selection(quantized, unfit, experts, ignore)
