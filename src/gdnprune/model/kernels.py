"""The gated delta rule on CPU, faster than transformers' reference fallback, for the library's own forwards.

Without flash-linear-attention (every CPU machine), transformers' GDN layers run
``torch_chunk_gated_delta_rule``, its pure-torch reference. That function pads every sequence to a multiple of
64, solves the chunk's triangular system twice even when there is no state to read, and allocates a new
``[batch, heads, chunk, chunk]`` tensor for every step of the decay mask. :func:`chunk_gated_delta_rule` computes
the same function, chunk by chunk without padding (the last chunk is as long as what is left), with one solve
per chunk when the state starts at zero, shorter chunks for small head states (:data:`SMALL_STATE`), and in place
where no gradient is needed: 2x faster on the plan's calibration windows, equal to the reference to float rounding (``tests/test_kernels.py`` checks it against
transformers' chunked and recurrent rules).

:func:`cpu_gdn_kernels` puts it in place of the reference, in the transformers modules already imported, for the
duration of a ``with`` block (the plan's measurements, scoring, distillation; not eval, whose numbers are lm-eval's own); where flash-linear-attention is installed it
changes nothing.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["chunk_gated_delta_rule", "cpu_gdn_kernels", "GDN_MODELING_MODULES"]

#: the transformers modules whose GDN layers call the module-level ``torch_chunk_gated_delta_rule``
GDN_MODELING_MODULES = (
    "transformers.models.qwen3_next.modeling_qwen3_next",
    "transformers.models.qwen3_5.modeling_qwen3_5",
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
    "transformers.models.olmo_hybrid.modeling_olmo_hybrid",
    "transformers.models.qwen4_exp.modeling_qwen4_exp",
)
#: a head state of at most this many entries (``Dk * Dv``) runs chunks of 16 tokens: the pairwise ``[chunk, chunk]``
#: tensors then cost more than the state's products (measured on CPU: 2x faster at 8 x 8, even at 32 x 32; at
#: 128 x 128 chunks of 64 are fastest)
SMALL_STATE = 1024
_NAME = "torch_chunk_gated_delta_rule"
_LOCK = threading.Lock()
_DEPTH = 0
_SAVED: dict[str, Any] = {}


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)  # as transformers' (and FLA's) l2norm


def chunk_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule over a whole sequence, with the arguments and results of transformers'
    ``torch_chunk_gated_delta_rule``: ``query``/``key`` ``[B, T, Hk, Dk]``, ``value`` ``[B, T, Hv, Dv]``, the
    log decay ``g`` and the write strength ``beta`` ``[B, T, Hv]``; each key head serves ``Hv / Hk``
    consecutive value heads. Returns the output ``[B, T, Hv, Dv]`` in the input's dtype and, when asked, the
    state ``[B, Hv, Dk, Dv]`` (float32) after the last token.

    Per chunk of ``chunk_size`` tokens, with ``c`` the cumulative log decay inside the chunk,
    ``D[i, j] = exp(c_i - c_j)`` for ``j <= i`` (0 above the diagonal) and ``S`` the state before the chunk:
    the new values ``U = (I + tril(beta K K^T * D, -1))^-1 (beta V - beta exp(c) K S)``, the output
    ``exp(c) Q S + (Q K^T * D) U``, the next state ``exp(c_last) S + (exp(c_last - c) K)^T U``."""
    if kwargs.get("cu_seqlens") is not None or kwargs.get("seq_idx") is not None:
        raise ValueError("the CPU gated delta rule keeps no packed sequences apart (cu_seqlens / seq_idx)")
    with torch.autocast(query.device.type, enabled=False):  # float32 throughout, as FLA's kernels
        return _rule(
            query, key, value, g, beta, chunk_size, initial_state, output_final_state, use_qk_l2norm_in_kernel
        )


