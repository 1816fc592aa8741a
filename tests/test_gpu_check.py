# python -m pytest tests/test_gpu_check.py -q
"""tests/gpu_check.py, the GPU node's check, at its --smoke sizes on this machine, where vLLM cannot be imported
(as on a GPU node that has torch and transformers only): its JSON is complete and passes, and each of its
checks fails when the part of opsd.py it checks is broken on purpose."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "gpu_check.py"
BOOLS_IN_LOSS = ("matches_float64",)
MIB_FIELDS = (("loss", "peak_mib"), ("loss", "naive_peak_mib"), ("step", "peak_mib"), ("step", "model_mib"))


@pytest.fixture(scope="module")
def no_vllm_env(tmp_path_factory):
    """An environment in which `import vllm` fails: a vllm.py that raises, first on PYTHONPATH."""
    block = tmp_path_factory.mktemp("no-vllm")
    (block / "vllm.py").write_text('raise ImportError("vllm is blocked for this test")\n')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(block), os.environ.get("PYTHONPATH", "")]))
    return env


def run(args, env, **kw):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300,
                          **kw)


@pytest.fixture(scope="module")
def smoke(no_vllm_env, tmp_path_factory):
    out = tmp_path_factory.mktemp("smoke") / "smoke.json"
    proc = run([str(SCRIPT), "--smoke", "--output", str(out)], no_vllm_env)
    return proc, out


def test_the_vllm_block_holds(no_vllm_env):
    # the premise of the smoke test: in its environment vLLM (installed here) cannot be imported
    proc = run(["-c", "import vllm"], no_vllm_env)
    assert proc.returncode != 0 and "vllm is blocked for this test" in proc.stderr


def test_smoke_run_passes_without_vllm(smoke):
    proc, out = smoke
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["finished"] is True and r["ok"] is True and r["failures"] == [] and r["smoke"] is True
    for key in ("device", "torch", "transformers"):
        assert isinstance(r[key], str) and r[key]
    assert r["torch"] == torch.__version__

    loss = r["loss"]
    assert isinstance(loss, dict), loss
    for key in ("seconds", "naive_seconds", "loss", "naive_loss", "f64_loss"):
        assert isinstance(loss[key], float) and loss[key] > 0, key
    assert loss["matches_float64"] is True
    # the chunked and the naive loss compute the same value from the same bf16 logits
    assert loss["naive_abs_diff"] <= 1e-4 * loss["loss"]
    # against float64 on the same rounded logits, well within the tolerance the script applies
    for part in ("loss", "grad"):
        assert loss["rel_err_vs_float64"][part] < loss["f64_tolerance"][part] / 3
        assert isinstance(loss["max_abs_err_vs_float64"][part], float)
    if r["device"] == "cpu":  # measured here: 2e-8
        assert loss["rel_err_vs_float64"]["loss"] < 1e-5
    assert loss["f64_positions"] > 2 * loss["chunk_size"]  # the slice spans chunk boundaries

    step = r["step"]
    assert isinstance(step, dict), step
    assert step["finite"] is True and step["loss"] > 0 and step["grad_norm"] > 0 and step["seconds"] > 0
    assert (step["micro_batch"], step["prompt_tokens"], step["completion_tokens"]) == (2, 32, 96)

    assert r["resume_roundtrip"] is True
    d = r["resume_details"]
    assert d["weights_bitwise"] and d["optimizer_bitwise"] and d["step_restored"] and d["rng_cpu_unchanged"]
    assert d["next_loss_rel_diff"] <= 1e-6
    assert r["logits_probe"] == "ok"
    assert r["lora_init_matches_cpu"] is True and r["lora_init_details"]["layers"] == 2 * 7

    # memory: measured from CUDA's allocator only; null on a CPU, where the chunked/naive comparison is not made
    if r["device"] == "cpu":
        assert all(r[part][field] is None for part, field in MIB_FIELDS)
        assert loss["chunked_below_naive"] is None and d["rng_cuda_unchanged"] is None
    else:
        assert all(isinstance(r[part][field], float) for part, field in MIB_FIELDS)
        assert loss["chunked_below_naive"] is True and loss["peak_mib"] < loss["naive_peak_mib"]

    # progress lines with timings, one per finished part
    for key in ("loss", "step", "resume_roundtrip", "logits_probe", "lora_init_matches_cpu"):
        assert f"] {key}: done in " in proc.stderr


def test_smoke_time(smoke):
    proc, _ = smoke
    (last,) = [line for line in proc.stderr.splitlines() if "] all parts passed -> " in line]
    assert float(last.split("]")[0].split()[1]) < 120, last  # "[gpu_check   12.3 s] all parts passed -> ..."


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_without_a_gpu_it_says_so_in_one_sentence(no_vllm_env, tmp_path):
    out = tmp_path / "gpu.json"
    proc = run([str(SCRIPT), "--output", str(out)], no_vllm_env)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"gpu_check.py: error: no CUDA device is visible to torch {torch.__version__}: run this on a GPU node, "
        "or pass --smoke for the tiny run on this machine."]
    assert not out.exists()


def test_an_unwritable_output_is_refused_before_anything_runs(no_vllm_env, tmp_path):
    proc = run([str(SCRIPT), "--smoke", "--output", str(tmp_path / "missing" / "out.json")], no_vllm_env)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"gpu_check.py: error: --output {tmp_path / 'missing' / 'out.json'} cannot be written "
        "(No such file or directory)."]


# Each case breaks one function of opsd.py in the way named, runs the part of gpu_check that checks it, and
# reports what that part found. The clean cases show the same calls pass unbroken.
BREAKING = textwrap.dedent("""
    import copy, json, sys
    from contextlib import contextmanager
    import torch
    sys.path.insert(0, "tests")
    import gpu_check, opsd

    s, dev = gpu_check.SIZES["smoke"], torch.device("cpu")
    orig = {n: getattr(opsd, n) for n in ("opsd_loss", "restore", "add_lora", "final_hidden", "backward_step")}

    @contextmanager
    def broken(name, fn):
        setattr(opsd, name, fn)
        try:
            yield
        finally:
            setattr(opsd, name, orig[name])

    def loss_value_off(*a, **kw):  # value and gradient 10% too large
        loss, stats = orig["opsd_loss"](*a, **kw)
        return loss * 1.1, stats

    def grad_off(*a, **kw):  # the right value, a gradient 10% too large
        loss, stats = orig["opsd_loss"](*a, **kw)
        return loss + 0.1 * (loss - loss.detach()), stats

    def restore_skips_optimizer(checkpoint, model, lora_params, optimizer):
        return orig["restore"](checkpoint, model, lora_params, torch.optim.AdamW(lora_params))

    def restore_skips_weights(checkpoint, model, lora_params, optimizer):
        return orig["restore"](checkpoint, copy.deepcopy(model), lora_params, optimizer)

    def restore_draws_random(*a):
        torch.rand(1)
        return orig["restore"](*a)

    def restore_wrong_step(*a):
        step, ema, window = orig["restore"](*a)
        return step - 1, ema, window

    def lora_from_global_rng(model, r, alpha, seed=0, **kw):
        return orig["add_lora"](model, r, alpha, seed=int(torch.randint(2 ** 30, ())), **kw)

    def scaled_hidden(model, inputs):
        return orig["final_hidden"](model, inputs) * 1.5

    def backward_fails(*a, **kw):
        raise RuntimeError("backward broken on purpose")

    out = {"clean_loss": gpu_check.check_loss(s, dev)["loss"]["matches_float64"],
           "clean_resume": gpu_check.check_resume(s, dev)["resume_roundtrip"]}
    for case, name, fn in [("loss_value_off", "opsd_loss", loss_value_off), ("grad_off", "opsd_loss", grad_off)]:
        with broken(name, fn):
            out[case] = gpu_check.check_loss(s, dev)["loss"]
    for case, fn in [("skips_optimizer", restore_skips_optimizer), ("skips_weights", restore_skips_weights),
                     ("draws_random", restore_draws_random), ("wrong_step", restore_wrong_step)]:
        with broken("restore", fn):
            out[case] = gpu_check.check_resume(s, dev)
    with broken("add_lora", lora_from_global_rng):
        out["lora_global_rng"] = gpu_check.check_lora_init(s, dev)["lora_init_matches_cpu"]
    with broken("final_hidden", scaled_hidden):
        out["scaled_logits"] = gpu_check.check_logits_probe(s, dev)["logits_probe"]
    with broken("backward_step", backward_fails):
        out["main_rc"] = gpu_check.main(["--smoke", "--output", sys.argv[1]])
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def broken(no_vllm_env, tmp_path_factory):
    out = tmp_path_factory.mktemp("broken") / "main.json"
    proc = run(["-c", BREAKING, str(out)], no_vllm_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), json.loads(out.read_text())


