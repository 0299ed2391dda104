"""GPTQ (Frantar et al., 2022, arXiv 2210.17323): integer weights chosen column by column with the rounding
error of each column spread over the columns not yet quantized, weighted by the inverse Hessian of the
layer's squared output error, ``H = 2 X Xᵀ`` over the calibration inputs ``X``.

For each column ``j`` (in blocks of columns, the paper's lazy batch updates):

    q_j = quant(w_j);   e = (w_j - q_j) / U_jj;   w_k -= e U_jk  for k > j

where ``U`` is the upper Cholesky factor of ``H⁻¹`` (dampened by a fraction of its mean diagonal). Group
scales are taken when the first column of a group is reached, from the weights as updated so far (the
paper's grouping). With ``H = I`` no error moves and GPTQ is round-to-nearest.

:class:`Hessians` collects ``X Xᵀ`` with hooks: for every ``nn.Linear`` it is given, and for the routed
experts of a fused MoE module (the tokens routed to each expert, and the input of its down projection).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

__all__ = ["gptq", "group_scales", "Hessians"]


def group_scales(weight: torch.Tensor, group_size: int, qmax: float, dtype: torch.dtype) -> torch.Tensor:
    """Symmetric scales ``max |w| / qmax`` per (row, group of ``group_size`` columns), rounded to ``dtype``
    (the dtype they are stored in) and never zero."""
    rows, cols = weight.shape
    amax = weight.abs().reshape(rows, cols // group_size, group_size).amax(-1)
    scale = (amax / qmax).to(dtype)
    return torch.where(scale == 0, torch.finfo(dtype).eps, scale.float()).to(dtype)


def _round(w: torch.Tensor, scale: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
    return torch.round(torch.clamp(w / scale, qmin, qmax)) * scale


def gptq(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    *,
    group_size: int,
    bits: int = 4,
    scale_dtype: torch.dtype = torch.bfloat16,
    damp: float = 0.01,
    block: int = 128,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ of one matrix ``weight [out, in]`` with ``hessian [in, in]`` (``X Xᵀ``, any positive scale):
    returns ``(dequantized weight in float32, scales [out, in // group_size] in scale_dtype)``; the weight
    lies on the symmetric ``bits``-bit grid of its scales (``q * scale``, ``q`` in ``[-2^(b-1), 2^(b-1)-1]``)."""
    w = weight.detach().to(torch.float32).clone()
    rows, cols = w.shape
    if cols % group_size:
        raise ValueError(f"{cols} input channels are not a multiple of the group size {group_size}")
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    h = hessian.detach().to(torch.float64).clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += damp * torch.mean(torch.diag(h)) * torch.eye(cols, dtype=h.dtype)
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).to(torch.float32)
    scales = torch.empty(rows, cols // group_size, dtype=scale_dtype)
    half = (qmax - qmin) / 2  # the scale of compressed-tensors' symmetric integers: max |w| / 7.5 at 4 bits
    for start in range(0, cols, block):
        end = min(start + block, cols)
        w1, err = w[:, start:end].clone(), torch.zeros(rows, end - start)
        for i in range(end - start):
            col = start + i
            if col % group_size == 0:
                g = col // group_size
                scales[:, g : g + 1] = group_scales(
                    torch.cat([w1[:, i:], w[:, end:]], 1)[:, :group_size], group_size, half, scale_dtype
                )
            s = scales[:, col // group_size].to(torch.float32)
            q = _round(w1[:, i], s, qmin, qmax)
            e = (w1[:, i] - q) / u[col, col]
            w1[:, i:] -= e.unsqueeze(1) * u[col, col:end].unsqueeze(0)
            w1[:, i] = q
            err[:, i] = e
        w[:, start:end] = w1
        w[:, end:] -= err @ u[start:end, end:]
    return w, scales


class Hessians:
    """``X Xᵀ`` of the inputs of named modules during forwards (``with Hessians(linears, experts) as h:``).

    ``linears``: ``{name: nn.Linear}``. ``experts``: ``{name: fused experts module}`` whose forward is
    ``(hidden [T, d], top_k_index [T, k], top_k_weights)`` and whose ``gate_up_proj [E, 2I, d]`` and
    ``down_proj [E, d, I]`` hold every expert (transformers 5's fused MoE); the Hessians of expert ``e`` are
    keyed ``{name}.{e}.gate_proj`` (= ``up_proj``) and ``{name}.{e}.down_proj``.
    """

    def __init__(
        self, linears: Mapping[str, torch.nn.Module], experts: Mapping[str, torch.nn.Module] | None = None
    ) -> None:
        self.linears, self.experts = dict(linears), dict(experts or {})
        self.sums: dict[str, torch.Tensor] = {}
        self.handles: list[Any] = []

    def _add(self, key: str, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).to(torch.float64)
        if x.shape[0] == 0:
            return
        gram = x.T @ x
        self.sums[key] = self.sums[key] + gram if key in self.sums else gram

    def _linear_hook(self, name: str) -> Callable:
        def hook(module, args, kwargs):
            self._add(name, (args[0] if args else next(iter(kwargs.values()))).detach())

        return hook

    def _experts_hook(self, name: str) -> Callable:
        def hook(module, args, kwargs):
            values = list(args) + list(kwargs.values())
            hidden, index = values[0].detach(), values[1]
            act = getattr(module, "act_fn", torch.nn.functional.silu)
            for e in range(module.gate_up_proj.shape[0]):
                rows = (index == e).any(-1).nonzero().squeeze(-1)
                x = hidden[rows]
                self._add(f"{name}.{e}.gate_proj", x)
                gate, up = torch.nn.functional.linear(x, module.gate_up_proj[e]).chunk(2, dim=-1)
                self._add(f"{name}.{e}.down_proj", act(gate) * up)

        return hook

    def __enter__(self) -> Hessians:
        for name, module in self.linears.items():
            self.handles.append(module.register_forward_pre_hook(self._linear_hook(name), with_kwargs=True))
        for name, module in self.experts.items():
            self.handles.append(module.register_forward_pre_hook(self._experts_hook(name), with_kwargs=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def run(self, model: torch.nn.Module, batches: Iterable[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Forward ``batches`` of token ids through ``model`` with the hooks on; the summed ``X Xᵀ``."""
        device = next(model.parameters()).device
        with self, torch.no_grad():
            for ids in batches:
                model(input_ids=ids.to(device), use_cache=False)
        return self.sums
