# python -m pytest tests/test_eval_input.py -q
"""eval.py refuses bad input early, in one sentence, before any model or engine loads: flag ranges,
data files (empty, malformed line, null answer), adapters without weights, of a rank vLLM cannot serve or
trained on another model, a mistyped --model, and output directories whose samples came from other settings,
other problems or other weights behind the same paths (the model fingerprint and adapter hash, checked
against their definitions). --help shows defaults and the columns a data file needs. No vLLM here: every
case stops before the engine would start."""

import hashlib
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

import eval as ev

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "eval_tiny.jsonl"


def refusal(argv, tmp_path, model=None):
    """The one line eval.py printed when it stopped (exit code 2), without its 'eval.py: error: ' prefix."""
    from contextlib import redirect_stderr
    from io import StringIO

    err = StringIO()
    with redirect_stderr(err), pytest.raises(SystemExit) as e:
        ev.main(["--model", model or str(tmp_path), "--output-dir", str(tmp_path / "out"), *argv])
    lines = err.getvalue().splitlines()
    assert e.value.code == 2 and len(lines) == 1 and lines[0].startswith("eval.py: error: "), lines
    return lines[0][len("eval.py: error: "):]


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
    assert message.startswith(f"argument {flag}: must be {rule}, got ") and float(message.split()[-1]) == float(value)
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
    # what --enforce-eager turns off, said plainly (vLLM 0.32: torch.compile and CUDA graphs)
    assert "--enforce-eager, --no-enforce-eager turn off vLLM's torch.compile and CUDA graph" in text
    # --limit's problems: a draw, said where the flag is
    assert "drawn at random with a fixed seed" in text


def test_eval_py_stands_alone():
    assert "METHOD" not in (ROOT / "eval.py").read_text()


def test_eval_py_keeps_opsd_py_line_standard():
    lines = (ROOT / "eval.py").read_text().splitlines()
    assert [n for n, line in enumerate(lines, 1) if len(line) > 100] == []


# -----------------------------------------------------------------------------
# Data files

