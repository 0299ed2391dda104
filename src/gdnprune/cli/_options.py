"""Option groups and argument types shared by several commands."""

from __future__ import annotations

import argparse
import os
import warnings

from ..model.targets import TARGET_FIELDS, TargetError


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """An argparse type: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def _number(text: str, *, positive: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value > 0 if positive else value >= 0) or value == float("inf"):
        raise argparse.ArgumentTypeError(
            f"expected a finite number {'>' if positive else '>='} 0, got {text!r}"
        )
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    return _number(text, positive=True)


def non_negative_float(text: str) -> float:
    """An argparse type: a finite number >= 0."""
    return _number(text, positive=False)


def add_output_arguments(
    p, *, metavar: str = "OUT_DIR", help: str = "folder to create", required: bool = True, folder: bool = True
) -> None:
    """``-o/--output``, ``--overwrite`` and ``-q/--quiet``, the same on every command that writes something
    (a folder, or a file with ``folder=False``)."""
    p.add_argument("--output", "-o", required=required, metavar=metavar, help=help)
    p.add_argument(
        "--overwrite",
        action="store_true",
        help=f"replace {metavar} if it exists" + (" (only an earlier output)" if folder else ""),
    )
    add_quiet_argument(p)


def deprecated(old: str, new: str) -> None:
    """Say (as a warning line) that ``old`` is a deprecated spelling of ``new``; the option still works."""

    warnings.warn(f"{old} is deprecated and will be removed; use {new}", UserWarning, stacklevel=2)


def add_deprecated_alias(p, old: str, dest: str, new: str, convert=None, **kwargs) -> None:
    """A hidden option ``old`` that stores into ``dest`` and says (a warning line) that ``new`` is its name now;
    ``convert`` turns the old option's value into the new one's (for an old option that took another kind of
    value; with ``nargs=0``, a flag, it receives ``[]``)."""

    class Alias(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            deprecated(old, new)
            setattr(namespace, self.dest, values if convert is None else convert(values))

    p.add_argument(old, dest=dest, action=Alias, help=argparse.SUPPRESS, default=argparse.SUPPRESS, **kwargs)


def add_gpu_argument(p) -> None:
    """``--gpu NAME``: the GPU an estimate predicts for."""
    p.add_argument(
        "--gpu",
        default=None,
        choices=("h100", "h200", "a100"),
        help="the GPU an estimate predicts for (default: the CPU; an h100 with --device cuda)",
    )


#: --dry-run's help, one for every command
DRY_RUN_HELP = (
    "print what the run will cost (FLOPs, bytes, memory per process, time; as `gdnprune estimate`) and exit "
    "without loading a model"
)


def add_dry_run_arguments(p) -> None:
    """``--dry-run`` (print the estimate of the command's stages for its options, load nothing, exit 0) and the
    GPU it predicts for."""
    g = p.add_argument_group("dry run")
    g.add_argument("--dry-run", action="store_true", help=DRY_RUN_HELP)
    add_gpu_argument(g)


def add_quiet_argument(p) -> None:
    """``-q/--quiet``."""
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bars and no notes")


def add_self_contained_argument(p) -> None:
    """``--self-contained``, on the commands that write a model folder through the streaming engine."""
    p.add_argument(
        "--self-contained",
        dest="self_contained",
        action="store_true",
        help="also write a small modeling file and auto_map into OUT_DIR, so that a folder whose layers "
        "differ (per_layer_config) loads with plain AutoModelForCausalLM.from_pretrained(OUT_DIR, "
        "trust_remote_code=True) where gdnprune is not installed",
    )


def add_target_arguments(p) -> None:
    """The nested-target options shared by ``gdnprune slice`` and ``gdnprune prune``."""
    p.add_argument(
        "--num-key-heads",
        dest="num_key_heads",
        type=positive_int,
        metavar="N",
        help="key heads (= key groups) to keep per GDN layer",
    )
    p.add_argument(
        "--num-value-heads",
        dest="num_value_heads",
        type=positive_int,
        metavar="N",
        help="value heads to keep per GDN layer: the total, a multiple of the key heads",
    )
    p.add_argument(
        "--key-head-dim",
        dest="key_head_dim",
        type=positive_int,
        metavar="N",
        help="channels to keep per key head",
    )
    p.add_argument(
        "--value-head-dim",
        dest="value_head_dim",
        type=positive_int,
        metavar="N",
        help="channels to keep per value head",
    )


def add_plan_arguments(p) -> None:
    """``--plan`` and the serving constraints, for ``gdnprune slice`` and ``gdnprune prune``."""
    p.add_argument(
        "--plan",
        metavar="PLAN.json",
        help="per-layer targets (gdnprune plan writes one) instead of --num-key-heads etc.",
    )
    add_constraint_arguments(p)


def add_constraint_arguments(p) -> None:
    """``--tp`` and ``--multiple-of``."""
    p.add_argument(
        "--tp",
        type=positive_int,
        default=None,
        metavar="N",
        help="tensor-parallel degree of the server: every layer's key and value heads divisible by N",
    )
    p.add_argument(
        "--multiple-of",
        dest="multiple_of",
        type=positive_int,
        default=None,
        metavar="M",
        help="head dims must be multiples of M (16 suits flash-linear-attention's kernels)",
    )
    add_snap_quant_argument(p)


def add_snap_quant_argument(p) -> None:
    """``--snap-quant N`` (``gdnprune plan``, ``slice`` and ``prune``)."""
    p.add_argument(
        "--snap-quant",
        dest="snap_quant",
        type=positive_int,
        default=None,
        metavar="N",
        help="every width a cut changes (GDN key and value widths, MLP channels, attention heads; a width "
        "left whole stays) a multiple of N, so that every matrix it cuts fits the tiles or groups of "
        "`gdnprune quantize` at size N (e.g. 128): a plan search (--budget-*) takes only such candidates; "
        "a target or --plan is snapped up to the nearest such widths. The hidden size is not snapped",
    )


def target_from_args(args, *, required: bool = True) -> dict[str, int] | None:
    """The target fields given on the command line (an axis not given keeps its size)."""
    target = {f: getattr(args, f) for f in TARGET_FIELDS if getattr(args, f) is not None}
    if getattr(args, "plan", None) is not None:
        if target:
            raise TargetError("give a target (--num-key-heads, ...) or --plan, not both")
        return None
    if not target and required:
        raise TargetError(
            "nothing to slice: give at least one of --num-key-heads, --num-value-heads, "
            "--key-head-dim, --value-head-dim, or --plan"
        )
    return target or None


def shard_spec(text: str) -> tuple[int, int]:
    """An argparse type: ``i/n``, share ``i`` of ``n`` (0 <= i < n)."""
    index, sep, count = text.partition("/")
    try:
        i, n = int(index), int(count)
    except ValueError:
        i = n = -1
    if not sep or n < 1 or not 0 <= i < n:
        raise argparse.ArgumentTypeError(
            f"expected i/n with 0 <= i < n (share i of n, e.g. 0/4), got {text!r}"
        )
    return i, n


def positive_seconds(text: str) -> float:
    """An argparse type: a number of seconds > 0."""
    try:
        return _number(text, positive=True)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}") from None


def add_distributed_arguments(p) -> None:
    """``--dist-timeout`` of the commands that run under ``torchrun`` / ``accelerate launch``."""
    p.add_argument(
        "--dist-timeout",
        type=positive_seconds,
        default=1800.0,
        metavar="SECONDS",
        help="under torchrun or accelerate launch: how long a rank waits for the others at a "
        "synchronisation point before it gives up with an error (default 1800)",
    )


def add_calibration_arguments(
    p, *, data_required: bool = True, num_samples: int = 128, purpose: str = "scoring", method: bool = True
) -> None:
    """``--data`` and ``--num-samples`` (and ``--method``, ``--seed`` with ``method``), then the forward-pass
    options of :func:`add_forward_arguments`; for ``score``, ``plan`` and ``prune``.

    ``--num-samples`` is the number of calibration windows of the command's own stage, so its default is
    per command: scoring sums statistics over many windows (128), the measured sensitivity of ``plan`` runs
    a forward per candidate width and layer, so it uses fewer (16).
    """
    add_data_arguments(p, required=data_required)
    if method:
        p.add_argument(
            "--method",
            choices=("projection", "activation", "random"),
            default="projection",
            help="projection (default): output-projection Gram + greedy removal; activation: "
            "Minitron-style magnitudes; random: seeded random orders",
        )
    p.add_argument(
        "--num-samples",
        type=positive_int,
        default=num_samples,
        metavar="N",
        help=f"calibration windows for {purpose} (default {num_samples}); the first ones of the corpus",
    )
    add_forward_arguments(p)
    if method:
        p.add_argument("--seed", type=int, default=0, help="seed of --method random (default 0)")


def add_device_arguments(p) -> None:
    """``--device``, ``--dtype``: where the model runs and in which dtype (every command that runs one)."""
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda when available, else cpu)")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="weights dtype for the forward passes (default float32)",
    )


def add_forward_arguments(p) -> None:
    """``--seq-len``, ``--batch-size``, ``--device``, ``--dtype``, ``--device-map``: how the model runs."""
    p.add_argument(
        "--seq-len",
        type=positive_int,
        default=None,
        metavar="N",
        help="tokens per window (default: what the model supports, max_position_embeddings or the "
        "tokenizer's model_max_length, at most 512)",
    )
    p.add_argument(
        "--batch-size", type=positive_int, default=4, metavar="N", help="windows per forward pass (default 4)"
    )
    add_device_arguments(p)
    p.add_argument(
        "--device-map",
        choices=("auto", "balanced", "balanced_low_0", "sequential"),
        default=None,
        help="spread the model over the GPUs and CPU of this machine through accelerate",
    )


def add_lane_search_arguments(g) -> None:
    """``--lane-search`` and ``--lane-search-samples`` of ``score`` and ``prune`` (``--refine lanes`` and
    ``--refine-samples`` are their deprecated spellings)."""
    g.add_argument(
        "--lane-search",
        action="store_true",
        help="decide the lane orders by measured KL (real forwards, a few times the scoring cost) "
        "instead of the loss-aware Gram",
    )
    g.add_argument(
        "--lane-search-samples",
        type=positive_int,
        default=16,
        metavar="N",
        help="calibration windows the lane search measures on (default 16)",
    )
    add_deprecated_alias(
        g, "--refine", "lane_search", "--lane-search", convert=lambda value: True, choices=("lanes",)
    )
    add_deprecated_alias(
        g, "--refine-samples", "lane_search_samples", "--lane-search-samples", type=positive_int
    )


#: every kind of block (``--blocks``), as ``plan`` names them; the default of ``plan`` and ``prune``
BLOCKS = "gdn,attention,mlp,shared_expert,experts,depth,hidden"
#: the default of ``score``: every kind but the hidden channels (a sort by their order rewrites every tensor;
#: ``prune`` scores them itself where its plan may cut the hidden size)
SCORE_BLOCKS = "gdn,attention,mlp,shared_expert,experts,depth"


def add_blocks_argument(p, help: str, default: str = BLOCKS) -> None:
    """``--blocks LIST``: the kinds of block a command works on (default every kind the model has)."""
    p.add_argument("--blocks", default=default, metavar="LIST", help=help)


def blocks_from_args(args) -> list[str]:
    """The kinds of block of ``--blocks LIST``."""
    return [b.strip() for b in args.blocks.split(",") if b.strip()]


def scoring_options(args) -> dict:
    """The keyword arguments of :func:`gdnprune.scoring.score_checkpoint` given by the calibration options."""
    return dict(
        method=args.method,
        num_samples=args.num_samples,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        device=args.device,
        dtype=args.dtype,
        device_map=args.device_map,
        seed=args.seed,
    )


def summary(manifest: dict, out: str) -> str:
    """One line about a written output folder."""
    layers = manifest["layers"]
    target = manifest.get("target")
    cut = any(layer["target"] != layer["shape"] for layer in layers.values())
    what = f"cut to {target}" if target else "cut layer by layer (per_layer_config)" if cut else "permuted"
    also = f", self-contained ({manifest['self_contained']})" if manifest.get("self_contained") else ""
    subs = f" and {len(manifest['blocks'])} sub-blocks" if manifest.get("blocks") else ""
    return (
        f"wrote {out}: {len(layers)} GDN layers{subs} {what}, sorted: {manifest['sorted']}{also} "
        f"({manifest['elapsed_seconds']:.1f} s)"
    )


DATA_FORMS = (
    "files, folders and globs: .txt, .jsonl, .jsonl.gz/.zst, .parquet, .arrow, save_to_disk folders "
    "(docs/data.md)"
)


def add_data_arguments(
    p, *, required: bool = True, what: str = "calibration text", eval_data: bool = False, cache: bool = False
) -> None:
    """``--data SOURCE...``, ``--data-weights W...`` and ``--text-field NAME`` (with ``eval_data``:
    ``--eval-data SOURCE...``; with ``cache``: ``--data-cache DIR``), the same on every command that reads a
    corpus. A mixture is ``--data A B --data-weights 0.3 0.7``: weights in their own option, so no file
    name can be mistaken for a weight."""
    p.add_argument(
        "--data",
        nargs="+",
        action="extend",
        required=required,
        metavar="SOURCE",
        help=f"{what}: one or more {DATA_FORMS}; several are read in order as one corpus",
    )
    p.add_argument(
        "--data-weights",
        dest="data_weights",
        nargs="+",
        metavar="W",
        default=None,
        help="make the --data sources a mixture: one weight > 0 per source, in the same order (they "
        "need not sum to 1); windows are interleaved by weight until the first source runs out",
    )
    p.add_argument(
        "--text-field",
        dest="text_field",
        default="text",
        metavar="NAME",
        help="the column that holds a row's text (default text); rows without it but with a messages "
        "list are rendered with the tokenizer's chat template",
    )
    if eval_data:
        p.add_argument(
            "--eval-data",
            dest="eval_data",
            nargs="+",
            action="extend",
            metavar="SOURCE",
            default=None,
            help=f"held-out text for the eval loss: {DATA_FORMS}",
        )
    if cache:
        p.add_argument(
            "--data-cache",
            dest="data_cache",
            metavar="DIR",
            default=None,
            help="where the tokenised windows are kept and reused (default: data-cache inside the output "
            "folder)",
        )


def data_from_args(args, *, eval_data: bool = False):
    """The corpus of ``--data`` (or ``--eval-data``) as a :class:`gdnprune.corpus.DataSpec`; None when not
    given. Raises :class:`gdnprune.corpus.MixtureError` for weights that do not fit (naming the flags)."""
    from ..corpus import MixtureError, data_spec  # lazy: `gdnprune --help` imports no datasets

    sources = getattr(args, "eval_data" if eval_data else "data", None)
    if sources is None:
        return None
    weights = None if eval_data else getattr(args, "data_weights", None)
    if weights is not None and len(weights) != len(sources):
        raise MixtureError(
            f"--data-weights: expected one weight per --data source ({len(sources)}), found {len(weights)}"
        )
    try:
        return data_spec(sources, weights=weights, text_field=getattr(args, "text_field", None))
    except MixtureError as exc:
        raise MixtureError(f"--data-weights: {exc}") from None


def checked_data(args, *, eval_data: bool = False, tokenizer_dir=None):
    """:func:`data_from_args`, checked cheaply (:func:`gdnprune.corpus.check_data`: files, UTF-8, schema,
    first rows; conversations against the chat template of ``tokenizer_dir``'s tokenizer when it has one)
    before any model is loaded; None when not given."""
    from ..corpus import check_data  # lazy: `gdnprune --help` imports no datasets

    spec = data_from_args(args, eval_data=eval_data)
    if spec is None:
        return None
    tokenizer = None
    if tokenizer_dir is not None and os.path.isdir(tokenizer_dir):
        from transformers import AutoTokenizer  # lazy: only commands that read text load a tokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        except (OSError, ValueError):
            tokenizer = None  # the command itself says what is wrong with the folder
    check_data(spec, tokenizer=tokenizer)
    return spec
