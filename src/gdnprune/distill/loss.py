"""The distillation loss: forward KL at temperature T, optionally mixed with the LM loss, in chunks.

:func:`kd_loss` is the formula on logits. :func:`distillation_loss` computes the same loss from final
hidden states and ``lm_head`` weights a chunk of positions at a time, with the gradient computed chunk by
chunk in the forward pass (a custom autograd function), so memory holds one chunk of logits and never
tokens x vocabulary (152K-248K for Qwen).
"""

from __future__ import annotations

import math
from typing import NamedTuple, cast

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from .vocab_parallel import VocabShard, add_chunk_gradients, local_rows, vocab_parallel_terms, vocab_shard

__all__ = [
    "kd_loss",
    "distillation_loss",
    "DistillationLoss",
    "IGNORE_INDEX",
    "lm_head_weights",
    "position_terms",
    "head_terms",
]

IGNORE_INDEX = -100
# default chunk: 2**25 logits (128 MiB per float32 buffer, a few buffers live at once). Every chunk reads the
# whole lm_head weight a few times, so much smaller chunks are slower on large vocabularies (BENCHMARKS.md,
# scoring overhead: 2**22 took twice as long as 2**25)
_LOGITS_PER_CHUNK = 1 << 25


def kd_loss(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, *, temperature: float = 1.0
) -> torch.Tensor:
    """``T**2 * KL(softmax(teacher/T) || softmax(student/T))`` per position, averaged over all positions.

    Logits are ``[..., V]``; computed in float32 on the whole tensor (the reference formula;
    :func:`distillation_loss` computes the same in chunks from hidden states).
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"kd_loss: expected logits of equal shape, found student {tuple(student_logits.shape)} "
            f"and teacher {tuple(teacher_logits.shape)}"
        )
    log_q = F.log_softmax(student_logits.float() / temperature, dim=-1)
    log_p = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    return temperature**2 * (log_p.exp() * (log_p - log_q)).sum(-1).mean()


class DistillationLoss(NamedTuple):
    """``loss = kd_weight * kd + lm_weight * lm``; ``kd`` and ``lm`` are detached means (for logging)."""

    loss: torch.Tensor
    kd: torch.Tensor
    lm: torch.Tensor


def lm_head_weights(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ``(weight, bias)`` of an ``lm_head`` module (bias None when it has none)."""
    # cast: nn.Module types its attributes Tensor | Module; an lm_head's weight is a parameter
    return cast(torch.Tensor, module.weight), getattr(module, "bias", None)


