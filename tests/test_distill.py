"""Recovery training (gdnprune.distill): the loss against direct formulas, chunking, training, resume after
Ctrl-C, 2-process DDP against 1 process, the vocabulary checks and HF folders of other families."""

import json
import os
import signal
import sys
import time
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import DISTILL_SHAPE, HALF, pair, sliced, windows
from launch_runs import ddp_run
from tiny_models import build_model, make_config
from transformers import TrainerCallback

from gdnprune.distill import (
    LOG_NAME,
    PLOT_NAME,
    check_same_vocabulary,
    distill,
    distill_checkpoint,
    distillation_loss,
    kd_loss,
    plot_history,
)

# --------------------------------------------------------------------------------------------------
# the loss


@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_kd_loss_is_the_temperature_scaled_forward_kl(temperature):
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(3, 5, 11, generator=g), 3 * torch.randn(3, 5, 11, generator=g)
    p, q = torch.softmax(t / temperature, -1), torch.softmax(s / temperature, -1)
    direct = temperature**2 * (p * (p.log() - q.log())).sum(-1).mean()
    via_kl_div = temperature**2 * F.kl_div(q.log().flatten(0, 1), p.flatten(0, 1), reduction="batchmean")
    assert kd_loss(s, t, temperature=temperature).item() == pytest.approx(direct.item(), rel=1e-5)
    assert direct.item() == pytest.approx(via_kl_div.item(), rel=1e-5)
    assert kd_loss(t, t, temperature=temperature).item() == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk_size", [1, 5, None])
@pytest.mark.parametrize(
    "temperature, kd_w, lm_w", [(2.0, 0.7, 0.4), (1.0, 1.0, 0.0), (1.0, 0.3, 0.6), (1.5, 0.0, 1.0)]
)
def test_chunked_loss_and_gradients_equal_the_unchunked_formulas(bias, chunk_size, temperature, kd_w, lm_w):
    g = torch.Generator().manual_seed(1)
    n, hidden, vocab = 23, 8, 13
    head, t_head = torch.nn.Linear(hidden, vocab, bias=bias), torch.nn.Linear(6, vocab, bias=bias)
    h, ht = torch.randn(n, hidden, generator=g, requires_grad=True), torch.randn(n, 6, generator=g)
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[[3, 10, 22]] = -100

    loss = distillation_loss(
        h,
        ht,
        head,
        t_head,
        labels,
        temperature=temperature,
        kd_weight=kd_w,
        lm_weight=lm_w,
        chunk_size=chunk_size,
    )
    (0.5 * loss.loss).backward()  # a scaled loss, as the Trainer's under gradient accumulation
    got = [h.grad.clone(), head.weight.grad.clone()] + ([head.bias.grad.clone()] if bias else [])
    h.grad = None
    head.zero_grad()

    keep = labels != -100
    z, zt = head(h), t_head(ht).detach()
    kd = kd_loss(z[keep], zt[keep], temperature=temperature)
    lm = F.cross_entropy(z, labels, ignore_index=-100)
    (0.5 * (kd_w * kd + lm_w * lm)).backward()
    want = [h.grad, head.weight.grad] + ([head.bias.grad] if bias else [])
    assert loss.kd.item() == pytest.approx(kd.item(), rel=1e-5)
    assert loss.lm.item() == pytest.approx(lm.item(), rel=1e-5)
    assert loss.loss.item() == pytest.approx((kd_w * kd + lm_w * lm).item(), rel=1e-5)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert t_head.weight.grad is None
    with torch.no_grad():  # the no-grad path gives the same value
        assert distillation_loss(
            h,
            ht,
            head,
            t_head,
            labels,
            temperature=temperature,
            kd_weight=kd_w,
            lm_weight=lm_w,
            chunk_size=chunk_size,
        ).loss.item() == pytest.approx(loss.loss.item())


