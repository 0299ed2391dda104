"""``quantize_checkpoint``: a model folder written again with its projections quantized, in the
``compressed-tensors`` format that vLLM, SGLang and transformers load.

The weights are read tensor by tensor from the folder's safetensors files (uniform, heterogeneous with
``per_layer_config``, MoE with one tensor per expert on disk: the names on disk are kept); each quantized
matrix gets its scales (round-to-nearest, or GPTQ on calibration windows for ``w4a16``) and is compressed by
``compressed-tensors``' own compressor for its format; the config gets the ``quantization_config`` that
``compressed-tensors`` writes (``QuantizationConfig``), with ``ignore`` listing what stays in high precision.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from compressed_tensors import __version__ as ct_version
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.config import CompressionFormat
from compressed_tensors.quantization import (
    QuantizationConfig,
    QuantizationScheme,
    QuantizationStatus,
    preset_name_to_scheme,
)
from compressed_tensors.quantization.utils import calculate_qparams
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm
from transformers import AutoTokenizer

from .. import __version__
from ..checkpoint.folder import CONFIG_NAME, INDEX_NAME, MANIFEST_NAME, SINGLE_NAME
from ..checkpoint.output import Staging, check_paths, copy_other_files, plan_other_files
from ..io.loading import load_causal_lm
from ..quality.calibration import calibration_windows, iter_batches
from ..runtime.fileio import read_json, write_json_atomic
from .gptq import Hessians, gptq
from .schemes import QuantizeError, Scheme, Selection, scheme_named, select_modules

__all__ = ["quantize_checkpoint", "compressed_scheme", "QuantizedWidthWarning"]

_LAYER_TAIL = re.compile(r"(?:^|\.)(layers\.\d+\..*)$")


class QuantizedWidthWarning(UserWarning):
    """A matrix kept in high precision because its widths do not fit the scheme's tiles or groups."""


def compressed_scheme(scheme: Scheme, size: int | None) -> QuantizationScheme:
    """The ``compressed-tensors`` scheme of ``scheme`` at ``size``, targeting ``Linear`` modules."""
    q = preset_name_to_scheme(scheme.preset, ["Linear"])
    assert q.weights is not None
    if scheme.size == "block":
        q.weights.block_structure = [size, size]
        if q.input_activations is not None:
            q.input_activations.group_size = size
    elif scheme.size == "group":
        q.weights.group_size = size
    return q


def _format(q: QuantizationScheme) -> CompressionFormat:
    assert q.weights is not None
    return (
        CompressionFormat.float_quantized if q.weights.type == "float" else CompressionFormat.pack_quantized
    )


