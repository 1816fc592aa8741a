# python -m pytest tests/test_quickstart.py -q
"""The README's quickstart, as written: its commands run here (writing under a temporary folder instead of runs/),
the held-out accuracy rises by at least 30 points, regraded here from the sums themselves, and the KL of the step
lines falls. The shipped data are the miniature's split, no held-out problem trained on. The committed record of
the quickstart (tests/miniature/quickstart/) agrees with its own files, and the README prints its figures."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import user_environment

import miniature
import teaching

ROOT = Path(__file__).resolve().parent.parent
RECORD = miniature.QUICKSTART_RECORD


def regraded(samples_file, heldout):
    """Share of samples whose last \\boxed{...} holds the sum of the problem's two operands (eval.py not used)."""
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    right = []
    for s in samples:
        a, b = (int(x) for x in heldout[s["problem"]]["problem"].split("+"))
        boxed = re.findall(r"\\boxed\{(\d+)\}", s["completion"])
        right.append(bool(boxed) and boxed[-1] == str(a + b))
    return sum(right) / len(right), len(samples)


def test_the_shipped_data_are_the_miniatures_split_and_never_train_on_held_out_problems():
    train, _, heldout = miniature.make_task()
    shipped = [json.loads(line) for line in (miniature.DATA / "train.jsonl").read_text().splitlines()]
    assert shipped == [{"problem": r["problem"], "solution": r["solution"]} for r in train]
    scored = [json.loads(line) for line in (miniature.DATA / "heldout.jsonl").read_text().splitlines()]
    assert scored == [{"problem": r["problem"], "answer": r["answer"]} for r in heldout] and len(scored) == 400
    seen = {tuple(sorted(map(int, r["problem"].split("+")))) for r in shipped}
    assert not any(tuple(sorted(map(int, r["problem"].split("+")))) in seen for r in scored)  # nor a swapped twin
    for r in shipped[:200]:  # the reference is the true sum, written tersely
        a, b = map(int, r["problem"].split("+"))
        assert r["solution"] == f"{a}+{b}={a + b}"


def test_the_parsed_commands_are_the_readme_block():
    commands = miniature.quickstart_commands()
    block = (ROOT / "README.md").read_text().split("\n## Quickstart", 1)[1].split("```bash\n", 1)[1].split("```")[0]
    starts = [line for line in block.splitlines() if line and not line.startswith(" ")]
    assert [c.split()[:2] for c in commands] == [line.split()[:2] for line in starts] and len(commands) == 3
    assert " ".join(block.replace("\\\n", " ").split()) == " ".join(commands)


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    out = tmp_path_factory.mktemp("quickstart")
    procs = []
    for command in miniature.quickstart_commands():
        procs.append(subprocess.run(miniature.in_dir(command, out), capture_output=True, text=True, cwd=ROOT,
                                    timeout=900, env=user_environment()))  # vLLM's sampler compiled, as a user's
        assert procs[-1].returncode == 0, procs[-1].stdout[-3000:] + procs[-1].stderr[-3000:]
    return out, procs


def test_the_quickstart_as_written_learns(quickstart):
    out, procs = quickstart
    heldout = [json.loads(line) for line in (miniature.DATA / "heldout.jsonl").read_text().splitlines()]
    base, n_base = regraded(out / "quickstart-base" / "samples.jsonl", heldout)
    trained, n_trained = regraded(out / "quickstart-trained" / "samples.jsonl", heldout)
    assert n_base == n_trained == 400
    assert 0.3 < base < 0.8, "the shipped model should be clearly imperfect, not useless"
    assert trained >= base + 0.30, (base, trained)
    for name, value in (("quickstart-base", base), ("quickstart-trained", trained)):  # what eval.py printed
        assert json.loads((out / name / "summary.json").read_text())["metrics"]["heldout"]["avg@1"] == \
            pytest.approx(value)
    records = [json.loads(line) for line in (out / "quickstart" / "metrics.jsonl").read_text().splitlines()]
    kl = [r["kl_mean"] for r in records]
    assert len(kl) == 40 and sum(kl[-5:]) < sum(kl[:5]) / 10, kl  # the step lines' kl falls
    shown = [float(m) for m in re.findall(r"\| kl (\d\.\d+) ", procs[0].stdout)]
    assert shown == pytest.approx(kl, abs=1e-4)  # the step lines print each step's own KL (--kl-window 1)
    assert "Traceback" not in procs[0].stderr and "Triton is installed" not in procs[0].stdout + procs[0].stderr