@pytest.mark.parametrize("model_type", ["qwen3_5_vl", "qwen3_next", "olmo_hybrid"])
def test_loss_from_hidden_states_equals_kd_of_the_models_logits(model_type):
    from gdnprune.distill import final_hidden as _final_hidden

    teacher, student = pair(model_type)
    ids = windows(2, 70)
    with torch.no_grad():
        direct = kd_loss(student(input_ids=ids).logits[:, :-1], teacher(input_ids=ids).logits[:, :-1])
        labels = F.pad(ids[:, 1:], (0, 1), value=-100)
        got = distillation_loss(
            _final_hidden(student, ids),
            _final_hidden(teacher, ids),
            student.get_output_embeddings(),
            teacher.get_output_embeddings(),
            labels,
            chunk_size=32,
        )
    assert direct.item() > 1e-3
    assert got.loss.item() == pytest.approx(direct.item(), rel=1e-5)


def test_lm_only_loss_needs_no_teacher():
    g = torch.Generator().manual_seed(2)
    head, h = torch.nn.Linear(6, 9), torch.randn(2, 7, 6, generator=g, requires_grad=True)
    labels = torch.randint(0, 9, (2, 7), generator=g)
    got = distillation_loss(h, None, head, None, labels, kd_weight=0, lm_weight=1, chunk_size=4)
    want = F.cross_entropy(head(h).flatten(0, 1), labels.flatten())
    assert got.loss.item() == pytest.approx(want.item(), rel=1e-6) and torch.isnan(got.kd)
    (grad,) = torch.autograd.grad(got.loss, h)
    torch.testing.assert_close(grad, torch.autograd.grad(want, h)[0])
    with pytest.raises(ValueError, match="teacher hidden states"):
        distillation_loss(h, None, head, None, labels, kd_weight=1)


def test_loss_rejects_bad_weights_and_shapes():
    head = torch.nn.Linear(4, 7)
    h, labels = torch.randn(5, 4), torch.zeros(5, dtype=torch.long)
    with pytest.raises(ValueError, match="kd_weight and lm_weight"):
        distillation_loss(h, h, head, head, labels, kd_weight=0, lm_weight=0)
    with pytest.raises(ValueError, match="temperature"):
        distillation_loss(h, h, head, head, labels, temperature=0)
    with pytest.raises(ValueError, match="as many positions"):
        distillation_loss(h, h[:3], head, head, labels)


# --------------------------------------------------------------------------------------------------
# training


def test_a_few_steps_decrease_the_kd_loss():
    teacher, student = pair()
    result = distill(
        student,
        teacher,
        windows(16),
        steps=6,
        batch_size=4,
        lr=3e-3,
        eval_data=windows(4, seed=9),
        eval_every=6,
        progress=False,
    )
    evals = [h for h in result["history"] if "eval_kd_loss" in h]
    assert [h["step"] for h in evals] == [0, 6]
    assert evals[-1]["eval_kd_loss"] < 0.8 * evals[0]["eval_kd_loss"]
    assert result["steps"] == 6 and result["tokens"] == 6 * 4 * 24 and not result["interrupted"]
    assert result["output_dir"] is None and result["eval"]["lm_loss"] == evals[-1]["eval_lm_loss"]
    assert evals[0]["eval_teacher_lm_loss"] == pytest.approx(evals[-1]["eval_teacher_lm_loss"])
    assert all("tokens_per_second" in h for h in result["history"] if "loss" in h)


def test_a_bf16_teacher_and_mixed_precision():
    teacher, student = pair()
    data, held_out = windows(8), windows(4, seed=3)
    ref = distill(sliced(teacher), teacher, data, steps=2, batch_size=4, eval_data=held_out, progress=False)
    got = distill(
        student,
        teacher.to(torch.bfloat16),
        data,
        steps=2,
        batch_size=4,
        eval_data=held_out,
        mixed_precision="bf16",
        progress=False,
    )
    assert got["eval"]["kd_loss"] == pytest.approx(ref["eval"]["kd_loss"], rel=0.05)
    assert next(student.parameters()).dtype == torch.float32


