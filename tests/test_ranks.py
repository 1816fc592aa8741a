# python -m pytest tests/test_ranks.py -q
"""When one rank of a torchrun job stops alone, it says why (after its rank), and no rank waits for it: 2-rank gloo
runs on the CPU where only rank 1 meets a fault (tests/fault_launch.py), each rank's output read from torchrun's
per-rank log files. On one node torchrun ends the other ranks (SIGTERM) within a second of one failing; across nodes
(two torchrun agents of one rank each) a rank that hangs is found when a collective has waited --collective-timeout.
A kill -9 of rank 1, a resume after it, Ctrl-C and two nodes computing one node's run are in test_train.py."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import launch_two_nodes, rank_stderr, said

import opsd

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "math_train.jsonl"
BOUND_S = 15  # from rank 1's fault to the end of the job: torchrun's 0.1 s poll, its SIGTERM, the exits
FLAGS = ["--model", "MODEL", "--dataset", str(DATA), "--device", "cpu", "--dtype", "float32", "--prompts-per-step",
         "4", "--micro-batch-size", "1", "--max-new-tokens", "16", "--max-steps", "5", "--save-every", "2"]


def flags(tiny_model_dir, out, *extra):
    return [tiny_model_dir if f == "MODEL" else f for f in FLAGS] + ["--output-dir", str(out), *extra]


def fault_time(stderr):
    """When rank 1 met its fault, and its pid, from the line tests/fault_launch.py prints."""
    line = next(line for line in stderr.splitlines() if line.startswith("fault at "))
    return float(line.split()[2]), int(line.split()[4])


def launch(tiny_model_dir, tmp_path, fault, *extra):
    """(return code, torchrun's own stderr, {rank: that rank's stderr}, seconds from the fault to the end or None)."""
    logs = tmp_path / "logs"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--log-dir", str(logs),
           "--redirects", "3", str(ROOT / "tests" / "fault_launch.py"), *flags(tiny_model_dir, tmp_path / "out", *extra)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, "FAULT": fault})
    end = time.time()
    ranks = {int(p.parent.name): p.read_text() for p in logs.glob("*/attempt_0/*/stderr.log")}
    elapsed = None
    if "fault at " in ranks.get(1, ""):
        elapsed = end - fault_time(ranks[1])[0]
    return proc.returncode, proc.stderr, ranks, elapsed


def root_cause(torchrun_stderr):
    return torchrun_stderr.split("Root Cause (first observed failure):", 1)[1]


def quiet_or_one_collective_error(stderr, where):
    """A rank that torchrun stopped says nothing; if gloo told it first that its peer is gone, it says so once, as
    its own error, with gloo's error in its traceback. Never the user's interrupt."""
    ours = [line for line in stderr.splitlines() if line.startswith("opsd.py")]
    assert "interrupted" not in stderr, stderr[-3000:]
    assert len(ours) <= 1, ours
    assert not ours or ours[0].startswith(f"opsd.py: rank 0: error {where} ("), ours
    assert ours or "Traceback" not in stderr, stderr[-3000:]


def test_data_only_rank_1_cannot_read_is_said_by_rank_1_alone(tiny_model_dir, tmp_path):
    missing, corrupt = tmp_path / "missing.jsonl", tmp_path / "corrupt.jsonl"
    corrupt.write_text(DATA.read_text().splitlines()[0] + "\n{\"problem\": \n")
    for path, sentence in ((missing, f"--dataset {missing}: Unable to find"),
                           (corrupt, f"--dataset {corrupt}: JSON parse error")):
        t0 = time.time()
        code, torchrun, ranks, _ = launch(tiny_model_dir, tmp_path / path.stem, f"data:{path}")
        assert code != 0 and time.time() - t0 < 120  # both ranks stop before a model loads
        assert said(ranks[1], f"opsd.py: error: rank 1: {sentence}") == 1, ranks[1][-2000:]
        assert "opsd.py" not in ranks[0], ranks[0][-2000:]  # torchrun stops rank 0, which found nothing wrong
        assert "Traceback" not in ranks[0] + ranks[1]
        assert f"rank 1: {sentence}" in root_cause(torchrun)
        assert not (tmp_path / path.stem / "out" / "args.json").exists()  # no run was started


def test_an_out_of_memory_on_rank_1_alone_keeps_torchs_message_and_ends_both(tiny_model_dir, tmp_path):
    code, torchrun, ranks, elapsed = launch(tiny_model_dir, tmp_path, "oom")
    assert code != 0 and elapsed is not None and elapsed < BOUND_S, (elapsed, torchrun[-2000:])
    out = tmp_path / "out"
    ours = (f"opsd.py: rank 1: error at step 3 of 5 (the last checkpoint is {out / 'checkpoint-2'}); lower "
            "--micro-batch-size, --loss-chunk-size or --vllm-memory:")
    lines = ranks[1].splitlines()
    torchs = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB (a test's fault)"
    assert lines.count(ours) == 1 and lines.index(torchs) > lines.index(ours), ranks[1][-3000:]
    quiet_or_one_collective_error(ranks[0], "at step 3 of 5")
    assert ours in root_cause(torchrun)
    assert (out / "checkpoint-2").is_dir() and not (out / "final").exists()


def test_a_bug_on_rank_1_alone_is_its_traceback_said_once_and_in_torchruns_report(tiny_model_dir, tmp_path):
    code, torchrun, ranks, elapsed = launch(tiny_model_dir, tmp_path, "bug")
    assert code != 0 and elapsed is not None and elapsed < BOUND_S, (elapsed, torchrun[-2000:])
    head = f"opsd.py: rank 1: error at step 3 of 5 (the last checkpoint is {tmp_path / 'out' / 'checkpoint-2'}):"
    assert said(ranks[1], head) == 1 and ranks[1].count("Traceback (most recent call last)") == 1, ranks[1][-3000:]
    assert "RuntimeError: a test's bug" in ranks[1]
    quiet_or_one_collective_error(ranks[0], "at step 3 of 5")
    cause = root_cause(torchrun)
    assert "Traceback (most recent call last)" in cause and "RuntimeError: a test's bug" in cause


def test_a_rank_that_hangs_on_another_node_ends_the_run_at_the_collective_timeout(tiny_model_dir, tmp_path):
    """Two nodes (two torchrun agents, one rank each): rank 1 stops answering (SIGSTOP) in step 3 and does not end,
    so no torchrun learns of it; rank 0 waits in a collective until --collective-timeout (0.2 minutes), then ends
    in one line."""
    logs = tmp_path / "logs"
    script = [str(ROOT / "tests" / "fault_launch.py"), *flags(tiny_model_dir, tmp_path / "out", "--collective-timeout",
                                                               "0.2")]
    node0, node1 = launch_two_nodes(script, logs, env={"FAULT": "hang"})
    try:
        _, torchrun0 = node0.communicate(timeout=300)
        end = time.time()
    finally:
        for proc in (node0, node1):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        if "fault at " in rank_stderr(logs, 1):
            os.kill(fault_time(rank_stderr(logs, 1))[1], signal.SIGKILL)  # the stopped worker, a session of its own
    fault_at, _ = fault_time(rank_stderr(logs, 1))
    assert node0.returncode != 0
    assert 12 <= end - fault_at < 12 + BOUND_S, end - fault_at  # the timeout, then the exits
    rank0 = rank_stderr(logs, 0)
    assert said(rank0, "opsd.py: rank 0: error at step 3 of 5 (") == 1, rank0[-3000:]
    assert "Timed out" in rank0 and rank0.count("Traceback (most recent call last)") == 1
    assert "rank 0: error at step 3 of 5" in root_cause(torchrun0) and "Timed out" in root_cause(torchrun0)


def test_on_gpus_the_nccl_communicator_is_made_when_the_process_group_starts(monkeypatch):
    """Read from torch's source: an NCCL communicator made lazily at the first collective waits without a bound
    for a rank that died before it; one made by init_process_group(device_id=...) exists while every rank is
    there, and each later collective is bound by the timeout. No GPU here: CUDA's three calls are stood in for,
    and the call opsd.py makes is recorded."""
    import datetime
    calls = []
    monkeypatch.setattr(opsd, "WORLD_SIZE", 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(opsd.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(opsd.torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    monkeypatch.setattr(opsd.dist, "init_process_group", lambda *a, **kw: calls.append((a, kw)))
    for name in opsd.PUSH_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    device = opsd.init_distributed(opsd.parse_args(["--collective-timeout", "0.5"]))
    assert device == opsd.torch.device("cuda", 1)
    assert calls == [("set_device", device),
                     (("nccl",), {"timeout": datetime.timedelta(seconds=30), "device_id": device})]


def test_a_slow_final_save_on_rank_0_does_not_fail_a_finished_run(tiny_model_dir, tmp_path):
    """Rank 0 writes final/ (and finishes wandb) while the other ranks end: none waits for it in a collective,
    which --collective-timeout (here 3 s) would end. Rank 0's final save takes 5 s more here."""
    code, torchrun, ranks, _ = launch(tiny_model_dir, tmp_path, "slow-final", "--max-steps", "1",
                                      "--collective-timeout", "0.05")
    assert code == 0, (torchrun[-2000:], ranks.get(0, "")[-2000:], ranks.get(1, "")[-2000:])
    assert "slow final save" in ranks[0] and (tmp_path / "out" / "final" / "adapter_model.safetensors").exists()
