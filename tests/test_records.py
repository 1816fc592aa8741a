# python -m pytest tests/test_records.py -q
"""Every path a committed record names is there. A record is a JSON or JSONL file under tests/ (the fixtures, the
models' own files, each run's config, metrics and summary, the results). A path in one is
  - the value of a path-valued key (PATH_KEYS: the model, the adapter, ...; eval.py's benchmark files), when it
    holds a "/" (without one it is a name: the run tags p1, pd under "model");
  - a path into tests/ or into an output folder written anywhere in a string (an argv, a command line, a note).
It is one of three kinds, told by its form alone:
  - relative: a file of this repository, which must exist relative to its root;
  - relative, inside a folder .gitignore leaves out (runs/, outputs/): a run's output, never committed, not looked
    for (the record keeps what it needs of it, e.g. the adapter's sha256);
  - absolute: the checkout a run was done in, on the machine that did it (/work/fullrun/tests/..., /tmp/clip-main/
    tests/...; the older ones in the layout from before the move to tests/miniature/): not looked for, but it must
    name a file of a checkout of this repository (.../tests/...).
Pure file reading: no model, no torch."""

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PATH_KEYS = {"model", "adapter", "model_dir", "dataset", "data", "train_file", "output_dir", "out_dir", "reference"}
PATH_DICTS = {"benchmarks"}  # eval.py's config: {benchmark name: its file}


def ignored_folders():
    """The top-level folders .gitignore leaves out (its /NAME/ lines: runs, outputs): where runs write."""
    return {line.strip()[1:-1] for line in (ROOT / ".gitignore").read_text().splitlines()
            if re.fullmatch(r"/[\w.-]+/", line.strip())}


def paths_in(value, in_text, key=None):
    """[(key, path)] of every path a parsed record names; `in_text` finds the paths written inside a string."""
    if isinstance(value, dict):
        found = []
        for k, v in value.items():
            if k in PATH_DICTS and isinstance(v, dict):
                found += [(f"{k}.{name}", p) for name, p in v.items() if isinstance(p, str)]
            else:
                found += paths_in(v, in_text, k)
        return found
    if isinstance(value, list):
        return [found for v in value for found in paths_in(v, in_text, key)]
    if isinstance(value, str):
        return [(key, value)] if key in PATH_KEYS and "/" in value else [(key, p) for p in in_text.findall(value)]
    return []


def problem(path, ignored):
    """Why a record's path is wrong, or None."""
    if path.startswith("/"):
        inside = {"tests", *ignored} & set(path.split("/")[1:-1])
        return None if inside else "an absolute path into no checkout of this repository"
    if path.split("/")[0] in ignored:
        return None
    target = (ROOT / path).resolve()
    return None if target.is_relative_to(ROOT) and target.exists() else "names nothing in the repository"


def read_record(path):
    text = path.read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()] if path.suffix == ".jsonl" \
        else json.loads(text)


def text_paths(ignored):
    """A path into tests/ or an output folder inside free text: it starts after a space, a quote, '=' or the start,
    and ends before what cannot be part of one (a space, a quote, "'s", a full stop at a sentence's end)."""
    return re.compile(r"(?<![\w./-])((?:tests|%s)/[\w.@/-]*[\w])" % "|".join(map(re.escape, sorted(ignored))))


def test_every_path_in_a_committed_record_exists():
    ignored = ignored_folders()
    assert {"runs", "outputs"} <= ignored
    in_text = text_paths(ignored)
    records = sorted(p for p in (ROOT / "tests").rglob("*") if p.suffix in (".json", ".jsonl") and p.is_file())
    found, wrong = {}, []
    for record in records:
        name = str(record.relative_to(ROOT))
        found[name] = paths_in(read_record(record), in_text)
        wrong += [f"{name}: {key}={path!r} {why}" for key, path in found[name]
                  if (why := problem(path, ignored))]
    assert not wrong, f"{len(wrong)} stale paths:\n" + "\n".join(wrong[:20])
    # the scan reads what it should: the fixtures' models, a command line's files, eval.py's configs and argvs
    assert ("model", "tests/miniature/model") in found["tests/miniature/reference_step.json"]
    assert ("model", "tests/miniature/model-drift") in found["tests/miniature/drift/reference_step.json"]
    assert ("about", "tests/miniature/miniature.py") in found["tests/miniature/reference_step.json"]
    assert ("commands", "tests/miniature/heldout.jsonl") in found["tests/miniature/quickstart/quickstart.json"]
    config = found["tests/miniature/clip/results/runs/entry-s1-eval/config.json"]
    assert {key for key, _ in config} == {"model", "adapter"}
    assert ("argv", "runs/clip") in found["tests/miniature/clip/results/invocations.json"]
    kinds = [("/" if p.startswith("/") else p.split("/")[0]) for paths in found.values() for _, p in paths]
    assert {"/", "tests", "runs"} <= set(kinds)


def test_the_check_finds_a_stale_path():
    ignored = ignored_folders()
    record = {"model": "tests/data/miniature/model", "about": "with tests/miniature.py's settings.",
              "argv": ["--output-dir", "runs/clip"], "adapter": "/tmp/clip-main/runs/clip/x/final",
              "output_dir": "/home/me/model",
              "benchmarks": {"heldout": "tests/miniature/heldout.jsonl", "sums": "sums.jsonl"},
              "runs": [{"model": "p1"}, {"model": "/work/fullrun/tests/data/miniature/model"}],
              "note": "see tests/miniature/README.md. Or ../tests/miniature, elsewhere/tests/x"}
    found = paths_in(record, text_paths(ignored))
    assert sorted(found) == sorted([
        ("model", "tests/data/miniature/model"), ("about", "tests/miniature.py"), ("argv", "runs/clip"),
        ("adapter", "/tmp/clip-main/runs/clip/x/final"), ("output_dir", "/home/me/model"),
        ("benchmarks.heldout", "tests/miniature/heldout.jsonl"), ("benchmarks.sums", "sums.jsonl"),
        ("model", "/work/fullrun/tests/data/miniature/model"), ("note", "tests/miniature/README.md")])
    missing, nowhere = "names nothing in the repository", "an absolute path into no checkout of this repository"
    assert {path: problem(path, ignored) for _, path in found} == {
        "tests/data/miniature/model": missing, "tests/miniature.py": missing, "sums.jsonl": missing,
        "/home/me/model": nowhere, "runs/clip": None, "/tmp/clip-main/runs/clip/x/final": None,
        "/work/fullrun/tests/data/miniature/model": None, "tests/miniature/heldout.jsonl": None,
        "tests/miniature/README.md": None}
    assert problem("tests/../../etc", ignored) == missing  # nor a path out of the repository
