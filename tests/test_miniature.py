# python -m pytest tests/test_miniature.py -q
"""OPSD in miniature, the quick variant: from the shipped pre-trained model, opsd.py with the token clip
(one seed) must raise eval.py's held-out accuracy on 2-digit addition by a margin the seed spread and the
standard error cannot explain. Also checks the task's split and that the pre-training mix renders exactly
the prompts opsd.py and eval.py build. (The control arm runs in the full experiment, not here.)"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import eval as evaluation
import miniature
import opsd

ROOT = Path(__file__).resolve().parent.parent

# Measured: the quick run's token arm (seed 1) scored 27.2 and 27.6 in two runs against the base model's 11.1
# (800 samples each, base standard error 1.1 points); in two full runs the weakest of three seeds gained 6.2 and
# 7.3 points. The test asks for 3 points and 2.5 standard errors of the base score: well below any seed's gain,
# well above noise.
MIN_GAIN = 0.03  # token arm over base, as a fraction


def test_task_split_is_disjoint_and_every_answer_is_the_sum():
    train, heldout = miniature.make_task()
    assert (len(train), len(heldout)) == (7700, 400)
    train_problems = {r["problem"] for r in train}
    assert len(train_problems) == 7700 and not train_problems & {r["problem"] for r in heldout}
    for r in train + heldout:
        a, b = map(int, r["problem"].split("+"))
        assert 10 <= a <= 99 and 10 <= b <= 99 and int(r["answer"]) == a + b
    assert all(r["solution"] == f"{r['problem']}={r['answer']}" and r["no_solution"] == "" for r in train)
    # the shipped model was pre-trained on this very split
    info = json.loads((miniature.SHIPPED_MODEL / miniature.TASK_FILE).read_text())
    assert info["heldout_digest"] == miniature.split_digest(heldout)


def test_pretraining_formats_are_the_scripts_own_prompts():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(miniature.SHIPPED_MODEL)
    train, heldout = miniature.make_task()
    rows = train[:5]
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


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("miniature")
    cmd = [sys.executable, str(ROOT / "tests" / "miniature.py"), "--output-dir", str(out), "--quick"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc.stdout


def test_quick_run_token_clip_beats_base(quick_run):
    out, stdout = quick_run
    results = json.loads((out / "results.json").read_text())
    heldout = results["heldout_avg"]
    base, token = heldout["base"], heldout["token"]
    assert results["samples_per_model"] == 400 * results["n"]
    assert 0.05 < base < 0.6, "the shipped model should be clearly imperfect but not useless"
    assert all(t >= base + MIN_GAIN for t in token), (base, token)
    assert all(t >= base + 2.5 * results["base_stderr"] for t in token), (base, token, results["base_stderr"])
    # results.json agrees with eval.py's own summary, recomputed here from its samples
    samples = [json.loads(l) for l in (out / "eval-token-s1" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == results["samples_per_model"]
    assert token[0] == pytest.approx(sum(s["correct"] for s in samples) / len(samples))
    assert (out / "miniature.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "token" in stdout and "per seed" in stdout


def test_second_run_into_the_same_directory_is_refused(quick_run):
    out, _ = quick_run
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "miniature.py"), "--output-dir", str(out), "--quick"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode != 0 and "--overwrite" in proc.stderr and "Traceback" not in proc.stderr
