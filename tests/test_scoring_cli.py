"""`gdnprune score` end to end (in process): text and JSONL data, methods, device maps, VL checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from tiny_models import TEXT, VISION, gdn_kwargs, randomize_gdn

from gdnprune.cli import main
from gdnprune.demo_data import build_byte_tokenizer, train_text
from gdnprune.gated_delta_net import GDNShape
from gdnprune.io.scores_file import gdn_entries
from gdnprune.model.layouts import find_gdn_modules
from gdnprune.quality.calibration import pack_windows, read_texts
from gdnprune.scoring import GDN_ONLY, load_scores, score_model

SHAPE = GDNShape(num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=6)
SEQ, SAMPLES = 72, 4


def _save(model, path):
    model.save_pretrained(path)
    build_byte_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.Qwen3_5TextConfig(**{**TEXT, "vocab_size": 257}, **gdn_kwargs(SHAPE))
    model = transformers.Qwen3_5ForCausalLM(config).eval()
    randomize_gdn(model)
    return _save(model, tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "calib.txt"
    path.write_text(train_text()[:3000], encoding="utf-8")
    return path


def _run(model_dir, data, out, *extra):
    return main(
        [
            "score",
            str(model_dir),
            "--data",
            str(data),
            "--output",
            str(out),
            "--num-samples",
            str(SAMPLES),
            "--seq-len",
            str(SEQ),
            "--batch-size",
            "2",
            "--quiet",
            *extra,
        ]
    )


def test_text_and_jsonl_give_the_same_scores(model_dir, text_file, tmp_path, capsys):
    assert _run(model_dir, text_file, tmp_path / "a.json") == 0
    assert "2 GDN layers and 6 sub-blocks" in capsys.readouterr().out  # every kind by default
    jsonl = tmp_path / "calib.jsonl"
    jsonl.write_text(
        json.dumps({"text": text_file.read_text(encoding="utf-8"), "id": 1}) + "\n\n", encoding="utf-8"
    )
    assert _run(model_dir, jsonl, tmp_path / "b.json") == 0
    a, b = load_scores(tmp_path / "a.json"), load_scores(tmp_path / "b.json")
    assert a["method"] == "projection" and a["num_tokens"] == SAMPLES * SEQ
    assert a["calibration"]["num_samples"] == SAMPLES and a["calibration"]["seq_len"] == SEQ
    assert list(gdn_entries(a["layers"])) == ["model.layers.0.linear_attn", "model.layers.2.linear_attn"]
    subs = {p: v["kind"] for p, v in a["layers"].items() if p not in gdn_entries(a["layers"])}
    assert subs == {
        **{f"model.layers.{i}.mlp": "mlp" for i in range(4)},
        **{f"model.layers.{i}.self_attn": "attention" for i in (1, 3)},
    }
    assert a["layers"] == b["layers"]


def test_jsonl_documents_are_joined_with_eos(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "ab"}\n{"text": ""}\n{"text": "cde"}\n', encoding="utf-8")
    assert read_texts(path) == ["ab", "cde"]
    windows = pack_windows(read_texts(path), build_byte_tokenizer(), seq_len=3)
    assert windows.tolist() == [[97, 98, 256], [99, 100, 101]]


def test_data_errors_exit_2(model_dir, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"txt": "oops"}\n', encoding="utf-8")
    assert _run(model_dir, bad, tmp_path / "s.json") == 2
    assert "bad.jsonl:2" in capsys.readouterr().err
    short = tmp_path / "short.txt"
    short.write_text("too short", encoding="utf-8")
    assert _run(model_dir, short, tmp_path / "s.json") == 2
    assert "fewer than one window" in capsys.readouterr().err
    assert _run(tmp_path / "missing", short, tmp_path / "s.json") == 2
    assert not (tmp_path / "s.json").exists()


def test_random_method_is_deterministic_with_seed(model_dir, text_file, tmp_path):
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        assert (
            _run(model_dir, text_file, tmp_path / f"{name}.json", "--method", "random", "--seed", str(seed))
            == 0
        )
    a, b, c = (load_scores(tmp_path / f"{n}.json") for n in "abc")
    assert a["layers"] == b["layers"] != c["layers"]
    assert a["method"] == "random" and a["seed"] == 1


def test_activation_method_and_device_map_auto(model_dir, text_file, tmp_path):
    assert (
        _run(model_dir, text_file, tmp_path / "act.json", "--method", "activation", "--device-map", "auto")
        == 0
    )
    scores = load_scores(tmp_path / "act.json")
    assert scores["method"] == "activation"
    assert all(
        len(p["value_dim_order_most_important_first"]) == SHAPE.value_head_dim
        for p in gdn_entries(scores["layers"]).values()
    )


@pytest.mark.parametrize("head_device", ["cpu", "disk"])
def test_layers_split_over_devices_with_offload(head_device, model_dir, text_file, tmp_path):
    """accelerate dispatch (real hooks; layer 2 offloaded to disk, so its weights sit on the meta device;
    with ``head_device="disk"`` also the final norm and lm_head that the loss-aware lane Gram runs)."""
    device_map = {
        "model.embed_tokens": "cpu",
        "model.layers.0": "cpu",
        "model.layers.1": "cpu",
        "model.layers.2": "disk",
        "model.layers.3": "cpu",
        "model.norm": head_device,
        "model.rotary_emb": "cpu",
        "lm_head": head_device,
    }
    dispatched = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, device_map=device_map, offload_folder=str(tmp_path / "offload")
    )
    gdn = dict(find_gdn_modules(dispatched))
    assert gdn["model.layers.2.linear_attn"].out_proj.weight.device.type == "meta"
    assert hasattr(gdn["model.layers.0.linear_attn"], "_hf_hook")
    assert (dispatched.lm_head.weight.device.type == "meta") == (head_device == "disk")
    plain = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    windows = pack_windows(read_texts(text_file), build_byte_tokenizer(), seq_len=SEQ, num_samples=SAMPLES)
    batches = [windows[:2], windows[2:]]
    a = score_model(dispatched, batches, progress=False, blocks=GDN_ONLY)
    b = score_model(plain, batches, progress=False, blocks=GDN_ONLY)
    assert a["measures"]["value_lane"] == "loss_gram"
    for prefix, pa in a["layers"].items():
        assert pa["loss_tokens"] > 0
        pb = b["layers"][prefix]
        for key in pa:
            if key.endswith("scores"):
                torch.testing.assert_close(
                    torch.tensor(pa[key]), torch.tensor(pb[key]), rtol=1e-5, atol=1e-12
                )
            elif "order" in key:
                assert pa[key] == pb[key]


def test_vision_language_checkpoint_keeps_its_tensor_prefixes(text_file, tmp_path):
    torch.manual_seed(0)
    config = transformers.Qwen3_5Config(
        text_config=dict(**{**TEXT, "vocab_size": 257}, **gdn_kwargs(SHAPE)), vision_config=dict(VISION)
    )
    model = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    randomize_gdn(model)
    folder = _save(model, tmp_path / "vl")
    assert _run(folder, text_file, tmp_path / "vl.json") == 0
    scores = load_scores(tmp_path / "vl.json")
    assert list(gdn_entries(scores["layers"])) == [
        "model.language_model.layers.0.linear_attn",
        "model.language_model.layers.2.linear_attn",
    ]
    assert all(p.startswith("model.language_model.layers.") for p in scores["layers"])  # sub-blocks too


# ---- score for real users: output files, window length, streaming, notes, threads --------------------------


def test_an_existing_scores_file_needs_overwrite(model_dir, text_file, tmp_path, capsys):
    out = tmp_path / "s.json"
    out.write_text("keep me")
    assert _run(model_dir, text_file, out) == 2
    assert "already exists" in capsys.readouterr().err and out.read_text() == "keep me"
    assert _run(model_dir, text_file, out, "--overwrite") == 0
    assert load_scores(out)["num_tokens"] == SAMPLES * SEQ


def test_the_default_window_is_what_the_model_supports(tmp_path, text_file):
    torch.manual_seed(0)
    config = transformers.Qwen3_5TextConfig(
        **{**TEXT, "vocab_size": 257}, **gdn_kwargs(SHAPE), max_position_embeddings=96
    )
    folder = _save(transformers.Qwen3_5ForCausalLM(config).eval(), tmp_path / "short_model")
    assert (
        main(
            [
                "score",
                str(folder),
                "--data",
                str(text_file),
                "--output",
                str(tmp_path / "s.json"),
                "--num-samples",
                "2",
                "--quiet",
            ]
        )
        == 0
    )
    calibration = load_scores(tmp_path / "s.json")["calibration"]
    assert calibration["seq_len"] == 96 and "max_position_embeddings 96" in calibration["seq_len_source"]
    from gdnprune.scoring import default_seq_len

    assert default_seq_len({"max_position_embeddings": 32768}) == (512, "capped at 512")
    assert default_seq_len({"text_config": {"max_position_embeddings": 64}})[0] == 64


def test_calibration_reads_only_what_the_windows_need(tmp_path):
    from gdnprune.quality.calibration import calibration_windows

    path = tmp_path / "big.txt"
    text = train_text()[:300_000]
    path.write_bytes(text.encode() + b"\n\xff broken tail")  # never reached by 4 windows of 72 bytes
    windows = calibration_windows(path, build_byte_tokenizer(), seq_len=SEQ, num_samples=SAMPLES)
    assert windows.reshape(-1).tolist() == list(text.encode()[: SAMPLES * SEQ])
    with pytest.raises(ValueError, match="not UTF-8 text"):
        read_texts(path)


def test_kernel_fallback_warnings_become_one_note(model_dir, text_file, tmp_path, capsys):
    import logging

    gpu = torch.cuda.is_available()  # the note says how to get the fast kernels: only where they can run
    for quiet, expected in ((False, int(gpu)), (True, 0)):
        logging.Logger.warning_once.cache_clear()  # transformers warns once per process
        args = [
            "score",
            str(model_dir),
            "--data",
            str(text_file),
            "--output",
            str(tmp_path / f"{quiet}.json"),
            "--num-samples",
            "1",
            "--seq-len",
            str(SEQ),
            "--threads",
            "1",
        ] + (["--quiet"] if quiet else [])
        assert main(args) == 0
        err = capsys.readouterr().err
        assert err.count("note: the GDN layers run transformers' reference PyTorch kernels") == expected
        assert "falling back" not in err
    assert torch.get_num_threads() == 1


def test_the_demo_says_how_to_get_its_plot(monkeypatch, tmp_path):
    import sys

    from gdnprune import demo

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    assert demo._plot([], [], tmp_path / "p.png", "t") is False
    assert "pip install 'gdnprune[plot]'" in demo.NO_PLOT


# ---- score then sort order every axis by default (the outside view) ---------------------------------------

TRAINED = Path(__file__).resolve().parent / "data" / "trained"


def _logits(folder, ids):
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.fixture(scope="module")
def byte_ids():
    return torch.tensor([list(train_text()[5000:5096].encode("utf-8"))[:96]])


def _score_and_sort(folder, text_file, tmp_path):
    scores, sorted_dir = tmp_path / "s.json", tmp_path / "sorted"
    assert _run(folder, text_file, scores) == 0
    assert main(["sort", str(folder), "--scores", str(scores), "-o", str(sorted_dir), "-q"]) == 0
    return json.loads(scores.read_text())["layers"], sorted_dir


def test_score_sort_slice_cuts_the_least_important_mlp_channels(text_file, tmp_path, byte_ids):
    """score + sort + slice --intermediate-size keeps each MLP's most important channels: the sliced model
    computes what the full model computes with the other channels' down_proj columns zeroed (plain torch)."""
    source, keep = TRAINED / "olmo_hybrid", 48
    layers, sorted_dir = _score_and_sort(source, text_file, tmp_path)
    mlps = {p: v for p, v in layers.items() if v.get("kind") == "mlp"}
    assert len(mlps) == 3 and {v.get("kind") for v in layers.values()} >= {"attention", "mlp"}
    cut_dir = tmp_path / "cut"
    argv = ["slice", str(sorted_dir), "-o", str(cut_dir), "--intermediate-size", str(keep), "-q"]
    assert main(argv) == 0

    full = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    stored = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    with torch.no_grad():
        for prefix, payload in mlps.items():
            order = payload["channel_order_most_important_first"]
            assert set(order[:keep]) != set(range(keep))  # not the stored order: the test can tell them apart
            full.get_submodule(f"{prefix}.down_proj").weight[:, order[keep:]] = 0
            stored.get_submodule(f"{prefix}.down_proj").weight[:, keep:] = 0
        expected, by_storage = full(input_ids=byte_ids).logits, stored(input_ids=byte_ids).logits
    got = _logits(cut_dir, byte_ids)
    assert json.loads((cut_dir / "config.json").read_text())["intermediate_size"] == keep
    assert torch.allclose(got, expected, atol=2e-4), (got - expected).abs().max()
    assert (got - by_storage).abs().max() > 1e-2  # cutting in the stored order is another model