def _rtn_scale(weight: torch.Tensor, q: QuantizationScheme, dtype: torch.dtype) -> torch.Tensor:
    """Round-to-nearest scales (``compressed-tensors``' ``calculate_qparams`` on each tile, channel or group's
    minimum and maximum), in the dtype they are stored in."""
    args = q.weights
    assert args is not None
    w = weight.to(torch.float32)
    if args.strategy == "block":
        b0, b1 = args.block_structure
        tiles = w.reshape(w.shape[0] // b0, b0, w.shape[1] // b1, b1)
        lo, hi = tiles.amin(dim=(1, 3)), tiles.amax(dim=(1, 3))
    elif args.strategy == "channel":
        lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    else:
        groups = w.reshape(w.shape[0], -1, args.group_size)
        lo, hi = groups.amin(-1), groups.amax(-1)
    scale, _ = calculate_qparams(lo, hi, args)
    return scale.to(dtype)


def _compress(weight: torch.Tensor, scale: torch.Tensor, q: QuantizationScheme) -> dict[str, torch.Tensor]:
    compressor = BaseCompressor.get_value_from_registry(_format(q).value)
    state = {"weight": weight.to(torch.float32), "weight_scale": scale}
    return {k: v.contiguous() for k, v in compressor.compress(state, q).items()}


def _tensor_files(src: Path) -> dict[str, str]:
    """tensor name -> the safetensors file (relative) that holds it."""
    if (src / INDEX_NAME).exists():
        return dict(read_json(src / INDEX_NAME)["weight_map"])
    if not (src / SINGLE_NAME).exists():
        raise QuantizeError(f"{src}: no {SINGLE_NAME} or {INDEX_NAME}")
    with safe_open(src / SINGLE_NAME, "pt") as f:
        return dict.fromkeys(f.keys(), SINGLE_NAME)


def _shapes(src: Path, files: dict[str, str]) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(set(files.values())):
        with safe_open(src / file, "pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def _hessians(src: Path, selection: Selection, batches: Iterable[torch.Tensor]) -> dict[str, torch.Tensor]:
    """``X Xᵀ`` of every quantized matrix's input on the calibration ``batches``, keyed by its module name on
    disk (the loaded model's names are matched from their ``layers.N.`` on)."""
    model = load_causal_lm(src, dtype="float32", device="cpu")
    by_tail = {m.group(1): name for name in selection.quantized if (m := _LAYER_TAIL.search(name))}
    linears, experts = {}, {}
    for name, module in model.named_modules():
        tail = _LAYER_TAIL.search(name)
        if tail is None:
            continue
        if isinstance(module, torch.nn.Linear) and tail.group(1) in by_tail:
            linears[by_tail[tail.group(1)]] = module
        elif hasattr(module, "gate_up_proj") and f"{tail.group(1)}.0.gate_proj" in by_tail:
            experts[by_tail[f"{tail.group(1)}.0.gate_proj"][: -len(".0.gate_proj")]] = module
    sums = Hessians(linears, experts).run(model, batches)
    for name in selection.quantized:  # an expert's up projection reads the input of its gate projection
        if name.endswith(".up_proj") and ".experts." in name:
            sums[name] = sums.get(name[: -len("up_proj")] + "gate_proj", torch.zeros(0))
    del model
    return sums


def _batches(src: Path, data: Any, *, num_samples: int, seq_len: int, batch_size: int) -> list[torch.Tensor]:
    windows = calibration_windows(
        data, AutoTokenizer.from_pretrained(src), seq_len=seq_len, num_samples=num_samples
    )
    return list(iter_batches(windows, batch_size))


def quantize_checkpoint(
    model_dir: str | os.PathLike,
    output: str | os.PathLike,
    *,
    scheme: str,
    size: int | None = None,
    calibration: str | None = None,
    data: Any = None,
    num_samples: int = 128,
    seq_len: int = 512,
    batch_size: int = 4,
    batches: Iterable[torch.Tensor] | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Write ``model_dir`` to ``output`` with its projections quantized by ``scheme``.

    Args:
        scheme: ``"fp8-block"``, ``"fp8-dynamic"`` or ``"w4a16"`` (:data:`~gdnprune.quantize.SCHEMES`).
        size: the tile edge of ``fp8-block`` or the group size of ``w4a16`` (default 128).
        calibration: ``"rtn"`` (round to nearest) or, for ``w4a16``, ``"gptq"`` (its default), which needs
            calibration text: ``data`` (anything :func:`gdnprune.corpus.data_spec` takes; its first
            ``num_samples`` windows of ``seq_len`` tokens, ``batch_size`` per forward) or ``batches`` (token-id
            tensors ``[batch, seq]``).
        overwrite: replace an existing output folder (a model folder).

    Returns:
        The manifest written to ``output/gdnprune.json``: the scheme, the matrices quantized, those kept in
        high precision and why, the bytes of the weights before and after.

    Raises:
        QuantizeError: an unknown scheme or size, an input already quantized, no matrix that fits, GPTQ
            without calibration batches.

    Warns:
        QuantizedWidthWarning: matrices kept in high precision because a cut left widths that the tiles or
            groups do not divide (each named), and routed experts a scheme keeps.
    """
    src, out = Path(model_dir), Path(output)
    spec, size, calibration = scheme_named(scheme, size, calibration)
    check_paths(src, out, overwrite)
    config = read_json(src / CONFIG_NAME)
    if "quantization_config" in config:
        method = (config["quantization_config"] or {}).get("quant_method", "?")
        raise QuantizeError(f"{src} is already quantized ({method}); quantize its bf16 checkpoint instead")
    files = _tensor_files(src)
    shapes = _shapes(src, files)
    selection = select_modules(shapes, spec, size)
    if not selection.quantized:
        widest = max((s for n, s in shapes.items() if n.endswith(".weight") and len(s) == 2), default=())
        raise QuantizeError(
            f"no projection of {src} fits {scheme}{f' at size {size}' if size else ''} (its widest matrix is "
            f"{' x '.join(map(str, widest))}); give a smaller size that divides its widths"
        )
    unfit_experts = sorted({m.split(".experts.")[0] for m in selection.unfit if ".experts." in m})
    if unfit_experts and spec.name == "w4a16":
        raise QuantizeError(
            f"the routed experts of {unfit_experts[0]}{' and others' if len(unfit_experts) > 1 else ''} do not fit "
            f"groups of {size} ({next(w for m, w in selection.unfit.items() if '.experts.' in m)}); transformers "
            f"loads a w4a16 checkpoint only when every routed expert is quantized: give a --group-size that "
            f"divides their widths"
        )
    _warn(selection, scheme, size)
    q = compressed_scheme(spec, size)
    if calibration == "gptq":
        if batches is None and data is None:
            raise QuantizeError(
                "`calibration=gptq` needs calibration text: give `data` (or `calibration=rtn`)"
            )
        if batches is None:
            batches = _batches(src, data, num_samples=num_samples, seq_len=seq_len, batch_size=batch_size)
        hessians = _hessians(src, selection, batches)
    other, _ = plan_other_files(src, {CONFIG_NAME, INDEX_NAME, MANIFEST_NAME, *files.values()})
    other = [name for name in other if "/" not in name]  # no subfolders (distill's checkpoints, logs)

    def matrix(module: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        if calibration == "gptq":
            w, scale = gptq(tensor, hessians[module], group_size=size or 0, scale_dtype=tensor.dtype)
        else:
            w, scale = tensor, _rtn_scale(tensor, q, tensor.dtype)
        return _compress(w, scale, q)

    staging = Staging(out, overwrite, src=src)
    with staging as tmp:
        bar = tqdm(
            total=len(selection.quantized), desc=f"quantize {scheme}", unit="matrix", disable=not progress
        )
        sizes = _write_weights(src, tmp, files, set(selection.quantized), matrix, bar.update)
        bar.close()
        copy_other_files(src, tmp, other)
        _write_config(tmp, config, q, selection.ignore)
        manifest = {
            "tool": "gdnprune",
            "version": __version__,
            "operation": "quantize",
            "source": {"path": str(src.resolve()), "operation": _source_operation(src)},
            "scheme": scheme,
            "size": size,
            "calibration": calibration,
            "format": _format(q).value,
            "quantized": selection.quantized,
            "high_precision": {**selection.unfit, **dict.fromkeys(selection.kept_experts, "routed expert")},
            "weight_bytes": sizes,
        }
        write_json_atomic(tmp / MANIFEST_NAME, manifest, indent=1)
        staging.commit()
    return manifest


def quantize_model(
    model: Any,
    *,
    scheme: str,
    size: int | None = None,
    calibration: str | None = None,
    **options: Any,
) -> Any:
    """A loaded model quantized by ``scheme`` and loaded back as gdnprune loads a quantized folder (weights
    dequantized, activations quantized as the scheme says): written, quantized
    (:func:`quantize_checkpoint`; ``options``: its calibration options) and read in a temporary folder."""
    with tempfile.TemporaryDirectory(prefix="gdnprune-quantize-") as tmp:
        model.save_pretrained(Path(tmp) / "model")
        quantize_checkpoint(
            Path(tmp) / "model",
            Path(tmp) / "quantized",
            scheme=scheme,
            size=size,
            calibration=calibration,
            progress=False,
            **options,
        )
        return load_causal_lm(Path(tmp) / "quantized", dtype="float32", device=str(model.device)).eval()


def _write_weights(
    src: Path,
    tmp: Path,
    files: dict[str, str],
    chosen: set[str],
    matrix: Callable[[str, torch.Tensor], dict[str, torch.Tensor]],
    done: Callable[[], Any],
) -> dict[str, int]:
    """Every safetensors file of ``src`` written to ``tmp`` under its own name, the weights of ``chosen``
    modules replaced by ``matrix(module, weight)``'s tensors; the index follows. Returns the bytes before and
    after."""
    weight_map: dict[str, str] = {}
    sizes = {"before": 0, "after": 0}
    for file in sorted(set(files.values())):
        written: dict[str, torch.Tensor] = {}
        for name, tensor in load_file(src / file).items():
            sizes["before"] += tensor.numel() * tensor.element_size()
            module = name[: -len(".weight")]
            if module not in chosen or not name.endswith(".weight"):
                written[name] = tensor
                continue
            for key, value in matrix(module, tensor).items():
                written[f"{module}.{key}"] = value
            done()
        for name, tensor in written.items():
            weight_map[name] = file
            sizes["after"] += tensor.numel() * tensor.element_size()
        save_file(written, tmp / file, metadata={"format": "pt"})
    if (src / INDEX_NAME).exists():
        index = read_json(src / INDEX_NAME)
        index["weight_map"] = dict(sorted(weight_map.items()))
        index.setdefault("metadata", {})["total_size"] = sizes["after"]
        write_json_atomic(tmp / INDEX_NAME, index, indent=2)
    return sizes


def _write_config(tmp: Path, config: dict[str, Any], q: QuantizationScheme, ignore: list[str]) -> None:
    """``config.json`` with the ``quantization_config`` compressed-tensors writes (also in ``text_config``,
    so the decoder alone, a ``ForCausalLM``, loads quantized too)."""
    qconfig = QuantizationConfig(
        config_groups={"group_0": q},
        format=_format(q).value,
        quantization_status=QuantizationStatus.COMPRESSED,
        ignore=ignore,
    )
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "version": ct_version,
        **qconfig.model_dump(exclude={"quant_method"}),
    }
    if isinstance(config.get("text_config"), dict):
        config["text_config"]["quantization_config"] = config["quantization_config"]
    write_json_atomic(tmp / CONFIG_NAME, config, indent=2)


def _source_operation(src: Path) -> str | None:
    try:
        return json.loads((src / MANIFEST_NAME).read_text()).get("operation")
    except (OSError, ValueError, AttributeError):
        return None


def _warn(selection: Selection, scheme: str, size: int | None) -> None:
    if selection.unfit:
        names: dict[str, str] = {}
        for module, why in selection.unfit.items():  # a layer's routed experts are named once
            names.setdefault(re.sub(r"\.experts\.\d+\..*$", ".experts", module), why.split(":")[0])
        shown = ", ".join(f"{m} ({shape})" for m, shape in names.items())
        reason = next(why for why in selection.unfit.values() if ": " in why).split(": ", 1)[1]
        warnings.warn(
            f"{len(names)} modules stay in high precision ({reason}{f' at size {size}' if size else ''}): "
            f"{shown}; give a size that divides these widths, or cut widths in multiples of it (`gdnprune "
            f"plan/prune --multiple-of` for head dims and MLP widths)",
            QuantizedWidthWarning,
            stacklevel=3,
        )
    if selection.kept_experts:
        warnings.warn(
            f"{scheme}: the routed experts stay in high precision (transformers cannot load block-scaled fused "
            f"experts); use fp8-dynamic to quantize routed experts",
            QuantizedWidthWarning,
            stacklevel=3,
        )
