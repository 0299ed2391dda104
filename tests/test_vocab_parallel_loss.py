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

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from gdnprune.distill import distillation_loss, kd_loss

VOCAB, HIDDEN, T_HIDDEN, POSITIONS = 13, 8, 6, (7, 5)
CASES = {  # name -> (temperature, kd_weight, lm_weight, bias, chunk_size, teacher sharded)
    "mix_t2_bias_chunks": (2.0, 0.7, 0.4, True, 3, True),
    "kd_only": (1.0, 1.0, 0.0, False, None, True),
    "mix_t1_teacher_whole": (1.0, 0.3, 0.6, False, 4, False),
    "lm_only": (1.5, 0.0, 1.0, True, 2, True),
}


def inputs(rank: int, bias: bool) -> dict[str, torch.Tensor]:
    """The whole weights (the same on every process) and the positions of process ``rank``."""
    g = torch.Generator().manual_seed(0)
    whole = {
        "weight": torch.randn(VOCAB, HIDDEN, generator=g),
        "t_weight": 2 * torch.randn(VOCAB, T_HIDDEN, generator=g),
        "bias": torch.randn(VOCAB, generator=g) if bias else None,
        "t_bias": torch.randn(VOCAB, generator=g) if bias else None,
    }
    g = torch.Generator().manual_seed(10 + rank)
    n = POSITIONS[rank]
    labels = torch.randint(0, VOCAB, (n,), generator=g)
    labels[torch.rand(n, generator=g) < 0.3] = -100
    labels[0] = VOCAB - 1  # the last row: on the second process's (shorter) shard
    return {
        **whole,
        "hidden": torch.randn(n, HIDDEN, generator=g),
        "t_hidden": torch.randn(n, T_HIDDEN, generator=g),
        "labels": labels,
        "ids": torch.randint(0, VOCAB, (2, n), generator=g),
        "out_grad": torch.randn(2, n, HIDDEN, generator=g),
    }


def vocab_parallel_run(root: str) -> None:
    """On the 2 ranks of the suite's shared launch (tests/launches.py), its process group already up: every case,
    the FSDP2-sharded tiny models and the embedding lookup; each rank's report in ``root/rank<R>.pt``."""
    from test_distill import windows
    from test_distill_fsdp import make_pair
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from gdnprune.distill.fsdp import shard_student, shard_teacher, vocab_sharded
    from gdnprune.distill.loss import head_terms
    from gdnprune.distill.vocab_parallel import embedding

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))

    def head(weight, bias, sharded, grad):
        module = torch.nn.Module()
        split = (lambda t: distribute_tensor(t, mesh, [Shard(0)])) if sharded else (lambda t: t)
        module.weight = torch.nn.Parameter(split(weight), requires_grad=grad)
        module.bias = None if bias is None else torch.nn.Parameter(split(bias), requires_grad=grad)
        return module

    report = {}
    for name, (temperature, kd_w, lm_w, bias, chunk, teacher_sharded) in CASES.items():
        x = inputs(rank, bias)
        student = head(x["weight"], x["bias"], True, True)
        teacher = head(x["t_weight"], x["t_bias"], teacher_sharded, False)
        hidden = x["hidden"].clone().requires_grad_(True)
        t_hidden = x["t_hidden"] if kd_w else None
        out = distillation_loss(hidden, t_hidden, student, teacher if kd_w else None, x["labels"],
                                temperature=temperature, kd_weight=kd_w, lm_weight=lm_w, chunk_size=chunk)  # fmt: skip
        out.loss.backward()
        kd, lm, t_lm = head_terms(
            x["hidden"], student, x["t_hidden"], teacher, x["labels"], temperature, chunk
        )
        report[name] = {
            "loss": out.loss.detach(), "kd": out.kd, "lm": out.lm, "hidden_grad": hidden.grad,
            "weight_grad": student.weight.grad.full_tensor(),
            "bias_grad": None if student.bias is None else student.bias.grad.full_tensor(),
            "local_grad_rows": student.weight.grad.to_local().shape[0],
            "terms": (kd, lm, t_lm),
        }  # fmt: skip
    # FSDP2: tiny models sharded as distillation shards them, one loss and backward on each process's windows
    for tied in (False, True):
        teacher, student = make_pair(False, tied)
        shard_student(student)
        shard_teacher(teacher)
        assert vocab_sharded(student) and vocab_sharded(teacher)
        step_loss(student, teacher, windows(4)[2 * rank : 2 * rank + 2], via=student).backward()
        report[f"fsdp_tied={tied}"] = {n: p.grad.full_tensor() for n, p in student.named_parameters()}
    x = inputs(rank, False)
    table = torch.nn.Parameter(distribute_tensor(x["weight"], mesh, [Shard(0)]))
    looked_up = embedding(x["ids"], table)
    (looked_up * x["out_grad"]).sum().backward()
    report["embedding"] = {"out": looked_up.detach(), "grad": table.grad.full_tensor()}
    os.makedirs(root, exist_ok=True)
    torch.save(report, os.path.join(root, f".rank{rank}.pt"))
    os.rename(os.path.join(root, f".rank{rank}.pt"), os.path.join(root, f"rank{rank}.pt"))


