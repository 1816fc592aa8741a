# python -m pytest tests/test_ranks.py -q
"""When one rank of a torchrun job stops alone, it says why once (after its rank) and no rank waits for it: 2-rank
gloo runs on the CPU where only rank 1 meets a fault (tests/fault_launch.py), each rank's output read from torchrun's
per-rank log files. A kill -9 of rank 1, and a resume after it, are in test_train.py."""

import os
import subprocess
import sys
import time
from pathlib import Path

from conftest import said

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "math_train.jsonl"
BOUND_S = 15  # from rank 1's fault to the end of the job: torchrun's 0.1 s poll, a 5 s wait for a word, the exits


def launch(tiny_model_dir, tmp_path, fault, *extra):
    """(return code, torchrun's own stderr, {rank: that rank's stderr}, seconds from the fault to the end or None)."""
    logs = tmp_path / "logs"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--log-dir", str(logs),
           "--redirects", "3", str(ROOT / "tests" / "fault_launch.py"), "--model", tiny_model_dir, "--dataset",
           str(DATA), "--device", "cpu", "--dtype", "float32", "--prompts-per-step", "4", "--micro-batch-size", "1",
           "--max-new-tokens", "16", "--max-steps", "5", "--save-every", "2", "--output-dir", str(tmp_path / "out"),
           *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, "FAULT": fault})
    end = time.time()
    ranks = {int(p.parent.name): p.read_text() for p in logs.glob("*/attempt_0/*/stderr.log")}
    fault_at = [float(line.split()[-1]) for line in ranks.get(1, "").splitlines() if line.startswith("fault at ")]
    return proc.returncode, proc.stderr, ranks, (end - fault_at[0]) if fault_at else None


def root_cause(torchrun_stderr):
    return torchrun_stderr.split("Root Cause (first observed failure):", 1)[1]


def test_data_only_rank_1_cannot_read_is_said_by_rank_1_alone(tiny_model_dir, tmp_path):
    missing, corrupt = tmp_path / "missing.jsonl", tmp_path / "corrupt.jsonl"
    corrupt.write_text(DATA.read_text().splitlines()[0] + "\n{\"problem\": \n")
    for path, sentence in ((missing, f"--dataset {missing}: no such file."),
                           (corrupt, f"--dataset {corrupt}, line 2: not valid JSON")):
        t0 = time.time()
        code, torchrun, ranks, _ = launch(tiny_model_dir, tmp_path / path.stem, f"data:{path}")
        assert code != 0 and time.time() - t0 < 120  # both ranks stop before a model loads
        assert said(ranks[1], f"opsd.py: error: rank 1: {sentence}") == 1, ranks[1][-2000:]
        assert ranks[0].strip() == "" or "opsd.py" not in ranks[0], ranks[0][-2000:]  # rank 0 says nothing
        assert "Traceback" not in ranks[0] + ranks[1]
        assert f"rank 1: {sentence}" in root_cause(torchrun)
        assert not (tmp_path / path.stem / "out" / "args.json").exists()  # no run was started


def test_an_out_of_memory_on_rank_1_alone_stops_both_in_one_sentence_each(tiny_model_dir, tmp_path):
    code, torchrun, ranks, elapsed = launch(tiny_model_dir, tmp_path, "oom")
    assert code != 0 and elapsed is not None and elapsed < BOUND_S, (elapsed, torchrun[-2000:])
    out = tmp_path / "out"
    cause = (f"opsd.py: error: rank 1: out of memory at step 3 of 5 (CUDA out of memory. Tried to allocate 2.00 GiB "
             f"(a test's fault)): lower --micro-batch-size, --loss-chunk-size or --vllm-memory; the last checkpoint is "
             f"{out / 'checkpoint-2'}.")
    assert ranks[1].count(cause) == 1 and "Traceback" not in ranks[1], ranks[1][-3000:]
    assert said(ranks[0], f"opsd.py: rank 0 stopped at step 3 of 5: rank 1 stopped first (its error is in its log); "
                          f"the last checkpoint is {out / 'checkpoint-2'}.") == 1, ranks[0][-3000:]
    assert "Traceback" not in ranks[0] and "interrupted" not in ranks[0]  # not the user's Ctrl-C
    assert "rank 1: out of memory at step 3" in root_cause(torchrun)
    assert (out / "checkpoint-2").is_dir() and not (out / "final").exists()
