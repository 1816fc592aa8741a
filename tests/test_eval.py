# python -m pytest tests/test_eval.py -x -q
"""eval.py: grading, metrics and prompts against hand-written values; end-to-end runs of main() on
the tiny Qwen3 with vLLM on CPU (files, counts, resume after a kill, an adapter from opsd.py)."""

import json
import shutil
import threading
from pathlib import Path

import pytest
import torch

import eval as ev

DATA = Path(__file__).resolve().parent / "data" / "eval_tiny.jsonl"
N, MAX_NEW = 2, 48


# -----------------------------------------------------------------------------
# extract_boxed

@pytest.mark.parametrize("text, expected", [
    ("so the answer is \\boxed{42}.", "42"),
    ("\\boxed{\\frac{3}{4}}", "\\frac{3}{4}"),                          # nested braces kept
    ("\\boxed{\\{1, 2\\} \\cup \\{x^{2}\\}}", "\\{1, 2\\} \\cup \\{x^{2}\\}"),
    ("first \\boxed{7}, then \\boxed{8}, finally \\boxed{9}", "9"),      # the last box counts
    ("\\boxed {12}", "12"),
    ("\\boxed{5} and a cut-off \\boxed{\\frac{1", "5"),                  # an unclosed box is no answer
    ("the answer is 42", None),
    ("", None),
])
def test_extract_boxed(text, expected):
    assert ev.extract_boxed(text) == expected


# -----------------------------------------------------------------------------
# is_correct

@pytest.mark.parametrize("completion, answer, expected", [
    ("\\boxed{42}", "42", True),
    ("\\boxed{41}", "42", False),
    ("\\boxed{036}", "36", True),                                        # AIME answers are often zero-padded
    ("\\boxed{\\frac{3}{4}}", "3/4", True),
    ("\\boxed{\\dfrac34}", "\\frac{3}{4}", True),
    ("\\boxed{0.75}", "\\frac{3}{4}", True),
    ("\\boxed{3/4}", "\\frac{3}{4}", True),
    ("\\boxed{\\frac{4}{3}}", "\\frac{3}{4}", False),
    ("\\boxed{2\\sqrt{3}}", "2\\sqrt3", True),
    ("\\boxed{1} no wait \\boxed{42}", "42", True),                     # several boxes: the last counts
    ("\\boxed{42} no wait \\boxed{1}", "42", False),
    ("The answer is 42.", "42", False),                                 # no box, no answer
    ("\\boxed{5\\text{ cm}}", "5", True),                               # units
    ("\\boxed{90^\\circ}", "90", True),
    ("\\boxed{x = 5}", "5", True),
    ("\\boxed{\\text{Alice}}", "Alice", True),                           # text: the string fallback
    ("\\boxed{\\text{Bob}}", "Alice", False),
])
def test_is_correct(completion, answer, expected):
    assert ev.is_correct(completion, answer) is expected


def test_is_correct_off_the_main_thread():
    # math_verify's SIGALRM timeout raises in other threads; is_correct must still grade there.
    results = []
    t = threading.Thread(target=lambda: results.extend([ev.is_correct("\\boxed{\\frac12}", "0.5"),
                                                        ev.is_correct("\\boxed{3}", "0.5")]))
    t.start()
    t.join()
    assert results == [True, False]


# -----------------------------------------------------------------------------
# Metrics on hand-made samples

def rec(benchmark, problem, sample, answer, correct, tokens=10):
    return {"benchmark": benchmark, "problem": problem, "sample": sample, "answer": answer, "correct": correct,
            "tokens": tokens}


def test_summarize_hand_made():
    samples = [
        # a/0: 2 of 3 correct; majority 7 (twice) is correct.
        rec("a", 0, 0, "7", True, 10), rec("a", 0, 1, "7", True, 20), rec("a", 0, 2, "8", False, 30),
        # a/1: one correct sample, outvoted by "\dfrac12" and "\frac{1}{2}" (the same answer once normalised).
        rec("a", 1, 0, "3", True), rec("a", 1, 1, "\\dfrac12", False), rec("a", 1, 2, "\\frac{1}{2}", False),
        # a/2: a 1-1 tie; the earlier sample (index 0) wins and is wrong; the unboxed one does not vote.
        rec("a", 2, 2, "5", True), rec("a", 2, 0, "4", False), rec("a", 2, 1, None, False),
        # b/0: nobody boxed an answer: no majority.
        rec("b", 0, 0, None, False, 40), rec("b", 0, 1, None, False, 40), rec("b", 0, 2, None, False, 40),
    ]
    m = ev.summarize(samples, 3)
    assert list(m) == ["a", "b", "all"]
    assert m["a"] == {"problems": 3, "samples": 9, "avg@3": 4 / 9, "pass@3": 1.0, "maj@3": 1 / 3,
                      "mean_tokens": 120 / 9}
    assert m["b"] == {"problems": 1, "samples": 3, "avg@3": 0.0, "pass@3": 0.0, "maj@3": 0.0,
                      "mean_tokens": 40.0}
    assert m["all"] == {"problems": 4, "samples": 12, "avg@3": 4 / 12, "pass@3": 3 / 4, "maj@3": 1 / 4,
                        "mean_tokens": 240 / 12}


