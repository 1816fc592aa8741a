# python -m pytest tests/test_miniature.py -q
"""OPSD in miniature. The task's splits and the pre-training mix; the statistics; the SFT arm's loss against a
float64 oracle; the port-check fixture (tests/data/miniature/reference_step.json) recomputed through opsd.py's
functions and by an independent float64 computation; a fixed seed reproducing opsd.py's run exactly; and the
quick variant: opsd.py trains the `none` arm (the opsd.py arm that gained on the dev split, see the README's
"OPSD in miniature") from the shipped model, it scores clearly above the base model on the held-out split, and
eval.py's scores reach results.json unchanged; an interrupted run resumes to the same results. (The other arms
run in the full experiment, not here.)"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import eval as evaluation
import miniature
import opsd

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = miniature.TESTS / "data" / "miniature" / "reference_step.json"

def test_task_splits_are_disjoint_and_every_answer_is_the_sum():
    train, dev, heldout = miniature.make_task()
    assert (len(train), len(dev), len(heldout)) == (7300, 400, 400)
    names = [{r["problem"] for r in split} for split in (train, dev, heldout)]
    assert sum(map(len, names)) == 8100 and len(set().union(*names)) == 8100  # disjoint, all pairs
    for r in train + dev + heldout:
        a, b = map(int, r["problem"].split("+"))
        assert 10 <= a <= 99 and 10 <= b <= 99 and int(r["answer"]) == a + b
    assert all(r["solution"] == f"{r['problem']}={r['answer']}" and r["no_solution"] == "" for r in train)
    # the wrong arm's reference: another training problem's solution, with another answer, each used once
    wrong = [r["wrong_solution"] for r in train]
    assert sorted(wrong) == sorted(r["solution"] for r in train)
    assert all(w.split("=")[1] != r["answer"] for w, r in zip(wrong, train))
    # the swapped-operand fact the README states, counted by hand here
    train_problems = {r["problem"] for r in train}
    twins = sum(f"{r['problem'].split('+')[1]}+{r['problem'].split('+')[0]}" in train_problems for r in heldout)
    assert twins == miniature.swapped_twins(heldout, train) and 300 < twins < 400
    # the shipped model was pre-trained on this very training split, without dev or held-out problems
    info = json.loads((miniature.SHIPPED_MODEL / miniature.TASK_FILE).read_text())
    assert info["train_digest"] == miniature.split_digest(train)
    assert info["dev_digest"] == miniature.split_digest(dev)
    assert info["heldout_digest"] == miniature.split_digest(heldout)


def test_pretraining_formats_are_the_scripts_own_prompts():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(miniature.SHIPPED_MODEL)
    rows = miniature.make_task()[0][:5]
    student_teacher = opsd.build_prompts(tok, [(r["problem"], r["solution"]) for r in rows], student_thinking=False,
                                         teacher_thinking=True, max_prompt_length=256)
    empty = opsd.build_prompts(tok, [(r["problem"], r["no_solution"]) for r in rows], student_thinking=False,
                               teacher_thinking=True, max_prompt_length=256)
    for r, (student, teacher), (_, teacher_empty) in zip(rows, student_teacher, empty):
        assert miniature.format_prompt(tok, r, "student") == student
        assert miniature.format_prompt(tok, r, "teacher") == teacher
        assert miniature.format_prompt(tok, r, "teacher_empty") == teacher_empty
        assert miniature.format_prompt(tok, r, "eval") == evaluation.prompt_ids(tok, r["problem"], True)
    # every digit is its own token, so the answer 123 is three tokens between the braces
    assert tok.convert_ids_to_tokens(miniature.answer_ids(tok, "123"))[-5:-1] == ["1", "2", "3", "}"]


def test_statistics_against_hand_computed_values():
    # values 0.20, 0.30, 0.25: mean 0.25, sample std 0.05, standard error 0.05 / sqrt(3) = 0.0288675;
    # Student t (2 degrees of freedom, 97.5%) 4.303 -> half-width 0.124217
    s = miniature.summarize([0.20, 0.30, 0.25], base=0.10, base_stderr=0.01)
    assert s["mean"] == pytest.approx(0.25) and s["ci95"] == pytest.approx(0.124217, abs=1e-6)
    assert s["vs_base"] == pytest.approx(0.15)
    assert s["vs_base_ci95"] == pytest.approx((0.124217 ** 2 + 0.0196 ** 2) ** 0.5, abs=1e-6)
    one = miniature.summarize([0.4], base=0.1, base_stderr=0.01)
    assert one["ci95"] is None and one["vs_base_ci95"] is None and one["vs_base"] == pytest.approx(0.3)


def test_a_one_seed_figure_shows_no_mean_and_a_quick_one_says_so():
    results = {"arms": ["token"], "split": "heldout", "heldout_avg": {"base": 0.1, "token": [0.3]},
               "seeds": {"token": [1]}, "n": 2, "quick": True}
    left, title = miniature.figure_titles(results)
    assert "mean" not in left and "dots" not in left and "seed 1" in left
    assert "quick" in title and "one seed" in title
    results.update(quick=False, seeds={"token": [1, 2]}, heldout_avg={"base": 0.1, "token": [0.3, 0.4]})
    left, title = miniature.figure_titles(results)
    assert "mean" in left and title is None


@pytest.mark.parametrize("argv, words", [
    (["--output-dir", "x", "--arms", "token,bogus"], "--arms"),
    (["--output-dir", "x", "--seeds", "1,1"], "--seeds"),
    (["--output-dir", "x", "--full", "--arms", "token"], "--full"),
    (["--arms", "token"], "--output-dir"),
    (["--output-dir", "x", "--resume", "--overwrite"], "--resume"),
])
def test_bad_flags_are_refused_in_one_sentence(argv, words):
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "miniature.py"), *argv], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("miniature.py: error:") and words in proc.stderr


def test_sft_loss_is_the_answer_tokens_cross_entropy(tmp_path):
    """The sft arm's step-1 loss against a float64 oracle: each row alone, unpadded, the mean over all answer
    tokens of the step of -log p(answer token); and training moves the adapter off zero."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    train = miniature.make_task()[0]
    miniature.train_sft(miniature.SHIPPED_MODEL, train, seed=3, steps=2, lr=1e-3, out_dir=tmp_path)
    step1 = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    tok = AutoTokenizer.from_pretrained(miniature.SHIPPED_MODEL)
    model = AutoModelForCausalLM.from_pretrained(miniature.SHIPPED_MODEL, dtype=torch.float64).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in opsd.step_indices(0, miniature.PROMPTS_PER_STEP, len(train), 3):
            prompt = opsd.render(tok, opsd.student_message(train[i]["problem"]), thinking=False)
            answer = tok.encode(f"\\boxed{{{train[i]['answer']}}}", add_special_tokens=False) + [tok.eos_token_id]
            logp = torch.log_softmax(model(input_ids=torch.tensor([prompt + answer])).logits[0], -1)
            total -= sum(logp[len(prompt) - 1 + k, t].item() for k, t in enumerate(answer))
            count += len(answer)
    assert step1["loss"] == pytest.approx(total / count, rel=1e-5)
    from safetensors.torch import load_file

    tensors = load_file(str(tmp_path / "final" / opsd.ADAPTER_WEIGHTS))
    assert any(v.abs().max() > 0 for k, v in tensors.items() if "lora_B" in k)


