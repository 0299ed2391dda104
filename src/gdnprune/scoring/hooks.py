"""Per-layer hooks and float64 statistics of one GDN layer, and the layer's score payload from them.

:class:`LayerScorer` hooks the q/k projection (post-conv q and k statistics) and the ``out_proj`` input
(value head contributions and value channel statistics) of one GDN module, accumulates sums over tokens
in float64, and turns them into the four orders and raw scores of the layer's payload. The measures and
their derivations are in ``docs/scoring.md``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from accelerate.utils import align_module_device
from transformers.activations import ACT2FN

from ..model.forwards import OUTPUT_PROJECTIONS, output_projection
from ..model.geometry import GDNShape
from ..model.layouts import detect_layout
from .payload import layer_payload, needs_loss_gradient, statistic_shapes

__all__ = ["LayerScorer", "materialized_weight"]


def materialized_weight(module: torch.nn.Module, name: str = "weight") -> torch.Tensor:
    """A parameter of ``module``, loaded from accelerate's offload map when it sits on the meta device."""
    tensor = getattr(module, name)
    if tensor is None or tensor.device.type != "meta":
        return tensor
    with align_module_device(module):
        return getattr(module, name).detach().clone()


class LayerScorer:
    """Hooks and float64 statistics of one GDN layer."""

    def __init__(
        self,
        prefix: str,
        module: Any,
        method: str,
        key_dim_measure: str,
        value_dim_measure: str,
        lane_measure: str = "energy_gram",
        key_group_measure: str = "energy_gram",
    ) -> None:
        self.prefix, self.module, self.method = prefix, module, method
        self.key_dim_measure, self.value_dim_measure = key_dim_measure, value_dim_measure
        self.lane_measure, self.key_group_measure = lane_measure, key_group_measure
        self.shape = GDNShape.from_module(module)
        children = dict(module.named_children())
        layout = detect_layout(name for name, _ in module.named_parameters())
        if layout is None:
            raise ValueError(
                f"{prefix}: unsupported GDN module {type(module).__name__}: expected in_proj_qkv (Qwen3.5), "
                f"in_proj_qkvz (Qwen3-Next) or q_proj/k_proj (OLMo-hybrid), found {sorted(children)}"
            )
        self.layout = layout.name
        if not any(name in children for name in OUTPUT_PROJECTIONS) or "conv1d" not in children:
            raise ValueError(f"{prefix}: GDN module {type(module).__name__} has no out_proj/o_proj or conv1d")
        self.out_proj = output_projection(module)
        self.conv: Any = children["conv1d"]
        self.stats: dict[str, torch.Tensor] = {}
        self.num_tokens = 0
        self.num_windows = 0
        self.token_mask: torch.Tensor | None = None  # [B, T] bool of the current batch, None = all tokens
        # [B, T] square roots of the tokens' weights in every second moment (forwards.KL_WEIGHT), None = 1
        self.token_root_weight: torch.Tensor | None = None
        self.loss_select: torch.Tensor | None = None  # [B, T] bool: tokens whose loss gradient is measured
        self.loss_tokens = 0
        self._pending_q: torch.Tensor | None = None
        self._pending_o: list[torch.Tensor] = []  # out_proj input of the loss tokens, [n, Hv*dv] per batch

    @property
    def needs_loss_gradient(self) -> bool:
        """Whether an order of this layer uses the loss-aware Gram (then :meth:`on_loss_gradient` must run)."""
        return needs_loss_gradient(self.method, self.measures)

    # hooks ---------------------------------------------------------------------------------------

    def attach(self) -> list[Any]:
        """Register the hooks; returns the handles."""
        m, handles = self.module, []
        handles.append(self.out_proj.register_forward_pre_hook(self._out_hook))
        if self.layout == "qwen3_5":
            handles.append(m.in_proj_qkv.register_forward_hook(self._qkv_hook))
        elif self.layout == "qwen3_next":
            handles.append(m.in_proj_qkvz.register_forward_hook(self._qkvz_hook))
        else:
            handles.append(m.q_proj.register_forward_hook(self._q_hook))
            handles.append(m.k_proj.register_forward_hook(self._k_hook))
        return handles

    def _qkv_hook(self, module, args, output) -> None:
        self._on_qk(output[..., : 2 * self.shape.key_dim])

    def _qkvz_hook(self, module, args, output) -> None:
        s = self.shape
        per_group = output.shape[-1] // s.num_key_heads
        grouped = output.reshape(*output.shape[:-1], s.num_key_heads, per_group)
        q = grouped[..., : s.key_head_dim].flatten(-2)
        k = grouped[..., s.key_head_dim : 2 * s.key_head_dim].flatten(-2)
        self._on_qk(torch.cat([q, k], dim=-1))

    def _q_hook(self, module, args, output) -> None:
        self._pending_q = output

    def _k_hook(self, module, args, output) -> None:
        q, self._pending_q = self._pending_q, None
        if q is None:  # pragma: no cover - q_proj always runs first
            raise RuntimeError(f"{self.prefix}: k_proj ran before q_proj")
        self._on_qk(torch.cat([q, output.to(q.device)], dim=-1))

    def _out_hook(self, module, args) -> None:
        self._on_out(args[0])

    # statistics ----------------------------------------------------------------------------------

    def _acc(self, name: str, value: torch.Tensor) -> None:
        """Add ``value`` to the float64 accumulator ``name`` (created on ``value``'s device)."""
        if name in self.stats:
            self.stats[name] += value
        else:
            self.stats[name] = value.to(torch.float64).clone()

    def _mask_on(self, device) -> torch.Tensor | None:
        return None if self.token_mask is None else self.token_mask.to(device)

    def _on_qk(self, qk: torch.Tensor) -> None:
        """q/k projection output [B, T, 2*Hk*dk] (canonical [q | k]) -> post-conv q, k statistics."""
        s = self.shape
        kd = s.key_dim
        B, T = qk.shape[0], qk.shape[1]
        weight = self.conv.weight[: 2 * kd]
        bias = None if self.conv.bias is None else self.conv.bias[: 2 * kd]
        x = qk.detach().transpose(1, 2)
        weight = weight.to(x.device)
        bias = None if bias is None else bias.to(x.device)
        kernel = weight.shape[-1]
        y = F.conv1d(x.to(weight.dtype), weight, bias, padding=kernel - 1, groups=2 * kd)[..., :T]
        y = ACT2FN[getattr(self.module, "activation", "silu")](y).float()  # [B, 2kd, T]
        mask = self._mask_on(y.device)
        if self.method == "activation":
            # per-window mean |q|, |k| over (valid) tokens, squared and summed over windows
            a = y.abs()
            if mask is None:
                means = a.mean(-1)
            else:
                m = mask[:, None, :].to(a.dtype)
                means = (a * m).sum(-1) / m.sum(-1).clamp_min(1)
            self._acc("qk_abs_mean_sq", (means.double() ** 2).sum(0))
            return
        y = y.reshape(B, 2, s.num_key_heads, s.key_head_dim, T)
        y = y * torch.rsqrt((y * y).sum(3, keepdim=True) + 1e-6)  # the kernel's l2norm
        if mask is not None:
            y = y * mask[:, None, None, None, :].to(y.dtype)
        if self.token_root_weight is not None:
            y = y * self.token_root_weight.to(y.device, y.dtype)[:, None, None, None, :]
        if self.key_dim_measure != "qk_gram":  # per-channel energies of q^ and k^ suffice: [2, Hk, dk]
            self._acc("qk_sq", y.to(self._gram_dtype(y.device)).pow(2).sum((0, 4)))
            return
        # [2, Hk, dk, B*T] -> per (q|k, head) second moments [2, Hk, dk, dk]
        flat = y.permute(1, 2, 3, 0, 4).reshape(2 * s.num_key_heads, s.key_head_dim, B * T)
        flat = flat.to(self._gram_dtype(flat.device))
        moments = torch.bmm(flat, flat.transpose(1, 2)).reshape(
            2, s.num_key_heads, s.key_head_dim, s.key_head_dim
        )
        self._acc("qk_moments", moments)

    def _on_out(self, o: torch.Tensor) -> None:
        """out_proj input [B, T, Hv*dv] -> value head / value channel statistics."""
        o = o.detach()
        B, T, V = o.shape[0], o.shape[1], o.shape[-1]
        mask = self._mask_on(o.device)
        n_valid = B * T if mask is None else int(mask.sum())
        self.num_tokens += n_valid
        self.num_windows += B
        if self.method == "activation":
            a = o.float().abs()
            if mask is None:
                means = a.mean(1)
            else:
                m = mask[:, :, None].to(a.dtype)
                means = (a * m).sum(1) / m.sum(1).clamp_min(1)
            self._acc("out_abs_mean_sq", (means.double() ** 2).sum(0))
            return
        if self.token_root_weight is not None:  # every second moment below weighs each token by its weight
            o = o * self.token_root_weight.to(o.device, o.dtype)[..., None]
        if self.loss_select is not None:
            self._pending_o.append(o.reshape(B * T, V)[self.loss_select.to(o.device).reshape(-1)])
        x = o.reshape(B * T, V)
        if mask is not None:
            x = x[mask.reshape(-1)]
        x = x.to(self._gram_dtype(x.device))
        if self.value_dim_measure == "gram":
            # full second moment C = sum_t o o^T; every Gram matrix is a block sum of (W^T W) * C
            self._acc("out_moment", x.T @ x)
            return
        s = self.shape
        Hv, dv = s.num_value_heads, s.value_head_dim
        heads = x.reshape(-1, Hv, dv)
        if self.value_dim_measure == "energy":
            # same-channel cross-head moments [dv, Hv, Hv]: enough for each value channel's own energy
            per_dim = heads.permute(2, 1, 0)
            self._acc("channel_moments", torch.bmm(per_dim, per_dim.transpose(1, 2)))
        elif self.value_dim_measure == "head_rms":
            self._acc("out_sq", x.pow(2).sum(0))  # [Hv*dv]
        # per-head contributions c_h = W_h o_h [Hv, n, H] (in token chunks) -> head Gram [Hv, Hv]. Each
        # entry of c sums dv products of one token, so c is computed in float32 like out_proj itself;
        # the sum over tokens (the Gram) is taken in the Gram dtype (float64 on CPU).
        W = materialized_weight(self.out_proj).detach().to(x.device, torch.float32)
        W_heads = W.reshape(W.shape[0], Hv, dv).permute(1, 2, 0)  # [Hv, dv, H]
        heads32 = heads.float()
        chunk = max(1, (1 << 24) // max(1, Hv * W.shape[0]))
        gram = torch.zeros(Hv, Hv, dtype=x.dtype, device=x.device)
        for start in range(0, heads.shape[0], chunk):
            c = torch.bmm(heads32[start : start + chunk].transpose(0, 1), W_heads).reshape(Hv, -1).to(x.dtype)
            gram += c @ c.T
        self._acc("head_gram", gram)

    def on_loss_gradient(self, grad: torch.Tensor) -> None:
        """Accumulate the loss-aware Grams from ``grad`` [n, H], the loss gradient at the selected tokens.

        ``grad`` is the gradient of the next-token loss with respect to the final residual stream (input
        of the final norm) at the tokens of ``loss_select`` of the batches since the last call, in their
        order (:class:`~gdnprune.scoring.loss_head.LossGradients` collects them). Along the direct path a head's
        contribution ``c_h`` changes the loss by about ``g . c_h``, so removing a set ``R`` changes it by
        ``-sum_{h in R} g . c_h``, whose square summed over tokens is ``1^T F_RR 1`` with
        ``F[h, k] = sum_t (g_t . c_h(t)) (g_t . c_k(t))``; the same for value channels with the channel's
        contribution summed over heads.
        """
        pending, self._pending_o = self._pending_o, []
        o = torch.cat(pending) if len(pending) > 1 else pending[0] if pending else None
        if o is None or o.shape[0] == 0:
            return
        if o.shape[0] != grad.shape[0]:
            raise RuntimeError(
                f"{self.prefix}: {o.shape[0]} out_proj tokens kept for {grad.shape[0]} loss gradients"
            )
        s = self.shape
        Hv, dv = s.num_value_heads, s.value_head_dim
        W = materialized_weight(self.out_proj).detach()
        # W^T g: the gradient at the out_proj input, then times the input: per (head, channel) terms of
        # g . c_h (float32 products, like out_proj; sums over tokens in the Gram dtype)
        terms = ((grad.to(W.device, torch.float32) @ W.float()).to(o.device) * o.float()).reshape(-1, Hv, dv)
        dtype = self._gram_dtype(o.device)
        per_head = terms.sum(-1).to(dtype)  # [n, Hv]: g . c_h
        self._acc("loss_head_gram", per_head.T @ per_head)
        if self.value_dim_measure == "loss_gram":
            per_dim = terms.sum(1).to(dtype)  # [n, dv]: g . (channel e's contribution summed over heads)
            self._acc("loss_dim_gram", per_dim.T @ per_dim)
        self.loss_tokens += int(grad.shape[0])

    @staticmethod
    def _gram_dtype(device: torch.device) -> torch.dtype:
        """float64 products on CPU; float32 products (added to float64 sums) on accelerators."""
        return torch.float64 if device.type == "cpu" else torch.float32

    # results -------------------------------------------------------------------------------------

    @property
    def measures(self) -> dict[str, str]:
        """The measures of this layer's orders, as the scores file records them."""
        return {
            "key_group": self.key_group_measure,
            "value_lane": self.lane_measure,
            "key_dim": self.key_dim_measure,
            "value_dim": self.value_dim_measure,
        }

    def statistics(self) -> dict[str, torch.Tensor]:
        """The layer's sums so far, on the CPU: float64 sums and int64 counts (:func:`.payload.statistic_shapes`).

        Weight-dependent factors are folded in linearly here (``|W[:, (h, e)]|^2`` for ``head_rms``, the
        ``W`` products of ``energy`` and ``gram``), so statistics of disjoint token sets add up to those
        of their union. A statistic never accumulated (no tokens yet) is zero.
        """
        s = self.shape
        Hv, dv = s.num_value_heads, s.value_head_dim
        raw = {k: v.detach().to("cpu", torch.float64) for k, v in self.stats.items()}
        out: dict[str, torch.Tensor] = {
            "num_tokens": torch.tensor(self.num_tokens, dtype=torch.int64),
            "num_windows": torch.tensor(self.num_windows, dtype=torch.int64),
            "loss_tokens": torch.tensor(self.loss_tokens, dtype=torch.int64),
        }
        if self.method == "projection" and raw:
            W = materialized_weight(self.out_proj).detach().to("cpu", torch.float64)
            if self.value_dim_measure == "gram":
                P = ((W.T @ W) * raw.pop("out_moment")).reshape(Hv, dv, Hv, dv)
                raw["head_gram"], raw["value_dim_gram"] = P.sum((1, 3)), P.sum((0, 2))
            elif self.value_dim_measure == "head_rms":
                raw["value_col_energy"] = W.pow(2).sum(0).reshape(Hv, dv) * raw.pop("out_sq").reshape(Hv, dv)
            elif self.value_dim_measure == "energy":
                W_dims = W.reshape(W.shape[0], Hv, dv).permute(2, 1, 0)  # [dv, Hv, H]
                moments = raw.pop("channel_moments")  # [dv, Hv, Hv]
                raw["value_dim_energy"] = (torch.bmm(W_dims, W_dims.transpose(1, 2)) * moments).sum((1, 2))
        for name, size in statistic_shapes(s, self.method, self.measures).items():
            if name not in out:
                out[name] = raw[name].reshape(size) if name in raw else torch.zeros(size, dtype=torch.float64)
        return out

    def payload(self) -> dict[str, Any]:
        """The layer's score payload (orders, raw scores, geometry) from the statistics of this process."""
        return layer_payload(
            self.statistics(),
            prefix=self.prefix,
            shape=self.shape,
            layout=self.layout,
            method=self.method,
            measures=self.measures,
        )
