# python -m pytest tests/test_errors.py -q
"""A user's mistakes stop opsd.py early (before the model or vLLM loads) with one sentence, never a traceback,
and under torchrun the sentence is said once. Each case's expected sentence is written here by hand."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import opsd

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "math_train.jsonl"


def error_of(argv, capsys):
    """Run opsd.main in this process; return what it printed to stderr when it stopped."""
    with pytest.raises(SystemExit) as stop:
        opsd.main(argv)
    assert stop.value.code == 2
    return capsys.readouterr().err


@pytest.fixture
def base(tiny_model_dir, tmp_path):
    return ["--model", tiny_model_dir, "--dataset", str(DATA), "--device", "cpu", "--output-dir", str(tmp_path / "out")]


def write(path, text):
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("extra, message", [
    (["--max-new-tokens", "0"], "--max-prompt-length and --max-new-tokens must be at least 1."),
    (["--top-p", "0"], "--top-p must lie in (0, 1]."),
    (["--lr", "-1"], "--lr must be positive"),
    (["--lora-r", "0"], "--lora-r must be at least 1"),
    (["--tau", "0"], "--tau must be positive."),
    (["--top-k", "0"], "--top-k must be -1 (off) or at least 1."),
    (["--vllm-memory", "1.5"], "--vllm-memory must lie in (0, 1]."),
    (["--skip-first-tokens", "1024"], "--skip-first-tokens must lie in [0, --max-new-tokens)."),
    (["--ema-decay", "0.9"], "--ema-decay needs --teacher ema."),
    (["--teacher", "ema", "--ema-decay", "1"], "--ema-decay must lie in (0, 1)."),
    (["--resume", "--overwrite"], "pass one."),
    (["--max-prompt-length", "4000", "--max-new-tokens", "100"],
     "--max-prompt-length 4000 + --max-new-tokens 100 exceeds the model's context of 4096 tokens: lower one of them."),
])
def test_bad_flags(base, extra, message, capsys):
    assert message in error_of(base + extra, capsys)


def test_bad_paths(base, tmp_path, capsys):
    typo = str(tmp_path / "tiny-qwn3")  # a local path that does not exist: no hub lookup, no retries
    assert f"--model {typo}: no such directory." in error_of(base + ["--model", typo], capsys)
    missing = str(tmp_path / "nope.jsonl")
    assert f"--dataset {missing}: no such file." in error_of(base + ["--dataset", missing], capsys)
    blocked = write(tmp_path / "a-file", "")  # a directory cannot be made under a file
    err = error_of(base + ["--output-dir", f"{blocked}/run"], capsys)
    assert f"--output-dir {blocked}/run is not writable" in err


def test_bad_data_files(base, tmp_path, capsys):
    empty = write(tmp_path / "empty.jsonl", "")
    assert f"--dataset {empty} holds no rows." in error_of(base + ["--dataset", empty], capsys)
    row = json.dumps({"problem": "p", "solution": "s"})
    broken = write(tmp_path / "broken.jsonl", f"{row}\n{row}\n{{\"problem\": \"p\", \n")
    assert f"--dataset {broken}, line 3: not valid JSON" in error_of(base + ["--dataset", broken], capsys)
    null = write(tmp_path / "null.jsonl", f"{row}\n" + json.dumps({"problem": "p", "solution": None}) + "\n")
    assert f"--dataset {null}, row 2: 'solution' is None, not a string." in error_of(base + ["--dataset", null], capsys)
    no_column = write(tmp_path / "cols.jsonl", json.dumps({"problem": "p", "answer": "1"}) + "\n")
    err = error_of(base + ["--dataset", no_column], capsys)
    assert f"--dataset {no_column} has no column 'solution' (--context-column); its columns are ['problem', 'answer']." in err
    err = error_of(base + ["--data-select", "hard"], capsys)
    assert f"--data-select hard needs the column 'source', which --dataset {DATA} does not have." in err


def test_one_sentence_once_under_torchrun_without_a_traceback_of_ours(tiny_model_dir, tmp_path):
    empty = write(tmp_path / "empty.jsonl", "")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(ROOT / "opsd.py"),
           "--model", tiny_model_dir, "--dataset", empty, "--device", "cpu", "--output-dir", str(tmp_path / "out")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode != 0
    assert proc.stderr.count(f"opsd.py: error: --dataset {empty} holds no rows.") == 1, proc.stderr[-3000:]
    assert "opsd.py\", line" not in proc.stderr  # torchrun reports the failed ranks; no frame of ours is printed
