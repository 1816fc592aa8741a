# python -m pytest tests/test_gpu_check.py -q
"""tests/gpu_check/gpu_check.py, the GPU node's check, at its --smoke sizes on this machine, where vLLM cannot be imported
(as on a GPU node that has torch and transformers only): its JSON is complete and passes, and each of its
checks fails when the part of opsd.py it checks is broken on purpose."""

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "gpu_check" / "gpu_check.py"
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

    # training's kernel choice, taken from opsd.py; the batch under it ran SDPA's CPU kernel, forward and backward
    assert r["sdpa_enabled"] == {"flash": True, "mem_efficient": True, "math": True, "cudnn": False}
    padded = r["padded_batch"]
    if r["device"] == "cpu":
        ran = padded["backends"]["default"]["kernels_ran"]
        assert ran == ["flash_attention_for_cpu", "flash_attention_for_cpu_backward"], ran
    assert padded["backends"]["math"]["kernels_ran"] == ["attention_math"]
    assert padded["passed"] is True and padded["alone_finite"] is True
    assert padded["backends"].keys() == {"default", "flash", "efficient", "cudnn", "math"}
    for name, b in padded["backends"].items():
        if name in ("default", "math"):
            assert "loss" in b, (name, b)
        if "loss" in b:  # ran: finite, no query row without a key, each row within the tolerance of its loss alone
            assert b["passed"] is True and b["finite"] is True and b["query_rows_without_key"] == 0
            assert b["max_row_rel_diff"] <= padded["tolerance"]["row_loss"]
            assert b["grad_rel_diff"] <= padded["tolerance"]["grad"]
            assert len(b["row_losses"]) == len(padded["alone_row_losses"]) == 3
            assert b["loss"] > 0 and all(x > 0 for x in b["row_losses"])
        else:  # refused (the CPU has no memory-efficient or cuDNN kernel) or absent: a one-line reason
            ((verdict, reason),) = b.items()
            assert verdict in ("refused", "absent") and reason.strip() and "\n" not in reason
    # every row has its own lengths, student and teacher alike, so both batches hold pads
    assert len(set(padded["student_prompts"])) == len(set(padded["completions"])) == 3
    assert len({t - s for t, s in zip(padded["teacher_prompts"], padded["student_prompts"])}) == 3

    readback = r["identity_readback"]
    assert readback["passed"] is True
    # the tiny Qwen3's shapes: hidden 64, intermediate 128, 2 query heads and 1 key/value head of 32
    assert readback["shapes"] == {"64x64": ["q_proj", "o_proj"], "32x64": ["k_proj", "v_proj"],
                                  "128x64": ["gate_proj", "up_proj", "qkv_proj"], "64x128": ["down_proj"],
                                  "256x64": ["gate_up_proj"]}
    # TF32 exists on CUDA only: on a CPU the unjudged float32_tf32_allowed is exact as well
    for key in ("bfloat16", "float32", "float32_tf32_allowed")[:3 if r["device"] == "cpu" else 2]:
        assert readback[key]["bitwise"] is True and set(readback[key]["mismatched_elements"].values()) == {0}
        assert all(readback[key]["fingerprint_equal"].values())
    assert readback["float32"]["settings"]["float32_matmul_precision"] == "highest"
    assert readback["float32"]["settings"]["allow_tf32"] is False

    # progress lines with timings, one per finished part
    for key in ("loss", "step", "resume_roundtrip", "logits_probe", "lora_init_matches_cpu", "padded_batch",
                "identity_readback"):
        assert f"] {key}: done in " in proc.stderr


def test_smoke_reports_its_time(smoke):
    proc, _ = smoke  # a time, not a bound on it: a loaded machine would fail a bound
    (last,) = [line for line in proc.stderr.splitlines() if "] all parts passed -> " in line]
    assert float(last.split("]")[0].split()[1]) > 0, last  # "[gpu_check   12.3 s] all parts passed -> ..."


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_without_a_gpu_it_says_so_in_one_sentence(no_vllm_env, tmp_path):
    out = tmp_path / "gpu.json"
    proc = run([str(SCRIPT), "--output", str(out)], no_vllm_env)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"gpu_check.py: error: no CUDA device is visible to torch {torch.__version__}: run this on a GPU node, "
        "or pass --smoke for the tiny run on this machine."]
    assert not out.exists()


