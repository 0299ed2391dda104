"""End-to-end checkpoint surgery (inspect / sort / slice / verify) on tiny real transformers checkpoints.

Every source folder is written by ``save_pretrained`` with 20 KB shards (GDN layers straddle shards), then
gets extra ``mtp.*`` tensors, tokenizer files and other files, as a real model folder has.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from helpers import EXTRA_FILES, MODEL_TYPES, add_mtp, leftovers, make_source, raw_tensors
from helpers import SOURCE_SHAPE as SHAPE
from reference import hand_cut_state_dict, picks, zero_removed_heads
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tiny_models import MODEL_CLASS, build_model

from gdnprune import checkpoint as ck
from gdnprune.cli import main
from gdnprune.gated_delta_net import GDNPermutation, GDNShape

pytestmark = pytest.mark.filterwarnings("ignore::gdnprune.checkpoint.UnsortedInputWarning")

TARGET = {"num_key_heads": 1, "num_value_heads": 1, "key_head_dim": 5, "value_head_dim": 4}
TARGET_ARGS = [
    "--num-key-heads",
    "1",
    "--num-value-heads",
    "1",
    "--key-head-dim",
    "5",
    "--value-head-dim",
    "4",
]
SEQ = 80  # longer than the GDN kernel's 64-token chunks
OLMO_CONV = ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight")


# ---- building source folders ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """model_type -> a read-only source folder (built once per module)."""
    root = tmp_path_factory.mktemp("sources")
    return {mt: make_source(root / mt, mt, seed=i) for i, mt in enumerate(MODEL_TYPES)}


# ---- helpers --------------------------------------------------------------------------------------------


def hash_tree(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def load_all(folder: Path) -> dict[str, torch.Tensor]:
    sd = {}
    for shard in ck.open_checkpoint(folder).shards:
        sd.update(load_file(shard.path))
    return sd


def gdn_layers(folder: Path):
    return ck.find_gdn_layers(ck.open_checkpoint(folder))[0]


def fuse_olmo_conv(sd: dict, prefixes) -> dict:
    """OLMo stores its conv split in three on disk; the core API works on the fused ``conv1d.weight``."""
    sd = dict(sd)
    for p in prefixes:
        if f"{p}.q_conv1d.weight" in sd:
            sd[f"{p}.conv1d.weight"] = torch.cat([sd.pop(f"{p}.{n}") for n in OLMO_CONV])
    return sd


def expected_state_dict(src_sd, prefixes, *, perms=None, target=None):
    """The source tensors with every GDN layer permuted and/or cut by hand (``reference.hand_cut``: heads
    and channels picked by the model's own formulas, no gdnprune index code)."""
    sd = fuse_olmo_conv(src_sd, prefixes)
    cut = (
        SHAPE
        if target is None
        else GDNShape(
            **{**SHAPE.as_dict(), **dict(target.as_dict() if isinstance(target, GDNShape) else target)}
        )
    )
    return hand_cut_state_dict(sd, {p: (SHAPE, cut) for p in prefixes}, perms)


def random_scores(prefixes, seed=0) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(seed)
    perms = {p: GDNPermutation.random(SHAPE, generator=g) for p in prefixes}
    return {"layers": {p: perm.to_score_payload() for p, perm in perms.items()}, "method": "random"}, perms


def write_scores(path: Path, scores: dict) -> str:
    path.write_text(json.dumps(scores))
    return str(path)


def load_model(folder: Path, model_type: str):
    cls = getattr(transformers, MODEL_CLASS[model_type])
    model, info = cls.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    problems = {
        k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v
    }
    assert not problems, problems
    return model.eval()


def ids(seed=0):
    return torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def logits_of(folder: Path, model_type: str) -> torch.Tensor:
    return load_model(folder, model_type)(input_ids=ids()).logits


def run_cli(args) -> int:
    return main([str(a) for a in args])


def one_error_line(err: str, command: str) -> str:
    """The stderr of a failed command: warnings may come first, then exactly one error line."""
    lines = err.strip().splitlines()
    errors = [line for line in lines if line.startswith(f"gdnprune {command}: error: ")]
    assert len(errors) == 1 and errors[0] == lines[-1], err
    return errors[0]


# ---- sort -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_sort_preserves_logits_and_copies_everything_else(model_type, sources, tmp_path, capsys):
    src = sources[model_type]
    before = hash_tree(src)
    layers = gdn_layers(src)
    prefixes = [layer.prefix for layer in layers]
    assert len(prefixes) == 2
    # the test is meaningful: some GDN layer straddles two shards
    ckpt = ck.open_checkpoint(src)
    assert any(len({ckpt.shard_of(t.name) for t in layer.tensors.values()}) > 1 for layer in layers)
    scores, perms = random_scores(prefixes)
    out = tmp_path / "sorted"
    assert (
        run_cli(
            ["sort", src, "--scores", write_scores(tmp_path / "s.json", scores), "--output", out, "--quiet"]
        )
        == 0
    )
    assert "wrote" in capsys.readouterr().out
    assert hash_tree(src) == before  # the input is never modified
    assert leftovers(tmp_path) == []

    # same function: logits within 1e-4, and the output loads with no missing/unexpected/mismatched keys
    ref, got = logits_of(src, model_type), logits_of(out, model_type)
    assert (ref - got).abs().max() < 1e-4

    # GDN tensors equal the permutation done by hand; every other tensor byte-identical, dtypes kept
    src_raw, out_raw = raw_tensors(src), raw_tensors(out)
    assert src_raw.keys() == out_raw.keys()
    gdn = {t.name for layer in layers for t in layer.tensors.values()}
    for name in src_raw.keys() - gdn:
        assert out_raw[name] == src_raw[name], name
    assert all(out_raw[n][0] == src_raw[n][0] for n in gdn)
    src_sd = load_all(src)
    expected = expected_state_dict(src_sd, prefixes, perms=perms)
    got_sd = fuse_olmo_conv(load_all(out), prefixes)
    for name in expected:
        assert torch.equal(expected[name], got_sd[name]), name
    fused_src = fuse_olmo_conv(src_sd, prefixes)
    assert all(
        not torch.equal(expected[n], fused_src[n]) for n in expected if n.endswith("linear_attn.A_log")
    )

    # same shard files and assignment; index total_size right; everything else copied
    src_files, out_files = hash_tree(src), hash_tree(out)
    assert {f for f in src_files if f.endswith(".safetensors")} == {
        f for f in out_files if f.endswith(".safetensors")
    }
    index = json.loads((out / ck.INDEX_NAME).read_text())
    assert index["weight_map"] == json.loads((src / ck.INDEX_NAME).read_text())["weight_map"]
    assert index["metadata"]["total_size"] == sum(len(v[2]) for v in out_raw.values())
    for name in [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        *EXTRA_FILES,
    ]:
        if name in src_files:
            assert out_files[name] == src_files[name], name
    assert "tokenizer.json" in out_files and "assets/notes.txt" in out_files

    manifest = json.loads((out / ck.MANIFEST_NAME).read_text())
    assert manifest["operation"] == "sort" and manifest["sorted"] is True and manifest["target"] is None
    assert manifest["source"]["path"] == str(src.resolve())
    assert (
        manifest["source"]["index_sha256"] == hashlib.sha256((src / ck.INDEX_NAME).read_bytes()).hexdigest()
    )
    assert (
        manifest["source"]["config_sha256"] == hashlib.sha256((src / "config.json").read_bytes()).hexdigest()
    )
    for p in prefixes:
        assert manifest["layers"][p]["permutation"] == perms[p].to_score_payload()
    assert manifest["scores"]["metadata"] == {"method": "random"}
    assert manifest["version"]
    assert ck.inspect_checkpoint(out)["manifest"] == {"operation": "sort", "sorted": True}


def test_sorted_vl_checkpoint_loads_as_conditional_generation_and_causal_lm(sources, tmp_path):
    src = sources["qwen3_5_vl"]
    prefixes = [layer.prefix for layer in gdn_layers(src)]
    assert prefixes[0].startswith("model.language_model.layers.")
    # scores written against the causal-LM names (as AutoModelForCausalLM loads a VL checkpoint) are accepted
    scores, perms = random_scores(prefixes, seed=3)
    scores["layers"] = {p.replace("model.language_model.", "model."): v for p, v in scores["layers"].items()}
    out = tmp_path / "sorted"
    ck.sort_checkpoint(src, scores, out, progress=False)
    causal = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ref = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        assert (causal(input_ids=ids()).logits - ref(input_ids=ids()).logits).abs().max() < 1e-4
    assert (
        json.loads((out / ck.MANIFEST_NAME).read_text())["layers"][prefixes[0]]["permutation"]
        == perms[prefixes[0]].to_score_payload()
    )


# ---- slice ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_slice_matches_the_hand_cut_and_loads(model_type, sources, tmp_path, capsys):
    src = sources[model_type]
    before = hash_tree(src)
    prefixes = [layer.prefix for layer in gdn_layers(src)]
    out = tmp_path / "sliced"
    assert run_cli(["slice", src, "--output", out, "--quiet", *TARGET_ARGS]) == 0
    assert "sorted" in capsys.readouterr().err  # warns: the input was never sorted
    assert hash_tree(src) == before
    expected = expected_state_dict(load_all(src), prefixes, target=TARGET)
    got = fuse_olmo_conv(load_all(out), prefixes)
    assert expected.keys() == got.keys()
    for name in expected:
        assert expected[name].dtype == got[name].dtype and torch.equal(expected[name], got[name]), name
    config = json.loads((out / "config.json").read_text())
    holder = config["text_config"] if model_type == "qwen3_5_vl" else config
    assert GDNShape.from_config(holder) == GDNShape(**{**SHAPE.as_dict(), **TARGET})
    if model_type == "qwen3_5_vl":
        assert "linear_num_key_heads" not in config
    model = load_model(out, model_type)  # loads cleanly with the rewritten config
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids()).logits).all()
    manifest = json.loads((out / ck.MANIFEST_NAME).read_text())
    assert manifest["operation"] == "slice" and manifest["sorted"] is False
    assert manifest["target"] == {**SHAPE.as_dict(), **TARGET} and manifest["source_shape"] == SHAPE.as_dict()


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_slice_on_disk_equals_zeroing_the_removed_heads(model_type, sources, tmp_path):
    """Removing key groups or lanes on disk equals zeroing the removed heads' ``out_proj`` columns in the full
    model (``reference.py``; the kept heads by the formula ``h = g*r + j`` from the orders): slice alone
    (groups, then lanes), sort with random orders and then slice both, and prune in one pass."""
    src = sources[model_type]
    prefixes = [layer.prefix for layer in gdn_layers(src)]
    full = load_model(src, model_type)
    # groups swapped and each group's lanes in its own order, so that the kept heads (2 and 1, then 2) read key
    # groups h // r that differ from h % Hk, and reading a lane order by new position instead of old group shows
    g = torch.Generator().manual_seed(4)
    perms = {
        p: GDNPermutation(
            [1, 0],
            [[1, 0], [0, 1]],
            torch.rand(2, 8, generator=g).argsort(-1),
            torch.randperm(6, generator=g),
        )
        for p in prefixes
    }
    scores = {"layers": {p: perm.to_score_payload() for p, perm in perms.items()}, "method": "by hand"}
    r = SHAPE.value_heads_per_group
    assert picks(SHAPE, GDNShape(2, 2, 8, 6), perms[prefixes[0]]).value_heads(r) == [2, 1]
    sorted_dir = tmp_path / "sorted"
    assert (
        run_cli(["sort", src, "--scores", write_scores(tmp_path / "s.json", scores), "-o", sorted_dir, "-q"])
        == 0
    )
    cases = [  # (name, target, permutations, how)
        (
            "groups",
            GDNShape(1, 2, 8, 6),
            None,
            lambda out: run_cli(
                ["slice", src, "-o", out, "-q", "--num-key-heads", "1", "--num-value-heads", "2"]
            ),
        ),
        (
            "lanes",
            GDNShape(2, 2, 8, 6),
            None,
            lambda out: ck.slice_checkpoint(src, out, {"num_value_heads": 2}, progress=False),
        ),
        (
            "sorted, then groups+lanes",
            GDNShape(1, 1, 8, 6),
            perms,
            lambda out: run_cli(
                ["slice", sorted_dir, "-o", out, "-q", "--num-key-heads", "1", "--num-value-heads", "1"]
            ),
        ),
        (
            "prune, lanes",
            GDNShape(2, 2, 8, 6),
            perms,
            lambda out: ck.transform_checkpoint(
                src, out, permutations=perms, target={"num_value_heads": 2}, operation="prune", progress=False
            ),
        ),
    ]
    for name, target, permutations, how in cases:
        out = tmp_path / name.replace(" ", "_").replace(",", "")
        done = how(out)  # the CLI's exit code, or the API's manifest
        assert done == 0 or isinstance(done, dict), name
        reference = copy.deepcopy(full)
        zero_removed_heads(
            reference,
            {
                p: picks(SHAPE, target, None if permutations is None else permutations[p]).value_heads(r)
                for p in prefixes
            },
        )
        with torch.no_grad():
            want, before = reference(input_ids=ids()).logits, full(input_ids=ids()).logits
            got = load_model(out, model_type)(input_ids=ids()).logits
        assert (want - before).abs().max() > 0.05, name  # the cut matters
        assert (got - want).abs().max() < 1e-4, name


