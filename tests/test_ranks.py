# python -m pytest tests/test_ranks.py -q
"""When one rank of a torchrun job stops alone, it says why (after its rank), and no rank waits for it: 2-rank gloo
runs on the CPU where one rank meets a fault (tests/fault_launch.py), each rank's output read from torchrun's
per-rank log files. On one node torchrun ends the other ranks (SIGTERM) within a second of one failing; across nodes
(two torchrun agents of one rank each) a refusal is said on both, and a rank that hangs, or dies before the process
group exists, is found when the others have waited --collective-timeout. A kill -9 of rank 1, a resume after it,
Ctrl-C and two nodes computing one node's run are in test_train.py."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import launch_two_nodes, rank_stderr, said, stop_nodes

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


def test_a_refusal_on_one_node_is_said_on_both_with_its_rank(tiny_model_dir, tmp_path):
    """Two nodes (two torchrun agents, one rank each) with their own data file or --output-dir: one rank refuses, and
    both nodes print its sentence once, after its rank, and both torchrun reports name it (before, the other node's
    said "error: None", or nothing). Nothing is written and no model loads."""
    corrupt = tmp_path / "corrupt.jsonl"  # its second line is cut short
    corrupt.write_text(DATA.read_text().splitlines()[0] + "\n{\"problem\": \n")
    finished = tmp_path / "finished"  # rank 0's --output-dir holds a run; rank 1's is empty
    finished.mkdir()
    (finished / "args.json").write_text("{}")
    cases = [(f"data:{corrupt}", tmp_path / "out",
              f"rank 1: --dataset {corrupt}: line 2 is not JSON ("),
             (f"output-dir:{tmp_path / 'empty'}", finished,
              f"rank 0: --output-dir {finished} already holds a run (args.json): pass --resume")]
    for k, (fault, out, sentence) in enumerate(cases):
        logs = tmp_path / f"logs{k}"
        nodes = launch_two_nodes([str(ROOT / "tests" / "fault_launch.py"), *flags(tiny_model_dir, out)], logs,
                                 env={"FAULT": fault})
        try:
            reports = [proc.communicate(timeout=120)[1] for proc in nodes]
        finally:
            stop_nodes(nodes)
        for node, (proc, report) in enumerate(zip(nodes, reports)):
            ours = rank_stderr(logs, node)
            assert proc.returncode != 0 and said(ours, f"opsd.py: error: {sentence}") == 1, ours[-2000:]
            assert "Traceback" not in ours and "<N/A>" not in report and "error: None" not in report
            assert f"traceback : opsd.py: error: {sentence}" in root_cause(report), report[-2000:]
        assert not (tmp_path / "out" / "args.json").exists() and not (tmp_path / "empty" / "args.json").exists()


def test_an_error_on_rank_1_alone_is_its_traceback_said_once_and_in_torchruns_report(tiny_model_dir, tmp_path):
    """An out of memory in rank 1's step 3: its one line (with the flags that lower memory), then its traceback, whose
    last line is torch's error whole; torchrun ends rank 0, and its report holds rank 1's error. A bug takes the same
    path, without the hint."""
    code, torchrun, ranks, elapsed = launch(tiny_model_dir, tmp_path, "oom")
    assert code != 0 and elapsed is not None and elapsed < BOUND_S, (elapsed, torchrun[-2000:])
    out = tmp_path / "out"
    ours = (f"opsd.py: rank 1: error at step 3 of 5 (the last checkpoint is {out / 'checkpoint-2'}); lower "
            "--micro-batch-size, --loss-chunk-size or --vllm-memory:")
    lines = ranks[1].splitlines()
    torchs = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB (a test's fault)"
    assert lines.count(ours) == 1 and lines.index(torchs) > lines.index(ours), ranks[1][-3000:]
    assert said(ranks[1], "opsd.py: ") == 1 and ranks[1].count("Traceback (most recent call last)") == 1
    quiet_or_one_collective_error(ranks[0], "at step 3 of 5")
    # torchrun's report holds rank 1's error whole. It names it first unless rank 0's lost peer came in the same
    # second (torchrun's timestamps are whole seconds, a tie going to the lower rank): only that it is there is checked
    report = torchrun.split("Failures:", 1)[1]
    assert ours in report and "Traceback (most recent call last)" in report and torchs in report, torchrun[-3000:]
    assert (out / "checkpoint-2").is_dir() and not (out / "final").exists()


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
        stop_nodes((node0, node1))
        if "fault at " in rank_stderr(logs, 1):
            os.kill(fault_time(rank_stderr(logs, 1))[1], signal.SIGKILL)  # the stopped worker, a session of its own
    fault_at, _ = fault_time(rank_stderr(logs, 1))
    assert node0.returncode != 0
    assert 12 <= end - fault_at < 12 + BOUND_S, end - fault_at  # the timeout, then the exits
    rank0 = rank_stderr(logs, 0)
    assert said(rank0, "opsd.py: rank 0: error at step 3 of 5 (") == 1, rank0[-3000:]
    assert "Timed out" in rank0 and rank0.count("Traceback (most recent call last)") == 1
    assert "rank 0: error at step 3 of 5" in root_cause(torchrun0) and "Timed out" in root_cause(torchrun0)


def test_a_rank_that_dies_before_the_process_group_exists_ends_the_other_node_at_the_collective_timeout(
        tiny_model_dir, tmp_path):
    """Two nodes: node 1's rank refuses before the process group exists (as a CPU build of torch on a GPU node does);
    node 0's rank waits in the group's start, gloo's connect, until --collective-timeout (0.1 minutes), then ends in
    one line. On GPUs that connect comes first too (the next test), before NCCL's, which would wait forever."""
    logs = tmp_path / "logs"
    script = [str(ROOT / "tests" / "fault_launch.py"), *flags(tiny_model_dir, tmp_path / "out", "--collective-timeout",
                                                               "0.1")]
    node0, node1 = launch_two_nodes(script, logs, env={"FAULT": "early"})
    try:
        _, report0 = node0.communicate(timeout=120)
        end = time.time()
        _, report1 = node1.communicate(timeout=120)
    finally:
        stop_nodes((node0, node1))
    fault_at, _ = fault_time(rank_stderr(logs, 1))
    assert node0.returncode != 0 and end - fault_at < 6 + BOUND_S, end - fault_at  # the timeout, then the exits
    assert said(rank_stderr(logs, 1), "opsd.py: error: a test's refusal before the process group exists") == 1
    rank0 = rank_stderr(logs, 0)
    assert said(rank0, "opsd.py: rank 0: error before the first step (the last checkpoint is None):") == 1, rank0
    assert "wait timeout after 6000ms" in rank0 and "wait timeout after 6000ms" in root_cause(report0)


