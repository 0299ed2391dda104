"""``gdnprune distill STUDENT --teacher TEACHER --data TRAIN --output OUT``: recover a pruned model by logit KD."""

from __future__ import annotations

import signal
import sys

from ._options import positive_int
from ._runtime import add_runtime_arguments, model_runtime

NAME = "distill"
HELP = "recover a pruned model by knowledge distillation from its unpruned teacher"


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        NAME, help=HELP,
        description="Train the student (a pruned checkpoint, uniform or per-layer) to match the next-token "
                    "distribution of the teacher (the unpruned model): forward KL at --temperature, optionally "
                    "mixed with the LM loss. Runs on the transformers Trainer: torchrun / accelerate launch run it "
                    "on several processes; checkpoints every --save-every steps; --resume continues an "
                    "interrupted run; Ctrl-C saves and stops. Writes the trained model, distill_log.json and "
                    "distill_loss.png into OUT.",
    )
    p.add_argument("student", metavar="STUDENT", help="the model folder to train (e.g. gdnprune prune's output)")
    p.add_argument("--teacher", required=True, metavar="TEACHER", help="the unpruned model folder")
    p.add_argument("--data", required=True, metavar="FILE", help="training text (UTF-8 or JSONL with \"text\")")
    p.add_argument("--output", "-o", required=True, metavar="OUT_DIR", help="folder to write")
    p.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it is an earlier output")
    g = p.add_argument_group("length of the run (one of)")
    length = g.add_mutually_exclusive_group(required=True)
    length.add_argument("--steps", type=positive_int, help="optimizer steps")
    length.add_argument("--tokens", type=positive_int, help="training tokens (rounded up to whole steps)")
    o = p.add_argument_group("optimisation")
    o.add_argument("--lr", type=float, default=1e-4, help="peak learning rate (default 1e-4; 1e-3 suits tiny models)")
    o.add_argument("--lr-schedule", default="cosine", help="transformers schedule name (default cosine)")
    o.add_argument("--warmup", type=float, default=0.0, help="warmup steps, or a fraction of the steps (default 0)")
    o.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (default 0)")
    o.add_argument("--batch-size", type=positive_int, default=16, help="windows per step, over all processes (16)")
    o.add_argument("--micro-batch-size", type=positive_int, default=None,
                   help="windows per forward pass and process (gradient accumulation for the rest)")
    o.add_argument("--seq-len", type=positive_int, default=None,
                   help="tokens per window (default: the student's max_position_embeddings, at most 2048)")
    o.add_argument("--num-samples", type=positive_int, default=None, help="training windows (default: all)")
    o.add_argument("--seed", type=int, default=0, help="seed of the data order (default 0)")
    o.add_argument("--bf16", action="store_true", help="train in bf16 mixed precision")
    k = p.add_argument_group("loss")
    k.add_argument("--temperature", type=float, default=1.0, help="KD temperature (default 1)")
    k.add_argument("--kd-weight", type=float, default=1.0, help="weight of the KL term (default 1: pure KD)")
    k.add_argument("--lm-weight", type=float, default=0.0, help="weight of the LM loss (default 0)")
    e = p.add_argument_group("evaluation and checkpoints")
    e.add_argument("--eval-data", metavar="FILE", help="held-out text for the eval loss")
    e.add_argument("--eval-samples", type=positive_int, default=None, help="held-out windows (default: all)")
    e.add_argument("--eval-every", type=positive_int, default=None, help="steps between evaluations")
    e.add_argument("--save-every", type=positive_int, default=None, help="steps between checkpoints (default: 1/10)")
    e.add_argument("--keep-checkpoints", type=positive_int, default=1, help="checkpoints kept (default 1)")
    e.add_argument("--resume", action="store_true", help="continue from the last checkpoint in OUT_DIR")
    add_runtime_arguments(p)
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar, no notes")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..distill import distill_checkpoint

    options = dict(steps=args.steps, tokens=args.tokens, lr=args.lr, lr_schedule=args.lr_schedule, warmup=args.warmup,
                   weight_decay=args.weight_decay, batch_size=args.batch_size, micro_batch_size=args.micro_batch_size,
                   seed=args.seed, bf16=args.bf16, temperature=args.temperature, kd_weight=args.kd_weight,
                   lm_weight=args.lm_weight, eval_every=args.eval_every, save_every=args.save_every,
                   keep_checkpoints=args.keep_checkpoints, resume=args.resume, overwrite=args.overwrite,
                   progress=not args.quiet)
    with model_runtime(args):
        result = distill_checkpoint(args.student, args.teacher, args.data, args.output, seq_len=args.seq_len,
                                    num_samples=args.num_samples, eval_data=args.eval_data,
                                    eval_samples=args.eval_samples, **options)
    if result.get("interrupted"):
        name = result.get("signal") or "SIGINT"
        print(f"gdnprune distill: interrupted by {name} at step {result['steps']}; saved {result.get('checkpoint')}; "
              f"continue with the same command and --resume", file=sys.stderr)
        return 128 + int(getattr(signal, name, signal.SIGINT))
    last = result.get("train_loss")
    evals = result.get("eval") or {}
    loss = evals.get("kd_loss") if args.kd_weight else evals.get("lm_loss")
    print(f"gdnprune distill: {result['steps']} steps, {result['tokens']:,} tokens"
          + (f", train loss {last:.4f}" if isinstance(last, float) else "")
          + (f", eval loss {loss:.4f}" if isinstance(loss, float) else "") + f" in {result['seconds']:.0f} s -> "
          f"{args.output}" + (f" (log {result['log']}, plot {result['plot']})" if result.get("plot") else ""))
    return 0
