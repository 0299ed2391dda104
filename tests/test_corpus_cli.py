"""Every command that takes --data reads every corpus form: a folder of mixed shards scores exactly as the
same documents in one JSONL file, a mixture scores on the windows the mixture rule picks."""

from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import transformers
from tiny_models import TEXT, gdn_kwargs, randomize_gdn

from gdnprune.checkpoint import verify_checkpoints
from gdnprune.cli import main
from gdnprune.corpus import data_spec
from gdnprune.demo_data import build_byte_tokenizer, train_text
from gdnprune.gated_delta_net import GDNShape
from gdnprune.scoring import load_scores, measure_checkpoint

SHAPE = GDNShape(num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=6)
SEQ, SAMPLES = 48, 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.Qwen3_5TextConfig(**{**TEXT, "vocab_size": 257}, **gdn_kwargs(SHAPE))
    model = transformers.Qwen3_5ForCausalLM(config).eval()
    randomize_gdn(model)
    path = tmp_path_factory.mktemp("model")
    model.save_pretrained(path)
    build_byte_tokenizer().save_pretrained(path)
    return path


def _docs(n: int, offset: int = 0) -> list[str]:
    text = train_text()
    return [text[offset + 97 * i : offset + 97 * i + 60 + i % 7] for i in range(n)]


def _score(model_dir, out, *data_args):
    argv = ["score", str(model_dir), "--data", *map(str, data_args), "--output", str(out)]
    argv += ["--num-samples", str(SAMPLES), "--seq-len", str(SEQ), "--batch-size", "2", "--quiet"]
    return main(argv)


def test_a_folder_of_shards_scores_as_one_jsonl_file(model_dir, tmp_path):
    docs = _docs(12)
    one = tmp_path / "one.jsonl"
    one.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:4]))
    with gzip.open(shards / "b.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps({"text": d}) + "\n" for d in docs[4:8]))
    pq.write_table(pa.table({"text": docs[8:]}), shards / "c.parquet")
    assert _score(model_dir, tmp_path / "one.json", one) == 0
    assert _score(model_dir, tmp_path / "shards.json", shards) == 0
    a, b = load_scores(tmp_path / "one.json"), load_scores(tmp_path / "shards.json")
    assert a["layers"] == b["layers"] and a["num_tokens"] == b["num_tokens"] == SAMPLES * SEQ
    assert b["calibration"]["data"] == str(shards)


def test_a_mixture_scores_on_the_windows_of_the_rule(model_dir, tmp_path):
    tokenizer = build_byte_tokenizer()
    sources = []
    for name, offset in (("x", 0), ("y", 20000)):
        path = tmp_path / f"{name}.txt"
        path.write_text(train_text()[offset : offset + 2000], encoding="utf-8")
        sources.append(path)
    assert _score(model_dir, tmp_path / "mix.json", *sources, "--data-weights", "1", "3") == 0
    # by hand: each source's windows of its bytes; the rule takes 1 of x, then 3 of y (positions 0.5/0.25
    # for x, 0.5/0.75 for y: x0 at 2, y0 at 2/3, y1 at 2, y2 at 10/3, x1 at 6, ...) -> y0, x0, y1, y2
    per = [list(p.read_bytes()) for p in sources]
    windows = [[w[k * SEQ : (k + 1) * SEQ] for k in range(len(w) // SEQ)] for w in per]
    expected = torch.tensor([windows[1][0], windows[0][0], windows[1][1], windows[1][2]])
    run = measure_checkpoint(
        model_dir,
        data_spec(sources, weights=[1, 3]),
        num_samples=SAMPLES,
        seq_len=SEQ,
        batch_size=2,
        progress=False,
        keep_model=True,
    )
    assert torch.equal(run.windows, expected)
    assert (
        load_scores(tmp_path / "mix.json")["calibration"]["data"]
        == f"{sources[0]} (weight 1) {sources[1]} (weight 3)"
    )
    assert tokenizer.eos_token_id == 256  # the byte tokenizer: ids are the bytes


def test_verify_reads_a_glob(model_dir, tmp_path):
    for i in range(2):
        (tmp_path / f"part{i}.txt").write_text(train_text()[1000 * i : 1000 * i + 400], encoding="utf-8")
    result = verify_checkpoints(
        model_dir, model_dir, data=str(tmp_path / "part*.txt"), seq_len=64, num_samples=3
    )
    assert (
        result["tokens"] == [3, 64] and result["within_tolerance"] and "part*.txt" in result["token_source"]
    )