def test_sort_then_slice_equals_prune_in_one_pass(sources, tmp_path):
    src = sources["qwen3_next"]
    prefixes = [layer.prefix for layer in gdn_layers(src)]
    scores, perms = random_scores(prefixes, seed=5)
    ck.sort_checkpoint(src, scores, tmp_path / "sorted", progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ck.UnsortedInputWarning)  # the sorted output says it is sorted
        manifest = ck.slice_checkpoint(
            tmp_path / "sorted", tmp_path / "sliced", GDNShape(1, 2, 5, 4), progress=False
        )
    assert manifest["sorted"] is True and manifest["source"]["operation"] == "sort"
    pruned = ck.transform_checkpoint(
        src,
        tmp_path / "pruned",
        permutations=perms,
        target=dict(num_key_heads=1, num_value_heads=2, key_head_dim=5, value_head_dim=4),
        operation="prune",
        progress=False,
    )
    assert pruned["sorted"] is True
    two_pass, one_pass = load_all(tmp_path / "sliced"), load_all(tmp_path / "pruned")
    expected = expected_state_dict(load_all(src), prefixes, perms=perms, target=GDNShape(1, 2, 5, 4))
    for name in expected:
        assert torch.equal(two_pass[name], one_pass[name]) and torch.equal(expected[name], one_pass[name]), (
            name
        )


