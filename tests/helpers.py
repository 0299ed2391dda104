"""Helpers shared by the test modules: tiny checkpoint folders, randomised tiny models and the independent
references the tests compare against. A test module imports from here (or from ``tiny_models`` and
``reference``), never from another test module.

Sections: checkpoint folders written by ``save_pretrained`` (``make_source``); models whose attention and
MLP weights are random (``random_dense_model``, built once per process and copied); byte-exact folders from
numpy's PCG64 stream (``build_source``); FP8 block quantisation and FP8 checkpoints (``make_fp8``); layers
skipped in the forward; teachers and students for distillation (``pair``, ``make_pair``, ``windows``); the command
line and environment of a child Python process (``python_command``, ``child_env``: torchrun, accelerate launch,
lm_eval and gdnprune run as a user runs them).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from tiny_models import build_model, make_config
from tokenizers import Tokenizer, models, pre_tokenizers

from gdnprune import checkpoint as ck
from gdnprune import demo_data
from gdnprune.cli import main
from gdnprune.gated_delta_net import slice_gated_delta_net_state_dict
from gdnprune.io.loading import slice_model
from gdnprune.model.geometry import GDNShape
from gdnprune.model.layouts import find_gdn_modules, get_layout
from gdnprune.model.subblock_surgery import find_model_blocks, random_orders
from gdnprune.quality import compensate
from gdnprune.scoring import score_model, scores_to_permutations

# ---- checkpoint folders as save_pretrained writes them ----------------------------------------------------

#: the GDN geometry of the folders of :func:`make_source`
SOURCE_SHAPE = GDNShape(num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=6)
MODEL_TYPES = ["qwen3_5", "qwen3_5_vl", "qwen3_5_moe", "qwen3_next", "olmo_hybrid"]
EXTRA_FILES = {
    "chat_template.jinja": "{{ messages }}",
    "preprocessor_config.json": '{"size": 4}',
    "README.md": "# tiny\n",
    "assets/notes.txt": "nested file\n",
}


def tokenizer_files(folder: Path) -> None:
    words = ["[UNK]", "the", "model", "sorts", "heads", "and", "slices", "them", "a", "of", "to"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(folder)


def add_mtp(folder: Path, extra: dict[str, torch.Tensor]) -> None:
    """Add tensors (e.g. ``mtp.*``) to the last shard and to the index, as real Qwen checkpoints have them."""
    index_path = folder / ck.INDEX_NAME
    if index_path.exists():
        index = json.loads(index_path.read_text())
        shard = sorted(set(index["weight_map"].values()))[-1]
    else:
        index, shard = None, ck.SINGLE_NAME
    tensors = load_file(folder / shard)
    tensors.update(extra)
    save_file(tensors, folder / shard, metadata={"format": "pt"})
    if index is not None:
        index["weight_map"].update({k: shard for k in extra})
        index["metadata"]["total_size"] += sum(t.nbytes for t in extra.values())
        index_path.write_text(json.dumps(index, indent=2))


def mtp_tensors(dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "mtp.fc.weight": torch.randn(64, 128, generator=g).to(dtype),
        "mtp.layers.0.self_attn.q_proj.weight": torch.randn(64, 64, generator=g).to(dtype),
        "mtp.norm.weight": torch.randn(64, generator=g).to(dtype),
    }


def make_source(
    folder: Path, model_type: str, *, dtype=torch.float32, sharded: bool = True, seed: int = 0, config=None
) -> Path:
    """A model folder of ``model_type`` as save_pretrained writes it, plus mtp tensors and other files."""
    model = build_model(model_type, SOURCE_SHAPE, seed=seed, config=config).to(dtype)
    model.save_pretrained(folder, max_shard_size="20KB" if sharded else "1GB")
    add_mtp(folder, mtp_tensors(dtype))
    tokenizer_files(folder)
    for name, text in EXTRA_FILES.items():
        (folder / name).parent.mkdir(exist_ok=True)
        (folder / name).write_text(text)
    return folder


def scored_source(
    root: Path,
    model_type: str = "qwen3_5",
    *,
    seed: int = 6,
    text: str = "the model sorts heads and slices them",
    repeats: int = 400,
    num_samples: int = 4,
    seq_len: int = 72,
) -> tuple[Path, Path, Path]:
    """A model folder (:func:`make_source`) in ``root``, its calibration text (``text`` ``repeats`` times) and
    the scores file ``gdnprune score`` writes from them (every kind of block); returns the three paths."""
    src = make_source(root / model_type, model_type, seed=seed)
    calib, scores = root / "calib.txt", root / f"{model_type}.scores.json"
    calib.write_text(" ".join([text] * repeats))
    argv = ["score", str(src), "--data", str(calib), "--output", str(scores)]
    assert main([*argv, "--num-samples", str(num_samples), "--seq-len", str(seq_len), "--quiet"]) == 0
    return src, calib, scores


def raw_tensors(folder: Path) -> dict[str, tuple[str, tuple, bytes]]:
    """name -> (dtype, shape, raw bytes) read straight from the files."""
    ckpt = ck.open_checkpoint(folder)
    out = {}
    for shard in ckpt.shards:
        data = Path(shard.path).read_bytes()
        for t in shard.tensors.values():
            out[t.name] = (t.dtype, t.shape, data[t.start : t.end])
    return out


def leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if "gdnprune-" in p.name]


@contextlib.contextmanager
def tmpfs(path: Path, options: str, why: str) -> Iterator[Path]:
    """A tmpfs mounted at ``path`` (made here) with the mount ``options`` (``"ro,size=8m"``), unmounted after.

    Mounting needs root; elsewhere the test is skipped, saying ``why`` it needs the mount. For a fixture:
    ``with tmpfs(tmp_path / "m", "size=64k", "...") as mnt: yield mnt``.
    """
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip(f"needs root to mount {why}")
    path.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


# ---- tiny models with random attention and MLP weights --------------------------------------------------

#: the GDN geometry of :func:`random_dense_model`
DENSE_SHAPE = GDNShape(2, 4, 8, 8)
DENSE = ("attention", "mlp", "shared_expert")  # routed experts: tests/test_experts.py
DENSE_TARGET = {
    "intermediate_size": 40,
    "shared_expert_intermediate_size": 12,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}


def token_ids(seed=0, batch=2, seq=12):
    return torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(seed))


def assert_same(actual, expected):
    """Equal up to float32 summation order: within 1e-4 of the logits' scale (a wrong head or channel moves
    them by more than 1e-2 of it, see the negative controls)."""
    assert actual.shape == expected.shape
    scale = expected.abs().max().item()
    assert (actual - expected).abs().max().item() <= 1e-4 * scale, (
        (actual - expected).abs().max().item(),
        scale,
    )


def random_dense_model(model_type, seed=0):
    """A tiny model whose attention and MLP parameters (norm weights included) are random: a fresh init has
    ones in the norms, which would hide a norm weight left in the wrong place. Built once per process for
    each ``(model_type, seed)``; every call returns a copy of its own."""
    return copy.deepcopy(_built_dense_model(model_type, seed))


#: how many models :func:`random_dense_model` has built (a test of the test suite's cost counts them)
BUILDS = {"dense": 0}


@functools.cache
def _built_dense_model(model_type, seed):
    BUILDS["dense"] += 1
    model = build_model(model_type, DENSE_SHAPE, seed=seed)
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".self_attn." in name or ".mlp." in name:
                noise = torch.randn(p.shape, generator=g)
                p.copy_(
                    1.0 + 0.5 * noise
                    if "norm" in name
                    else noise * (p.shape[-1] ** -0.5 if p.dim() > 1 else 1)
                )
    return model


def random_block_orders(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    return {b.prefix: random_orders(b, generator=g) for b in find_model_blocks(model)}


def moe_block_inputs(model, batches) -> dict[str, list[torch.Tensor]]:
    """Per experts block (prefix): its input hidden states, one [batch, seq, H] tensor per batch of ids."""
    inputs: dict[str, list[torch.Tensor]] = {}
    handles = [
        model.get_submodule(b.prefix).register_forward_pre_hook(
            lambda m, a, p=b.prefix: inputs.setdefault(p, []).append(a[0])
        )
        for b in find_model_blocks(model, ("experts",))
    ]
    try:
        with torch.no_grad():
            for ids in batches:
                model(input_ids=ids)
    finally:
        for h in handles:
            h.remove()
    return inputs


def kept_by_orders(block, orders, target):
    """Which channels / query heads a sorted cut keeps, from the definition of the orders."""
    if block.kind == "attention":
        r = block.shape.num_attention_heads // block.shape.num_key_value_heads
        r_new = target["num_attention_heads"] // target["num_key_value_heads"]
        groups = orders["kv_groups"][: target["num_key_value_heads"]]
        return {int(g) * r + int(orders["query_heads"][g][j]) for g in groups for j in range(r_new)}
    size = target["intermediate_size" if block.kind == "mlp" else "shared_expert_intermediate_size"]
    return {int(c) for c in orders["channels"][:size]}


def zeroed_model(model, kept: dict):
    """The full model with the output columns (down_proj / o_proj) of everything not kept set to zero."""
    ref = copy.deepcopy(model)
    state = ref.state_dict()
    for prefix, (kind, keep) in kept.items():
        if kind == "attention":
            weight = state[prefix + ".o_proj.weight"]
            hd = ref.config.get_text_config(decoder=True).head_dim
            for h in range(weight.shape[1] // hd):
                if h not in keep:
                    weight[:, h * hd : (h + 1) * hd] = 0
        else:
            weight = state[prefix + ".down_proj.weight"]
            for c in range(weight.shape[1]):
                if c not in keep:
                    weight[:, c] = 0
    return ref


def per_layer_fields(model) -> dict[str, dict[str, int]]:
    """Every sub-block of ``model`` cut to a size of its own, by its layer index (attention layers are 1 and 3)."""
    fields = {}
    for b in find_model_blocks(model):
        i = int(b.prefix.split("layers.")[1].split(".")[0])  # the layer index
        j = (i // 2) % 2
        fields[b.prefix] = {
            "attention": {"num_attention_heads": 2 * (j + 1), "num_key_value_heads": j + 1},
            "mlp": {"intermediate_size": 16 + 8 * i},
            "shared_expert": {"shared_expert_intermediate_size": 8 + 4 * i},
            "experts": {"num_experts": 2 + i % 3},
        }[b.kind]
    return fields


# ---- byte-exact source folders (numpy's PCG64 stream, hand-written safetensors headers) ---------------------

BYTES_SHAPE = GDNShape(num_key_heads=2, num_value_heads=6, key_head_dim=6, value_head_dim=4)
BYTES_TARGET = {"num_key_heads": 1, "num_value_heads": 2, "key_head_dim": 5, "value_head_dim": 3}
BYTES_HIDDEN, BYTES_KERNEL = 16, 4
BYTES_DTYPES = {"BF16": "<u2", "F16": "<f2", "F32": "<f4"}
# (layout, on-disk dtype, weight prefix of the text model, config builder)
BYTES_CASES = {
    "qwen3_5_vl": ("qwen3_5", "BF16", "model.language_model."),
    "qwen3_next": ("qwen3_next", "F16", "model."),
    "olmo_hybrid": ("olmo_hybrid", "F32", "model."),
}
BYTES_OLMO_SPLIT = {"conv1d.weight": ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight")}


def _config(name: str) -> dict:
    gdn = {
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 6,
        "linear_key_head_dim": 6,
        "linear_value_head_dim": 4,
        "linear_conv_kernel_dim": BYTES_KERNEL,
    }
    text = {
        "hidden_size": BYTES_HIDDEN,
        "num_hidden_layers": 3,
        "vocab_size": 32,
        "layer_types": ["linear_attention", "full_attention", "linear_attention"],
        **gdn,
    }
    if name == "qwen3_5_vl":
        return {
            "model_type": "qwen3_5",
            "architectures": ["Qwen3_5ForConditionalGeneration"],
            "text_config": {"model_type": "qwen3_5_text", **text},
            "vision_config": {"depth": 1},
        }
    return {"model_type": name, **text}


def _gdn_tensors(layout: str, prefix: str) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for rule in get_layout(layout).rules:
        if not rule.required:
            continue
        n = rule.length(BYTES_SHAPE)
        dims = {
            1: (n,),
            2: (n, BYTES_HIDDEN) if rule.axis == 0 else (BYTES_HIDDEN, n),
            3: (n, 1, BYTES_KERNEL),
        }[rule.ndim]
        if layout == "olmo_hybrid" and rule.name in BYTES_OLMO_SPLIT:  # transformers writes equal thirds
            for piece in BYTES_OLMO_SPLIT[rule.name]:
                shapes[f"{prefix}.{piece}"] = (n // 3, 1, BYTES_KERNEL)
        else:
            shapes[f"{prefix}.{rule.name}"] = dims
    return shapes


def _write_shard(path: Path, tensors: dict[str, np.ndarray], dtype: str) -> None:
    header, blobs, offset = {}, [], 0
    for name, array in tensors.items():
        data = array.tobytes()
        header[name] = {
            "dtype": dtype,
            "shape": list(array.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        blobs.append(data)
        offset += len(data)
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def build_source(folder: Path, name: str) -> Path:
    """A three-shard folder: two GDN layers (the second straddles shards 2 and 3), attention, mlp, mtp."""
    layout, dtype, base = BYTES_CASES[name]
    rng = np.random.Generator(np.random.PCG64(sum(map(ord, name))))
    shapes = {f"{base}embed_tokens.weight": (32, BYTES_HIDDEN)}
    shapes.update(_gdn_tensors(layout, f"{base}layers.0.linear_attn"))
    shapes[f"{base}layers.1.self_attn.q_proj.weight"] = (BYTES_HIDDEN, BYTES_HIDDEN)
    shapes.update(_gdn_tensors(layout, f"{base}layers.2.linear_attn"))
    shapes.update(
        {
            f"{base}norm.weight": (BYTES_HIDDEN,),
            "lm_head.weight": (32, BYTES_HIDDEN),
            "mtp.fc.weight": (BYTES_HIDDEN, 2 * BYTES_HIDDEN),
        }
    )
    names = list(shapes)
    cut1, cut2 = names.index(f"{base}layers.1.self_attn.q_proj.weight"), len(names) - 6
    shards = [names[:cut1], names[cut1:cut2], names[cut2:]]
    folder.mkdir(parents=True)
    weight_map = {}
    for i, members in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        arrays = {}
        for n in members:
            if dtype == "BF16":
                arrays[n] = (
                    rng.integers(0x3C00, 0x4100, size=shapes[n], dtype=np.uint16)
                    ^ rng.integers(0, 2, size=shapes[n], dtype=np.uint16) << 15
                )
            else:
                arrays[n] = rng.standard_normal(shapes[n]).astype(BYTES_DTYPES[dtype])
        _write_shard(folder / file, arrays, dtype)
        weight_map.update({n: file for n in members})
    total = sum((folder / f).stat().st_size for f in set(weight_map.values()))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    (folder / "config.json").write_text(json.dumps(_config(name), indent=2))
    (folder / "tokenizer_config.json").write_text('{"model_max_length": 64}\n')
    return folder


def scores_for(folder: Path, name: str) -> dict:
    _, _, base = BYTES_CASES[name]
    rng = np.random.Generator(np.random.PCG64(7))
    layers = {}
    for i in (0, 2):
        layers[f"{base}layers.{i}.linear_attn"] = {
            "key_group_order_most_important_first": rng.permutation(2).tolist(),
            "value_lane_order_most_important_first": [rng.permutation(3).tolist() for _ in range(2)],
            "key_dim_order_most_important_first": [rng.permutation(6).tolist() for _ in range(2)],
            "value_dim_order_most_important_first": rng.permutation(4).tolist(),
        }
    return {"format": "gdnprune-scores", "version": 1, "method": "fixed", "layers": layers}


# ---- FP8 block quantisation as Qwen's FP8 releases store it ------------------------------------------------

FP8_BLOCK = 4
#: the modules Qwen's FP8 releases leave unquantised (``modules_to_not_convert``)
NOT_CONVERTED = ["lm_head", "self_attn", "mlp", "in_proj_a", "in_proj_b", "embed_tokens"]


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block FP8: scale = amax / 448 of each FP8_BLOCK x FP8_BLOCK block, weight / scale in float8_e4m3fn."""
    rows, cols = weight.shape
    blocks = weight.reshape(rows // FP8_BLOCK, FP8_BLOCK, cols // FP8_BLOCK, FP8_BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0
    q = (blocks / scale[:, None, :, None]).reshape(rows, cols).to(torch.float8_e4m3fn)
    return q, scale.float()


def dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    full = scale.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)  # a last tile may be partial
    return weight.float() * full[: weight.shape[0], : weight.shape[1]]


