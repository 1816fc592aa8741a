# python -m pytest tests/test_miniature.py -q
"""Reasoning in miniature (tests/miniature/miniature.py and its README.md). The task's split and the writers' traces
against hand-worked examples and counts; the starting models' acceptance figures recomputed independently; the
student's prompt token-identical between opsd.py --student-prompt eval --no-student-thinking and eval.py
--no-thinking; the statistics, GRPO's advantages and loss and the SFT loss against hand values and float64
oracles; the port-check fixture (tests/miniature/reference_step.json) recomputed through opsd.py's functions
and independently; a fixed seed reproducing opsd.py's run exactly; the committed records; and the script's own
machinery on a few steps: results.json holds what eval.py scored, and an interrupted run resumes to the same
results. (The gain itself: tests/test_quickstart.py.)"""

import contextlib
import io
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import as_a_user_would
import torch

import eval as evaluation
import miniature
import opsd

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = miniature.DATA / "reference_step.json"
# opsd.py's float32 step figures recomputed here against the fixture committed from another machine: other kernels
# (AVX512 or not, thread counts) moved them by up to 5e-8, absolute whichever clip (the float32 sums are at the KL's
# scale, 0.09: 8e-6 relative on the smallest loss, 0.004); 1e-6 is 20x that, and the clips' losses differ by > 1e-3
FLOAT32_ABS = 1e-6


@pytest.fixture(scope="module")
def task():
    return miniature.make_task()


def test_task_splits_are_disjoint_and_every_answer_is_the_sum(task):
    train, dev, heldout = task
    assert (len(train), len(dev), len(heldout)) == (12_000, 400, 400)
    names = [{r["problem"] for r in split} for split in (train, dev, heldout)]
    assert sum(map(len, names)) == 12_800 and len(set().union(*names)) == 12_800  # disjoint
    scored = names[1] | names[2]
    for r in train + dev + heldout:
        a, b = map(int, r["problem"].split("+"))
        assert 100 <= a <= 999 and 100 <= b <= 999 and int(r["answer"]) == a + b
    for r in train:  # no training problem is the operands-swapped twin of a scored one
        a, b = r["problem"].split("+")
        assert f"{b}+{a}" not in scored
        assert r["solution"] == f"{r['problem']}={r['answer']}" and r["no_solution"] == ""
        assert r["trace"].endswith(f"\\boxed{{{r['answer']}}}")
    wrong = [r["wrong_solution"] for r in train]  # another problem's reference with another answer, each used once
    assert sorted(wrong) == sorted(r["solution"] for r in train)
    assert all(w.split("=")[1] != r["answer"] for w, r in zip(wrong, train))
    # every shipped model was pre-trained on this very split
    for model_dir in miniature.SHIPPED_MODELS.values():
        info = json.loads((model_dir / miniature.TASK_FILE).read_text())
        assert info["train_digest"] == miniature.split_digest(train)
        assert (info["dev_digest"], info["heldout_digest"]) == (miniature.split_digest(dev),
                                                                miniature.split_digest(heldout))


def test_traces_against_hand_worked_examples():
    assert miniature.correct_trace(457, 385) == "7+5=12 5+8+1=14 4+3+1=8 \\boxed{842}"
    assert miniature.correct_trace(999, 999) == "9+9=18 9+9+1=19 9+9+1=19 \\boxed{1998}"
    assert miniature.correct_trace(100, 100) == "0+0=0 0+0=0 1+1=2 \\boxed{200}"
    always = random.Random(0)
    # the misconception, always on: the tens column (5+8 and a carry, 14: it carries again) loses its carry; the
    # hundreds column (4+3 and a carry, 8: it does not carry again) keeps it
    assert miniature.write_trace(457, 385, always, carry_drop=1.0) == "7+5=12 5+8=13 4+3+1=8 \\boxed{832}"
    assert miniature.write_trace(199, 801, always, carry_drop=1.0) == "9+1=10 9+0=9 1+8=9 \\boxed{990}"
    assert miniature.misconception_applies(457, 385) and not miniature.misconception_applies(123, 456)
    assert not miniature.misconception_applies(450, 380)  # carries into the hundreds, which do not carry again
    assert miniature.has_scratchpad("7+5=12 \\boxed{12}") and not miniature.has_scratchpad("\\boxed{842}")


def test_the_error_prone_writer_errs_at_its_rates():
    """Counts over many draws against the rates the protocol fixes: a slip in 10% of columns; the carry dropped in
    70% of the columns that carry again; no error at all without either."""
    rng = random.Random(1)
    slipped = columns = dropped = chances = 0
    for _ in range(6000):
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        got = miniature.write_trace(a, b, rng, slip=0.1).split(" ")[:3]
        for i, col in enumerate(got):  # the writer with slips only: carries as written, sums off by one
            x, y = a // 10 ** i % 10, b // 10 ** i % 10
            lhs, s = col.split("=")
            slipped += int(s) != sum(map(int, lhs.split("+")))
            columns += 1
        got = miniature.write_trace(a, b, rng, carry_drop=0.7).split(" ")[:3]
        carry = 0
        for i, col in enumerate(got):
            x, y = a // 10 ** i % 10, b // 10 ** i % 10
            if carry and x + y + 1 >= 10:
                chances += 1
                dropped += col == f"{x}+{y}={x + y}"
            s = int(col.split("=")[1])
            carry = s // 10
    assert abs(slipped / columns - 0.1) < 0.01 and abs(dropped / chances - 0.7) < 0.02, (slipped / columns,
                                                                                       dropped / chances)
    clean = random.Random(2)
    assert all(miniature.write_trace(a, b, clean) == miniature.correct_trace(a, b) for a in range(100, 1000, 37)
               for b in range(100, 1000, 41))
    for a in range(100, 1000, 7):  # self-consistent: the answer is what the written columns give
        b = 1099 - a
        text = miniature.writer_trace(a, b, clean)
        digits, carry = [], 0
        for col in text.split(" ")[:3]:
            s = int(col.split("=")[1])
            digits.append(s % 10)
            carry = s // 10
        assert evaluation.extract_boxed(text) == str(int(("1" if carry else "") + "".join(map(str, digits[::-1]))))


