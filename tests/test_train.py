# python -m pytest tests/test_train.py -q
"""The training loop: gradient equivalence across ranks and micro-batches, end-to-end torchrun runs on CPU
with the real vLLM (float32), the recipe's choices together (the EMA teacher, skipped first tokens, hard rows,
wandb offline), Ctrl-C and a SIGKILL in that run, resumed to the same adapter and EMA, and early errors."""

import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import launch_two_nodes, said
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import opsd

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "math_train.jsonl"
KEYS = {"step", "loss", "lr", "grad_norm", "kl_mean", "kl_frac_above_tau", "logprob_gap_mean", "logprob_gap_max",
        "completion_len_mean", "time_sample", "time_train", "time_push"}

# four rows of different prompt and completion lengths; teacher prompts are longer
STUDENT = [[1, 89, 87, 266, 203], [1, 307, 265], [1, 285, 15, 22, 35, 2, 203], [1, 359, 87]]
TEACHER = [p + [300 + i] * (4 + 2 * i) for i, p in enumerate(STUDENT)]
COMPLETIONS = [[40, 41, 42, 43, 2], [50, 51], [60, 61, 62, 63, 64, 65, 66, 2], [70, 71, 72]]


def lora_model(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(0)
    params = opsd.add_lora(model, r=8, alpha=16)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # nonzero B, so A gets a gradient too
        for m in opsd.lora_layers(model).values():
            m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * 0.1)
    return model, params


def step_gradients(model_dir, rows, micro_batch_size):
    model, params = lora_model(model_dir)
    loss, _ = opsd.backward_step(model, params, [STUDENT[i] for i in rows], [TEACHER[i] for i in rows],
                                 [COMPLETIONS[i] for i in rows], pad_id=0, micro_batch_size=micro_batch_size,
                                 teacher="base", temperature=1.1, clip="token", tau=0.05)
    return loss, [p.grad.clone() for p in params]


def rank_worker(rank, model_dir, port, out_dir):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    loss, grads = step_gradients(model_dir, rows=[2 * rank, 2 * rank + 1], micro_batch_size=1)
    torch.save({"loss": loss, "grads": grads}, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_two_micro_batches_equal_one_big_batch(tiny_model_dir, tmp_path):
    ref_loss, ref_grads = step_gradients(tiny_model_dir, rows=[0, 1, 2, 3], micro_batch_size=4)
    mp.spawn(rank_worker, args=(tiny_model_dir, free_port(), str(tmp_path)), nprocs=2)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["loss"] == pytest.approx(ref_loss, rel=1e-5)
        for g, ref in zip(got["grads"], ref_grads):
            torch.testing.assert_close(g, ref, atol=1e-5, rtol=1e-4)
    assert max(g.abs().max() for g in ref_grads) > 1e-3
    # the released recipe's normalisation on the same four rows, two micro-batches of 2 (7 and 11 answer tokens),
    # each divided by its own token count and the two averaged, gives another gradient
    parts = [step_gradients(tiny_model_dir, rows=rows, micro_batch_size=2)[1] for rows in ([0, 1], [2, 3])]
    mean_of_parts = [(a + b) / 2 for a, b in zip(*parts)]
    assert max(((m - r).norm() / r.norm()).item() for m, r in zip(mean_of_parts, ref_grads)) > 0.05



def test_gradient_checkpointing_changes_no_gradient(tiny_model_dir):
    """In main()'s mode (load_model: dropout off, LoRA on, train mode; the teacher's forward under no_grad between
    the student's forward and its backward), checkpointing recomputes each layer (counted) and changes no gradient."""
    results = {}
    for checkpointing in (True, False):
        args = opsd.parse_args(["--model", tiny_model_dir, "--dtype", "float32", "--lora-r", "8", "--lora-alpha", "16",
                                "--gradient-checkpointing" if checkpointing else "--no-gradient-checkpointing"])
        model, params = opsd.load_model(args, torch.device("cpu"))
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():  # nonzero B, so A gets a gradient too
            for m in opsd.lora_layers(model).values():
                m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * 0.1)
        assert model.is_gradient_checkpointing == checkpointing
        calls = []  # a pre-hook: checkpointing's recompute stops once it has what the backward needs, before the end
        model.model.layers[0].register_forward_pre_hook(lambda *_: calls.append(1))
        loss, _ = opsd.backward_step(model, params, STUDENT, TEACHER, COMPLETIONS, pad_id=0, micro_batch_size=2,
                                     teacher="base", temperature=1.1, clip="token", tau=0.05)
        results[checkpointing] = loss, [p.grad.clone() for p in params], len(calls)
    (loss_on, grads_on, calls_on), (loss_off, grads_off, calls_off) = results[True], results[False]
    assert (calls_on, calls_off) == (6, 4)  # 2 micro-batches x (teacher, student, and with checkpointing a recompute)
    assert loss_on == pytest.approx(loss_off, rel=1e-6)
    for a, b in zip(grads_on, grads_off):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)
    assert max(g.abs().max() for g in grads_off) > 1e-3