#: the GDN geometry of :func:`make_fp8`'s models
FP8_SHAPE = GDNShape(num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=8)
#: the GDN projections :func:`make_fp8` quantises, per model type
FP8_TENSORS = {
    "qwen3_5": ("in_proj_qkv", "in_proj_z", "out_proj"),
    "qwen3_next": ("in_proj_qkvz", "out_proj"),
}


def make_fp8(folder, model_type: str, seed: int = 0):
    """A real tiny model saved with its large GDN projections in FP8 blocks, as Qwen's FP8 releases store them."""
    model = build_model(model_type, FP8_SHAPE, seed=seed)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    for prefix, _ in find_gdn_modules(model):
        for name in FP8_TENSORS[model_type]:
            q, s = quantize(state[f"{prefix}.{name}.weight"])
            state[f"{prefix}.{name}.weight"], state[f"{prefix}.{name}.weight_scale_inv"] = q, s
    model.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
        "modules_to_not_convert": NOT_CONVERTED,
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


# ---- layers skipped in the forward (the reference of layer removal) ------------------------------------------


class _Skip(torch.nn.Module):
    """A decoder layer that does nothing: the residual stream passes through."""

    def __init__(self, layer):
        super().__init__()
        self.layer_type = getattr(layer, "layer_type", None)
        self.attention_type = getattr(layer, "attention_type", None)

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


