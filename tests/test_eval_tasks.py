"""The built-in tasks: recall probes (deterministic, exact answer spans, an oracle scores 100% and a guesser
chance) and nats per byte (equal to a plain loop over windows with the model's own forward)."""

from __future__ import annotations

import filecmp
import importlib.util
import json
import math
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import CHILD_GC, child_env

from gdnprune import demo_data
from gdnprune.evaluation.tasks import shipped_task_folder, text_windows, write_task_folder
from gdnprune.quality import probes

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.api.model import LM  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_environment_report")

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("kind", ["passkey", "mqar"])
@pytest.mark.parametrize("length", [128, 256, 1000, 4096])
def test_probes_are_deterministic_exact_in_length_and_answers_are_spans_of_the_text(kind, length):
    a, b = probes.probe(kind, 3, length, 7), probes.probe(kind, 3, length, 7)
    assert a == b
    assert probes.probe(kind, 4, length, 7) != a and probes.probe(kind, 3, length, 8) != a
    assert len(a.text) == length and a.text.isascii()
    expected = 1 if kind == "passkey" else probes.MQAR_QUERIES
    assert len(a.queries) == expected
    for q in a.queries:
        assert a.text[len(q.context) : len(q.context) + len(q.answer)] == q.answer
    if kind == "passkey":  # the answer is the needle's number, and the text ends with it
        key = re.search(r"The pass key is (\d+)\.", a.text).group(1)
        assert a.queries[0].answer == " " + key and a.text.endswith(key)
    else:  # each answer is the value written with its key in the first line
        pairs = dict(p.split(":") for p in a.text.split("\n", 1)[0].split())
        assert len(pairs) == probes.mqar_pairs(length)
        for q in a.queries:
            assert pairs[q.context[-3:-1]] == q.answer


@pytest.mark.parametrize("length", [256, 1000, 200_000])
def test_the_ruler_probes_ask_what_their_text_says(length):
    """multikey: the asked key's number is the answer and the other needles are distractors; vartrack: the
    answer names the variables the chain of assignments gives the number, in the order they were assigned."""
    a = probes.probe("multikey", 2, length, 5)
    assert a == probes.multikey(2, length, 5) and len(a.text) == length and a.text.isascii()
    needles = dict(re.findall(r"The number of ([a-z]{5}) is (\d{5})\.", a.text))
    assert len(needles) == probes.MULTIKEY_NEEDLES
    asked = re.search(r"What is the number of ([a-z]{5})\?", a.text).group(1)
    assert a.queries[0].answer == " " + needles[asked] and a.text.endswith(needles[asked])
    v = probes.probe("vartrack", 2, length, 5)
    assert len(v.text) == length and v.text.isascii()
    value = re.search(r"Which variables are (\d{5})\?", v.text).group(1)
    holds = {re.search(rf"VAR ([A-Z]{{5}}) = {value}\.", v.text).group(1)}
    chain = [holds.copy().pop()]
    for a_, b_ in re.findall(r"VAR ([A-Z]{5}) = VAR ([A-Z]{5})\.", v.text):
        assert b_ in holds or a_ in holds  # every assignment continues the chain, in order
        holds |= {a_, b_}
        chain.append(a_)
    assert v.queries[0].answer == "".join(f" {n}" for n in chain) and len(chain) == probes.VARTRACK_HOPS + 1
    with pytest.raises(ValueError, match="at least 256 characters"):
        probes.probe("vartrack", 0, 200)


def test_the_needle_sits_at_its_depth_and_the_grid_tasks_read_it():
    """The needle starts at the sentence start at or before its depth's share of the filler (at most one
    sentence earlier); the grid's documents are those passkeys."""
    length = 4096
    starts = []
    for depth in (0, 0.25, 0.5, 0.75, 1):
        text = probes.passkey(0, length, 3, depth=depth).text
        at = text.index("The pass key is")
        starts.append(at)
        assert at <= depth * length and (depth == 0 or at >= depth * (length - 160) - len(probes.FILLER))
    assert starts == sorted(starts) and starts[0] == 0
    assert probes.passkey(0, 512, 1).text == probes.probe("passkey", 0, 512, 1).text  # no depth: as before
    from gdnprune.evaluation.tasks import probe_docs

    docs = probe_docs("needle", 512, 0, 3, depth=50)
    assert [d["context"] + d["answer"] for d in docs] == [
        probes.passkey(0, 512, i, depth=0.5).text for i in range(3)
    ]


