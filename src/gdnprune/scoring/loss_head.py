"""The loss-gradient head: the gradient of the next-token loss at the final norm's input, on chosen tokens.

Behind the loss-aware Grams (lanes by default): after each calibration forward, the final norm and
``lm_head`` are re-run on one token in ``stride`` of the batch, in chunks that bound the number of logits,
and differentiated with respect to their input only. See ``docs/scoring.md``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["module_device", "output_head", "loss_gradient", "loss_positions", "measure_loss_gradient"]


def module_device(module: torch.nn.Module) -> torch.device:
    """Device a module computes on: its accelerate execution device when it has one, else its weights'."""
    hook_device = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
    if hook_device is not None:
        return torch.device(hook_device if not isinstance(hook_device, int) else f"cuda:{hook_device}")
    for tensor in module.parameters():
        if tensor.device.type != "meta":
            return tensor.device
    return torch.device("cpu")


def output_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module] | str:
    """``(final norm, lm_head)`` of a causal LM, or a string saying why they were not found.

    The final norm is the decoder's ``norm`` (``model.model.norm``; ``model.model.language_model.norm``
    for the vision-language models, found through ``get_decoder()``), the head ``get_output_embeddings()``.
    """
    try:
        head = model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        head = None
    if head is None or getattr(head, "weight", None) is None:
        return f"{type(model).__name__} has no output embeddings (lm_head)"
    decoder = None
    for get in (lambda: model.get_decoder(), lambda: model.model, lambda: model.model.language_model):
        try:
            candidate = get()
        except (AttributeError, NotImplementedError, TypeError):
            continue
        if candidate is not None and isinstance(getattr(candidate, "norm", None), torch.nn.Module):
            decoder = candidate
            break
    if decoder is None:
        return f"{type(model).__name__} has no final norm before lm_head (decoder.norm)"
    return decoder.norm, head


def loss_gradient(norm, head, hidden: torch.Tensor, targets: torch.Tensor, max_logits: int = 1 << 25
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
            loss = F.cross_entropy(logits.float(), targets[start : start + chunk].to(logits.device), reduction="sum")
            (grad,) = torch.autograd.grad(loss, x)
            out.append(grad.float())
    return torch.cat(out)


def loss_positions(ids: torch.Tensor, mask: torch.Tensor | None, first_window: int, stride: int) -> torch.Tensor:
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


def measure_loss_gradient(head, hidden, ids, select, scorers) -> None:
    """The loss gradient at the selected tokens of a batch, handed to every layer scorer."""
    if hidden is None or tuple(hidden.shape[:2]) != tuple(ids.shape):
        found = None if hidden is None else list(hidden.shape)
        raise RuntimeError(f"the final norm saw hidden states {found}, expected [batch, tokens, hidden] "
                           f"for input_ids {list(ids.shape)}")
    targets = torch.zeros_like(ids)
    targets[:, :-1] = ids[:, 1:]
    flat = select.reshape(-1)
    if not bool(flat.any()):  # e.g. one-token windows: nothing to measure in this batch
        for scorer in scorers:
            scorer.on_loss_gradient(hidden.new_zeros(0, hidden.shape[-1], dtype=torch.float32))
        return
    chosen = hidden.detach().reshape(-1, hidden.shape[-1])[flat.to(hidden.device)]
    grad = loss_gradient(head[0], head[1], chosen, targets.reshape(-1)[flat])
    for scorer in scorers:
        scorer.on_loss_gradient(grad)
