#!/usr/bin/env python
"""Variants of the measured greedy expert removal (issue 31), uniform cuts: which error should the greedy
minimise?

One scoring pass (64 training windows of 256 bytes, batches of 8; the library's statistics) and one pass
with the loss's backward on the same windows, which keeps, at the sampled tokens (every 4th position, the
library's sample), each MoE layer's input, the gradient of the windows' next-byte loss with respect to the
layer's routed-experts output (exact, through every later layer) and the gradient at the final norm's
input. Orders, per MoE layer:

* ``frequency``, ``removal_frequency`` (the default): the library's;
* ``greedy``: the library's measured greedy (squared change of the routed output);
* ``greedy_loss``: the same greedy on the squared first-order loss change ``(g(t) . delta o(t))^2``,
  ``g`` the exact gradient at the layer's routed output (an empirical-Fisher weight, rank 1 per token);
* ``greedy_final``: the same with ``g`` the gradient at the final norm's input (the residual path alone,
  what a forward-only scorer could keep);
* ``..._x_freq``: each greedy step's increase times the expert's frequency.

Every MoE layer keeps the first 8 and 4 of 16 experts of each order; loss per held-out window
(``window_losses``), paired differences with frequency.

    python benchmarks/expert_greedy_variants.py MODEL_DIR --validation-windows 176
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402
from experts import cut, paired  # noqa: E402
from plans import window_losses  # noqa: E402

from gdnprune import demo_data  # noqa: E402
from gdnprune.io.loading import load_pretrained  # noqa: E402
from gdnprune.scoring.api import measure_statistics  # noqa: E402
from gdnprune.scoring.expert_greedy import greedy_expert_removal  # noqa: E402
from gdnprune.scoring.experts import _expert_output  # noqa: E402

SEQ_LEN, STEP = 256, 4


def gradients(model, batches, prefixes):
    """Per MoE prefix, at every STEP-th position: the layer's input [N, H], the loss gradient at its routed
    output [N, H]; and the gradient at the final norm's input [N, H]."""
    got: dict[str, dict[str, list]] = {p: {"x": [], "g": []} for p in prefixes}
    final: list = []
    pos = torch.arange(0, SEQ_LEN, STEP)

    def keep(p):
        def hook(module, args, out):
            got[p]["x"].append(args[0].detach().reshape(-1, SEQ_LEN, args[0].shape[-1])[:, pos])
            out.register_hook(lambda g: got[p]["g"].append(g.reshape(-1, SEQ_LEN, g.shape[-1])[:, pos]))

        return hook

    handles = [model.get_submodule(p + ".experts").register_forward_hook(keep(p)) for p in prefixes]

    def keep_final(module, args):
        args[0].register_hook(lambda g: final.append(g[:, pos]))

    handles.append(model.model.norm.register_forward_pre_hook(keep_final))
    for x in batches:
        model(input_ids=x, labels=x).loss.backward()
        model.zero_grad()
    for h in handles:
        h.remove()
    flat = lambda xs: torch.cat(xs).reshape(-1, xs[0].shape[-1]).double()  # noqa: E731
    return {p: (flat(v["x"]), flat(v["g"])) for p, v in got.items()}, flat(final)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", type=Path)
    p.add_argument("--validation-windows", type=int, default=176)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = load_pretrained(args.model, dtype=torch.float32).eval()
    batches = list(demo_data.byte_windows(demo_data.train_text(), SEQ_LEN, 64).split(8))
    validation = demo_data.byte_windows(demo_data.validation_text(), SEQ_LEN, args.validation_windows)
    stats = {
        prefix: s
        for prefix, (b, s) in measure_statistics(model, batches, progress=False).blocks.items()
        if b.kind == "experts"
    }
    prefixes = list(stats)
    inputs, final = gradients(model, batches, prefixes)
    orders = {}
    for prefix, (x, g) in inputs.items():
        moe, s = model.get_submodule(prefix), stats[prefix]
        k, freq = moe.gate.top_k, s["count"].double()
        with torch.no_grad():
            logits = moe.gate(x.float())[0].double()
            ranks = torch.argsort(-logits, dim=-1)
            y = torch.zeros(*ranks.shape, x.shape[-1], dtype=torch.float64)
            for e in range(ranks.shape[1]):
                token, rank = torch.where(ranks == e)
                y[token, rank] = _expert_output(moe.experts, e, x[token].float()).double()
        grams = {"greedy": y @ y.transpose(1, 2)}
        for name, grad in (("greedy_loss", g), ("greedy_final", final)):
            v = torch.einsum("nmh,nh->nm", y, grad)
            grams[name] = v[:, :, None] * v[:, None, :]
        orders[prefix] = {
            "frequency": torch.argsort(-freq, stable=True),
            "removal_frequency": torch.argsort(-(s["removal_error"] * freq), stable=True),
        }
        for name, gram in grams.items():
            orders[prefix][name] = greedy_expert_removal(logits, ranks, gram, k, True)[0]
            orders[prefix][name + "_x_freq"] = greedy_expert_removal(logits, ranks, gram, k, True, freq)[0]
    names = list(orders[prefixes[0]])
    base = window_losses(model, validation)
    print(f"{args.model}: unpruned {base.mean():.4f} nats/byte on {validation.shape[0]} windows", flush=True)
    for keep in (8, 4):
        losses = {
            n: window_losses(
                cut(
                    model,
                    {p: {"experts": orders[p][n].numpy()} for p in prefixes},
                    {p: keep for p in prefixes},
                ),
                validation,
            )
            for n in names
        }
        for n in names:
            mean, se = paired(losses[n], losses["frequency"])
            print(
                f"{keep} {n:<22} {losses[n].mean() - base.mean():+.4f}  - frequency {mean:+.4f} ± {se:.4f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
