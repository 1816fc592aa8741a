# python -m pytest tests/test_eval_grading.py -q
"""eval.py's verdicts follow the released evaluation's rule: the last \\boxed (no answer when its braces
never close), $...$ wrapping unless a $ is present, math_verify with no fallback and a 5 s timeout,
a string compare only when math_verify raises. Every expected value is written by hand from that rule.
maj@n votes by mathematical equivalence. No vLLM here."""

import subprocess
import sys
import threading
from pathlib import Path

import pytest

import eval as ev

ROOT = Path(__file__).resolve().parent.parent


# -----------------------------------------------------------------------------
# Extraction: the last \boxed, braces matched from it

@pytest.mark.parametrize("text, expected", [
    ("so the answer is \\boxed{42}.", "42"),
    ("\\boxed{ 42 }", "42"),                                              # the content is stripped
    ("\\boxed{\\frac{3}{4}}", "\\frac{3}{4}"),                            # nested braces kept
    ("\\boxed{\\{1, 2\\} \\cup \\{x^{2}\\}}", "\\{1, 2\\} \\cup \\{x^{2}\\}"),
    ("first \\boxed{7}, then \\boxed{8}, finally \\boxed{9}", "9"),        # the last box counts
    ("\\boxed{7} ... wait, actually \\boxed{8", None),                    # last box cut off: no answer,
    ("\\boxed{5} and a cut-off \\boxed{\\frac{1", None),                  # the earlier closed box does not count
    ("the answer is \\boxed 5", None),                                    # no brace after \boxed: no answer
    ("\\boxed {12}", None),                                               # nor when a space comes first
    ("\\boxed 5 since {x} is odd", None),
    ("the answer is 42", None),
    ("", None),
])
def test_extract_boxed(text, expected):
    assert ev.extract_boxed(text) == expected


# -----------------------------------------------------------------------------
# Verdicts: one hand-written case (at least) per rule of the released evaluation

@pytest.mark.parametrize("completion, gold, expected", [
    # a truncated last box: no answer, so wrong, although the earlier box holds the gold
    ("\\boxed{7} ... wait, actually \\boxed{8", "7", False),
    # nested braces: the whole fraction is the answer, equal to 3/4 and to 0.75
    ("\\boxed{\\frac{3}{4}}", "3/4", True),
    ("\\boxed{\\frac{3}{4}}", "0.75", True),
    ("\\boxed{\\frac{4}{3}}", "0.75", False),
    # \boxed without braces: no answer
    ("the answer is \\boxed 5", "5", False),
    # a $ already present: not wrapped again. "$\frac{1}{2}$" is math as it stands; "\$5" (a price)
    # holds a $, so it stays unwrapped and math_verify finds no math in it: wrong.
    ("\\boxed{$\\frac{1}{2}$}", "0.5", True),
    ("\\boxed{\\$5}", "5", False),
    ("\\boxed{5}", "$5$", True),
    # text answers: the same text is equal, another text is not
    ("\\boxed{\\text{even}}", "\\text{even}", True),
    ("\\boxed{\\text{odd}}", "\\text{even}", False),
    # an answer math_verify cannot parse is wrong, even when the strings are identical: math_verify
    # did not raise, so there is no string fallback
    ("\\boxed{?}", "?", False),
    ("\\boxed{}", "5", False),
    # ordinary math
    ("\\boxed{42}", "42", True),
    ("\\boxed{41}", "42", False),
    ("\\boxed{036}", "36", True),                                         # zero-padded AIME answers
    ("\\boxed{2\\sqrt{3}}", "2\\sqrt3", True),
    ("\\boxed{1} no wait \\boxed{42}", "42", True),
    ("\\boxed{42} no wait \\boxed{1}", "42", False),
    ("The answer is 42.", "42", False),                                   # no box, no answer
])
def test_is_correct_follows_the_released_rule(completion, gold, expected):
    assert ev.is_correct(completion, gold) is expected