def skipped_model(model, removed):
    """A copy of ``model`` whose decoder layers ``removed`` pass the residual stream through."""
    ref = copy.deepcopy(model)
    inner = ref.model
    layers = inner.language_model.layers if hasattr(inner, "language_model") else inner.layers
    for i in removed:
        layers[i] = _Skip(layers[i])
    return ref


# ---- least-squares compensation on the bundled trained model -------------------------------------------------


@functools.cache
def trained_demo_case():
    """The bundled model, 8 calibration windows, its orders and statistics, and its held-out loss function;
    computed once per process and shared: read them, never change them."""
    model, _ = demo_data.load_demo_model()
    calib = demo_data.byte_windows(demo_data.train_text(), 256, 8)
    heldout = demo_data.byte_windows(demo_data.validation_text(), 256, 8)
    permutations = scores_to_permutations(score_model(model, [calib], progress=False))
    stats = compensate.collect_statistics(model, [calib])

    def loss(m):
        with torch.no_grad():
            logits = m(input_ids=heldout).logits[:, :-1]
        return float(
            torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), heldout[:, 1:].reshape(-1)
            )
        )

    return model, calib, permutations, stats, loss


def refit_by_hand(model, plain, target, permutations, stats, ridge=compensate.DEFAULT_RIDGE):
    """The compensated model by hand: out_proj columns from compensated_columns (torch API for the rest)."""
    refit = copy.deepcopy(plain)
    small_modules = dict(find_gdn_modules(refit))
    for prefix, module in find_gdn_modules(model):
        shape = GDNShape.from_module(module)
        kept = permutations[prefix].indices(shape, target=target)["vidx"].numpy()
        out = getattr(module, "out_proj", None) or module.o_proj
        columns = compensate.compensated_columns(
            out.weight.detach().double().numpy(), stats[prefix]["out_moment"], kept, ridge=ridge
        )
        small_out = getattr(small_modules[prefix], "out_proj", None) or small_modules[prefix].o_proj
        with torch.no_grad():
            small_out.weight.copy_(torch.from_numpy(columns))
    return refit