def test_answer_positions_in_the_token_stream_are_exact():
    """With the byte tokenizer, lm-eval's encoding puts the answer's tokens at the character offsets."""
    _, tokenizer = demo_data.load_demo_model()
    lm = HFLM(pretrained=demo_data.load_demo_model()[0], tokenizer=tokenizer, batch_size=1)
    for kind in ("passkey", "mqar"):
        probe = probes.probe(kind, 0, 256, 0)
        for q in probe.queries:
            context_ids, answer_ids = lm._encode_pair(q.context, q.answer)
            whole = list((q.context + q.answer).encode())
            assert context_ids + answer_ids == whole
            assert answer_ids == list(q.answer.encode())
            assert len(context_ids) == len(q.context)


class _Oracle(LM):
    """Reads the answer from the context (a perfect copier); or guesses digits (``guess=True``)."""

    def __init__(self, guess: bool = False):
        super().__init__()
        self.guess, self.rng = guess, random.Random(0)

    def _answer(self, context: str, continuation: str) -> str:
        if self.guess:
            return "".join(
                self.rng.choice("0123456789 ") if c == " " else self.rng.choice("0123456789")
                for c in continuation
            )
        passkey = re.search(r"The pass key is (\d+)\.", context)
        if passkey:
            return " " + passkey.group(1)
        pairs = dict(p.split(":") for p in context.split("\n", 1)[0].split())
        return pairs[context[-3:-1]]

    def loglikelihood(self, requests):
        out = []
        for request in requests:
            context, continuation = request.args
            out.append((0.0, self._answer(context, continuation) == continuation))
        return out

    def loglikelihood_rolling(self, requests):
        raise NotImplementedError

    def generate_until(self, requests):
        raise NotImplementedError


@pytest.fixture(scope="module")
def probe_tasks(tmp_path_factory):
    folder = write_task_folder(tmp_path_factory.mktemp("tasks"), context_lengths=[256, 1024])
    return TaskManager(include_path=str(folder.path), include_defaults=False)


def _accuracy(lm: LM, manager, tasks: list[str]) -> dict[str, float]:
    out = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager, log_samples=False)
    return {t: out["results"][t]["acc,none"] for t in tasks}


def test_a_perfect_copier_gets_every_probe_right(probe_tasks):
    assert _accuracy(_Oracle(), probe_tasks, ["passkey_256", "passkey_1024", "mqar_256", "mqar_1024"]) == {
        "passkey_256": 1.0,
        "passkey_1024": 1.0,
        "mqar_256": 1.0,
        "mqar_1024": 1.0,
    }


def test_a_guesser_scores_chance(probe_tasks):
    """Chance: 10^-5 for a passkey (answer: a space and 5 digits), 1/100 for an MQAR value (2 digits)."""
    acc = _accuracy(_Oracle(guess=True), probe_tasks, ["passkey_1024", "mqar_1024"])
    assert acc["passkey_1024"] == 0.0
    n = 12 * probes.MQAR_QUERIES  # documents of mqar_1024
    # binomial(n, 1/100): P(more than 6 hits) < 1e-4
    assert acc["mqar_1024"] * n <= 6


def _plain_nats_per_byte(model, text: str, window: int) -> float:
    """A plain loop: 256-byte windows of ASCII text; every byte after the window's leading whitespace and
    first character is predicted by one forward of the window."""
    data = text.encode()
    nats, count = 0.0, 0
    for start in range(0, len(data) - window + 1, window):
        ids = list(data[start : start + window])
        first = next(i for i, b in enumerate(ids) if chr(b) not in " \t\n\r\x0b\x0c")
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].double(), dim=-1)
        for i in range(first + 1, len(ids)):
            nats -= float(logp[i - 1, ids[i]])
            count += 1
    return nats / count


def test_nats_per_byte_equals_a_plain_loop_over_windows(tmp_path):
    text = "".join(c for c in demo_data.validation_text()[: 256 * 7] if c.isascii())[: 256 * 6]
    text = text[:256] + "\n   " + text[260:]  # a window that starts with whitespace
    data = tmp_path / "text.txt"
    data.write_text(text, encoding="utf-8")
    folder = write_task_folder(tmp_path / "tasks", context_lengths=[256], data=data)
    manager = TaskManager(include_path=str(folder.path), include_defaults=False)
    model, tokenizer = demo_data.load_demo_model()
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=4)
    out = lm_eval.simple_evaluate(model=lm, tasks=["nats_per_byte"], task_manager=manager, log_samples=False)
    ours = out["results"]["nats_per_byte"]["nats_per_byte,none"]
    assert math.isclose(ours, _plain_nats_per_byte(model, text, 256), rel_tol=1e-5)
    # with windows that start with a visible character it is the demo's validation loss
    plain = "".join(text[i : i + 256] for i in range(0, len(text), 256) if not text[i].isspace())
    assert math.isclose(
        _plain_nats_per_byte(model, plain, 256),
        demo_data.validation_loss(model, text=plain, num_windows=None),
        rel_tol=1e-5,
    )


