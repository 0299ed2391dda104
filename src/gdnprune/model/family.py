"""The published Qwen hybrid models as data: every member's counts and widths, each value with the stored source
it was read from, and the configs built from them. No torch, no numpy.

This table is the one place the real models' numbers live. ``docs/models.md`` is generated from it
(:func:`models_markdown`, ``scripts/models_doc.py``; a test checks it is current), the tests and
``benchmarks/scale.py`` build their real-count models from it (:func:`tiny_config`: the real counts of
layers, layer types, heads, key-value heads, experts, top-k, shared expert and MTP layers at tiny widths),
and ``gdnprune estimate`` answers for a member by name (:func:`real_config`).

A value that no stored source gave is not invented: it is listed in the member's ``stand_ins`` with the value
used in its place and why, and the docs table marks it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Source",
    "Member",
    "MEMBERS",
    "FIELDS",
    "member",
    "real_config",
    "tiny_config",
    "layer_types",
    "models_markdown",
]

#: the config keys every member records (transformers' text-config names; ``mtp_num_hidden_layers``: the
#: multi-token-prediction layers stored under ``mtp.*``)
FIELDS = (
    "num_hidden_layers",
    "full_attention_interval",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
    "intermediate_size",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "vocab_size",
    "tie_word_embeddings",
    "mtp_num_hidden_layers",
)

#: the widths :func:`tiny_config` replaces (every other field is a count and is kept)
WIDTHS = (
    "hidden_size",
    "head_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "intermediate_size",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "vocab_size",
)

_MOE = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")


@dataclass(frozen=True)
class Source:
    """A stored source and the fields read from it."""

    where: str
    fields: tuple[str, ...]
    note: str = ""


@dataclass(frozen=True)
class Member:
    """One published model: ``values`` at its real size (every key of :data:`FIELDS` that applies: the MoE keys
    only for MoE members, ``intermediate_size`` only where a dense MLP exists), the ``sources`` they were read
    from, and ``stand_ins``: field -> why its value was not read from a stored source."""

    name: str
    hub_id: str
    model_type: str  # the text model's transformers model type
    values: Mapping[str, int | bool]
    sources: tuple[Source, ...]
    stand_ins: Mapping[str, str] = field(default_factory=dict)

    @property
    def moe(self) -> bool:
        return "num_experts" in self.values

    def sourced(self, key: str) -> list[int]:
        """The indices of the sources that give ``key`` (1-based, as the docs number them)."""
        return [i + 1 for i, s in enumerate(self.sources) if key in s.fields]


_TRANSFORMERS = "transformers 5.23 `{}` defaults (`configuration_{}.py`; its docs name the checkpoint {})"
_SLIME = "https://github.com/THUDM/slime/blob/main/scripts/models/{}.sh"
_MILES = "https://github.com/{}/blob/main/scripts/models/{}.sh"
_ATTN = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")
_GDN = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
_GDN_ALL = (*_GDN, "linear_conv_kernel_dim")
#: the Qwen3.5 family-wide facts: one full-attention layer in four (the model cards' "Hidden Layout:
#: N x (3 x (Gated DeltaNet -> FFN) -> 1 x (Gated Attention -> FFN))") and an MTP layer
_QWEN35_LAYOUT = Source(
    "https://huggingface.co/Qwen/Qwen3.5-27B/commit/3b2962802c141fcffb992b4e13e4cf9012fdaa13",
    ("full_attention_interval",),
    "the model card's hidden layout: 3 Gated DeltaNet layers, then 1 Gated Attention layer",
)
_QWEN35_MTP = Source(
    "https://huggingface.co/oopere/Qwen3.5-0.65B-Base-Rearchitected/blob/main/config.json",
    ("mtp_num_hidden_layers",),
    "a Qwen3.5 config.json (`mtp_num_hidden_layers: 1`); the model pages say every size has an MTP head",
)
_QWEN35_GDN_DIMS = Source(
    _SLIME.format("qwen3.5-35B-A3B"),
    ("linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim"),
    "GDN head dims 128 and conv kernel 4, the same in every Qwen3.5 config found",
)


def _qwen35(name: str, values: dict, sources: tuple[Source, ...], stand_ins: dict | None = None) -> Member:
    moe = "num_experts" in values
    full = {
        "full_attention_interval": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "vocab_size": 248320,
        "mtp_num_hidden_layers": 1,
        **values,
    }
    return Member(
        name=name,
        hub_id=f"Qwen/{name}",
        model_type="qwen3_5_moe_text" if moe else "qwen3_5_text",
        values=full,
        sources=(*sources, _QWEN35_LAYOUT, _QWEN35_MTP, _QWEN35_GDN_DIMS),
        stand_ins=stand_ins or {},
    )


MEMBERS: tuple[Member, ...] = (
    Member(
        name="Qwen3-Next-80B-A3B",
        hub_id="Qwen/Qwen3-Next-80B-A3B-Instruct",
        model_type="qwen3_next",
        values={
            "num_hidden_layers": 48,
            "full_attention_interval": 4,
            "hidden_size": 2048,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "num_experts": 512,
            "num_experts_per_tok": 10,
            "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512,
            "vocab_size": 151936,
            "tie_word_embeddings": False,
            "mtp_num_hidden_layers": 1,
        },
        sources=(
            Source(
                _TRANSFORMERS.format("Qwen3NextConfig", "qwen3_next", "Qwen/Qwen3-Next-80B-A3B-Instruct"),
                (*_ATTN, *_GDN_ALL, *_MOE, "vocab_size", "tie_word_embeddings"),
                "its example calls the defaults the Qwen3-Next-80B-A3B style configuration",
            ),
            Source(
                _SLIME.format("qwen3-next-80B-A3B"),
                (*_ATTN, *_MOE, "vocab_size", "tie_word_embeddings", "mtp_num_hidden_layers"),
                "`--mtp-num-layers 1`; every layer MoE (no dense MLP)",
            ),
            Source(
                "https://www.radixark.com/miles/docs/models/qwen/qwen3-next",
                ("full_attention_interval",),
                "hybrid Gated DeltaNet + full attention; the 3:1 ratio is in reportify.ai's summary of the "
                "Qwen blog (https://reportify.ai/social-media/718848039649623)",
            ),
        ),
    ),
    _qwen35(
        "Qwen3.5-0.8B",
        {
            "num_hidden_layers": 24,
            "hidden_size": 1024,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 16,
            "intermediate_size": 3584,
            "tie_word_embeddings": True,
        },
        (
            Source(
                _SLIME.format("qwen3.5-0.8B"),
                (*_ATTN, "intermediate_size", "vocab_size", "tie_word_embeddings"),
                "tied: the script has no `--untie-embeddings-and-output-weights`",
            ),
            Source(
                "https://huggingface.co/oopere/Qwen3.5-0.65B-Base-Rearchitected/blob/main/config.json",
                _GDN,
                "a Qwen3.5-0.8B with layers removed: hidden 1024, intermediate 3584, heads 8/2 as the 0.8B",
            ),
        ),
    ),
    _qwen35(
        "Qwen3.5-2B",
        {
            "num_hidden_layers": 24,
            "hidden_size": 2048,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 16,
            "intermediate_size": 6144,
            "tie_word_embeddings": True,
        },
        (
            Source(
                _MILES.format("williammtan/miles", "qwen3.5-2B"),
                (*_ATTN, "intermediate_size", "vocab_size", "tie_word_embeddings"),
                "tied: the script has no `--untie-embeddings-and-output-weights`",
            ),
        ),
        {
            "linear_num_key_heads": "not found in a stored source; the 0.8B's value (16), the same in every size",
            "linear_num_value_heads": "not found in a stored source; the 0.8B's value (16), whose layers, "
            "attention heads and key-value heads the 2B shares",
        },
    ),
    _qwen35(
        "Qwen3.5-4B",
        {
            "num_hidden_layers": 32,
            "hidden_size": 2560,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
            "intermediate_size": 9216,
            "tie_word_embeddings": True,
        },
        (
            Source(
                _MILES.format("radixark/miles", "qwen3.5-4B"),
                (*_ATTN, "intermediate_size", "vocab_size", "tie_word_embeddings"),
                "tied: the script has no `--untie-embeddings-and-output-weights`",
            ),
            Source(
                "https://huggingface.co/halen214/st01/blob/main/config.json",
                (*_GDN, "intermediate_size", "tie_word_embeddings"),
                "a Qwen3_5ForCausalLM config.json with the 4B's widths (hidden 2560, intermediate 9216)",
            ),
        ),
    ),
    _qwen35(
        "Qwen3.5-9B",
        {
            "num_hidden_layers": 32,
            "hidden_size": 4096,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
            "intermediate_size": 12288,
            "tie_word_embeddings": False,
        },
        (
            Source(
                _MILES.format("radixark/miles", "qwen3.5-9B"),
                (*_ATTN, "intermediate_size", "vocab_size", "tie_word_embeddings"),
            ),
            Source(
                _TRANSFORMERS.format("Qwen3_5TextConfig", "qwen3_5", "Qwen/Qwen3.5-27B"),
                (*_ATTN, *_GDN_ALL, "intermediate_size", "vocab_size", "tie_word_embeddings"),
                "the defaults are the 9B's widths (hidden 4096, intermediate 12288, 32 layers, heads 16/4), "
                "not the 27B's its docs name",
            ),
        ),
    ),
    _qwen35(
        "Qwen3.5-27B",
        {
            "num_hidden_layers": 64,
            "hidden_size": 5120,
            "num_attention_heads": 24,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 48,
            "intermediate_size": 17408,
            "tie_word_embeddings": False,
        },
        (
            Source(
                _SLIME.format("qwen3.5-27B"),
                (*_ATTN, "intermediate_size", "vocab_size", "tie_word_embeddings"),
            ),
            Source(
                "https://huggingface.co/Qwen/Qwen3.5-27B/commit/3b2962802c141fcffb992b4e13e4cf9012fdaa13",
                ("num_hidden_layers", "hidden_size"),
                "the model card: hidden dimension 5120, 64 layers",
            ),
            Source(
                "a test fixture in the code index (repository not named) that builds the 27B's config: "
                "hidden 5120, intermediate 17408, heads 24/4, `linear_num_value_heads` 48",
                _GDN,
                "the only stored source found for the 27B's GDN heads",
            ),
        ),
    ),
    _qwen35(
        "Qwen3.5-35B-A3B",
        {
            "num_hidden_layers": 40,
            "hidden_size": 2048,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
            "num_experts": 256,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512,
            "tie_word_embeddings": False,
        },
        (
            Source(
                _SLIME.format("qwen3.5-35B-A3B"),
                (*_ATTN, *_GDN_ALL, *_MOE, "vocab_size", "tie_word_embeddings"),
            ),
            Source(
                _TRANSFORMERS.format("Qwen3_5MoeTextConfig", "qwen3_5_moe", "Qwen/Qwen3.5-35B-A3B"),
                (*_ATTN, *_GDN_ALL, *_MOE, "vocab_size", "tie_word_embeddings"),
            ),
        ),
    ),
    _qwen35(
        "Qwen3.5-122B-A10B",
        {
            "num_hidden_layers": 48,
            "hidden_size": 3072,
            "num_attention_heads": 32,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 64,
            "num_experts": 256,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 1024,
            "shared_expert_intermediate_size": 1024,
            "tie_word_embeddings": False,
        },
        (
            Source(
                "https://apxml.com/models/qwen35-122b-a10b",
                (*_ATTN, "num_experts", "moe_intermediate_size", "vocab_size", "mtp_num_hidden_layers"),
                "hidden 3072, 48 layers, heads 32/2 of dim 256, 256 experts of width 1024, 1 MTP head",
            ),
            Source(
                "https://awesomeagents.ai/models/qwen-3-5-122b-a10b",
                ("num_experts", "num_experts_per_tok", "moe_intermediate_size"),
                "8 routed + 1 shared expert per token",
            ),
            Source(
                "a launch script in the code index (repository not named), `run_qwen3_5_moe_122B`",
                (*_ATTN, *_GDN, *_MOE),
                "dim 3072, moe and shared-expert widths 1024, 256 experts top-8, 48 layers, heads 32/2, "
                "GDN heads 16/64: the only stored source found for the GDN heads and the shared expert's width",
            ),
        ),
        {"tie_word_embeddings": "not stated by the sources found; untied as every MoE member"},
    ),
    _qwen35(
        "Qwen3.5-397B-A17B",
        {
            "num_hidden_layers": 60,
            "hidden_size": 4096,
            "num_attention_heads": 32,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 64,
            "num_experts": 512,
            "num_experts_per_tok": 10,
            "moe_intermediate_size": 1024,
            "shared_expert_intermediate_size": 1024,
            "tie_word_embeddings": False,
        },
        (
            Source(
                _SLIME.format("qwen3.5-397B-A17B"),
                (*_ATTN, *_MOE, "vocab_size", "tie_word_embeddings"),
            ),
            Source(
                "https://harmonyhu.com/2026/02/21/qwen3.5",
                (*_GDN_ALL,),
                "GDN caches per layer: conv state [B, 12288, 4], recurrent state [B, 64, 128, 128]: 64 value "
                "heads of 128 x 128, so 2 x Hk x 128 + 64 x 128 = 12288 gives 16 key heads",
            ),
            Source(
                "https://docs.sglang.io/docs/hardware-platforms/ascend-npus/model-tutorials/qwen3_5_397b",
                ("num_experts", "num_experts_per_tok", "full_attention_interval", "mtp_num_hidden_layers"),
                "top-10 of 512 routed experts plus a shared expert, full attention every 4th layer, built-in MTP",
            ),
        ),
    ),
)


def member(name: str) -> Member:
    """The member called ``name`` (case-insensitive; the hub id works too). Raises ``ValueError`` naming the
    members when none is."""
    wanted = name.lower().removeprefix("qwen/")
    for m in MEMBERS:
        if wanted in (m.name.lower(), m.hub_id.lower().removeprefix("qwen/")):
            return m
    names = ", ".join(m.name for m in MEMBERS)
    raise ValueError(f"{name!r} is not a member of the table; expected one of {names}")


def layer_types(num_layers: int, interval: int) -> list[str]:
    """``layer_types`` of a hybrid model with one full-attention layer in ``interval`` (the last of each group)."""
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]


_ARCHITECTURES = {
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
}


def _config(m: Member, values: Mapping[str, Any]) -> dict[str, Any]:
    config: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[m.model_type]],
        "model_type": m.model_type,
        **{k: v for k, v in values.items() if k != "full_attention_interval"},
        "full_attention_interval": values["full_attention_interval"],
        "layer_types": layer_types(int(values["num_hidden_layers"]), int(values["full_attention_interval"])),
    }
    if m.model_type == "qwen3_next":
        config.update(decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
        config.pop("mtp_num_hidden_layers")  # Qwen3NextConfig has no such key: the head is only in the files
    if m.moe:
        config.setdefault("intermediate_size", config["moe_intermediate_size"])  # unused: every layer is MoE
    return config


def real_config(name: str | Member) -> dict[str, Any]:
    """The text ``config.json`` (as a dict) of a member at its real size: what ``gdnprune estimate`` reads for a
    model that is not on disk. The vision tower of the Qwen3.5 members is not part of it."""
    m = name if isinstance(name, Member) else member(name)
    return _config(m, m.values)


def tiny_config(
    name: str | Member,
    *,
    hidden_size: int = 64,
    head_dim: int = 8,
    expert_width: int = 8,
    mlp_width: int = 16,
    vocab_size: int = 257,
    scale: float = 1.0,
) -> dict[str, Any]:
    """A member's config with its real counts and tiny widths: ``hidden_size``; ``head_dim`` for the attention
    heads and the GDN key and value heads; ``expert_width`` for the routed and shared experts; ``mlp_width``
    for a dense MLP; ``vocab_size`` (257: gdnprune's byte tokenizer). Every count (layers and their types,
    heads, key-value heads, GDN heads, experts, top-k, the MTP layers) is the member's, times ``scale`` for the
    layers and experts (at least 4 layers and one full-attention layer, top-k at most the experts) — the
    scaled-down points of the cost-growth benchmark."""
    m = name if isinstance(name, Member) else member(name)
    values: dict[str, Any] = dict(m.values)
    values.update(
        hidden_size=hidden_size,
        head_dim=head_dim,
        linear_key_head_dim=head_dim,
        linear_value_head_dim=head_dim,
        vocab_size=vocab_size,
        tie_word_embeddings=False,
    )
    if "intermediate_size" in values:
        values["intermediate_size"] = mlp_width
    if m.moe:
        values.update(moe_intermediate_size=expert_width, shared_expert_intermediate_size=expert_width)
    if scale != 1.0:
        interval = int(values["full_attention_interval"])
        layers = max(interval, round(int(values["num_hidden_layers"]) * scale / interval) * interval)
        values["num_hidden_layers"] = layers
        if m.moe:
            values["num_experts"] = max(2, round(int(values["num_experts"]) * scale))
            values["num_experts_per_tok"] = min(int(values["num_experts_per_tok"]), values["num_experts"])
    return _config(m, values)


def _cell(m: Member, key: str) -> str:
    if key not in m.values:
        return "–"
    value = m.values[key]
    text = ("tied" if value else "untied") if isinstance(value, bool) else f"{value:,}"
    refs = m.sourced(key)
    mark = "*" if key in m.stand_ins else ""
    return f"{text}{mark}" + (f" [{','.join(map(str, refs))}]" if refs else "")


def models_markdown() -> str:
    """``docs/models.md``: the table of every member, the sources numbered per member, the stand-ins."""
    lines = [
        "# The Qwen hybrid models, as gdnprune records them",
        "",
        "<!-- generated by scripts/models_doc.py from src/gdnprune/model/family.py; do not edit -->",
        "",
        "The published counts and widths of every Qwen hybrid model gdnprune prunes, each with the stored "
        "sources it was read from (the numbers in brackets; the list follows the table). The tests and "
        "`benchmarks/scale.py` build their real-count models from this table (`gdnprune.model.family."
        "tiny_config`: these counts at hidden size 64, head dims 8, expert width 8), and `gdnprune estimate "
        "NAME` answers for a member that is not on disk. A value marked * was not found in a stored source: "
        "the value used in its place and why are listed under the member's sources. The Qwen3.5 models are "
        "vision-language models: only their text decoder is described here.",
        "",
    ]
    header = ["field", *(m.name for m in MEMBERS)]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "---|" * len(header))
    lines.append("| model type | " + " | ".join(f"`{m.model_type}`" for m in MEMBERS) + " |")
    for key in FIELDS:
        lines.append(f"| `{key}` | " + " | ".join(_cell(m, key) for m in MEMBERS) + " |")
    lines += ["", "## Sources", ""]
    for m in MEMBERS:
        lines.append(f"**{m.name}** (`{m.hub_id}`)")
        lines.append("")
        for i, s in enumerate(m.sources, 1):
            note = f" — {s.note}" if s.note else ""
            lines.append(f"{i}. {s.where}{note}")
        for key, why in m.stand_ins.items():
            lines.append(f"- `{key}`*: {why}")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