def test_reference_step_figures():
    """The port-check fixture: its model is the shipped one; its figures come back through opsd.py's functions
    and, independently, from a float64 forward of each row alone with the divergence written out here."""
    ref = json.loads(REFERENCE.read_text())
    rows, settings, expected = ref["rows"], ref["settings"], ref["expected"]
    assert len(rows) >= 16 and ref["model_sha256_16"] == miniature.model_digest(miniature.SHIPPED_MODEL)
    assert ref["positions"] == sum(len(r["completion_ids"]) for r in rows)
    got = miniature.step_figures(miniature.SHIPPED_MODEL, rows, **settings)
    for clip in ("token", "entry", "none"):
        for key in ("loss", "kl_mean", "kl_clipped_teacher_mass"):
            assert got[clip][key] == pytest.approx(expected[clip][key], abs=1e-6), (clip, key)

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(miniature.SHIPPED_MODEL, dtype=torch.float64).eval()
    T, tau = settings["temperature"], settings["tau"]
    assert settings["beta"] == 0.0
    per_position = []  # (V,) d_v = p_T(v) (log p_T(v) - log p_S(v)) at each completion position
    teacher_probs = []
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


def test_selection_scores_the_probability_of_the_exact_answer(tmp_path):
    """--select with the sft arm for 4 steps: selection.json holds the dev score of the base model and of each
    checkpoint; the base score equals a float64 computation, row by row and unpadded, of the mean over dev problems
    of exp(sum of the answer tokens' log-probs) after eval.py's prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    selection = miniature.main(["--output-dir", str(tmp_path), "--select", "--arms", "sft", "--seeds", "2",
                                "--steps", "4", "--curve-every", "2"])
    assert json.loads((tmp_path / "selection.json").read_text()) == selection and selection["steps"] == [2, 4]
    dev = miniature.make_task()[1]
    tok = AutoTokenizer.from_pretrained(miniature.SHIPPED_MODEL)
    model = AutoModelForCausalLM.from_pretrained(miniature.SHIPPED_MODEL, dtype=torch.float64).eval()
    probabilities = []
    with torch.no_grad():
        for r in dev:
            prompt, answer = evaluation.prompt_ids(tok, r["problem"], True), miniature.answer_ids(tok, r["answer"])
            logp = torch.log_softmax(model(input_ids=torch.tensor([prompt + answer])).logits[0], -1)
            probabilities.append(math.exp(sum(logp[len(prompt) - 1 + k, t].item() for k, t in enumerate(answer))))
    assert selection["base"] == pytest.approx(sum(probabilities) / len(dev), rel=1e-4)
    run = miniature.run_dir(tmp_path, "sft", "sft", 2)
    points = selection["runs"]["sft seed 2"]
    assert points[-1] == miniature.answer_probability(miniature.SHIPPED_MODEL, dev, run / "final")
    assert points[0] == miniature.answer_probability(miniature.SHIPPED_MODEL, dev, run / "checkpoint-2")
    assert points[0] != selection["base"] and points[1] != points[0]  # each checkpoint is its own adapter


def metrics_without_timings(run):
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in miniature.TIMING_FIELDS} for r in records]


def test_a_fixed_seed_reproduces_exactly(tmp_path):
    """Two runs of the token arm through opsd.py with --seed 1, the second on one OpenMP thread: identical
    metrics.jsonl apart from timings, identical adapters; and their step 1 is the port-check fixture's."""
    train = miniature.make_task()[0]
    miniature.write_jsonl(tmp_path / "train.jsonl", train)
    runs = []
    for name, env in (("a", {}), ("b", {"OMP_NUM_THREADS": "1"})):
        out = tmp_path / name
        cmd = miniature.opsd_command(miniature.SHIPPED_MODEL, tmp_path / "train.jsonl", "token", 1, 4,
                                     miniature.OPSD_LR, out)
        miniature.run_logged(cmd, tmp_path / f"{name}.log", env=env)
        runs.append(out)
    a, b = (metrics_without_timings(run) for run in runs)
    assert len(a) == 4 and a == b
    assert len({r["loss"] for r in a}) == 4  # the steps differ from each other: the check compares real values
    adapter = opsd.ADAPTER_WEIGHTS
    assert (runs[0] / "final" / adapter).read_bytes() == (runs[1] / "final" / adapter).read_bytes()
    expected = json.loads(REFERENCE.read_text())["expected"]["token"]
    for key in ("loss", "kl_mean", "kl_clipped_teacher_mass"):
        assert a[0][key] == pytest.approx(expected[key], abs=1e-6), key


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("miniature")
    cmd = [sys.executable, str(ROOT / "tests" / "miniature.py"), "--output-dir", str(out), "--quick"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=ROOT, env={**os.environ})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc.stdout