@pytest.mark.skipif(bool(torch.version.cuda), reason="torch here is a CUDA build")
def test_a_cpu_build_of_torch_on_a_gpu_machine_is_refused_before_anything_runs(no_vllm_env, tmp_path):
    fake = tmp_path / "bin"  # a PATH whose first nvidia-smi lists an H100, as on a rented GPU node
    fake.mkdir()
    (fake / "nvidia-smi").write_text('#!/bin/sh\necho "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)"\n')
    (fake / "nvidia-smi").chmod(0o755)
    env = {**no_vllm_env, "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}"}
    for flags in ([], ["--smoke"]):  # --smoke too: on a GPU node it is meant to run on the GPU
        out = tmp_path / "gpu.json"
        start = time.perf_counter()
        proc = run([str(SCRIPT), *flags, "--output", str(out)], env)
        assert (proc.returncode, proc.stderr) == (2, f"gpu_check.py: error: torch {torch.__version__} is a CPU build, "
                                                     "but nvidia-smi lists a GPU: pip install -r requirements.txt "
                                                     "in a fresh venv.\n")
        assert time.perf_counter() - start < 15 and not out.exists()  # before its output is written, let alone a model


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
    sys.path.insert(0, "tests/gpu_check")
    import gpu_check, opsd

    s, dev = gpu_check.SIZES["smoke"], torch.device("cpu")
    orig = {n: getattr(opsd, n) for n in ("opsd_loss", "restore", "add_lora", "final_hidden", "backward_step",
                                          "build_batch")}

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

    def left_padded(prompts, completions, pad_id, device, attend_pads=False):
        # opsd.py's former builder: [left pads | prompt | completion | right pads], positions cumsum - 1; with
        # attend_pads, a mask that lets every token see the pads too
        P, L = max(map(len, prompts)), max(map(len, completions))
        input_ids = torch.full((len(prompts), P + L), pad_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        completion_mask = torch.zeros_like(input_ids, dtype=torch.bool)
        for row, (prompt, completion) in enumerate(zip(prompts, completions)):
            input_ids[row, P - len(prompt):P] = torch.tensor(prompt)
            input_ids[row, P:P + len(completion)] = torch.tensor(completion)
            attention_mask[row, P - len(prompt):P + len(completion)] = 1
            completion_mask[row, P:P + len(completion)] = True
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # (B, P + L)
        if attend_pads:
            attention_mask[:, :P] = 1
        inputs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
        return {k: v.to(device) for k, v in inputs.items()}, completion_mask.to(device)

    def left_padded_pads_attended(*a):
        return left_padded(*a, attend_pads=True)

    # A stand-in for the CUDA kernels that return NaN for a query row whose mask allows no key (the CPU's SDPA
    # returns 0 there): SDPA's result with such rows set to NaN, registered in transformers in SDPA's place.
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def nan_on_rows_without_key(module, query, key, value, attention_mask, **kwargs):
        out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)  # (B, Q, H, D)
        if attention_mask is not None:
            without_key = ~attention_mask.bool().any(-1)  # (B, 1, Q)
            out = out.masked_fill(without_key.any(1)[:, :, None, None], float("nan"))
        return out, weights

    @contextmanager
    def nan_kernel():
        AttentionInterface.register("sdpa", nan_on_rows_without_key)
        try:
            yield
        finally:
            AttentionInterface.register("sdpa", sdpa_attention_forward)

    orig_product = gpu_check.identity_product

    @contextmanager
    def product(fn):
        gpu_check.identity_product = fn
        try:
            yield
        finally:
            gpu_check.identity_product = orig_product

    def one_ulp_off(eye, weight):  # one element of I W^T one unit in the last place away
        got = orig_product(eye, weight).clone()
        got[1, 2] = torch.nextafter(got[1, 2], torch.tensor(float("inf"), dtype=got.dtype))
        return got

    def tf32(x):  # float32 rounded to TF32's 10 mantissa bits (to nearest, ties away), as a TF32 GEMM reads it
        bits = x.contiguous().view(torch.int32)
        return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)

    def tf32_when_allowed(eye, weight):  # a device whose float32 GEMM rounds to TF32 whenever it is allowed
        fast = torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest"
        return orig_product(eye, tf32(weight) if fast and weight.dtype == torch.float32 else weight)

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
    with broken("build_batch", left_padded):
        out["left_padded"] = gpu_check.check_padded(s, dev)["padded_batch"]
        with nan_kernel():
            out["left_padded_nan_kernel"] = gpu_check.check_padded(s, dev)["padded_batch"]
    with broken("build_batch", left_padded_pads_attended):
        out["pads_attended"] = gpu_check.check_padded(s, dev)["padded_batch"]
    with nan_kernel():
        out["right_padded_nan_kernel"] = gpu_check.check_padded(s, dev)["padded_batch"]
    with product(one_ulp_off):
        out["one_ulp_off"] = gpu_check.check_readback(s, dev)["identity_readback"]
    torch.backends.cuda.matmul.allow_tf32 = True  # a user's setting: the float32 check must not run under it
    torch.set_float32_matmul_precision("high")
    with product(tf32_when_allowed):
        out["tf32_when_allowed"] = gpu_check.check_readback(s, dev)["identity_readback"]
        out["settings_after"] = [torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision()]
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = False
    with product(lambda eye, weight: orig_product(eye, tf32(weight) if weight.dtype == torch.float32 else weight)):
        out["tf32_always"] = gpu_check.check_readback(s, dev)["identity_readback"]
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
    assert r["padded_batch"]["passed"] is True and r["identity_readback"]["passed"] is True


def test_the_padded_batch_check_catches_left_pads_under_a_nan_kernel(broken):
    found, _ = broken
    # the CPU's SDPA returns 0 for a left pad's query row: left pads pass here, which is why CPU tests missed them
    left = found["left_padded"]
    pads = sum(max(prompts) - n for prompts in (left["student_prompts"], left["teacher_prompts"]) for n in prompts)
    assert pads > 0 and left["backends"]["default"]["query_rows_without_key"] == pads  # each left pad is such a row
    assert left["passed"] is True
    # under a kernel that returns NaN there (as some CUDA kernels do), the check fails on every backend that ran
    nan = found["left_padded_nan_kernel"]
    assert nan["passed"] is False and nan["alone_finite"] is True  # rows alone have no pads
    ran = {name: b for name, b in nan["backends"].items() if "loss" in b}
    assert {"default", "math"} <= ran.keys()
    assert all(b["finite"] is False and b["passed"] is False for b in ran.values())
    # opsd.py's right-padded batch has no such row: the same kernel changes nothing
    right = found["right_padded_nan_kernel"]
    assert right["passed"] is True
    assert all(b["query_rows_without_key"] == 0 and b["finite"] for b in right["backends"].values() if "loss" in b)