def _rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    use_qk_l2norm_in_kernel: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    dtype = query.dtype
    key_heads, key_dim = key.shape[2], key.shape[3]
    value_heads, value_dim = value.shape[2], value.shape[3]
    if key_heads != value_heads:
        query = query.repeat_interleave(value_heads // key_heads, dim=2)
        key = key.repeat_interleave(value_heads // key_heads, dim=2)
    # [B, H, T, D], contiguous: strided operands may take another BLAS path, and a window's result would then
    # depend on the windows batched with it
    q, k, v, b, decay = (x.transpose(1, 2).float().contiguous() for x in (query, key, value, beta, g))
    b = b.unsqueeze(-1)
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    q = q * key_dim**-0.5
    if key_dim * value_dim <= SMALL_STATE:  # the pairwise tensors cost more than the state's products
        chunk_size = min(chunk_size, 16)
    inplace = not torch.is_grad_enabled()
    state = None if initial_state is None else initial_state.float()
    length = k.shape[2]
    outs = []
    for start in range(0, length, chunk_size):
        part = slice(start, start + chunk_size)
        qc, kc, vc, bc = q[:, :, part], k[:, :, part], v[:, :, part], b[:, :, part]
        c = decay[:, :, part].cumsum(-1)
        pair = c.unsqueeze(-1) - c.unsqueeze(-2)  # c_i - c_j: <= 0 on and below the diagonal (g <= 0)
        weights = pair.clamp_(max=0).exp_().tril_() if inplace else pair.clamp(max=0).exp().tril()
        kb = kc * bc
        system = kb @ kc.transpose(-1, -2)
        attn = qc @ kc.transpose(-1, -2)
        system, attn = (
            (system.mul_(weights), attn.mul_(weights)) if inplace else (system * weights, attn * weights)
        )
        if state is None:
            new = torch.linalg.solve_triangular(system, vc * bc, upper=False, unitriangular=True)
            out = attn @ new
        else:
            grown = c.exp().unsqueeze(-1)
            both = torch.linalg.solve_triangular(
                system, torch.cat([vc * bc, kb * grown], -1), upper=False, unitriangular=True
            )
            new = both[..., :value_dim] - both[..., value_dim:] @ state
            out = (qc * grown) @ state + attn @ new
        if output_final_state or start + chunk_size < length:
            last = c[..., -1:]
            write = (kc * (last - c).exp().unsqueeze(-1)).transpose(-1, -2) @ new
            state = write if state is None else state * last.exp().unsqueeze(-1) + write
        outs.append(out)
    output = torch.cat(outs, 2).transpose(1, 2).contiguous().to(dtype)
    if output_final_state and state is None:  # an empty sequence
        state = torch.zeros(k.shape[0], value_heads, key_dim, value_dim, dtype=torch.float32, device=k.device)
    return output, (state if output_final_state else None)


def _fla_installed() -> bool:
    return importlib.util.find_spec("fla") is not None


def _is_reference(function: Any, module: str) -> bool:
    """Whether ``function`` is transformers' own fallback of ``module`` (not a kernel or a function someone put
    there)."""
    return getattr(function, "__module__", None) == module and getattr(function, "__name__", None) == _NAME


@contextlib.contextmanager
def cpu_gdn_kernels() -> Iterator[None]:
    """Inside the block, the GDN layers of the transformers modules already imported (a model already built)
    run :func:`chunk_gated_delta_rule` in place of the reference fallback; where flash-linear-attention is
    installed, or something else stands in the fallback's place, they keep it. Re-entrant; the originals are back when the outermost block ends."""
    global _DEPTH
    with _LOCK:
        if _DEPTH == 0 and not _fla_installed():
            for name in GDN_MODELING_MODULES:
                module = sys.modules.get(name)
                original = getattr(module, _NAME, None)
                if _is_reference(original, name):
                    _SAVED[name] = original
                    setattr(module, _NAME, chunk_gated_delta_rule)
        _DEPTH += 1
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH -= 1
            if _DEPTH == 0:
                for name, original in _SAVED.items():
                    module = sys.modules.get(name)
                    if module is not None:
                        setattr(module, _NAME, original)
                _SAVED.clear()
