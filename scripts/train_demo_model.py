#!/usr/bin/env python
"""Train the tiny byte-level Qwen3.5 demo model bundled in ``src/gdnprune/data/demo_model``.

The model is a ``Qwen3_5ForCausalLM`` with hidden size 128 and 4 layers (3 GatedDeltaNet
``linear_attention`` layers + 1 ``full_attention`` layer), GDN geometry Hk=4, Hv=8, dk=dv=32,
conv kernel 4, trained on the training split of :mod:`gdnprune.demo_data` (CPython's pydoc topics).
Tokens are UTF-8 bytes (plus ``<|endoftext|>``, unused in training).

``--family`` trains the same kind of model in another family of GDN models (``qwen3_next``,
``olmo_hybrid``, ``qwen3_5_moe``, ``qwen3_5_vl``: a vision-language model trained on text only, its
small vision tower left at its initial weights). The tests' trained models in ``tests/data/trained/``
are made this way (see ``tests/data/trained/README.md`` for their commands).

Training is deterministic given ``--seed`` and the thread count: weights are initialised after
``torch.manual_seed(seed)`` and batches are random windows drawn with a separate ``torch.Generator``
seeded with ``seed``. The budget is a number of optimizer steps (``--steps``), not wall time.

At the end the script writes, into a temporary sibling folder moved into place when complete:
``config.json``, ``generation_config.json``, ``model.safetensors`` (float32), the tokenizer files,
and ``training.json`` (command line, hyper-parameters, corpus sha256, losses, wall time, versions).

Usage::

    python scripts/train_demo_model.py            # defaults: 400 steps, seed 0
    python scripts/train_demo_model.py --steps 50 --out /tmp/demo_model
    python scripts/train_demo_model.py --family qwen3_next --hidden-size 64 --layer-types GGA \
        --key-head-dim 16 --value-head-dim 16 --out tests/data/trained/qwen3_next ...
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "src"))  # use the checkout even when gdnprune is not installed

from gdnprune import demo_data  # noqa: E402
from gdnprune.quality import probes  # noqa: E402

#: seeds of the training probes are offset from the evaluation's (default seed 0): no probe in both
TRAIN_PROBE_SEED = 1000
#: seed of the held-out probes of --recall-check-every (neither the evaluation's nor a training seed)
CHECK_PROBE_SEED = 500

DEFAULT_OUT = REPO_ROOT / "src" / "gdnprune" / "data" / "demo_model"
#: --family -> the transformers class trained (the bundled demo model is qwen3_5)
MODEL_CLASS = {
    "qwen3_5": "Qwen3_5ForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "olmo_hybrid": "OlmoHybridForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
    "qwen3_5_vl": "Qwen3_5ForConditionalGeneration",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=400, help="optimizer steps (default 400)")
    p.add_argument("--seed", type=int, default=0, help="seed for init and batch sampling (default 0)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    p.add_argument(
        "--min-lr-ratio", type=float, default=0.1, help="final lr / peak lr of the cosine (default 0.1)"
    )
    p.add_argument("--warmup-steps", type=int, default=20, help="linear warmup steps (default 20)")
    p.add_argument("--batch-size", type=int, default=16, help="windows per batch (default 16)")
    p.add_argument("--seq-len", type=int, default=256, help="bytes per window (default 256)")
    p.add_argument(
        "--weight-decay", type=float, default=0.1, help="AdamW weight decay on matrices (default 0.1)"
    )
    p.add_argument("--grad-clip", type=float, default=1.0, help="max global grad norm (default 1.0)")
    p.add_argument("--eval-every", type=int, default=100, help="steps between validation evals (default 100)")
    p.add_argument("--log-every", type=int, default=10, help="steps between progress lines (default 10)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument(
        "--save-dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="dtype of the written weights (default float32); with bfloat16 the final losses are "
        "measured on the rounded weights, i.e. on the model as written",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    g = p.add_argument_group("geometry and corpus (defaults: the bundled demo model)")
    g.add_argument(
        "--family",
        choices=list(MODEL_CLASS),
        default="qwen3_5",
        help="model family (default qwen3_5, the bundled model's; the MoE families get 4 experts, "
        "2 per token, expert and shared-expert widths = hidden size)",
    )
    g.add_argument(
        "--corpus",
        choices=demo_data.CORPORA,
        default="pydoc",
        help="training text: pydoc topics (default) or the standard library's docstrings",
    )
    g.add_argument(
        "--layer-types",
        default="GGGA",
        help="one letter per decoder layer: G = GatedDeltaNet, A = full attention (default GGGA)",
    )
    g.add_argument("--hidden-size", type=int, default=128, help="hidden size (default 128)")
    g.add_argument(
        "--intermediate-size",
        type=int,
        default=None,
        help="MLP width of the dense families (default 2 x hidden size)",
    )
    g.add_argument("--key-heads", type=int, default=4, help="GDN key heads (default 4)")
    g.add_argument(
        "--value-heads", type=int, default=8, help="GDN value heads, a multiple of the key heads (default 8)"
    )
    g.add_argument("--key-head-dim", type=int, default=32, help="GDN key head dim (default 32)")
    g.add_argument("--value-head-dim", type=int, default=32, help="GDN value head dim (default 32)")
    g.add_argument("--num-experts", type=int, default=4, help="routed experts per MoE layer (default 4)")
    g.add_argument("--experts-per-token", type=int, default=2, help="routed experts per token (default 2)")
    g.add_argument(
        "--router-aux-loss",
        type=float,
        default=0.0,
        help="MoE families: weight of the router's load-balancing loss in training (transformers' "
        "router_aux_loss_coef with output_router_logits; default 0: off, as before); the logged "
        "loss then includes it, the saved config has output_router_logits false",
    )
    g.add_argument(
        "--expert-size",
        type=int,
        default=None,
        help="intermediate size of each routed expert and the shared expert (default hidden size)",
    )
    r = p.add_argument_group("recall mix (the recall model: tests/data/trained/recall)")
    r.add_argument(
        "--recall-mix",
        type=float,
        default=0.0,
        help="share of the training windows that are recall probes (gdnprune.evaluation.probes: half "
        "passkey, half MQAR, each a whole window of --seq-len characters; default 0: text only)",
    )
    r.add_argument(
        "--init",
        type=Path,
        default=None,
        help="start from this trained model folder (same geometry) instead of random weights",
    )
    r.add_argument(
        "--answer-weight",
        type=float,
        default=1.0,
        help="loss weight of the answer characters of a probe (what recall must copy) against 1 for every "
        "other token (default 1: the plain mean)",
    )
    r.add_argument(
        "--curriculum",
        default="",
        metavar="LEN:STEPS,...",
        help="shorter windows first: e.g. 128:300 trains the first 300 steps on windows (and probes) of 128 "
        "characters, then --seq-len (default: --seq-len throughout)",
    )
    r.add_argument(
        "--recall-check-every",
        type=int,
        default=0,
        help="steps between exact-match checks on held-out probes at --seq-len (default 0: never)",
    )
    r.add_argument(
        "--recall-check-probes", type=int, default=16, help="probes of each kind per check (default 16)"
    )
    r.add_argument(
        "--recall-target",
        type=float,
        default=None,
        help="stop at the first check where the exact match of both kinds reaches this (e.g. 0.9)",
    )
    r.add_argument(
        "--gdn-decay-init",
        choices=["transformers", "mamba"],
        default="transformers",
        help="initial decay of the GatedDeltaNet state: transformers' (A ~ U(0.01, 16), dt_bias 1: the decay "
        "exp(-A * softplus(dt_bias)) makes most heads forget their state within a character) or mamba "
        "(Mamba's and the DeltaNet papers': softplus(dt_bias) log-uniform in [0.001, 0.1], A ~ U(1, 16): "
        "memories of 1 to 1000 characters; learning to copy through the state needs it). Ignored with --init",
    )
    r.add_argument(
        "--induction-init",
        action="store_true",
        help="start the first GatedDeltaNet layer as a copy circuit (see init_induction; random weights "
        "elsewhere; ignored with --init); from random weights a GDN model had not found one in 32,000 probes",
    )
    r.add_argument(
        "--induction-hold",
        type=int,
        default=0,
        metavar="STEPS",
        help="with --induction-init: keep the copy circuit (the first layer's conv, query/key/value and write "
        "projections, decay, and the digits' embeddings but for weight decay) fixed for the first STEPS steps "
        "while the rest learns to read it; the first steps' large updates otherwise erase it (default 0)",
    )
    r.add_argument(
        "--max-positions",
        type=int,
        default=None,
        help="max_position_embeddings of the config (default --seq-len, the training window)",
    )
    return p.parse_args(argv)


def model_config(
    vocab_size: int,
    eos_token_id: int,
    seq_len: int = 256,
    *,
    layer_types: str = "GGGA",
    hidden_size: int = 128,
    key_heads: int = 4,
    value_heads: int = 8,
    key_head_dim: int = 32,
    value_head_dim: int = 32,
    family: str = "qwen3_5",
    intermediate_size: int | None = None,
    num_experts: int = 4,
    experts_per_token: int = 2,
    expert_size: int | None = None,
):
    """The demo model's geometry (defaults): hidden 128, 3 GDN layers + 1 full-attention layer, ~0.9M parameters.

    Other families get the same text geometry in their own config class (MoE: ``num_experts`` routed
    experts, ``experts_per_token`` per token, expert and shared-expert widths ``expert_size``, by default
    ``hidden_size``; the vision-language model: a one-block vision tower).
    """
    import transformers

    kinds = {"G": "linear_attention", "A": "full_attention"}
    if not layer_types or set(layer_types) - set(kinds):
        raise SystemExit(f"--layer-types must be letters G and A, got {layer_types!r}")
    text = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=len(layer_types),
        layer_types=[kinds[c] for c in layer_types],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        linear_num_key_heads=key_heads,
        linear_num_value_heads=value_heads,
        linear_key_head_dim=key_head_dim,
        linear_value_head_dim=value_head_dim,
        linear_conv_kernel_dim=4,
        max_position_embeddings=seq_len,  # the training window (gdnprune score takes its default from it)
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
    )
    if not 1 <= experts_per_token <= num_experts:
        raise SystemExit(
            f"--experts-per-token must be between 1 and --num-experts ({num_experts}), got {experts_per_token}"
        )
    moe = dict(
        num_experts=num_experts,
        num_experts_per_tok=experts_per_token,
        moe_intermediate_size=expert_size or hidden_size,
        shared_expert_intermediate_size=expert_size or hidden_size,
    )
    if family == "qwen3_5":
        return transformers.Qwen3_5TextConfig(**text)
    if family == "qwen3_next":
        return transformers.Qwen3NextConfig(**text, **moe, decoder_sparse_step=1)
    if family == "qwen3_5_moe":
        return transformers.Qwen3_5MoeTextConfig(**text, **moe)
    if family == "olmo_hybrid":
        return transformers.OlmoHybridConfig(**{k: v for k, v in text.items() if k != "head_dim"})
    if family == "qwen3_5_vl":
        vision = dict(
            depth=1,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=hidden_size,
            patch_size=4,
            spatial_merge_size=2,
            temporal_patch_size=2,
            num_position_embeddings=16,
        )
        return transformers.Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True)
    raise SystemExit(f"--family must be one of {list(MODEL_CLASS)}, got {family!r}")


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warmup to ``args.lr`` then cosine decay to ``args.lr * args.min_lr_ratio`` at the last step."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    span = max(1, args.steps - args.warmup_steps)
    progress = min(1.0, (step - args.warmup_steps) / span)
    floor = args.lr * args.min_lr_ratio
    return floor + 0.5 * (args.lr - floor) * (1.0 + math.cos(math.pi * progress))


def sample_batch(
    ids: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator
) -> torch.Tensor:
    """``batch_size`` random windows of ``seq_len`` tokens from the 1-D ``ids`` (one gather, no loops)."""
    starts = torch.randint(0, ids.numel() - seq_len + 1, (batch_size, 1), generator=generator)
    return ids[starts + torch.arange(seq_len)]


def mix_recall(
    batch: torch.Tensor, share: float, seed: int, step: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Replace a ``share`` of the rows of ``batch`` by recall probes of the same length (bytes = tokens).

    Row ``i`` at ``step`` becomes probe number ``step * B + i``: passkey or MQAR alternately, generated with
    seed ``TRAIN_PROBE_SEED + seed``, so training never sees an evaluation probe (seed 0). Returns the batch
    and a mask of the answer characters of every query (the tokens recall must copy).
    """
    answers = torch.zeros(batch.shape, dtype=torch.bool)
    if share <= 0:
        return batch, answers
    rows, seq_len = batch.shape
    chosen = torch.rand(rows, generator=generator) < share
    out = batch.clone()
    for i in torch.nonzero(chosen).flatten().tolist():
        index = step * rows + i
        kind = "passkey" if index % 2 == 0 else "mqar"
        probe = probes.probe(kind, TRAIN_PROBE_SEED + seed, seq_len, index)
        out[i] = demo_data.text_to_ids(probe.text)
        for query in probe.queries:
            answers[i, len(query.context) : len(query.context) + len(query.answer)] = True
    return out, answers