def test_quick_run_reports_what_eval_scored(quick_run):
    out, stdout = quick_run
    results = json.loads((out / "results.json").read_text())
    arm = miniature.QUICK_ARM
    score, base = results["heldout_avg"][arm][0], results["heldout_avg"]["base"]
    assert results["samples_per_model"] == 400 * results["n"] and results["quick"] and results["arms"] == [arm]
    assert 0.05 < base < 0.6, "the shipped model should be clearly imperfect, not useless"
    # training through opsd.py made it better: on dev this arm gained 7.4 points (noise-free score, seed 1); 3
    # points is about two standard errors of the difference of two avg@2 scores on 400 problems
    assert score > base + 0.03, (score, base)
    # results.json agrees with eval.py's own summary, recomputed here from its samples
    samples = [json.loads(line) for line in (out / f"eval-{arm}-s1" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == results["samples_per_model"]
    assert score == pytest.approx(sum(s["correct"] for s in samples) / len(samples))
    assert (out / "miniature.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert arm in stdout and "per seed" in stdout
    # opsd.py ran every step and moved the adapter off its zero start (LoRA B starts at 0)
    from safetensors.torch import load_file

    run = miniature.run_dir(out, "opsd", arm, 1)
    assert len((run / "metrics.jsonl").read_text().splitlines()) == results["steps"] == miniature.STEPS
    tensors = load_file(str(run / "final" / opsd.ADAPTER_WEIGHTS))
    assert any(v.abs().max() > 0 for k, v in tensors.items() if "lora_B" in k)


def test_second_run_into_the_same_directory_is_refused(quick_run):
    out, _ = quick_run
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "miniature.py"), "--output-dir", str(out), "--quick"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode != 0 and "--overwrite" in proc.stderr and "Traceback" not in proc.stderr


def test_an_interrupted_run_resumes_to_the_uninterrupted_results(quick_run):
    """A kill during the last evaluation, then --resume: the training is kept as it was, eval.py draws only the
    samples it lacks, and results.json holds the uninterrupted run's scores. Other settings are refused."""
    out, _ = quick_run
    script = [sys.executable, str(ROOT / "tests" / "miniature.py"), "--output-dir", str(out), "--quick"]
    before = json.loads((out / "results.json").read_text())
    arm = miniature.QUICK_ARM
    metrics = miniature.run_dir(out, "opsd", arm, 1) / "metrics.jsonl"
    trained = metrics.read_bytes()
    scored = out / f"eval-{arm}-s1" / "samples.jsonl"
    lines = scored.read_text().splitlines(keepends=True)
    half = len(lines) // 2
    scored.write_text("".join(lines[:half]) + lines[half][:20])  # half of the samples and a line cut short
    (out / f"eval-{arm}-s1" / "summary.json").unlink()
    (out / "results.json").unlink()
    refused = subprocess.run(script + ["--resume", "--lr", "1e-3"], capture_output=True, text=True, timeout=120,
                             cwd=ROOT)
    assert refused.returncode != 0 and "--lr" in refused.stderr and "Traceback" not in refused.stderr
    proc = subprocess.run(script + ["--resume"], capture_output=True, text=True, timeout=1200, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    after = json.loads((out / "results.json").read_text())
    assert after["heldout_avg"] == before["heldout_avg"] and after["resumed"] and not before["resumed"]
    assert metrics.read_bytes() == trained and "training kept" in proc.stdout
    assert len(scored.read_text().splitlines()) == len(lines)
    assert after["timings"][f"opsd-{arm}-s1"] == before["timings"][f"opsd-{arm}-s1"]  # the first invocation's