# -- end to end ----------------------------------------------------------------------------------


def opsd_command(model_dir, out_dir, *extra, nproc=2, dataset=DATA):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return launcher + [str(ROOT / "opsd.py"), "--model", model_dir, "--dataset", str(dataset), "--device", "cpu",
                       "--dtype", "float32", "--prompts-per-step", "4", "--micro-batch-size", "1",
                       "--max-new-tokens", "32", "--output-dir", str(out_dir), "--log-rollouts-every", "2", *extra]


def run(cmd, timeout=300, env=None):
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def metrics(out_dir):
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def entry_run(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("entry")
    stdout = run(opsd_command(tiny_model_dir, out, "--clip", "entry", "--max-steps", "5", "--save-every", "2"))
    return out, stdout


def test_end_to_end_under_torchrun(entry_run, tiny_model_dir):
    """The entry clip's run at the default --kl-window; the token clip's runs under torchrun in test_run_oracle.py,
    where the same checks are made on it (with --overwrite replacing an older run) and its every figure
    recomputed."""
    out, stdout = entry_run
    records = metrics(out)
    assert [r["step"] for r in records] == list(range(1, len(records) + 1)) and len(records) >= 3
    for r in records:
        assert KEYS <= set(r)
        assert all(torch.isfinite(torch.tensor(float(r[k]))) for k in KEYS)
        # sampler and trainer agree on every sampled token: padding, positions and pushes are right
        assert r["logprob_gap_mean"] <= 1e-5 and r["logprob_gap_max"] <= 1e-4  # the float32 floor (~1e-6), x10
        assert r["lr"] > 0 and r["completion_len_mean"] > 0
    step_tokens = [r["completion_len_mean"] * 4 for r in records]  # 4 prompts per step over both ranks
    # the default 20,000-token window has not filled up yet: it covers every step so far
    assert [r["kl_window_tokens"] for r in records] == [sum(step_tokens[:i + 1]) for i in range(len(records))]
    # the command that resumes: once at the start (before a model loads), then on each checkpoint's line
    resume = "to resume: torchrun --nproc_per_node 2 opsd.py "
    assert stdout.index(resume) < stdout.index("step ")
    assert stdout.count(resume) == 1 + len(list(out.glob("checkpoint-*")))  # the same after vLLM's start
    step_lines = [line for line in stdout.splitlines() if line.startswith("step ")]
    assert len(step_lines) == len(records) and "kl" in step_lines[0] and "push" in step_lines[0]
    assert (out / "rollouts.jsonl").exists()
    # the final adapter loads back into the model (and vLLM's loader reads it: see test_lora.py)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    opsd.add_lora(model, r=64, alpha=128)
    opsd.load_adapter(model, out / "final")
    assert any(m.lora_B.abs().max() > 0 for m in opsd.lora_layers(model).values())


TIMINGS = ("time_sample", "time_train", "time_push", "tokens_per_second")


def without_timings(records):
    return [{k: v for k, v in r.items() if k not in TIMINGS} for r in records]


def run_with_fault(cmd, fault, logs):
    """An opsd_command run through tests/fault_launch.py with `fault` on rank 1: (torchrun's process, the time it
    ended, {rank: that rank's stderr}, read from torchrun's per-rank log files)."""
    opsd_at = cmd.index(str(ROOT / "opsd.py"))
    faulty = cmd[:opsd_at] + ["--log-dir", str(logs), "--redirects", "3", str(ROOT / "tests" / "fault_launch.py")]
    proc = subprocess.run(faulty + cmd[opsd_at + 1:], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "FAULT": fault})
    end = time.time()
    return proc, end, {int(p.parent.name): p.read_text() for p in logs.glob("*/attempt_0/*/stderr.log")}