def test_the_padded_batch_check_catches_pads_that_reach_real_tokens(broken):
    found, _ = broken
    leak = found["pads_attended"]  # finite, but each row's loss is no longer its loss alone
    assert leak["passed"] is False
    for name in ("default", "math"):
        b = leak["backends"][name]
        assert b["finite"] is True and b["passed"] is False
        assert b["max_row_rel_diff"] > 10 * leak["tolerance"]["row_loss"]
        assert b["grad_rel_diff"] > leak["tolerance"]["grad"]


def test_the_readback_check_catches_one_ulp(broken):
    found, _ = broken
    r = found["one_ulp_off"]
    assert r["passed"] is False
    for key in ("bfloat16", "float32", "float32_tf32_allowed"):
        assert r[key]["bitwise"] is False
        assert set(r[key]["mismatched_elements"].values()) == {1}  # one element at every shape
        assert not any(r[key]["fingerprint_equal"].values())  # and opsd.fingerprint sees it


def test_the_readback_check_runs_float32_at_full_precision_whatever_was_set(broken):
    found, _ = broken
    # a device that rounds float32 GEMMs to TF32 when allowed; the process had TF32 allowed beforehand
    r = found["tf32_when_allowed"]
    assert r["passed"] is True and r["bfloat16"]["bitwise"] and r["float32"]["bitwise"]
    assert r["float32_tf32_allowed"]["bitwise"] is False  # reported, not judged
    assert min(r["float32_tf32_allowed"]["mismatched_elements"].values()) > 0
    precision = {key: {k: r[key]["settings"][k] for k in ("float32_matmul_precision", "allow_tf32")}
                 for key in ("float32", "float32_tf32_allowed")}
    assert precision == {"float32": {"float32_matmul_precision": "highest", "allow_tf32": False},
                         "float32_tf32_allowed": {"float32_matmul_precision": "high", "allow_tf32": True}}
    assert found["settings_after"] == [True, "high"]  # the process's own settings are given back
    # a device whose float32 GEMM is never exact fails the float32 check only
    r = found["tf32_always"]
    assert r["passed"] is False and r["bfloat16"]["bitwise"] is True and r["float32"]["bitwise"] is False


def test_the_readback_shapes_are_qwen3_1_7b_s():
    import gpu_check

    # Qwen3-1.7B's published config: hidden 2,048, intermediate 6,144, 16 query heads and 8 key/value heads of 128
    assert gpu_check.projection_shapes(gpu_check.QWEN3_1_7B) == {
        (2048, 2048): ["q_proj", "o_proj"], (1024, 2048): ["k_proj", "v_proj"],
        (6144, 2048): ["gate_proj", "up_proj"], (2048, 6144): ["down_proj"],
        (4096, 2048): ["qkv_proj"], (12288, 2048): ["gate_up_proj"]}


def test_training_chooses_the_attention_kernels_in_one_place_whatever_was_set_before():
    """opsd.choose_attention_kernels, which init_distributed calls before any model is built, sets all four SDPA
    switches, so the choice is the same whatever was set before it (importing vLLM's CUDA platform sets cuDNN's)."""
    import itertools

    import opsd

    b = torch.backends.cuda
    switches = ("flash", "mem_efficient", "math", "cudnn")
    try:
        for before in itertools.product([False, True], repeat=4):
            for name, on in zip(switches, before):
                getattr(b, f"enable_{name}_sdp")(on)
            if before == (False, False, False, True):
                opsd.init_distributed(opsd.parse_args(["--device", "cpu"]), torch.device("cpu"))
            else:
                opsd.choose_attention_kernels()
            assert [getattr(b, f"{name}_sdp_enabled")() for name in switches] == [True, True, True, False], before
    finally:
        for name in switches:
            getattr(b, f"enable_{name}_sdp")(True)


# -- the memory budget (tests/gpu_check/budget.py): its trainer-side formula against measured peaks ------------------

# One micro-batch through opsd.backward_step and an AdamW step on a tiny random Qwen3, in a process of its own whose
# large blocks are each mapped apart (so resident memory follows the live tensors): the peak resident memory above
# what the model and its LoRA already held, read from the kernel (VmHWM after a reset). Prints one JSON line.
MEASURE = """
import gc, json, os, sys, torch
from pathlib import Path
sys.path[:0] = [{root!r}, {gpu_check!r}]
import opsd, gpu_check
def rss(field):
    return next(int(l.split()[1]) for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(field))
def peak(case):
    s = dict(gpu_check.SIZES["smoke"], model=dict(gpu_check.TINY_QWEN3, **case["model"]),
             dtype=getattr(torch, case["dtype"]))
    model = gpu_check.build_model(s, torch.device("cpu"))
    params = opsd.add_lora(model, case["lora_r"], 2.0 * case["lora_r"], seed=0)
    if case["checkpointing"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={{"use_reentrant": False}})
    model.train()
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    g = torch.Generator().manual_seed(0)
    ids = lambda n: [torch.randint(1, case["model"]["vocab_size"], (n,), generator=g).tolist()
                     for _ in range(case["rows"])]
    prompts, completions = ids(case["prompt"]), ids(case["answer"])
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    base = rss("VmRSS")
    opsd.backward_step(model, params, prompts, prompts, completions, pad_id=0, micro_batch_size=case["rows"],
                       teacher="base", temperature=1.1, clip="token", tau=0.2, chunk_size=case["chunk"])
    optimizer.step()
    return (rss("VmHWM") - base) * 1024
peaks = []
for case in json.loads(sys.argv[1]):  # each case in a process of its own, forked after the imports
    read, write = os.pipe()
    if os.fork() == 0:
        os.write(write, json.dumps(peak(case)).encode())
        os._exit(0)
    os.close(write)
    peaks.append(json.loads(os.read(read, 1 << 16)))
    os.wait()
print(json.dumps(peaks))
"""


