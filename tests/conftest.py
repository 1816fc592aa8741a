"""Shared fixtures: the tiny Qwen3 model is built once per pytest session."""

import os
import sys
from contextlib import contextmanager
from pathlib import Path

# vLLM on CPU: a small KV cache, and the engine in this process so tests can reach its worker.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# vLLM's CPU sampler uncompiled (the same operations, eager) in this process and the ones it starts: torch compiles
# it anew in each process that starts an engine, ~4 s, and the suite starts ~40. The runs that stand for a user's
# (the README's quickstart, the miniature's quick run, eval.py as a user meets it) run as_a_user_would(), compiled.
# ATEN_CPU_CAPABILITY=default (torch's plain kernels, as a CPU without AVX would run): torch 2.13's compiler then writes
# vector code for the sampler that it cannot build, so there every run stays eager.
COMPILE_SET_BEFORE = "TORCH_COMPILE_DISABLE" in os.environ
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")

TESTS = Path(__file__).resolve().parent
# the unit tests import opsd.py and eval.py from the root and the scripts they test from their folders
sys.path[:0] = [str(TESTS.parent), str(TESTS), *(str(TESTS / d) for d in ("miniature", "miniature/context", "gpu_check", "benchmark"))]

import pytest  # noqa: E402

import make_tiny_model  # noqa: E402

# the method's tests, what `python -m pytest tests -m method -q` runs after each edit of the loss or its port: the
# loss against its float64 oracles, LoRA, the prompts and the batches' positions, the schedule, and the verifier's
# kit on its own fixture (opsd.py and a correct port reproduce it, each defect is named, check 2's batches); the
# verifier's catalogue of peers' forms (the rest of test_verify.py) runs with every test
METHOD_FILES = ("test_loss.py", "test_lora.py", "test_prompts.py", "test_batches.py", "test_schedule.py")
METHOD_KIT = ("test_the_fixture_speaks_a_peers_language",
              "test_prompt_lengths_differ_within_every_micro_batch_on_both_sides",
              "test_normalisations_are_told_apart_at_every_setting", "test_opsd_reproduces_the_fixture",
              "test_a_correct_port_matches_at_every_setting_and_clip", "test_each_defect_is_named_and_no_other",
              "test_opsd_batches_and_a_left_padded_batch_pass",
              "test_a_pad_between_prompt_and_answer_fails_naming_the_row", "test_scored_positions_one_late_fail")


def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.name in METHOD_FILES or (item.path.name == "test_verify.py" and item.originalname in METHOD_KIT):
            item.add_marker(pytest.mark.method)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-qwen3")
    make_tiny_model.main(out)
    return str(out)


@pytest.fixture(scope="session")
def vllm_lora_engine(tiny_model_dir):
    """One float32 vLLM engine on the tiny model, with LoRA serving on, shared by read-only tests."""
    from vllm import LLM

    return LLM(model=tiny_model_dir, dtype="float32", enforce_eager=True, seed=0, max_model_len=1024,
               enable_lora=True, max_lora_rank=8)


def user_environment(environment=None):
    """`environment` (os.environ's by default) as a user's shell has it: vLLM's sampler compiled, as torch does
    unless told otherwise (the session turns that off above; not at ATEN_CPU_CAPABILITY=default, nor when the
    caller of pytest set it)."""
    environment = dict(os.environ if environment is None else environment)
    if not COMPILE_SET_BEFORE and environment.get("ATEN_CPU_CAPABILITY") != "default":
        environment.pop("TORCH_COMPILE_DISABLE", None)
    return environment


@contextmanager
def as_a_user_would():
    """os.environ as user_environment() gives it while the block runs (for the processes it starts)."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(user_environment(saved))
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def said(stderr, text):
    """How many of stderr's lines are ours and hold `text`: under torchrun the launcher's report repeats our sentence
    indented ("traceback : opsd.py: error: ..."), and that copy is not one the run said."""
    return sum(text in line for line in stderr.splitlines() if line.startswith("opsd.py: "))


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_two_nodes(script_and_flags, logs, env=None):
    """Two torchrun agents on this machine acting as two nodes of one rank each (--nnodes 2), started together:
    [node 0's Popen, node 1's]; each rank's stderr goes to logs/node<k>/ (rank_stderr reads it). One thread a rank,
    as torchrun sets for several ranks of one node (not for one): the same kernels, so the same float32 sums."""
    import subprocess
    port = free_port()
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
               "--node_rank", str(node), "--master_addr", "127.0.0.1", "--master_port", str(port),
               "--log-dir", str(Path(logs) / f"node{node}"), "--redirects", "3", *script_and_flags]
        procs.append(subprocess.Popen(cmd, cwd=TESTS.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                                      start_new_session=True))
    return procs


def stop_nodes(procs):
    """Kill what is left of a launch_two_nodes run: each agent leads a session of its own, its ranks in it."""
    import signal
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def rank_stderr(logs, node):
    """What the rank of node `node` of a launch_two_nodes run wrote to stderr ('' before it wrote anything)."""
    found = list((Path(logs) / f"node{node}").glob("*/attempt_0/*/stderr.log"))
    return found[0].read_text() if found else ""