def test_pretraining_examples_are_the_scripts_own_prompts(task):
    from transformers import AutoTokenizer

    train = task[0]
    tok = AutoTokenizer.from_pretrained(miniature.SHIPPED_MODEL)
    rng = random.Random(0)
    r = train[0]
    a, b = miniature.operands(r["problem"])
    prompt, answer = miniature.pretrain_example(tok, r, "teacher", rng)
    assert prompt == opsd.render(tok, opsd.teacher_message(r["problem"], r["solution"]), thinking=True)
    assert tok.decode(answer) == r["trace"] + tok.eos_token
    prompt, _ = miniature.pretrain_example(tok, r, "teacher_empty", rng)
    assert prompt == opsd.render(tok, opsd.teacher_message(r["problem"], ""), thinking=True)
    assert miniature.pretrain_example(tok, r, "student", rng)[0] == evaluation.prompt_ids(tok, r["problem"], False)
    assert miniature.pretrain_example(tok, r, "transfer", rng)[0] == evaluation.prompt_ids(tok, r["problem"], True)
    # issue 25's teacher: the reference's style (the boxed answer alone) at the given share of teacher examples
    terse = [tok.decode(miniature.pretrain_example(tok, r, "teacher", rng, teacher_terse=0.3)[1]) for _ in range(2000)]
    share = sum(t == f"\\boxed{{{a + b}}}{tok.eos_token}" for t in terse) / len(terse)
    assert abs(share - 0.3) < 0.04 and all(t in (r["trace"] + tok.eos_token, f"\\boxed{{{a + b}}}{tok.eos_token}")
                                           for t in terse)
    # every digit is its own token
    assert tok.convert_ids_to_tokens(miniature.answer_ids(tok, "\\boxed{1234}"))[-6:-1] == ["1", "2", "3", "4", "}"]


def test_the_student_trains_in_the_prompt_eval_scores(task, tmp_path):
    """opsd.py --student-prompt eval --no-student-thinking, through its own data loading, gives the student prompt
    eval.py --no-thinking renders for the same problem text, token for token; the teacher keeps opsd.py's prompt
    with the reference. So the primary score is taken in the very prompt the student trains in."""
    from transformers import AutoTokenizer

    train = task[0][:20]
    miniature.write_jsonl(tmp_path / "train.jsonl", train)
    args = opsd.parse_args(["--model", str(miniature.SHIPPED_MODEL), "--dataset", str(tmp_path / "train.jsonl"),
                            *miniature.OPSD_FLAGS, *miniature.STUDENT_FLAGS])
    _, prompts = opsd.load_prompts(args)
    tok = AutoTokenizer.from_pretrained(miniature.SHIPPED_MODEL)
    for r, (student, teacher) in zip(train, prompts):
        assert student == evaluation.prompt_ids(tok, r["problem"], thinking=False) == \
               miniature.student_prompt(tok, r["problem"])
        assert tok.decode(student).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        assert f"{r['problem']}\n\n{opsd.INSTRUCTION}" in tok.decode(student)
        assert "Problem:" not in tok.decode(student)
        assert teacher == miniature.teacher_prompt(tok, r["problem"], r["solution"])
    assert len(prompts) == len(train)


def unbatched_greedy(model, tok, prompt, max_new_tokens=48):
    """One prompt at a time, no padding: the argmax token fed back through the model's KV cache."""
    ids, step, past = [], torch.tensor([list(prompt)]), None
    with torch.no_grad():
        for _ in range(max_new_tokens):
            out = model(input_ids=step, past_key_values=past, use_cache=True)
            nxt, past = int(out.logits[0, -1].argmax()), out.past_key_values
            if nxt == tok.eos_token_id:
                break
            ids.append(nxt)
            step = torch.tensor([[nxt]])
    return tok.decode(ids, skip_special_tokens=True)


def test_the_starting_models_were_accepted_by_the_fixed_rule(task):
    """Every shipped model's record: accepted by ACCEPT's rule, with the figures it was accepted on; the primary
    model's student and teacher greedy accuracy on 100 dev problems recomputed here one problem at a time, with an
    unbatched greedy loop (not the batched, left-padded one that made the record)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = task[1]
    for model_dir in miniature.SHIPPED_MODELS.values():
        info = json.loads((model_dir / miniature.TASK_FILE).read_text())
        assert info["accepted"] and miniature.accept(info["dev"], info["dev_answer_loss"])["accepted"]
        assert info["pretrain_steps"] == miniature.PRETRAIN["steps"] and info["teacher_terse"] == 0.0
    info = json.loads((miniature.SHIPPED_MODEL / miniature.TASK_FILE).read_text())
    tok = AutoTokenizer.from_pretrained(miniature.SHIPPED_MODEL)
    model = AutoModelForCausalLM.from_pretrained(miniature.SHIPPED_MODEL, dtype=torch.float32).eval()
    rows = dev[:100]
    student = [unbatched_greedy(model, tok, miniature.student_prompt(tok, r["problem"])) for r in rows]
    references = [f"{r['problem']}={r['answer']}" for r in rows]
    teacher = [unbatched_greedy(model, tok, miniature.teacher_prompt(tok, r["problem"], ref))
               for r, ref in zip(rows, references)]
    batched = miniature.generate(model, tok, [miniature.student_prompt(tok, r["problem"]) for r in rows])
    assert sum(a == b for a, b in zip(student, batched)) >= 98  # batching changes at most a near-tie or two
    student_acc = sum(evaluation.extract_boxed(t) == r["answer"] for t, r in zip(student, rows)) / len(rows)
    teacher_acc = sum(evaluation.extract_boxed(t) == r["answer"] for t, r in zip(teacher, rows)) / len(rows)
    assert abs(student_acc - info["dev"]["student_greedy"]) < 0.12  # 100 of the record's 400 problems
    assert teacher_acc >= 0.9 and student_acc < teacher_acc
    assert all(miniature.has_scratchpad(t) for t in student)  # the student reasons in its scratchpad


def test_the_drift_model_was_accepted_and_its_teacher_writes_the_reference_style(task):
    """The drift model's record: accepted by the same rule, pre-trained on the same split with DRIFT_TERSE; and
    recomputed here from its weights, independently of the sampled figures in the record: the probability that the
    first answer token is the box's (`\\`, the boxed answer alone) is about DRIFT_TERSE under the teacher shown the
    reference, about zero under the student's prompt, averaged over 100 dev problems."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    train, dev = task[0], task[1]
    info = json.loads((miniature.DRIFT_MODEL / miniature.TASK_FILE).read_text())
    assert info["accepted"] and miniature.accept(info["dev"], info["dev_answer_loss"])["accepted"]
    assert info["teacher_terse"] == miniature.DRIFT_TERSE and info["train_digest"] == miniature.split_digest(train)
    assert info["pretrain_steps"] == miniature.PRETRAIN["steps"]
    assert abs(info["dev"]["teacher_sampled_no_scratchpad"] - miniature.DRIFT_TERSE) < 0.08
    tok = AutoTokenizer.from_pretrained(miniature.DRIFT_MODEL)
    model = AutoModelForCausalLM.from_pretrained(miniature.DRIFT_MODEL, dtype=torch.float32).eval()
    box = tok.encode("\\boxed{1}", add_special_tokens=False)[0]
    assert tok.convert_ids_to_tokens(box) == "\\" and box not in tok.encode("7+5=12", add_special_tokens=False)

    def p_box(prompt):
        with torch.no_grad():
            return model(input_ids=torch.tensor([prompt])).logits[0, -1].double().softmax(-1)[box].item()

    rows = dev[:100]
    teacher = sum(p_box(miniature.teacher_prompt(tok, r["problem"], f"{r['problem']}={r['answer']}"))
                  for r in rows) / len(rows)
    student = sum(p_box(miniature.student_prompt(tok, r["problem"])) for r in rows) / len(rows)
    assert abs(teacher - miniature.DRIFT_TERSE) < 0.08 and student < 0.02