def budget_case(model, dtype, checkpointing, rows, prompt, answer, chunk=64, lora_r=8):
    return dict(model=model, dtype=dtype, checkpointing=checkpointing, rows=rows, prompt=prompt, answer=answer,
                chunk=chunk, lora_r=lora_r)


BUDGET_CASES = [  # sizes apart from each other in width, depth, length and dtype, with and without checkpointing
    budget_case(dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=64, vocab_size=4096), "bfloat16", True, 2, 256, 256),
    budget_case(dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=3, num_attention_heads=6,
                     num_key_value_heads=6, head_dim=64, vocab_size=8192), "bfloat16", False, 1, 512, 512, 128),
    budget_case(dict(hidden_size=128, intermediate_size=512, num_hidden_layers=6, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=64, vocab_size=2048), "float32", True, 4, 128, 384, 256, 16),
]
BUDGET_MARGIN = 0.4  # the formula's trainer side (less the weights) within 40% of the measured peak, either way


def test_the_budget_formula_is_within_its_margin_of_measured_peaks(tmp_path):
    import budget
    import gpu_check
    from transformers import Qwen3Config

    script = tmp_path / "measure.py"
    script.write_text(MEASURE.format(root=str(ROOT), gpu_check=str(ROOT / "tests" / "gpu_check")))
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(256 << 10), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(script), json.dumps(BUDGET_CASES)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = []
    for case, measured in zip(BUDGET_CASES, json.loads(proc.stdout.strip().splitlines()[-1])):
        fields = {k: v for k, v in dict(gpu_check.TINY_QWEN3, **case["model"]).items() if k != "rope_theta"}
        config = Qwen3Config(**fields)
        args = budget.opsd.parse_args(["--dtype", case["dtype"], "--micro-batch-size", str(case["rows"]),
                                       "--prompts-per-step", str(case["rows"]), "--max-prompt-length",
                                       str(case["prompt"]), "--max-new-tokens", str(case["answer"]),
                                       "--loss-chunk-size", str(case["chunk"]), "--lora-r", str(case["lora_r"]),
                                       "--lora-alpha", str(2 * case["lora_r"]),
                                       "--gradient-checkpointing" if case["checkpointing"] else
                                       "--no-gradient-checkpointing"])
        total, lora = budget.count_parameters(config, args)
        parts = budget.trainer_bytes(config, args, total, lora)
        predicted = parts["activations"] + parts["loss_chunk"] + lora * 4 * 4  # the LoRA itself was already held
        rows.append((case["dtype"], case["checkpointing"], measured / 2**20, predicted / 2**20))
    print("budget: (dtype, checkpointing, measured MiB, predicted MiB):", rows)  # shown by pytest -s
    for dtype, checkpointing, measured, predicted in rows:
        assert abs(predicted / measured - 1) <= BUDGET_MARGIN, rows


def test_the_budget_says_in_one_sentence_when_a_run_does_not_fit(capsys):
    import budget

    configs = ROOT / "tests" / "gpu_check" / "configs"
    recommended = ["--clip", "token", "--skip-first-tokens", "1"]
    assert budget.main(["--gpu-gib", "80", "--config", str(configs / "Qwen3-1.7B.json"), "--", *recommended]) == 0
    out = capsys.readouterr().out
    assert "1.72B parameters, LoRA 69.7M (r 64)" in out and "vllm            24.00 GiB" in out  # 0.3 of 80 GiB
    assert budget.main(["--gpu-gib", "24", "--config", str(configs / "Qwen3-8B.json"), "--", *recommended]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("budget.py: does not fit: ") and "--micro-batch-size" in err[0]


# -- the time budget (tests/gpu_check/budget.py): each piece against FLOPs and bytes counted by hand, and the training
# FLOPs against torch's own count of what opsd.backward_step runs --------------------------------------------------

def tiny_qwen3_config():
    """gpu_check's tiny Qwen3: hidden 64, MLP 128, 2 layers, 2 query heads and 1 key/value head of 32, vocabulary
    512, tied embeddings."""
    import gpu_check
    from transformers import Qwen3Config

    return Qwen3Config(**{k: v for k, v in gpu_check.TINY_QWEN3.items() if k != "rope_theta"})


# The tiny Qwen3 by hand. A layer's seven projections: q and o 64 x 64, k and v 64 x 32, gate, up and down 64 x 128.
TINY_PROJECTIONS = 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128)  # 73,728 weights in 2 layers
# Its LoRA at r 8: r x (in + out) a projection
TINY_LORA = 2 * 8 * (2 * (64 + 64) + 2 * (64 + 32) + 3 * (64 + 128))  # 16,384
# Every parameter: the embedding (512 x 64, also the lm_head), per layer the projections, two norms of 64 and q's
# and k's norms of 32, and the final norm
TINY_PARAMETERS = 512 * 64 + TINY_PROJECTIONS + 2 * (64 + 64 + 32 + 32) + 64  # 106,944


