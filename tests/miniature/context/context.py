"""What the teacher is shown, in the quickstart: opsd.py --teacher-context reference, none, other and answer, three
seeds each, with the README quickstart's task, model and settings. tests/miniature/context/README.md holds the
protocol (committed before any run) and the results.

    python tests/miniature/context/context.py --output-dir runs/context      # 12 runs and 13 scorings (~15 min)
    python tests/miniature/context/context.py --output-dir runs/context --record tests/miniature/context/results

A run already scored is not run again (so an interrupted sweep continues). The answer arm reads a copy of the
quickstart's data whose references box their sum (457+385=\\boxed{842}), so that the flag finds the final answer;
the teacher then sees \\boxed{842} alone.
"""

import argparse
import json
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent  # tests/miniature/context: this script and its records
sys.path[:0] = [str(HERE.parent), str(HERE.parent.parent.parent)]

import miniature  # noqa: E402  (the quickstart's commands, the runner, the metrics reader)

ARMS = ("reference", "none", "other", "answer")
SEEDS = (42, 43, 44)  # 42: the quickstart's own seed, so reference-42 is the quickstart run
STEP1 = ("kl_mean", "entropy_student", "entropy_teacher", "loss_frac_negative")


def flag_value(argv, flag):
    return argv[argv.index(flag) + 1]


def with_flag(argv, flag, value):
    """argv with `flag` set to `value` (replaced where it is, else appended)."""
    if flag in argv:
        i = argv.index(flag)
        return [*argv[:i + 1], value, *argv[i + 2:]]
    return [*argv, flag, value]


def boxed_copy(train, path):
    """The quickstart's rows with each reference's sum boxed: 457+385=842 -> 457+385=\\boxed{842}."""
    rows = [json.loads(line) for line in Path(train).read_text().splitlines()]
    lines = []
    for row in rows:
        left, total = row["solution"].split("=")
        lines.append(json.dumps({**row, "solution": f"{left}=\\boxed{{{total}}}"}) + "\n")
    Path(path).write_text("".join(lines))


def commands(out, arm, seed):
    """(the training argv, the scoring argv) of one run: the quickstart's, with the arm's flag and the seed."""
    train, _, trained = (miniature.in_dir(c, out) for c in miniature.quickstart_commands())
    run = out / f"{arm}-{seed}"
    train = with_flag(train, "--output-dir", str(run))
    train = with_flag(with_flag(train, "--seed", str(seed)), "--teacher-context", arm)
    if arm == "answer":
        train = with_flag(train, "--dataset", str(out / "train-boxed.jsonl"))
    trained = with_flag(with_flag(trained, "--adapter", str(run / "final")), "--output-dir", str(run / "eval"))
    return train, trained


def sweep(out):
    out.mkdir(parents=True, exist_ok=True)
    train, base, _ = (miniature.in_dir(c, out) for c in miniature.quickstart_commands())
    boxed_copy(miniature.ROOT / flag_value(train, "--dataset"), out / "train-boxed.jsonl")
    base = with_flag(base, "--output-dir", str(out / "base-eval"))
    if not (out / "base-eval" / "summary.json").exists():
        miniature.run_logged(base, out / "base-eval.log")
    for seed in SEEDS:
        for arm in ARMS:
            train, trained = commands(out, arm, seed)
            run = Path(flag_value(train, "--output-dir"))
            if (run / "eval" / "summary.json").exists():
                continue
            shutil.rmtree(run, ignore_errors=True)
            miniature.run_logged(train, out / f"{arm}-{seed}.log")
            miniature.run_logged(trained, out / f"{arm}-{seed}-eval.log")
            print(f"{arm} seed {seed}: held-out {accuracy(run / 'eval' / 'samples.jsonl'):.1%}", flush=True)


def accuracy(samples_path):
    """The share of held-out samples whose last \\boxed{} is the sum, from eval.py's samples alone."""
    heldout = [json.loads(line) for line in (HERE.parent / "heldout.jsonl").read_text().splitlines()]
    samples = [json.loads(line) for line in Path(samples_path).read_text().splitlines()]
    # a sample names its problem by its index in heldout.jsonl
    right = [s["answer"] == str(sum(miniature.operands(heldout[s["problem"]]["problem"]))) for s in samples]
    return sum(right) / len(right)


def results(root):
    """results.json's content from a sweep's (or a record's) files: per run the held-out accuracy and the step-1
    figures; per arm their means over the seeds; the base model's accuracy."""
    runs = {}
    for arm in ARMS:
        for seed in SEEDS:
            run = root / f"{arm}-{seed}"
            step1 = miniature.read_metrics(run)[0]
            runs[f"{arm}-{seed}"] = {"heldout": accuracy(run / "eval" / "samples.jsonl"),
                                     **{f"step1_{key}": step1[key] for key in STEP1}}
    arms = {}
    for arm in ARMS:
        mine = [runs[f"{arm}-{seed}"] for seed in SEEDS]
        arms[arm] = {key: sum(r[key] for r in mine) / len(mine) for key in mine[0]}
        arms[arm]["heldout_range"] = [min(r["heldout"] for r in mine), max(r["heldout"] for r in mine)]
    return {"base_heldout": accuracy(root / "base-eval" / "samples.jsonl"), "arms": arms, "runs": runs}


def table(res):
    lines = [f"base model: held-out {res['base_heldout']:.1%}",
             "arm          held-out (3 seeds)     step-1 kl   H student   H teacher   negative terms"]
    for arm, r in res["arms"].items():
        low, high = r["heldout_range"]
        lines.append(f"{arm:<12} {r['heldout']:6.1%} ({low:.1%}..{high:.1%})  {r['step1_kl_mean']:9.4f}"
                     f"   {r['step1_entropy_student']:9.3f}   {r['step1_entropy_teacher']:9.3f}"
                     f"   {r['step1_loss_frac_negative']:12.1%}")
    return "\n".join(lines) + "\n"


def record(out, dest):
    """Copy what results.json is computed from (each run's metrics.jsonl and scored samples, the base scoring's),
    then write results.json and table.txt from the copies."""
    for name in ["base-eval", *(f"{arm}-{seed}" for arm in ARMS for seed in SEEDS)]:
        (dest / name / "eval").mkdir(parents=True, exist_ok=True)
        if name == "base-eval":
            shutil.copy(out / name / "samples.jsonl", dest / name / "samples.jsonl")
            continue
        shutil.copy(out / name / "metrics.jsonl", dest / name / "metrics.jsonl")
        shutil.copy(out / name / "eval" / "samples.jsonl", dest / name / "eval" / "samples.jsonl")
    res = results(dest)
    (dest / "results.json").write_text(json.dumps(res, indent=2) + "\n")
    (dest / "table.txt").write_text(table(res))
    print(table(res), end="")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output-dir", required=True, help="the runs, their logs and scorings")
    p.add_argument("--record", help="copy the sweep's records here and write results.json and table.txt")
    args = p.parse_args(argv)
    out = Path(args.output_dir).resolve()
    if args.record:
        record(out, Path(args.record).resolve())
        return
    sweep(out)
    print(table(results(out)), end="")


if __name__ == "__main__":
    main()