def test_the_committed_results_are_the_scorings_beside_them():
    """tests/miniature/results/results.json (the full run's table) against the record committed beside it:
    every held-out score, on every starting model, is the avg@2 of that run's own eval.py summary; every run trained
    all its steps (its metrics.jsonl); the best-tau rule's verdicts are the table's."""
    results_dir = miniature.RESULTS.parent
    results = json.loads(miniature.RESULTS.read_text())
    blocks = {"p1": results, **results["by_model"]}
    assert set(blocks) == {"p1", "p2", "p3"}
    for tag, block in blocks.items():
        for key, fmt in (("heldout_avg", "primary"), ("transfer_avg", "transfer")):
            def avg(name):
                summary = json.loads((results_dir / "runs" / f"{name}-eval-{fmt}" / "summary.json").read_text())
                return summary["metrics"]["split"]["avg@2"]
            assert block[key]["base"] == avg(f"{tag}-base")
            for arm, seeds in block["seeds"].items():
                assert block[key][arm] == [avg(miniature.run_name(tag, arm, s)) for s in seeds]
        for arm, seeds in block["seeds"].items():
            for s in seeds:
                run = results_dir / "runs" / miniature.run_name(tag, arm, s)
                steps = [r["step"] for r in miniature.read_metrics(run)]
                assert steps == list(range(1, results["steps"] + 1))
    assert len(results["seeds"]["token"]) == 5 and all(len(v) >= 3 for v in results["seeds"].values())
    for arm in ("token", "none"):  # the long runs: every step trained, a dev point every 25 steps to 300
        assert [p[0] for p in results["dev_curves"][f"{arm} (300 steps)"]] == list(range(0, 301, 25))
        assert len(miniature.read_metrics(results_dir / "runs" / f"p1-{arm}-s1-long300")) == 300
    # the best-tau rule applied here to the scores just checked: the highest mean over seeds 1-3, a tie to 0.05
    for clip in ("token", "entry"):
        scores = results["heldout_avg"]
        means = {tau: sum(scores[clip if tau == 0.05 else f"{clip}@{tau:g}"][:3]) / 3 for tau in (0.005, 0.05, 0.5)}
        top = max(means.values())
        want = 0.05 if means[0.05] == top else next(tau for tau, m in means.items() if m == top)
        assert miniature.best_tau(clip) == want, (clip, means)


def check_record(record_dir, tag):
    """A run's committed results.json against the record beside it: every held-out score is the avg@2 of that run's
    own eval.py summary; every share of answers without a scratchpad is recomputed from its committed samples with
    has_scratchpad; every run trained all its steps. Returns the results."""
    import gzip

    results = json.loads((record_dir / "results.json").read_text())

    def eval_dir(name, fmt):
        return record_dir / "runs" / f"{name}-eval-{fmt}"

    def avg(name, fmt):
        return json.loads((eval_dir(name, fmt) / "summary.json").read_text())["metrics"]["split"]["avg@2"]

    def no_scratchpad(name):
        with gzip.open(eval_dir(name, "primary") / "samples.jsonl.gz", "rt") as f:
            samples = [json.loads(line) for line in f if line.strip()]
        assert len(samples) == results["problems"] * results["n"]
        return sum(not miniature.has_scratchpad(s["completion"]) for s in samples) / len(samples)

    assert results["model"] == tag
    for key, fmt in (("heldout_avg", "primary"), ("transfer_avg", "transfer")):
        assert results[key]["base"] == avg(f"{tag}-base", fmt)
    assert results["no_scratchpad"]["base"] == pytest.approx(no_scratchpad(f"{tag}-base"), abs=1e-12)
    for arm, seeds in results["seeds"].items():
        names = [miniature.run_name(tag, arm, s) for s in seeds]
        assert results["heldout_avg"][arm] == [avg(n, "primary") for n in names]
        assert results["transfer_avg"][arm] == [avg(n, "transfer") for n in names]
        assert results["no_scratchpad"][arm] == pytest.approx([no_scratchpad(n) for n in names], abs=1e-12)
        for name in names:
            steps = [r["step"] for r in miniature.read_metrics(record_dir / "runs" / name)]
            assert steps == list(range(1, results["steps"] + 1))
    return results


