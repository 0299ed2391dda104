"""The embedding lookup and the distillation terms of a vocabulary sharded over processes, without gathering it.

Under FSDP2 every parameter is split along its first dimension, so the embedding and ``lm_head`` weights
(``[V, H]``) are split by vocabulary: process ``r`` of ``W`` holds rows ``[r * ceil(V/W), ...)``
(:class:`VocabShard`). Instead of gathering the whole weight, every process works on its own rows for the
positions of all processes (Megatron-LM's vocabulary-parallel embedding and cross entropy):

* :func:`embedding`: each process looks up the ids of all processes that fall in its rows; the partial
  embeddings are summed and scattered back to their owners (a reduce-scatter). The backward gathers the
  gradients of all positions and adds them into the local rows.
* :func:`vocab_parallel_terms`: the final hidden states (student and teacher) and labels of all processes
  are gathered (tokens x hidden, small); each process computes the logits of its rows, chunk by chunk, the
  log-sum-exp of each softmax is combined over processes, and the per-position KD and LM sums are
  all-reduced once at the end. The gradient of the local head rows is summed over all positions here; the
  gradient of the hidden states is summed over processes and scattered back to its owner.

Gradients of the local rows are divided by the number of processes: the mean of the processes' gradients,
as FSDP2 (and DDP) reduce every other gradient. Memory: one chunk of positions x local rows of logits, the
gathered hidden states, and the local head gradient; the whole vocabulary is never held.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

from ..estimate.memory import positions_per_chunk

__all__ = [
    "VocabShard",
    "vocab_shard",
    "local_rows",
    "embedding",
    "vocab_parallel_terms",
    "add_chunk_gradients",
    "default_positions_per_chunk",
]

# torch 2.13 renamed these two collectives (the old names warn); pyproject allows torch >= 2.4
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class VocabShard:
    """This process's rows ``[start, stop)`` of a weight of ``vocab`` rows sharded over ``group`` (``rank`` of
    ``world``); every process's share is ``chunk = ceil(vocab / world)`` rows, the last ones shorter."""

    start: int
    stop: int
    vocab: int
    rank: int
    world: int
    group: Any  # a torch.distributed ProcessGroup

    @property
    def chunk(self) -> int:
        return math.ceil(self.vocab / self.world)


def vocab_shard(weight: torch.Tensor) -> VocabShard | None:
    """The shard of ``weight`` held here when it is a DTensor split along dim 0 (FSDP2's sharded parameter),
    else None (a whole tensor, e.g. one FSDP2 has gathered)."""
    if not isinstance(weight, DTensor):
        return None
    if tuple(weight.placements) != (Shard(0),):
        raise ValueError(f"expected a weight sharded along its rows (Shard(0)), found {weight.placements}")
    mesh = weight.device_mesh
    vocab, world, rank = weight.shape[0], mesh.size(), mesh.get_local_rank()
    chunk = math.ceil(vocab / world)
    start = min(vocab, rank * chunk)
    shard = VocabShard(start, min(vocab, start + chunk), vocab, rank, world, mesh.get_group())
    rows = weight.to_local().shape[0]
    if rows != shard.stop - shard.start:
        raise ValueError(
            f"expected {shard.stop - shard.start} local rows of a {vocab}-row weight, found {rows}"
        )
    return shard


def local_rows(tensor: torch.Tensor | None, shard: VocabShard) -> torch.Tensor | None:
    """The rows of ``shard`` of a ``[vocab, ...]`` tensor: the local part of a DTensor sharded the same way
    (autograd flows back into it), or a slice of a whole tensor."""
    if tensor is None:
        return None
    if isinstance(tensor, DTensor):
        found = vocab_shard(tensor)
        if found is None or (found.start, found.stop, found.vocab) != (shard.start, shard.stop, shard.vocab):
            raise ValueError(
                f"expected the rows [{shard.start}, {shard.stop}) of {shard.vocab}, found {found}"
            )
        return tensor.to_local()
    if tensor.shape[0] != shard.vocab:
        raise ValueError(f"expected a tensor of {shard.vocab} rows, found {tuple(tensor.shape)}")
    return tensor[shard.start : shard.stop]