def weighted_loss(
    logits: torch.Tensor, batch: torch.Tensor, answers: torch.Tensor, weight: float
) -> tuple[torch.Tensor, float]:
    """Next-token cross entropy, the targets in ``answers`` weighted ``weight`` and the others 1; and the
    mean loss of the answer targets alone (nan without any): ln 10 = 2.303 while digits are guessed."""
    losses = torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="none"
    )
    mask = answers[:, 1:].flatten()
    weights = 1.0 + (weight - 1.0) * mask.float()
    answer_loss = float(losses[mask].detach().mean()) if mask.any() else float("nan")
    return (losses * weights).sum() / weights.sum(), answer_loss


def init_gdn_decay(model: torch.nn.Module, generator: torch.Generator) -> int:
    """Mamba's decay init on every GatedDeltaNet layer (modules with ``A_log`` and ``dt_bias``): the step
    size dt = softplus(dt_bias) log-uniform in [0.001, 0.1] (dt_bias its inverse softplus) and A ~ U(1, 16),
    so the per-character decay exp(-A dt) keeps a state for 1 to ~1000 characters. Returns the layers set."""
    count = 0
    with torch.no_grad():
        for module in model.modules():
            if not (hasattr(module, "A_log") and hasattr(module, "dt_bias")):
                continue
            heads = module.dt_bias.numel()
            u = torch.rand(heads, generator=generator)
            dt = torch.exp(u * (math.log(0.1) - math.log(0.001)) + math.log(0.001))
            module.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse of softplus
            module.A_log.copy_(torch.empty(heads).uniform_(1.0, 16.0, generator=generator).log())
            count += 1
    return count