@pytest.mark.parametrize("mode", ["pwritev", "pwrite", "pwritev, 3 buffers per call, short writes"])
@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_next", "olmo_hybrid"])
def test_every_write_path_gives_the_hand_cut_result(model_type, mode, sources, tmp_path, monkeypatch):
    """Row gathers are written from the memory map with vectored writes (or one pwrite per run where the
    platform has no pwritev); force each path, including partial writes, and compare with the hand cut."""
    from gdnprune.io import safetensors_io

    src = sources[model_type]
    prefixes = [layer.prefix for layer in gdn_layers(src)]
    monkeypatch.setattr(safetensors_io, "_HAVE_PWRITEV", mode != "pwrite")
    calls = []
    if mode.startswith("pwritev,"):
        monkeypatch.setattr(safetensors_io, "_IOV_MAX", 3)
        real = os.pwritev

        def short_pwritev(fd, buffers, offset):  # writes at most 40 bytes per call
            calls.append(len(buffers))
            data = b"".join(bytes(b) for b in buffers)[:40]
            return real(fd, [data], offset)

        monkeypatch.setattr(os, "pwritev", short_pwritev)
    scores, perms = random_scores(prefixes, seed=11)
    target = GDNShape(1, 2, 5, 4)
    ck.transform_checkpoint(
        src,
        tmp_path / "pruned",
        permutations=perms,
        target=target.as_dict(),
        operation="prune",
        progress=False,
    )
    ck.slice_checkpoint(src, tmp_path / "sliced", target, progress=False)
    ck.sort_checkpoint(src, scores, tmp_path / "sorted", progress=False)
    if calls:
        assert max(calls) == 3
    src_sd = load_all(src)
    for out, kw in (
        ("pruned", dict(perms=perms, target=target)),
        ("sliced", dict(target=target)),
        ("sorted", dict(perms=perms)),
    ):
        expected = expected_state_dict(src_sd, prefixes, **kw)
        got = fuse_olmo_conv(load_all(tmp_path / out), prefixes)
        assert expected.keys() == got.keys()
        for name in expected:
            assert expected[name].dtype == got[name].dtype and torch.equal(expected[name], got[name]), (
                out,
                name,
            )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_single_file_checkpoint_keeps_dtype(dtype, tmp_path):
    src = make_source(tmp_path / "src", "qwen3_5", dtype=dtype, sharded=False)
    assert not (src / ck.INDEX_NAME).exists()
    prefixes = [layer.prefix for layer in gdn_layers(src)]
    scores, perms = random_scores(prefixes, seed=1)
    ck.sort_checkpoint(src, scores, tmp_path / "sorted", progress=False)
    ck.slice_checkpoint(src, tmp_path / "sliced", TARGET, progress=False)
    src_raw = raw_tensors(src)
    for folder, exp in [
        (tmp_path / "sorted", expected_state_dict(load_all(src), prefixes, perms=perms)),
        (tmp_path / "sliced", expected_state_dict(load_all(src), prefixes, target=TARGET)),
    ]:
        assert sorted(os.listdir(folder)).count(ck.SINGLE_NAME) == 1 and not (folder / ck.INDEX_NAME).exists()
        got, raw = load_all(folder), raw_tensors(folder)
        for name, tensor in exp.items():
            assert got[name].dtype == dtype and torch.equal(got[name], tensor), name
            if "linear_attn" not in name:
                assert raw[name] == src_raw[name]
        with safe_open(folder / ck.SINGLE_NAME, "pt") as f:
            assert f.metadata() == {"format": "pt"}
    load_model(tmp_path / "sorted", "qwen3_5")


