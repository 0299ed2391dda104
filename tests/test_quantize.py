"""gdnprune quantize: every scheme on every kind of output loads in transformers with no warning, and its
logits match a quantize-dequantize reference computed here with plain torch formulas (e4m3 per tile or per
channel with dynamic per-token activations, int4 per group), not with the code under test.

The tiny models are bf16 checkpoints with widths in multiples of 32; tiles and groups are 32 wide (128 in
real models, where widths are multiples of 128).
"""

from __future__ import annotations

import contextlib
import json
import logging
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from tiny_models import MOE, TEXT, build_model

from gdnprune import demo_data, load_pretrained
from gdnprune.cli import main
from gdnprune.gated_delta_net import GDNShape
from gdnprune.io.loading import slice_model
from gdnprune.model.layouts import find_gdn_modules
from gdnprune.model.subblock_geometry import block_candidates
from gdnprune.model.subblock_surgery import find_model_blocks
from gdnprune.plan import layer_candidates
from gdnprune.quantize import QuantizedWidthWarning, QuantizeError, gptq, quantize_checkpoint

SHAPE = GDNShape(num_key_heads=2, num_value_heads=4, key_head_dim=16, value_head_dim=16)
SIZE = 32
PROJECTIONS = {
    "q_proj", "k_proj", "v_proj", "o_proj", "g_proj", "in_proj_qkv", "in_proj_z", "in_proj_qkvz",
    "out_proj", "gate_proj", "up_proj", "down_proj",
}  # fmt: skip
F8 = torch.float8_e4m3fn


def _size(scheme):
    return None if scheme == "fp8-dynamic" else SIZE