#: --induction-init: per key head, the conv taps (characters back from the current one) its key channels
#: read, split evenly over the head's channels; its queries read each one character later. Head 0 keys on the
#: previous character (copy what followed the current one), head 1 on the previous two, head 2 on the two
#: before those (an MQAR key ``ab`` across its ``:``), head 3 on the previous three.
INDUCTION_TAPS = ((1,), (2, 1), (3, 2), (3, 2, 1))


def init_induction(layer: torch.nn.Module, generator: torch.Generator, write_direction: torch.Tensor) -> None:
    """Make one GatedDeltaNet layer a copy circuit from the start (the weights stay trainable).

    The depthwise causal conv picks, per channel, one earlier character: a key head reads the characters
    of :data:`INDUCTION_TAPS`, the query the characters one later, the values the current character; queries
    and keys share one random projection, so the query at position ``t`` equals the key written where the
    same characters preceded an earlier position, and the state (the delta rule stores value per key)
    returns what came after them. Every head keeps its state for hundreds of characters (A = 1, softplus
    (dt_bias) log-uniform in [0.001, 0.01]). The write strength beta = sigmoid(b . x) reads the layer
    input's component along ``write_direction`` (a unit vector; see :func:`init_first_gdn_layer`), so the few
    facts to remember are not overwritten by the many characters around them (a 16-dim key holds a few
    associations, not a hundred).
    """
    key_dim, head_k, conv = (
        layer.key_dim,
        layer.head_k_dim,
        layer.conv1d.weight,
    )  # conv: (channels, 1, kernel)
    kernel = conv.shape[-1]
    heads = key_dim // head_k
    with torch.no_grad():
        qk = torch.randn(key_dim, layer.in_proj_qkv.in_features, generator=generator)
        qk /= math.sqrt(layer.in_proj_qkv.in_features)
        layer.in_proj_qkv.weight[:key_dim] = qk
        layer.in_proj_qkv.weight[key_dim : 2 * key_dim] = qk
        conv.zero_()
        conv[2 * key_dim :, 0, kernel - 1] = 1.0  # values: the current character
        for h in range(heads):
            taps = INDUCTION_TAPS[h % len(INDUCTION_TAPS)]
            for i in range(head_k):
                back = min(taps[i * len(taps) // head_k], kernel - 1)
                conv[key_dim + h * head_k + i, 0, kernel - 1 - back] = 1.0  # key
                conv[h * head_k + i, 0, kernel - back] = 1.0  # query: one character later
        value_heads = layer.dt_bias.numel()
        u = torch.rand(value_heads, generator=generator)
        dt = torch.exp(u * (math.log(0.01) - math.log(0.001)) + math.log(0.001))
        layer.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        layer.A_log.zero_()
        layer.in_proj_b.weight.copy_(1.5 * write_direction.expand_as(layer.in_proj_b.weight))


#: --induction-init: the characters the copy circuit writes into its state at first (the probes' answers)
WRITE_CHARACTERS = "0123456789"


def init_first_gdn_layer(model: torch.nn.Module, seed: int) -> None:
    """:func:`init_induction` on the first decoder layer (a GatedDeltaNet layer). The write gate needs
    a direction of the embedding that tells :data:`WRITE_CHARACTERS` from the rest: every embedding gets
    +0.1 (those characters) or -0.1 (every other token) times one random unit vector ``u`` (the embeddings'
    own norm is about 0.16), and beta reads ``u``: about 0.998 on a digit, 0.002 elsewhere at the start."""
    layer = model.get_decoder().layers[0]
    if not hasattr(layer, "linear_attn"):
        raise SystemExit("--induction-init needs a GatedDeltaNet first layer (--layer-types G...)")
    generator = torch.Generator().manual_seed(seed)
    embedding = model.get_input_embeddings().weight
    u = torch.randn(embedding.shape[1], generator=generator)
    u /= u.norm()
    sign = -torch.ones(embedding.shape[0])
    sign[demo_data.text_to_ids(WRITE_CHARACTERS)] = 1.0
    with torch.no_grad():
        embedding += 0.1 * sign.unsqueeze(1) * u
    init_induction(layer.linear_attn, generator, u)


def circuit_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The weights :func:`init_induction` sets in the first layer (what --induction-hold keeps fixed)."""
    layer = model.get_decoder().layers[0].linear_attn
    return [layer.conv1d.weight, layer.in_proj_qkv.weight, layer.in_proj_b.weight, layer.A_log, layer.dt_bias]


def parse_curriculum(text: str, seq_len: int) -> list[tuple[int, int]]:
    """``128:300,192:200`` -> [(128, 300), (192, 200)]: window lengths of the first steps (then ``seq_len``)."""
    phases = []
    for part in filter(None, (x.strip() for x in text.split(","))):
        length, _, steps = part.partition(":")
        try:
            phases.append((int(length), int(steps)))
        except ValueError:
            raise SystemExit(
                f"--curriculum must be LEN:STEPS pairs separated by commas, got {text!r}"
            ) from None
    if any(not 2 <= n <= seq_len or k < 1 for n, k in phases):
        raise SystemExit(f"--curriculum lengths must lie in [2, --seq-len] and steps be >= 1, got {text!r}")
    return phases


def seq_len_at(step: int, phases: list[tuple[int, int]], seq_len: int) -> int:
    """The window length at ``step`` under the curriculum ``phases``."""
    for length, steps in phases:
        if step < steps:
            return length
        step -= steps
    return seq_len


@torch.no_grad()
def recall_exact_match(model: torch.nn.Module, length: int, count: int) -> dict[str, float]:
    """Greedy exact match of every query of ``count`` held-out probes of each kind (seed
    ``CHECK_PROBE_SEED``), as the eval's passkey and mqar tasks score it: every answer token is the argmax."""
    was_training = model.training
    model.eval()
    out = {}
    for kind in ("passkey", "mqar"):
        batch = [probes.probe(kind, CHECK_PROBE_SEED, length, i) for i in range(count)]
        ids = torch.stack([demo_data.text_to_ids(p.text) for p in batch])
        greedy = model(input_ids=ids, use_cache=False).logits.argmax(-1)
        hits = [
            bool(
                (
                    greedy[row, len(q.context) - 1 : len(q.context) + len(q.answer) - 1]
                    == ids[row, len(q.context) : len(q.context) + len(q.answer)]
                ).all()
            )
            for row, p in enumerate(batch)
            for q in p.queries
        ]
        out[kind] = sum(hits) / len(hits)
    model.train(was_training)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.steps < 1 or args.batch_size < 1 or args.seq_len < 2:
        raise SystemExit("--steps, --batch-size must be >= 1 and --seq-len >= 2")
    torch.set_num_threads(args.threads)
    phases = parse_curriculum(args.curriculum, args.seq_len)
    if args.recall_mix > 0 and min([args.seq_len, *(n for n, _ in phases)]) < probes.MIN_LENGTH:
        raise SystemExit(f"--recall-mix needs windows of at least {probes.MIN_LENGTH} characters")
    if args.answer_weight != 1.0 and args.router_aux_loss:
        raise SystemExit("--answer-weight and --router-aux-loss cannot be combined")

    import transformers

    tokenizer = demo_data.build_byte_tokenizer()
    train_ids = demo_data.text_to_ids(demo_data.train_text(args.corpus))
    # Fixed train windows, scored exactly like validation, for a comparable final train loss.
    train_eval_text = demo_data.train_text(args.corpus)
    val_text = demo_data.validation_text(args.corpus)

    torch.manual_seed(args.seed)
    config = model_config(
        len(tokenizer),
        tokenizer.eos_token_id,
        args.max_positions or args.seq_len,
        layer_types=args.layer_types,
        hidden_size=args.hidden_size,
        key_heads=args.key_heads,
        value_heads=args.value_heads,
        key_head_dim=args.key_head_dim,
        value_head_dim=args.value_head_dim,
        family=args.family,
        intermediate_size=args.intermediate_size,
        num_experts=args.num_experts,
        experts_per_token=args.experts_per_token,
        expert_size=args.expert_size,
    )
    if args.router_aux_loss:
        if not hasattr(config, "router_aux_loss_coef"):
            raise SystemExit(f"--router-aux-loss needs an MoE family, got {args.family}")
        config.router_aux_loss_coef = args.router_aux_loss
    model = getattr(transformers, MODEL_CLASS[args.family])(config)
    if args.gdn_decay_init == "mamba" and args.init is None:
        init_gdn_decay(model, torch.Generator().manual_seed(args.seed))
    if args.induction_init and args.init is None:
        init_first_gdn_layer(model, args.seed + 1)
    if args.init is not None:  # continue from a trained model of the same geometry (its weights, this config)
        start = getattr(transformers, MODEL_CLASS[args.family]).from_pretrained(
            args.init, dtype=torch.float32
        )
        model.load_state_dict(start.state_dict())
    n_params = sum(p.numel() for p in model.parameters())
    layer_types = config.get_text_config(decoder=True).layer_types
    print(f"{type(model).__name__}: {n_params} parameters, layer_types={layer_types}", flush=True)
    print(
        f"corpus {args.corpus}: {len(train_eval_text.encode())} train bytes, "
        f"{len(val_text.encode())} validation bytes, sha256 {demo_data.corpus_sha256(args.corpus)[:16]}...",
        flush=True,
    )

    held = (
        set(map(id, circuit_parameters(model))) if args.induction_init and args.induction_hold > 0 else set()
    )
    decay = [p for p in model.parameters() if p.dim() >= 2 and id(p) not in held]
    no_decay = [p for p in model.parameters() if p.dim() < 2 and id(p) not in held]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if held:  # its own group: lr 0 while held (AdamW's decay is lr-scaled, so nothing moves)
        groups.append({"params": circuit_parameters(model), "weight_decay": 0.0, "held": True})
    optimizer = torch.optim.AdamW(
        groups,
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    generator = torch.Generator().manual_seed(args.seed)
    holding = [bool(held)]  # read by the hook below; cleared when the hold ends
    if held:  # the written characters' embeddings too: text training makes the digits' alike (cosine 0.95)
        rows = demo_data.text_to_ids(WRITE_CHARACTERS)
        model.get_input_embeddings().weight.register_hook(
            lambda grad: grad.index_fill(0, rows, 0.0) if holding[0] else grad
        )

    history: list[dict] = []
    checks: list[dict] = []
    recent: list[float] = []
    recent_answer: list[float] = []
    t_start = time.perf_counter()
    model.train()
    for step in range(args.steps):
        lr = lr_at(step, args)
        holding[0] = bool(held) and step < args.induction_hold
        for group in optimizer.param_groups:
            group["lr"] = 0.0 if group.get("held") and holding[0] else lr
        seq_len = seq_len_at(step, phases, args.seq_len)
        batch = sample_batch(train_ids, args.batch_size, seq_len, generator)
        batch, answers = mix_recall(batch, args.recall_mix, args.seed, step, generator)
        answer_loss = float("nan")
        if args.recall_mix > 0 and not args.router_aux_loss:  # (the two cannot combine: checked above)
            logits = model(input_ids=batch, use_cache=False).logits
            loss, answer_loss = weighted_loss(logits, batch, answers, args.answer_weight)
        else:
            loss = model(
                input_ids=batch,
                labels=batch,
                use_cache=False,
                **({"output_router_logits": True} if args.router_aux_loss else {}),
            ).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        recent = (recent + [loss.item()])[-20:]
        if not math.isnan(answer_loss):
            recent_answer = (recent_answer + [answer_loss])[-20:]
        done = step + 1
        if done % args.log_every == 0 or done == args.steps:
            elapsed = time.perf_counter() - t_start
            print(
                f"step {done:5d}/{args.steps}  loss {loss.item():.4f}  avg20 {sum(recent) / len(recent):.4f}  "
                f"lr {lr:.2e}  gnorm {float(grad_norm):.2f}  {elapsed:6.1f}s"
                + (f"  answer avg20 {sum(recent_answer) / len(recent_answer):.3f}" if recent_answer else ""),
                flush=True,
            )
        if args.recall_check_every > 0 and done % args.recall_check_every == 0:
            recall = recall_exact_match(model, args.seq_len, args.recall_check_probes)
            checks.append({"step": done, **recall})
            print(f"step {done:5d}  exact match at {args.seq_len}: {json.dumps(recall)}", flush=True)
            if args.recall_target is not None and min(recall.values()) >= args.recall_target:
                print(f"step {done:5d}  recall target {args.recall_target} reached: stopping", flush=True)
                break
        if args.eval_every > 0 and (done % args.eval_every == 0) and done != args.steps:
            val = demo_data.validation_loss(model, text=val_text)
            history.append(
                {"step": done, "validation_loss": val, "train_loss_avg20": sum(recent) / len(recent)}
            )
            print(f"step {done:5d}  validation loss {val:.4f} nats/byte", flush=True)
    train_seconds = time.perf_counter() - t_start

    model.eval()
    if args.save_dtype == "bfloat16":  # measure the model as written: weights rounded to bf16, run in fp32
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).float())
    val = demo_data.validation_loss(model, text=val_text)
    val_full = demo_data.validation_loss(model, num_windows=None, text=val_text)
    train_eval = demo_data.validation_loss(model, text=train_eval_text)
    history.append({"step": done, "validation_loss": val, "train_loss_avg20": sum(recent) / len(recent)})
    final_recall = None
    if args.recall_check_every > 0:  # on the model as written
        final_recall = recall_exact_match(model, args.seq_len, args.recall_check_probes)
        print(f"final: exact match at {args.seq_len}: {json.dumps(final_recall)}", flush=True)
    print(
        f"final: validation {val:.4f} (all windows {val_full:.4f}), train {train_eval:.4f} nats/byte, "
        f"train time {train_seconds:.1f}s",
        flush=True,
    )

    record = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]) if argv is None else " ".join(argv),
        "family": args.family,
        "model_class": type(model).__name__,
        "seed": args.seed,
        "steps": args.steps,
        "hyperparameters": {
            "optimizer": "AdamW",
            "lr": args.lr,
            "betas": [0.9, 0.95],
            "eps": 1e-8,
            "weight_decay": args.weight_decay,
            "weight_decay_applies_to": "parameters with dim >= 2",
            "schedule": "linear warmup then cosine decay to lr * min_lr_ratio",
            "warmup_steps": args.warmup_steps,
            "min_lr_ratio": args.min_lr_ratio,
            "batch_size": args.batch_size,
            "seq_len": args.seq_len,
            "grad_clip": args.grad_clip,
            "threads": args.threads,
        },
        "recall_mix": args.recall_mix,
        "answer_weight": args.answer_weight,
        "curriculum": phases,
        "gdn_decay_init": None if args.init is not None else args.gdn_decay_init,
        "induction_init": args.induction_init and args.init is None,
        "induction_hold": args.induction_hold if args.induction_init and args.init is None else 0,
        "steps_done": done,
        "recall_checks": checks,
        "recall_exact_match": final_recall,
        "recall_check_seed": CHECK_PROBE_SEED,
        "init": None if args.init is None else str(args.init),
        "num_parameters": n_params,
        "saved_dtype": args.save_dtype,
        "corpus": {
            "name": args.corpus,
            "source": {
                "pydoc": "pydoc_data.topics.topics (sorted keys, joined by a blank line)",
                "docstrings": "docstrings of the standard library's source files (ast; sorted paths)",
            }[args.corpus],
            "sha256": demo_data.corpus_sha256(args.corpus),
            "block_chars": demo_data.BLOCK_CHARS,
            "validation_every": demo_data.VALIDATION_EVERY,
            "train_bytes": len(train_eval_text.encode()),
            "validation_bytes": len(val_text.encode()),
        },
        "metric": (
            "gdnprune.demo_data.validation_loss: mean next-byte cross entropy in nats/byte over "
            f"{demo_data.DEFAULT_NUM_WINDOWS} evenly spaced non-overlapping windows of "
            f"{demo_data.DEFAULT_SEQ_LEN} bytes"
        ),
        "validation_loss": val,
        "validation_loss_all_windows": val_full,
        "train_loss": train_eval,
        "train_loss_last20_batches": sum(recent) / len(recent),
        "history": history,
        "train_wall_seconds": round(train_seconds, 1),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
    }

    out = args.out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        if args.save_dtype == "bfloat16":
            model.to(torch.bfloat16)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "training.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        os.chmod(tmp, 0o755)
        old = None
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            out.rename(old)
        tmp.rename(out)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"wrote {out} ({size / 1e6:.2f} MB): {sorted(f.name for f in out.iterdir())}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
