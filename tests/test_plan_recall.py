"""Recall in the plan: the recall windows (facts of the calibration text written twice, the second copies
weighted in the KL), their exact match, the default sensitivity measured on them, ``short`` without them,
and ``keep_recall`` checked on the whole cut model.

References: the windows' facts found again by brute force in the token stream; the exact match by a plain
loop over the model's greedy predictions; the whole cut model's exact match on the model sliced by the plan
(``slice_model``), not the cut modules swapped in place that the plan measures.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gdnprune import demo_data
from gdnprune.cli import main
from gdnprune.gated_delta_net import GDNPermutation, GDNShape
from gdnprune.io.loading import load_pretrained, slice_model
from gdnprune.model.forwards import KL_WEIGHT
from gdnprune.model.layouts import find_gdn_modules
from gdnprune.plan import plan_model
from gdnprune.plan.measure.recall import CHECK_SEED
from gdnprune.quality import probes
from gdnprune.quality.recall_windows import (
    PROBE_SEED,
    RECALL_MASK,
    RECALL_SHARE,
    exact_match,
    probe_windows,
    span_windows,
)
from gdnprune.scoring import GDN_ONLY, score_model

RECALL = Path(__file__).resolve().parent / "data" / "trained" / "recall"
TOKENIZER = demo_data.build_byte_tokenizer()


def _runs(mask: torch.Tensor) -> list[tuple[int, int]]:
    """[start, stop) of every run of True, by a plain loop."""
    out, start = [], None
    for t, v in enumerate(mask.tolist() + [False]):
        if v and start is None:
            start = t
        if not v and start is not None:
            out.append((start, t))
            start = None
    return out


@pytest.fixture(scope="module")
def calibration():
    return list(demo_data.byte_windows(demo_data.train_text(), 256, 8).split(4))


@pytest.fixture(scope="module")
def plan_windows(calibration):
    """The plans' windows: the first 2 of the calibration windows, one batch (a plan measures every candidate on
    each)."""
    return calibration[:1]


def test_span_windows_ask_again_for_spans_written_earlier_and_carry_their_share_of_the_kl(calibration):
    windows = span_windows(calibration, share=0.3, seed=4)
    again = span_windows(calibration, share=0.3, seed=4)
    asked = recall = plain = 0.0
    for batch, same, given in zip(windows, again, calibration, strict=True):
        ids, weight, mask = batch["input_ids"], batch[KL_WEIGHT], batch[RECALL_MASK]
        assert torch.equal(ids, same["input_ids"]) and torch.equal(weight, same[KL_WEIGHT])  # deterministic
        assert ids.shape == given.shape and weight.shape == ids.shape and mask.shape == ids.shape
        for row in range(ids.shape[0]):
            tokens = ids[row].tolist()
            for start, stop in _runs(mask[row]):
                asked += 1
                # the run predicts tokens start+1..stop (the value) after the key's last token (start): key
                # and value were written before, as one span
                span = tokens[start : stop + 1]
                assert any(tokens[i : i + len(span)] == span for i in range(0, start - len(span) + 1))
        recall += float(weight[mask].sum())
        plain += float(weight[~mask].sum())
        assert bool((weight[~mask] == 1).all())
    assert asked >= len(calibration) * 4
    assert recall / (recall + plain) == pytest.approx(0.3, rel=1e-9)


def test_probe_windows_are_probes_with_the_calibration_text_as_their_haystack(calibration):
    """Each window decoded, made a passkey or MQAR probe of its length with its text as the filler; the
    weighted positions predict exactly the answers' characters (the byte tokenizer: one token each)."""
    windows = probe_windows(calibration, TOKENIZER, share=0.5, seed=3)
    texts = [TOKENIZER.decode(row.tolist()) for batch in calibration for row in batch]
    assert len(windows) == len(texts)
    recall = plain = 0.0
    for k, (batch, text) in enumerate(zip(windows, texts, strict=True)):
        kind = ("passkey", "mqar")[k % 2]
        made = (probes.passkey if kind == "passkey" else probes.mqar)(3, len(text), k, haystack=text)
        ids = batch["input_ids"][0]
        assert TOKENIZER.decode(ids.tolist()) == made.text
        starts = {len(q.context.encode()) + i for q in made.queries for i in range(len(q.answer.encode()))}
        assert {t + 1 for t in torch.nonzero(batch[RECALL_MASK][0]).flatten().tolist()} == starts
        assert text[:40] in made.text  # the calibration text is the haystack
        recall += float(batch[KL_WEIGHT][batch[RECALL_MASK]].sum())
        plain += float(batch[KL_WEIGHT][~batch[RECALL_MASK]].sum())
    assert recall / (recall + plain) == pytest.approx(0.5, rel=1e-9)