def test_text_windows_never_split_a_character_and_cover_the_text_in_order():
    text = "ab é€ 😀 x" * 40
    windows = text_windows(text, 16)
    joined = "".join(c + a for c, a in windows)
    assert text.startswith(joined) and len(text.encode()) - len(joined.encode()) < 16
    assert all(0 < len((c + a).encode()) <= 16 for c, a in windows)
    assert all(not c[-1].isspace() and c.strip() == c[-1] for c, _ in windows)


def test_the_shipped_task_folder_is_what_the_script_writes(tmp_path):
    folder = write_task_folder(tmp_path / "tasks")
    shipped = shipped_task_folder()
    names = sorted(p.name for p in folder.path.iterdir())
    assert names == sorted(p.name for p in shipped.iterdir() if p.name != "__pycache__")
    assert all(filecmp.cmp(folder.path / n, shipped / n, shallow=False) for n in names)


#: lm-eval alone, in another process: its model loader (``hf``) and evaluator on the folder given as its include
#: path, as ``lm_eval run --model hf --include_path FOLDER --tasks ...`` runs them (docs/eval.md), but for lm-eval's
#: own 26,651 task files, which its command line indexes first (10 s here) and this run never reads, and for the
#: environment report of its results (torch's: ``pip list`` and compiler versions, 1 s of CPU), which nothing reads
LM_EVAL_ALONE = """
import json, sys
import lm_eval.evaluator
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager

lm_eval.evaluator.add_env_info = lambda results: None  # torch's environment report (pip list...): nothing reads it

folder, model, tasks = sys.argv[1:4]
manager = TaskManager(include_path=folder, include_defaults=False)
done = simple_evaluate(model="hf", model_args=f"pretrained={model},dtype=float32", device="cpu",
                       tasks=tasks.split(","), limit=1, task_manager=manager)
print(json.dumps({task: metrics.get("acc,none") for task, metrics in done["results"].items()}))
"""


def test_lm_eval_alone_runs_the_shipped_folder():
    """lm-eval's model loader and evaluator with gdnprune's task folder as its include path, in another process,
    on one task of every kind (the longer lengths would exceed the demo model's 256 positions: lm-eval truncates
    the left of a context, so only the 256 tasks are run)."""
    tasks = "passkey_256,mqar_256,multikey_256,vartrack_256,needle_256_50"
    model, folder = str(demo_data.demo_model_path()), str(shipped_task_folder())
    out = subprocess.run(
        [sys.executable, "-c", CHILD_GC + LM_EVAL_ALONE, folder, model, tasks],
        capture_output=True,
        text=True,
        timeout=600,
        env=child_env(),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    accuracy = json.loads(out.stdout.strip().splitlines()[-1])
    assert sorted(accuracy) == sorted(tasks.split(","))
    assert all(0.0 <= value <= 1.0 for value in accuracy.values()), accuracy


# ---- the recall training mix of scripts/train_demo_model.py --------------------------------------------------


def _training_script():
    spec = importlib.util.spec_from_file_location(
        "train_demo_model", REPO / "scripts" / "train_demo_model.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_training_mix_marks_exactly_the_answer_characters_of_its_probes():
    script = _training_script()
    generator = torch.Generator().manual_seed(0)
    text = demo_data.text_to_ids(demo_data.train_text())
    batch = script.sample_batch(text, 6, 160, generator)
    mixed, answers = script.mix_recall(batch, 1.0, 0, 3, generator)  # every row a probe
    for row in range(6):
        index = 3 * 6 + row
        kind = "passkey" if index % 2 == 0 else "mqar"
        probe = probes.probe(kind, script.TRAIN_PROBE_SEED, 160, index)
        chars = bytes(mixed[row].tolist()).decode("ascii")
        assert chars == probe.text
        marked = "".join(c for c, m in zip(chars, answers[row].tolist(), strict=True) if m)
        # passkey: " 12345" at the very end; mqar: two digits after each asked "key:"
        if kind == "passkey":
            assert answers[row, -6:].all() and int(answers[row].sum()) == 6 and marked[0] == " "
        else:
            asked = re.findall(r"(?<=[a-z]{2}:)\d\d", chars[chars.rindex("\n") :])
            assert marked == "".join(asked) and len(asked) == probes.MQAR_QUERIES
        assert marked == "".join(q.answer for q in probe.queries)
    plain, none = script.mix_recall(batch, 0.0, 0, 3, generator)
    assert torch.equal(plain, batch) and not none.any()


def test_the_weighted_loss_is_the_plain_mean_at_weight_1_and_a_weighted_mean_otherwise():
    script = _training_script()
    torch.manual_seed(0)
    logits = torch.randn(2, 7, 11)
    batch = torch.randint(0, 11, (2, 7))
    answers = torch.rand(2, 7) < 0.4
    plain = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 11), batch[:, 1:].reshape(-1))
    assert script.weighted_loss(logits, batch, answers, 1.0)[0].item() == pytest.approx(
        plain.item(), rel=1e-6
    )
    total = weights = answer_total = 0.0
    answer_count = 0
    for r in range(2):
        for t in range(6):  # position t predicts token t + 1
            nll = -torch.log_softmax(logits[r, t], -1)[batch[r, t + 1]].item()
            w = 5.0 if answers[r, t + 1] else 1.0
            total, weights = total + w * nll, weights + w
            if answers[r, t + 1]:
                answer_total, answer_count = answer_total + nll, answer_count + 1
    loss, answer_loss = script.weighted_loss(logits, batch, answers, 5.0)
    assert loss.item() == pytest.approx(total / weights, rel=1e-5)
    assert answer_count > 0 and answer_loss == pytest.approx(answer_total / answer_count, rel=1e-5)