def test_a_comparison_past_the_timeout_is_wrong():
    # 9^(9^(9^9)) * 1 equals 9^(9^(9^9)), but sympy cannot finish the comparison: math_verify's
    # timeout ends it and the verdict is wrong. Without the timeout it would never return, so it runs
    # in a child process (main thread, as eval.py grades) that the test can abandon. The child sets
    # eval.py's constant to 1 s, not its 5: what is checked is that the constant reaches math_verify.
    code = ("import time, eval; eval.GRADING_TIMEOUT_S = 1; t = time.time(); "
            "v = eval.is_correct('\\\\boxed{9^{9^{9^{9}}} \\\\cdot 1}', '9^{9^{9^{9}}}'); print(v, time.time() - t)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    verdict, seconds = out.stdout.split()
    assert verdict == "False"
    # the alarm's second (SIGALRM): not an answer sympy found, nor math_verify's own 5 s default
    assert 0.9 <= float(seconds) < 4


def test_string_compare_only_when_math_verify_raises():
    # In the main thread math_verify returns, so "?" against "?" is wrong (above). Off the main thread
    # it raises (its SIGALRM timeout cannot be set there): only then do the strings decide, with "$"
    # and spaces removed and case ignored.
    results = []
    t = threading.Thread(target=lambda: results.extend([ev.verdict("?", "?"), ev.verdict("Al ice", "$alice$"),
                                                        ev.verdict("3/4", "0.75")]))
    t.start()
    t.join()
    assert results == [True, True, False]  # 3/4 vs 0.75: equal numbers, different strings
    assert ev.verdict("?", "?") is False


def test_eval_grades_only_in_the_main_thread():
    # Where math_verify's timeout cannot apply, eval.py refuses to grade rather than grade differently.
    errors = []

    def grade():
        try:
            ev.is_correct("\\boxed{1}", "1")
        except RuntimeError as e:
            errors.append(str(e))

    t = threading.Thread(target=grade)
    t.start()
    t.join()
    assert errors and "main thread" in errors[0]


# -----------------------------------------------------------------------------
# maj@n: votes grouped by mathematical equivalence

def rec(problem, sample, answer, correct, tokens=10, truncated=False, benchmark="a"):
    return {"benchmark": benchmark, "problem": problem, "sample": sample, "answer": answer, "correct": correct,
            "tokens": tokens, "truncated": truncated}


@pytest.mark.parametrize("answers, gold, expected", [
    (["033", "12", "33", "12"], "33", True),               # 033 and 33 are one answer: 2-2, the earlier wins
    (["12", "033", "33", "12", "33"], "33", True),          # 3 votes for 33 against 2 for 12
    (["0.5", "7", "1/2", "7", "\\frac{1}{2}"], "7", False), # one half, written three ways, beats 7
    (["7", "0.5", "1/2", "7"], "0.5", False),               # 2-2, the earlier (7) wins
    (["5", "?", "?"], "5", False),                          # identical strings vote together even unparsed
    ([None, None], "5", False),                             # nobody answered: no majority
])
def test_majority_groups_equal_answers(answers, gold, expected):
    samples = [rec(0, j, a, a is not None and ev.verdict(a, gold)) for j, a in enumerate(answers)]
    assert ev.majority_correct(samples) is expected


def test_summarize_hand_made():
    samples = [
        # a/0: 2 of 3 correct; majority 7 (twice) is correct; one sample cut off at the budget.
        rec(0, 0, "7", True, 10), rec(0, 1, "7", True, 20), rec(0, 2, None, False, 30, truncated=True),
        # a/1: one correct sample (3), outvoted by 1/2 written two ways.
        rec(1, 0, "3", True), rec(1, 1, "\\dfrac12", False), rec(1, 2, "0.5", False),
        # a/2: a 1-1 tie; the earlier sample (index 0) wins and is wrong; the unboxed one does not vote.
        rec(2, 2, "5", True), rec(2, 0, "4", False), rec(2, 1, None, False),
        # b/0: nobody boxed an answer, all cut off: no majority.
        *[rec(0, j, None, False, 40, truncated=True, benchmark="b") for j in range(3)],
    ]
    m = ev.summarize(samples, 3)
    assert list(m) == ["a", "b", "all"]
    assert m["a"] == {"problems": 3, "samples": 9, "avg@3": 4 / 9, "pass@3": 1.0, "maj@3": 1 / 3,
                      "mean_tokens": 120 / 9, "truncated": 1 / 9}
    assert m["b"] == {"problems": 1, "samples": 3, "avg@3": 0.0, "pass@3": 0.0, "maj@3": 0.0,
                      "mean_tokens": 40.0, "truncated": 1.0}
    assert m["all"] == {"problems": 4, "samples": 12, "avg@3": 4 / 12, "pass@3": 3 / 4, "maj@3": 1 / 4,
                        "mean_tokens": 240 / 12, "truncated": 4 / 12}


def test_table_prints_percentages_and_totals():
    row = {"problems": 30, "samples": 360, "avg@12": 0.515, "pass@12": 0.8, "maj@12": 2 / 3, "mean_tokens": 12345.4,
           "truncated": 0.125}
    lines = ev.format_table({"aime24": row, "all": row}, 12).splitlines()
    assert lines[0].split() == ["benchmark", "problems", "avg@12", "pass@12", "maj@12", "mean_tokens", "truncated"]
    assert lines[1].split() == ["aime24", "30", "51.5", "80.0", "66.7", "12345", "12.5"]
    assert lines[2].split()[0] == "all"