def test_the_committed_record_agrees_with_itself_and_the_readme():
    record = json.loads((RECORD / "quickstart.json").read_text())
    assert record["commands"] == miniature.quickstart_commands()  # the README's commands are the ones recorded
    metrics = [json.loads(line) for line in (RECORD / "metrics.jsonl").read_text().splitlines()]
    assert record["kl_mean"] == [[r["step"], r["kl_mean"]] for r in metrics]
    curve_metrics = [json.loads(line) for line in (RECORD / "curve-run-metrics.jsonl").read_text().splitlines()]
    timing = ("time_sample", "time_train", "time_push", "tokens_per_second")
    assert [{k: v for k, v in r.items() if k not in timing} for r in curve_metrics] == \
        [{k: v for k, v in r.items() if k not in timing} for r in metrics]  # checkpoints changed nothing
    heldout = [json.loads(line) for line in (miniature.DATA / "heldout.jsonl").read_text().splitlines()]
    base, _ = regraded(RECORD / "base-samples.jsonl", heldout)
    trained, _ = regraded(RECORD / "trained-samples.jsonl", heldout)
    assert (record["heldout_base"], record["heldout_trained"]) == (pytest.approx(base), pytest.approx(trained))
    steps = [p[0] for p in record["curve_heldout"]]
    assert steps == list(range(0, 41, record["curve_every"]))
    # the curve's scorer draws eval.py's samples: its ends are the two eval.py scores
    assert record["curve_heldout"][0][1] == pytest.approx(base)
    assert record["curve_heldout"][-1][1] == pytest.approx(trained)
    assert record["seconds_total"] == pytest.approx(sum(record["seconds"]), abs=0.2)
    readme = (ROOT / "README.md").read_text()
    assert f"{100 * base:.1f}" in readme and f"{100 * trained:.1f}" in readme
    assert f"{record['seconds_total']:.0f} s" in readme
    shown = [line.strip() for line in readme.splitlines() if line.strip().startswith("step ") and "| loss" in line]
    assert shown and all(line in (RECORD / "step-lines.txt").read_text() for line in shown)
    assert (RECORD / "quickstart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- where the teacher disagrees: rollouts.jsonl's per-token KL, drawn (tests/miniature/teaching.py) ----------------

TEACHING = RECORD / "teaching"


def test_a_dropped_carry_is_found_where_it_was_written():  # hand-written answers, offsets counted by hand
    assert teaching.dropped_carries("7+5=12 5+8+1=14 4+3+1=8 \\boxed{842}") == []
    assert teaching.dropped_carries("7+5=12 5+8=13 4+3+1=8 \\boxed{837}") == [(10, 13)]
    assert teaching.dropped_carries("7+5=12 5+8+1=14 4+3=7 \\boxed{742}") == [(19, 21)]
    assert teaching.dropped_carries("1+2=3 5+8=13 4+3=7 \\boxed{1 5+8=13}") == [(16, 18)]  # columns before the box
    assert teaching.position_of(["7", "+", "5", "=", "12"], 3) == 3 and teaching.position_of(["ab", "c"], 2) == 1


def test_a_fresh_quickstart_run_draws_where_its_teacher_disagreed(quickstart):
    out, _ = quickstart
    record = teaching.build_record(out / "quickstart")  # checks the logged step-1 KL against its recomputation
    answer, trained = record["answer"], record["trained"]
    assert "".join(answer["tokens"]).startswith(tuple("0123456789")) and answer["dropped_carry_tokens"]
    assert answer["tokens"][answer["dropped_carry_tokens"][0]] == "="  # where "+1" was due, then the wrong sum
    assert answer["recomputed_max_abs_difference"] < 1e-4
    a, b = map(int, record["problem"].split("+"))
    assert record["reference"] == f"{a}+{b}={a + b}"  # the row the log's prompt_index names
    assert "".join(trained["tokens"]).startswith(miniature.correct_trace(a, b))  # trained: the right columns
    assert trained["max_kl"] < 0.1 * max(answer["kl"])
    fig = teaching.draw(record)
    assert fig.axes[0].images[0].get_array().shape == (1, len(answer["kl"]))


def test_the_committed_teaching_figure_draws_the_committed_log():
    record = json.loads((TEACHING / "teaching.json").read_text())
    logged = [json.loads(line) for line in (TEACHING / "run" / "rollouts.jsonl").read_text().splitlines()]
    first = [r for r in logged if r["step"] == 1]
    chosen = next(r for r in first if r["prompt_index"] == record["prompt_index"])
    assert chosen["kl"] == record["answer"]["kl"] and chosen["token_ids"] == record["answer"]["token_ids"]
    assert first.index(chosen) == min(i for i, r in enumerate(first) if teaching.dropped_carries(r["completion"]))
    for step, means in record["mean_kl_by_position"].items():  # recomputed here: position j over answers that long
        rows = [r["kl"] for r in logged if r["step"] == int(step)]
        mine = [sum(kl[j] for kl in rows if len(kl) > j) / sum(len(kl) > j for kl in rows)
                for j in range(max(map(len, rows)))]
        assert means == pytest.approx(mine, rel=1e-12)
    ours = [json.loads(line) for line in (TEACHING / "run" / "metrics.jsonl").read_text().splitlines()]
    recorded = [json.loads(line) for line in (RECORD / "metrics.jsonl").read_text().splitlines()]
    # the quickstart's own run again: the same answers' lengths at every step, the KL to another CPU's rounding
    assert [r["completion_len_mean"] for r in ours] == [r["completion_len_mean"] for r in recorded]
    assert [r["kl_mean"] for r in ours] == pytest.approx([r["kl_mean"] for r in recorded], rel=1e-4)
    fig = teaching.draw(record)  # what the committed figure shows is the record's numbers
    for ax, answer in zip(fig.axes[:2], (record["answer"], record["trained"])):
        drawn = ax.images[0].get_array()[0]
        assert list(drawn) == pytest.approx([max(v, 1e-4) for v in answer["kl"]])
        assert [t.get_text() for t in ax.texts] == [teaching.label(t) for t in answer["tokens"]]
    assert [list(line.get_ydata()) for line in fig.axes[2].lines] == list(record["mean_kl_by_position"].values())
    assert (TEACHING / "teaching.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