def step_loss(student, teacher, ids, via=None):
    """A training step's loss as the Trainer computes it: inside the teacher's forward, then the student's
    (so FSDP2's hooks run around both), KD plus 0.4 LM."""
    from gdnprune.distill.trainer import final_hidden, forward_redirect, next_token_labels

    def in_student(t_hidden):
        hidden = final_hidden(student, ids)
        head, t_head = student.get_output_embeddings(), teacher.get_output_embeddings()
        return distillation_loss(hidden, t_hidden, head, t_head, next_token_labels(ids), lm_weight=0.4).loss

    def in_teacher():
        t_hidden = final_hidden(teacher, ids)
        with torch.enable_grad():
            return forward_redirect(student, in_student, t_hidden, via=via)

    with torch.no_grad():
        return forward_redirect(teacher, in_teacher)


@pytest.fixture(scope="module")
def ranks(launch, launch_inputs):
    """Each rank's report from this file's part of the suite's shared launch (:func:`vocab_parallel_run`)."""
    root = launch_inputs / "vocab_parallel"
    assert (root / "rank1.pt").exists(), launch.stderr[-4000:]
    return [torch.load(root / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


def reference(name: str, rank: int) -> dict[str, torch.Tensor]:
    """Loss, terms and gradients of process ``rank``'s positions on the whole weights, in plain torch."""
    temperature, kd_w, lm_w, bias, _, _ = CASES[name]
    x = inputs(rank, bias)
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


@pytest.mark.parametrize("name", list(CASES))
def test_vocab_parallel_loss_and_gradients_equal_the_whole_formula(ranks, name):
    want = [reference(name, r) for r in (0, 1)]
    for rank, got in enumerate(r[name] for r in ranks):
        close = dict(rtol=1e-5, atol=1e-6, msg=f"{name}, rank {rank}")
        torch.testing.assert_close(got["loss"], want[rank]["loss"], **close)
        torch.testing.assert_close(got["lm"], want[rank]["lm"], **close)
        if CASES[name][1]:
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
        x = inputs(rank, False)
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
    from test_distill import windows
    from test_distill_fsdp import make_pair

    teacher, student = make_pair(False, tied)
    step_loss(student, teacher, windows(4)).backward()
    want = {n: p.grad for n, p in student.named_parameters()}
    for got in (r[f"fsdp_tied={tied}"] for r in ranks):
        assert set(got) == set(want)
        for name, grad in want.items():
            error = (got[name] - grad).abs().max()
            assert error <= 1e-4 * grad.abs().max() + 1e-9, (name, float(error), float(grad.abs().max()))