def test_gradient_checkpointing_gives_the_same_run():
    teacher, _ = pair()
    runs = [
        distill(
            sliced(teacher).train(),
            teacher,
            windows(8),
            steps=2,
            batch_size=4,
            lr=3e-3,
            lm_weight=0.5,
            log_every=1,
            gradient_checkpointing=checkpointing,
            progress=False,
        )
        for checkpointing in (False, True)
    ]
    losses = [[h["loss"] for h in r["history"] if "loss" in h] for r in runs]
    assert losses[1] == pytest.approx(losses[0], rel=1e-5) and len(losses[0]) == 2
    assert runs[1]["trainer"].model.is_gradient_checkpointing


class _CtrlCAt(TrainerCallback):
    def __init__(self, step, signum=signal.SIGINT):
        self.step, self.signum = step, signum

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.kill(os.getpid(), self.signum)


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_ctrl_c_saves_and_resume_matches_an_uninterrupted_run(tmp_path):
    teacher, _ = pair()
    data, held_out = windows(12), windows(4, seed=5)
    options = dict(
        steps=7,
        batch_size=4,
        lr=3e-3,
        lm_weight=0.5,
        eval_data=held_out,
        eval_every=7,
        save_every=2,
        log_every=1,
        progress=False,
    )

    straight = sliced(teacher)
    full = distill(straight, teacher, data, tmp_path / "straight", **options)

    handler = signal.getsignal(signal.SIGINT)
    first = distill(sliced(teacher), teacher, data, tmp_path / "run", callbacks=[_CtrlCAt(4)], **options)
    assert (
        first["interrupted"] and first["signal"] == "SIGINT" and first["steps"] == 4
    )  # mid-epoch: 3 per epoch
    assert signal.getsignal(signal.SIGINT) is handler
    assert first["checkpoint"].endswith("checkpoint-4")
    assert json.loads((tmp_path / "run" / LOG_NAME).read_text())["status"] == "interrupted"
    assert not (tmp_path / "run" / "model.safetensors").exists()  # no final model after an interrupt

    with pytest.raises(ValueError, match="resume"):
        distill(sliced(teacher), teacher, data, tmp_path / "run", **{**options, "lr": 1e-3}, resume=True)
    with pytest.raises(ValueError, match="not empty"):
        distill(sliced(teacher), teacher, data, tmp_path / "run", **options)

    resumed_model = sliced(teacher)
    resumed = distill(resumed_model, teacher, data, tmp_path / "run", resume=True, **options)
    assert resumed["resumed_from"].endswith("checkpoint-4") and resumed["steps"] == 7
    losses = lambda r: [(h["step"], h["loss"]) for h in r["history"] if "loss" in h]  # noqa: E731
    assert [s for s, _ in losses(resumed)] == list(range(1, 8))
    for (_, a), (_, b) in zip(losses(full), losses(resumed)):
        assert a == pytest.approx(b, rel=1e-4)
    assert resumed["eval"]["loss"] == pytest.approx(full["eval"]["loss"], rel=1e-4)
    want = _weights(straight)
    for name, value in _weights(resumed_model).items():
        torch.testing.assert_close(value, want[name], rtol=1e-4, atol=1e-5)
    log = json.loads((tmp_path / "run" / LOG_NAME).read_text())
    assert log["status"] == "finished" and log["config"]["steps"] == 7
    assert (tmp_path / "run" / PLOT_NAME).read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "run" / "model.safetensors").is_file()