def test_checkpoint_holds_what_a_resume_needs_and_restoring_leaves_the_rng_alone(entry_run, tiny_model_dir):
    out, _ = entry_run
    state = torch.load(out / "checkpoint-2" / "trainer_state.pt", weights_only=True)
    assert set(state) == {"step", "optimizer", "kl_window", "format"} and state["step"] == 2
    assert state["format"] == opsd.CHECKPOINT_FORMAT
    recorded = json.loads((out / "args.json").read_text())  # the flags and the run's contents, recorded once
    assert set(recorded) - set(vars(opsd.parse_args([]))) == {"prompt_ids_sha256", "model_sha256", "device_type"}
    assert recorded["device_type"] == "cpu" and recorded["clip"] == "entry" and recorded["model_sha256"]
    assert [w["tokens"] for w in state["kl_window"]] == [r["completion_len_mean"] * 4 for r in metrics(out)[:2]]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    params = opsd.add_lora(model, r=64, alpha=128)
    optimizer = torch.optim.AdamW(params)
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    step, ema, window = opsd.restore(out / "checkpoint-2", model, params, optimizer)
    assert torch.equal(torch.rand(4), expected)  # a restored RNG state would change the next draws
    assert step == 2 and ema is None and list(window) == state["kl_window"]
    assert optimizer.state_dict()["state"][0]["step"] == 2


def test_output_dir_and_resume_refusals(tiny_model_dir, entry_run, tmp_path, capsys, monkeypatch):
    """Each refused in one sentence, in this process (no rank to agree with), before a model loads."""
    finished, _ = entry_run
    unfinished = tmp_path / "unfinished"  # what a kill after checkpoint-4 leaves: no final/
    shutil.copytree(finished, unfinished, ignore=shutil.ignore_patterns("final"))
    older = tmp_path / "older"  # a run whose args.json does not record its contents
    shutil.copytree(unfinished, older)
    flags = json.loads((older / "args.json").read_text())
    for key in ("prompt_ids_sha256", "model_sha256", "device_type"):
        del flags[key]
    (older / "args.json").write_text(json.dumps(flags))
    other = tmp_path / "other"  # its record says another device type and other prompts
    shutil.copytree(unfinished, other)
    recorded = json.loads((unfinished / "args.json").read_text())
    (other / "args.json").write_text(json.dumps({**recorded, "device_type": "cuda", "prompt_ids_sha256": "0" * 64}))
    cut = tmp_path / "cut"  # a copy cut short: checkpoint-4's trainer state lost its end
    shutil.copytree(unfinished, cut)
    state = cut / "checkpoint-4" / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:1000])
    same = ["--clip", "entry", "--save-every", "2", "--max-steps", "5", "--prompts-per-step", "4",
            "--micro-batch-size", "1", "--max-new-tokens", "32", "--dtype", "float32", "--log-rollouts-every", "2"]
    cases = [
        (["--prompts-per-step", "6", "--micro-batch-size", "4", "--output-dir", str(tmp_path / "a")],
         "must be divisible by ranks x --micro-batch-size"),
        (["--output-dir", str(finished), "--seed", "7"], f"--output-dir {finished} already holds a run"),
        (["--output-dir", str(finished), "--resume", *same], f"the run in {finished} has finished"),
        (["--output-dir", str(unfinished), "--resume", *same, "--max-steps", "200", "--lr", "1e-4", "--clip", "token"],
         f"--resume with other --clip, --max-steps, --lr than the run in {unfinished} would change its results"),
        (["--output-dir", str(tmp_path / "empty"), "--resume", *same], "holds no run to resume (no args.json): drop --resume"),
        (["--output-dir", str(older), "--resume", *same], f"--resume with other prompts, model files, device type than "
                                                          f"the run in {older}"),
        (["--output-dir", str(other), "--resume", *same], f"--resume with other prompts, device type than the run in "
                                                          f"{other} would change its results"),
        (["--output-dir", str(cut), "--resume", *same], f"--resume: {state} does not load (PytorchStreamReader failed "
         f"reading zip archive: failed finding central directory): rename checkpoint-4 to bad-checkpoint-4 to resume "
         "from the one before."),
    ]
    base = ["--model", tiny_model_dir, "--dataset", str(DATA), "--device", "cpu"]
    monkeypatch.setattr(opsd, "load_model", lambda *_: pytest.fail("a model loaded before the refusal"))
    for extra, message in cases:
        with pytest.raises(SystemExit) as stop:
            opsd.main(base + extra)
        err = capsys.readouterr().err
        assert stop.value.code == 2 and err.startswith("opsd.py: error: ") and message in err, (extra, err[-2000:])
        assert err.count("\n") == 1  # one sentence, no traceback
    assert {p.name for p in finished.iterdir()} == {p.name for p in unfinished.iterdir()} | {"final"}  # nothing touched


