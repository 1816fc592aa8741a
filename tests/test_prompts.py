# python -m pytest tests/test_prompts.py -q
"""Prompts and data: the released recipe's strings (written out here by hand), loading, dropping, order."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

import opsd

ROOT = Path(__file__).resolve().parent.parent

PROBLEM, SOLUTION = "What is 17 + 25?", "10 + 20 = 30 and 7 + 5 = 12, so \\boxed{42}."

# the released recipe's strings, typed out independently of opsd.py
EXPECTED_STUDENT = ("Problem: What is 17 + 25?\n\n"
                    "Please reason step by step, and put your final answer within \\boxed{}.")
EXPECTED_TEACHER = (
    "Problem: What is 17 + 25?\n\n"
    "Here is a reference solution to this problem:\n"
    "=== Reference Solution Begin ===\n10 + 20 = 30 and 7 + 5 = 12, so \\boxed{42}.\n=== Reference Solution End ===\n"
    "\n\nAfter reading the reference solution above, make sure you truly understand the reasoning behind each step "
    "\u2014 do not copy or paraphrase it. Now, using your own words and independent reasoning, derive the same final "
    "answer to the problem above. Think step by step, explore different approaches, and don't be afraid to backtrack "
    "or reconsider if something doesn't work out:\n"
    "\n"
    "Please reason step by step, and put your final answer within \\boxed{}."
)


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_messages_are_the_released_strings():
    assert opsd.student_message(PROBLEM) == EXPECTED_STUDENT
    assert opsd.teacher_message(PROBLEM, SOLUTION) == EXPECTED_TEACHER


def test_rendered_prompts_and_thinking_flags(tok):
    student = tok.decode(opsd.render(tok, opsd.student_message(PROBLEM), thinking=False))
    teacher = tok.decode(opsd.render(tok, opsd.teacher_message(PROBLEM, SOLUTION), thinking=True))
    assert student == f"<|im_start|>user\n{EXPECTED_STUDENT}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert teacher == f"<|im_start|>user\n{EXPECTED_TEACHER}<|im_end|>\n<|im_start|>assistant\n"
    # the flags switch: a thinking student ends at assistant\n, a non-thinking teacher with the empty think block
    assert tok.decode(opsd.render(tok, EXPECTED_STUDENT, thinking=True)).endswith("<|im_start|>assistant\n")
    assert tok.decode(opsd.render(tok, EXPECTED_TEACHER, thinking=False)).endswith("assistant\n<think>\n\n</think>\n\n")
    # privileged information reaches the teacher only
    assert SOLUTION in teacher and SOLUTION not in student and "Reference Solution" not in student


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_load_rows_local_files_and_context_column(tmp_path):
    rows = [{"problem": f"p{i}", "solution": f"s{i}", "COT_Reason": f"long trace {i}"} for i in range(3)]
    jsonl = write_jsonl(tmp_path / "d.jsonl", rows)
    assert opsd.load_rows(jsonl, "train", "problem", "solution") == [("p0", "s0"), ("p1", "s1"), ("p2", "s2")]
    assert opsd.load_rows(jsonl, "train", "problem", "COT_Reason")[1] == ("p1", "long trace 1")
    import pandas as pd

    pd.DataFrame(rows).to_parquet(tmp_path / "d.parquet")
    assert opsd.load_rows(str(tmp_path / "d.parquet"), "train", "problem", "solution")[2] == ("p2", "s2")


def test_missing_column_names_it_and_the_columns_that_exist(tmp_path, capsys):
    path = write_jsonl(tmp_path / "d.jsonl", [{"problem": "p", "answer": "1"}])
    with pytest.raises(opsd.Refusal) as refused:
        opsd.load_rows(path, "train", "problem", "solution")
    assert "no column 'solution' (--context-column); its columns are ['problem', 'answer']" in str(refused.value)
    with pytest.raises(opsd.Refusal) as refused:
        opsd.load_rows(path, "train", "question", "answer")
    assert "no column 'question' (--problem-column); its columns are" in str(refused.value)
    bad = tmp_path / "d.csv"
    bad.write_text("problem,solution\n")
    with pytest.raises(opsd.Refusal) as refused:
        opsd.load_rows(str(bad), "train", "problem", "solution")
    assert str(refused.value).endswith("(a hub id needs network; else give a local .json, .jsonl or .parquet file)")


def test_long_rows_are_dropped_and_counted(tok, capsys):
    rows = [("short", "s"), ("short too", "t"), ("long", "word " * 400)]
    limit = len(opsd.render(tok, opsd.teacher_message("short too", "t"), True)) + 5
    prompts = opsd.build_prompts(tok, rows, student_thinking=False, teacher_thinking=True, max_prompt_length=limit)
    assert len(prompts) == 2 and "1 dropped" in capsys.readouterr().out
    student, teacher = prompts[0]
    assert student == opsd.render(tok, opsd.student_message("short"), False)
    assert teacher == opsd.render(tok, opsd.teacher_message("short", "s"), True)
    with pytest.raises(opsd.Refusal) as refused:
        opsd.build_prompts(tok, rows, student_thinking=False, teacher_thinking=True, max_prompt_length=10)
    assert "No row fits --max-prompt-length 10" in str(refused.value)


def test_data_order_shards_epochs_and_seed():
    n, per_step = 10, 4
    steps = [opsd.step_indices(s, per_step, n, seed=42) for s in range(5)]  # 20 positions = 2 epochs
    stream = [i for s in steps for i in s]
    assert sorted(stream[:10]) == list(range(10)) and sorted(stream[10:]) == list(range(10))  # each epoch covers all
    assert stream[:10] != stream[10:]  # reshuffled per epoch
    assert steps[0] == opsd.step_indices(0, per_step, n, seed=42)  # a function of (seed, step) only
    assert steps[0] != opsd.step_indices(0, per_step, n, seed=43)


def test_student_prompt_eval_is_eval_py_s_prompt_token_for_token(tok):
    import eval as evaluation

    expected = "What is 17 + 25?\n\nPlease reason step by step, and put your final answer within \\boxed{}."  # by hand
    assert opsd.student_message(PROBLEM, "eval") == expected and opsd.student_message(PROBLEM) == EXPECTED_STUDENT
    assert opsd.parse_args(["--student-prompt", "eval"]).student_prompt == "eval"
    assert opsd.parse_args([]).student_prompt == "recipe"
    for thinking in (False, True):
        ids = opsd.build_prompts(tok, [(PROBLEM, SOLUTION)], student_thinking=thinking, teacher_thinking=True,
                                 max_prompt_length=10_000, student_prompt="eval")[0][0]
        assert ids == evaluation.prompt_ids(tok, PROBLEM, thinking)  # eval.py --thinking / --no-thinking
        assert tok.decode(ids).startswith(f"<|im_start|>user\n{expected}<|im_end|>\n<|im_start|>assistant\n")


def test_two_context_columns_are_joined_and_each_row_checked(tmp_path, capsys):
    rows = [{"problem": f"p{i}", "solution": f"s{i}", "COT_Reason": f"long trace {i}"} for i in range(3)]
    jsonl = write_jsonl(tmp_path / "d.jsonl", rows)
    assert opsd.load_rows(jsonl, "train", "problem", "solution,COT_Reason")[1] == ("p1", "s1\n\nlong trace 1")
    assert opsd.load_rows(jsonl, "train", "problem", "COT_Reason, solution")[0] == ("p0", "long trace 0\n\ns0")
    rows[2]["COT_Reason"] = None
    jsonl = write_jsonl(tmp_path / "e.jsonl", rows)
    with pytest.raises(opsd.Refusal) as refused:
        opsd.load_rows(jsonl, "train", "problem", "solution,COT_Reason")
    assert str(refused.value) == f"--dataset {jsonl}, row 3: 'COT_Reason' is None, not a string: fix or drop the row."
    with pytest.raises(opsd.Refusal) as refused:
        opsd.load_rows(jsonl, "train", "problem", "solution,")
    assert "has no column '' (--context-column)" in str(refused.value)
    with pytest.raises(opsd.Refusal) as refused:
        opsd.load_rows(jsonl, "train", "problem", "solution,trace")
    assert "has no column 'trace' (--context-column)" in str(refused.value)


# -- what the teacher is shown (--teacher-context) ----------------------------------------------------------------

ROWS = [("What is 17 + 25?", "10 + 20 = 30 and 7 + 5 = 12, so \\boxed{42}."),
        ("Halve 1.", "Half of one is \\boxed{\\frac{1}{2}}, not \\boxed{2} first: \\boxed{\\frac{1}{2}}"),
        ("What is 2 + 2?", "Two and two: \\boxed{4}."),
        ("What is 3 * 3?", "Three threes: \\boxed{9}.")]
# the teacher's messages, typed out: the reference block, and with no context the recipe's student message
NO_REFERENCE = "Problem: What is 17 + 25?\n\nPlease reason step by step, and put your final answer within \\boxed{}."
ANSWER_ONLY = EXPECTED_TEACHER.replace("10 + 20 = 30 and 7 + 5 = 12, so \\boxed{42}.", "\\boxed{42}")
HALF_ANSWER = "=== Reference Solution Begin ===\n\\boxed{\\frac{1}{2}}\n=== Reference Solution End ==="


def teacher_texts(tok, shown, seed=3, rows=ROWS):
    prompts = opsd.build_prompts(tok, opsd.shown_contexts(rows, shown, seed), student_thinking=False,
                                 teacher_thinking=True, max_prompt_length=4096)
    return [tok.decode(teacher) for _, teacher in prompts], [student for student, _ in prompts]


def test_what_the_teacher_is_shown_is_a_switch(tok):
    chat = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"  # thinking on: no empty think block
    reference, students = teacher_texts(tok, "reference")
    assert reference[0] == chat.format(EXPECTED_TEACHER)  # the default is unchanged
    none, none_students = teacher_texts(tok, "none")
    assert none[0] == chat.format(NO_REFERENCE) and all("Reference" not in t for t in none)
    answer, _ = teacher_texts(tok, "answer")
    assert answer[0] == chat.format(ANSWER_ONLY)
    assert HALF_ANSWER in answer[1]  # the LAST \boxed{}, nested braces whole
    other, other_students = teacher_texts(tok, "other")
    assert students == none_students == other_students  # the student never changes
    # another row's reference, each row's exactly once, never its own
    donors = [next(j for j, (_, ref) in enumerate(ROWS) if ref in text) for text in other]
    assert sorted(donors) == [0, 1, 2, 3] and all(d != i for i, d in enumerate(donors)), donors
    assert all(t.replace(ROWS[d][1], ROWS[i][1]) == reference[i] for i, (t, d) in enumerate(zip(other, donors)))


def test_the_other_rows_pairing_is_a_derangement_fixed_by_the_seed_alone():
    rows = [(f"p{i}", f"r{i}") for i in range(50)]
    for seed in range(20):
        donors = [int(ref[1:]) for _, ref in opsd.shown_contexts(rows, "other", seed)]
        assert sorted(donors) == list(range(50)) and all(d != i for i, d in enumerate(donors)), (seed, donors)
    assert opsd.shown_contexts(rows, "other", 1) != opsd.shown_contexts(rows, "other", 2)
    # another process, as another rank or a resume: other hash seed, other torch RNG state, same pairing
    code = ("import os, random, sys, torch; torch.manual_seed(os.getpid()); random.seed(); import opsd; "
            f"print([c for _, c in opsd.shown_contexts({rows!r}, 'other', 7)])")
    for rank in ("0", "1"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True,
                             env={**os.environ, "RANK": rank, "WORLD_SIZE": "2", "PYTHONHASHSEED": str(11 + int(rank))})
        assert out.stdout.strip() == str([c for _, c in opsd.shown_contexts(rows, "other", 7)])
    with pytest.raises(opsd.Refusal, match="--teacher-context other needs at least two rows"):
        opsd.shown_contexts(rows[:1], "other", 0)


def test_a_reference_without_boxed_is_refused_naming_its_row_and_the_fingerprint_follows_the_switch(tok, tmp_path):
    rows = ROWS + [("Name a prime.", "Seven is prime.")]
    with pytest.raises(opsd.Refusal) as refusal:
        opsd.shown_contexts(rows, "answer", 0)
    assert str(refusal.value) == "--teacher-context answer: row 5 ('Name a prime.') has no \\boxed{} in its reference: add one, or drop the row."
    args = opsd.parse_args(["--teacher-context", "answer"])
    assert args.teacher_context == "answer" and opsd.parse_args([]).teacher_context == "reference"
    device = torch.device("cpu")
    prints = set()
    for shown in opsd.TEACHER_CONTEXTS:  # a resume with another switch finds other prompt ids, and is refused
        prompts = opsd.build_prompts(tok, opsd.shown_contexts(ROWS, shown, 0), student_thinking=False,
                                     teacher_thinking=True, max_prompt_length=4096)
        prints.add(opsd.run_record(opsd.parse_args(["--model", str(tmp_path)]), prompts, device)
                   ["prompt_ids_sha256"])
    assert len(prints) == 4
