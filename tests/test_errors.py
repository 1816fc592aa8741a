# python -m pytest tests/test_errors.py -q
"""A user's mistakes stop opsd.py early (before the model or vLLM loads) with one sentence, never a traceback,
and under torchrun the sentence is said once and is the cause torchrun's own report names. Each case's expected
sentence is written here by hand."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import opsd

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "math_train.jsonl"


def error_of(argv, capsys):
    """Run opsd.main in this process; return what it printed to stderr when it stopped."""
    with pytest.raises(SystemExit) as stop:
        opsd.main(argv)
    assert stop.value.code == 2
    return capsys.readouterr().err


@pytest.fixture
def base(tiny_model_dir, tmp_path):
    return ["--model", tiny_model_dir, "--dataset", str(DATA), "--device", "cpu", "--output-dir", str(tmp_path / "out")]


def write(path, text):
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("extra, message", [
    (["--max-new-tokens", "0"], "opsd.py: error: --max-new-tokens must be positive.\n"),
    (["--top-p", "0"], "opsd.py: error: --top-p must lie in (0, 1].\n"),
    (["--lr", "-1"], "opsd.py: error: --lr must be positive.\n"),
    (["--lora-r", "0"], "opsd.py: error: --lora-r must be positive.\n"),
    (["--lora-r", "two"], "opsd.py: error: argument --lora-r: invalid int value: 'two'\n"),
    (["--tau", "0"], "opsd.py: error: --tau must be positive.\n"),
    (["--temperature", "3"],
     "opsd.py: error: --temperature must lie in (0, 2].\n"),
    (["--top-k", "0"], "opsd.py: error: --top-k must be -1 (off) or at least 1.\n"),
    (["--vllm-memory", "1.5"], "opsd.py: error: --vllm-memory must lie in (0, 1].\n"),
    (["--clip", "entr"], "opsd.py: error: argument --clip: invalid choice: 'entr' (choose from 'entry', 'token', 'none')\n"),
    (["--skip-first-tokens", "1024"], "opsd.py: error: --skip-first-tokens must lie in [0, --max-new-tokens).\n"),
    (["--teacher", "ema", "--ema-decay", "1"], "opsd.py: error: --ema-decay must lie in (0, 1).\n"),
    (["--resume", "--overwrite"], "opsd.py: error: argument --overwrite: not allowed with argument --resume\n"),
    (["--min-lr", "1e-5"], "opsd.py: error: --min-lr must lie in [0, --lr].\n"),
    (["--warmup-steps", "100"], "opsd.py: error: --warmup-steps must lie in [0, --max-steps).\n"),
    (["--prompts-per-step", "6"], "opsd.py: error: --prompts-per-step 6 must be divisible by ranks x --micro-batch-size "
                                  "= 1 x 4.\n"),
    (["--max-prompt-length", "4000", "--max-new-tokens", "100"], "opsd.py: error: --max-prompt-length 4000 + "
     "--max-new-tokens 100 exceeds the model's context of 4096 tokens: lower one of them.\n"),
])
def test_bad_flags(base, extra, message, capsys):
    assert error_of(base + extra, capsys) == message  # the whole of stderr: one sentence, no usage block


def test_bad_paths(base, tmp_path, capsys):
    typo = str(tmp_path / "tiny-qwn3")  # a local path that does not exist: no hub lookup, no retries
    err = error_of(base + ["--model", typo], capsys)  # transformers' words, then ours
    assert f"--model {typo}: cannot load its config (" in err and "give a model directory that exists" in err
    missing = str(tmp_path / "nope.jsonl")  # a local file: no word of the hub
    assert error_of(base + ["--dataset", missing], capsys) == f"opsd.py: error: --dataset {missing}: Unable to find '{missing}'\n"
    blocked = write(tmp_path / "a-file", "")  # a directory cannot be made under a file
    err = error_of(base + ["--output-dir", f"{blocked}/run"], capsys)
    assert f"--output-dir {blocked}/run: Not a directory: choose another." in err


def test_bad_data_files(base, tmp_path, capsys):
    empty = write(tmp_path / "empty.jsonl", "")
    assert error_of(base + ["--dataset", empty], capsys) == f"opsd.py: error: --dataset {empty}: no rows\n"
    row = json.dumps({"problem": "p", "solution": "s"})
    # the fourth line, as an editor counts it (datasets says "row 2": it counts from 0, past blank lines), and no
    # word of the hub for a local file; a .json file of JSON lines alike
    for name in ("broken.jsonl", "lines.json"):
        broken = write(tmp_path / name, f"{row}\n\n{row}\n{{\"problem\": \"p\", \n{row}\n")
        assert error_of(base + ["--dataset", broken], capsys) == (
            f"opsd.py: error: --dataset {broken}: line 4 is not JSON (Expecting property name enclosed in double quotes)\n")
    document = write(tmp_path / "list.json", f"[{row},\n{row[:-1]}]\n")  # one JSON document: datasets' words
    err = error_of(base + ["--dataset", document], capsys)
    assert err.startswith(f"opsd.py: error: --dataset {document}: ") and "line" not in err and "hub" not in err
    null = write(tmp_path / "null.jsonl", f"{row}\n" + json.dumps({"problem": "p", "solution": None}) + "\n")
    assert f"--dataset {null}, row 2: 'solution' is None, not a string: fix or drop the row." in error_of(
        base + ["--dataset", null], capsys)
    no_column = write(tmp_path / "cols.jsonl", json.dumps({"problem": "p", "answer": "1"}) + "\n")
    err = error_of(base + ["--dataset", no_column], capsys)
    assert f"--dataset {no_column} has no column 'solution' (--context-column); its columns are ['problem', 'answer']." in err
    err = error_of(base + ["--data-select", "hard"], capsys)
    assert f"--dataset {DATA} has no column 'source' (--data-select hard); its columns are [" in err


def test_one_sentence_once_under_torchrun_without_a_traceback_of_ours(tiny_model_dir, tmp_path):
    empty = write(tmp_path / "empty.jsonl", "")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(ROOT / "opsd.py"),
           "--model", tiny_model_dir, "--dataset", empty, "--device", "cpu", "--output-dir", str(tmp_path / "out")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode != 0
    sentence = f"opsd.py: error: --dataset {empty}: no rows"  # every rank's: said without a rank
    lines = proc.stderr.splitlines()
    assert lines.count(sentence) == 1, proc.stderr[-3000:]  # said once, on a line of its own
    assert "opsd.py\", line" not in proc.stderr  # torchrun reports the failed ranks; no frame of ours is printed
    # the launcher's report, which follows, names our sentence as the root cause instead of "<N/A>"
    root_cause = proc.stderr.split("Root Cause (first observed failure):", 1)[1]
    assert f"traceback : {sentence}" in root_cause and "<N/A>" not in proc.stderr


def test_auto_never_trains_a_gpu_sized_model_on_the_cpu_and_leaves_no_directory(tmp_path, capsys, monkeypatch):
    big = tmp_path / "Qwen3-1.7B"  # its config alone: the size is read from it, no weights exist or load
    big.mkdir()
    shutil.copy(ROOT / "tests" / "gpu_check" / "configs" / "Qwen3-1.7B.json", big / "config.json")
    monkeypatch.setattr(opsd.torch.cuda, "is_available", lambda: False)  # a node whose GPU is not visible
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    out = tmp_path / "runs" / "opsd"
    argv = ["--model", str(big), "--dataset", str(DATA), "--output-dir", str(out), "--max-prompt-length", "256",
            "--max-new-tokens", "48"]
    err = error_of(argv, capsys)
    # by hand from the config: embeddings 151936 x 2048 (tied), 28 layers of 50,336,000, the last norm: 1,720,574,976
    assert err == (f"opsd.py: error: --device auto: torch {torch.__version__} sees no CUDA device, and --model {big} has "
                   "1.72B parameters, too many for a CPU: make a GPU visible, or pass --device cpu.\n")
    assert not (tmp_path / "runs").exists()  # refused before anything is written: no empty run directory
    opsd.check_model(opsd.parse_args(argv + ["--device", "cpu"]))  # asked for on purpose, the CPU is allowed
    small = opsd.parse_args(["--model", str(ROOT / "tests" / "miniature" / "model"), *argv[2:]])
    opsd.check_model(small)  # the miniature's 0.8M parameters: auto still uses the CPU


def test_an_unreachable_hub_is_one_sentence_not_a_dozen_retries(base, tmp_path, capfd, monkeypatch):
    import huggingface_hub.utils._http as hub_http
    waits = []
    monkeypatch.setattr(hub_http.time, "sleep", waits.append)  # the client's own retries, without their 30 s of waiting
    with pytest.raises(SystemExit):
        opsd.main(base + ["--model", "nobody/no-such-model"])
    err = capfd.readouterr().err
    assert waits, "the hub client did not retry: nothing here tests that its retries go unprinted"
    assert err.startswith("opsd.py: error: --model nobody/no-such-model: cannot load its config"), err
    assert err.count("\n") == 1, err  # the sentence alone: no "Retrying in 1s [Retry 1/5]" lines before it
    assert not (tmp_path / "out").exists()


CPU_BUILD_ON_A_GPU = (f"torch {torch.__version__} is a CPU build, but nvidia-smi lists a GPU: pip install -r "
                      "requirements.txt in a fresh venv.")


def fake_gpu_path(folder):
    """A PATH whose first nvidia-smi lists an H100, as on a rented GPU node."""
    folder.mkdir()
    smi = folder / "nvidia-smi"
    smi.write_text('#!/bin/sh\necho "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)"\n')
    smi.chmod(0o755)
    return f"{folder}{os.pathsep}{os.environ['PATH']}"


@pytest.mark.skipif(bool(torch.version.cuda), reason="torch here is a CUDA build")
def test_a_cpu_build_of_torch_on_a_gpu_machine_is_refused_before_anything_loads(tiny_model_dir, tmp_path):
    env = {**os.environ, "PATH": fake_gpu_path(tmp_path / "bin")}
    out = tmp_path / "out"
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(ROOT / "opsd.py"), "--model", tiny_model_dir, "--dataset", str(DATA),
                           "--output-dir", str(out)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    seconds = time.perf_counter() - start
    assert (proc.returncode, proc.stderr) == (2, f"opsd.py: error: {CPU_BUILD_ON_A_GPU}\n")
    assert seconds < 15 and not out.exists()  # before the run's directory, let alone the model
    # --device cpu asks for the CPU: no refusal of the build (the run goes on, refused here for its output directory)
    out.mkdir()
    (out / "args.json").write_text("{}")
    proc = subprocess.run([sys.executable, str(ROOT / "opsd.py"), "--model", tiny_model_dir, "--dataset", str(DATA),
                           "--output-dir", str(out), "--device", "cpu"], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and "CPU build" not in proc.stderr and "already holds a run" in proc.stderr


def test_every_flag_has_help_and_shows_its_default():
    """`opsd.py --help` is a reference: each flag says what it is and shows its default; where the recommended
    command departs from the released recipe's default, the help says so."""
    proc = subprocess.run([sys.executable, str(ROOT / "opsd.py"), "--help"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    entries = {}  # flag -> its help entry, from the lines that start with two spaces and a dash
    for line in proc.stdout.split("options:", 1)[1].splitlines():
        if line.startswith("  -"):
            flag = line.split()[0].rstrip(",")
            entries[flag] = line
        elif line.startswith("    ") and entries:
            entries[flag] += line
    usage = proc.stdout.split("\n\n", 1)[0]  # every flag, once
    flags = {word.strip("[]|,") for word in usage.split() if word.strip("[]|,").startswith("--")}
    for flag in sorted(flags):
        if flag.startswith("--no-"):
            continue  # the negative of an on/off flag shares its entry
        assert flag in entries, flag
        assert "(default: " in entries[flag] and len(entries[flag].split("(default:")[0].split()) >= 3, entries[flag]
    assert len(entries) >= 45
    assert "recommended" in entries["--clip"] and "recommended" in entries["--skip-first-tokens"]
    assert "(default: 0.999)" in entries["--ema-decay"]


def test_a_run_that_asks_for_cuda_and_cannot_have_it_is_refused_before_anything_loads(base, tmp_path, capsys,
                                                                                       monkeypatch):
    """--device cuda without a GPU once trained on the CPU and exited 0; a CUDA build that sees no GPU (a driver too
    old, a container started without GPUs) is refused with --device auto too. Before the process group, so across
    nodes every node says it (test_ranks.py)."""
    monkeypatch.setattr(opsd.torch.cuda, "is_available", lambda: False)
    cuda = base + ["--device", "cuda"]
    assert error_of(cuda, capsys) == (f"opsd.py: error: --device cuda: torch {torch.__version__} is a CPU build: pip "
                                      "install -r requirements.txt in a fresh venv, or pass --device cpu.\n")
    monkeypatch.setattr(opsd.torch.version, "cuda", "13.0")
    for device in ("cuda", "auto"):
        assert error_of(base + ["--device", device], capsys) == (
            f"opsd.py: error: --device {device}: torch {torch.__version__} sees no GPU (a driver too old for CUDA "
            "13.0, CUDA_VISIBLE_DEVICES, a container without GPUs?): make one visible, or pass --device cpu.\n")
    monkeypatch.setattr(opsd.importlib.util, "find_spec", lambda name, *args: None)  # a node without wandb
    assert error_of(base + ["--wandb-project", "p"], capsys) == (
        "opsd.py: error: --wandb-project needs wandb: pip install wandb.\n")
    assert not (tmp_path / "out").exists()


def test_wandb_without_credentials_and_torchruns_restarts_are_refused_at_the_start(base, tmp_path, capsys,
                                                                                 monkeypatch):
    """--wandb-project on a node where wandb has no API key: refused at the start (before, wandb.init asked for one
    after the engine had started, at a terminal without a timeout while the other ranks waited); WANDB_MODE=offline
    needs none. torchrun's --max-restarts above 0 (a restart would meet the run's own files): refused at the start.
    Each before any model loads."""
    monkeypatch.setattr(opsd, "load_model", lambda *_: pytest.fail("a model loaded before the refusal"))
    for name in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    for name in ("HOME", "WANDB_CONFIG_DIR", "NETRC"):  # no settings file, no .netrc
        monkeypatch.setenv(name, str(tmp_path / "nowhere"))
    assert error_of(base + ["--wandb-project", "p"], capsys) == (
        "opsd.py: error: --wandb-project: wandb has no API key on rank 0's node: wandb login, or set "
        "WANDB_API_KEY or WANDB_MODE=offline.\n")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    assert error_of(base + ["--wandb-project", "p"], capsys) == (
        "opsd.py: error: torchrun --max-restarts 3: a restart would meet this run's files: pass 0, and resume "
        "with the command a stop prints.\n")
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_in_another_format_is_refused_before_the_model_loads(tmp_path):
    """trainer_state.pt holds its format (opsd.CHECKPOINT_FORMAT); one written before it did is format 1 if its KL
    window holds loss_tokens, else 0 (such a checkpoint once resumed, ran a step, then failed on KeyError
    'loss_tokens' at every retry). Another format, older or newer, is one sentence saying what to do."""
    checkpoint = tmp_path / "checkpoint-2"
    checkpoint.mkdir()
    opsd.save_file({"w": torch.zeros(1)}, str(checkpoint / opsd.ADAPTER_WEIGHTS))
    sums = {"tokens": 3.0, "kl": 0.5}  # a window's sums before loss_tokens
    for state, written in [({"kl_window": [sums]}, 0), ({"kl_window": [sums], "format": 2}, 2),
                           ({"kl_window": [{**sums, "loss_tokens": 2.0}]}, 1), ({"kl_window": [], "format": 1}, 1)]:
        torch.save({"step": 2, "optimizer": {}, **state}, checkpoint / "trainer_state.pt")
        if written == opsd.CHECKPOINT_FORMAT:
            opsd.check_checkpoint(checkpoint)
            continue
        with pytest.raises(opsd.Refusal) as refusal:
            opsd.check_checkpoint(checkpoint)
        assert str(refusal.value) == (f"--resume: {checkpoint} is in format {written}, this opsd.py's is 1: resume with "
                                      "the opsd.py that wrote it, or start a new --output-dir.")


def test_a_model_without_a_chat_template_is_one_sentence_before_it_loads(tiny_model_dir, base, tmp_path, capsys,
                                                                         monkeypatch):
    plain = tmp_path / "plain"
    shutil.copytree(tiny_model_dir, plain)
    for path in plain.iterdir():  # the template, wherever transformers saved it
        if path.name == "chat_template.jinja":
            path.unlink()
    config = plain / "tokenizer_config.json"
    config.write_text(json.dumps({k: v for k, v in json.loads(config.read_text()).items() if k != "chat_template"}))
    monkeypatch.setattr(opsd, "load_model", lambda *_: pytest.fail("a model loaded before the refusal"))
    assert error_of(base + ["--model", str(plain)], capsys) == (
        f"opsd.py: error: --model {plain} has no chat template (its tokenizer sets none): use a chat or instruct "
        "model, or give its directory a chat_template.jinja.\n")


def test_enforce_eager_reaches_vllms_engine_on_a_gpu(monkeypatch):
    """No CUDA engine can start here: the arguments opsd.py gives vLLM's LLM are recorded. On a CPU the engine is
    always eager (CPU_ENGINE)."""
    import vllm
    given = []
    monkeypatch.setattr(vllm, "LLM", lambda **kwargs: given.append(kwargs))
    for flag, eager in (("--enforce-eager", True), ("--no-enforce-eager", False)):
        opsd.start_engine(opsd.parse_args([flag]), torch.device("cuda", 0))
        assert given[-1]["enforce_eager"] is eager and given[-1]["gpu_memory_utilization"] == 0.3
    opsd.start_engine(opsd.parse_args(["--no-enforce-eager"]), torch.device("cpu"))
    assert given[-1]["enforce_eager"] is True
