# python -m pytest tests/test_ranks.py -q
"""When one rank of a torchrun job stops alone, it says why (after its rank), and no rank waits for it: 2-rank gloo
runs on the CPU where one rank meets a fault (tests/fault_launch.py), each rank's output read from torchrun's
per-rank log files. On one node torchrun ends the other ranks (SIGTERM) within a second of one failing; across nodes
(two torchrun agents of one rank each) a refusal is said on both (a flag only one node's command line gets wrong, a
node that sees no checkpoint where the other does among them), a node's refusal before the process group exists is
said on both at once, a rank stalled in a start-up phase is ended by that phase's time limit and named by the others,
a rank SIGKILLed in a phase is said as that, a frozen node 0 (its agent stopped) ends every rank at the agreement's
limit, and a rank that hangs in a step is found when the others have waited --collective-timeout. A kill -9 of rank 1, a
resume after it, Ctrl-C and two nodes computing one node's run are in test_train.py."""

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

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
    """Two nodes (two torchrun agents, one rank each) with their own data file, --output-dir or command line: one rank
    refuses, and both nodes print its sentence once, after its rank, within seconds (not --collective-timeout, 30
    minutes), and both torchrun reports name it (before, the other node's said "error: None", or nothing; a flag only
    node 1 got wrong cost node 0 the timeout). A node whose --output-dir holds the run but not yet its checkpoint (a
    shared filesystem that lags) makes the same agreements as the others: both refuse it. Nothing is written and no
    model loads."""
    corrupt = tmp_path / "corrupt.jsonl"  # its second line is cut short
    corrupt.write_text(DATA.read_text().splitlines()[0] + "\n{\"problem\": \n")
    finished = tmp_path / "finished"  # rank 0's --output-dir holds a run; rank 1's is empty
    finished.mkdir()
    (finished / "args.json").write_text("{}")
    resumed, lagging = tmp_path / "resumed", tmp_path / "lagging"  # rank 0's run has checkpoint-2, rank 1's none yet
    args = opsd.parse_args(flags(tiny_model_dir, resumed, "--resume"))
    record = json.dumps(opsd.run_record(args, opsd.load_prompts(args)[1], torch.device("cpu")))
    for out in (resumed, lagging):
        out.mkdir()
        (out / "args.json").write_text(record)
    (resumed / "checkpoint-2").mkdir()
    torch.save({"step": 2, "optimizer": {}, "kl_window": [], "format": opsd.CHECKPOINT_FORMAT},
               resumed / "checkpoint-2" / "trainer_state.pt")
    save_file({"w": torch.zeros(1)}, resumed / "checkpoint-2" / opsd.ADAPTER_WEIGHTS)
    cases = [(f"data:{corrupt}", tmp_path / "out", [], f"rank 1: --dataset {corrupt}: line 2 is not JSON ("),
             (f"output-dir:{tmp_path / 'empty'}", finished, [],
              f"rank 0: --output-dir {finished} already holds a run (args.json): pass --resume"),
             ("flag:--top-p 2", tmp_path / "out", [], "rank 1: --top-p must lie in (0, 1]."),
             (f"output-dir:{lagging}", resumed, ["--resume"],
              "--resume: ranks see checkpoints 0 to 2 as the newest (0: none): give every node one --output-dir (a "
              "lagging shared filesystem?).")]
    for k, (fault, out, extra, sentence) in enumerate(cases):
        logs = tmp_path / f"logs{k}"
        start = time.time()
        nodes = launch_two_nodes([str(ROOT / "tests" / "fault_launch.py"), *flags(tiny_model_dir, out, *extra)], logs,
                                 env={"FAULT": fault})
        try:
            reports = [proc.communicate(timeout=120)[1] for proc in nodes]
        finally:
            stop_nodes(nodes)
        assert time.time() - start < 60, fault  # torch's and transformers' imports on two busy cores, then the checks
        for node, (proc, report) in enumerate(zip(nodes, reports)):
            ours = rank_stderr(logs, node)
            assert proc.returncode != 0 and said(ours, f"opsd.py: error: {sentence}") == 1, ours[-2000:]
            assert "Traceback" not in ours and "<N/A>" not in report and "error: None" not in report
            assert "loading the model" not in ours
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
    so no torchrun learns of it; rank 0 waits in a collective until --collective-timeout (0.15 minutes), then ends
    in one line (transformers and vLLM imported before the run, so that its start-up phases stay well within it)."""
    logs = tmp_path / "logs"
    script = [str(ROOT / "tests" / "fault_launch.py"), *flags(tiny_model_dir, tmp_path / "out", "--collective-timeout",
                                                               "0.15")]
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
    assert 9 <= end - fault_at < 9 + BOUND_S, end - fault_at  # the timeout, then the exits
    rank0 = rank_stderr(logs, 0)
    assert said(rank0, "opsd.py: rank 0: error at step 3 of 5 (") == 1, rank0[-3000:]
    assert "Timed out" in rank0 and rank0.count("Traceback (most recent call last)") == 1
    assert "rank 0: error at step 3 of 5" in root_cause(torchrun0) and "Timed out" in root_cause(torchrun0)


def run_two_nodes(tiny_model_dir, tmp_path, fault, minutes):
    """Two nodes (two torchrun agents, one rank each), `fault` on rank 1, --collective-timeout `minutes`, each node
    waited for to its end: (the agents, their torchrun reports, when each ended, the folder of the ranks' logs)."""
    logs = tmp_path / "logs"
    script = [str(ROOT / "tests" / "fault_launch.py"),
              *flags(tiny_model_dir, tmp_path / "out", "--collective-timeout", str(minutes))]
    nodes = launch_two_nodes(script, logs, env={"FAULT": fault})
    reports = []
    ends = []
    try:
        for node in nodes:
            reports.append(node.communicate(timeout=300)[1])
            ends.append(time.time())
    finally:
        stop_nodes(nodes)
    return nodes, reports, ends, logs


# where rank 1 stalls (tests/fault_launch.py), the phase, --collective-timeout (minutes: above what each phase before
# it takes here, with two nodes on two cores: the input checks ~1 s, the rest under 0.2 s each, with transformers and
# vLLM imported before the run), and what rank 0 says: a rank missing from an agreement is named; a phase whose own
# collectives wait for the stalled rank (the connect, vLLM's start) ends at the same bound
STALLS = [
    ("connect", "the process group's start", 0.1,
     "opsd.py: rank 0: the process group's start did not end within 0.1 minutes"),
    ("load", "the model's load", 0.1, "opsd.py: error: rank 1 did not reach the model's load within 0.1 minutes "
     "(--collective-timeout): rank 1 is in the model's load; the log of its node says where it stopped."),
    ("engine", "vLLM's start", 0.1, "opsd.py: rank 0: vLLM's start did not end within 0.1 minutes"),
]


@pytest.mark.parametrize("stall, phase, minutes, rank_0_says", STALLS, ids=[s[0] for s in STALLS])
def test_a_rank_stalled_before_the_first_step_ends_every_node_within_the_bound(stall, phase, minutes, rank_0_says,
                                                                               tiny_model_dir, tmp_path):
    """Two nodes (two torchrun agents, one rank each); rank 1 sleeps where a real call would block (a hub or a network
    filesystem that stalls, NCCL's connect, vLLM's NCCL splits). No torchrun learns of it, so each node must end by
    itself: rank 1 at its time limit, with its line and where it waited; rank 0 at its own, or at its wait's."""
    nodes, reports, ends, logs = run_two_nodes(tiny_model_dir, tmp_path, f"stall:{stall}", minutes)
    rank0 = rank_stderr(logs, 0)
    rank1 = rank_stderr(logs, 1)
    fault_at, _ = fault_time(rank1)
    assert all(node.returncode != 0 for node in nodes)
    assert [end - fault_at < minutes * 60 + BOUND_S for end in ends] == [True, True], (ends, fault_at)
    stuck = f"opsd.py: rank 1: {phase} did not end within {minutes:g} minutes (--collective-timeout)"
    assert said(rank1, stuck) == 1 and "in stall" in rank1, rank1[-3000:]  # faulthandler's stack: where it waited
    assert said(rank0, rank_0_says) == 1 and said(rank0, "opsd.py: ") == 1, rank0[-3000:]
    assert stuck in root_cause(reports[1]) and rank_0_says.split("opsd.py: ")[1] in root_cause(reports[0])


def test_a_rank_killed_by_a_signal_in_a_phase_is_said_as_that_on_every_node(tiny_model_dir, tmp_path):
    """Two nodes; rank 1 is SIGKILLed in the input checks (the host's OOM killer): its node's torchrun report names
    the signal and the phase, and no time limit (before, its error file claimed the phase's limit, dated a minute past
    it, so a rank torchrun ended later came first as the root cause); rank 0 names it at the agreement, with the
    phase it is in, after --collective-timeout. On one node, where torchrun ends rank 0 at once, rank 1 is the root
    cause."""
    _, reports, ends, logs = run_two_nodes(tiny_model_dir, tmp_path, "signal:checks", 0.15)
    fault_at, _ = fault_time(rank_stderr(logs, 1))
    assert [end - fault_at < 2 + 9 + BOUND_S for end in ends] == [True, True], (ends, fault_at)
    cause = root_cause(reports[1])
    assert "exitcode  : -9" in cause and "SIGKILL" in cause, cause
    assert "traceback : opsd.py: rank 1: ended during the input checks, begun at " in cause, cause
    assert "limit" not in cause and "did not end" not in cause
    rank0 = rank_stderr(logs, 0)
    sentence = ("opsd.py: error: rank 1 did not reach the input checks within 0.15 minutes (--collective-timeout): "
                "rank 1 is in the input checks; the log of its node says where it stopped.")
    assert said(rank0, sentence) == 1 and said(rank0, "opsd.py: ") == 1, rank0[-3000:]
    assert sentence.split("opsd.py: ")[1] in root_cause(reports[0])
    # on one node torchrun SIGTERMs rank 0 when rank 1 ends: its report's root cause is rank 1 still
    code, torchrun, ranks, elapsed = launch(tiny_model_dir, tmp_path / "one-node", "signal:checks")
    cause = root_cause(torchrun)
    assert code != 0 and elapsed is not None and elapsed < 2 + BOUND_S, (elapsed, torchrun[-2000:])
    assert "rank      : 1 (local_rank: 1)" in cause and "SIGKILL" in cause, cause
    assert "traceback : opsd.py: rank 1: ended during the input checks, begun at " in cause, cause


def test_a_frozen_node_0_ends_every_rank_within_the_agreements_bound(tiny_model_dir, tmp_path):
    """Two nodes; node 0's torchrun agent, which keeps the store, stops (SIGSTOP: a hung host, a network that drops
    without a reset) while both ranks are at the start's agreement. The store's client reads its reply without a bound
    (torch's TCPStore::doWait, after its timeout, reads the reply to its cancel with no limit), so each rank ends by
    the agreement's own limit, 1.1 x --collective-timeout, with its line (before, they waited until node 0 came back).
    Node 0's agent, resumed, reports its rank's line."""
    logs = tmp_path / "logs"
    frozen = tmp_path / "frozen"
    script = [str(ROOT / "tests" / "fault_launch.py"),
              *flags(tiny_model_dir, tmp_path / "out", "--collective-timeout", "0.1")]
    nodes = launch_two_nodes(script, logs, env={"FAULT": f"freeze:{frozen}"})
    try:
        while "fault at " not in rank_stderr(logs, 1):
            assert nodes[1].poll() is None, rank_stderr(logs, 1)[-2000:]
            time.sleep(0.1)
        os.kill(nodes[0].pid, signal.SIGSTOP)  # the agent alone; its rank runs on
        stopped = time.time()
        frozen.touch()
        report1 = nodes[1].communicate(timeout=120)[1]
        end1 = time.time()
        line = ("the agreement on the start did not end within 0.11 minutes (1.1 x --collective-timeout: torchrun's "
                "store on node 0 did not answer)")
        while f"opsd.py: rank 0: {line}" not in rank_stderr(logs, 0) and time.time() < stopped + 60:
            time.sleep(0.1)
        end0 = time.time()
        os.kill(nodes[0].pid, signal.SIGCONT)
        report0 = nodes[0].communicate(timeout=60)[1]
    finally:
        if nodes[0].poll() is None:
            os.kill(nodes[0].pid, signal.SIGCONT)
        stop_nodes(nodes)
    assert end1 - stopped < 6.6 + BOUND_S and end0 - stopped < 6.6 + BOUND_S, (end1 - stopped, end0 - stopped)
    for node, report in enumerate((report0, report1)):
        ours = rank_stderr(logs, node)
        assert said(ours, f"opsd.py: rank {node}: {line}") == 1 and said(ours, "opsd.py: ") == 1, ours[-3000:]
        assert "in exchange" in ours  # the stack: where it waited
        assert f"opsd.py: rank {node}: {line}" in root_cause(report), report[-2000:]
    assert nodes[0].returncode != 0 and nodes[1].returncode != 0


@pytest.mark.parametrize("fault, extra, sentence", [
    ("no-cuda", ["--device", "auto"], f"rank 1: --device auto: torch {torch.__version__} sees no GPU (a driver too old "
                                      "for CUDA 13.0, CUDA_VISIBLE_DEVICES, a container without GPUs?): make one "
                                      "visible, or pass --device cpu."),
    ("no-wandb", ["--wandb-project", "p"], "rank 1: --wandb-project needs wandb: pip install wandb.")])
def test_a_node_refused_before_the_process_group_exists_ends_every_node_at_once(fault, extra, sentence, tiny_model_dir,
                                                                                tmp_path):
    """Two nodes: node 1's torch is a CUDA build that sees no GPU, or it lacks wandb. Its refusal comes before the
    process group exists, through torchrun's store: both nodes say it at once (the timeout, 5 minutes, is not
    waited)."""
    logs = tmp_path / "logs"
    script = [str(ROOT / "tests" / "fault_launch.py"),
              *flags(tiny_model_dir, tmp_path / "out", "--collective-timeout", "5", *extra)]
    # rank 0's wandb needs no API key offline (one without is refused too: test_errors.py)
    nodes = launch_two_nodes(script, logs, env={"FAULT": fault, "WANDB_MODE": "offline"})
    try:
        reports = [node.communicate(timeout=120)[1] for node in nodes]
        end = time.time()
    finally:
        stop_nodes(nodes)
    fault_at, _ = fault_time(rank_stderr(logs, 1))
    assert end - fault_at < BOUND_S, end - fault_at
    for node, report in enumerate(reports):
        ours = rank_stderr(logs, node)
        assert said(ours, f"opsd.py: error: {sentence}") == 1 and said(ours, "opsd.py: ") == 1, ours[-2000:]
        assert f"traceback : opsd.py: error: {sentence}" in root_cause(report), report[-2000:]
    assert not (tmp_path / "out").exists()


def test_a_phase_over_its_time_limit_ends_the_rank_with_its_line_and_where_it_waited(tmp_path):
    """A healthy phase cancels its limit (the rank lives on past it); one that stalls ends the rank at its limit, with
    one line and every thread's stack. During a phase, torchrun's report holds the phase and when it began, claiming
    no limit (a signal may end the rank there: torchrun's exit code names it), dated as the phase's start (the rank
    failing there is torchrun's root cause, before the ranks torchrun ends after it); nothing after it."""
    error_file = tmp_path / "error.json"
    code = ("import json, time, opsd\n"
            "began = time.time()\n"
            "with opsd.time_limit('a healthy phase', 0.02):\n"
            "    time.sleep(1.1)\n"
            "    print(json.dumps(json.loads(open(%r).read())), began, flush=True)\n"
            "time.sleep(2)\n"
            "import os; print(os.path.exists(%r), time.time(), flush=True)\n"
            "with opsd.time_limit('a stalled phase', 0.02):\n"
            "    time.sleep(60)\n" % (str(error_file), str(error_file)))
    start = time.time()
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TORCHELASTIC_ERROR_FILE": str(error_file)})
    elapsed = time.time() - start
    assert proc.returncode == 1 and elapsed < 30, (elapsed, proc.stderr[-2000:])
    during, after = proc.stdout.splitlines()
    report, began = json.loads(during.rsplit(" ", 1)[0]), float(during.rsplit(" ", 1)[1])
    clock = time.strftime("%H:%M:%S", time.localtime(report["timestamp"]))
    assert report["message"] == f"opsd.py: rank 0: ended during a healthy phase, begun at {clock}", report
    assert int(began) <= report["timestamp"] <= began + 1, (report, began)
    assert after.split()[0] == "False"
    line = "opsd.py: rank 0: a stalled phase did not end within 0.02 minutes (--collective-timeout)"
    assert proc.stderr.startswith(line) and 'File "<string>", line 9 in <module>' in proc.stderr, proc.stderr
    report = json.loads(error_file.read_text())
    assert report["message"].startswith(line) and int(float(after.split()[1])) <= report["timestamp"], report
    assert report["timestamp"] <= float(after.split()[1]) + 1  # the stalled phase's start, not the end 1.2 s later


def test_an_agreement_names_a_rank_that_did_not_come_and_passes_on_a_failure(monkeypatch):
    """Through a real store, as rank 0 of three: its key for the n-th agreement on a phase is
    opsd/<restart>/<phase>/<n>/<rank>, so ranks on different paths never pair; a missing rank is named with the phase
    it is in (opsd/<restart>/at/<rank>)."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30))
    monkeypatch.setattr(opsd, "STORE", store)
    monkeypatch.setattr(opsd, "WORLD_SIZE", 3)
    monkeypatch.setattr(opsd, "AGREEMENTS", {})
    store.set("opsd/0/a test's phase/1/2", "")  # rank 2 agrees; rank 1 never comes
    start = time.time()
    with pytest.raises(opsd.Refusal) as refusal:
        with opsd.ranks_agree("a test's phase", 0.02):
            pass
    assert 1.2 <= time.time() - start < 10
    assert str(refusal.value) == ("rank 1 did not reach a test's phase within 0.02 minutes (--collective-timeout): "
                                  "the log of its node says where it stopped.")
    store.set("opsd/0/another phase/1/2", "")  # rank 2 is at another phase's first agreement, rank 1 in its work
    store.set("opsd/0/at/1", "another phase")
    with pytest.raises(opsd.Refusal) as refusal:
        with opsd.ranks_agree("another phase", 0.02):
            pass
    assert str(refusal.value) == ("rank 1 did not reach another phase within 0.02 minutes (--collective-timeout): rank 1 "
                                  "is in another phase; the log of its node says where it stopped.")
    store.set("opsd/0/a test's phase/2/1", "a test's refusal")  # the second on the first phase: rank 1 refuses
    store.set("opsd/0/a test's phase/2/2", "")
    with pytest.raises(opsd.Refusal) as refusal:
        with opsd.ranks_agree("a test's phase", 0.02):
            pass
    assert str(refusal.value) == "rank 1: a test's refusal"
    with pytest.raises(OSError):  # the third: this rank fails, and says so for the others, who need not wait
        with opsd.ranks_agree("a test's phase", 0.02):
            raise OSError("a test's failure")
    assert store.get("opsd/0/a test's phase/3/0").decode() == ("a test's phase failed (OSError): the log of its node "
                                                              "says why.")


def test_on_gpus_the_process_group_connects_gloo_first_and_makes_nccls_communicator_at_once(monkeypatch):
    """Read from torch's source (distributed_c10d.py, _new_process_group_helper): for "cpu:gloo,cuda:nccl" the gloo
    backend is made first, its connect bound by the timeout; then, with device_id, NCCL's communicator, while every
    rank is there (its connect bound by the caller's time limit only), so each later collective is bound by the
    timeout too. No GPU here: CUDA's calls are stood in for, and the calls opsd.py makes are recorded."""
    calls = []
    store = object()
    monkeypatch.setattr(opsd, "WORLD_SIZE", 2)
    monkeypatch.setattr(opsd, "RANK", 1)
    monkeypatch.setattr(opsd, "LOCAL_RANK", 1)
    monkeypatch.setattr(opsd, "STORE", store)
    monkeypatch.setattr(opsd.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(opsd.torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(opsd.torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    monkeypatch.setattr(opsd.dist, "init_process_group", lambda *a, **kw: calls.append((a, kw)))
    for name in opsd.PUSH_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    args = opsd.parse_args(["--collective-timeout", "0.5"])
    device = opsd.choose_device(args)
    assert device == opsd.torch.device("cuda", 1)
    opsd.init_distributed(args, device)
    assert calls == [("set_device", device),
                     (("cpu:gloo,cuda:nccl",), {"store": store, "rank": 1, "world_size": 2,
                                                "timeout": timedelta(seconds=30), "device_id": device})]
    monkeypatch.setattr(opsd.torch.cuda, "device_count", lambda: 1)  # two ranks on a node that sees one GPU
    with pytest.raises(opsd.Refusal, match="this node sees 1 GPUs, fewer than its ranks"):
        opsd.choose_device(args)


def test_a_slow_final_save_on_rank_0_does_not_fail_a_finished_run(tiny_model_dir, tmp_path):
    """Rank 0 writes final/ (and finishes wandb) while the other ranks end: none waits for it in a collective,
    which --collective-timeout (here 3 s; the start-up's phases run without their time limit here) would end. Rank
    0's final save takes 5 s more here."""
    code, torchrun, ranks, _ = launch(tiny_model_dir, tmp_path, "slow-final", "--max-steps", "1",
                                      "--collective-timeout", "0.05")
    assert code == 0, (torchrun[-2000:], ranks.get(0, "")[-2000:], ranks.get(1, "")[-2000:])
    assert "slow final save" in ranks[0] and (tmp_path / "out" / "final" / "adapter_model.safetensors").exists()
