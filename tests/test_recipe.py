# python -m pytest tests/test_recipe.py -q
"""The released recipe's remaining choices and the conveniences: the EMA teacher (against a hand computation and a
model loaded with the EMA weights), --skip-first-tokens (against the loss restricted by hand), --data-select hard
(against the rule applied by hand). All of them together under torchrun, with Weights & Biases offline, interrupted
and resumed to the uninterrupted run's weights, EMA and metrics: tests/test_train.py."""

import json
from collections import deque

import pytest
import torch
from transformers import AutoModelForCausalLM

import opsd

STUDENT = [[1, 89, 87, 266, 203], [1, 307, 265], [1, 285, 15, 22, 35, 2, 203]]
TEACHER = [p + [300 + i] * (4 + 2 * i) for i, p in enumerate(STUDENT)]
COMPLETIONS = [[40, 41, 42, 43, 2], [50, 51], [60, 61, 62, 63, 64, 65, 66, 2]]


def lora_model(model_dir, seed=1):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(0)
    params = opsd.add_lora(model, r=8, alpha=16)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in opsd.lora_layers(model).values():
            m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * 0.1)
    return model, params


# -- EMA teacher ---------------------------------------------------------------------------------


def test_ema_recursion_by_hand():
    student = [torch.tensor([1.0, -2.0]), torch.tensor([[4.0]])]
    ema = opsd.ema_update(None, student, decay=0.75)  # after the first step: an exact copy, no decay
    assert [e.tolist() for e in ema] == [[1.0, -2.0], [[4.0]]] and ema[0] is not student[0]
    student[0].copy_(torch.tensor([3.0, 2.0]))
    student[1].fill_(0.0)
    ema = opsd.ema_update(ema, student, decay=0.75)  # 0.75 * old + 0.25 * new
    assert [e.tolist() for e in ema] == [[1.5, -1.0], [[3.0]]]
    ema = opsd.ema_update(ema, student, decay=0.75)
    assert [e.tolist() for e in ema] == [[1.875, -0.25], [[2.25]]]


def test_ema_teacher_is_the_model_with_the_ema_adapter_and_leaves_the_student_alone(tiny_model_dir, tmp_path):
    model, params = lora_model(tiny_model_dir, seed=1)
    other, other_params = lora_model(tiny_model_dir, seed=2)
    ema = [p.detach().clone() for p in other_params]
    opsd.save_adapter(other, tmp_path / "ema", "tiny")
    loaded, _ = lora_model(tiny_model_dir, seed=3)
    opsd.load_adapter(loaded, tmp_path / "ema")  # the oracle: a model that simply holds the EMA weights
    inputs, _ = opsd.build_batch(TEACHER, COMPLETIONS, 0, "cpu")
    with torch.no_grad():
        student = opsd.final_hidden(model, inputs)
    student_before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.full_like(p, 7.0)
    with torch.no_grad(), opsd.teacher_weights(model, params, "ema", ema):
        teacher = opsd.final_hidden(model, inputs)
    with torch.no_grad():
        torch.testing.assert_close(teacher, opsd.final_hidden(loaded, inputs), rtol=0, atol=1e-6)
        assert not torch.allclose(teacher, student, atol=1e-3)  # it is not the student
        with opsd.teacher_weights(model, params, "ema", None):  # before the first step: the student itself
            assert torch.equal(opsd.final_hidden(model, inputs), student)
    assert all(torch.equal(p, b) for p, b in zip(params, student_before))
    assert all(torch.equal(p.grad, torch.full_like(p, 7.0)) for p in params)
    with torch.no_grad():
        assert torch.equal(opsd.final_hidden(model, inputs), student)  # the student's weights are back


# -- skipping the first completion tokens ---------------------------------------------------------