def test_on_gpus_the_process_group_connects_gloo_first_and_makes_nccls_communicator_at_once(monkeypatch):
    """Read from torch's source (distributed_c10d.py, _new_process_group_helper): for "cpu:gloo,cuda:nccl" the gloo
    backend is made first, its connect bound by the timeout (the test above); then, with device_id, NCCL's
    communicator, while every rank is there, so each later collective is bound by the timeout too. No GPU here:
    CUDA's three calls are stood in for, and the call opsd.py makes is recorded."""
    import datetime
    calls = []
    monkeypatch.setattr(opsd, "WORLD_SIZE", 2)
    monkeypatch.setattr(opsd, "LOCAL_RANK", 1)
    monkeypatch.setattr(opsd.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(opsd.torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    monkeypatch.setattr(opsd.dist, "init_process_group", lambda *a, **kw: calls.append((a, kw)))
    for name in opsd.PUSH_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    device = opsd.init_distributed(opsd.parse_args(["--collective-timeout", "0.5"]))
    assert device == opsd.torch.device("cuda", 1)
    assert calls == [("set_device", device),
                     (("cpu:gloo,cuda:nccl",), {"timeout": datetime.timedelta(seconds=30), "device_id": device})]


def test_a_slow_final_save_on_rank_0_does_not_fail_a_finished_run(tiny_model_dir, tmp_path):
    """Rank 0 writes final/ (and finishes wandb) while the other ranks end: none waits for it in a collective,
    which --collective-timeout (here 3 s) would end. Rank 0's final save takes 5 s more here."""
    code, torchrun, ranks, _ = launch(tiny_model_dir, tmp_path, "slow-final", "--max-steps", "1",
                                      "--collective-timeout", "0.05")
    assert code == 0, (torchrun[-2000:], ranks.get(0, "")[-2000:], ranks.get(1, "")[-2000:])
    assert "slow final save" in ranks[0] and (tmp_path / "out" / "final" / "adapter_model.safetensors").exists()