def qdq_weight(w: torch.Tensor, scheme: str) -> torch.Tensor:
    """The weight as the format stores it: scales rounded to bf16 (the checkpoint's dtype)."""
    rows, cols = w.shape
    if scheme == "fp8-block":
        t = w.reshape(rows // SIZE, SIZE, cols // SIZE, SIZE)
        s = (t.abs().amax(dim=(1, 3)) / 448).to(torch.bfloat16).float()[:, None, :, None]
        return ((t / s).clamp(-448, 448).to(F8).float() * s).reshape(rows, cols)
    if scheme == "fp8-dynamic":
        s = (w.abs().amax(1, keepdim=True) / 448).to(torch.bfloat16).float()
        return (w / s).clamp(-448, 448).to(F8).float() * s
    t = w.reshape(rows, cols // SIZE, SIZE)
    s = (t.abs().amax(-1, keepdim=True) / 7.5).to(torch.bfloat16).float()
    return (torch.round((t / s).clamp(-8, 7)) * s).reshape(rows, cols)


def qdq_input(x: torch.Tensor, scheme: str) -> torch.Tensor:
    """FP8 activations quantized at run time: per token (fp8-dynamic), per token and group (fp8-block).
    compressed-tensors' reference forward keeps the first two dims as tokens, so a 2-D input (the MoE block's
    shared expert reads ``[tokens, hidden]``) is quantized per tensor there."""
    shape = x.shape
    t = x.reshape(*shape[:-1], -1, SIZE) if scheme == "fp8-block" else x
    s = (
        t.abs().amax() / 448
        if scheme == "fp8-dynamic" and x.ndim == 2
        else t.abs().amax(-1, keepdim=True) / 448
    )
    return ((t / s).clamp(-448, 448).to(F8).to(x.dtype) * s).reshape(shape)


def reference(model, scheme: str, kept=()):
    """``model`` (fp32) with every projection but ``kept`` replaced by its quantize-dequantize, and for the
    FP8 schemes, each such projection's input quantized too (routed experts: their weights)."""
    model = model.float().eval()
    for name, module in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        if (
            isinstance(module, torch.nn.Linear)
            and last in PROJECTIONS
            and not any(name.endswith(k) for k in kept)
        ):
            module.weight.data = qdq_weight(module.weight.data, scheme)
            if scheme != "w4a16":
                module.register_forward_pre_hook(lambda m, a: (qdq_input(a[0], scheme),))
        elif hasattr(module, "gate_up_proj"):
            # fused experts, as transformers loads them: on unquantized inputs; unquantized ones (fp8-block)
            # in the checkpoint's dtype, packed int4 dequantized in the scales' dtype (both bf16), fp8 ones
            # dequantized in the model's dtype
            for p in (module.gate_up_proj, module.down_proj):
                if scheme != "fp8-block":
                    p.data = torch.stack([qdq_weight(e, scheme) for e in p.data])
                if scheme != "fp8-dynamic":
                    p.data = p.data.to(torch.bfloat16)
    return model


def save_bf16(model, folder):
    model.to(torch.bfloat16).save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """bf16 checkpoints of each kind of output: uniform dense, vision-language, heterogeneous
    (``per_layer_config``, one MLP cut to a width no tile divides), MoE (one tensor per expert on disk)."""
    root = tmp_path_factory.mktemp("quantize")
    out = {}
    out["uniform"] = save_bf16(build_model("qwen3_5", SHAPE, seed=1), root / "uniform")
    out["vl"] = save_bf16(build_model("qwen3_5_vl", SHAPE, seed=2), root / "vl")
    base = build_model("qwen3_5", SHAPE, seed=3)
    cut = slice_model(
        base,
        {"model.layers.0.linear_attn": {"num_value_heads": 2}, "model.layers.2.linear_attn": SHAPE},
        blocks={"model.layers.1.mlp": {"intermediate_size": 80}},
    )
    out["heterogeneous"] = save_bf16(cut, root / "heterogeneous")
    out["moe"] = save_bf16(build_model("qwen3_5_moe", SHAPE, seed=4), root / "moe")
    return root, out


def _load_quiet(folder, **kwargs):
    """Load with transformers, returning the model and every warning and logged warning of the load."""
    records: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                records.append(record.getMessage())

    handler = Catch()
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model, info = load_pretrained(folder, dtype=torch.float32, output_loading_info=True, **kwargs)
    finally:
        logger.removeHandler(handler)
    problems = {k: v for k, v in info.items() if v and k != "error_msgs"} | (
        {"errors": info["error_msgs"]} if info.get("error_msgs") else {}
    )
    return model.eval(), records + [str(w.message) for w in caught], problems


IDS = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("scheme", ["fp8-block", "fp8-dynamic", "w4a16"])
@pytest.mark.parametrize("kind", ["uniform", "vl", "heterogeneous", "moe"])
def test_each_output_loads_with_no_warning_and_computes_the_reference(sources, tmp_path, kind, scheme):
    root, models = sources
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        manifest = quantize_checkpoint(
            root / kind, tmp_path / "q", scheme=scheme, size=_size(scheme), calibration="rtn", progress=False
        )
    ours = [str(w.message) for w in caught if issubclass(w.category, QuantizedWidthWarning)]
    unfit = manifest["high_precision"]
    if kind == "heterogeneous" and scheme != "fp8-dynamic":  # 80 channels: no 32-wide tile or group fits
        assert {m for m, why in unfit.items() if why != "routed expert"} >= {"model.layers.1.mlp.down_proj"}
        assert "model.layers.1.mlp.down_proj" in ours[0]
    if kind == "moe" and scheme == "fp8-block":
        assert any("routed expert" in w for w in ours)
    model, logged, problems = _load_quiet(tmp_path / "q")
    assert problems == {}
    assert logged == []
    source = transformers.AutoConfig.from_pretrained(root / kind)
    expected_class = getattr(transformers, source.architectures[0])
    assert isinstance(model, expected_class)
    source_model = load_pretrained(root / kind, dtype=torch.float32)
    kept = [m for m, why in unfit.items() if why != "routed expert"]
    ref = reference(source_model, scheme, kept=kept)
    with torch.no_grad():
        got, want = model(input_ids=IDS).logits, ref(input_ids=IDS).logits
        plain = source_model.float()
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    config = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors"
    assert "lm_head" in config["ignore"] and r"re:.*mlp\.gate$" in config["ignore"]
    del plain


def test_a_vision_language_output_loads_as_a_causal_lm_too(sources, tmp_path):
    """Loaded as ``Qwen3_5ForCausalLM`` (the decoder renamed ``model.``), every ignored module still matches."""
    root, _ = sources
    quantize_checkpoint(
        root / "vl", tmp_path / "q", scheme="w4a16", size=SIZE, calibration="rtn", progress=False
    )
    causal = transformers.Qwen3_5ForCausalLM.from_pretrained(tmp_path / "q", dtype=torch.float32).eval()
    full = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(tmp_path / "q", dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(causal(input_ids=IDS).logits, full.eval()(input_ids=IDS).logits)


def test_gptq_with_an_identity_hessian_rounds_to_nearest_and_beats_it_on_correlated_inputs():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 64, generator=g)
    q, s = gptq(w, torch.eye(64), group_size=32, scale_dtype=torch.float32, damp=0.0)
    torch.testing.assert_close(q, qdq_rtn := _rtn(w, 32), rtol=0, atol=0)
    x = torch.randn(512, 8, generator=g) @ torch.randn(8, 64, generator=g) + 0.05 * torch.randn(
        512, 64, generator=g
    )
    q, s = gptq(w, x.T @ x, group_size=32, scale_dtype=torch.float32)
    ints = q.reshape(16, 2, 32) / s[:, :, None]
    torch.testing.assert_close(ints, ints.round(), atol=1e-4, rtol=0)
    assert ints.abs().max() <= 8
    gptq_error = (x @ (q - w).T).pow(2).sum()
    rtn_error = (x @ (qdq_rtn - w).T).pow(2).sum()
    assert gptq_error < 0.7 * rtn_error


def _rtn(w, group):
    t = w.reshape(w.shape[0], -1, group)
    s = t.abs().amax(-1, keepdim=True) / 7.5
    return (torch.round((t / s).clamp(-8, 7)) * s).reshape(w.shape)


def test_gptq_output_loads_and_holds_its_own_integers(sources, tmp_path):
    """w4a16 with GPTQ on calibration windows: transformers loads the weights GPTQ chose (integers on the
    grid of the stored scales), and on the calibration text they reproduce the layers' outputs better than
    rounding to nearest."""
    root, models = sources
    batches = [torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    quantize_checkpoint(
        root / "moe", tmp_path / "g", scheme="w4a16", size=SIZE, batches=batches, progress=False
    )
    quantize_checkpoint(
        root / "moe", tmp_path / "r", scheme="w4a16", size=SIZE, calibration="rtn", progress=False
    )
    source = load_pretrained(root / "moe", dtype=torch.float32).eval()
    losses = {}
    for name in ("g", "r"):
        model, logged, problems = _load_quiet(tmp_path / name)
        assert problems == {} and logged == []
        with torch.no_grad():
            diff = model(input_ids=torch.cat(batches)).logits - source(input_ids=torch.cat(batches)).logits
        losses[name] = diff.pow(2).mean().item()
    assert losses["g"] < losses["r"]
    manifest = json.loads((tmp_path / "g" / "gdnprune.json").read_text())
    assert manifest["calibration"] == "gptq" and any(
        ".experts.3.down_proj" in m for m in manifest["quantized"]
    )


def test_refusals_name_what_was_expected(sources, tmp_path):
    root, _ = sources
    with pytest.raises(QuantizeError, match="no projection .* fits fp8-block at size 128"):
        quantize_checkpoint(root / "uniform", tmp_path / "a", scheme="fp8-block", progress=False)
    with pytest.raises(QuantizeError, match="needs calibration text"):
        quantize_checkpoint(root / "uniform", tmp_path / "b", scheme="w4a16", size=SIZE, progress=False)
    quantize_checkpoint(root / "uniform", tmp_path / "c", scheme="fp8-dynamic", progress=False)
    with pytest.raises(QuantizeError, match="already quantized"):
        quantize_checkpoint(tmp_path / "c", tmp_path / "d", scheme="fp8-dynamic", progress=False)
    assert not (tmp_path / "a").exists() and not (tmp_path / "d").exists()
    # routed experts 48 wide: transformers cannot load w4a16 experts that are partly left in bf16
    config = transformers.Qwen3_5MoeTextConfig(
        **{**TEXT, "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"]},
        **SHAPE.config_updates(),
        **{**MOE, "moe_intermediate_size": 48},
    )
    save_bf16(transformers.Qwen3_5MoeForCausalLM(config), tmp_path / "moe48")
    with pytest.raises(
        QuantizeError, match="routed experts of model.layers.0.mlp and others do not fit groups of 32"
    ):
        quantize_checkpoint(tmp_path / "moe48", tmp_path / "e", scheme="w4a16", size=SIZE, calibration="rtn")


def test_cli_quantize(sources, tmp_path, capsys):
    root, _ = sources
    args = ["quantize", str(root / "uniform"), "-o", str(tmp_path / "q"), "--scheme", "w4a16"]
    assert main([*args, "--group-size", "32", "--calibration", "rtn", "-q"]) == 0
    assert "w4a16" in capsys.readouterr().out
    assert main(["quantize", str(root / "uniform"), "-o", str(tmp_path / "x"), "--scheme", "fp8-block"]) == 2
    assert "no projection" in capsys.readouterr().err
    assert main([*args[:4], "--scheme", "fp8-dynamic", "--group-size", "32"]) == 2


def test_eval_and_bench_take_quantized_folders(tmp_path, capsys):
    """`gdnprune eval` names a quantized folder after its source and scheme, counts its weights (not its
    scales) as parameters, and measures it close to its source; `bench` times it."""
    trained = demo_data.demo_model_path()
    text = tmp_path / "val.txt"
    text.write_text(demo_data.validation_text()[: 256 * 2], encoding="utf-8")
    quantized = tmp_path / "demo-fp8"
    assert main(["quantize", str(trained), "-o", str(quantized), "--scheme", "fp8-dynamic", "-q"]) == 0
    capsys.readouterr()
    out = tmp_path / "eval"
    args = [
        "eval",
        str(trained),
        str(quantized),
        "--tasks",
        "nats_per_byte",
        "--data",
        str(text),
        "-o",
        str(out),
    ]
    assert main([*args, "--device", "cpu", "--quiet"]) == 0
    models = json.loads((out / "results.json").read_text())["models"]
    assert [m["name"] for m in models] == ["demo_model", "demo_model + fp8-dynamic"]
    assert models[0]["parameters"] == models[1]["parameters"] == 898_512
    nats = [m["results"]["nats_per_byte"]["nats_per_byte,none"] for m in models]
    assert abs(nats[1] - nats[0]) < 0.02 and nats[1] != nats[0]
    argv = ["bench", str(quantized), "--workload", "decode:1:8", "--repeats", "1", "--warmup-calls", "0"]
    assert main([*argv, "--device", "cpu", "--quiet", "-o", str(tmp_path / "bench")]) == 0
    rows = json.loads((tmp_path / "bench" / "results.json").read_text())["results"]
    assert rows[0]["parameters"] == 898_512 and rows[0]["tokens_per_second"] > 0


def test_prune_quantize_writes_the_quantized_model_beside_its_output(tmp_path, capsys):
    trained = Path(__file__).parent / "data" / "trained" / "qwen3_5_moe"
    text = tmp_path / "calib.txt"
    text.write_text(demo_data.train_text()[: 256 * 8], encoding="utf-8")
    out = tmp_path / "pruned"
    argv = ["prune", str(trained), "--data", str(text), "--num-value-heads", "4", "--num-samples", "4"]
    argv += ["--value-head-dim", "12", "--snap-quant", "32"]  # 4 x 12 = 48 channels: snapped to 4 x 16
    assert main([*argv, "--seq-len", "64", "-o", str(out), "--quantize", "fp8-dynamic", "-q"]) == 0
    assert "-> " + str(out) + "-fp8-dynamic" in capsys.readouterr().out
    manifest = json.loads((tmp_path / "pruned-fp8-dynamic" / "gdnprune.json").read_text())
    assert manifest["source"]["operation"] == "prune" and manifest["scheme"] == "fp8-dynamic"
    model, logged, problems = _load_quiet(tmp_path / "pruned-fp8-dynamic")
    assert problems == {} and logged == [] and model.model.layers[0].linear_attn.num_v_heads == 4
    assert _shapes(out)["model.layers.0.linear_attn.in_proj_z.weight"] == (4 * 16, 64)


def _shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}


def test_slice_snap_quant_leaves_every_cut_width_a_multiple(sources, tmp_path, capsys):
    """`slice --snap-quant 32`: every width of a projection that the cut changed is a multiple of 32 (read
    from the tensors' shapes), where the same cut without it leaves widths of 24, 12 and 40."""
    root, _ = sources
    src = root / "uniform"
    cut = ["--num-value-heads", "2", "--value-head-dim", "12", "--key-head-dim", "12"]
    cut += ["--intermediate-size", "40", "--num-attention-heads", "2", "-q"]
    assert main(["slice", str(src), "-o", str(tmp_path / "plain"), *cut]) == 0
    assert main(["slice", str(src), "-o", str(tmp_path / "snapped"), *cut, "--snap-quant", "32"]) == 0
    full = _shapes(src)

    def changed(folder):
        return {
            (name, axis, width)
            for name, shape in _shapes(folder).items()
            if name.endswith("_proj.weight") or name.endswith("_proj_qkv.weight") or "in_proj_z" in name
            for axis, width in enumerate(shape)
            if width != full[name][axis]
        }

    plain, snapped = changed(tmp_path / "plain"), changed(tmp_path / "snapped")
    assert {w % 32 for _, _, w in plain} != {0}  # the plain cut leaves widths no tile of 32 divides
    assert snapped and all(w % 32 == 0 for _, _, w in snapped), snapped
    manifest = json.loads((tmp_path / "snapped" / "gdnprune.json").read_text())
    assert manifest["snap_quant"] == 32
    # and nothing is kept in high precision by a scheme of that size for a width the cut changed
    for folder, widths in ((tmp_path / "plain", plain), (tmp_path / "snapped", snapped)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            q = quantize_checkpoint(folder, tmp_path / f"q-{folder.name}", scheme="fp8-block", size=SIZE)
        kept = {m + ".weight" for m in q["high_precision"]} & {n for n, _, _ in widths}
        assert bool(kept) == bool(caught) == (folder.name == "plain"), kept
    capsys.readouterr()
    for bad, message in (("24", "a multiple of 16"), ("0", "positive")):
        argv = ["slice", str(src), "-o", str(tmp_path / "x"), *cut, "--snap-quant", bad]
        with pytest.raises(SystemExit) if bad == "0" else contextlib.nullcontext():
            assert main(argv) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_the_plan_grid_with_snap_quant_is_the_grid_less_the_cuts_no_tile_divides():
    """`snap_quant` in the search keeps exactly the candidates whose changed widths (heads x dims, MLP channels)
    are multiples, counted here by hand from each candidate's fields."""
    model = build_model("qwen3_5", SHAPE, seed=5)
    prefix, module = find_gdn_modules(model)[0]
    tensors = {n: tuple(p.shape) for n, p in module.named_parameters()}

    def gdn(**kw):
        return [
            c.target for c in layer_candidates(prefix, SHAPE, tensors, "qwen3_5", 4, dim_step="1/4", **kw)
        ]

    def fits(t):
        widths = [(t.num_key_heads * t.key_head_dim, 2 * 16), (t.num_value_heads * t.value_head_dim, 4 * 16)]
        return all(w == full or w % 32 == 0 for w, full in widths)

    assert gdn(snap_quant=32) == [t for t in gdn() if fits(t)] and SHAPE in gdn(snap_quant=32)
    assert len(gdn(snap_quant=32)) < len(gdn())
    blocks = {b.kind: b for b in find_model_blocks(model)}
    sizes = [c.target.intermediate_size for c in block_candidates(blocks["mlp"], step=8, snap_quant=32)]
    assert sizes == [s for s in range(96, 0, -8) if s % 32 == 0]
    attention = block_candidates(blocks["attention"], snap_quant=64)
    hd = blocks["attention"].shape.head_dim
    assert all(
        c.target.num_key_value_heads * hd % 64 == 0 or c.target == blocks["attention"].shape
        for c in attention
    )