def test_non_finite_loss_stops_the_run_and_keeps_the_checkpoint(tiny_model_dir, tmp_path):
    # lr 1e30 blows the weights up in one step; step 2's loss is then NaN
    cmd = [sys.executable, str(ROOT / "opsd.py"), "--model", tiny_model_dir, "--dataset", str(DATA), "--device", "cpu",
           "--dtype", "float32", "--prompts-per-step", "2", "--micro-batch-size", "2", "--max-new-tokens", "16",
           "--max-steps", "3", "--save-every", "1", "--lr", "1e30", "--output-dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode != 0
    assert "step 2: non-finite loss" in proc.stderr and "checkpoint-1; to resume: " in proc.stdout
    assert not (tmp_path / "checkpoint-2").exists() and not (tmp_path / "final").exists()
    state = torch.load(tmp_path / "checkpoint-1" / "trainer_state.pt", weights_only=True)
    assert state["step"] == 1
    assert all(torch.isfinite(t).all() for t in load_file(tmp_path / "checkpoint-1" / "adapter_model.safetensors").values())


# -- the recipe's choices together: the EMA teacher, skipped first tokens, hard rows, wandb offline ---------------


@pytest.fixture(scope="module")
def hard_data(tmp_path_factory):
    rows = [json.loads(line) for line in DATA.read_text().splitlines()]
    sources = ["math", "amc", "olympiads", "aops"]
    path = tmp_path_factory.mktemp("data") / "hard.jsonl"
    path.write_text("".join(json.dumps({**r, "source": sources[i % 4], "generated_token_count": (37 * i) % 101}) + "\n"
                            for i, r in enumerate(rows)))
    return path


OFFLINE = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
RECIPE = ("--max-steps", "5", "--save-every", "2", "--lr", "1e-3", "--teacher", "ema", "--ema-decay", "0.5",
          "--skip-first-tokens", "2", "--data-select", "hard")


@pytest.fixture(scope="module")
def recipe_run(tiny_model_dir, hard_data, tmp_path_factory):
    """The recipe's choices together, uninterrupted, with wandb offline: (its --output-dir, what it printed)."""
    out = tmp_path_factory.mktemp("recipe") / "run"
    cmd = opsd_command(tiny_model_dir, out, *RECIPE, "--wandb-project", "opsd-test", dataset=hard_data)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=ROOT, env={**os.environ, **OFFLINE})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc.stdout


