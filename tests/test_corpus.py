"""gdnprune.corpus: every reader against plain Python reading the same files, windows against tokenising by
hand, the token cache (reused, rebuilt), the mixture rule, and the bad inputs."""

from __future__ import annotations

import gzip
import json
import os
import warnings
from fractions import Fraction
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import zstandard
from helpers import corpus_docs, write_jsonl
from transformers import AutoTokenizer

from gdnprune import corpus
from gdnprune.cli import main as cli_main
from gdnprune.corpus import windows as corpus_windows
from gdnprune.corpus.dataset import first_windows, open_windows
from gdnprune.quality.calibration import calibration_windows

DEMO = Path(__file__).resolve().parents[1] / "src" / "gdnprune" / "data" / "demo_model"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEMO)


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    """One folder with every format; each file's documents are known independently (``expected.json``)."""
    root = tmp_path_factory.mktemp("corpus")
    expected: dict[str, list[str]] = {}
    (root / "a.txt").write_text("plain text file\nwith two lines\n", encoding="utf-8")
    expected["a.txt"] = ["plain text file\nwith two lines\n"]
    docs = corpus_docs("jsonl", 7)
    write_jsonl(root / "b.jsonl", docs)
    expected["b.jsonl"] = docs
    docs = corpus_docs("gz", 5)
    write_jsonl(root / "c.jsonl.gz", docs, opener=gzip.open)
    expected["c.jsonl.gz"] = docs
    docs = corpus_docs("zst", 6)
    raw = "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()
    (root / "d.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    expected["d.jsonl.zst"] = docs
    docs = corpus_docs("parquet", 9)
    pq.write_table(pa.table({"text": docs, "n": list(range(9))}), root / "e.parquet", row_group_size=4)
    expected["e.parquet"] = docs
    docs = corpus_docs("arrow", 4)
    table = pa.table({"text": docs})
    with pa.OSFile(str(root / "f.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    expected["f.arrow"] = docs
    docs = corpus_docs("saved", 3)
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(root / "g_saved"))
    expected["g_saved"] = docs
    (root / ".expected.json").write_text(json.dumps(expected))
    return root


def _reference(root: Path, name: str) -> list[str]:
    """The documents of one file, read with plain Python and pyarrow (not datasets, not gdnprune)."""
    path = root / name
    if name.endswith(".txt"):
        return [path.read_text(encoding="utf-8")]
    if name.endswith(".jsonl"):
        return [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines()]
    if name.endswith(".gz"):
        return [json.loads(line)["text"] for line in gzip.decompress(path.read_bytes()).decode().splitlines()]
    if name.endswith(".zst"):
        raw = zstandard.ZstdDecompressor().stream_reader(path.read_bytes()).read()
        return [json.loads(line)["text"] for line in raw.decode().splitlines()]
    if name.endswith(".parquet"):
        return pq.read_table(path).column("text").to_pylist()
    if name.endswith(".arrow"):
        with pa.OSFile(str(path), "rb") as f:
            return pa.ipc.open_stream(f).read_all().column("text").to_pylist()
    arrow = sorted(path.glob("*.arrow"))
    return [
        t
        for a in arrow
        for t in pa.ipc.open_stream(pa.OSFile(str(a), "rb")).read_all().column("text").to_pylist()
    ]


NAMES = ["a.txt", "b.jsonl", "c.jsonl.gz", "d.jsonl.zst", "e.parquet", "f.arrow", "g_saved"]


def _read(data, tokenizer=None) -> list[str]:
    """Documents as gdnprune reads them (a text file's pieces joined back into its document)."""
    spec = corpus.data_spec(data)
    files = [f for s in spec.sources for f in corpus.source_files(s)]
    docs: list[str] = []
    for piece in corpus.iter_pieces(files, text_field=spec.text_field, tokenizer=tokenizer):
        if piece.new_document:
            docs.append(piece.text)
        else:
            docs[-1] += piece.text
    return docs


@pytest.mark.parametrize("name", NAMES)
def test_every_reader_gives_the_documents_python_reads(corpus_dir, name):
    reference = _reference(corpus_dir, name)
    assert reference == json.loads((corpus_dir / ".expected.json").read_text())[name]
    assert _read(corpus_dir / name) == reference


def test_a_folder_a_glob_and_a_list_read_their_files_in_path_order(corpus_dir):
    everything = [d for n in NAMES for d in _reference(corpus_dir, n)]
    assert _read(corpus_dir) == everything  # the folder: sorted by path; .expected.json is hidden
    jsonl = [d for n in ("b.jsonl", "c.jsonl.gz", "d.jsonl.zst") for d in _reference(corpus_dir, n)]
    assert _read(str(corpus_dir / "*.jsonl*")) == jsonl
    assert _read([corpus_dir / "e.parquet", corpus_dir / "a.txt"]) == (
        _reference(corpus_dir, "e.parquet") + _reference(corpus_dir, "a.txt")
    )
    kinds = {f.path.name: f.kind for f in corpus.source_files(str(corpus_dir))}
    assert kinds == {
        "a.txt": "text",
        "b.jsonl": "json",
        "c.jsonl.gz": "json",
        "d.jsonl.zst": "json",
        "e.parquet": "parquet",
        "f.arrow": "arrow",
        "g_saved": "saved",
    }


def _by_hand(docs: list[str], tokenizer, seq_len: int) -> list[list[int]]:
    """Documents tokenised one by one, joined with EOS, cut into windows: plain Python."""
    stream: list[int] = []
    for i, d in enumerate(docs):
        if i:
            stream.append(tokenizer.eos_token_id)
        stream += tokenizer(d, add_special_tokens=False)["input_ids"]
    return [stream[k : k + seq_len] for k in range(0, len(stream) - seq_len + 1, seq_len)]


@pytest.mark.parametrize("seq_len", [7, 64])
def test_windows_equal_the_documents_tokenised_by_hand(corpus_dir, tokenizer, tmp_path, seq_len):
    docs = [d for n in NAMES for d in _reference(corpus_dir, n)]
    expected = _by_hand(docs, tokenizer, seq_len)
    ds = open_windows(corpus_dir, tokenizer, seq_len=seq_len, cache_dir=tmp_path)
    assert len(ds) == len(expected) and ds.tensor().tolist() == expected
    assert ds[3]["input_ids"].dtype == torch.long and ds[3]["input_ids"].tolist() == expected[3]
    assert first_windows(corpus_dir, tokenizer, seq_len=seq_len, num_windows=5).tolist() == expected[:5]
    assert calibration_windows(corpus_dir, tokenizer, seq_len=seq_len, num_samples=5).tolist() == expected[:5]


def test_shards_and_selections_are_windows_by_index(corpus_dir, tokenizer, tmp_path):
    ds = open_windows(corpus_dir, tokenizer, seq_len=16, cache_dir=tmp_path)
    everything = ds.tensor()
    parts = [ds.shard(i, 3) for i in range(3)]
    assert torch.equal(torch.cat([p.tensor() for p in parts]), everything)
    assert sum(len(p) for p in parts) == len(ds)
    tail = ds.select(range(5, len(ds)))
    assert list(tail.indices) == list(range(5, len(ds))) and torch.equal(tail.tensor(), everything[5:])


def test_the_cache_is_reused_and_rebuilt_when_an_input_changes(tmp_path, tokenizer, monkeypatch):
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "one.jsonl", corpus_docs("one", 20))
    cache = tmp_path / "cache"
    first = open_windows(data, tokenizer, seq_len=32, cache_dir=cache)
    stream = first.windows.streams[0]
    assert not stream.reused
    stamp = stream.path.stat().st_mtime_ns
    calls = []
    real = corpus_windows._build
    monkeypatch.setattr(corpus_windows, "_build", lambda *a, **k: calls.append(a) or real(*a, **k))
    again = open_windows(data, tokenizer, seq_len=32, cache_dir=cache)
    assert again.windows.streams[0].reused and not calls and stream.path.stat().st_mtime_ns == stamp
    assert torch.equal(again.tensor(), first.tensor())
    # a new seq_len: the tokens do not depend on it, so they are reused, and the windows are right
    longer = open_windows(data, tokenizer, seq_len=50, cache_dir=cache)
    assert longer.windows.streams[0].reused and not calls
    assert longer.tensor().tolist() == _by_hand(corpus_docs("one", 20), tokenizer, 50)
    # a changed file (another size and mtime): rebuilt, and the windows follow the new text
    write_jsonl(data / "one.jsonl", corpus_docs("changed", 20))
    changed = open_windows(data, tokenizer, seq_len=32, cache_dir=cache)
    assert not changed.windows.streams[0].reused and len(calls) == 1
    assert changed.tensor().tolist() == _by_hand(corpus_docs("changed", 20), tokenizer, 32)
    # a new file in the folder: rebuilt
    write_jsonl(data / "two.jsonl", corpus_docs("two", 3))
    assert not open_windows(data, tokenizer, seq_len=32, cache_dir=cache).windows.streams[0].reused
    assert len(calls) == 2
    # another tokenizer (one more special token, so other ids): rebuilt
    other = AutoTokenizer.from_pretrained(DEMO)
    other.add_special_tokens({"additional_special_tokens": ["<doc>"]})
    assert corpus.tokenizer_fingerprint(other) != corpus.tokenizer_fingerprint(tokenizer)
    assert not open_windows(data, other, seq_len=32, cache_dir=cache).windows.streams[0].reused
    assert len(calls) == 3
    # calling a tokenizer (truncation state) does not change its fingerprint
    before = corpus.tokenizer_fingerprint(tokenizer)
    tokenizer(["some text"] * 2, truncation=True, max_length=4, padding=True)
    assert corpus.tokenizer_fingerprint(tokenizer) == before
    # and the truncation an earlier call left on the fast tokenizer's backend never cuts a document
    assert first_windows(data, tokenizer, seq_len=32).tolist() == _by_hand(
        corpus_docs("changed", 20) + corpus_docs("two", 3), tokenizer, 32
    )


def _rule(counts: list[int], weights: list[float]) -> list[tuple[int, int]]:
    """The documented mixture rule, step by step with exact fractions: the next window is the one with the
    smallest position (j + 1/2) / w_i (ties: the first source); stop when that source has no window left."""
    total = sum(Fraction(w).limit_denominator(10**6) for w in weights)
    w = [Fraction(x).limit_denominator(10**6) / total for x in weights]
    taken = [0] * len(counts)
    out = []
    while True:
        positions = [(Fraction(2 * taken[i] + 1, 2) / w[i], i) for i in range(len(counts))]
        _, i = min(positions)
        if taken[i] >= counts[i]:
            return out
        out.append((i, taken[i]))
        taken[i] += 1


@pytest.mark.parametrize(
    "counts, weights",
    [
        ([10, 10], [1, 1]),
        ([100, 40], [0.3, 0.7]),
        ([50, 50, 50], [1, 2, 5]),
        ([3, 1000], [0.5, 0.5]),
        ([10, 4], [1, 3]),  # x1 and y's missing window y4 tie at position 6: x1 is in (source order)
        ([1, 10], [1, 3]),  # x's missing window x1 and y4 tie at 6: y4 is out
        ([0, 5], [1, 1]),
    ],
)
def test_mixture_order_is_the_documented_rule(counts, weights):
    source, index = corpus.mixture_order(counts, weights)
    assert list(zip(source.tolist(), index.tolist())) == _rule(counts, weights)


def test_a_mixture_interleaves_the_sources_windows_by_weight(tmp_path, tokenizer):
    code, web = tmp_path / "code", tmp_path / "web"
    code.mkdir()
    web.mkdir()
    write_jsonl(code / "part.jsonl", corpus_docs("code", 30))
    (web / "w.txt").write_text("the web " * 400, encoding="utf-8")
    spec = corpus.data_spec([code, web], weights=["0.3", "0.7"])
    ds = open_windows(spec, tokenizer, seq_len=24, cache_dir=tmp_path / "cache")
    per_source = [
        _by_hand(corpus_docs("code", 30), tokenizer, 24),
        _by_hand(["the web " * 400], tokenizer, 24),
    ]
    order = _rule([len(p) for p in per_source], [0.3, 0.7])
    assert ds.tensor().tolist() == [per_source[i][j] for i, j in order]
    counts = [sum(1 for i, _ in order if i == s) for s in (0, 1)]
    assert counts[0] == len(per_source[0]) or counts[1] == len(per_source[1])  # up to the first that runs out
    assert first_windows(spec, tokenizer, seq_len=24, num_windows=17).tolist() == ds.tensor()[:17].tolist()


def test_chat_rows_are_rendered_with_the_chat_template(tmp_path):
    chat = AutoTokenizer.from_pretrained(DEMO)
    chat.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    rows = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
        {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]},
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    assert _read(path, chat) == ["<user>hi\n<assistant>hello\n", "<user>2+2?\n<assistant>4\n"]
    corpus.check_data(path)  # without a tokenizer the conversations are not rendered, not refused
    plain = AutoTokenizer.from_pretrained(DEMO)
    with pytest.raises(corpus.ChatTemplateError, match=r"chat.jsonl:1: .*no chat template"):
        corpus.check_data(path, tokenizer=plain)