def test_resume_of_a_model_with_tied_embeddings_warns_of_nothing(tmp_path, caplog):
    config = make_config("qwen3_5", DISTILL_SHAPE)
    config.tie_word_embeddings = True
    teacher = build_model("qwen3_5", DISTILL_SHAPE, config=config)
    options = dict(steps=3, batch_size=4, lr=3e-3, save_every=1, log_every=1, progress=False)
    first = distill(
        sliced(teacher), teacher, windows(8), tmp_path / "run", callbacks=[_CtrlCAt(1)], **options
    )
    assert first["interrupted"]
    student = sliced(teacher)
    assert student.lm_head.weight is student.model.embed_tokens.weight
    with caplog.at_level("WARNING"):
        resumed = distill(student, teacher, windows(8), tmp_path / "run", resume=True, **options)
    assert resumed["steps"] == 3 and not [r for r in caplog.records if "missing keys" in r.getMessage()]
    assert student.lm_head.weight is student.model.embed_tokens.weight


class _CtrlCTwice(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 2:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)  # within a second: the same Ctrl-C (torchrun forwards a copy)
            time.sleep(1.5)
            os.kill(os.getpid(), signal.SIGINT)  # a second Ctrl-C: stop at once


def test_sigterm_stops_like_ctrl_c():
    teacher, student = pair()
    handler = signal.getsignal(signal.SIGTERM)
    result = distill(
        student,
        teacher,
        windows(8),
        steps=5,
        batch_size=4,
        callbacks=[_CtrlCAt(1, signal.SIGTERM)],
        progress=False,
    )
    assert (result["interrupted"], result["signal"], result["steps"]) == (True, "SIGTERM", 1)
    assert signal.getsignal(signal.SIGTERM) is handler


