# python -m pytest tests/test_eval_cli.py -q
"""eval.py as a new user meets it, through its command line: without network the default benchmarks, or a hub model,
are refused in a few seconds, in one sentence naming the offline way, before any engine starts; a real run on the
tiny model prints its progress and table, not vLLM's log, and ends without vLLM warning that its engine died."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import user_environment

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "eval_tiny.jsonl"


def eval_py(argv, **env):
    """Run eval.py as a user would: vLLM's own settings unset and its sampler compiled (the test session sets
    otherwise), `env` added."""
    clean = {k: v for k, v in user_environment().items() if not k.startswith(("VLLM_", "HF_"))}
    start = time.perf_counter()
    out = subprocess.run([sys.executable, str(ROOT / "eval.py"), *argv], capture_output=True, text=True,
                         env={**clean, **env}, cwd=ROOT, timeout=600)
    return out, time.perf_counter() - start


@pytest.mark.parametrize("offline", [
    {"HF_ENDPOINT": "http://127.0.0.1:9"},  # nothing listens there: the Hub does not answer
    {"HF_HUB_OFFLINE": "1"},                # the user says so
])
def test_without_network_the_default_benchmarks_are_refused_at_once(tmp_path, offline):
    # An empty cache, so no copy of the benchmarks can stand in.
    out, seconds = eval_py(["--model", str(tmp_path), "--output-dir", str(tmp_path / "out")],
                           HF_HOME=str(tmp_path / "hf"), **offline)
    assert out.returncode == 2, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("eval.py: error: HuggingFaceH4/aime_2024: cannot load split 'train' from the hub (")
    # the way on: the flag, in the form it takes, for the benchmark that failed
    assert last.endswith("; without network, use a local copy: --data aime24=FILE (a .jsonl, .json or .parquet of "
                         "problem and answer columns).") and "Traceback" not in out.stderr
    assert seconds < 10
    assert not (tmp_path / "out").exists()  # refused before an output directory, let alone an engine


def test_a_hub_model_without_network_is_refused_in_one_sentence(tmp_path):
    # was vLLM's 79-line traceback; an empty cache, so no copy of the model can stand in
    out, _ = eval_py(["--model", "nobody/no-such-model", "--data", f"tiny={DATA}", "--output-dir", str(tmp_path / "out")],
                     HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr[-3000:]
    assert out.stderr.startswith("eval.py: error: --model nobody/no-such-model: cannot load its config (")
    assert out.stderr.endswith("; without network, pass a local model directory.\n")


def test_a_run_prints_its_progress_and_table_not_vllms_log(tiny_model_dir, tmp_path):
    out, _ = eval_py(["--model", tiny_model_dir, "--data", f"tiny={DATA}", "--n", "1", "--max-new-tokens", "8",
                      "--enforce-eager", "--output-dir", str(tmp_path)])
    assert out.returncode == 0, out.stderr
    lines = (out.stdout + out.stderr).splitlines()
    assert not [line for line in lines if " INFO " in line or " WARNING " in line], "\n".join(lines)
    printed = out.stdout.splitlines()
    assert "0 of 3 samples already in" in printed[0] and "3/3 samples" in printed
    table = [line.split() for line in printed[-3:]]
    assert table[0][:3] == ["benchmark", "problems", "avg@1"] and table[1][:2] == ["tiny", "3"]
    assert table[2][:2] == ["all", "3"]


def test_the_engine_is_shut_down_cleanly(tiny_model_dir, tmp_path):
    # vLLM's own engine process (its default, and the GPU path) and its warnings shown, as a user may ask: left to
    # vLLM's exit handlers the engine process was killed, with a warning that it "exited unexpectedly".
    out, _ = eval_py(["--model", tiny_model_dir, "--data", f"tiny={DATA}", "--n", "1", "--max-new-tokens", "8",
                      "--enforce-eager", "--output-dir", str(tmp_path)],
                     VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_LOGGING_LEVEL="WARNING")
    assert out.returncode == 0, out.stderr
    text = out.stdout + out.stderr
    assert " WARNING " in text and " INFO " not in text  # the user's level holds
    assert "exited unexpectedly" not in text and "force kill" not in text
    assert out.stdout.splitlines()[-1].split()[:2] == ["all", "3"]


def test_a_cpu_build_of_torch_on_a_gpu_machine_is_refused_before_anything_loads(tiny_model_dir, tmp_path):
    import torch

    if torch.version.cuda:
        pytest.skip("torch here is a CUDA build")
    fake = tmp_path / "bin"  # a PATH whose first nvidia-smi lists an H100, as on a rented GPU node
    fake.mkdir()
    (fake / "nvidia-smi").write_text('#!/bin/sh\necho "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)"\n')
    (fake / "nvidia-smi").chmod(0o755)
    out, seconds = eval_py(["--model", tiny_model_dir, "--data", f"tiny={DATA}", "--output-dir", str(tmp_path / "out")],
                           PATH=f"{fake}{os.pathsep}{os.environ['PATH']}")
    assert (out.returncode, out.stderr) == (2, f"eval.py: error: torch {torch.__version__} is a CPU build, but "
                                               "nvidia-smi lists a GPU: pip install -r requirements.txt in a fresh "
                                               "venv.\n")
    assert seconds < 15 and not (tmp_path / "out").exists()  # before the output directory, let alone an engine


def as_at_a_terminal():
    """In the child, before eval.py starts: Ctrl-C's signal handled and not blocked, as a shell starts a command.
    A child inherits both from this process, where earlier tests of the suite may have left them otherwise, and
    Python installs its KeyboardInterrupt only where SIGINT is not ignored."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def test_ctrl_c_says_what_was_kept_and_the_command_that_continues(tiny_model_dir, tmp_path):
    import shlex
    import signal

    # Ctrl-C at a terminal signals the whole process group. Sent once the engine is up (config.json
    # written), while it samples. The engine runs in eval.py's process here: with vLLM's engine in a
    # process of its own (its default, the GPU path) this passed alone (41 s) but once did not end
    # within 120 s while the whole suite ran, which a test the suite runs cannot afford.
    argv = ["--model", tiny_model_dir, "--data", f"tiny={DATA}", "--n", "64", "--max-new-tokens", "512",
            "--enforce-eager", "--output-dir", str(tmp_path)]
    clean = {k: v for k, v in user_environment().items() if not k.startswith(("VLLM_", "HF_"))}
    proc = subprocess.Popen([sys.executable, str(ROOT / "eval.py"), *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True,
                            env={**clean, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, preexec_fn=as_at_a_terminal)
    deadline = time.monotonic() + 300
    while not (tmp_path / "config.json").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    # No traceback of eval.py's (vLLM's engine, stopped in the middle of a step, may log its own).
    assert "KeyboardInterrupt" not in err and 'eval.py", line' not in err, err[-3000:]
    path = tmp_path / "samples.jsonl"  # opened when sampling starts
    kept = 0
    if path.exists():
        kept = len(path.read_text().splitlines())
    assert kept < 3 * 64  # stopped before the end
    command = shlex.join(["python", "eval.py", *argv])
    ours = [line for line in err.splitlines() if line.startswith("eval.py: ")]
    assert ours == [f"eval.py: stopped by Ctrl-C; {kept} samples kept in {tmp_path / 'samples.jsonl'}; "
                    f"to draw the rest: {command}"]