# ---- lm-eval tasks of the demo model (test_eval; the shared launch's eval) ----------------------------------------

#: a multiple-choice task the model can do better than chance on: which continuation is Python's
CHOICES = [
    ("def f(x):\n    return", [" x", " }"]),
    ("import os\nimport", [" sys", " ((("]),
    ("for i in range(10):\n   ", [" print(i)", " ]]]"]),
    ("class A:\n    def", [" __init__", " 123"]),
    ("The return value is", [" None", " zq"]),
    ("if x is", [" None", " ???"]),
    ("while True:\n    ", ["break", "}{"]),
    ("try:\n    pass\nexcept", [" ValueError", " 9"]),
]


def mc_folder(root: Path, name: str = "python_mc", wrong: tuple[int, ...] = ()) -> Path:
    """A folder with the multiple-choice task ``name`` over :data:`CHOICES`, the nonsense choice labelled
    right in the rows ``wrong``."""
    folder = root / f"{name}_tasks"
    folder.mkdir()
    rows = [{"query": q, "choices": c, "label": int(i in wrong)} for i, (q, c) in enumerate(CHOICES)]
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {str(data)!r}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{query}}"\n'
        "doc_to_choice: choices\n"
        "doc_to_target: label\n"
        'target_delimiter: ""\n'
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
        "metadata:\n  version: 1.0\n",
        encoding="utf-8",
    )
    return folder