def test_the_budget_counts_a_tiny_qwen3_as_by_hand():
    import budget

    config = tiny_qwen3_config()
    args = budget.opsd.parse_args(["--lora-r", "8", "--lora-alpha", "16"])
    assert budget.count_parameters(config, args) == (TINY_PARAMETERS, TINY_LORA)
    assert budget.projections(config) == TINY_PROJECTIONS
    assert budget.kv_bytes(config, 2) == 2 * 2 * 32 * 2  # keys and values, 2 layers, one head of 32, bf16


def test_the_training_flops_are_counted_by_hand():
    import budget

    # 2 rows: student prompts 10, teacher prompts 20, answers 6 tokens (16 and 26 in all); r 8; bf16; 4 GPUs
    parts = budget.train_work(tiny_qwen3_config(), TINY_LORA, 2, 2, (10, 20, 6), lora_r=8, teacher_lora=False,
                              checkpointing=True, gpus=4)
    token = 2 * TINY_PROJECTIONS  # 2 FLOPs a weight, every token

    def attention(T):  # scores and values of T x T, both 2 x 64 FLOPs a pair (2 query heads of 32), 2 layers
        return 2 * (2 * 64 * T * T) * 2

    lm_head = 12 * (2 * 512 * 64)  # the 12 answer positions' logits
    lora = 2 * TINY_LORA  # float32 FLOPs a token
    assert parts["teacher forward"]["flops"] == 2 * (26 * token + attention(26)) + lm_head
    assert parts["teacher forward"]["float32_flops"] == 0  # the base teacher: LoRA off
    assert parts["student forward"]["flops"] == 2 * (16 * token + attention(16)) + lm_head
    assert parts["student forward"]["float32_flops"] == 2 * 16 * lora
    # the recompute: the student's forward again, less each layer's last LoRA product (down's B u: 2 x 8 x 64)
    assert parts["recompute"]["flops"] == 2 * (16 * token + attention(16))
    assert parts["recompute"]["float32_flops"] == 2 * 16 * (lora - 2 * (2 * 8 * 64))
    # the backward: input gradients (a forward's worth), attention's five products to its forward's two, the
    # lm_head's input gradient; the LoRA's gradients of A, B and its input, twice its forward
    assert parts["backward"]["flops"] == 2 * (16 * token + 2.5 * attention(16)) + lm_head
    assert parts["backward"]["float32_flops"] == 2 * 16 * 2 * lora
    # bytes: the loss's 8 float32 copies and the two bf16 logits of each of the 12 positions, written and read;
    # AdamW, the all-reduce's copies and the clip, 14 float32 passes; a ring all-reduce sends 2 x 3/4 of the gradient
    assert parts["loss"]["moved"] == 12 * 512 * 2 * (8 * 4 + 2 * 2)
    assert parts["update"]["moved"] == 14 * 4 * TINY_LORA
    assert parts["update"]["link"] == 2 * 3 / 4 * 4 * TINY_LORA
    assert parts["loss"]["flops"] == parts["update"]["flops"] == 0
    # without checkpointing no recompute, and the first layer's q, k and v take no input gradient (base and LoRA)
    off = budget.train_work(tiny_qwen3_config(), TINY_LORA, 2, 2, (10, 20, 6), lora_r=8, teacher_lora=True,
                            checkpointing=False, gpus=1)
    assert off["recompute"]["flops"] == off["recompute"]["float32_flops"] == 0
    assert off["backward"]["flops"] == 2 * (16 * (token - 2 * 64 * (64 + 32 + 32)) + 2.5 * attention(16)) + lm_head
    assert off["backward"]["float32_flops"] == 2 * 16 * (2 * lora - 3 * 2 * 8 * 64)
    assert off["teacher forward"]["float32_flops"] == 2 * 26 * lora  # --teacher current: the LoRA runs
    assert off["update"]["link"] == 0