def test_a_masked_batch_is_kept_as_it_is(calibration):
    ids = calibration[0]
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[0, -5:] = False
    out = span_windows([{"input_ids": ids, "attention_mask": mask}, calibration[1]])
    assert torch.equal(out[0]["input_ids"], ids) and not bool(out[0][RECALL_MASK].any())
    assert bool(out[1][RECALL_MASK].any())


@pytest.fixture(scope="module")
def recall_model():
    model = load_pretrained(RECALL, dtype=torch.float32).eval()
    model.config.use_cache = False
    return model


def test_exact_match_counts_the_answers_the_model_gets_right(recall_model, calibration):
    model = recall_model
    windows = probe_windows(calibration, TOKENIZER, haystack=False) + span_windows(calibration)
    hits = total = 0
    with torch.no_grad():
        for batch in windows:
            for row in range(batch["input_ids"].shape[0]):
                ids = batch["input_ids"][row]
                greedy = model(input_ids=ids[None]).logits[0].argmax(-1)
                for start, stop in _runs(batch[RECALL_MASK][row]):
                    total += 1
                    hits += all(int(greedy[t]) == int(ids[t + 1]) for t in range(start, stop))
    assert exact_match(model, windows) == (hits, total)
    assert 0 < hits < total  # the recall model answers some, not all


@pytest.fixture(scope="module")
def scores(recall_model, calibration):
    return score_model(recall_model, calibration, progress=False, seed=0, blocks=GDN_ONLY)


#: a small grid: 8 candidates per layer
GRID = dict(blocks=["gdn"], dim_step="1/2", axes=["key_heads", "key_dim"], progress=False)


def test_the_default_plan_measures_on_recall_windows_and_short_on_the_calibration_windows(
    recall_model, plan_windows, scores
):
    model, calibration = recall_model, plan_windows
    options = dict(budget_state=0.5, **GRID)
    short, short_report = plan_model(model, calibration, scores, sensitivity="short", **options)
    default, report = plan_model(model, calibration, scores, **options)
    assert short_report["windows"] == {"kind": "calibration", "recall_share": 0.0}
    assert report["windows"] == {"kind": "spans", "recall_share": RECALL_SHARE}
    # the default is short on span_windows(batches): the same measurements, the same plan
    windows = span_windows(calibration, seed=PROBE_SEED)
    direct, _ = plan_model(model, windows, scores, sensitivity="short", **options)
    assert default["layers"] == direct["layers"]
    assert default["predicted"]["summed_sensitivity"] == direct["predicted"]["summed_sensitivity"]
    assert short["predicted"]["summed_sensitivity"] != direct["predicted"]["summed_sensitivity"]


def test_keep_recall_is_measured_on_the_whole_cut_model_and_replans_when_missed(
    recall_model, plan_windows, scores
):
    model, calibration = recall_model, plan_windows
    plan, report = plan_model(
        model,
        calibration,
        scores,
        budget_state=0.4,
        sensitivity="short",
        keep_recall=1.0,
        tokenizer=TOKENIZER,
        **GRID,
    )
    rounds = report["recall"]["rounds"]
    # short: no share at first, then the default share, then half way from it to 1
    shares = [0.0, RECALL_SHARE, (1 + RECALL_SHARE) / 2]
    assert [r["share"] for r in rounds] == shares[: len(rounds)]
    assert report["recall"]["met"] == rounds[-1]["met"] and (len(rounds) == 3 or rounds[-1]["met"])
    # the last round's exact match is the sliced model's on the check probes (their own filler)
    permutations = {
        p: GDNPermutation.from_score_payload(scores["layers"][p], GDNShape.from_module(m))
        for p, m in find_gdn_modules(model)
    }
    cut = slice_model(model, plan["layers"], permutations).eval()
    cut.config.use_cache = False
    check = probe_windows(calibration, TOKENIZER, seed=CHECK_SEED, haystack=False)
    hits, asked = exact_match(cut, check)
    base_hits, base_asked = exact_match(model, check)
    assert rounds[-1]["asked"] == asked and rounds[-1]["exact_match"] == pytest.approx(hits / asked)
    assert rounds[-1]["kept"] == pytest.approx((hits / asked) / (base_hits / base_asked))
    assert plan["predicted"]["recall_kept"] == rounds[-1]["kept"]
    with pytest.raises(ValueError, match="without `evolve_generations`"):
        plan_model(model, calibration, scores, budget_state=0.5, keep_recall=0.9, evolve_generations=1)
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        plan_model(model, calibration, scores, budget_state=0.5, keep_recall=1.5)