def test_the_committed_drift_results_are_the_scorings_beside_them():
    """tests/miniature/drift/results.json (the style-drift arms) against the record beside it (check_record);
    the @best arms ran at the best-tau rule's verdict on the reasoning miniature's results; the dev curves and the
    step-1 profile are the files'. And the two arms added after those results, each in its own record: the token
    clip with the first position left out, on the drift model and on the primary model."""
    drift_dir = miniature.DATA / "drift"
    results = check_record(drift_dir, "pd")
    assert results["drift"] and set(results["seeds"]) == set(miniature.DRIFT_ARMS)
    assert all(len(seeds) >= 3 for seeds in results["seeds"].values())
    assert results["best_tau"] == {clip: miniature.best_tau(clip) for clip in ("token", "entry")}
    if results["best_tau"]["token"] == 0.05:  # then drift-token@best is drift-token again: seed for seed the same
        for key in ("heldout_avg", "transfer_avg", "no_scratchpad"):
            assert results[key]["drift-token@best"] == results[key]["drift-token"]
    for arm in miniature.DRIFT_ARMS:  # seed 1 of every arm: a dev point every 25 steps
        assert [p[0] for p in results["dev_curves"][arm]] == list(range(0, results["steps"] + 1, 25))
    assert results["step1_kl"] == json.loads((drift_dir / "step1_kl.json").read_text())
    for tag, arm in (("pd", "drift-token-skip1"), ("p1", "token-skip1")):
        added = check_record(drift_dir / f"added-{tag}", tag)
        assert added["seeds"] == {arm: [1, 2, 3]} and added["steps"] == results["steps"]


def test_statistics_against_hand_computed_values():
    # values 0.20, 0.30, 0.25: mean 0.25, sample std 0.05, standard error 0.05 / sqrt(3) = 0.0288675;
    # Student t (2 degrees of freedom, 97.5%) 4.303 -> half-width 0.124217
    s = miniature.summarize([0.20, 0.30, 0.25], base=0.10, base_stderr=0.01)
    assert s["mean"] == pytest.approx(0.25) and s["ci95"] == pytest.approx(0.124217, abs=1e-6)
    assert s["vs_base"] == pytest.approx(0.15)
    assert s["vs_base_ci95"] == pytest.approx((0.124217 ** 2 + 0.0196 ** 2) ** 0.5, abs=1e-6)
    one = miniature.summarize([0.4], base=0.1, base_stderr=0.01)
    assert one["ci95"] is None and one["vs_base_ci95"] is None
    # paired over the common seeds 1 and 3 only: differences 0.1 and 0.3, mean 0.2, std 0.141421, se 0.1,
    # t(1) 12.706 -> half-width 1.2706
    d = miniature.paired([0.5, 0.6, 0.7], [0.4, 0.4], [1, 2, 3], [1, 3])
    assert d["seeds"] == [1, 3] and d["differences"] == pytest.approx([0.1, 0.3])
    assert d["mean"] == pytest.approx(0.2) and d["ci95"] == pytest.approx(1.2706, abs=1e-4)


def test_token_efficiency_interpolates_between_checkpoints():
    # a reaches 0.6 at the second point (1000 tokens); b's final 0.6 is the target, first reached halfway between
    # its 2000- and 4000-token checkpoints (0.4 -> 0.8): 3000 tokens, ratio 3
    curves = {"a": [[0, 0, 0.0, 0.2, 0], [25, 1000, 10.0, 0.6, 0], [50, 2000, 20.0, 0.9, 0]],
              "b": [[0, 0, 0.0, 0.2, 0], [25, 2000, 5.0, 0.4, 0], [50, 4000, 10.0, 0.8, 0], [75, 6000, 15.0, 0.6, 0]]}
    e = miniature.token_efficiency(curves, "a", "b")
    assert e["target_dev_avg"] == 0.6 and e["tokens"] == pytest.approx([1000, 3000])
    assert e["token_ratio"] == pytest.approx(3.0) and e["seconds"] == pytest.approx([10.0, 7.5])


def test_token_efficiency_reads_curves_with_answer_lengths():
    # the drift curves carry a sixth figure (mean answer tokens): the interpolation must not depend on it
    five = {"a": [[0, 0, 0.0, 0.2, 0], [25, 1000, 10.0, 0.6, 0]], "b": [[0, 0, 0.0, 0.2, 0], [25, 3000, 9.0, 0.6, 0]]}
    six = {k: [p + [28.0] for p in v] for k, v in five.items()}
    assert miniature.token_efficiency(six, "a", "b") == miniature.token_efficiency(five, "a", "b")
    assert miniature.token_efficiency(six, "a", "b")["token_ratio"] == pytest.approx(3.0)


def test_the_best_tau_rule_on_hand_made_sweeps(tmp_path):
    def sweep(token, token_small, token_large):  # held-out scores of seeds 1-5 (plain) and 1-3 (the sweep)
        results = {"seeds": {"token": [1, 2, 3, 4, 5], "token@0.005": [1, 2, 3], "token@0.5": [1, 2, 3]},
                   "heldout_avg": {"token": token, "token@0.005": token_small, "token@0.5": token_large}}
        path = tmp_path / "results.json"
        path.write_text(json.dumps(results))
        return miniature.best_tau("token", path)

    # seeds 4 and 5 of the plain arm do not count: over seeds 1-3 it is 0.9 (over all five 0.94), below 0.93
    assert sweep([0.9, 0.9, 0.9, 1.0, 1.0], [0.93, 0.93, 0.93], [0.5, 0.5, 0.5]) == 0.005
    assert sweep([1.0, 1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]) == 0.05  # a tie: the default
    assert sweep([0.2, 0.2, 0.2, 0.2, 0.2], [0.6, 0.6, 0.6], [0.6, 0.6, 0.6]) == 0.5  # a tie of the others: larger
    assert sweep([0.2, 0.2, 0.2, 0.2, 0.2], [0.1, 0.1, 0.1], [0.3, 0.3, 0.3]) == 0.5
    with pytest.raises(SystemExit, match="run --full first"):
        miniature.best_tau("token", tmp_path / "none.json")