def test_sort_moves_the_experts_and_keeps_the_function(text_file, tmp_path, byte_ids):
    """The default scores order the routed experts too, and sort applies them: expert i of the sorted folder is
    expert order[i] of the source (bytes), its router row with it, and the logits stay the same."""
    from safetensors.torch import load_file

    source = TRAINED / "qwen3_5_moe"
    layers, sorted_dir = _score_and_sort(source, text_file, tmp_path)
    experts = {p: v for p, v in layers.items() if v.get("kind") == "experts"}
    assert len(experts) == 3 and {"shared_expert", "attention"} <= {v.get("kind") for v in layers.values()}
    before = load_file(source / "model.safetensors")
    after = {k: v for f in sorted(sorted_dir.glob("*.safetensors")) for k, v in load_file(f).items()}
    moved = 0
    for prefix, payload in experts.items():
        order = payload["expert_order_most_important_first"]
        moved += order != sorted(order)
        assert torch.equal(after[f"{prefix}.gate.weight"], before[f"{prefix}.gate.weight"][order])
        for i, e in enumerate(order):
            for name in ("gate_proj", "up_proj", "down_proj"):
                key = f"{prefix}.experts.{{}}.{name}.weight"
                assert torch.equal(after[key.format(i)], before[key.format(e)])
    assert moved  # at least one layer's experts really moved
    expected, got = _logits(source, byte_ids), _logits(sorted_dir, byte_ids)
    assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()