def test_sampling_pushing_and_eval_are_counted_by_hand():
    import budget

    config = tiny_qwen3_config()
    kv = 2 * 2 * 32 * 2  # bytes of a token's keys and values
    # 2 answers of 6 tokens to prompts of 10, in 8 decode steps: each step reads every weight (tied: the embedding
    # is the lm_head); answer token t reads 10 + t cached tokens; the prefill is 2 FLOPs a weight a prompt token
    sample = budget.sample_work(config, TINY_PARAMETERS, 2, 2, 10, 6, 8)
    assert sample["moved"] == 8 * TINY_PARAMETERS * 2 + 2 * (10 + 11 + 12 + 13 + 14 + 15) * kv
    assert sample["flops"] == 2 * TINY_PARAMETERS * 2 * 10 and sample["decode_steps"] == 8

    # the push, a merged weight in bf16: two merges of 2 + 4 | 4 | 4 + 4 | 8 + 4 | 4 + 2 bytes; the load 2 + 2;
    # the read-back GEMM reads W and writes W^T, 2 + 2; two fingerprints of 2 + 2 | 2 + 8 | 8 | 8 x 3 | 8 + 8 |
    # 16 + 8 bytes; the engine's transposed copy 2 + 2
    per_weight = 2 * 36 + 4 + 4 + 2 * 86 + 4
    # vLLM's stacked layers (in, out): qkv (64, 128), o (64, 64), gate_up (64, 256), down (128, 64); an identity of
    # in x in for each, written and read in bf16; the GEMM 2 x in x in x out
    eye = 2 * (64 * 64 + 64 * 64 + 64 * 64 + 128 * 128) * 2 * 2
    gemm = 2 * 2 * (64 * 64 * 128 + 64 * 64 * 64 + 64 * 64 * 256 + 128 * 128 * 64)
    push = budget.push_work(config, 2, 8)
    assert push["moved"] == TINY_PROJECTIONS * per_weight + eye
    assert push["flops"] == gemm
    assert push["float32_flops"] == 2 * (2 * 8 * TINY_PROJECTIONS)  # two merges' B A, 2 r FLOPs a weight

    # eval: 5 problems x 3 samples on 2 GPUs, one engine each: 8 answers an engine (15 split evenly, rounded up),
    # all at once; 6 tokens each after prompts of 10, in 6 decode steps
    done, at_once, holds = budget.eval_work(config, TINY_PARAMETERS, 2, problems=5, samples=15, prompt=10, answer=6,
                                            gpus=2, tensor_parallel=1, memory=4 * 2**30)
    assert holds == (4 * 2**30 - TINY_PARAMETERS * 2 - 2 * 2**30) // kv
    assert at_once == 8 and done["decode_steps"] == 6
    assert done["moved"] == 6 * TINY_PARAMETERS * 2 + 8 * (10 + 11 + 12 + 13 + 14 + 15) * kv
    assert done["flops"] == 2 * TINY_PARAMETERS * 3 * 10  # one prompt a problem (prefix caching): 3 of 5 problems
    # one engine over both GPUs: each holds half the weights and half of every token's keys and values
    done, at_once, holds = budget.eval_work(config, TINY_PARAMETERS, 2, problems=5, samples=15, prompt=10, answer=6,
                                            gpus=2, tensor_parallel=2, memory=4 * 2**30)
    assert at_once == 15 and done["decode_steps"] == 6
    assert done["moved"] == 6 * TINY_PARAMETERS + 15 * (10 + 11 + 12 + 13 + 14 + 15) * kv / 2


def test_time_is_work_at_the_datasheet_peaks_and_at_the_stated_shares():
    import budget

    h100 = budget.GPUS["h100"]  # NVIDIA's H100 SXM datasheet, dense: 989 TFLOP/s bf16, 67 float32, 3.35 TB/s
    assert (h100["bf16"], h100["float32"], h100["bandwidth"]) == (989e12, 67e12, 3.35e12)
    assert (budget.GPUS["h200"]["bf16"], budget.GPUS["h200"]["bandwidth"]) == (989e12, 4.8e12)
    done = budget.work(flops=989e12, float32_flops=67e12, moved=3.35e12, link=450e9, decode_steps=1000)
    assert budget.seconds(done, h100, 2) == pytest.approx(4.0)  # a second each, one after another
    assert budget.seconds(done, h100, 2, 0.5, 0.25, 0.002) == pytest.approx(2 + 2 + 4 + 4 + 2)
    assert budget.seconds(budget.work(flops=67e12), h100, 4) == pytest.approx(1.0)  # a float32 model's GEMMs
    names = ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H200", "NVIDIA H100 NVL", "NVIDIA A100-SXM4-80GB")
    assert [budget.gpu_key(n) for n in names] == ["h100", "h100-pcie", "h200", None, None]


# torch's FlopCounterMode counts every matmul a run dispatches; its SDPA formulas (the whole T x T square, and five
# products in the backward) are registered for CUDA's kernels, and here also for the CPU's
FLOPS = """
import json, sys, torch
sys.path[:0] = [{root!r}, {gpu_check!r}]
import opsd, gpu_check
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count, sdpa_backward_flop_count
aten = torch.ops.aten
def forward(q, k, v, *a, out_shape=None, **kw):
    return sdpa_flop_count(q, k, v)
def backward(grad, q, k, v, *a, out_shape=None, **kw):
    return sdpa_backward_flop_count(grad, q, k, v)
cpu = {{aten._scaled_dot_product_flash_attention_for_cpu: forward,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: backward}}
counted = []
for case in json.loads(sys.argv[1]):
    model = gpu_check.build_model(gpu_check.SIZES["smoke"], torch.device("cpu"))
    params = opsd.add_lora(model, 8, 16.0, seed=0)
    if case["checkpointing"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={{"use_reentrant": False}})
    model.train()
    g = torch.Generator().manual_seed(0)
    ids = lambda n: [torch.randint(1, 512, (n,), generator=g).tolist() for _ in range(case["rows"])]
    student, teacher, answers = ids(case["prompt"]), ids(case["teacher_prompt"]), ids(case["answer"])
    with FlopCounterMode(display=False, custom_mapping=cpu) as counter:
        opsd.backward_step(model, params, student, teacher, answers, pad_id=0, micro_batch_size=case["micro_batch"],
                           teacher=case["teacher"], temperature=1.1, clip="token", tau=0.05, chunk_size=4)
    counted.append(counter.get_total_flops())
print(json.dumps(counted))
"""


