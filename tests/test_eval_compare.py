# python -m pytest tests/test_eval_compare.py -q
"""eval.py --baseline: a run compared with another of the same problems, paired by problem, against differences and
standard errors computed by hand; baselines of other problems refused in one sentence before anything is written.
No vLLM here: every run's samples are already in its directory, so no engine starts."""

import json
import math

import pytest

import eval as ev
from test_eval_input import DATA, refusal, write_run

PROBLEMS = ev.load_problems("tiny", str(DATA), "problem", "answer")  # 3 problems


def write_graded(out, model, correct, problems=PROBLEMS):
    """A finished run of len(correct[i]) samples a problem, sample j of problem i graded correct[i][j]."""
    write_run(out, problems, model, n=len(correct[0]), flags=["--n", str(len(correct[0]))])
    records = [{"benchmark": "tiny", "problem": i, "sample": j, "hash": problems[i]["hash"], "answer": "1",
                "correct": c, "tokens": 5, "truncated": False} for i, row in enumerate(correct) for j, c in enumerate(row)]
    (out / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def compared(tmp_path, here, there, *flags):
    model = str(tmp_path)
    write_graded(tmp_path / "here", model, here)
    write_graded(tmp_path / "there", model, there)
    return ev.main(["--model", model, "--data", f"tiny={DATA}", "--n", str(len(here[0])), *flags,
                    "--output-dir", str(tmp_path / "here"), "--baseline", str(tmp_path / "there")])


def test_the_paired_difference_and_its_standard_error_by_hand(tmp_path, capsys):
    # Shares correct here 1, 1/2, 0; there 1/2, 1/2, 0: d = (1/2, 0, 0), mean 1/6, sd sqrt((1/9 + 1/36 + 1/36) / 2)
    # = sqrt(1/12), standard error sqrt(1/12) / sqrt(3) = 1/6: within 2 standard errors. Unpaired, the two runs'
    # standard errors (their shares' variances 1/4 and 1/12, over 3 problems) give sqrt(1/12 + 1/36) = 1/3.
    T, F = True, False
    summary = compared(tmp_path, [[T, T], [T, F], [F, F]], [[T, F], [F, T], [F, F]])
    tiny = summary["baseline"]["metrics"]["tiny"]
    assert tiny == {"problems": 3, "avg@2": pytest.approx(1 / 2), "baseline": pytest.approx(1 / 3),
                    "difference": pytest.approx(1 / 6), "standard_error": pytest.approx(1 / 6),
                    "beyond_noise": False}
    assert tiny["avg@2"] == summary["metrics"]["tiny"]["avg@2"] and summary["baseline"]["metrics"]["all"] == tiny
    printed = capsys.readouterr().out.splitlines()
    assert printed[-4] == f"against {tmp_path / 'there'}, paired by problem: {ev.NOISE_MODEL}."
    assert printed[-2].split() == ["tiny", "3", "50.0", "33.3", "+16.7", "16.7", "no"]


def test_differences_beyond_noise_within_it_and_without_a_standard_error(tmp_path):
    # 4 samples: shares here 1, 1, 1/2; there 0, 1/2, 1/4: d = (1, 1/2, 1/4), mean 7/12, deviations (5, -1, -4) / 12,
    # sd sqrt(42 / 144 / 2) = sqrt(21) / 12, standard error sqrt(21) / 12 / sqrt(3) = sqrt(7) / 12: sqrt(7) = 2.65
    # standard errors, beyond noise.
    T, F = True, False
    here, there = [[T] * 4, [T] * 4, [T, T, F, F]], [[F] * 4, [T, T, F, F], [T, F, F, F]]
    tiny = compared(tmp_path / "a", here, there)["baseline"]["metrics"]["tiny"]
    assert (tiny["difference"], tiny["standard_error"], tiny["beyond_noise"]) == (
        pytest.approx(7 / 12), pytest.approx(math.sqrt(7) / 12), True)
    # d = (1, 1/2, 0): mean 1/2, sd 1/2, standard error 1 / (2 sqrt(3)) = 0.289: 1.7 standard errors, within noise.
    tiny = compared(tmp_path / "c", [[T, T], [T, F], [F, F]], [[F, F]] * 3)["baseline"]["metrics"]["tiny"]
    assert (tiny["difference"], tiny["standard_error"], tiny["beyond_noise"]) == (
        pytest.approx(1 / 2), pytest.approx(1 / (2 * math.sqrt(3))), False)
    # One problem scored (--limit 1: the one a generator seeded "0/tiny" draws first), against a baseline of all
    # three: a difference, no standard error.
    import random

    drawn = random.Random("0/tiny").sample(range(3), 3)[0]
    there = [[T, F], [F, F], [F, F]]
    summary = compared(tmp_path / "b", [[T, T]] * 3, there, "--limit", "1")
    tiny = summary["baseline"]["metrics"]["tiny"]
    difference = 1 - sum(there[drawn]) / 2
    assert (tiny["problems"], tiny["difference"], tiny["standard_error"], tiny["beyond_noise"]) == (
        1, difference, None, False)
    assert summary["cost"] is None  # nothing was drawn, so no rate was measured


def test_a_baseline_of_other_problems_is_refused_before_anything_is_written(tmp_path):
    there = tmp_path / "there"
    argv = ["--data", f"tiny={DATA}", "--n", "1", "--baseline", str(there)]
    assert refusal(argv, tmp_path) == (f"--baseline {there}: no samples.jsonl there; pass an --output-dir that "
                                       "eval.py wrote.")
    other = [dict(p) for p in PROBLEMS]
    other[1]["hash"] = "0" * 16  # problem 1 there is another problem (or answer)
    write_graded(there, str(tmp_path), [[True]] * 3, problems=other)
    assert refusal(argv, tmp_path) == (f"--baseline {there} scored another tiny problem 1 than this run: compare "
                                       "runs of the same problems.")
    (there / "samples.jsonl").write_text((there / "samples.jsonl").read_text().splitlines()[0] + "\n")
    assert refusal(argv, tmp_path) == (f"--baseline {there} holds no sample of tiny problem 1: compare runs of the "
                                       "same problems.")
    assert not (tmp_path / "out").exists()