def _gather(x: torch.Tensor, rows: int, group: Any, fill: float = 0) -> torch.Tensor:
    """``x`` ``[n, ...]`` of every process, each padded with ``fill`` to ``rows``: ``[world * rows, ...]``."""
    padded = x.new_full((rows, *x.shape[1:]), fill)
    padded[: x.shape[0]] = x
    out = x.new_empty((dist.get_world_size(group) * rows, *x.shape[1:]))
    _all_gather(out, padded.contiguous(), group=group)
    return out


def _scatter_sum(x: torch.Tensor, n: int, group: Any) -> torch.Tensor:
    """The sum over processes of ``x`` ``[world * rows, ...]``, each process keeping its ``n`` of its rows."""
    out = x.new_empty((x.shape[0] // dist.get_world_size(group), *x.shape[1:]))
    _reduce_scatter(out, x.contiguous(), group=group)
    return out[:n]


def _sizes(values: list[int], device: torch.device, group: Any) -> torch.Tensor:
    """``values`` of every process: ``[world, len(values)]`` int64."""
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    out = mine.new_empty((dist.get_world_size(group), len(values)))
    _all_gather(out.view(-1), mine, group=group)
    return out


class _Embedding(torch.autograd.Function):
    """See :func:`embedding`; the collectives run in forward and in backward, in the same order everywhere."""

    @staticmethod
    def forward(ctx, ids, weight, shard):
        flat = ids.reshape(-1)
        rows = int(_sizes([flat.shape[0]], flat.device, shard.group).max())
        index = _gather(flat, rows, shard.group, fill=-1) - shard.start
        mine = (index >= 0) & (index < shard.stop - shard.start)
        partial = weight.new_zeros((index.shape[0], weight.shape[1]))
        partial[mine] = weight[index[mine]]
        ctx.shard, ctx.rows, ctx.index, ctx.mine = shard, rows, index, mine
        return _scatter_sum(partial, flat.shape[0], shard.group).view(*ids.shape, weight.shape[1])

    @staticmethod
    def backward(ctx, grad):
        grad = grad.reshape(-1, grad.shape[-1])
        every = _gather(grad.contiguous(), ctx.rows, ctx.shard.group)
        g_weight = grad.new_zeros((ctx.shard.stop - ctx.shard.start, grad.shape[1]))
        g_weight.index_add_(0, ctx.index[ctx.mine], every[ctx.mine])
        return None, g_weight.div_(ctx.shard.world), None


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``weight[ids]`` (``[..., H]``) from the DTensor ``weight`` sharded by vocabulary, without gathering it;
    a collective: every process of its group calls it (with its own ids, of any count). The gradient of the
    local rows is the processes' mean (see the module docstring)."""
    shard = vocab_shard(weight)
    if shard is None or not isinstance(weight, DTensor):
        raise ValueError("embedding: expected a weight sharded along its rows (a DTensor)")
    return _Embedding.apply(ids, weight.to_local(), shard)


@dataclass
class _Gathered:
    """The positions of every process, each process's padded to ``rows``: hidden states, teacher hidden
    states, labels (``valid`` false where ignored or padding) and the gradient scale of each position."""

    rows: int
    hidden: torch.Tensor
    teacher: torch.Tensor | None
    labels: torch.Tensor
    valid: torch.Tensor
    counts: torch.Tensor  # [world * rows]: the predicted positions of the position's own process (>= 1)


def _gather_positions(hidden, teacher_hidden, labels, valid, group) -> _Gathered:
    sizes = _sizes([hidden.shape[0], int(valid.sum())], hidden.device, group)
    rows = int(sizes[:, 0].max())
    counts = sizes[:, 1].clamp(min=1).repeat_interleave(rows).to(torch.float32)
    teacher = None if teacher_hidden is None else _gather(teacher_hidden.detach(), rows, group)
    return _Gathered(
        rows,
        _gather(hidden.detach(), rows, group),
        teacher,
        _gather(labels, rows, group),
        _gather(valid, rows, group, fill=False),
        counts,
    )


def _logsumexp_over(local: torch.Tensor, group: Any) -> torch.Tensor:
    """The log-sum-exp over all processes of each process's ``local`` log-sum-exps ``[k, n]``."""
    every = local.new_empty((dist.get_world_size(group), *local.shape))
    _all_gather(every.view(-1), local.contiguous().view(-1), group=group)
    return every.logsumexp(0)


def vocab_parallel_terms(
    hidden,
    head,
    teacher_hidden,
    teacher_head,
    labels,
    valid,
    temperature,
    positions_per_chunk,
    shard,
    *,
    weights: tuple[float, float] | None = None,
    teacher_lm: bool = False,
):
    """:func:`gdnprune.distill.loss.position_terms` with the head weights held as ``shard``'s rows: per-position
    KD, LM (and teacher LM) terms of this process's positions, float32, detached, 0 where not ``valid``. A
    collective: every process of ``shard.group`` calls it, with its own positions.

    ``head`` / ``teacher_head``: the ``(weight, bias)`` local rows (:func:`local_rows`); ``labels`` the
    next-token ids (any value where not ``valid``). With ``weights = (kd_weight, lm_weight)`` it also returns
    the gradients ``(hidden, head weight rows, head bias rows)`` of ``kd_weight * KD + lm_weight * LM``
    (each averaged over its process's predicted positions): the hidden gradient of this process's loss,
    and the local rows' gradient as the mean over processes of each one's loss gradient.
    """
    (weight, bias), group, n = head, shard.group, hidden.shape[0]
    g = _gather_positions(hidden, teacher_hidden, labels.clamp(min=0), valid, group)
    total = g.hidden.shape[0]
    width = shard.stop - shard.start
    kd, lm_target, t_target = (
        torch.zeros(total, dtype=torch.float32, device=hidden.device) for _ in range(3)
    )
    lse = torch.zeros(4, total, dtype=torch.float32, device=hidden.device)  # student T, 1; teacher T, 1
    grads, a, b = None, None, None
    if weights is not None:
        grads = (
            torch.zeros(total, hidden.shape[1], dtype=torch.float32, device=hidden.device),
            torch.zeros_like(weight, dtype=torch.float32),
            None if bias is None else torch.zeros_like(bias, dtype=torch.float32),
        )
        kd_w, lm_w = weights
        a = kd_w / g.counts * g.valid if kd_w and teacher_hidden is not None else None
        b = lm_w / g.counts * g.valid if lm_w else None
    step = positions_per_chunk or default_positions_per_chunk(shard.vocab, g.rows)
    for begin in range(0, total, step):
        rows = slice(begin, min(total, begin + step))
        h, y, ok = g.hidden[rows].to(weight.dtype), g.labels[rows] - shard.start, g.valid[rows]
        mine = ok & (y >= 0) & (y < width)
        y = y.clamp(0, max(0, width - 1))
        with torch.no_grad():
            z = F.linear(h, weight, bias).float()
            if width:
                lm_target[rows] = torch.where(mine, z.gather(1, y[:, None]).squeeze(1), 0.0)
            z_t = None
            if g.teacher is not None:
                t_weight, t_bias = teacher_head
                z_t = F.linear(g.teacher[rows].to(t_weight.device, t_weight.dtype), t_weight, t_bias)
                z_t = z_t.to(z.device, torch.float32)
                if teacher_lm and width:
                    t_target[rows] = torch.where(mine, z_t.gather(1, y[:, None]).squeeze(1), 0.0)
            parts = _chunk(z, z_t, temperature, teacher_lm, lse[:, rows], kd[rows], group)
            if grads is None:
                continue
            scales = (None if a is None else a[rows], None if b is None else b[rows])
            g_z = _logit_gradient(parts, z, lse[1, rows], temperature, *scales, mine, y)
            if g_z is not None:
                add_chunk_gradients(grads, rows, g_z, h, weight)
    sums = torch.stack([kd, lm_target, t_target])
    dist.all_reduce(sums, group=group)
    own = slice(shard.rank * g.rows, shard.rank * g.rows + n)
    ok = g.valid[own]
    out = (sums[0, own] * ok, (lse[1, own] - sums[1, own]) * ok, (lse[3, own] - sums[2, own]) * ok)
    if not teacher_lm or teacher_hidden is None:
        out = (out[0], out[1], torch.zeros_like(out[2]))
    if grads is None:
        return *out, None
    g_hidden, g_weight, g_bias = grads
    g_hidden = _scatter_sum(g_hidden, n, group).to(hidden.dtype)
    return *out, (g_hidden, g_weight.div_(shard.world), None if g_bias is None else g_bias.div_(shard.world))


def default_positions_per_chunk(vocab: int, positions: int) -> int:
    """Positions per chunk of :func:`vocab_parallel_terms` when not given: as many as one process has (the
    most of any), and at most as many as the whole-head loss takes (``2**25 // vocab``, its chunk of 2**25
    logits). A chunk's logits (positions x local rows) are then at most ``1 / world`` of what the whole-head
    loss holds for one process's positions: the loss buffers shard with the vocabulary, where a chunk of all
    processes' positions would cost each process as much as the whole head does. Each chunk reads the local
    rows once: ``world`` chunks read as many bytes of the head as the whole-head loss reads once."""
    return positions_per_chunk(vocab, positions)


def add_chunk_gradients(grads, rows: slice, g_z: torch.Tensor, h: torch.Tensor, weight: torch.Tensor) -> None:
    """One chunk's logit gradient ``g_z`` added into ``grads = (hidden, weight rows, bias rows)`` (the whole
    head's rows in :func:`gdnprune.distill.loss.position_terms`, this process's here)."""
    g_hidden, g_weight, g_bias = grads
    g_hidden[rows] = (g_z.to(weight.dtype) @ weight).to(g_hidden.dtype)
    if h.dtype == torch.float32:  # accumulated in place: no second rows x hidden buffer
        g_weight.addmm_(g_z.t(), h)
    else:
        g_weight += (g_z.t().to(h.dtype) @ h).float()
    if g_bias is not None:
        g_bias += g_z.sum(0)


def _chunk(z, z_t, temperature, teacher_lm, lse, kd, group):
    """One chunk's softmaxes over the whole vocabulary: the log-sum-exps of the student (at ``temperature``
    and at 1) and of the teacher (at ``temperature``, at 1 for ``teacher_lm``) over the local rows, combined
    over processes into ``lse`` ``[4, n]``; this process's part of the KD sum written into ``kd``. Returns
    ``(log_q, p)``: the student's log-softmax at ``temperature`` and the teacher's softmax (None without a
    teacher) over the local rows. ``z_t`` is reused in place, and ``z`` at temperature 1."""
    scaled = z if temperature == 1 else z / temperature
    stats = [scaled.logsumexp(-1)]
    stats.append(stats[0] if temperature == 1 else z.logsumexp(-1))
    t_scaled = None
    if z_t is not None:
        one = z_t.logsumexp(-1) if teacher_lm and temperature != 1 else None
        t_scaled = z_t if temperature == 1 else z_t.div_(temperature)
        stats.append(t_scaled.logsumexp(-1))
        stats.append(stats[2] if one is None else one)
    every = _logsumexp_over(torch.stack(stats), group)
    lse[: len(stats)] = every
    log_q = scaled.sub_(every[0][:, None])
    if t_scaled is None:
        return log_q, None
    log_p = t_scaled.sub_(every[2][:, None])
    p = log_p.exp()
    kd.copy_(temperature**2 * log_p.sub_(log_q).mul_(p).sum(-1))  # log_p is not needed after
    return log_q, p


def _logit_gradient(parts, z, lse_one, temperature, a, b, mine, y):
    """The gradient of the local logits, ``a*T*(softmax(z/T) - p) + b*(softmax(z) - onehot(y))`` per position
    (``a``, ``b``: per-position scales, 0 where not predicted, None for a weight of 0; ``y`` the local label
    where ``mine``; ``lse_one`` the log-sum-exp of ``z`` over the whole vocabulary). ``log_q``, ``p`` and,
    at a temperature other than 1, ``z`` are reused in place. None when both scales are None."""
    log_q, p = parts
    q = log_q.exp_()
    d = p.sub_(q).mul_(-temperature * a[:, None]) if p is not None and a is not None else None  # a*T*(q - p)
    lm = None
    if b is not None:
        lm = q if temperature == 1 else z.sub_(lse_one[:, None]).exp_()  # softmax(z): q itself at T = 1
        lm.mul_(b[:, None])
        rows = torch.nonzero(mine).squeeze(1)
        lm[rows, y[rows]] -= b[rows]
    return d if lm is None else lm if d is None else lm.add_(d)
