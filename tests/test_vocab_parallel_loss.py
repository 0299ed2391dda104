"""The vocabulary-parallel loss and embedding (CPU, gloo, 2 processes) against the plain formulas on whole logits.

A part of the suite's shared 2-process launch (tests/launches.py): each process holds its rows of head weights split by vocabulary (DTensors
``Shard(0)``, 13 rows over 2 processes: 7 and 6, so the shards are uneven) and its own positions (7 and 5,
some ignored); it computes the loss of its positions with :func:`distillation_loss`, its gradients, the
evaluation terms and a vocabulary-parallel embedding lookup. The reference is computed here, in one process,
on the whole weights with plain torch (log-softmax, cross entropy, :func:`kd_loss`, autograd): the loss and
hidden gradient of each process's positions, and the head gradient as the mean over processes of each
process's loss gradient (what FSDP2 and DDP make of every other gradient). The same launch shards tiny
distillation models (untied and tied embeddings) as training shards them and runs one step's loss and
backward: the gradients FSDP2 leaves on the shards equal one process's on the whole batch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import make_pair, windows
from launch_runs import VOCAB_CASES, step_loss, vocab_inputs

from gdnprune.distill import kd_loss


@pytest.fixture(scope="module")
def ranks(launch, launch_inputs):
    """Each rank's report from this file's part of the suite's shared launch (:func:`vocab_parallel_run`)."""
    root = launch_inputs / "vocab_parallel"
    assert (root / "rank1.pt").exists(), launch.stderr[-4000:]
    return [torch.load(root / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


def reference(name: str, rank: int) -> dict[str, torch.Tensor]:
    """Loss, terms and gradients of process ``rank``'s positions on the whole weights, in plain torch."""
    temperature, kd_w, lm_w, bias, _, _ = VOCAB_CASES[name]
    x = vocab_inputs(rank, bias)
    weight = x["weight"].clone().requires_grad_(True)
    b = None if x["bias"] is None else x["bias"].clone().requires_grad_(True)
    hidden = x["hidden"].clone().requires_grad_(True)
    z, z_t = F.linear(hidden, weight, b), F.linear(x["t_hidden"], x["t_weight"], x["t_bias"])
    valid = x["labels"] != -100
    kd = kd_loss(z[valid], z_t[valid], temperature=temperature)
    lm = F.cross_entropy(z, x["labels"], ignore_index=-100)
    loss = kd_w * kd + lm_w * lm
    loss.backward()
    per_kd = temperature**2 * F.kl_div(
        F.log_softmax(z / temperature, -1),
        F.log_softmax(z_t / temperature, -1),
        log_target=True,
        reduction="none",
    ).sum(-1)
    terms = (
        per_kd * valid,
        F.cross_entropy(z, x["labels"], ignore_index=-100, reduction="none"),
        F.cross_entropy(z_t, x["labels"], ignore_index=-100, reduction="none"),
    )
    return {
        "loss": loss.detach(),
        "kd": kd.detach(),
        "lm": lm.detach(),
        "hidden_grad": hidden.grad,
        "weight_grad": weight.grad,
        "bias_grad": None if b is None else b.grad,
        "terms": tuple(t.detach() for t in terms),
    }


@pytest.mark.parametrize("name", list(VOCAB_CASES))
def test_vocab_parallel_loss_and_gradients_equal_the_whole_formula(ranks, name):
    want = [reference(name, r) for r in (0, 1)]
    for rank, got in enumerate(r[name] for r in ranks):
        close = dict(rtol=1e-5, atol=1e-6, msg=f"{name}, rank {rank}")
        torch.testing.assert_close(got["loss"], want[rank]["loss"], **close)
        torch.testing.assert_close(got["lm"], want[rank]["lm"], **close)
        if VOCAB_CASES[name][1]:
            torch.testing.assert_close(got["kd"], want[rank]["kd"], **close)
        torch.testing.assert_close(got["hidden_grad"], want[rank]["hidden_grad"], **close)
        for kind, want_kind in zip(got["terms"], want[rank]["terms"]):
            torch.testing.assert_close(kind, want_kind, **close)
        # the head gradient: the mean over processes of each one's loss gradient, held as each one's rows
        for key in ("weight_grad", "bias_grad"):
            if want[0][key] is None:
                assert got[key] is None
                continue
            torch.testing.assert_close(got[key], (want[0][key] + want[1][key]) / 2, **close)
        assert got["local_grad_rows"] == (7, 6)[rank]


def test_vocab_parallel_embedding_equals_a_lookup_in_the_whole_table(ranks):
    grads = []
    for rank, got in enumerate(r["embedding"] for r in ranks):
        x = vocab_inputs(rank, False)
        table = x["weight"].clone().requires_grad_(True)
        out = F.embedding(x["ids"], table)
        (out * x["out_grad"]).sum().backward()
        torch.testing.assert_close(got["out"], out.detach(), rtol=0, atol=0)
        grads.append(table.grad)
    for got in (r["embedding"] for r in ranks):
        torch.testing.assert_close(got["grad"], (grads[0] + grads[1]) / 2, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tied", [False, True])
def test_fsdp2_gradients_of_a_step_equal_one_process(ranks, tied):
    """The student sharded by :func:`shard_student` (embedding and head never gathered) and the teacher by
    :func:`shard_teacher`: the gradients FSDP2 leaves on the shards, gathered, equal one process's on the
    whole batch, every tensor (the head's and the embedding's rows included: added once, not reduced again
    by FSDP2, and averaged over the processes like every other gradient)."""
    teacher, student = make_pair(False, tied)
    step_loss(student, teacher, windows(4)).backward()
    want = {n: p.grad for n, p in student.named_parameters()}
    for got in (r[f"fsdp_tied={tied}"] for r in ranks):
        assert set(got) == set(want)
        for name, grad in want.items():
            error = (got[name] - grad).abs().max()
            assert error <= 1e-4 * grad.abs().max() + 1e-9, (name, float(error), float(grad.abs().max()))