def position_terms(
    hidden,
    head,
    teacher_hidden,
    teacher_head,
    labels,
    temperature,
    chunk_size,
    *,
    grad_scale: tuple[float, float] | None = None,
    teacher_lm: bool = False,
):
    """Per-position KD, LM (and teacher LM) terms, float32, detached, 0 where ``labels`` is ignored.

    Works ``chunk_size`` positions at a time. With ``grad_scale = (a, b)`` it also returns the gradients
    of ``sum(a * kd + b * lm)`` with respect to ``hidden``, the head weight and the head bias, from
    ``dL/dz = a*T*(softmax(z/T) - softmax(z_teacher/T)) + b*(softmax(z) - onehot(label))``. Without a
    teacher (``teacher_hidden`` None) the KD terms are 0 and ``a`` must be 0.
    """
    (weight, bias), n = head, hidden.shape[0]
    valid = labels != IGNORE_INDEX
    kd, lm, t_lm = (hidden.new_zeros(n, dtype=torch.float32) for _ in range(3))
    if grad_scale is not None and grad_scale[0] and teacher_hidden is None:
        raise ValueError(f"position_terms: a KD gradient scale ({grad_scale[0]}) needs a teacher")
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None
    if grad_scale is not None:
        grads = (
            torch.zeros_like(hidden),
            torch.zeros_like(weight, dtype=torch.float32),
            None if bias is None else torch.zeros_like(bias, dtype=torch.float32),
        )
    step = chunk_size or max(1, _LOGITS_PER_CHUNK // weight.shape[0])
    for start in range(0, n, step):
        rows = slice(start, min(n, start + step))
        h, y, ok = hidden[rows].detach().to(weight.dtype), labels[rows].clamp(min=0), valid[rows]
        t_h = None if teacher_hidden is None else teacher_hidden[rows]
        with torch.no_grad():
            g = _chunk_terms(h, y, ok, head, t_h, teacher_head, temperature, grad_scale, teacher_lm,
                             (kd[rows], lm[rows], t_lm[rows]))  # fmt: skip
            if grads is not None and g is not None:
                add_chunk_gradients(grads, rows, g, h, weight)
    return kd, lm, t_lm, grads


def _log_softmax(z: torch.Tensor, temperature: float) -> torch.Tensor:
    return F.log_softmax(z if temperature == 1 else z / temperature, -1)


def _chunk_terms(h, y, ok, head, t_h, teacher_head, temperature, grad_scale, teacher_lm, out):
    """One chunk of :func:`position_terms`: its terms written into ``out = (kd, lm, t_lm)`` (views of rows),
    and the gradient of the logits (None without ``grad_scale``). Every buffer of chunk x vocabulary is
    reused in place where it can be: at most three (four at a temperature other than 1) are alive at once,
    and each elementwise pass over the logits is made once (this is most of a KD step's cost beyond the
    teacher's forward)."""
    kd, lm, t_lm = out
    z = F.linear(h, *head).float()
    log_q = _log_softmax(z, temperature)
    z_lm: torch.Tensor | None = None if temperature == 1 else z  # at T = 1 log_q is the LM's log-softmax too
    del z
    log_q1 = log_q if z_lm is None else F.log_softmax(z_lm, -1)
    lm.copy_(-log_q1.gather(-1, y[:, None]).squeeze(-1) * ok)
    del log_q1
    p = None
    if t_h is not None:
        t_weight, t_bias = teacher_head
        zt = F.linear(t_h.to(t_weight.device, t_weight.dtype), t_weight, t_bias).to(
            log_q.device, torch.float32
        )
        log_p = _log_softmax(zt, temperature)
        if teacher_lm:
            log_p1 = log_p if temperature == 1 else F.log_softmax(zt, -1)
            t_lm.copy_(-log_p1.gather(-1, y[:, None]).squeeze(-1) * ok)
            del log_p1
        del zt
        p = log_p.exp()
        kd.copy_(temperature**2 * log_p.sub_(log_q).mul_(p).sum(-1) * ok)  # log_p is not needed after
        del log_p
    if grad_scale is None:
        return None
    a, b = grad_scale
    # dL/dz = b*(softmax(z) - onehot(y)) + a*T*(softmax(z/T) - p), each buffer reused in place, in the order
    # of the plain formula (so the result is the same to the bit)
    q = log_q.exp_()
    d = p.sub_(q).mul_(-a * temperature) if p is not None and a else None  # a*T*(q - p)
    g: torch.Tensor | None = None
    if b:
        g = (q if z_lm is None else F.log_softmax(z_lm, -1).exp_()).mul_(b)  # at T = 1 both softmaxes are q
        g[torch.arange(len(y), device=g.device), y] -= b
    g = d if g is None else g if d is None else g.add_(d)
    if g is None:  # both weights 0
        return None
    return g.mul_(ok.to(g.dtype)[:, None])


class _ChunkedDistillation(torch.autograd.Function):
    """The loss of :func:`distillation_loss`; gradients are computed in forward, chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, teacher_hidden, labels, teacher_head, options):
        temperature, kd_weight, lm_weight, chunk_size, count, shard = options
        if shard is not None:  # the head's rows of this process: the vocabulary-parallel terms
            kd, lm, _, grads = vocab_parallel_terms(
                hidden, (weight, bias), teacher_hidden, teacher_head, labels.clamp(min=0),
                labels != IGNORE_INDEX, temperature, chunk_size, shard, weights=(kd_weight, lm_weight),
            )  # fmt: skip
        else:
            kd, lm, _, grads = position_terms(
                hidden,
                (weight, bias),
                teacher_hidden,
                teacher_head,
                labels,
                temperature,
                chunk_size,
                grad_scale=(kd_weight / count, lm_weight / count),
            )
        ctx.grads = grads  # intermediate buffers of the loss, not inputs or outputs: kept on ctx, used once
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        kd_mean, lm_mean = kd.sum() / count, lm.sum() / count
        ctx.mark_non_differentiable(kd_mean, lm_mean)
        return kd_weight * kd_mean + lm_weight * lm_mean, kd_mean, lm_mean

    @staticmethod
    def backward(ctx, grad_loss, _grad_kd, _grad_lm):
        if ctx.grads is None:
            raise RuntimeError("the distillation loss's backward ran twice (its gradients are used up)")
        (g_hidden, g_weight, g_bias), ctx.grads = ctx.grads, None
        # scaled in place: the buffers are this loss's own, and no second head-sized gradient is made
        g_bias = None if g_bias is None else g_bias.mul_(grad_loss).to(ctx.dtypes[1])
        return g_hidden.mul_(grad_loss), g_weight.mul_(grad_loss).to(ctx.dtypes[0]), g_bias, *(None,) * 4


def distillation_loss(
    student_hidden: torch.Tensor,
    teacher_hidden: torch.Tensor | None,
    student_head: torch.nn.Module,
    teacher_head: torch.nn.Module | None,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    kd_weight: float = 1.0,
    lm_weight: float = 0.0,
    chunk_size: int | None = None,
) -> DistillationLoss:
    """``kd_weight * KD + lm_weight * LM`` from final hidden states, ``chunk_size`` positions at a time.

    ``student_hidden`` / ``teacher_hidden`` are ``[..., H]`` (the models' ``hidden_states[-1]``, after the
    final norm), the heads are the ``lm_head`` modules (``weight [V, H]``, optional bias) and ``labels``
    ``[...]`` the next-token ids (``-100``: position skipped by both terms). KD is :func:`kd_loss` at
    ``temperature``, LM the cross entropy at temperature 1, both averaged over the non-skipped positions.
    Equal to the unchunked formulas up to float rounding; memory holds one chunk of logits (default
    ``2**25 // V`` positions) plus the gradient of the student head. The teacher side gets no gradient.
    With ``kd_weight=0`` the teacher may be None (LM-only fine-tuning; ``kd`` is then NaN).
    """
    if kd_weight < 0 or lm_weight < 0 or kd_weight + lm_weight == 0:
        raise ValueError(
            f"expected non-negative kd_weight and lm_weight, not both 0; found {kd_weight} and {lm_weight}"
        )
    if temperature <= 0:
        raise ValueError(f"expected a positive temperature, found {temperature}")
    if (teacher_hidden is None or teacher_head is None) and kd_weight:
        raise ValueError(f"expected teacher hidden states and head for kd_weight={kd_weight}, found None")
    hidden = student_hidden.reshape(-1, student_hidden.shape[-1])
    labels = labels.reshape(-1).to(hidden.device)
    t_hidden, t_head = None, None
    if teacher_hidden is not None and teacher_head is not None:
        t_hidden = teacher_hidden.detach().reshape(-1, teacher_hidden.shape[-1])
        t_head = lm_head_weights(teacher_head)
    if labels.shape[0] != hidden.shape[0] or (t_hidden is not None and t_hidden.shape[0] != hidden.shape[0]):
        found = (None if t_hidden is None else t_hidden.shape[0], labels.shape[0])
        raise ValueError(
            f"expected as many positions in teacher hidden states and labels as in student hidden states "
            f"({hidden.shape[0]}), found {found[0]} and {found[1]}"
        )
    count = max(1, int((labels != IGNORE_INDEX).sum()))
    weight, bias = lm_head_weights(student_head)
    shard = vocab_shard(weight)
    weight, bias, t_head = _rows(weight, bias, t_head, shard)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias)):
        options = (temperature, kd_weight, lm_weight, chunk_size, count, shard)
        loss, kd, lm = _ChunkedDistillation.apply(hidden, weight, bias, t_hidden, labels, t_head, options)
    else:
        kd, lm, _, _ = _terms(
            hidden, (weight, bias), t_hidden, t_head, labels, temperature, chunk_size, shard
        )
        kd, lm = kd.sum() / count, lm.sum() / count
        loss = kd_weight * kd + lm_weight * lm
    return DistillationLoss(loss, kd if t_hidden is not None else torch.full_like(kd, math.nan), lm)


def _rows(weight, bias, teacher_head, shard: VocabShard | None):
    """The student head ``(weight, bias)`` and the teacher's as the loss reads them: ``shard``'s rows of both
    when the student head is sharded by vocabulary, else whole (a sharded teacher head gathered)."""
    if shard is not None:
        t_head = None if teacher_head is None else tuple(local_rows(t, shard) for t in teacher_head)
        return local_rows(weight, shard), local_rows(bias, shard), t_head
    if teacher_head is not None and isinstance(teacher_head[0], DTensor):  # a student gathered, a teacher not
        teacher_head = tuple(None if t is None else t.full_tensor() for t in teacher_head)
    return weight, bias, teacher_head


def _terms(hidden, head, t_hidden, t_head, labels, temperature, chunk_size, shard, *, teacher_lm=False):
    if shard is None:
        return position_terms(
            hidden, head, t_hidden, t_head, labels, temperature, chunk_size, teacher_lm=teacher_lm
        )
    valid = labels != IGNORE_INDEX
    return vocab_parallel_terms(hidden, head, t_hidden, t_head, labels.clamp(min=0), valid, temperature,
                                chunk_size, shard, teacher_lm=teacher_lm)  # fmt: skip


def head_terms(
    hidden: torch.Tensor,
    head: torch.nn.Module,
    teacher_hidden: torch.Tensor,
    teacher_head: torch.nn.Module,
    labels: torch.Tensor,
    temperature: float,
    chunk_size: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`position_terms` (KD, LM and teacher LM per position, no gradients) from the ``lm_head`` modules:
    on the rows this process holds when the student head is sharded by vocabulary (a collective then),
    else on the whole heads."""
    weight, bias = lm_head_weights(head)
    shard = vocab_shard(weight)
    weight, bias, t_head = _rows(weight, bias, lm_head_weights(teacher_head), shard)
    kd, lm, t_lm, _ = _terms(hidden, (weight, bias), teacher_hidden, t_head, labels, temperature, chunk_size,
                             shard, teacher_lm=True)  # fmt: skip
    return kd, lm, t_lm