@pytest.mark.parametrize("name, content, message", [
    ("empty.jsonl", "", "b: {path} holds no problems; write a row per problem in it, or pass another file with "
                        "--data b=FILE."),
    ("blank.jsonl", "\n\n", "b: {path} holds no problems; write a row per problem in it, or pass another file with "
                            "--data b=FILE."),
    ("bad.jsonl", '{"problem": "1+1?", "answer": "2"}\n{"problem": "2+2?", "answer": 4\n',
     "{path}, line 2: not valid JSON (Expecting ',' delimiter); fix that line."),
    ("null.jsonl", '{"problem": "1+1?", "answer": "2"}\n\n{"problem": "2+2?", "answer": null}\n',
     "{path}, row 2: 'answer' is None, not a string or a number; fix or remove that row."),
    ("nullproblem.json", '[{"problem": "1+1?", "answer": "2"}, {"problem": null, "answer": "4"}]',
     "{path}, row 2: 'problem' is None, not a string or a number; fix or remove that row."),
    ("scalar.json", '"1+1?"', "{path}: every row must be a JSON object: write one object a line (.jsonl), or a list "
                              "of objects (.json)."),
    ("list.jsonl", '["1+1?", "2"]\n', "{path}: every row must be a JSON object: write one object a line (.jsonl), or "
                                      "a list of objects (.json)."),
    ("bool.jsonl", '{"problem": "1+1?", "answer": true}\n',
     "{path}, row 1: 'answer' is True, not a string or a number; fix or remove that row."),
    ("cols.jsonl", '{"question": "1+1?", "answer": "2"}\n',
     "{path} has no column 'problem'; its columns are ['question', 'answer']: name the right one with "
     "--problem-column."),
    ("bench.csv", "problem,answer\n1+1?,2\n",
     "{path}: a benchmark file must be .jsonl, .json or .parquet; convert it, or rename it if it is one."),
])
def test_bad_data_files_name_the_file_and_line(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_text(content)
    assert refusal(["--data", f"b={path}"], tmp_path) == message.format(path=path)  # each says how to go on


def test_a_line_separator_inside_a_string_does_not_end_its_line(tmp_path):
    """JSON allows U+2028 and U+0085 unescaped inside a string (a file written with ensure_ascii=False holds them
    so); str.splitlines would end a line there and refuse a valid file."""
    rows = [{"problem": "a\u2028b\x85c", "answer": "1"}, {"problem": "2+2?", "answer": "4"}]
    path = tmp_path / "b.jsonl"
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    assert "\u2028" in path.read_text(encoding="utf-8")
    assert ev.read_rows("b", str(path)) == rows


def test_a_bad_data_flag_is_refused_with_its_form(tmp_path):
    assert refusal(["--data", "aime24"], tmp_path) == ("--data takes NAME=PATH, got 'aime24': pass e.g. "
                                                       "--data aime24=aime24.jsonl.")
    missing = tmp_path / "aime24.jsonl"
    assert refusal(["--data", f"aime24={missing}"], tmp_path) == (
        f"--data aime24: no file at {missing}; pass the path of a .jsonl, .json or .parquet file.")
    assert refusal(["--data", f"tiny={DATA}", "--benchmarks", "amc23"], tmp_path) == (
        "Unknown benchmark 'amc23': choose from aime24, aime25, hmmt25 or give a file with --data amc23=PATH.")
    assert not (tmp_path / "out").exists()


def test_null_in_a_parquet_file_names_the_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "b.parquet"
    pq.write_table(pa.Table.from_pylist([{"problem": "1+1?", "answer": "2"}, {"problem": "2+2?", "answer": None}]),
                   path)
    assert refusal(["--data", f"b={path}"], tmp_path) == (f"{path}, row 2: 'answer' is None, not a string or a number; "
                                                          "fix or remove that row.")


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

@pytest.mark.parametrize("model", ["/no/such/model", "./runs/typo", "tests/no-such-model"])
def test_mistyped_model_fails_in_one_sentence(tmp_path, model, monkeypatch):
    monkeypatch.chdir(ROOT)  # tests/ exists here, so tests/no-such-model names a local path, as opsd.py reads it
    message = refusal(["--data", f"tiny={DATA}"], tmp_path, model=model)
    assert message == (f"--model {model}: no such directory; pass a model's directory or a hub id such as "
                       "Qwen/Qwen3-1.7B.")


def test_a_model_without_a_chat_template_is_refused_before_the_engine(tiny_model_dir, tmp_path):
    import shutil

    from transformers import AutoTokenizer

    import opsd

    model = tmp_path / "no-template"
    shutil.copytree(tiny_model_dir, model)
    (model / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = AutoTokenizer.from_pretrained(model)
    assert tokenizer.chat_template is None
    with pytest.raises(opsd.Refusal) as said:
        opsd.check_chat_template(tokenizer, str(model))
    message = refusal(["--data", f"tiny={DATA}"], tmp_path, model=str(model))
    assert message == str(said.value)  # opsd.py's own sentence
    assert not (tmp_path / "out" / "config.json").exists()  # written once the engine is up: it never was


def test_a_bare_hub_id_is_a_hub_id():
    # opsd.py's rule: a name like gpt2 or Qwen3-1.7B is a hub id; paths look like paths
    assert not ev.local_path("gpt2") and not ev.local_path("Qwen/Qwen3-1.7B")
    assert ev.local_path("./model") and ev.local_path("/abs/model") and ev.local_path("a/b/c")


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

def write_run(out, problems, model, n=1, flags=(), **recorded):
    """A finished run's files: config.json (the settings, and `recorded` contents) and one correct record per
    (problem, sample)."""
    out.mkdir(parents=True)
    args = ev.parse_args(["--model", model, "--output-dir", str(out), *flags])
    (out / "config.json").write_text(json.dumps({**{k: getattr(args, k) for k in ev.SAMPLING_KEYS}, **recorded}))
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


# -----------------------------------------------------------------------------
# Contents, not paths: the model fingerprint, the adapter hash, and adapters that do not fit

CHUNK = 64 * 1024


def fake_model(directory, sizes, seed=0, suffix=".safetensors"):
    """A model directory as far as fingerprints go: config.json and weight files of random bytes."""
    rng = random.Random(seed)
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen3", "seed": seed}))
    for k, size in enumerate(sizes):
        (directory / f"model-{k:05d}{suffix}").write_bytes(rng.randbytes(size))
    return directory


def fingerprint_by_definition(directory):
    """sha256 over config.json's bytes, then per weight file (sorted; *.safetensors, else *.bin) its name, its
    size and 16 samples of 64 KiB at byte k * (size - 64 KiB) // 15 for k = 0..15, or all of it under 1 MiB;
    name and size as the text 'name NUL size NUL'."""
    data = (directory / "config.json").read_bytes()
    for f in sorted(directory.glob("*.safetensors")) or sorted(directory.glob("*.bin")):
        raw = f.read_bytes()
        data += f.name.encode() + b"\0" + str(len(raw)).encode() + b"\0"
        if len(raw) < 16 * CHUNK:
            data += raw
        else:
            data += b"".join(raw[k * (len(raw) - CHUNK) // 15:][:CHUNK] for k in range(16))
    return hashlib.sha256(data).hexdigest()


def flip(path, offset):
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0xFF
    path.write_bytes(bytes(raw))


def test_model_fingerprint_follows_its_definition(tmp_path):
    model = fake_model(tmp_path / "m", [3 * 2**20 + 7, 1000, 2**20])  # sampled, whole, sampled at exactly 1 MiB
    (model / "ignored.bin").write_bytes(b"not read while safetensors exist")
    assert ev.model_fingerprint(str(model)) == fingerprint_by_definition(model)
    bins = fake_model(tmp_path / "b", [2 * 2**20], suffix=".bin")  # no safetensors: the .bin files count
    assert ev.model_fingerprint(str(bins)) == fingerprint_by_definition(bins)
    assert ev.model_fingerprint(str(tmp_path / "empty")) is None  # no such directory: nothing to fingerprint
    import opsd  # one definition: a resumed training run and the evaluation check the same fingerprint

    assert ev.model_fingerprint is opsd.model_fingerprint


def test_model_fingerprint_sees_the_sampled_bytes_and_the_sizes(tmp_path):
    model = fake_model(tmp_path / "m", [3 * 2**20, 5000])
    big, small = sorted(model.glob("*.safetensors"))
    before = ev.model_fingerprint(str(model))
    flip(big, 5 * (3 * 2**20 - CHUNK) // 15 + 100)  # inside the 6th sample
    after = ev.model_fingerprint(str(model))
    assert after != before
    flip(big, CHUNK + 10)  # between the 1st and 2nd samples (about 205 KiB apart): not read, by design
    assert ev.model_fingerprint(str(model)) == after
    flip(small, 4321)  # a file under 1 MiB is read whole
    assert ev.model_fingerprint(str(model)) != after
    fingerprint = ev.model_fingerprint(str(model))
    small.write_bytes(small.read_bytes() + b"\0")
    assert ev.model_fingerprint(str(model)) != fingerprint


def test_a_hub_id_resolves_to_its_cached_snapshot_without_network(tmp_path, monkeypatch):
    import huggingface_hub.constants

    # The Hugging Face cache layout: models--{owner}--{name}/refs/main names the snapshot directory.
    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123abcd")
    snapshot = fake_model(repo / "snapshots" / "0123abcd", [2 * 2**20])
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert ev.model_dir("org/tiny") == snapshot.resolve()
    assert ev.model_fingerprint("org/tiny") == fingerprint_by_definition(snapshot)
    assert ev.model_fingerprint("org/not-cached") is None


def fake_adapter(directory, base, rank=8, weights=b"lora weights"):
    directory.mkdir(parents=True)
    (directory / "adapter_config.json").write_text(json.dumps({"r": rank, "base_model_name_or_path": base}))
    (directory / "adapter_model.safetensors").write_bytes(weights)
    return directory


def adapter_sha256_by_definition(adapter):
    return hashlib.sha256((adapter / "adapter_config.json").read_bytes()
                          + (adapter / "adapter_model.safetensors").read_bytes()).hexdigest()


def test_changed_model_weights_are_refused_on_resume(tmp_path):
    model = fake_model(tmp_path / "model", [2 * 2**20])
    problems = ev.load_problems("tiny", str(DATA), "problem", "answer")
    write_run(tmp_path / "out", problems, str(model), model_fingerprint=fingerprint_by_definition(model))
    argv = ["--data", f"tiny={DATA}", "--n", "1"]
    assert ev.main(["--model", str(model), "--output-dir", str(tmp_path / "out"), *argv])["metrics"]["tiny"]
    flip(next(model.glob("*.safetensors")), 0)  # the same path, other weights
    message = refusal(argv, tmp_path, model=str(model))
    assert message == f"{tmp_path / 'out'} holds samples drawn with other model weights: use a new --output-dir."


def test_changed_adapter_weights_are_refused_on_resume(tmp_path):
    model = fake_model(tmp_path / "model", [2 * 2**20])
    adapter = fake_adapter(tmp_path / "adapter", str(model))
    problems = ev.load_problems("tiny", str(DATA), "problem", "answer")
    write_run(tmp_path / "out", problems, str(model), flags=["--adapter", str(adapter)],
              adapter_sha256=adapter_sha256_by_definition(adapter))
    argv = ["--data", f"tiny={DATA}", "--n", "1", "--adapter", str(adapter)]
    summary = ev.main(["--model", str(model), "--output-dir", str(tmp_path / "out"), *argv])
    assert summary["config"]["adapter_sha256"] == adapter_sha256_by_definition(adapter)
    (adapter / "adapter_model.safetensors").write_bytes(b"retrained lora weights")
    message = refusal(argv, tmp_path, model=str(model))
    assert message == f"{tmp_path / 'out'} holds samples drawn with other adapter weights: use a new --output-dir."


def test_an_adapter_trained_on_another_model_is_refused(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    model = fake_model(tmp_path / "model", [2 * 2**20], seed=1)
    other = fake_model(tmp_path / "other", [2 * 2**20], seed=2)
    for base in ("org/other-model", str(other)):  # a hub id this machine does not hold; other weights
        adapter = fake_adapter(tmp_path / f"adapter-{len(base)}", base)
        message = refusal(["--data", f"tiny={DATA}", "--adapter", str(adapter)], tmp_path, model=str(model))
        assert message == (f"{adapter} was trained on {base}, which is neither the directory nor the weights of "
                           f"--model {model}: pass --model {base}, or --allow-other-base to evaluate it on this "
                           "model.")
        assert not (tmp_path / "out").exists()
        assert ev.check_adapter(str(adapter), str(model), allow_other_base=True) is None


def test_an_adapter_of_the_same_model_elsewhere_is_accepted(tmp_path, monkeypatch):
    model = fake_model(tmp_path / "model", [2 * 2**20])
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in model.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    monkeypatch.chdir(tmp_path)
    for base in ("model", "./model/", str(copy)):  # the same directory written otherwise; the same files elsewhere
        assert ev.check_adapter(str(fake_adapter(tmp_path / f"a{len(base)}", base)), str(model), False) is None


@pytest.mark.parametrize("rank, accepted", [(1, True), (64, True), (512, True), (513, False), (1024, False),
                                            (0, False), ("8", False)])
def test_a_lora_rank_vllm_cannot_serve_is_refused(tmp_path, rank, accepted):
    adapter = fake_adapter(tmp_path / "adapter", str(tmp_path), rank=rank)
    if accepted:
        assert ev.check_adapter(str(adapter), str(tmp_path), False) is None
    else:
        message = refusal(["--data", f"tiny={DATA}", "--adapter", str(adapter)], tmp_path)
        assert message == (f"{adapter} has LoRA rank {rank}, and vLLM serves ranks 1 to 512: "
                           "train with a smaller --lora-r.")