def test_the_best_tau_arms_are_refused_early_without_the_sweeps_results(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(miniature, "RESULTS", tmp_path / "results.json")  # not there
    with pytest.raises(SystemExit) as stop:
        miniature.parse_args(["--output-dir", str(tmp_path), "--arms", "drift-none,drift-token@best"])
    assert stop.value.code == 2 and "run --full first" in capsys.readouterr().err


def test_the_drift_arms_command_lines(tmp_path, monkeypatch):
    monkeypatch.setattr(miniature, "best_tau", lambda clip: {"token": 0.5, "entry": 0.005}[clip])

    def flags(arm):
        cmd = miniature.opsd_command(miniature.DRIFT_MODEL, tmp_path / "t.jsonl", arm, 1, 150, 2e-3, tmp_path / arm)
        return {k: v for k, v in zip(cmd, cmd[1:]) if k.startswith("--")}

    assert flags("drift-token@best")["--tau"] == "0.5" and flags("drift-token@best")["--clip"] == "token"
    assert flags("drift-entry@best")["--tau"] == "0.005" and flags("drift-entry@best")["--clip"] == "entry"
    assert flags("drift-skip1")["--skip-first-tokens"] == "1" and flags("drift-skip1")["--clip"] == "none"
    assert "--skip-first-tokens" not in flags("drift-none") and flags("drift-entry")["--tau"] == "0.05"
    # every drift arm trains at its clip's dev-chosen lr; the student prompt is the training format's
    assert miniature.lr_of("drift-token@best") == miniature.CHOSEN_LR["token"]
    assert miniature.lr_of("drift-skip1") == miniature.lr_of("drift-none") == miniature.CHOSEN_LR["none"]
    assert miniature.lr_of("drift-sft-trace") == miniature.CHOSEN_LR["sft-trace"]
    # the arms added after the drift results: the token clip at 0.05 with the first position left out, at the
    # token family's lr; outside the fixed protocol's arm lists
    for arm in ("token-skip1", "drift-token-skip1"):
        assert flags(arm)["--skip-first-tokens"] == "1" and flags(arm)["--clip"] == "token"
        assert flags(arm)["--tau"] == "0.05" and miniature.lr_of(arm) == miniature.CHOSEN_LR["token"]
        assert arm not in miniature.ARMS and arm not in miniature.DRIFT_ARMS
    assert miniature.parse_args(["--output-dir", str(tmp_path), "--arms", "drift-token-skip1"]).start_model == "drift"
    assert miniature.parse_args(["--output-dir", str(tmp_path), "--arms", "token-skip1"]).start_model == 1
    assert set(miniature.ALL_ARMS) <= set(miniature.COLORS)  # every arm can be drawn
    cmd = miniature.opsd_command(miniature.DRIFT_MODEL, tmp_path / "t.jsonl", "drift-token", 1, 150, 2e-3, tmp_path)
    assert flags("drift-token")["--student-prompt"] == "eval" and "--no-student-thinking" in cmd
    assert flags("drift-token")["--model"] == str(miniature.DRIFT_MODEL)


def test_answer_styles_against_hand_labelled_answers():
    labelled = {"7+5=12 5+8+1=14 4+3+1=8 \\boxed{842}": "columns", "6+6=13 6+1+1=1 \\boxed{193}": "columns",
                "0+1=1 \\boxed{1}": "columns", "590+101=763 \\boxed{763}": "reference",
                "457+385=842 \\boxed{842}": "reference", "\\boxed{842}": "none", "so \\boxed{12}": "none",
                "457+385=842 7+5=12 \\boxed{842}": "columns"}
    assert {t: miniature.answer_style(t) for t in labelled} == labelled
    # has_scratchpad counts any work before the box: the columns and the terse reference alike
    assert [miniature.has_scratchpad(t) for t in labelled] == [s != "none" for s in labelled.values()]


def test_the_lr_rule_breaks_a_ceiling_by_the_area_under_the_dev_curve():
    def run(family, lr, *dev):  # a dev curve: step 0 then one checkpoint per 25 steps
        return {"arm": family, "family": family, "lr": lr, "seed": 1,
                "curve": [[25 * i, 0, 0.0, v, 0.0] for i, v in enumerate(dev)]}

    runs = [run("a", 2e-3, .5, .90, 1.0, 1.0), run("a", 5e-3, .5, .99, 1.0, .995), run("a", 1.25e-2, .5, 1, .9, .98),
            run("b", 2e-3, .5, .8, .9), run("b", 5e-3, .5, .8, .9),  # an exact tie: the smaller lr
            run("c", 8e-4, .5, .7, .8), run("c", 2e-3, .5, .2, .3),  # best at the lowest edge run so far
            run("d", 3.2e-4, .5, .7, .8), run("d", 8e-4, .5, .2, .3)]  # ... at the extension's limit
    chosen = miniature.choose_lrs({"runs": {str(i): r for i, r in enumerate(runs)}})
    # a: 1.25e-2 ends 2 points below the best (1.0) and leaves the band despite its curve; 5e-3's area
    # (.99 + 1 + .995) / 3 beats 2e-3's (.9 + 1 + 1) / 3 although it ends half a point lower
    assert chosen["a"]["lr"] == 5e-3 and chosen["a"]["dev_area"] == pytest.approx(2.985 / 3)
    assert not chosen["a"]["extend"]
    assert chosen["b"]["lr"] == 2e-3 and chosen["b"]["extend"]  # at the lower edge: 8e-4 must run
    assert chosen["c"]["lr"] == 8e-4 and chosen["c"]["extend"]  # 3.2e-4 is the last point the rule may add
    assert chosen["d"]["lr"] == 3.2e-4 and not chosen["d"]["extend"]


def test_the_chosen_lrs_are_the_rules_verdict_on_the_committed_selection():
    selection = json.loads((miniature.DATA / "selection" / "selection.json").read_text())
    chosen = miniature.choose_lrs(selection)
    assert {family: c["lr"] for family, c in chosen.items()} == miniature.CHOSEN_LR
    assert not any(c["extend"] for c in chosen.values())  # no extension the rule asks for is left to run
    assert set(miniature.FAMILY.values()) == set(miniature.CHOSEN_LR)  # every arm trains at a dev-chosen lr


def test_grpo_advantages_and_loss_against_float64_oracles(task):
    adv = miniature.group_advantages([1, 0, 0, 0, 1, 1, 1, 1], 4)
    # group 1: mean 0.25, population std sqrt(0.1875) = 0.4330127; group 2: all equal -> 0
    assert adv[:4].tolist() == pytest.approx([0.75 / (0.4330127 + 1e-4)] + [-0.25 / (0.4330127 + 1e-4)] * 3)
    assert adv[4:].abs().max() == 0
    from transformers import AutoModelForCausalLM, AutoTokenizer

    train = task[0]
    tok = AutoTokenizer.from_pretrained(miniature.SHIPPED_MODEL)
    model = AutoModelForCausalLM.from_pretrained(miniature.SHIPPED_MODEL, dtype=torch.float32)
    prompts = [miniature.student_prompt(tok, r["problem"]) for r in train[:4]]
    completions = [miniature.answer_ids(tok, r["trace"])[: 5 + 3 * i] for i, r in enumerate(train[:4])]
    advantages = torch.tensor([1.5, -0.5, 0.25, -1.25], dtype=torch.float64)
    loss = miniature.grpo_loss(model, prompts, completions, advantages, tok.pad_token_id, temperature=1.1)
    ref = model.to(torch.float64).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for p, c, a in zip(prompts, completions, advantages.tolist()):
            logp = torch.log_softmax(ref(input_ids=torch.tensor([p + c])).logits[0] / 1.1, -1)
            total -= a * sum(logp[len(p) - 1 + k, t].item() for k, t in enumerate(c))
            count += len(c)
    # float32 against float64; the advantages' signs cancel much of the sum, so the tolerance is absolute (the
    # terms' scale is ~1e-2: a wrong sign, temperature or token shift moves the loss far more)
    assert loss.item() == pytest.approx(total / count, abs=1e-6)


def test_sft_losses_are_the_targets_cross_entropy(task, tmp_path):
    """Step 1 of each SFT arm against a float64 oracle: each row alone, unpadded, the mean over the step's target
    tokens of -log p(token); the targets are the terse reference then the boxed answer, or the correct trace."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    train = task[0]
    tok = AutoTokenizer.from_pretrained(miniature.SHIPPED_MODEL)
    model = AutoModelForCausalLM.from_pretrained(miniature.SHIPPED_MODEL, dtype=torch.float64).eval()
    for arm, text in (("sft-reference", lambda r: f"{r['problem']}={r['answer']} \\boxed{{{r['answer']}}}"),
                      ("sft-trace", lambda r: miniature.correct_trace(*miniature.operands(r["problem"])))):
        out = tmp_path / arm
        miniature.train_sft(miniature.SHIPPED_MODEL, train, miniature.ARMS[arm][1], seed=3, steps=2, lr=1e-3,
                            out_dir=out)
        step1 = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
        total, count = 0.0, 0
        with torch.no_grad():
            for i in opsd.step_indices(0, miniature.COMPLETIONS_PER_STEP, len(train), 3):
                prompt = evaluation.prompt_ids(tok, train[i]["problem"], False)
                answer = tok.encode(text(train[i]), add_special_tokens=False) + [tok.eos_token_id]
                logp = torch.log_softmax(model(input_ids=torch.tensor([prompt + answer])).logits[0], -1)
                total -= sum(logp[len(prompt) - 1 + k, t].item() for k, t in enumerate(answer))
                count += len(answer)
        assert step1["loss"] == pytest.approx(total / count, rel=1e-5), arm
        tensors = load_file(str(out / "final" / opsd.ADAPTER_WEIGHTS))
        assert any(v.abs().max() > 0 for k, v in tensors.items() if "lora_B" in k)


def test_reference_step_figures():
    """The port-check fixture: its model is the shipped one; its figures come back through opsd.py's functions
    and, independently, from a float64 forward of each row alone with the divergence written out here."""
    ref = json.loads(REFERENCE.read_text())
    rows, settings, expected = ref["rows"], ref["settings"], ref["expected"]
    assert len(rows) >= 16 and ref["model_sha256_16"] == miniature.model_digest(miniature.SHIPPED_MODEL)
    assert ref["model"] == miniature.repo_path(miniature.SHIPPED_MODEL) == "tests/miniature/model"  # as written
    drift = json.loads((miniature.DATA / "drift" / "reference_step.json").read_text())
    assert drift["model"] == miniature.repo_path(miniature.DRIFT_MODEL) == "tests/miniature/model-drift"
    assert ref["positions"] == sum(len(r["completion_ids"]) for r in rows)
    got = miniature.step_figures(miniature.SHIPPED_MODEL, rows, **settings)
    for clip in ("token", "entry", "none"):
        for key in ("loss", "kl_mean", "kl_clipped_teacher_mass"):
            assert got[clip][key] == pytest.approx(expected[clip][key], abs=FLOAT32_ABS), (clip, key)

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(miniature.SHIPPED_MODEL, dtype=torch.float64).eval()
    T, tau = settings["temperature"], settings["tau"]
    assert settings["beta"] == 0.0
    per_position, teacher_probs = [], []  # (V,) d_v = p_T(v) (log p_T(v) - log p_S(v)) at each completion position
    with torch.no_grad():
        for r in rows:
            c = r["completion_ids"]
            logits = {}
            for role in ("student", "teacher"):
                prompt = r[f"{role}_prompt_ids"]
                out = model(input_ids=torch.tensor([prompt + c])).logits[0]  # no padding: positions 0..L-1
                logits[role] = out[len(prompt) - 1:len(prompt) - 1 + len(c)] / T  # predict each completion token
            log_s, log_t = (torch.log_softmax(logits[k], -1) for k in ("student", "teacher"))
            per_position.append(log_t.exp() * (log_t - log_s))
            teacher_probs.append(log_t.exp())
    d, p_t = torch.cat(per_position), torch.cat(teacher_probs)  # (N, V)
    N = d.shape[0]
    kl = d.sum(-1)
    oracle = {"token": kl.clamp(max=tau).sum() / N, "entry": d.clamp(max=tau).sum() / N, "none": kl.sum() / N}
    for clip, loss in oracle.items():
        assert expected[clip]["loss"] == pytest.approx(loss.item(), abs=1e-5), clip
        assert expected[clip]["kl_mean"] == pytest.approx(kl.mean().item(), abs=1e-5)
        assert expected[clip]["kl_clipped_teacher_mass"] == pytest.approx((p_t * (d > tau)).sum(-1).mean().item(),
                                                                          abs=1e-5)
    # the three clips give losses far apart on this data, so a port that mixes them up fails; with no clip and
    # beta 0 the loss is the mean KL itself
    losses = sorted(expected[clip]["loss"] for clip in ("token", "entry", "none"))
    assert losses[1] - losses[0] > 1e-3 and losses[2] - losses[1] > 1e-3
    assert expected["none"]["loss"] == pytest.approx(expected["none"]["kl_mean"], abs=1e-7)
    # the step-1 KL profile beside it is these positions' KL
    profile = json.loads((miniature.DATA / "step1_kl.json").read_text())
    assert profile["positions"] == N and profile["kl_mean"] == pytest.approx(kl.mean().item(), abs=1e-5)
    # the share above tau in float32 against float64: at most one position may sit on the other side of tau
    assert abs(profile["frac_above_tau"] * N - int((kl > tau).sum())) <= 1 + 1e-3
    assert sum(profile["histogram_counts"]) == N


@pytest.mark.parametrize("argv, words", [
    (["--output-dir", "x", "--arms", "token,bogus"], "--arms"),
    (["--output-dir", "x", "--seeds", "1,1"], "--seeds"),
    (["--output-dir", "x", "--full", "--arms", "token"], "--full"),
    (["--arms", "token"], "--output-dir"),
    (["--output-dir", "x", "--resume", "--overwrite"], "--resume"),
    (["--output-dir", "x", "--quick", "--select"], "--select"),
    (["--output-dir", "x", "--arms", "token,drift-token"], "mixes drift arms"),
    (["--output-dir", "x", "--drift", "--arms", "none"], "--drift runs the drift arms"),
    (["--output-dir", "x", "--drift", "--quick"], "separate runs"),
])
def test_bad_flags_are_refused_in_one_sentence(argv, words, capsys):
    with pytest.raises(SystemExit) as refused:  # in this process: parse_args is where every flag is checked
        miniature.parse_args(argv)
    err = capsys.readouterr().err
    assert refused.value.code == 2 and err.strip().splitlines()[-1].startswith("miniature.py: error:") and words in err


def test_a_bad_flag_from_the_command_line_is_one_sentence_without_a_traceback():
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "miniature" / "miniature.py"), "--output-dir", "x",
                           "--seeds", "1,1"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("miniature.py: error:") and "--seeds" in proc.stderr


def metrics_without_timings(run):
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in miniature.TIMING_FIELDS} for r in records]


def test_a_fixed_seed_reproduces_exactly(quick_run):
    """The quick run's first step (its arm through opsd.py with --seed 1, on this machine today): its figures are the
    port-check fixture's, committed from the run that made it (sampling, batches and loss all reproduce). A first
    step's figures come before any update, so the quick run's lr and step count do not enter them."""
    out, _ = quick_run
    first = metrics_without_timings(out / miniature.run_name("p1", miniature.QUICK_ARM, 1))[0]
    assert first["step"] == 1 and miniature.ALL_ARMS[miniature.QUICK_ARM][1][:2] == ("none", 0.05)
    ref = json.loads(REFERENCE.read_text())
    assert first["kl_window_tokens"] == ref["positions"]  # the same completions sampled: a count, exact
    for key in ("loss", "kl_mean", "kl_clipped_teacher_mass"):
        assert first[key] == pytest.approx(ref["expected"]["none"][key], abs=FLOAT32_ABS), key


def test_grpo_trains_from_opsds_parts(task, tmp_path, monkeypatch):
    """Three GRPO steps (in this process, where vLLM is imported already; a user's run starts a process for them):
    64 completions a step (8 prompts x 8), rewards in [0, 1] that are not all alike on this imperfect model, the
    weight push checked by opsd.py, the adapter moved off zero."""
    from safetensors.torch import load_file

    monkeypatch.setattr(miniature, "IN_PROCESS", True)
    files = {"train": tmp_path / "train.jsonl"}
    miniature.write_jsonl(files["train"], task[0])
    adapter, _ = miniature.train_arm(miniature.SHIPPED_MODEL, files, task[0], "grpo", 1, 3, 5e-3, tmp_path / "g",
                                     resume=False)
    records = miniature.read_metrics(tmp_path / "g")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(0 < r["reward_mean"] < 1 and r["sampled_tokens"] == 64 * r["completion_len_mean"] for r in records)
    assert all(r["time_push"] > 0 for r in records)
    tensors = load_file(str(adapter / opsd.ADAPTER_WEIGHTS))
    assert any(v.abs().max() > 0 for k, v in tensors.items() if "lora_B" in k)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """miniature.py's main() in this process (a new process for the script would add its imports, 4 s): its
    opsd.py run a process of its own, as a user's (vLLM's sampler compiled); eval.py's main() in this process too,
    where vLLM is imported already (7 s less an evaluation, and the resume's evaluations below as well): the run's
    directory and what it printed."""
    out = tmp_path_factory.mktemp("miniature")
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(miniature, "IN_PROCESS", True)
        with contextlib.redirect_stdout(printed), as_a_user_would():
            miniature.main(["--output-dir", str(out), *QUICK])
        yield out, printed.getvalue()


def test_quick_run_records_what_eval_scored(quick_run):
    """The quick variant, cut to QUICK[-1] steps (the quickstart's test shows the gain): results.json holds the
    scores eval.py gave, regraded here from the sums."""
    out, stdout = quick_run
    results = json.loads((out / "results.json").read_text())
    arm = miniature.QUICK_ARM
    assert results["quick"] and results["arms"] == [arm] and results["n"] == 1
    assert 0.3 < results["heldout_avg"]["base"] < 0.8, "the shipped model should be clearly imperfect, not useless"
    # results.json agrees with eval.py's samples, regraded here: the boxed answer against the sum of the operands
    for name, key in (("p1-none-s1-eval-primary", "heldout_avg"), ("p1-none-s1-eval-transfer", "transfer_avg")):
        samples = [json.loads(line) for line in (out / name / "samples.jsonl").read_text().splitlines()]
        assert len(samples) == 400
        heldout = miniature.make_task()[2]
        right = [evaluation.extract_boxed(s["completion"]) == str(sum(miniature.operands(heldout[s["problem"]]
                                                                                          ["problem"])))
                 for s in samples]
        assert results[key][arm][0] == pytest.approx(sum(right) / len(right))
    assert (out / "miniature.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert arm in stdout and "per seed" in stdout
    run = out / miniature.run_name("p1", arm, 1)
    assert len((run / "metrics.jsonl").read_text().splitlines()) == results["steps"] == int(QUICK[-1])


QUICK = ["--quick", "--steps", "3"]  # the script's machinery, not its gain: a few steps are enough


def test_second_run_into_the_same_directory_is_refused(quick_run):
    """In this process (a new one spends 4 s importing to say one sentence): a SystemExit with the sentence, which
    Python prints alone, no traceback, and the run's files untouched."""
    out, _ = quick_run
    settings = (out / "settings.json").read_bytes()
    with pytest.raises(SystemExit) as refused:
        miniature.main(["--output-dir", str(out), *QUICK])
    assert "--overwrite" in str(refused.value.code) and (out / "settings.json").read_bytes() == settings


def test_an_interrupted_run_resumes_to_the_uninterrupted_results(quick_run, capsys):
    """A kill during the last evaluation, then --resume: the training is kept as it was, eval.py draws only the
    samples it lacks, and results.json holds the uninterrupted run's scores. Other settings are refused."""
    out, _ = quick_run
    flags = ["--output-dir", str(out), *QUICK]
    before = json.loads((out / "results.json").read_text())
    run = out / miniature.run_name("p1", miniature.QUICK_ARM, 1)
    trained = (run / "metrics.jsonl").read_bytes()
    scored = out / f"{run.name}-eval-transfer" / "samples.jsonl"
    lines = scored.read_text().splitlines(keepends=True)
    half = len(lines) // 2
    scored.write_text("".join(lines[:half]) + lines[half][:20])  # half of the samples and a line cut short
    (scored.parent / "summary.json").unlink()
    (out / "results.json").unlink()
    with pytest.raises(SystemExit) as refused:  # in this process, as the second run's refusal
        miniature.main(flags + ["--resume", "--steps", "4"])
    assert "--resume with other --steps than the run in " in str(refused.value.code)
    capsys.readouterr()
    with as_a_user_would():  # in this process, as the quick run: eval.py draws the rest as it drew the first half
        miniature.main(flags + ["--resume"])
    printed = capsys.readouterr().out
    after = json.loads((out / "results.json").read_text())
    assert after["heldout_avg"] == before["heldout_avg"] and after["transfer_avg"] == before["transfer_avg"]
    assert after["resumed"] and not before["resumed"]
    assert (run / "metrics.jsonl").read_bytes() == trained and "training kept" in printed
    assert len(scored.read_text().splitlines()) == len(lines)
    assert after["timings"][run.name] == before["timings"][run.name]  # the first invocation's


# -- what the teacher is shown (tests/miniature/context/) ------------------------------------------------------------

CONTEXT = ROOT / "tests" / "miniature" / "context"


def test_the_teacher_context_runs_are_the_quickstart_with_one_flag(tmp_path):
    import context
    quickstart = [miniature.in_dir(c, tmp_path) for c in miniature.quickstart_commands()]
    train, scoring = context.commands(tmp_path, "other", 43)
    at = quickstart[0].index("--output-dir")
    assert train == [*quickstart[0][:at + 1], str(tmp_path / "other-43"), *quickstart[0][at + 2:], "--seed", "43",
                     "--teacher-context", "other"]
    answer, _ = context.commands(tmp_path, "answer", 42)
    assert answer[answer.index("--dataset") + 1] == str(tmp_path / "train-boxed.jsonl")
    assert scoring[scoring.index("--adapter") + 1] == str(tmp_path / "other-43" / "final")
    source = tmp_path / "train.jsonl"
    source.write_text('{"problem": "457+385", "solution": "457+385=842"}\n')
    context.boxed_copy(source, tmp_path / "boxed.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "boxed.jsonl").read_text().splitlines()]
    assert rows == [{"problem": "457+385", "solution": "457+385=\\boxed{842}"}]
    assert opsd.shown_contexts([(r["problem"], r["solution"]) for r in rows], "answer", 0) == [
        ("457+385", "\\boxed{842}")]


def test_the_committed_teacher_context_results_are_their_files():
    import context
    committed = json.loads((CONTEXT / "results" / "results.json").read_text())
    assert committed == json.loads(json.dumps(context.results(CONTEXT / "results")))  # the same sums: exact
    assert set(committed["runs"]) == {f"{arm}-{seed}" for arm in context.ARMS for seed in context.SEEDS}
    # reference at seed 42 is the quickstart run itself: the same held-out score as the quickstart's record
    quickstart = json.loads((ROOT / "tests" / "miniature" / "quickstart" / "quickstart.json").read_text())
    assert committed["runs"]["reference-42"]["heldout"] == pytest.approx(quickstart["heldout_trained"])
    assert committed["base_heldout"] == pytest.approx(quickstart["heldout_base"])