def wandb_history(run_dir):
    """The history records of an offline wandb run, read from its run file: a 7-byte header, then 32 KiB
    blocks of records, each with a 7-byte header (checksum, length, kind: 1 whole, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data = next(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb")).read_bytes()
    pos, block, pending, history = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        pending, pos = pending + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                for item in record.history.item})
    return history


def test_ema_skip_select_and_wandb_under_torchrun(recipe_run):
    """The hard rows by the rule, by hand; the EMA teacher's adapter beside the student's in each checkpoint and
    final/; wandb's history holds rank 0's metrics.jsonl records, step for step. Interrupted and resumed to this
    run's weights, EMA and records: test_ctrl_c_and_a_kill_of_one_rank_... below."""
    out, stdout = recipe_run
    counts = sorted((37 * i) % 101 for i in range(32) if i % 4)  # the rule by hand on the 24 rows not from 'math'
    threshold = counts[len(counts) // 2]
    kept = sum((37 * i) % 101 >= threshold for i in range(32) if i % 4)
    assert f"data-select hard: 32 rows -> {kept} (source != 'math', generated_token_count >= {threshold})" in stdout
    assert (out / "checkpoint-2" / "ema" / "adapter_model.safetensors").is_file()
    final, ema = (load_file(out / "final" / d / "adapter_model.safetensors") for d in ("", "ema"))
    assert final.keys() == ema.keys() and any(not torch.equal(final[k], ema[k]) for k in final)
    records = metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    history = {h["_step"]: h for h in wandb_history(out)}
    for r in records:
        assert all(history[r["step"]][k] == pytest.approx(v, rel=1e-12) for k, v in r.items()), r["step"]
    assert "rollouts/_type" in history[5]  # the last step logs its sampled answers


# -- resume checks contents, and signals stop a run quietly -----------------------------------------


def test_run_record_follows_contents_not_names(tiny_model_dir, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(tiny_model_dir, copy)
    prompts = [([1, 2, 3], [1, 2, 3, 4]), ([5], [5, 6])]
    contents = ("prompt_ids_sha256", "model_sha256", "device_type")

    def record(model, prompts):
        full = opsd.run_record(opsd.parse_args(["--model", model]), prompts, torch.device("cpu"))
        return {key: full[key] for key in contents}
    base = record(str(copy), prompts)
    assert base == record(tiny_model_dir, prompts) and base["device_type"] == "cpu"
    # the same number of prompts, one token moved from the student's prompt to the teacher's
    moved = record(str(copy), [([1, 2], [3, 1, 2, 3, 4]), ([5], [5, 6])])
    assert moved["prompt_ids_sha256"] != base["prompt_ids_sha256"]
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[5 * (len(data) - 2**16) // 15 + 100] ^= 1  # one bit inside the 6th of the 16 sampled 64 KiB blocks
    weights.write_bytes(bytes(data))
    assert record(str(copy), prompts)["model_sha256"] not in (None, base["model_sha256"])
    assert record(str(copy), prompts)["model_sha256"] == opsd.model_fingerprint(str(copy))


def interrupt(cmd, ready):
    """Run `cmd` (torchrun), press Ctrl-C once `ready()` holds (torchrun passes SIGINT on to every rank); the line
    rank 0 says about it."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not ready():
        assert proc.poll() is None and time.time() < deadline, "the run ended before the interrupt"
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode != 0, "the interrupt came too late to test anything"
    assert "opsd.py\", line" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith("opsd.py: interrupted at step ")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


def test_ctrl_c_and_a_kill_of_one_rank_end_every_rank_in_one_line_and_the_run_resumes_to_the_same_adapter(
        recipe_run, hard_data, tiny_model_dir, tmp_path):
    """The recipe's run (wandb aside) stopped three ways, then ended on the uninterrupted run's records, rollouts,
    adapter and EMA teacher. Ctrl-C after step 1, before any checkpoint: nothing to resume, and the command printed
    (the run's own, with --resume) starts the run again. In that run, kill -9 of rank 1 in step 3 (after
    checkpoint-2): torchrun ends rank 0 within seconds, silently (or with one error and its traceback, if gloo told
    it first that its peer is gone), and the files hold lines cut in the middle of a write, as a kill can leave.
    Ctrl-C in its resume, once it has logged step 3: the command printed resumes the run, which then ends (with wandb
    offline, as the reference: its history holds the steps after the checkpoint)."""
    reference, _ = recipe_run
    out, logs = tmp_path / "run", tmp_path / "logs"
    cmd = opsd_command(tiny_model_dir, out, *RECIPE, dataset=hard_data)
    head = cmd[:cmd.index(str(ROOT / "opsd.py")) + 1]
    line = interrupt(cmd, lambda: (out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text())
    assert not opsd.checkpoints(out), "the interrupt came too late to test anything"
    assert ", before any checkpoint: nothing to resume; to start again: " in line, line
    again = head + line.split("to start again: ", 1)[1].split(" opsd.py ", 1)[1].split()
    assert again == cmd + ["--resume"]

    proc, end, ranks = run_with_fault(again, "kill", logs)
    fault_at = float(next(line for line in ranks[1].splitlines() if line.startswith("fault at ")).split()[2])
    assert proc.returncode != 0 and end - fault_at < 15, (end - fault_at, proc.stderr[-2000:])
    ours = [line for line in ranks[0].splitlines() if line.startswith("opsd.py")]
    assert len(ours) <= 1 and all("rank 0: error at step 3 of 5 (" in line for line in ours)
    assert "interrupted" not in ranks[0] and (ours or "Traceback" not in ranks[0]), ranks[0][-2000:]
    # torchrun's report lists every failure it saw; which it names first (the kill, or rank 0's lost peer in the same
    # second) is a race, so only that the kill is among them is checked
    assert "Signal 9 (SIGKILL)" in proc.stderr.split("Failures:", 1)[1], proc.stderr[-3000:]
    assert opsd.checkpoints(out).keys() == {2} and not (out / "final").exists()
    for name in ("metrics.jsonl", "rollouts.jsonl"):  # and a line cut in the middle of a write, as a kill can leave
        with open(out / name, "a") as f:
            f.write('{"step": 5, "loss": 0.1')

    # once the resume has logged step 3 (a line cut short reads as no step)
    line = interrupt(again, lambda: 3 in map(opsd.record_step, (out / "metrics.jsonl").read_text().splitlines()))
    assert not (out / "final").exists(), "the interrupt came too late to test anything"
    assert f"(the last checkpoint is {out / 'checkpoint-2'})" in line or "checkpoint-4" in line, line
    command = line.split("to resume: ", 1)[1]
    assert command.startswith("torchrun --nproc_per_node 2 opsd.py ") and "--overwrite" not in command
    assert head + command.split(" opsd.py ", 1)[1].split() == cmd + ["--resume"]

    run(cmd + ["--resume", "--wandb-project", "opsd-test"], env={**os.environ, **OFFLINE})  # wandb, as the reference
    # record for record the uninterrupted run's: steps after the checkpoint are not doubled, a half-written line is
    # dropped, and the KL window (20,000 tokens: every step so far) continues from the checkpoint, not empty
    assert without_timings(metrics(out)) == without_timings(metrics(reference))
    resumed_from = 4 if "checkpoint-4" in line else 2  # the checkpoint the Ctrl-C's line named
    assert sorted(h["_step"] for h in wandb_history(out) if "loss" in h) == list(range(resumed_from + 1, 6))
    rollouts = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert rollouts == [json.loads(line) for line in (reference / "rollouts.jsonl").read_text().splitlines()]
    assert not list(out.glob(".tmp-*"))
    for d in ("", "ema"):  # the student's adapter and the EMA teacher's
        resumed = load_file(out / "final" / d / "adapter_model.safetensors")
        uninterrupted = load_file(reference / "final" / d / "adapter_model.safetensors")
        assert resumed.keys() == uninterrupted.keys()
        for k in resumed:
            assert torch.equal(resumed[k], uninterrupted[k]), (d, k)


def test_only_a_directory_named_checkpoint_n_is_a_checkpoint(entry_run, tmp_path):
    """The refusal of a checkpoint that does not load names a rename that works; so do the two renames a user
    would try first: none of them is read as a checkpoint, and a resume takes the one before."""
    finished, _ = entry_run
    for name in ("bad-checkpoint-4", "checkpoint-4.bad", "checkpoint-4-bad"):
        out = tmp_path / name
        shutil.copytree(finished, out, ignore=shutil.ignore_patterns("final"))
        (out / "checkpoint-4").rename(out / name)
        assert opsd.latest_checkpoint(out) == out / "checkpoint-2"
        assert [p.name for p in opsd.run_files(out)] == ["args.json", "metrics.jsonl", "rollouts.jsonl",
                                                          "checkpoint-2"]
    state = tmp_path / "cut" / "checkpoint-4" / "trainer_state.pt"
    shutil.copytree(finished / "checkpoint-4", state.parent)
    state.write_bytes(state.read_bytes()[:1000])
    with pytest.raises(opsd.Refusal) as refusal:
        opsd.check_checkpoint(state.parent)
    assert str(refusal.value).endswith(": rename checkpoint-4 to bad-checkpoint-4 to resume from the one before.")


def test_a_schedulers_sigterm_ends_every_rank_at_once_and_the_run_resumes_from_its_checkpoint(tiny_model_dir,
                                                                                             tmp_path):
    """torchrun passes a SIGTERM on to every rank, which ends at once (the signal's default action: nothing runs
    that could wait on a collective); the checkpoints on disk are whole."""
    out = tmp_path / "run"
    cmd = opsd_command(tiny_model_dir, out, "--clip", "entry", "--max-steps", "5", "--save-every", "2")
    stderr = signal_after_checkpoint_2(cmd, out, signal.SIGTERM)
    assert "opsd.py\", line" not in stderr and "opsd.py: " not in stderr, stderr[-3000:]
    assert "got signal: 15" in stderr  # torchrun's own report of the SIGTERM it passed on
    last = opsd.latest_checkpoint(out)
    assert last.name in ("checkpoint-2", "checkpoint-4")
    torch.load(last / "trainer_state.pt", weights_only=True)  # whole: each file loads
    load_file(last / "adapter_model.safetensors")


def signal_after_checkpoint_2(cmd, out, sig):
    """Run `cmd`, send torchrun `sig` once checkpoint-2 is on disk; torchrun's stderr, once every rank has ended."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not (out / "checkpoint-2" / "trainer_state.pt").exists():
        assert proc.poll() is None and time.time() < deadline, "the run ended before writing checkpoint-2"
        time.sleep(0.05)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode != 0 and not (out / "final").exists(), "the signal came too late to test anything"
    return stderr


def test_two_nodes_compute_exactly_what_one_node_computes(entry_run, tiny_model_dir, tmp_path):
    """Two torchrun agents on this machine act as two nodes of one rank each (--nnodes 2; one --output-dir that both
    see): the same records, apart from timings, and the same final adapter, bit for bit, as the 2-rank run."""
    reference, _ = entry_run
    out = tmp_path / "two-nodes"
    cmd = opsd_command(tiny_model_dir, out, "--clip", "entry", "--max-steps", "5", "--save-every", "2")
    nodes = launch_two_nodes(cmd[cmd.index(str(ROOT / "opsd.py")):], tmp_path / "logs")
    for node in nodes:
        _, stderr = node.communicate(timeout=300)
        assert node.returncode == 0, stderr[-3000:]
    assert without_timings(metrics(out)) == without_timings(metrics(reference))
    two = load_file(out / "final" / "adapter_model.safetensors")
    one = load_file(reference / "final" / "adapter_model.safetensors")
    assert two.keys() == one.keys() and all(torch.equal(two[k], one[k]) for k in one)


# -- checkpoints on disk: flushed before they are named, refused when a file does not load ---------------------------


def test_a_checkpoint_is_flushed_before_its_rename_and_its_directory_after(tiny_model_dir, tmp_path, monkeypatch):
    model, params = lora_model(tiny_model_dir)
    events, rename = [], os.rename
    monkeypatch.setattr(opsd, "flush", lambda path: events.append(("flush", Path(path))))
    monkeypatch.setattr(opsd.os, "rename", lambda a, b: (events.append(("rename", Path(b))), rename(a, b)))
    args = opsd.parse_args(["--model", tiny_model_dir])
    opsd.save_run_state(tmp_path, model, params, [p.detach().clone() for p in params], args,
                        state={"step": 3, "optimizer": {}, "kl_window": []})
    final = tmp_path / "checkpoint-3"
    renamed = events.index(("rename", final))
    flushed = {path.relative_to(tmp_path / ".tmp-checkpoint-3") for kind, path in events[:renamed]}
    on_disk = {path.relative_to(final) for path in final.rglob("*")}
    assert on_disk == {Path(n) for n in ("adapter_model.safetensors", "adapter_config.json", "trainer_state.pt", "ema",
                                         "ema/adapter_model.safetensors", "ema/adapter_config.json")}
    assert flushed == on_disk | {Path(".")}  # every file and directory, then the rename, then the directory holding it
    assert events[renamed + 1:] == [("flush", tmp_path)]


def resume_with_rank_1_in(rank_1_dir, entry_run, tiny_model_dir, tmp_path):
    """Resume a copy of the entry run (killed after checkpoint-4) with rank 1 reading `rank_1_dir` instead."""
    finished, _ = entry_run
    out = tmp_path / "run"
    shutil.copytree(finished, out, ignore=shutil.ignore_patterns("final"))
    cmd = opsd_command(tiny_model_dir, out, "--clip", "entry", "--max-steps", "5", "--save-every", "2", "--resume")
    proc, _, ranks = run_with_fault(cmd, f"output-dir:{rank_1_dir}", tmp_path / "logs")
    return out, proc, ranks


def test_resume_on_a_rank_that_does_not_see_the_run_is_refused_by_that_rank(entry_run, tiny_model_dir, tmp_path):
    elsewhere = tmp_path / "node-local"
    out, proc, ranks = resume_with_rank_1_in(elsewhere, entry_run, tiny_model_dir, tmp_path)
    assert proc.returncode != 0 and "Traceback" not in ranks[0] + ranks[1]
    sentence = (f"opsd.py: error: rank 1: --resume: {elsewhere} holds no run to resume (no args.json): drop --resume "
                "to start one; across nodes every rank must see one --output-dir.")
    assert said(ranks[0] + ranks[1], sentence) == 1, ranks  # said once on the node, and in torchrun's report
    assert sentence in proc.stderr.split("Root Cause (first observed failure):", 1)[1]


@pytest.mark.parametrize("copy", ["older listing", "bad copy"])
def test_ranks_resuming_from_different_checkpoints_are_refused_before_any_loads_the_model(copy, entry_run,
                                                                                          tiny_model_dir, tmp_path):
    """Each rank picks the newest checkpoint it sees; a node with an older listing (here rank 1 sees a copy of the run
    without checkpoint-4) would resume another step: one comparison over ranks refuses it. A node whose copy of the
    checkpoint is cut short refuses, naming its file, and every rank with it. Both before any rank loads a model."""
    elsewhere = tmp_path / "copy"
    shutil.copytree(entry_run[0], elsewhere, ignore=shutil.ignore_patterns("final", "checkpoint-4"))
    sentence = ("opsd.py: error: --resume: ranks see checkpoints 2 to 4 as the newest (0: none): give every node one "
                "--output-dir (a lagging shared filesystem?).")
    if copy == "bad copy":
        shutil.copytree(entry_run[0] / "checkpoint-4", elsewhere / "checkpoint-4")
        adapter = elsewhere / "checkpoint-4" / opsd.ADAPTER_WEIGHTS
        adapter.write_bytes(adapter.read_bytes()[:100])  # an interrupted copy
        sentence = f"opsd.py: error: rank 1: --resume: {adapter} does not load ("
    _, proc, ranks = resume_with_rank_1_in(elsewhere, entry_run, tiny_model_dir, tmp_path)
    assert proc.returncode != 0 and said(ranks[0] + ranks[1], sentence) == 1, ranks
    assert "Traceback" not in ranks[0] + ranks[1] and "loading the model" not in ranks[0] + ranks[1], ranks
