"""The loss-gradient head: the gradient of the next-token loss at the final norm's input, on chosen tokens.

Behind the loss-aware Grams (lanes by default): the final norm's input is kept at one token in
``stride`` of every calibration batch; the final norm and ``lm_head`` are re-run on those tokens,
collected over batches into chunks that bound the number of logits, and differentiated with respect to
their input only. See ``docs/scoring.md``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..model.forwards import final_norm

__all__ = [
    "module_device",
    "output_head",
    "loss_gradient",
    "loss_positions",
    "LossGradients",
    "default_loss_token_stride",
    "DEFAULT_LOSS_TOKEN_STRIDE",
    "LOSS_COST_SHARE",
    "MAX_DEFAULT_LOSS_TOKEN_STRIDE",
]

#: one token in this many is measured, unless the vocabulary makes that too expensive
DEFAULT_LOSS_TOKEN_STRIDE = 8
#: the share of a plain forward's multiply-adds that the loss gradient's ``lm_head`` products may cost
LOSS_COST_SHARE = 1 / 8
#: the default stride stops here: 128 windows of 512 tokens (the CLI default) keep 1024 measured tokens
MAX_DEFAULT_LOSS_TOKEN_STRIDE = 64


def default_loss_token_stride(model: Any, head: Any) -> int:
    """The default ``loss_token_stride``: 8, or the smallest larger power of two whose cost fits the budget.

    Each measured token costs two ``lm_head``-sized products (the logits and the input gradient),
    ``2 V H`` multiply-adds for a vocabulary of ``V`` and a hidden size ``H``. A plain forward costs
    about one multiply-add per parameter per token, not counting the input embedding (a lookup) and
    ``lm_head`` (scoring asks for the last token's logits only); MoE experts are all counted, which
    overstates the forward and keeps the stride small. The stride doubles until ``2 V H / stride``
    is at most :data:`LOSS_COST_SHARE` of that, up to :data:`MAX_DEFAULT_LOSS_TOKEN_STRIDE` (fewer
    measured tokens order lanes worse: BENCHMARKS.md, "Scoring overhead"). Models of a billion
    parameters and more keep 8; a 24-layer model of hidden size 1024 with a 248K vocabulary gets 16, a
    4-layer one 64. Parameters on the meta device (offloaded) count too.
    """
    vocab, hidden = head.weight.shape
    skip = {id(p) for p in head.parameters()}
    try:
        skip.update(id(p) for p in model.get_input_embeddings().parameters())
    except (AttributeError, NotImplementedError):
        pass
    forward = sum(p.numel() for p in model.parameters() if id(p) not in skip)
    stride = DEFAULT_LOSS_TOKEN_STRIDE
    while 2 * vocab * hidden > LOSS_COST_SHARE * forward * stride and stride < MAX_DEFAULT_LOSS_TOKEN_STRIDE:
        stride *= 2
    return stride


def module_device(module: torch.nn.Module) -> torch.device:
    """Device a module computes on: its accelerate execution device when it has one, else its weights'."""
    hook_device = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
    if hook_device is not None:
        return torch.device(hook_device if not isinstance(hook_device, int) else f"cuda:{hook_device}")
    for tensor in module.parameters():
        if tensor.device.type != "meta":
            return tensor.device
    return torch.device("cpu")


def output_head(model: Any) -> tuple[Any, Any] | str:
    """``(final norm, lm_head)`` of a causal LM, or a string saying why they were not found.

    The final norm is the decoder's ``norm`` (:func:`gdnprune.model.forwards.final_norm`), the head
    ``get_output_embeddings()``.
    """
    try:
        head = model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        head = None
    if head is None or getattr(head, "weight", None) is None:
        return f"{type(model).__name__} has no output embeddings (lm_head)"
    norm = final_norm(model)
    if norm is None:
        return f"{type(model).__name__} has no final norm before lm_head (decoder.norm)"
    return norm, head


def loss_gradient(
    norm, head, hidden: torch.Tensor, targets: torch.Tensor, max_logits: int = 1 << 25
) -> torch.Tensor:
    """Gradient of the summed next-token loss of ``lm_head(norm(hidden))`` with respect to ``hidden`` [n, H].

    Token chunks of at most ``max_logits`` logits at a time (the vocabulary may have 150K+ entries; 2^25
    float32 logits are 128 MiB, a few times that at the peak of the backward). Chunks are kept large
    because each one reads the whole ``lm_head`` weight twice: with a 248K vocabulary on CPU, 16-token
    chunks took twice as long as 64-token chunks. The cross-entropy in float32, the returned gradient
    float32 on ``hidden``'s device; only the input gradient is taken (no weight gradients).
    """
    vocab = head.weight.shape[0]  # known on the meta device too
    chunk = max(1, max_logits // max(1, vocab))
    head_device = module_device(head)
    out = []
    with torch.enable_grad():
        for start in range(0, hidden.shape[0], chunk):
            x = hidden[start : start + chunk].detach().requires_grad_(True)
            logits = head(norm(x).to(head_device))
            loss = F.cross_entropy(
                logits.float(), targets[start : start + chunk].to(logits.device), reduction="sum"
            )
            (grad,) = torch.autograd.grad(loss, x)
            out.append(grad.float())
    return torch.cat(out)


def loss_positions(
    ids: torch.Tensor, mask: torch.Tensor | None, first_window: int, stride: int
) -> torch.Tensor:
    """[B, T] bool: the tokens whose loss gradient is measured.

    A token needs a next token in its window (both unmasked). Of those, one position in ``stride`` is
    kept: position ``t`` of the window with running index ``w`` (over all calibration windows) when
    ``(t + w) % stride == 0``, so the choice depends on the windows, not on how they are batched.
    """
    B, T = ids.shape
    valid = torch.zeros(B, T, dtype=torch.bool)
    valid[:, :-1] = True
    if mask is not None:
        m = mask.cpu()
        valid[:, :-1] &= m[:, :-1] & m[:, 1:]
    pos = torch.arange(T)[None, :] + (first_window + torch.arange(B))[:, None]
    return valid & (pos % stride == 0)


class LossGradients:
    """The loss gradient of the measured tokens, collected over batches and computed in large chunks.

    :meth:`add` keeps a batch's final hidden states and next-token targets at the selected tokens (the
    layer scorers keep their ``out_proj`` inputs at the same tokens); once a chunk of ``max_logits``
    logits is full, :meth:`flush` computes the gradient (:func:`loss_gradient`) and hands it to every
    scorer. Each chunk reads the whole ``lm_head`` weight twice, so collecting over batches matters when
    few tokens per batch are measured (a large stride): with a 248K vocabulary on CPU that read costs as
    much as about 30 tokens' products. Call :meth:`flush` after the last batch.
    """

    def __init__(self, head: tuple[Any, Any], scorers, max_logits: int = 1 << 25) -> None:
        self.norm, self.head = head
        self.scorers = scorers
        self.max_logits = max_logits
        self.chunk = max(1, max_logits // max(1, self.head.weight.shape[0]))
        self._hidden: list[torch.Tensor] = []
        self._targets: list[torch.Tensor] = []
        self._count = 0

    def add(self, hidden: torch.Tensor | None, ids: torch.Tensor, select: torch.Tensor) -> None:
        """One batch: ``hidden`` [B, T, H] the final norm's input, ``ids`` [B, T], ``select`` [B, T] bool."""
        if hidden is None or tuple(hidden.shape[:2]) != tuple(ids.shape):
            found = None if hidden is None else list(hidden.shape)
            raise RuntimeError(
                f"the final norm saw hidden states {found}, expected [batch, tokens, hidden] "
                f"for input_ids {list(ids.shape)}"
            )
        flat = select.reshape(-1)
        targets = torch.zeros_like(ids)
        targets[:, :-1] = ids[:, 1:]
        self._hidden.append(hidden.detach().reshape(-1, hidden.shape[-1])[flat.to(hidden.device)])
        self._targets.append(targets.reshape(-1)[flat])
        self._count += int(flat.sum())
        if self._count >= self.chunk:
            self.flush()

    def flush(self) -> None:
        """Compute the gradient of the tokens collected so far and hand it to every scorer."""
        if not self._hidden:
            return
        hidden, targets = torch.cat(self._hidden), torch.cat(self._targets)
        self._hidden, self._targets, self._count = [], [], 0
        if hidden.shape[0] == 0:  # e.g. one-token windows: nothing to measure
            grad = hidden.new_zeros(0, hidden.shape[-1], dtype=torch.float32)
        else:
            grad = loss_gradient(self.norm, self.head, hidden, targets, self.max_logits)
        for scorer in self.scorers:
            scorer.on_loss_gradient(grad)
