# python -m pytest tests/test_eval_input.py -q
"""eval.py refuses bad input early, in one sentence, before any model or engine loads: flag ranges,
data files (empty, malformed line, null answer), adapters without weights, a mistyped --model, and
output directories whose samples came from other settings or other problems. --help shows defaults
and the columns a data file needs. No vLLM here: every case stops before the engine would start."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import eval as ev

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "eval_tiny.jsonl"


def refusal(argv, tmp_path, model=None):
    with pytest.raises(SystemExit) as e:
        ev.main(["--model", model or str(tmp_path), "--output-dir", str(tmp_path / "out"), *argv])
    assert isinstance(e.value.code, str), "a refusal carries its sentence"
    return e.value.code


# -----------------------------------------------------------------------------
# Flags

@pytest.mark.parametrize("flag, value, rule", [
    ("--n", "0", "at least 1"),
    ("--temperature", "-0.1", "0 or more"),
    ("--top-p", "0", "in (0, 1]"),
    ("--top-p", "1.5", "in (0, 1]"),
    ("--max-new-tokens", "0", "at least 1"),
    ("--tensor-parallel-size", "0", "at least 1"),
    ("--gpu-memory-utilization", "0", "in (0, 1]"),
    ("--gpu-memory-utilization", "1.2", "in (0, 1]"),
])
def test_numeric_flags_are_range_checked(tmp_path, flag, value, rule):
    message = refusal(["--data", f"tiny={DATA}", flag, value], tmp_path)
    assert message.startswith(f"{flag} must be {rule}, got ") and float(message.split()[-1].rstrip(".")) == float(value)
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_boundary_values_are_accepted():
    args = ev.parse_args(["--model", "m", "--output-dir", "o", "--n", "1", "--temperature", "0", "--top-p", "1",
                          "--max-new-tokens", "1", "--gpu-memory-utilization", "1"])
    assert (args.n, args.temperature, args.top_p, args.max_new_tokens, args.gpu_memory_utilization) == (1, 0, 1, 1, 1)


def test_help_shows_defaults_and_the_data_columns():
    out = subprocess.run([sys.executable, str(ROOT / "eval.py"), "--help"], capture_output=True, text=True,
                         timeout=120).stdout
    text = " ".join(out.split())  # argparse wraps lines
    for shown in ("(default: 12)", "(default: 0.95)", "(default: 38912)", "(default: problem)", "(default: answer)"):
        assert shown in text
    assert "a problem column and an answer column" in text


def test_eval_py_stands_alone():
    assert "METHOD" not in (ROOT / "eval.py").read_text()


# -----------------------------------------------------------------------------
# Data files

@pytest.mark.parametrize("name, content, message", [
    ("empty.jsonl", "", "{path} holds no problems."),
    ("blank.jsonl", "\n\n", "{path} holds no problems."),
    ("bad.jsonl", '{"problem": "1+1?", "answer": "2"}\n{"problem": "2+2?", "answer": 4\n',
     "{path}, line 2: not valid JSON"),
    ("null.jsonl", '{"problem": "1+1?", "answer": "2"}\n\n{"problem": "2+2?", "answer": null}\n',
     "{path}, line 3: 'answer' is null."),
    ("nullproblem.json", '[{"problem": "1+1?", "answer": "2"}, {"problem": null, "answer": "4"}]',
     "{path}, row 1: 'problem' is null."),
    ("dict.json", '{"problem": "1+1?", "answer": "2"}', "{path} holds JSON that is not a list of objects"),
    ("list.jsonl", '["1+1?", "2"]\n', "{path}, line 1: not a JSON object."),
    ("cols.jsonl", '{"question": "1+1?", "answer": "2"}\n', "{path} has no column 'problem'"),
])
def test_bad_data_files_name_the_file_and_line(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_text(content)
    assert message.format(path=path) in refusal(["--data", f"b={path}"], tmp_path)


def test_null_in_a_parquet_file_names_the_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "b.parquet"
    pq.write_table(pa.Table.from_pylist([{"problem": "1+1?", "answer": "2"}, {"problem": "2+2?", "answer": None}]),
                   path)
    assert f"{path}, row 1: 'answer' is null." in refusal(["--data", f"b={path}"], tmp_path)


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet", ".json-lines"])
def test_local_benchmark_files(tmp_path, suffix):
    rows = [{"problem": "What is 17 + 25?", "answer": "42"}, {"problem": "Compute 2^{10}.", "answer": 1024}]
    path = tmp_path / f"bench{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(rows))
    elif suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist([{**r, "answer": str(r["answer"])} for r in rows]), path)
    else:  # JSON lines, also accepted under a .json name
        path = path.with_suffix(".json") if suffix == ".json-lines" else path
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    problems = ev.load_problems("b", str(path), "problem", "answer")
    # Answers read as text (an integer column, as in some AIME copies, too); each problem gets a hash.
    assert [(p["problem"], p["answer"]) for p in problems] == [("What is 17 + 25?", "42"), ("Compute 2^{10}.", "1024")]
    assert len({p["hash"] for p in problems}) == 2


# -----------------------------------------------------------------------------
# Model and adapter

@pytest.mark.parametrize("model", ["/no/such/model", "./runs/typo", "Qwen3-1.7B"])
def test_mistyped_model_fails_in_one_sentence(tmp_path, model):
    message = refusal(["--data", f"tiny={DATA}"], tmp_path, model=model)
    assert message == f"--model {model}: no such directory, and not a hub id of the form owner/name."


def test_adapter_without_weights_is_refused(tmp_path):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    assert "No adapter_config.json" in refusal(["--data", f"tiny={DATA}", "--adapter", str(adapter)], tmp_path)
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 8}))
    message = refusal(["--data", f"tiny={DATA}", "--adapter", str(adapter)], tmp_path)
    assert message == (f"{adapter} holds an adapter config but no adapter_model.safetensors: "
                       "pass a directory written by opsd.py.")


# -----------------------------------------------------------------------------
# Output directories that already hold samples

def write_run(out, problems, model, n=1):
    """A finished run's files: config.json and one correct record per (problem, sample)."""
    out.mkdir(parents=True)
    args = ev.parse_args(["--model", model, "--output-dir", str(out)])
    (out / "config.json").write_text(json.dumps({k: getattr(args, k) for k in ev.SAMPLING_KEYS}))
    records = [{"benchmark": "tiny", "problem": i, "sample": j, "hash": p["hash"], "answer": p["answer"],
                "correct": True, "tokens": 5, "truncated": False} for i, p in enumerate(problems) for j in range(n)]
    (out / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_complete_samples_are_summarised_without_an_engine(tmp_path):
    write_run(tmp_path / "out", ev.load_problems("tiny", str(DATA), "problem", "answer"), str(tmp_path))
    summary = ev.main(["--model", str(tmp_path), "--data", f"tiny={DATA}", "--n", "1",
                       "--output-dir", str(tmp_path / "out")])
    assert summary["metrics"]["tiny"]["avg@1"] == 1.0 and summary["metrics"]["tiny"]["samples"] == 3


def test_other_settings_are_refused(tmp_path):
    write_run(tmp_path / "out", ev.load_problems("tiny", str(DATA), "problem", "answer"), "org/other-model")
    message = refusal(["--data", f"tiny={DATA}", "--n", "1"], tmp_path)
    assert message == f"{tmp_path / 'out'} holds samples drawn with other model: use a new --output-dir."


def test_another_file_under_the_same_name_is_refused(tmp_path):
    # Samples of tiny=eval_tiny.jsonl exist; tiny= now names a file whose problem 1 differs.
    write_run(tmp_path / "out", ev.load_problems("tiny", str(DATA), "problem", "answer"), str(tmp_path))
    rows = [json.loads(line) for line in DATA.read_text().splitlines()]
    rows[1]["problem"] = "Simplify \\frac{20}{24}."
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps(r) + "\n" for r in rows))
    message = refusal(["--data", f"tiny={other}", "--n", "1"], tmp_path)
    assert message == (f"{tmp_path / 'out'} holds samples of another tiny (problem 1 differs from the one "
                       "read now): use a new --output-dir.")
    # A shorter file under the same name: the samples of problem 2 belong to no problem read now.
    other.write_text("".join(json.dumps(r) + "\n" for r in rows[:1]))
    assert "holds samples of another tiny (problem 1 differs" in refusal(["--data", f"tiny={other}", "--n", "1"],
                                                                        tmp_path)