def _induction_model(script):
    import transformers

    tokenizer = demo_data.build_byte_tokenizer()
    config = script.model_config(
        len(tokenizer),
        tokenizer.eos_token_id,
        256,
        layer_types="GG",
        hidden_size=64,
        key_head_dim=16,
        value_head_dim=16,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(config)
    script.init_first_gdn_layer(model, 1)
    return model


def test_the_induction_init_keys_on_earlier_characters_and_writes_only_digits():
    script = _training_script()
    model = _induction_model(script)
    layer = model.get_decoder().layers[0]
    attn = layer.linear_attn
    text = "ab:42 cd:17 The sky is blue. ab:42"
    with torch.no_grad():
        x = layer.input_layernorm(model.get_input_embeddings()(demo_data.text_to_ids(text)))
        # the layer's own projection and causal conv, then silu, as its forward runs them
        mixed = attn.conv1d(attn.in_proj_qkv(x).T.unsqueeze(0))[0, :, : len(text)].T
        q, k = mixed[:, : attn.key_dim], mixed[:, attn.key_dim : 2 * attn.key_dim]
        beta = torch.sigmoid(attn.in_proj_b(x))
    taps = script.INDUCTION_TAPS
    for h in range(attn.key_dim // attn.head_k_dim):
        cols = slice(h * attn.head_k_dim, (h + 1) * attn.head_k_dim)
        back = max(taps[h])
        for t in range(back, len(text) - 1):
            # the query at t reads the characters the key one position later reads (what x[t + 1] followed)
            assert torch.allclose(q[t, cols], k[t + 1, cols], atol=1e-6)
        # a key never reads the current character: equal keys wherever the taps' characters are equal
        for s in range(back, len(text)):
            for t in range(back, len(text)):
                same = all(text[s - j] == text[t - j] for j in taps[h])
                assert torch.allclose(k[s, cols], k[t, cols], atol=1e-6) == same
    digits = torch.tensor([c.isdigit() for c in text])
    assert (beta[digits] > 0.9).all() and (beta[~digits] < 0.1).all()


def test_the_induction_hold_keeps_the_circuit_and_the_digits_embeddings_fixed(tmp_path):
    script = _training_script()
    before = _induction_model(script)
    out = tmp_path / "model"
    args = [
        "--hidden-size", "64", "--layer-types", "GG", "--key-head-dim", "16", "--value-head-dim", "16",
        "--recall-mix", "0.5", "--seq-len", "128", "--batch-size", "2", "--steps", "3", "--log-every", "3",
        "--eval-every", "0", "--threads", "1", "--induction-init", "--induction-hold", "3",
        "--out", str(out),
    ]  # fmt: skip
    assert script.main(args) == 0
    import transformers

    after = transformers.Qwen3_5ForCausalLM.from_pretrained(out, dtype=torch.float32)
    held = dict(zip(("conv", "qkv", "b", "A_log", "dt_bias"), script.circuit_parameters(before), strict=True))
    for name, p in zip(held, script.circuit_parameters(after), strict=True):
        assert torch.equal(p, held[name]), name
    digits = demo_data.text_to_ids("0123456789")
    e0, e1 = before.get_input_embeddings().weight, after.get_input_embeddings().weight
    # their gradient is held at zero, so only AdamW's decoupled weight decay moves them
    shrink = math.prod(1 - script.lr_at(step, script.parse_args(args)) * 0.1 for step in range(3))
    assert shrink < 1 and torch.allclose(e1[digits], e0[digits] * shrink, rtol=1e-6, atol=0)
    letters = demo_data.text_to_ids("abcdefghij")
    assert not torch.equal(e0[letters], e1[letters])  # the rest trains
