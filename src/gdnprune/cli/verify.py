"""``gdnprune verify MODEL_A MODEL_B``: compare the logits of two checkpoints; exit 1 beyond tolerance."""

from __future__ import annotations

from ._options import (
    add_data_arguments,
    add_deprecated_alias,
    add_quiet_argument,
    checked_data,
    non_negative_float,
    positive_int,
)
from ._runtime import add_runtime_arguments, model_runtime

NAME = "verify"
HELP = "compare the logits of two checkpoints"


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        NAME,
        help=HELP,
        description="Load both folders with transformers (fp32), run the same tokens and "
        "print the max and mean absolute logit difference and each model's "
        "loss. Exit 0 within tolerance, 1 otherwise.",
    )
    p.add_argument("model_a", metavar="MODEL_A", help="a model folder (its tokenizer tokenises --data)")
    p.add_argument("model_b", metavar="MODEL_B", help="the model folder to compare with (same vocabulary)")
    add_data_arguments(p, required=False, what="text to run (default: seeded random token ids)")
    p.add_argument(
        "--tolerance",
        type=non_negative_float,
        default=1e-4,
        metavar="X",
        help="max |logit diff| allowed (default 1e-4)",
    )
    p.add_argument(
        "--seq-len", type=positive_int, default=128, metavar="N", help="tokens per window (default 128)"
    )
    p.add_argument(
        "--num-samples", type=positive_int, default=4, metavar="N", help="windows to run (default 4)"
    )
    add_deprecated_alias(p, "--num-sequences", "num_samples", "--num-samples", type=positive_int)
    p.add_argument("--seed", type=int, default=0, help="seed of the random token ids (default 0)")
    add_runtime_arguments(p)
    add_quiet_argument(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from ..checkpoint import verify_checkpoints  # lazy: fast --help

    with model_runtime(args):
        data = checked_data(args, tokenizer_dir=args.model_a)
        r = verify_checkpoints(
            args.model_a,
            args.model_b,
            data=data,
            tolerance=args.tolerance,
            seq_len=args.seq_len,
            num_samples=args.num_samples,
            seed=args.seed,
        )
    print(f"tokens: {r['tokens'][0]} x {r['tokens'][1]} ({r['token_source']})")
    print(f"loss A: {r['loss_a']:.6f}  ({r['model_a']})")
    print(f"loss B: {r['loss_b']:.6f}  ({r['model_b']})")
    verdict = "OK" if r["within_tolerance"] else "EXCEEDS tolerance"
    print(
        f"max |logit diff|: {r['max_abs_diff']:.3e}  mean: {r['mean_abs_diff']:.3e}  "
        f"tolerance: {r['tolerance']:.1e}  {verdict}"
    )
    return 0 if r["within_tolerance"] else 1