def test_text_field_names_the_column(tmp_path):
    path = tmp_path / "content.parquet"
    pq.write_table(pa.table({"content": ["alpha", "beta"], "text_len": [5, 4]}), path)
    assert _read(corpus.data_spec(path, text_field="content")) == ["alpha", "beta"]
    with pytest.raises(corpus.MissingFieldError, match=r"content.parquet: expected a 'text' column"):
        corpus.check_data(path)
    arrow = tmp_path / "content.arrow"
    table = pa.table({"content": ["gamma"]})
    with pa.OSFile(str(arrow), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    with pytest.raises(corpus.MissingFieldError, match=r"content.arrow: expected a 'text' column"):
        corpus.check_data(arrow)
    saved = tmp_path / "saved_dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"content": ["delta", "eps"]})}).save_to_disk(
        saved
    )
    assert _read(corpus.data_spec(saved, text_field="content")) == ["delta", "eps"]
    with pytest.raises(corpus.MissingFieldError, match=r"saved_dict: expected a 'text' column"):
        corpus.check_data(saved)


def test_bad_inputs_raise_errors_that_name_the_file(tmp_path, tokenizer):
    good = tmp_path / "good.jsonl"
    write_jsonl(good, corpus_docs("good", 3))
    with pytest.raises(corpus.NoMatchError, match=r"nothing\*\.jsonl: the glob matches no data file"):
        corpus.check_data(str(tmp_path / "nothing*.jsonl"))
    with pytest.raises(corpus.NoMatchError, match="missing.txt: no such file or folder"):
        corpus.check_data(tmp_path / "missing.txt")
    shards = tmp_path / "shards"
    shards.mkdir()
    write_jsonl(shards / "0.jsonl", corpus_docs("s", 4))
    (shards / "1.jsonl").write_bytes(b"")
    with pytest.warns(corpus.EmptyShardWarning, match=r"1.jsonl: empty, skipped"):
        files = corpus.check_data(shards)
    assert [f.path.name for f in files[0]] == ["0.jsonl"]
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.jsonl").write_bytes(b"")
    (empty / "b.txt").write_bytes(b"")
    with pytest.raises(corpus.EmptyDataError, match="every file is empty"):
        corpus.check_data(empty)
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\u00e9 ol\u00e9\n".encode("latin-1"))
    with pytest.raises(corpus.NotUTF8Error, match=r"latin.txt: not UTF-8"):
        corpus.check_data(latin)
    binary = tmp_path / "blob.jsonl"
    binary.write_bytes(b'{"text": "\xff\xfe"}\n')
    with pytest.raises(corpus.NotUTF8Error, match=r"blob.jsonl: not UTF-8"):
        corpus.check_data(binary)
    no_text = tmp_path / "no_text.parquet"
    pq.write_table(pa.table({"body": ["x"]}), no_text)
    with pytest.raises(corpus.MissingFieldError, match=r"no_text.parquet: expected a 'text' column.*body"):
        corpus.check_data(no_text)
    row = tmp_path / "row.jsonl"
    row.write_text('{"text": "fine"}\n{"txt": "oops"}\n', encoding="utf-8")
    with pytest.raises(corpus.MissingFieldError, match=r"row.jsonl:2: expected a string 'text' field"):
        corpus.check_data(row)
    for weights, found in (
        (["0.5", "x"], "'x'"),
        (["1", "-2"], "'-2'"),
        (["1", "0"], "'0'"),
        (["1"], "found 1"),
    ):
        with pytest.raises(corpus.MixtureError, match=found):
            corpus.data_spec([good, shards], weights=weights)
    for error in (
        corpus.NoMatchError,
        corpus.EmptyDataError,
        corpus.NotUTF8Error,
        corpus.MissingFieldError,
        corpus.ChatTemplateError,
        corpus.MixtureError,
    ):
        assert issubclass(error, ValueError)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--data", "{tmp}/none*.jsonl"], "none*.jsonl: the glob matches no data file"),
        (["--data", "{tmp}/latin.txt"], "latin.txt: not UTF-8"),
        (["--data", "{tmp}/no_text.parquet"], "no_text.parquet: expected a 'text' column"),
        (["--data", "{tmp}/good.jsonl", "{tmp}/good.jsonl", "--data-weights", "1", "x"], "--data-weights"),
        (["--data", "{tmp}/good.jsonl", "--data-weights", "1", "2"], "--data-weights: expected one weight"),
        (["--data", "{tmp}/empty"], "every file is empty"),
        (["--data", "{tmp}/chat.jsonl"], "chat.jsonl:1: a conversation (messages) but the tokenizer has no"),
    ],
)
def test_the_cli_says_bad_data_in_one_line_before_any_model_loads(tmp_path, capsys, args, message):
    (tmp_path / "latin.txt").write_bytes("caf\u00e9\n".encode("latin-1"))
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "no_text.parquet")
    write_jsonl(tmp_path / "good.jsonl", corpus_docs("good", 3))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.jsonl").write_bytes(b"")
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    # a model folder whose weights cannot load: the data must be refused before anything tries
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (model / name).write_bytes((DEMO / name).read_bytes())
    (model / "model.safetensors").write_bytes(b"not a safetensors file")
    argv = [a.format(tmp=tmp_path) for a in args]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = cli_main(["score", str(model), *argv, "--output", str(tmp_path / "s.json"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "s.json").exists()


def test_a_name_that_is_not_on_disk_is_never_sent_to_a_hub(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    asked = []
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: asked.append(a))
    with pytest.raises(corpus.NoMatchError, match="HuggingFaceFW/fineweb: no such file or folder"):
        corpus.check_data("HuggingFaceFW/fineweb")
    assert not asked and os.environ.get("HF_DATASETS_OFFLINE") in ("1", "true", "True", "ON")


def test_two_gloo_processes_build_once_and_see_the_windows_of_one(launch, launch_inputs, tmp_path, tokenizer):
    """The shared launch's two ranks (tests/launches.py) open the same 3 shards with one cache folder: one
    tokenises, the other waits and reuses its cache; their shares are the windows of one process."""
    ranks = [json.loads((launch.folder / f"rank{r}.json").read_text())["corpus"] for r in (0, 1)]
    assert sorted(r["reused"] for r in ranks) == [False, True]  # one tokenised, the other waited and reused
    single = open_windows(launch_inputs / "shards", tokenizer, seq_len=20, cache_dir=tmp_path / "single")
    assert [w for r in ranks for w in r["windows"]] == single.tensor().tolist()
    assert [i for r in ranks for i in r["indices"]] == list(range(len(single)))
    cache = launch.folder / "corpus_cache"
    assert len([p for p in cache.iterdir() if not p.name.startswith(".")]) == 1


def test_tokenising_shows_a_bar_over_the_input_bytes(tmp_path, tokenizer, capsys):
    write_jsonl(tmp_path / "d.jsonl", corpus_docs("bar", 50))
    open_windows(tmp_path / "d.jsonl", tokenizer, seq_len=16, cache_dir=tmp_path / "c", progress=True)
    err = capsys.readouterr().err
    assert "tokenising" in err and "B/s" in err
    open_windows(tmp_path / "d.jsonl", tokenizer, seq_len=16, cache_dir=tmp_path / "c2", progress=False)
    assert "tokenising" not in capsys.readouterr().err
