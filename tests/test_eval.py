# python -m pytest tests/test_eval.py -x -q
"""eval.py end to end: the prompt against a hand-written string, then runs of main() on the tiny Qwen3
with vLLM on CPU (files, counts, metrics recomputed from the file, resume after a kill, many seeded
requests at once, an adapter from opsd.py and the hashes recorded, the LoRA ranks vLLM takes), and the metrics of
a model that answers (the miniature's) recomputed from the sums, with the cost projected by --limit.
Grading: test_eval_grading.py; bad input: test_eval_input.py; the command line: test_eval_cli.py."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

import eval as ev
from test_eval_input import adapter_sha256_by_definition, fingerprint_by_definition

DATA = Path(__file__).resolve().parent / "data" / "eval_tiny.jsonl"
ROOT = Path(__file__).resolve().parent.parent
N, MAX_NEW = 2, 48


# -----------------------------------------------------------------------------
# Prompt

def test_prompt_is_the_released_one(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    question = "What is 17 + 25?"
    user = ("<|im_start|>user\nWhat is 17 + 25?\n\nPlease reason step by step, and put your final answer "
            "within \\boxed{}.<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(ev.prompt_ids(tok, question, thinking=True)) == user
    assert tok.decode(ev.prompt_ids(tok, question, thinking=False)) == user + "<think>\n\n</think>\n\n"


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
        assert s["truncated"] <= (s["tokens"] == MAX_NEW)  # only a sample at the budget can be cut off
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
    assert m["truncated"] == sum(s["truncated"] for s in samples) / (3 * N)
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


def test_metrics_count_records_already_in_the_file(tiny_model_dir, full_run, tmp_path):
    # The tiny random model never boxes an answer, so seed the file with correct records a resumed
    # run must keep: problem 0 both samples ("42", right), problem 1 sample 0 ("3/4", right).
    hashes = [p["hash"] for p in ev.load_problems("tiny", str(DATA), "problem", "answer")]
    seeded = [{"benchmark": "tiny", "problem": i, "sample": j, "hash": hashes[i], "answer": a, "correct": True,
               "tokens": 10, "truncated": False} for i, j, a in [(0, 0, "42"), (0, 1, "42"), (1, 0, "\\frac{3}{4}")]]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in seeded))
    shutil.copy(full_run / "config.json", tmp_path / "config.json")
    summary = run(tiny_model_dir, tmp_path)
    drawn = [s for s in read_jsonl(tmp_path / "samples.jsonl") if "completion" in s]
    assert len(drawn) == 3 and not any(s["correct"] or s["answer"] for s in drawn)
    # Problem 0: 2/2 right, majority right. Problem 1: 1/2 right, the only vote is right. Problem 2: none.
    assert summary["metrics"]["tiny"] == {
        "problems": 3, "samples": 6, f"avg@{N}": 3 / 6, f"pass@{N}": 2 / 3, f"maj@{N}": 2 / 3,
        "mean_tokens": (3 * 10 + sum(s["tokens"] for s in drawn)) / 6,
        "truncated": sum(s["truncated"] for s in drawn) / 6,
    }


def test_a_run_that_died_before_sampling_does_not_block_the_next(tiny_model_dir, tmp_path):
    # A first attempt with a mistyped --model may leave config.json behind, but no sample: the
    # corrected rerun must go ahead, and record its own settings.
    (tmp_path / "config.json").write_text(json.dumps({"model": "Qwen/Qwen3-1.7b-typo"}))
    summary = run(tiny_model_dir, tmp_path, "--n", "1", "--max-new-tokens", "1")
    assert summary["metrics"]["tiny"]["samples"] == 3
    assert json.loads((tmp_path / "config.json").read_text())["model"] == tiny_model_dir


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
    # config.json records what lies behind the paths, by the definitions written out in test_eval_input.py.
    recorded = json.loads((tmp_path / "eval-random" / "config.json").read_text())
    assert recorded["adapter_sha256"] == adapter_sha256_by_definition(tmp_path / "random")
    assert recorded["model_fingerprint"] == fingerprint_by_definition(Path(tiny_model_dir))
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


def limit_by_definition(name, count, limit):
    """--help's words: `limit` of the problems, drawn at random with a fixed seed (a generator seeded
    "0/NAME" shuffles the indices, the first `limit` are scored)."""
    import random

    return sorted(random.Random(f"0/{name}").sample(range(count), count)[:limit])


def test_limit_draws_at_random_the_same_problems_every_run():
    # A year's 30 problems, 2 scored (README's first-day probe): a draw, not the first two.
    for name in ev.HUB_IDS:
        assert ev.limited(name, 30, 2) == limit_by_definition(name, 30, 2)
    assert any(ev.limited(name, 30, 2) != [0, 1] for name in ev.HUB_IDS)
    # a smaller limit's problems are among a larger one's, and no limit (or one past the end) is all
    assert set(ev.limited("aime24", 30, 2)) <= set(ev.limited("aime24", 30, 10))
    assert ev.limited("aime24", 30, None) == ev.limited("aime24", 30, 30) == list(range(30))
    # The draw does not wander between processes (str seeds are hashed, unlike hash()).
    import subprocess
    import sys

    code = "import random; print(random.Random('0/aime24').sample(range(30), 30)[:2])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert sorted(json.loads(out.stdout)) == ev.limited("aime24", 30, 2)


def test_a_full_run_after_limit_keeps_its_samples(tiny_model_dir, full_run, tmp_path, capsys):
    run(tiny_model_dir, tmp_path, "--limit", "2")
    drawn = limit_by_definition("tiny", 3, 2)
    assert f"--limit 2: problems (counted from 0) tiny {drawn[0]}, {drawn[1]}" in capsys.readouterr().out
    first = by_key(read_jsonl(tmp_path / "samples.jsonl"))
    assert sorted(first) == [("tiny", i, j) for i in drawn for j in range(N)]
    run(tiny_model_dir, tmp_path)
    assert f"{2 * N} of {3 * N} samples already in" in capsys.readouterr().out
    # kept, not redrawn; and what the full run added is what an uninterrupted full run draws
    whole = by_key(read_jsonl(tmp_path / "samples.jsonl"))
    assert all(whole[k] == first[k] for k in first) and len(whole) == 3 * N
    assert whole == by_key(read_jsonl(full_run / "samples.jsonl"))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary == json.loads((full_run / "summary.json").read_text())


def test_lora_ranks_are_those_vllm_takes():
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    assert ev.VLLM_LORA_RANKS == get_args(MaxLoRARanks)


def test_metrics_on_a_model_that_answers_and_the_cost_of_the_whole(tmp_path, capsys):
    """avg@k, pass@k and maj@k where they are neither 0 nor 1: the miniature's starting model on 30 of 40
    held-out sums (--limit 30, drawn; it drops carries, so some samples are wrong), regraded here from the sums
    and voted here by hand; and the whole evaluation's hours, projected by hand from the lengths and the recorded times."""
    import time
    from collections import Counter

    heldout = [json.loads(line) for line in (ROOT / "tests" / "miniature" / "heldout.jsonl").read_text().splitlines()]
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in heldout[:40]))
    out, n, scored = tmp_path / "out", 4, 30
    started = time.perf_counter()
    ev.main(["--model", str(ROOT / "tests" / "miniature" / "model"), "--data", f"sums={data}", "--n", str(n),
             "--max-new-tokens", "48", "--no-thinking", "--limit", str(scored), "--output-dir", str(out)])
    wall = time.perf_counter() - started
    samples = read_jsonl(out / "samples.jsonl")
    drawn = limit_by_definition("sums", 40, scored)
    assert sorted((s["problem"], s["sample"]) for s in samples) == [(i, j) for i in drawn for j in range(n)]
    boxed = {(s["problem"], s["sample"]): (re.findall(r"\\boxed\{(\d+)\}", s["completion"]) or [None])[-1]
             for s in samples}
    right = {key: answer == str(sum(map(int, heldout[key[0]]["problem"].split("+")))) for key, answer in boxed.items()}
    avg = sum(right.values()) / len(right)
    passed = sum(any(right[i, j] for j in range(n)) for i in drawn) / scored
    majority = 0
    for i in drawn:
        votes = Counter(boxed[i, j] for j in range(n) if boxed[i, j] is not None)
        if votes:
            top = max(votes.values())
            first = next(boxed[i, j] for j in range(n) if boxed[i, j] is not None and votes[boxed[i, j]] == top)
            majority += first == heldout[i]["answer"]
    summary = json.loads((out / "summary.json").read_text())
    m = summary["metrics"]["sums"]
    assert m[f"avg@{n}"] == pytest.approx(avg) and m[f"pass@{n}"] == pytest.approx(passed)
    assert m[f"maj@{n}"] == pytest.approx(majority / scored)
    assert 0.2 < avg < 0.9 and avg < passed  # an imperfect model: the metrics differ and each can be wrong
    # The cost: all 40 x n answers at this run's mean length, at the rate it drew its own, after its start.
    cost = summary["cost"]
    assert 0 < cost["start_seconds"] and 0 < cost["sampling_seconds"]
    assert cost["start_seconds"] + cost["sampling_seconds"] < wall  # seconds, both within the run
    tokens = sum(s["tokens"] for s in samples)
    mean, rate = tokens / (scored * n), tokens / cost["sampling_seconds"]
    hours = (cost["start_seconds"] + 40 * n * mean / rate) / 3600
    assert cost["projected_hours"] == pytest.approx(hours, rel=1e-12) and cost["whole_answers"] == 40 * n
    printed = capsys.readouterr().out
    assert f"{scored * n} answers of {mean:,.0f} tokens on average; {tokens:,} tokens drawn" in printed
    assert f"({rate:,.0f} tokens/s)" in printed and f"{hours:.2f} h on this machine" in printed
    assert f"pass --answer-tokens {round(mean)} to tests/gpu_check/budget.py --eval" in printed