def test_skip_first_tokens_is_the_loss_restricted_by_hand(tiny_model_dir):
    skip, kw = 2, dict(temperature=1.1, clip="none", tau=0.05)  # unclipped: every position counts with its own value
    model, params = lora_model(tiny_model_dir)
    loss, stats = opsd.backward_step(model, params, STUDENT, TEACHER, COMPLETIONS, pad_id=0, micro_batch_size=2,
                                     teacher="base", skip_first_tokens=skip, **kw)
    grads = [p.grad.clone() for p in params]
    # by hand: one sequence at a time, no padding, full logits from the model's own forward
    ref_model, ref_params = lora_model(tiny_model_dir)
    total, count = 0.0, 0
    for s, t, c in zip(STUDENT, TEACHER, COMPLETIONS):
        student_logits = ref_model(torch.tensor([s + c])).logits[0, len(s) - 1:-1]  # predicts each completion token
        with torch.no_grad(), opsd.lora_disabled(ref_model):
            teacher_logits = ref_model(torch.tensor([t + c])).logits[0, len(t) - 1:-1]
        log_s, log_t = opsd.log_probs(student_logits, teacher_logits, kw["temperature"])
        k = opsd.clipped_divergence(log_s, log_t, beta=0.0, clip=kw["clip"], tau=kw["tau"])  # (len(c),)
        total, count = total + k[skip:].sum(), count + len(c[skip:])
    (total / count).backward()
    assert count == 3 + 0 + 6
    assert loss == pytest.approx(float(total.detach() / count), rel=1e-5)
    for g, p in zip(grads, ref_params):
        torch.testing.assert_close(g, p.grad, atol=1e-6, rtol=1e-4)
    # the diagnostics still cover every position, first tokens included
    assert len(stats.kl) == len(stats.logprob) == sum(map(len, COMPLETIONS))
    # the first-token KL: each completion's first position, written out by hand from their lengths (5, 2, 8)
    assert list(map(len, COMPLETIONS)) == [5, 2, 8]
    firsts = [0, 5, 7]
    sums = opsd.diagnostic_sums(stats, [[0.0] * len(c) for c in COMPLETIONS], tau=0.05)
    assert sums["first_tokens"] == len(firsts) and sums["first_kl"] == pytest.approx(float(stats.kl[firsts].sum()))
    assert sums["tokens"] == len(stats.kl) and sums["kl"] == pytest.approx(float(stats.kl.sum()), rel=1e-6)
    for key in ("student_entropy", "teacher_entropy", "negative"):
        assert sums[key] == pytest.approx(float(getattr(stats, key).sum()), rel=1e-6), key
    assert sums["loss_tokens"] == 3 + 0 + 6  # the positions in the loss: lengths 5, 2, 8 less the 2 skipped
    unskipped, _ = opsd.backward_step(*lora_model(tiny_model_dir)[:2], STUDENT, TEACHER, COMPLETIONS, pad_id=0,
                                      micro_batch_size=2, teacher="base", **kw)
    assert abs(unskipped - loss) > 1e-4  # the skip changed something


def test_the_kl_window_averages_each_diagnostic_per_answer_token():
    """Two steps of per-step sums, by hand: a window of 10 tokens holds the newest step alone, one of 15 both. Each
    answer's first position is out of the loss (5 answers), so the negative terms' share is of 15 - 5 positions."""
    older = {"tokens": 5, "kl": 1.0, "above_tau": 1, "clipped_mass": 0.5, "first_kl": 0.4, "first_tokens": 2,
             "student_entropy": 4.0, "teacher_entropy": 6.0, "negative": 1, "loss_tokens": 3}
    newer = {"tokens": 10, "kl": 1.0, "above_tau": 4, "clipped_mass": 2.0, "first_kl": 0.9, "first_tokens": 3,
             "student_entropy": 5.0, "teacher_entropy": 3.0, "negative": 0, "loss_tokens": 7}
    both = opsd.kl_window_means(deque([older, newer]), 15)
    assert both == {"kl_mean": 2 / 15, "kl_frac_above_tau": 5 / 15, "kl_clipped_teacher_mass": 2.5 / 15,
                    "kl_first_token": 1.3 / 5, "entropy_student": 9 / 15, "entropy_teacher": 9 / 15,
                    "loss_frac_negative": 1 / 10, "kl_window_tokens": 15}
    window = deque([older, newer])
    assert opsd.kl_window_means(window, 10)["entropy_teacher"] == 0.3 and list(window) == [newer]


# -- data selection -------------------------------------------------------------------------------


def test_hard_selection_by_hand(tmp_path, capsys):
    rows = [("math", 10_000), ("amc", 100), ("olympiads", 500), ("amc", 300), ("aops", 900), ("amc", 50)]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"problem": f"p{i}", "solution": f"s{i}", "source": s,
                                        "generated_token_count": n}) + "\n" for i, (s, n) in enumerate(rows)))
    # without 'math': counts 100, 500, 300, 900, 50; sorted 50, 100, 300, 500, 900; index 5 // 2 = 2: 300
    assert opsd.load_rows(str(path), "train", "problem", "solution", "hard") == [("p2", "s2"), ("p3", "s3"), ("p4", "s4")]
    assert "data-select hard: 6 rows -> 3 (source != 'math', generated_token_count >= 300)" in capsys.readouterr().out
    assert len(opsd.load_rows(str(path), "train", "problem", "solution", "all")) == 6


def test_hard_selection_checks_every_row(tmp_path, capsys):
    good = {"problem": "p", "solution": "s", "source": "amc", "generated_token_count": 10}
    for bad, shown in [({"source": "amc"}, "'generated_token_count' is None, not a number"),
                       ({"generated_token_count": "12"}, "'source' is None, not a string"),
                       ({"source": None, "generated_token_count": 5}, "'source' is None, not a string"),
                       ({"source": "amc", "generated_token_count": True}, "'generated_token_count' is True, not a number")]:
        path = tmp_path / "d.jsonl"
        third = {**{k: v for k, v in good.items() if k not in ("source", "generated_token_count")}, **bad}
        path.write_text("".join(json.dumps(r) + "\n" for r in [good, good, third]))
        with pytest.raises(opsd.Refusal) as refused:
            opsd.load_rows(str(path), "train", "problem", "solution", "hard")
        assert str(refused.value) == f"--dataset {path}, row 3: {shown}: fix or drop the row."