def test_the_training_flops_are_what_torch_counts_in_backward_step(tmp_path):
    import budget

    cases = [dict(rows=2, micro_batch=2, prompt=10, teacher_prompt=20, answer=6, checkpointing=True, teacher="base"),
             dict(rows=3, micro_batch=1, prompt=7, teacher_prompt=15, answer=9, checkpointing=False,
                  teacher="current")]
    script = tmp_path / "flops.py"
    script.write_text(FLOPS.format(root=str(ROOT), gpu_check=str(ROOT / "tests" / "gpu_check")))
    proc = subprocess.run([sys.executable, str(script), json.dumps(cases)], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    counted = json.loads(proc.stdout.strip().splitlines()[-1])
    for case, flops in zip(cases, counted):  # rows of one length each: no pads, so the padded mean is exact
        parts = budget.train_work(tiny_qwen3_config(), TINY_LORA, 2, case["rows"],
                                  (case["prompt"], case["teacher_prompt"], case["answer"]), lora_r=8,
                                  teacher_lora=case["teacher"] != "base", checkpointing=case["checkpointing"], gpus=1)
        done = budget.total(parts.values())
        assert done["flops"] + done["float32_flops"] == flops, (case, flops)


def budget_lines(capsys, argv):
    import budget

    assert budget.main(argv) == 0
    return capsys.readouterr().out.splitlines()


def seconds_of(line):
    """The lower bound and the expected seconds at a table line's end: '... 1.27 s 3.37 s'."""
    words = line.split()
    return float(words[-4]), float(words[-2])


def test_the_budget_prints_the_hours_of_the_recommended_command(capsys):
    configs = ROOT / "tests" / "gpu_check" / "configs"
    recommended = ["--clip", "token", "--skip-first-tokens", "1"]
    lines = budget_lines(capsys, ["--config", str(configs / "Qwen3-1.7B.json"), "--", *recommended])
    text = "\n".join(lines)
    assert "Time on 4 x H100 SXM 80 GB: estimates, not measurements" in text
    assert "989 TFLOP/s bf16, 67 TFLOP/s float32, 3.35 TB/s memory" in text
    # each assumption beside its figure and the flag that changes it
    for said in ("answers of 1,024 tokens on average (--answer-tokens",
                 "student prompts of 256 tokens (--prompt-tokens)",
                 "the teacher's 2,048", "(--teacher-prompt-tokens; default --max-prompt-length)",
                 "35% of peak FLOP/s (--flops-utilisation)", "70% of peak bandwidth (--bandwidth-utilisation)",
                 "1.5 ms a decode step", "(--decode-step-ms)", "3 min to start (--startup-minutes)"):
        assert said in text, said
    row = {line.split()[0]: line for line in lines if line.endswith(" s")}
    # sampling's lower bound by hand: 8 answers a rank of 1,024 tokens after prompts of 256, in 1,024 decode steps,
    # each reading the 1.72B weights in bf16 (tied: the embedding is the lm_head); a token's keys and values are
    # 2 x 28 layers x 8 heads x 128 x 2 bytes; the prefill 2 FLOPs a weight a prompt token
    weights = 1024 * 1_720_574_976 * 2
    cache = 8 * (1024 * 256 + 1024 * 1023 // 2) * (2 * 28 * 8 * 128 * 2)
    prefill = 2 * 1_720_574_976 * 8 * 256
    assert seconds_of(row["sample"])[0] == pytest.approx((weights + cache) / 3.35e12 + prefill / 989e12, abs=0.005)
    lower, expected = seconds_of(row["step"])
    parts = ("sample", "teacher", "student", "recompute", "backward", "loss", "update", "push")
    assert sum(seconds_of(row[p])[1] for p in parts) == pytest.approx(expected, abs=0.05)
    assert 0 < lower < expected
    (ratio,) = [line for line in lines if "the released recipe's ~9 s" in line]
    assert float(ratio.split()[-1]) == pytest.approx(expected / 9, abs=0.006)
    (run,) = [line for line in lines if "run of 100 steps" in line]
    hours = float(run.split("expected ")[1].split(" h")[0])
    assert hours == pytest.approx((100 * expected + 3 * 60) / 3600, abs=0.006)  # 100 steps and 3 minutes to start
    gpu_hours = float(run.split(", ")[-1].split()[0])
    assert gpu_hours == pytest.approx(4 * hours, abs=0.02)

    # an H200 has the same peak FLOP/s and 4.8 / 3.35 of the bandwidth: its sampling, bound by bandwidth, is faster
    lines = budget_lines(capsys, ["--gpu", "h200", "--config", str(configs / "Qwen3-1.7B.json"), "--", *recommended])
    h200 = {line.split()[0]: line for line in lines if line.endswith(" s")}
    assert seconds_of(h200["sample"])[0] == pytest.approx(
        (weights + cache) / 4.8e12 + prefill / 989e12, abs=0.005)
    assert seconds_of(h200["teacher"]) == seconds_of(row["teacher"])
    assert "141 GiB per GPU" in "\n".join(lines)  # the H200's memory for the memory budget


def test_the_budget_prints_the_hours_of_an_evaluation(capsys, tmp_path):
    import re

    configs = ROOT / "tests" / "gpu_check" / "configs"
    lines = budget_lines(capsys, ["--eval", "--config", str(configs / "Qwen3-1.7B.json")])
    text = "\n".join(lines)
    assert "90 problems (aime24 30, aime25 30, hmmt25 30) x 12 samples = 1,080 answers" in text
    assert "answers of 16,000 tokens on average (--answer-tokens" in text and "mean_tokens" in text
    assert "every answer at --max-new-tokens 38,912" in text
    (one,) = [line for line in lines if "one checkpoint:" in line]
    (longest,) = [line for line in lines if "every answer at" in line]
    assert float(longest.split("lower bound ")[1].split()[0]) > float(one.split("lower bound ")[1].split()[0])
    # a local benchmark is counted by its rows
    data = ROOT / "tests" / "data" / "eval_tiny.jsonl"
    rows = sum(1 for line in data.read_text().splitlines() if line.strip())
    lines = budget_lines(capsys, ["--eval", "--config", str(configs / "Qwen3-1.7B.json"), "--answer-tokens", "500",
                                  "--", "--data", f"tiny={data}", "--n", "3", "--tensor-parallel-size", "2"])
    text = "\n".join(lines)
    assert f"{rows} problems (tiny {rows}) x 3 samples = {3 * rows:,} answers" in text
    assert "one engine over 2 GPU(s) (--tensor-parallel-size 2), as eval.py runs; 2 of --gpus 4 idle" in text
    # eval.py runs one engine: on 4 GPUs without --tensor-parallel-size the hours are one GPU's, and
    # the GPU-hours billed four times those
    def hours(gpus):
        lines = budget_lines(capsys, ["--eval", "--gpus", gpus, "--config", str(configs / "Qwen3-1.7B.json")])
        line = next(line for line in lines if "one checkpoint:" in line)
        return [float(x) for x in re.search(r"expected ([\d.]+) h .*, ([\d.]+) GPU-hours billed", line).groups()]

    (h1, billed1), (h4, billed4) = hours("1"), hours("4")
    assert h1 == h4 and billed1 == h1 and billed4 == pytest.approx(4 * h1, abs=0.025)  # each rounded to 0.01
    # eval.py --limit 2: two problems of each benchmark, as that run scores
    lines = budget_lines(capsys, ["--eval", "--config", str(configs / "Qwen3-1.7B.json"), "--", "--limit", "2"])
    assert "6 problems (aime24 2, aime25 2, hmmt25 2) x 12 samples = 72 answers" in "\n".join(lines)


@pytest.mark.parametrize("argv, said", [
    (["--gpu", "a100"], "argument --gpu: invalid choice: 'a100'"),
    (["--gpus", "3"], "--prompts-per-step 32 must be divisible by --gpus x --micro-batch-size = 3 x 4."),
    (["--answer-tokens", "2000"], "--answer-tokens 2000 cannot exceed --max-new-tokens 1024."),
    (["--flops-utilisation", "0"], "argument --flops-utilisation: must be in (0, 1], got 0"),
    (["--eval", "--gpus", "1", "--", "--tensor-parallel-size", "2"],
     "eval.py --tensor-parallel-size 2 needs 2 GPUs, but --gpus is 1."),
    (["--eval", "--config", str(ROOT / "tests" / "gpu_check" / "configs" / "Qwen3-1.7B.json"), "--",
      "--tensor-parallel-size", "3"],
     "eval.py cannot split 16 attention heads over --tensor-parallel-size 3: vLLM needs a divisor of 16."),
    (["--eval", "--answer-tokens", "40000"], "--answer-tokens 40000 cannot exceed eval.py's --max-new-tokens 38912."),
])
def test_the_budget_refuses_bad_input_in_one_sentence(capsys, argv, said):
    import budget

    with pytest.raises(SystemExit) as stop:
        budget.main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"budget.py: error: {said}"), err


def test_the_gpu_check_step_records_budget_time_beside_its_own(smoke):
    _, out = smoke
    r = json.loads(out.read_text())
    step, t = r["step"], r["step"]["budget_time"]
    # the smoke step by hand: the tiny Qwen3, 2 rows of 32 + 96 tokens for both student and teacher (128 each), 192
    # answer positions, LoRA r 8, gradient checkpointing on, the base teacher
    token, lora = 2 * TINY_PROJECTIONS, 2 * TINY_LORA
    attention = 2 * (2 * 64 * 128 * 128) * 2  # one row's, 2 layers
    forward = 2 * (128 * token + attention)
    lm_head = 192 * 2 * 512 * 64
    assert t["flops"] == (forward + lm_head) * 2 + forward + 2 * (128 * token + 2.5 * attention) + lm_head
    assert t["float32_flops"] == 2 * 128 * (lora + (lora - 2 * 2 * 8 * 64) + 2 * lora)
    assert t["measured_s"] == step["seconds"] and t["lower_bound_s"] < t["expected_s"]
    if r["device"] == "cpu":  # not a GPU of the table: timed on its H100, compared with nothing
        assert t["gpu"] is None and t["timed_on"] == "H100 SXM 80 GB"
        assert t["measured_over_expected"] is None and t["matching_flops_utilisation"] is None
    else:
        assert t["measured_over_expected"] == pytest.approx(t["measured_s"] / t["expected_s"])