def test_symlinked_source_folder(sources, tmp_path):
    """Hugging Face cache snapshots are folders of symlinks."""
    src = tmp_path / "snapshot"
    src.mkdir()
    for p in sources["qwen3_5"].iterdir():
        (src / p.name).symlink_to(p)
    ck.slice_checkpoint(src, tmp_path / "out", TARGET, progress=False)
    out_files = list((tmp_path / "out").iterdir())
    assert out_files and not any(p.is_symlink() for p in out_files)
    load_model(tmp_path / "out", "qwen3_5")


# ---- inspect / verify -----------------------------------------------------------------------------------


def test_inspect_table_and_json(sources, capsys):
    src = sources["qwen3_5_moe"]
    assert run_cli(["inspect", src]) == 0
    table = capsys.readouterr().out
    assert (
        "model.layers.0.linear_attn" in table and "model.layers.2.linear_attn" in table and "qwen3_5" in table
    )
    assert run_cli(["inspect", src, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    sd = load_all(src)
    assert info["total_parameters"] == sum(t.numel() for t in sd.values())
    gdn = sum(t.numel() for k, t in sd.items() if ".linear_attn." in k)
    assert info["gdn_parameters"] == gdn and info["other_parameters"] == info["total_parameters"] - gdn
    assert [layer["prefix"] for layer in info["layers"]] == [
        "model.layers.0.linear_attn",
        "model.layers.2.linear_attn",
    ]
    assert info["layers"][0]["num_value_heads"] == 4 and info["layers"][0]["layout"] == "qwen3_5"
    assert info["format"] == "sharded" and info["shards"] > 10 and info["manifest"] is None
    assert len(info["layers"][0]["shards"]) >= 1


def test_verify_cli(sources, tmp_path, capsys):
    src = sources["qwen3_5"]
    prefixes = [layer.prefix for layer in gdn_layers(src)]
    ck.sort_checkpoint(src, random_scores(prefixes)[0], tmp_path / "sorted", progress=False)
    ck.slice_checkpoint(src, tmp_path / "sliced", TARGET, progress=False)
    assert run_cli(["verify", src, tmp_path / "sorted", "--seq-len", "70", "--num-samples", "2"]) == 0
    out = capsys.readouterr().out
    assert "max |logit diff|" in out and "OK" in out and "random ids" in out and "loss A" in out
    assert run_cli(["verify", src, tmp_path / "sliced", "--seq-len", "70", "--num-samples", "2"]) == 1
    assert "EXCEEDS" in capsys.readouterr().out
    text = tmp_path / "text.txt"
    text.write_text("the model sorts heads and slices them " * 30)
    result = ck.verify_checkpoints(src, tmp_path / "sorted", data=text, seq_len=70, num_samples=2)
    assert (
        "tokenizer" in result["token_source"] and result["tokens"] == [2, 70] and result["within_tolerance"]
    )
    assert abs(result["loss_a"] - result["loss_b"]) < 1e-4
    no_tok = tmp_path / "no_tokenizer"
    shutil.copytree(tmp_path / "sorted", no_tok)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (no_tok / name).unlink()
    result = ck.verify_checkpoints(no_tok, src, data=text, seq_len=100, num_samples=3)
    assert "bytes" in result["token_source"] and result["tokens"] == [3, 100] and result["within_tolerance"]


def test_verify_errors(sources, tmp_path, capsys):
    assert run_cli(["verify", sources["qwen3_5"], tmp_path / "missing"]) == 2
    assert "config.json" in capsys.readouterr().err
    other = tmp_path / "other_vocab"
    shutil.copytree(sources["qwen3_5"], other)
    config = json.loads((other / "config.json").read_text())
    config["vocab_size"] = 256
    (other / "config.json").write_text(json.dumps(config))
    assert run_cli(["verify", sources["qwen3_5"], other]) == 2
    assert "vocabulary" in capsys.readouterr().err


# ---- warnings -------------------------------------------------------------------------------------------


def test_missing_scores_entry_warns_and_keeps_order(sources, tmp_path):
    src = sources["qwen3_5"]
    prefixes = [layer.prefix for layer in gdn_layers(src)]
    scores, perms = random_scores(prefixes[:1])
    with pytest.warns(ck.MissingScoresWarning, match=prefixes[1]):
        manifest = ck.sort_checkpoint(src, scores, tmp_path / "out", progress=True)
    src_raw, out_raw = raw_tensors(src), raw_tensors(tmp_path / "out")
    assert all(out_raw[n] == src_raw[n] for n in src_raw if n.startswith(prefixes[1] + "."))
    assert any(out_raw[n] != src_raw[n] for n in src_raw if n.startswith(prefixes[0] + "."))
    assert manifest["sorted"] is False and manifest["unsorted_layers"] == [prefixes[1]]
    assert manifest["layers"][prefixes[1]]["permutation"] is None


def test_cli_warnings_are_one_line_on_stderr(sources, tmp_path, capsys):
    src = sources["qwen3_5"]
    prefixes = [layer.prefix for layer in gdn_layers(src)]
    path = write_scores(tmp_path / "s.json", random_scores(prefixes[:1])[0])
    assert run_cli(["sort", src, "--scores", path, "--output", tmp_path / "out", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert f"gdnprune sort: warning: GDN layer {prefixes[1]} has no entry in the scores" in err


def test_gdn_looking_mtp_layer_is_left_untouched(tmp_path):
    src = make_source(tmp_path / "src", "qwen3_5")
    mtp = {
        f"mtp.layers.0.linear_attn.{r}": t
        for r, t in {
            "in_proj_qkv.weight": torch.randn(SHAPE.conv_dim, 64),
            "in_proj_z.weight": torch.randn(SHAPE.value_dim, 64),
        }.items()
    }
    add_mtp(src, mtp)
    with pytest.warns(ck.PassthroughWarning, match="mtp.layers.0.linear_attn"):
        manifest = ck.slice_checkpoint(src, tmp_path / "out", TARGET, progress=False)
    assert manifest["passthrough"] == ["mtp.layers.0.linear_attn"]
    src_raw, out_raw = raw_tensors(src), raw_tensors(tmp_path / "out")
    assert all(out_raw[k] == src_raw[k] for k in src_raw if k.startswith("mtp."))
    info = ck.inspect_checkpoint(src)
    assert info["passthrough"] == ["mtp.layers.0.linear_attn"] and len(info["layers"]) == 2


def test_overwrite_replaces_existing_output(sources, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    assert (
        run_cli(
            ["slice", sources["qwen3_5"], "-o", out, "-q", "--num-key-heads", "1", "--num-value-heads", "2"]
        )
        == 2
    )
    assert "exists" in capsys.readouterr().err and (out / "old.txt").exists()
    # --overwrite replaces an earlier model folder only, never an arbitrary folder
    assert run_cli(["slice", sources["qwen3_5"], "-o", out, "-q", "--num-key-heads", "1", "--overwrite"]) == 2
    assert "not a model folder" in capsys.readouterr().err and (out / "old.txt").exists()
    (out / "config.json").write_text("{}")
    assert (
        run_cli(
            [
                "slice",
                sources["qwen3_5"],
                "-o",
                out,
                "-q",
                "--num-key-heads",
                "1",
                "--num-value-heads",
                "2",
                "--overwrite",
            ]
        )
        == 0
    )
    assert not (out / "old.txt").exists() and (out / ck.MANIFEST_NAME).exists()
    assert leftovers(tmp_path) == []


# ---- error paths: exit 2, one line, no output folder ----------------------------------------------------


def _copy(sources, tmp_path, model_type="qwen3_5") -> Path:
    dst = tmp_path / "model"
    shutil.copytree(sources[model_type], dst)
    return dst


def _shards(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def _corrupt_truncate(folder):
    shard = _shards(folder)[3]
    shard.write_bytes(shard.read_bytes()[:-10])


def _corrupt_header(folder):
    shard = _shards(folder)[0]
    data = shard.read_bytes()
    shard.write_bytes(data[:8] + b"{not json" + data[17:])


def _missing_shard(folder):
    _shards(folder)[1].unlink()


def _no_config(folder):
    (folder / "config.json").unlink()


def _no_weights(folder):
    for p in _shards(folder):
        p.unlink()
    (folder / ck.INDEX_NAME).unlink()


def _index_disagrees(folder):
    index = json.loads((folder / ck.INDEX_NAME).read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = next(
        v for v in index["weight_map"].values() if v != index["weight_map"][name]
    )
    (folder / ck.INDEX_NAME).write_text(json.dumps(index))


def _rewrite_tensors(folder, fn):
    """Apply ``fn(name, tensor) -> {name: tensor}`` to every tensor of every shard, keeping the index right."""
    index = json.loads((folder / ck.INDEX_NAME).read_text())
    weight_map = {}
    for shard in _shards(folder):
        new = {}
        for k, v in load_file(shard).items():
            new.update(fn(k, v))
        save_file(new, shard, metadata={"format": "pt"})
        weight_map.update({k: shard.name for k in new})
    index["weight_map"] = weight_map
    (folder / ck.INDEX_NAME).write_text(json.dumps(index))


def _unknown_layout(folder):
    _rewrite_tensors(folder, lambda k, v: {k.replace(".in_proj_", ".fused_proj_"): v})


def _quantised(folder):
    _rewrite_tensors(
        folder,
        lambda k, v: {
            k: v,
            **(
                {k + "_scale_inv": torch.ones(1)}
                if k.endswith("layers.0.linear_attn.in_proj_qkv.weight")
                else {}
            ),
        },
    )


def _missing_gdn_tensor(folder):
    _rewrite_tensors(folder, lambda k, v: {} if k.endswith("layers.2.linear_attn.dt_bias") else {k: v})


def _wrong_geometry(folder):
    config = json.loads((folder / "config.json").read_text())
    config["linear_num_value_heads"] = 6
    (folder / "config.json").write_text(json.dumps(config))


def _no_gdn_layer(folder):
    shutil.rmtree(folder)
    config = build_model("qwen3_5", SHAPE, randomize=False).config
    config.layer_types = ["full_attention"] * 4
    make_source(folder, "qwen3_5", config=config)


INPUT_ERRORS = {
    "truncated shard": (_corrupt_truncate, "truncated"),
    "corrupt header": (_corrupt_header, "not JSON"),
    "missing shard": (_missing_shard, "missing"),
    "no config": (_no_config, "config.json"),
    "no weights": (_no_weights, "model.safetensors"),
    "index disagrees": (_index_disagrees, "disagree"),
    "unknown layout": (_unknown_layout, "unknown GDN layout"),
    "quantised": (_quantised, "not part of the qwen3_5 GDN layout"),
    "missing tensor": (_missing_gdn_tensor, "missing tensor 'model.layers.2.linear_attn.dt_bias'"),
    "wrong geometry": (
        _wrong_geometry,
        r"A_log' has shape \(4,\), expected \(6\) for GDNShape.* \(config.json",
    ),
    "no GDN layer": (_no_gdn_layer, "no GDN layer"),
}


@pytest.mark.parametrize("case", list(INPUT_ERRORS))
@pytest.mark.parametrize("command", ["sort", "slice"])
def test_input_errors_exit_2_and_leave_no_output(case, command, sources, tmp_path, capsys):
    folder = _copy(sources, tmp_path)
    corrupt, message = INPUT_ERRORS[case]
    corrupt(folder)
    out = tmp_path / "out"
    if command == "sort":
        scores = write_scores(tmp_path / "s.json", random_scores(["model.layers.0.linear_attn"])[0])
        args = ["sort", folder, "--scores", scores, "--output", out]
    else:
        args = ["slice", folder, "--output", out, "--num-key-heads", "1", "--num-value-heads", "2"]
    assert run_cli(args) == 2
    assert re.search(message, one_error_line(capsys.readouterr().err, command))
    assert not out.exists() and leftovers(tmp_path) == []
    if case not in ("no config", "no weights", "missing shard"):
        assert run_cli(["inspect", folder]) == 2


def test_nonexistent_model_dir(tmp_path, capsys):
    assert run_cli(["slice", tmp_path / "nope", "-o", tmp_path / "out", "--num-key-heads", "1"]) == 2
    assert "no such directory" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


SCORE_ERRORS = {
    "not a file": (None, "--scores: expected a scores file, found no such path"),
    "not json": ("{oops", "not valid JSON"),
    "no layers": ({"method": "x"}, "'layers'"),
    "not a GDN layer": ({"layers": {"model.layers.1.linear_attn": {}}}, "not a GDN layer"),
    "wrong shape": (
        {"layers": {"model.layers.0.linear_attn": {"key_group_order_most_important_first": [0, 1, 2]}}},
        r"key_group_order_most_important_first: expected shape \[2\], found \[3\]",
    ),
    "not a permutation": (
        {"layers": {"model.layers.0.linear_attn": {"value_dim_order_most_important_first": [0] * 6}}},
        "not a permutation",
    ),
    "lanes wrong shape": (
        {"layers": {"model.layers.2.linear_attn": {"value_lane_order_most_important_first": [[0, 1, 2, 3]]}}},
        r"expected shape \[2, 2\], found \[1, 4\]",
    ),
}


@pytest.mark.parametrize("case", list(SCORE_ERRORS))
def test_bad_scores_exit_2(case, sources, tmp_path, capsys):
    content, message = SCORE_ERRORS[case]
    path = tmp_path / "scores.json"
    if content is not None:
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    out = tmp_path / "out"
    assert run_cli(["sort", sources["qwen3_5"], "--scores", path, "--output", out]) == 2
    assert re.search(message, one_error_line(capsys.readouterr().err, "sort"))
    assert not out.exists() and leftovers(tmp_path) == []


TARGET_ERRORS = {
    "too many key heads": (["--num-key-heads", "4", "--num-value-heads", "4"], "num_key_heads 4 > 2"),
    "not a multiple": (["--num-value-heads", "3"], "must be a multiple"),
    "too many lanes": (["--num-key-heads", "1"], "value heads per key head > 2"),
    "key dim too big": (["--key-head-dim", "9"], "key_head_dim 9 > 8"),
    "value dim too big": (["--value-head-dim", "7"], "value_head_dim 7 > 6"),
    "nothing": ([], "nothing to slice"),
}


@pytest.mark.parametrize("case", list(TARGET_ERRORS))
def test_illegal_targets_exit_2(case, sources, tmp_path, capsys):
    flags, message = TARGET_ERRORS[case]
    out = tmp_path / "out"
    assert run_cli(["slice", sources["qwen3_5"], "--output", out, "--quiet", *flags]) == 2
    assert message in one_error_line(capsys.readouterr().err, "slice")
    assert not out.exists() and leftovers(tmp_path) == []


def test_non_positive_target_is_a_usage_error(sources, tmp_path):
    with pytest.raises(SystemExit) as exc:
        main(["slice", str(sources["qwen3_5"]), "--output", str(tmp_path / "out"), "--key-head-dim", "0"])
    assert exc.value.code == 2 and not (tmp_path / "out").exists()


def test_output_inside_or_equal_to_input_is_refused(sources, tmp_path, capsys):
    folder = _copy(sources, tmp_path)
    before = hash_tree(folder)
    for out in (folder / "sub", folder, folder / "a" / "b"):
        assert (
            run_cli(["slice", folder, "--output", out, "--num-key-heads", "1", "--num-value-heads", "2"]) == 2
        )
        assert "model folder" in capsys.readouterr().err
    assert (
        run_cli(
            [
                "slice",
                folder,
                "--output",
                tmp_path,
                "--overwrite",
                "--num-key-heads",
                "1",
                "--num-value-heads",
                "2",
            ]
        )
        == 2
    )
    assert "inside the output folder" in capsys.readouterr().err
    assert hash_tree(folder) == before and not (folder / "sub").exists()


# ---- interrupts and internal paths ----------------------------------------------------------------------


def test_interrupt_while_copying_leaves_nothing(sources, tmp_path, monkeypatch, capsys):
    from gdnprune.checkpoint import engine

    calls = {"n": 0}
    real = engine.copy_range

    def interrupted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "copy_range", interrupted)
    out = tmp_path / "out"
    assert (
        run_cli(
            ["slice", sources["qwen3_5"], "--output", out, "--num-key-heads", "1", "--num-value-heads", "2"]
        )
        == 130
    )
    assert calls["n"] == 3 and not out.exists() and leftovers(tmp_path) == []


def test_interrupt_in_the_gather_worker_leaves_nothing(sources, tmp_path, monkeypatch):
    from gdnprune.checkpoint import engine

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(engine, "_write_job", interrupted)
    out = tmp_path / "out"
    assert (
        run_cli(["slice", sources["qwen3_next"], "-o", out, "--num-key-heads", "1", "--num-value-heads", "2"])
        == 130
    )
    assert not out.exists() and leftovers(tmp_path) == []


def test_python_m_gdnprune_help():
    result = subprocess.run(
        [sys.executable, "-m", "gdnprune", "--help"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0
    for command in ("inspect", "sort", "slice", "verify"):
        assert command in result.stdout