def test_a_second_ctrl_c_interrupts_at_once(tmp_path):
    teacher, student = pair()
    # Ctrl-C as in a terminal: a runner started in the background with SIGINT ignored (a non-interactive
    # shell's `&`) would otherwise make the library, rightly, keep ignoring it
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        handler = signal.getsignal(signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            distill(
                student,
                teacher,
                windows(8),
                tmp_path / "run",
                steps=5,
                batch_size=4,
                save_every=10,
                callbacks=[_CtrlCTwice()],
                progress=False,
            )
        assert signal.getsignal(signal.SIGINT) is handler
    finally:
        signal.signal(signal.SIGINT, outer)
    assert not list(tmp_path.glob("run/checkpoint-*"))


def test_two_processes_give_the_loss_curve_of_one(launch, tmp_path):
    assert (launch.folder / "distill_two.pt").exists(), launch.stderr[-3000:]
    ddp_run(tmp_path / "one.pt")
    one, two = torch.load(tmp_path / "one.pt"), torch.load(launch.folder / "distill_two.pt")
    assert (two["config"]["processes"], two["config"]["micro_batch_size"]) == (2, 2)
    assert (one["config"]["processes"], one["config"]["micro_batch_size"]) == (1, 4)
    assert len(one["losses"]) == 3 and one["losses"][-1] < one["losses"][0]
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-4)
    assert two["eval"]["loss"] == pytest.approx(one["eval"]["loss"], rel=1e-4)
    for name, value in one["weights"].items():
        torch.testing.assert_close(two["weights"][name], value, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------------------------------
# vocabulary checks, HF folders


def test_teacher_and_student_must_share_the_vocabulary():
    from gdnprune.demo_data import build_byte_tokenizer

    teacher, student = pair()
    config = make_config("qwen3_5", HALF)
    config.vocab_size = 100
    other = build_model("qwen3_5", HALF, config=config)
    with pytest.raises(ValueError, match="share a vocabulary.*128 outputs, found 100"):
        distill(other, teacher, windows(8, vocab=100), steps=1, batch_size=4, progress=False)
    tokenizer, extended = build_byte_tokenizer(), build_byte_tokenizer()
    extended.add_tokens(["<extra>"])
    check_same_vocabulary(student, teacher, tokenizer, build_byte_tokenizer())
    with pytest.raises(ValueError, match="share a tokenizer.*257 and 258 tokens"):
        check_same_vocabulary(student, teacher, tokenizer, extended)


def _byte_model(model_type, shape, seed=0):
    config = make_config(model_type, shape)
    text = config.text_config if hasattr(config, "text_config") else config
    text.vocab_size, text.max_position_embeddings = 257, 80
    return build_model(model_type, shape, seed=seed, config=config)


@pytest.mark.parametrize("model_type", ["qwen3_next", "olmo_hybrid"])
def test_distill_checkpoint_writes_a_loadable_folder(tmp_path, model_type):
    import transformers

    from gdnprune.demo_data import build_byte_tokenizer, train_text

    teacher = _byte_model(model_type, DISTILL_SHAPE)
    tokenizer = build_byte_tokenizer()
    for name, model in (("teacher", teacher), ("student", sliced(teacher))):
        model.save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    (tmp_path / "student" / "chat_template.jinja").write_text("{{ messages }}")
    (tmp_path / "train.txt").write_text(train_text()[:4000])
    (tmp_path / "eval.txt").write_text(train_text()[-2000:])

    result = distill_checkpoint(
        tmp_path / "student",
        tmp_path / "teacher",
        tmp_path / "train.txt",
        tmp_path / "out",
        eval_data=tmp_path / "eval.txt",
        steps=2,
        batch_size=4,
        lr=1e-3,
        progress=False,
    )
    out = tmp_path / "out"
    assert result["steps"] == 2 and result["eval"]["kd_loss"] > 0
    assert result["config"]["seq_len"] == 80  # the model's max_position_embeddings
    reloaded = type(teacher).from_pretrained(out)
    assert reloaded.config.linear_num_value_heads == HALF.num_value_heads
    assert transformers.AutoTokenizer.from_pretrained(out).get_vocab() == tokenizer.get_vocab()
    assert (out / "chat_template.jinja").read_text() == "{{ messages }}"
    assert (out / PLOT_NAME).is_file() and json.loads((out / LOG_NAME).read_text())["status"] == "finished"

    with pytest.raises(ValueError, match="outside the student folder"):
        distill_checkpoint(
            tmp_path / "student",
            tmp_path / "teacher",
            tmp_path / "train.txt",
            tmp_path / "student" / "out",
            seq_len=80,
            steps=1,
            batch_size=4,
            progress=False,
        )
    extended = build_byte_tokenizer()
    extended.add_tokens(["<extra>"])
    extended.save_pretrained(tmp_path / "teacher")
    with pytest.raises(ValueError, match="share a tokenizer"):
        distill_checkpoint(
            tmp_path / "student",
            tmp_path / "teacher",
            tmp_path / "train.txt",
            tmp_path / "out2",
            seq_len=80,
            steps=1,
            batch_size=4,
            progress=False,
        )


def test_options_are_checked(tmp_path):
    teacher, student = pair()
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    with pytest.raises(ValueError, match="refusing to replace"):
        distill(student, teacher, windows(8), tmp_path / "notes", steps=1, batch_size=4, overwrite=True)
    assert (tmp_path / "notes" / "todo.txt").read_text() == "mine"
    data = windows(8)
    for bad, match in [
        (dict(steps=1, tokens=10), "exactly one"),
        (dict(steps=0), "at least one step"),
        (dict(steps=1, batch_size=16), "at least batch_size"),
        (dict(steps=1, batch_size=4, micro_batch_size=3), "multiple"),
    ]:
        with pytest.raises(ValueError, match=match):
            distill(student, teacher, data, **{"batch_size": 4, **bad}, progress=False)
    with pytest.raises(ValueError, match="token windows"):
        distill(student, teacher, data.float(), steps=1, batch_size=4, progress=False)
    assert distill(student, teacher, data, tokens=200, batch_size=4, progress=False)["steps"] == 3  # 200 / 96


def test_plot_without_matplotlib_warns_and_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert plot_history([{"step": 1, "loss": 1.0}], tmp_path / "x.png") is False
    assert any("pip install matplotlib" in str(w.message) for w in caught)
    assert not (tmp_path / "x.png").exists()