def test_the_loss_check_catches_a_wrong_value_or_gradient(broken):
    found, _ = broken
    assert found["clean_loss"] is True
    value, grad = found["loss_value_off"], found["grad_off"]
    assert value["matches_float64"] is False and value["rel_err_vs_float64"]["loss"] == pytest.approx(0.1, rel=1e-3)
    assert grad["matches_float64"] is False
    assert grad["rel_err_vs_float64"]["loss"] < 1e-5 and grad["rel_err_vs_float64"]["grad"] > 0.09


def test_the_resume_check_catches_each_thing_restore_can_lose(broken):
    found, _ = broken
    assert found["clean_resume"] is True
    assert all(found[case]["resume_roundtrip"] is False
               for case in ("skips_optimizer", "skips_weights", "draws_random", "wrong_step"))
    details = {case: found[case]["resume_details"]
               for case in ("skips_optimizer", "skips_weights", "draws_random", "wrong_step")}
    # each breakage is caught by its own check, and not by the others
    checks = ("weights_bitwise", "optimizer_bitwise", "step_restored", "rng_cpu_unchanged")
    expect = {"skips_optimizer": "optimizer_bitwise", "skips_weights": "weights_bitwise",
              "draws_random": "rng_cpu_unchanged", "wrong_step": "step_restored"}
    for case, check in expect.items():
        assert [c for c in checks if details[case][c] is False] == [check], case
    # weights left at their initial values also change the next step's loss
    assert details["skips_weights"]["next_loss_matches"] is False
    assert details["skips_weights"]["next_loss_rel_diff"] > 1e-4


def test_the_lora_and_logits_checks_catch_their_breakage(broken):
    found, _ = broken
    assert found["lora_global_rng"] is False
    assert isinstance(found["scaled_logits"], str) and found["scaled_logits"] not in ("", "ok")  # opsd's refusal


def test_a_failing_part_is_an_error_string_and_the_others_still_run(broken):
    found, r = broken
    assert found["main_rc"] == 1
    assert r["finished"] is True and r["ok"] is False and r["failures"] == ["step", "resume_roundtrip"]
    assert r["step"] == r["resume_roundtrip"] == "error: RuntimeError: backward broken on purpose"
    assert r["loss"]["matches_float64"] is True and r["logits_probe"] == "ok" and r["lora_init_matches_cpu"] is True