def test_table_prints_percentages_and_totals():
    row = {"problems": 30, "samples": 360, "avg@12": 0.515, "pass@12": 0.8, "maj@12": 2 / 3, "mean_tokens": 12345.4}
    lines = ev.format_table({"aime24": row, "all": row}, 12).splitlines()
    assert lines[0].split() == ["benchmark", "problems", "avg@12", "pass@12", "maj@12", "mean_tokens"]
    assert lines[1].split() == ["aime24", "30", "51.5", "80.0", "66.7", "12345"]
    assert lines[2].split()[0] == "all"


# -----------------------------------------------------------------------------
# Prompts and bad input

def test_prompt_is_methods_section_8(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    question = "What is 17 + 25?"
    user = ("<|im_start|>user\nWhat is 17 + 25?\n\nPlease reason step by step, and put your final answer "
            "within \\boxed{}.<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(ev.prompt_ids(tok, question, thinking=True)) == user
    assert tok.decode(ev.prompt_ids(tok, question, thinking=False)) == user + "<think>\n\n</think>\n\n"


@pytest.mark.parametrize("argv, message", [
    (["--benchmarks", "aime23"], "Unknown benchmark 'aime23'"),
    (["--data", "tiny"], "--data takes NAME=PATH"),
    (["--data", "tiny=/nonexistent.jsonl"], "no file at /nonexistent.jsonl"),
    (["--data", f"tiny={DATA}", "--answer-column", "solution"], "has no column 'solution'"),
    (["--data", f"tiny={DATA}", "--adapter", "/nonexistent"], "No adapter_config.json"),
])
def test_bad_input_fails_early_with_one_sentence(tmp_path, argv, message):
    with pytest.raises(SystemExit) as e:
        ev.main(["--model", "unused", "--output-dir", str(tmp_path), *argv])
    assert message in str(e.value)


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_local_benchmark_files(tmp_path, suffix):
    rows = [{"problem": "What is 17 + 25?", "answer": "42"}, {"problem": "Compute 2^{10}.", "answer": "1024"}]
    path = tmp_path / f"bench{suffix}"
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    assert ev.load_problems("b", str(path), "problem", "answer") == rows
    # An integer answer column (as in some AIME copies) reads as text.
    assert ev.load_problems("tiny", str(DATA), "problem", "answer")[2] == {
        "problem": "What is the remainder when 100 is divided by 7?", "answer": "2"}


def test_restart_with_other_sampling_settings_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({k: None for k in ev.SAMPLING_KEYS}))
    with pytest.raises(SystemExit) as e:
        ev.main(["--model", "unused", "--data", f"tiny={DATA}", "--output-dir", str(tmp_path)])
    assert "holds samples drawn with other model" in str(e.value)


# -----------------------------------------------------------------------------
# End to end on the tiny model

def run(model_dir, out_dir, *extra):
    argv = ["--model", model_dir, "--data", f"tiny={DATA}", "--n", str(N), "--max-new-tokens", str(MAX_NEW),
            "--enforce-eager", "--output-dir", str(out_dir), *extra]
    return ev.main(argv)


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


@pytest.fixture(scope="module")
def full_run(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval-full")
    run(tiny_model_dir, out)
    return out


def by_key(samples):
    return {(s["benchmark"], s["problem"], s["sample"]): s for s in samples}


def test_end_to_end_files_counts_and_metrics(full_run):
    summary = json.loads((full_run / "summary.json").read_text())
    samples = read_jsonl(full_run / "samples.jsonl")
    # Counts: every (problem, sample) exactly once, 3 problems x n.
    assert sorted(by_key(samples)) == [("tiny", i, j) for i in range(3) for j in range(N)]
    assert len(samples) == 3 * N
    for s in samples:
        assert 1 <= s["tokens"] <= MAX_NEW
        if s["tokens"] < MAX_NEW:
            assert not s["truncated"]
        assert s["answer"] == ev.extract_boxed(s["completion"])
    # Metrics recomputed here, by their definitions, from the file.
    answers = [r["answer"] for r in read_jsonl(DATA)]
    correct = {(s["problem"], s["sample"]): s["correct"] for s in samples}
    assert all(correct[i, j] == ev.is_correct(by_key(samples)["tiny", i, j]["completion"], str(answers[i]))
               for i in range(3) for j in range(N))
    m = summary["metrics"]["tiny"]
    assert m["problems"] == 3 and m["samples"] == 3 * N
    assert m[f"avg@{N}"] == sum(correct.values()) / (3 * N)
    assert m[f"pass@{N}"] == sum(any(correct[i, j] for j in range(N)) for i in range(3)) / 3
    assert m["mean_tokens"] == sum(s["tokens"] for s in samples) / (3 * N)
    if not any(s["answer"] for s in samples):  # the random model boxes nothing: no majority either
        assert m[f"maj@{N}"] == 0.0
    assert summary["metrics"]["all"] == m
    assert summary["config"]["n"] == N and summary["config"]["thinking"] is True


def test_restart_after_a_kill_gives_the_uninterrupted_summary(tiny_model_dir, full_run, tmp_path):
    lines = (full_run / "samples.jsonl").read_text().splitlines(keepends=True)
    shutil.copy(full_run / "config.json", tmp_path / "config.json")
    # Two whole lines and half of the third: what a kill mid-write leaves.
    (tmp_path / "samples.jsonl").write_text("".join(lines[:2]) + lines[2][: len(lines[2]) // 2])
    run(tiny_model_dir, tmp_path)
    assert json.loads((tmp_path / "summary.json").read_text()) == json.loads((full_run / "summary.json").read_text())
    # Not only the summary: the redrawn samples are the ones the uninterrupted run drew.
    assert by_key(read_jsonl(tmp_path / "samples.jsonl")) == by_key(read_jsonl(full_run / "samples.jsonl"))


def test_metrics_count_records_already_in_the_file(tiny_model_dir, tmp_path):
    # The tiny random model never boxes an answer, so seed the file with correct records a resumed
    # run must keep: problem 0 both samples ("42", right), problem 1 sample 0 ("3/4", right).
    seeded = [rec("tiny", 0, 0, "42", True), rec("tiny", 0, 1, "42", True), rec("tiny", 1, 0, "\\frac{3}{4}", True)]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in seeded))
    summary = run(tiny_model_dir, tmp_path)
    drawn = [s for s in read_jsonl(tmp_path / "samples.jsonl") if "completion" in s]
    assert len(drawn) == 3 and not any(s["correct"] or s["answer"] for s in drawn)
    # Problem 0: 2/2 right, majority right. Problem 1: 1/2 right, the only vote is right. Problem 2: none.
    assert summary["metrics"]["tiny"] == {
        "problems": 3, "samples": 6, f"avg@{N}": 3 / 6, f"pass@{N}": 2 / 3, f"maj@{N}": 2 / 3,
        "mean_tokens": (3 * 10 + sum(s["tokens"] for s in drawn)) / 6,
    }


def test_adapter_is_applied(tiny_model_dir, full_run, tmp_path):
    from transformers import AutoModelForCausalLM

    import opsd

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    opsd.add_lora(model, r=8, alpha=16)
    opsd.save_adapter(model, tmp_path / "zero", tiny_model_dir)  # B = 0: the base model exactly
    torch.manual_seed(0)
    for m in opsd.lora_layers(model).values():
        torch.nn.init.normal_(m.lora_B, std=0.5)
    opsd.save_adapter(model, tmp_path / "random", tiny_model_dir)

    base = by_key(read_jsonl(full_run / "samples.jsonl"))
    completions = {}
    for name in ("zero", "random"):
        run(tiny_model_dir, tmp_path / f"eval-{name}", "--adapter", str(tmp_path / name))
        samples = by_key(read_jsonl(tmp_path / f"eval-{name}" / "samples.jsonl"))
        assert samples.keys() == base.keys()
        completions[name] = {k: s["completion"] for k, s in samples.items()}
    # Same prompts and per-sample seeds, so only the weights differ: a zero update must reproduce
    # the base samples token for token, and a large random one must change (nearly) all of them.
    assert all(completions["zero"][k] == base[k]["completion"] for k in base)
    assert sum(completions["random"][k] != base[k]["completion"] for k in base) >= len(base) - 1


def test_many_seeded_requests_at_once(tiny_model_dir, full_run, tmp_path):
    # 3 prompts of ~50 tokens x 30 samples queue ~4,500 prompt tokens, more than one vLLM step takes on
    # CPU (4,096): with chunked prefill a prompt is then split, and rewinding its seeded generator
    # crashed the CPU build ("CPU Generator does not use offset").
    many = 30
    run(tiny_model_dir, tmp_path, "--n", str(many))
    samples = by_key(read_jsonl(tmp_path / "samples.jsonl"))
    assert sorted(samples) == [("tiny", i, j) for i in range(3) for j in range(many)]
    # A seeded sample does not depend on what else is queued: the first N equal the 6-request run's.
    base = by_key(read_jsonl(full_run / "samples.jsonl"))
    assert all(samples[k]["completion"] == base[k]["completion"] for k in base)