#: hook of a multiple-choice task that appends (rank, query) of each document it scores to $EVAL_RECORD
RECORD_HOOK = """import json, os


def process_results(doc, results):
    with open(os.environ["EVAL_RECORD"], "a") as f:
        f.write(json.dumps({"rank": int(os.environ.get("RANK", "0")), "query": doc["query"]}) + "\\n")
    best = max(range(len(results)), key=lambda i: results[i][0])
    return {"acc": float(best == doc["label"])}
"""
RECORD_YAML = """process_results: !function record.process_results
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def mixed_mc_folder(root: Path) -> Path:
    """The task ``mixed_mc``: :data:`CHOICES` with the nonsense choice right in the odd rows (so its accuracy and
    standard error depend on every document counted once), whose hook records which rank scored each document
    in ``$EVAL_RECORD`` (:data:`RECORD_HOOK`)."""
    folder = mc_folder(root, "mixed_mc", wrong=(1, 3, 5, 7))
    (folder / "record.py").write_text(RECORD_HOOK, encoding="utf-8")
    yaml = (folder / "mixed_mc.yaml").read_text()
    yaml = yaml.replace("metric_list:\n  - metric: acc\n  - metric: acc_norm\n", "")
    (folder / "mixed_mc.yaml").write_text(yaml + RECORD_YAML, encoding="utf-8")
    return folder


# ---- corpus files (test_corpus; the shared launch's corpus) -------------------------------------------------------


def corpus_docs(tag: str, n: int) -> list[str]:
    """``n`` documents tagged ``tag``, of different lengths, with non-ASCII text and a second line."""
    return [f"{tag} document {i}: " + "words é ü " * (i % 5 + 1) + "\nsecond line" for i in range(n)]


def write_jsonl(path: Path, docs: list[str], opener=open) -> None:
    """``docs`` as JSON lines ``{"text", "id"}`` (``opener``: ``gzip.open`` for a compressed file)."""
    with opener(path, "wt", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"text": d, "id": i}) + "\n")


# ---- teachers and students for distillation ----------------------------------------------------------------

#: the GDN geometry of the distillation teachers (:func:`pair`) and of their nested half
DISTILL_SHAPE, HALF = GDNShape(2, 4, 16, 16), GDNShape(1, 2, 16, 8)


def sliced(model, target=HALF):
    """The nested prefix ``target`` of every GDN layer of ``model``, as a new model."""
    state = dict(model.state_dict())
    for prefix, module in find_gdn_modules(model):
        slice_gated_delta_net_state_dict(
            state, prefix=prefix, shape=GDNShape.from_module(module), target=target
        )
    small = type(model)(target.apply_to_config(model.config)).eval()
    small.load_state_dict(state, strict=True)
    return small


def windows(n, seq_len=24, vocab=128, seed=0):
    """``n`` windows of random token ids."""
    return torch.randint(0, vocab, (n, seq_len), generator=torch.Generator().manual_seed(seed))


def pair(model_type="qwen3_5", seed=0):
    """A random teacher and its student: the nested half (:data:`HALF`) of every GDN layer."""
    teacher = build_model(model_type, DISTILL_SHAPE, seed=seed)
    return teacher, sliced(teacher)


def make_pair(heterogeneous, tied=False):
    """A teacher and its student: the nested half of every GDN layer, or different cuts per layer; with
    ``tied``, embeddings tied to ``lm_head`` (one tensor, sharded by vocabulary and read by both the lookup
    and the loss)."""
    if tied:
        config = make_config("qwen3_5", DISTILL_SHAPE)
        config.tie_word_embeddings = True
        teacher = build_model("qwen3_5", DISTILL_SHAPE, config=config)
        student = sliced(teacher)
        assert student.lm_head.weight is student.model.embed_tokens.weight
        return teacher, student
    teacher, student = pair()
    if heterogeneous:
        student = slice_model(
            teacher,
            {
                "model.layers.0.linear_attn": {"num_key_heads": 1, "num_value_heads": 2},
                "model.layers.2.linear_attn": {"value_head_dim": 8},
            },
        )
    return teacher, student


# ---- child processes: torchrun, accelerate launch, lm_eval, gdnprune as a user runs them ------------------

#: what a launcher sets for its ranks: a child must not see them (it would think itself one of the ranks)
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")


#: the suite's garbage collector thresholds (tests/suite.py sets them in the workers): the youngest generation
#: collected every 50,000 new objects, not 700. The tests' tiny models make and drop Python objects faster than
#: tensors fill memory, and importing torch and transformers makes a million objects that live to the end
GC_THRESHOLD = (50_000, 20, 100)
#: the first line of a child Python script that imports torch: :data:`GC_THRESHOLD` (0.4 s of CPU less for the
#: child's imports), and at exit its objects out of the garbage collector's reach, as gdnprune's commands do
#: (gdnprune.cli): the interpreter's last collection then skips them, about 1 s of CPU less per child
CHILD_GC = f"import atexit, gc; gc.set_threshold{GC_THRESHOLD}; atexit.register(gc.freeze)\n"


def python_command(module: str, *args: str | os.PathLike) -> list[str]:
    """``python -m module args...`` with the interpreter running the tests (``torch.distributed.run`` is
    ``torchrun``, ``accelerate.commands.launch`` is ``accelerate launch``)."""
    return [sys.executable, "-m", module, *(str(a) for a in args)]


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child Python process: this one's, but for a launcher's rank variables, with this
    session's ``sys.path`` as ``PYTHONPATH`` (the tree under test and the test helpers), one torch thread
    (tiny models: more threads only spin on a shared machine) and the Hugging Face hub offline; ``extra``
    added last."""
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES}
    env.update(PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env.update(extra)
    return env