def test_keep_recall_on_the_command_line_is_a_share(tmp_path, capsys):
    plan = ["plan", str(RECALL), "--budget-state", "0.5", "-o", str(tmp_path / "p.json"), "--scores", "s"]
    with pytest.raises(SystemExit) as exited:  # argparse's error: usage and one line, exit 2
        main([*plan, "--keep-recall", "2"])
    assert exited.value.code == 2
    assert (
        "argument --keep-recall: expected a share in (0, 1] such as 0.9, got '2'" in capsys.readouterr().err
    )


def test_prune_says_what_the_plan_was_measured_on_and_the_recall_it_kept(tmp_path, capsys):
    data = tmp_path / "text.txt"
    data.write_text(demo_data.train_text()[:20_000], encoding="utf-8")
    common = ["--data", str(data), "--budget-state", "0.5", "--num-samples", "4", "--plan-samples", "2"]
    common += ["--seq-len", "256", "--dim-step", "1/2", "--axes", "key_heads,key_dim"]
    code = main(["prune", str(RECALL), "-o", str(tmp_path / "out"), *common, "--keep-recall", "0.5"])
    assert code == 0
    out = capsys.readouterr().out
    assert "measured on recall windows: each calibration window followed by a recall probe" in out
    assert "recall kept: " in out and "--keep-recall 0.5" in out
    manifest = json.loads((tmp_path / "out" / "gdnprune.json").read_text())
    rounds = manifest["plan_report"]["recall"]["rounds"]
    assert manifest["plan_report"]["windows"]["kind"] == "probes" and rounds[0]["share"] == RECALL_SHARE
    # the default refits out_proj on the same recall windows (the least squares weighted as the plan's KL);
    # --compensate none cuts the same plan with out_proj as the plain cut's, nothing else different
    assert "out_proj refitted on the recall windows" in out
    assert manifest["compensation"]["method"] == "sequential"
    assert manifest["compensation_windows"] == "recall windows"
    none = ["prune", str(RECALL), "-o", str(tmp_path / "none"), *common, "--keep-recall", "0.5", "--quiet"]
    assert main([*none, "--compensate", "none"]) == 0
    plain = json.loads((tmp_path / "none" / "gdnprune.json").read_text())
    assert "compensation" not in plain and plain["plan"] == manifest["plan"]
    assert {k: v["target"] for k, v in plain["layers"].items()} == {
        k: v["target"] for k, v in manifest["layers"].items()
    }
    refit, cut = (load_pretrained(tmp_path / d).state_dict() for d in ("out", "none"))
    assert refit.keys() == cut.keys()
    differs = {k for k in refit if not torch.equal(refit[k], cut[k])}
    assert differs and all(k.endswith("out_proj.weight") for k in differs), differs
    # scores taken on the text alone: the default does not refit (on the text it would cost recall)
    scores = tmp_path / "text_scores.json"
    assert (
        main(["score", str(RECALL), "-o", str(scores), *common[:2], *common[4:6], *common[8:10], "-q"]) == 0
    )
    assert main([*none[:3], str(tmp_path / "text"), *none[4:], "--scores", str(scores)]) == 0
    assert "compensation" not in json.loads((tmp_path / "text" / "gdnprune.json").read_text())


def test_a_token_weight_in_scoring_counts_a_token_that_many_times():
    """Scores of windows A (weight 2), B (weight 0), C (weight 1) equal those of A, A, C unweighted: every
    statistic is a second moment summed over tokens (the loss tokens every token, so none is chosen by the
    window's index)."""
    from tiny_models import build_model

    model = build_model(
        "qwen3_5", GDNShape(num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=6)
    )
    a, b, c = torch.randint(0, 128, (3, 1, 16), generator=torch.Generator().manual_seed(6))
    weighted = [
        {"input_ids": a, KL_WEIGHT: torch.full((1, 16), 2.0)},
        {"input_ids": b, KL_WEIGHT: torch.zeros(1, 16)},
        {"input_ids": c, KL_WEIGHT: torch.ones(1, 16)},
    ]
    options = dict(progress=False, seed=0, loss_token_stride=1)
    ours, reference = score_model(model, weighted, **options), score_model(model, [a, a, c], **options)
    assert ours["layers"].keys() == reference["layers"].keys()
    for prefix, entry in reference["layers"].items():
        for key, value in entry.items():
            if key.endswith("_order_most_important_first"):
                assert ours["layers"][prefix][key] == value, (prefix, key)
            elif key.endswith("_scores"):
                torch.testing.assert_close(
                    torch.as_tensor(ours["layers"][prefix][key], dtype=torch.float64),
                    torch.as_tensor(value, dtype=torch.float64),
                    rtol=1e-6,  # a token times sqrt(2) in float32, squared
                    atol=1e-12,
                )
