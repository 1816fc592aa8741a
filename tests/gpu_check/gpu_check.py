"""Check opsd.py's training path on one GPU, with torch and transformers only (no vLLM, no network).

    python tests/gpu_check/gpu_check.py --output gpu_check.json     # on a GPU node: the first CUDA device
    python tests/gpu_check/gpu_check.py --smoke --output smoke.json  # the same code at tiny sizes, on any device

Not collected by pytest (tests/test_gpu_check.py runs --smoke). opsd.py is imported, never vLLM (opsd.py
imports it only inside the functions that sample). Each part below runs in its own try block: a part that
fails (out of memory, say) is recorded as a string "error: ...", and the others still run. The JSON file
is rewritten after every part, so a run cut short still leaves what it measured. Progress lines, with
timings, go to stderr. Exit code 0 when every part ran and passed, 1 otherwise, 2 for a usage error.

- "loss": opsd.opsd_loss (chunked, with its diagnostics, as in training) at Qwen3-1.7B's vocabulary and
  hidden size in bf16, over micro-batch 4 x 4,096 answer positions of random hidden states and lm_head,
  forward and backward; the same loss from full logits at once (the released recipe's way: "naive");
  and both the chunked value and gradient against a float64 computation on a slice of positions that
  spans several chunks. peak_mib / naive_peak_mib: the peak CUDA memory allocated during the forward and
  backward, above what the inputs already held.
- "step": one optimizer step through the real training path (opsd.add_lora, the teacher's and the
  student's forwards, the chunked loss, gradient checkpointing: opsd.backward_step in a world of one,
  the gradient clip and AdamW) on a randomly initialised Qwen3-1.7B, micro-batch 4, prompt 1,024 +
  answer 4,096 tokens. peak_mib: the peak CUDA memory allocated during the step, model included. budget_time:
  budget.py's lower bound and expected time for the same step on this GPU, beside the measured seconds.
- "resume_roundtrip": a checkpoint written by opsd.save_run_state and read by opsd.restore gives back
  bitwise the LoRA weights, the optimizer state and the step; restoring leaves the torch CPU and CUDA
  RNG states as they were (opsd saves none: data order and sampling seeds are functions of (seed,
  step)); and the next step's loss equals the uninterrupted run's to 1e-6 relative.
- "logits_probe": "ok", or opsd.check_logits_path's refusal, on the random Qwen3-1.7B in bf16.
- "lora_init_matches_cpu": opsd.add_lora on the device model draws A matrices bitwise equal to the same
  call on a CPU copy.
- "padded_batch": a micro-batch of 4 rows of different prompt, context and answer lengths (student and teacher
  batches both padded, differently), scored as opsd.backward_step scores one (opsd.build_batch, the base
  teacher, opsd.final_hidden, opsd.opsd_loss) on the random Qwen3-1.7B in bf16 with a LoRA moved off zero,
  under SDPA's own kernel choice and under each backend forced (flash, efficient, cudnn, math): finite loss
  and LoRA gradient, each row's loss and the gradient within bf16 tolerance of the rows scored one per batch
  (no pads). A forced backend that refuses the inputs is recorded as refused; default and math must pass.
- "identity_readback": the weight push's read-back premise, F.linear(I, W) = W^T bitwise, at every weight
  shape of Qwen3-1.7B's projections (and vLLM's stacked qkv and gate_up), in bf16 and in float32 with
  full-precision matmuls (opsd.py's settings for a float32 run); float32 with TF32 allowed is reported only.

tests/gpu_check/README.md describes each part's fields and tolerances, and keeps the results table.

On a CPU (--smoke without a GPU) peak memory cannot be read from an allocator: every *_mib field is null
there, and only the CUDA run checks that the chunked loss's peak is below the naive one.
"""

import argparse
import contextlib
import copy
import gc
import json
import math
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import opsd  # noqa: E402

# The loss settings of the released recipe (opsd.py's defaults)
LOSS_KW = dict(beta=0.0, temperature=1.1, clip="entry", tau=0.05)
MIB = 2 ** 20

# Qwen3-1.7B's published config (vocab, sizes, heads, tied embeddings, context, RoPE base, norm epsilon): 1.72B
# parameters, 1.41B without the embedding (its model card: 1.7B and 1.4B)
QWEN3_1_7B = dict(vocab_size=151_936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                  max_position_embeddings=40_960, rope_theta=1e6, rms_norm_eps=1e-6)
TINY_QWEN3 = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=32, tie_word_embeddings=True, max_position_embeddings=4096,
                  rope_theta=1e6, rms_norm_eps=1e-6)

SIZES = {
    "full": dict(
        dtype=torch.bfloat16, model=QWEN3_1_7B, model_name="random Qwen3-1.7B",
        # loss: B x T answer positions; the float64 slice (600) spans chunks 256 + 256 + 88
        loss_vocab=151_936, loss_hidden=2048, loss_batch=4, loss_positions=4096, chunk_size=256, f64_positions=600,
        # one training step
        micro_batch=4, prompt_tokens=1024, completion_tokens=4096, lora_r=64, lora_alpha=128.0,
        # resume: short sequences, a large lr so that the LoRA update shows in a bf16 forward
        resume_batch=2, resume_prompt=64, resume_completion=192, resume_steps=2, resume_lr=1e-3,
        # padded_batch: one micro-batch of 4 rows, each of its own prompt, context and answer lengths
        padded_prompts=[384, 96, 256, 32], padded_contexts=[200, 420, 64, 300], padded_completions=[512, 900, 160, 700],
    ),
    "smoke": dict(
        dtype=torch.bfloat16, model=TINY_QWEN3, model_name="random tiny Qwen3 (2 layers)",
        loss_vocab=4096, loss_hidden=64, loss_batch=2, loss_positions=320, chunk_size=128, f64_positions=300,
        micro_batch=2, prompt_tokens=32, completion_tokens=96, lora_r=8, lora_alpha=16.0,
        resume_batch=2, resume_prompt=16, resume_completion=48, resume_steps=2, resume_lr=1e-3,
        padded_prompts=[24, 8, 16], padded_contexts=[10, 30, 4], padded_completions=[40, 64, 12],
    ),
}

# Largest relative error of the chunked loss against float64 on the same logits rounded to the model dtype
# (loss value; gradient, norm-wise): what remains is float32 softmax and KL, and the gradient flowing back
# through model-dtype logits and matmul (bf16 keeps 8 significant bits: 2^-8 = 4e-3 per rounding). Measured
# on CPU in bf16, at the smoke sizes and at the full vocabulary and hidden size: loss 2e-8 and 3e-6, gradient
# 3.2e-3 and 3.3e-3. The margins leave room for GPU kernels' other summation orders.
F64_TOLERANCE = {"loss": 1e-3, "grad": 2e-2}  # for bf16, the dtype of both sizes
RESUME_LOSS_RTOL = 1e-6
# padded_batch: the largest relative difference of a padded row's loss (mean divergence) from the same row alone,
# and of the micro-batch's LoRA gradient from the rows' alone (norm-wise), both in bf16, where kernels sum in other
# orders for other shapes and masks. Measured on CPU (SDPA's flash and math kernels), on the random Qwen3-1.7B at a
# quarter and an eighth of the full lengths: row loss 9e-5 to 7.8e-4, gradient 3.0e-2 to 3.8e-2 (the same at both
# lengths); at the smoke sizes 2e-4 to 1.4e-3 and 3.4e-3 to 7.2e-3. Pads that reach real tokens move a row's loss
# by far more (tests/test_gpu_check.py).
PADDED_TOLERANCE = {"row_loss": 1e-2, "grad": 0.15}

START = time.perf_counter()


def log(message):
    print(f"[gpu_check {time.perf_counter() - START:7.1f} s] {message}", file=sys.stderr, flush=True)


# -----------------------------------------------------------------------------
# Measuring on a device: CUDA's allocator gives peak memory; a CPU gives none (null)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure(fn, device):
    """(result, seconds, peak MiB allocated above what was allocated before; None off CUDA)."""
    free(device)
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter()
    result = fn()
    sync(device)
    seconds = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated(device) - base) / MIB if device.type == "cuda" else None
    return result, seconds, peak


def allocated_mib(device):
    return torch.cuda.memory_allocated(device) / MIB if device.type == "cuda" else None


def error_string(e):
    first = (str(e).strip().splitlines() or [""])[0][:300]
    return f"error: {type(e).__name__}: {first}"


# -----------------------------------------------------------------------------
# "loss": the chunked loss, the naive one, and a float64 computation on a slice


def full_logits_loss(hs, ht, W, *, compute_dtype, round_logits_to=None, beta, temperature, clip, tau):
    """The loss from all positions' full logits at once, written independently of opsd.py (forward KL only).
    hs, ht (N, H); W (V, H). compute_dtype float64: everything in float64 (a reference); round_logits_to
    then rounds the logits to that dtype as opsd.py's model-dtype matmul does (the gradient passes the
    rounding unchanged). Otherwise the released recipe's way: logits in the model dtype, log-softmax and KL
    in float32."""
    assert beta == 0.0, "written for the forward KL only"
    soft_dtype = torch.float64 if compute_dtype == torch.float64 else torch.float32

    def logits(h):
        x = h.to(compute_dtype) @ W.to(compute_dtype).T  # (N, V)
        if round_logits_to is not None:
            x = x + (x.to(round_logits_to).to(compute_dtype) - x).detach()
        return x

    student = logits(hs)
    with torch.no_grad():
        teacher = logits(ht)
    log_s = F.log_softmax(student.to(soft_dtype) / temperature, dim=-1)
    log_t = F.log_softmax(teacher.to(soft_dtype) / temperature, dim=-1)
    d = log_t.exp() * (log_t - log_s)  # (N, V) p_T(v) (log p_T(v) - log p_S(v))
    if clip == "entry":
        d = d.clamp(max=tau)
    k = d.sum(-1)  # (N,)
    if clip == "token":
        k = k * (tau / k.clamp(min=tau)).detach()
    return k.sum() / hs.shape[0]


def loss_inputs(s, device):
    """Random student / teacher hidden states (B, T, H) and lm_head (V, H) in the model dtype; the teacher's
    hidden states are the student's plus noise, so the two distributions differ as in training."""
    g = torch.Generator(device=device).manual_seed(0)
    B, T, H, V = s["loss_batch"], s["loss_positions"], s["loss_hidden"], s["loss_vocab"]
    hs = torch.randn(B, T, H, generator=g, device=device)
    ht = hs + 0.5 * torch.randn(B, T, H, generator=g, device=device)
    W = torch.randn(V, H, generator=g, device=device) * (2 / math.sqrt(H))  # logits of std about 2
    mask = torch.ones(B, T, dtype=torch.bool, device=device)
    targets = torch.randint(V, (B * T,), generator=g, device=device)
    return hs.to(s["dtype"]), ht.to(s["dtype"]), W.to(s["dtype"]), mask, targets


def compare_with_float64(hs, ht, W, s):
    """The chunked loss and its gradient on the first f64_positions positions against float64 computations
    from the same inputs (upcast): `f64` rounds the logits to the model dtype as opsd.py does, then works in
    float64 (the check: softmax, KL, chunking and the gradient's assembly); `exact_f64` keeps float64 logits
    (reported only: what rounding the logits to the model dtype costs)."""
    n = s["f64_positions"]
    h = hs.reshape(-1, hs.shape[-1])[:n].detach().clone()[None].requires_grad_()  # (1, n, H)
    t = ht.reshape(-1, ht.shape[-1])[:n][None]
    mask = torch.ones(1, n, dtype=torch.bool, device=hs.device)
    loss, _ = opsd.opsd_loss(h, mask, t, mask, W, n, chunk_size=s["chunk_size"], **LOSS_KW)
    loss.backward()
    got_loss, got_grad = loss.item(), h.grad[0].double()
    errors = {}
    for name, rounding in (("f64", s["dtype"]), ("exact_f64", None)):
        h64 = h.detach()[0].double().requires_grad_()
        ref = full_logits_loss(h64, t[0], W, compute_dtype=torch.float64, round_logits_to=rounding, **LOSS_KW)
        ref.backward()
        diff, loss_err = got_grad - h64.grad, abs(got_loss - ref.item())
        errors[name] = {"loss": ref.item(), "abs": {"loss": loss_err, "grad": diff.abs().max().item()},
                        "rel": {"loss": loss_err / abs(ref.item()), "grad": (diff.norm() / h64.grad.norm()).item()}}
        del h64, ref, diff
    tol, rel = F64_TOLERANCE, errors["f64"]["rel"]
    return {"f64_positions": n, "f64_loss": errors["f64"]["loss"], "max_abs_err_vs_float64": errors["f64"]["abs"],
            "rel_err_vs_float64": rel, "f64_tolerance": tol,
            "matches_float64": rel["loss"] <= tol["loss"] and rel["grad"] <= tol["grad"],
            "rel_err_vs_exact_float64": errors["exact_f64"]["rel"]}


def check_loss(s, device):
    hs, ht, W, mask, targets = loss_inputs(s, device)
    n = int(mask.sum())

    def chunked():
        h = hs.detach().requires_grad_()
        loss, stats = opsd.opsd_loss(h, mask, ht, mask, W, n, targets, chunk_size=s["chunk_size"], **LOSS_KW)
        loss.backward()
        return loss.item()

    def naive():
        h = hs.detach().requires_grad_()
        loss = full_logits_loss(h[mask], ht[mask], W, compute_dtype=s["dtype"], **LOSS_KW)
        loss.backward()
        return loss.item()

    out = {"vocab": s["loss_vocab"], "hidden": s["loss_hidden"], "micro_batch": s["loss_batch"],
           "answer_positions": s["loss_positions"], "chunk_size": s["chunk_size"], "dtype": str(s["dtype"])[6:]}
    chunked()  # warm-up: kernels, cuBLAS handles
    out["loss"], out["seconds"], out["peak_mib"] = measure(chunked, device)
    import budget  # its loss chunk at these sizes (logits in bf16, LOSS_CHUNK_COPIES float32 copies), to stand beside
    out["budget_mib"] = s["chunk_size"] * s["loss_vocab"] * (budget.LOSS_CHUNK_COPIES * 4 + 2 * 2) / MIB
    log(f"loss: chunked {out['seconds']:.3f} s, peak {out['peak_mib']} MiB (budget.py's loss chunk "
        f"{out['budget_mib']:.0f} MiB)")
    try:
        naive()
        out["naive_loss"], out["naive_seconds"], out["naive_peak_mib"] = measure(naive, device)
        out["naive_error"] = None
        out["naive_abs_diff"] = abs(out["naive_loss"] - out["loss"])
    except torch.cuda.OutOfMemoryError as e:  # the naive loss not fitting is itself the answer
        out.update(naive_loss=None, naive_seconds=None, naive_peak_mib=None, naive_abs_diff=None,
                   naive_error=error_string(e))
    free(device)
    log(f"loss: naive {out['naive_seconds']} s, peak {out['naive_peak_mib']} MiB {out['naive_error'] or ''}")
    # where memory is measured (CUDA), the chunked loss must take less than the naive one
    if out["peak_mib"] is None:
        out["chunked_below_naive"] = None
    else:
        out["chunked_below_naive"] = out["naive_peak_mib"] is None or out["peak_mib"] < out["naive_peak_mib"]
    out.update(compare_with_float64(hs, ht, W, s))
    log(f"loss: vs float64 on {out['f64_positions']} positions, relative error "
        f"loss {out['rel_err_vs_float64']['loss']:.2e} grad {out['rel_err_vs_float64']['grad']:.2e}")
    return {"loss": out}


# -----------------------------------------------------------------------------
# A random Qwen3 and the training path


def build_model(s, device, seed=0):
    """A randomly initialised Qwen3ForCausalLM from the config above, in the run's dtype, on `device`."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    fields = dict(s["model"])
    fields["rope_parameters"] = {"rope_type": "default", "rope_theta": fields.pop("rope_theta")}
    config = Qwen3Config(**fields, attention_dropout=0.0)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3ForCausalLM(config)
    return model.to(s["dtype"])


def random_batch(s, batch, prompt_len, completion_len, seed):
    """Student and teacher prompts and completions of random token ids (no pads: every row full length)."""
    g = torch.Generator().manual_seed(seed)
    vocab = s["model"]["vocab_size"]

    def rows(length):
        return torch.randint(1, vocab, (batch, length), generator=g).tolist()

    return rows(prompt_len), rows(prompt_len), rows(completion_len)


def train_step(model, lora_params, optimizer, batch, micro_batch, lr, chunk_size):
    """One optimizer step as opsd.main takes it: backward_step (world of one), gradient clip, AdamW."""
    student, teacher, completions = batch
    loss, _ = opsd.backward_step(model, lora_params, student, teacher, completions, pad_id=0,
                                 micro_batch_size=micro_batch, teacher="base", chunk_size=chunk_size, **LOSS_KW)
    grad_norm = torch.nn.utils.clip_grad_norm_(lora_params, 0.1).item()
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss, grad_norm


def trainable(s, device, seed=42):
    model = build_model(s, device)
    lora_params = opsd.add_lora(model, s["lora_r"], s["lora_alpha"], seed=seed)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    optimizer = torch.optim.AdamW(lora_params, lr=5e-6, betas=(0.9, 0.999), weight_decay=0.0)
    return model, lora_params, optimizer


def check_step(s, device):
    model, lora_params, optimizer = trainable(s, device)
    batch = random_batch(s, s["micro_batch"], s["prompt_tokens"], s["completion_tokens"], seed=0)
    out = {"model": s["model_name"], "micro_batch": s["micro_batch"], "prompt_tokens": s["prompt_tokens"],
           "completion_tokens": s["completion_tokens"], "lora_r": s["lora_r"], "gradient_checkpointing": True,
           "model_mib": allocated_mib(device)}

    def step():
        return train_step(model, lora_params, optimizer, batch, s["micro_batch"], 5e-6, s["chunk_size"])

    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    step()  # the first step: kernels warm up and AdamW allocates its state
    sync(device)
    out["first_seconds"] = time.perf_counter() - t0
    log(f"step: first step {out['first_seconds']:.2f} s")
    t0 = time.perf_counter()
    out["loss"], out["grad_norm"] = step()
    sync(device)
    out["seconds"] = time.perf_counter() - t0
    out["peak_mib"] = torch.cuda.max_memory_allocated(device) / MIB if device.type == "cuda" else None
    out["finite"] = math.isfinite(out["loss"]) and math.isfinite(out["grad_norm"])
    out["budget_mib"] = budget_mib(s, model, lora_params)
    out["budget_time"] = budget_time(s, model, lora_params, out["seconds"], device)
    log(f"step: second step {out['seconds']:.2f} s, peak {out['peak_mib']} MiB (model {out['model_mib']} MiB; "
        f"budget.py's estimate {out['budget_mib']:.0f} MiB), loss {out['loss']:.4f}")
    t = out["budget_time"]
    log(f"step: budget.py's time on {t['timed_on']}: lower bound {t['lower_bound_s']:.2f} s, expected "
        f"{t['expected_s']:.2f} s at {t['flops_utilisation']:.0%} of peak FLOP/s; measured / expected "
        f"{t['measured_over_expected']}, the utilisation that matches {t['matching_flops_utilisation']}")
    return {"step": out}


def step_args(s):
    """opsd.py's flags for this step's sizes: one micro-batch, a world of one."""
    return opsd.parse_args(["--dtype", str(s["dtype"])[6:], "--micro-batch-size", str(s["micro_batch"]),
                            "--prompts-per-step", str(s["micro_batch"]), "--max-prompt-length", str(s["prompt_tokens"]),
                            "--max-new-tokens", str(s["completion_tokens"]), "--lora-r", str(s["lora_r"]),
                            "--lora-alpha", str(s["lora_alpha"]), "--loss-chunk-size", str(s["chunk_size"])])


def budget_mib(s, model, lora_params):
    """budget.py's trainer-side estimate (weights, LoRA state, activations, one loss chunk) for this step's sizes,
    to stand beside the peak measured on CUDA."""
    import budget

    lora = sum(p.numel() for p in lora_params)
    parts = budget.trainer_bytes(model.config, step_args(s), sum(p.numel() for p in model.parameters()) - lora, lora)
    return sum(parts.values()) / MIB


def budget_time(s, model, lora_params, measured, device):
    """budget.py's time for this step (its training parts: the base teacher's forward, the student's, the recompute,
    the backward, the loss, AdamW; no sampling, no push) beside the measured seconds, so that the first GPU
    calibrates it. Timed on this GPU's row of budget.GPUS; a device not in that table (a CPU) is timed on the table's
    H100 and compared with nothing. matching_flops_utilisation: the --flops-utilisation at which the expected time
    equals the measured one, the bytes' share held at budget.py's default."""
    import budget

    b = 2 if s["dtype"] == torch.bfloat16 else 4
    # the teacher's prompts as long as the student's (random_batch)
    lengths = (s["prompt_tokens"], s["prompt_tokens"], s["completion_tokens"])
    parts = budget.train_work(model.config, sum(p.numel() for p in lora_params), b, s["micro_batch"], lengths,
                              lora_r=s["lora_r"], teacher_lora=False, checkpointing=True, gpus=1)
    done = budget.total(parts.values())
    key = None
    if device.type == "cuda":
        key = budget.gpu_key(torch.cuda.get_device_name(device))
    gpu = budget.GPUS[key or "h100"]
    shares = (budget.FLOPS_UTILISATION, budget.BANDWIDTH_UTILISATION)
    lower, expected = budget.seconds(done, gpu, b), budget.seconds(done, gpu, b, *shares)
    out = {"gpu": key, "timed_on": gpu["name"], "flops": done["flops"], "float32_flops": done["float32_flops"],
           "moved_bytes": done["moved"], "lower_bound_s": lower, "expected_s": expected,
           "flops_utilisation": shares[0], "bandwidth_utilisation": shares[1], "measured_s": measured,
           "measured_over_expected": None, "matching_flops_utilisation": None}
    bytes_s = budget.seconds(budget.work(moved=done["moved"]), gpu, b, *shares)
    if key is not None:
        out["measured_over_expected"] = measured / expected
        flops_at_peak = lower - budget.seconds(budget.work(moved=done["moved"]), gpu, b)
        if measured > bytes_s:
            out["matching_flops_utilisation"] = flops_at_peak / (measured - bytes_s)
    return out


# -----------------------------------------------------------------------------
# "resume_roundtrip": save_run_state, then restore into a fresh optimizer and reset LoRA weights


def rng_states(device):
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if device.type == "cuda" else []
    return cpu, cuda


def optimizer_snapshot(optimizer):
    sd = optimizer.state_dict()
    state = {k: {n: v.detach().clone() if torch.is_tensor(v) else v for n, v in st.items()}
             for k, st in sd["state"].items()}
    return {"state": state, "param_groups": copy.deepcopy(sd["param_groups"])}


def same_tensor(a, b):
    return a.dtype == b.dtype and a.device == b.device and a.shape == b.shape and torch.equal(a, b)


def same_optimizer_state(a, b):
    if a["param_groups"] != b["param_groups"] or a["state"].keys() != b["state"].keys():
        return False
    for k in a["state"]:
        x, y = a["state"][k], b["state"][k]
        if x.keys() != y.keys():
            return False
        for n in x:
            if torch.is_tensor(x[n]) != torch.is_tensor(y[n]):
                return False
            if (not same_tensor(x[n], y[n])) if torch.is_tensor(x[n]) else x[n] != y[n]:
                return False
    return True


def check_resume(s, device):
    model, lora_params, optimizer = trainable(s, device)
    initial = [p.detach().clone() for p in lora_params]
    K, lr, mb = s["resume_steps"], s["resume_lr"], s["resume_batch"]

    def batch(step):  # each step's data is a function of the step, as opsd's data order is of (seed, step)
        return random_batch(s, mb, s["resume_prompt"], s["resume_completion"], seed=1000 + step)

    # the uninterrupted run: K steps, a checkpoint, then step K
    for step in range(K):
        train_step(model, lora_params, optimizer, batch(step), mb, lr, s["chunk_size"])
    run_args = opsd.parse_args(["--model", s["model_name"].replace(" ", "-")])
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(tmp)
        opsd.save_run_state(out_dir, model, lora_params, None, run_args,
                            state={"step": K, "optimizer": optimizer.state_dict(), "kl_window": []})
        saved_weights = [p.detach().clone() for p in lora_params]
        saved_optimizer = optimizer_snapshot(optimizer)
        loss_uninterrupted, _ = train_step(model, lora_params, optimizer, batch(K), mb, lr, s["chunk_size"])
        log(f"resume: {K + 1} steps and a checkpoint, loss at step {K + 1} {loss_uninterrupted:.6f}")

        # the restart: the LoRA weights back at their initial values, a fresh optimizer, then restore
        with torch.no_grad():
            for p, v in zip(lora_params, initial):
                p.copy_(v)
        optimizer = torch.optim.AdamW(lora_params, lr=5e-6, betas=(0.9, 0.999), weight_decay=0.0)
        rng_before = rng_states(device)
        step, ema, window = opsd.restore(out_dir / f"checkpoint-{K}", model, lora_params, optimizer)
        rng_after = rng_states(device)
    details = {
        "model": s["model_name"], "steps_before_checkpoint": K,
        "weights_bitwise": all(same_tensor(p.detach(), w) for p, w in zip(lora_params, saved_weights)),
        "optimizer_bitwise": same_optimizer_state(optimizer_snapshot(optimizer), saved_optimizer),
        "step_restored": step == K,
        "rng_cpu_unchanged": torch.equal(rng_before[0], rng_after[0]),
        "rng_cuda_unchanged": (all(torch.equal(a, b) for a, b in zip(rng_before[1], rng_after[1]))
                               if device.type == "cuda" else None),
    }
    loss_resumed, _ = train_step(model, lora_params, optimizer, batch(K), mb, lr, s["chunk_size"])
    details["next_loss_uninterrupted"], details["next_loss_resumed"] = loss_uninterrupted, loss_resumed
    details["next_loss_rel_diff"] = abs(loss_resumed - loss_uninterrupted) / max(abs(loss_uninterrupted), 1e-30)
    details["next_loss_matches"] = details["next_loss_rel_diff"] <= RESUME_LOSS_RTOL
    ok = all(v is not False for k, v in details.items() if k in (
        "weights_bitwise", "optimizer_bitwise", "step_restored", "rng_cpu_unchanged", "rng_cuda_unchanged",
        "next_loss_matches"))
    log(f"resume: restored step {step}, next loss {loss_resumed:.6f} (relative difference "
        f"{details['next_loss_rel_diff']:.1e}); round trip {'ok' if ok else 'FAILED'}")
    return {"resume_roundtrip": ok, "resume_details": details}


# -----------------------------------------------------------------------------
# "logits_probe" and "lora_init_matches_cpu"


def check_logits_probe(s, device):
    model = build_model(s, device)
    refused = opsd.check_logits_path(model)
    log(f"logits_probe: {refused or 'ok'}")
    return {"logits_probe": refused or "ok"}


def check_lora_init(s, device):
    model = build_model(s, device)
    cpu_copy = copy.deepcopy(model).to("cpu")
    opsd.add_lora(model, s["lora_r"], s["lora_alpha"], seed=7)
    opsd.add_lora(cpu_copy, s["lora_r"], s["lora_alpha"], seed=7)
    on_device, on_cpu = opsd.lora_layers(model), opsd.lora_layers(cpu_copy)
    mismatched = [name for name in on_device if name not in on_cpu
                  or on_device[name].lora_A.device.type != device.type  # A must live on the model's device
                  or not torch.equal(on_device[name].lora_A.detach().cpu(), on_cpu[name].lora_A.detach())]
    ok = bool(on_device) and on_device.keys() == on_cpu.keys() and not mismatched
    log(f"lora_init: {len(on_device)} layers, {len(mismatched)} with other A than on the CPU")
    return {"lora_init_matches_cpu": ok, "lora_init_details": {"layers": len(on_device), "mismatched": mismatched[:5]}}


# -----------------------------------------------------------------------------
# "padded_batch": one micro-batch of rows of different lengths under each SDPA backend, against its rows alone


# The SDPA backends a device may offer, by the names the JSON uses; "default" is SDPA's own choice (no context)
SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION",
                 "math": "MATH"}
MUST_PASS = ("default", "math")  # the others may refuse the masked inputs (recorded, not a failure)


def padded_rows(s):
    """Student prompts, teacher prompts (the student's plus a context of another length) and completions of random
    token ids, every row of its own lengths, so both micro-batches are padded and differently."""
    g = torch.Generator().manual_seed(5)
    vocab = s["model"]["vocab_size"]

    def ids(n):
        return torch.randint(1, vocab, (n,), generator=g).tolist()

    student = [ids(n) for n in s["padded_prompts"]]
    teacher = [ids(n) + p for n, p in zip(s["padded_contexts"], student)]
    return student, teacher, [ids(n) for n in s["padded_completions"]]


def query_rows_without_key(inputs):
    """How many query rows of this batch's causal, padded mask allow no key: a row's keys are the unmasked tokens at
    or before it, so these are the pads before a row's first token (what some CUDA kernels turn into NaN)."""
    seen = inputs["attention_mask"].cumsum(-1)  # (B, T) unmasked keys at or before each column
    return int((seen == 0).sum())


def score_rows(model, lora_params, rows, num_tokens, chunk_size):
    """One micro-batch scored as opsd.backward_step scores it (opsd.build_batch for student and teacher, the base
    teacher's forward, hidden state t predicting token t + 1, opsd.opsd_loss), but each row's loss on its own:
    backward of sum_rows (row's divergence summed) / num_tokens, as one micro-batch of a step of num_tokens tokens.
    Returns (each row's mean divergence, the micro-batch's loss, the query rows without a key in both batches)."""
    student, teacher, completions = rows
    device = lora_params[0].device
    s_in, s_mask = opsd.build_batch(student, completions, 0, device)
    t_in, t_mask = opsd.build_batch(teacher, completions, 0, device)
    with torch.no_grad(), opsd.teacher_weights(model, lora_params, "base", None):
        t_hidden = opsd.final_hidden(model, t_in)  # (B, T_teacher, H)
    s_hidden = opsd.final_hidden(model, s_in)  # (B, T_student, H)
    lm_head = model.get_output_embeddings().weight
    row = torch.arange(len(completions), device=device)[:, None]  # (B, 1)
    means, loss = [], 0.0
    for r, completion in enumerate(completions):
        mean, _ = opsd.opsd_loss(s_hidden[:, :-1], (s_mask & (row == r))[:, 1:], t_hidden[:, :-1],
                                 (t_mask & (row == r))[:, 1:], lm_head, len(completion), chunk_size=chunk_size,
                                 **LOSS_KW)
        means.append(mean.item())
        loss = loss + mean * (len(completion) / num_tokens)
    loss.backward()
    return means, loss.item(), query_rows_without_key(s_in) + query_rows_without_key(t_in)


def kernels_ran(prof):
    """The SDPA kernels (ATen's op names, forward and backward) a profiled run dispatched to, e.g.
    'efficient_attention' and 'efficient_attention_backward' on CUDA, 'flash_attention_for_cpu' on a CPU."""
    prefix = "aten::_scaled_dot_product_"
    return sorted({e.name.removeprefix(prefix) for e in prof.events() if e.name.startswith(prefix)})


def lora_grad(lora_params):
    return torch.cat([p.grad.flatten().float() for p in lora_params])


def zero_grads(lora_params):
    for p in lora_params:
        p.grad = None


def rel_diff(a, b):
    return abs(a - b) / max(abs(b), 1e-30)


def check_padded(s, device):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = build_model(s, device)
    lora_params = opsd.add_lora(model, s["lora_r"], s["lora_alpha"], seed=42)
    with torch.no_grad():  # a student apart from its base teacher, so that every LoRA matrix has a gradient
        g = torch.Generator().manual_seed(3)
        for p in lora_params:
            p.add_((torch.randn(p.shape, generator=g) * 0.02).to(p.dtype).to(p.device))
    rows = padded_rows(s)
    num_tokens = sum(map(len, rows[2]))
    out = {"model": s["model_name"], "dtype": str(s["dtype"])[6:], "student_prompts": s["padded_prompts"],
           "teacher_prompts": [len(t) for t in rows[1]], "completions": s["padded_completions"],
           "tolerance": PADDED_TOLERANCE}

    # the oracle: each row in a micro-batch of its own (no pads, no mask), SDPA's own choice of kernel
    zero_grads(lora_params)
    alone = [score_rows(model, lora_params, [[x[r]] for x in rows], num_tokens, s["chunk_size"])[0][0]
             for r in range(len(rows[2]))]
    alone_grad = lora_grad(lora_params)
    out["alone_row_losses"] = alone
    out["alone_finite"] = all(map(math.isfinite, alone)) and bool(torch.isfinite(alone_grad).all())

    def run(name):
        forced = name != "default"
        context = sdpa_kernel([getattr(SDPBackend, SDPA_BACKENDS[name])]) if forced else contextlib.nullcontext()
        zero_grads(lora_params)
        with context, torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            means, loss, empty = score_rows(model, lora_params, rows, num_tokens, s["chunk_size"])
        grad = lora_grad(lora_params)
        finite = math.isfinite(loss) and all(map(math.isfinite, means)) and bool(torch.isfinite(grad).all())
        row_rel = [rel_diff(m, a) for m, a in zip(means, alone)]
        grad_rel = ((grad - alone_grad).norm() / alone_grad.norm()).item()
        return {"loss": loss, "row_losses": means, "finite": finite, "query_rows_without_key": empty,
                "kernels_ran": kernels_ran(prof),
                "max_row_rel_diff": max(row_rel), "grad_rel_diff": grad_rel,
                "passed": finite and max(row_rel) <= PADDED_TOLERANCE["row_loss"]
                and grad_rel <= PADDED_TOLERANCE["grad"]}

    backends = {}
    for name in ("default", *SDPA_BACKENDS):
        if name != "default" and not hasattr(SDPBackend, SDPA_BACKENDS[name]):
            backends[name] = {"absent": f"torch {torch.__version__} has no SDPBackend.{SDPA_BACKENDS[name]}"}
        else:
            try:
                backends[name] = run(name)
            except RuntimeError as e:  # a kernel that refuses these inputs (a mask, say) or this device
                if name in MUST_PASS:
                    raise
                backends[name] = {"refused": error_string(e).removeprefix("error: ")}
        b = backends[name]
        log(f"padded_batch: {name}: " + (f"loss {b['loss']:.6f}, rows within {b['max_row_rel_diff']:.1e} of alone, "
                                         f"gradient {b['grad_rel_diff']:.1e}" if "loss" in b
                                         else "{}: {}".format(*next(iter(b.items())))))
    out["backends"] = backends
    out["passed"] = out["alone_finite"] and all(backends[n].get("passed") is True for n in MUST_PASS) and all(
        b.get("passed", True) for b in backends.values())
    return {"padded_batch": out}


# -----------------------------------------------------------------------------
# "identity_readback": the push read-back's premise, I W^T = W^T bitwise, at Qwen3-1.7B's projection shapes


def projection_shapes(model_config):
    """{(out, in): the projections with that weight shape}: the seven the LoRA covers, and the two vLLM stacks them
    into (qkv_proj, gate_up_proj), whose GEMM the engine's read-back runs."""
    h, i = model_config["hidden_size"], model_config["intermediate_size"]
    q = model_config["num_attention_heads"] * model_config["head_dim"]
    kv = model_config["num_key_value_heads"] * model_config["head_dim"]
    named = [("q_proj", (q, h)), ("k_proj", (kv, h)), ("v_proj", (kv, h)), ("o_proj", (h, q)),
             ("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i)),
             ("qkv_proj", (q + 2 * kv, h)), ("gate_up_proj", (2 * i, h))]
    shapes = {}
    for name, shape in named:
        shapes.setdefault(shape, []).append(name)
    return shapes


def identity_product(eye, weight):
    """What the engine's read-back computes for an unquantized linear layer on CUDA (vLLM's default GEMM is
    F.linear): I W^T, (in, out)."""
    return F.linear(eye, weight)


@contextlib.contextmanager
def float32_matmuls(precision):
    """float32 matmuls at torch's `precision`: "highest" (full precision, no TF32) is what opsd.py sets for every run
    and what vLLM's worker sets with VLLM_FLOAT32_MATMUL_PRECISION=highest, which opsd.py forces; "high" allows
    TF32. The process's previous setting comes back afterwards."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def readback_mismatches(shape, dtype, device, seed):
    """Elements of W^T that I W^T does not give back bitwise (-0.0 counted as 0.0, as opsd.fingerprint does), for a
    random W of this shape at a trained model's scale; and whether opsd.fingerprint tells them apart."""
    g = torch.Generator(device=device).manual_seed(seed)
    weight = (torch.randn(shape, generator=g, device=device) * 0.02).to(dtype)  # (out, in)
    eye = torch.eye(shape[1], dtype=dtype, device=device)
    got = identity_product(eye, weight).t()  # (out, in)
    bits = getattr(torch, f"int{8 * weight.element_size()}")
    differ = (got + 0.0).view(bits) != (weight + 0.0).view(bits)
    return int(differ.sum()), opsd.fingerprint(got) == opsd.fingerprint(weight)


def check_readback(s, device):
    shapes = projection_shapes(s["model"])
    settings = {"bfloat16": (torch.bfloat16, contextlib.nullcontext),
                "float32": (torch.float32, lambda: float32_matmuls("highest")),
                "float32_tf32_allowed": (torch.float32, lambda: float32_matmuls("high"))}  # reported, unjudged
    out = {"shapes": {"x".join(map(str, shape)): names for shape, names in shapes.items()}}
    for key, (dtype, context) in settings.items():
        with context():
            found = {"x".join(map(str, shape)): readback_mismatches(shape, dtype, device, seed=n)
                     for n, shape in enumerate(shapes)}
            matmul = {"float32_matmul_precision": torch.get_float32_matmul_precision(),
                      "allow_tf32": torch.backends.cuda.matmul.allow_tf32,
                      "allow_bf16_reduced_precision_reduction":
                          torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction}
        out[key] = {"settings": matmul, "mismatched_elements": {k: v[0] for k, v in found.items()},
                    "fingerprint_equal": {k: v[1] for k, v in found.items()},
                    "bitwise": all(v[0] == 0 for v in found.values())}
        log(f"identity_readback: {key}: " + ("bitwise at every shape" if out[key]["bitwise"] else
            "differs: " + ", ".join(f"{k} ({v} elements)" for k, v in out[key]["mismatched_elements"].items() if v)))
    out["passed"] = out["bfloat16"]["bitwise"] and out["float32"]["bitwise"]
    return {"identity_readback": out}


# -----------------------------------------------------------------------------
# The run


PARTS = [("loss", check_loss), ("step", check_step), ("resume_roundtrip", check_resume),
         ("logits_probe", check_logits_probe), ("lora_init_matches_cpu", check_lora_init),
         ("padded_batch", check_padded), ("identity_readback", check_readback)]


def failures(results):
    """Names of the parts that failed: an error string, or a check that came out false."""
    failed = []
    loss, step = results.get("loss"), results.get("step")
    if not (isinstance(loss, dict) and loss["matches_float64"] and loss["chunked_below_naive"] is not False):
        failed.append("loss")
    if not (isinstance(step, dict) and step["finite"]):
        failed.append("step")
    failed += [k for k in ("resume_roundtrip", "lora_init_matches_cpu") if results.get(k) is not True]
    if results.get("logits_probe") != "ok":
        failed.append("logits_probe")
    failed += [k for k in ("padded_batch", "identity_readback")
               if not (isinstance(results.get(k), dict) and results[k]["passed"] is True)]
    return failed


def fail(message):
    print(f"gpu_check.py: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def main(argv=None):
    p = argparse.ArgumentParser(description="Check opsd.py's loss, training step, resume, LoRA init, padded batches "
                                            "and the push read-back's premise on one GPU without vLLM; one JSON "
                                            "object to --output.")
    p.add_argument("--output", required=True, help="the JSON file to write (rewritten after every part)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes on whatever device there is (a CPU here): the same code, in seconds")
    args = p.parse_args(argv)
    try:  # before anything runs: a CPU build of torch on a GPU node would measure the CPU
        opsd.check_cuda_build()
    except opsd.Refusal as e:  # opsd.py's sentence
        fail(str(e))
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        fail(f"no CUDA device is visible to torch {torch.__version__}: run this on a GPU node, "
             "or pass --smoke for the tiny run on this machine.")
    output = Path(args.output)
    try:  # before anything runs: a result that cannot be written is a wasted GPU slot
        output.write_text("{}\n")
    except OSError as e:
        fail(f"--output {output} cannot be written ({e.strerror}).")
    device = torch.device("cuda:0" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    s = SIZES["smoke" if args.smoke else "full"]
    opsd.choose_attention_kernels()  # training's choice, which padded_batch's "default" runs under
    import transformers

    results = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
               "transformers": transformers.__version__, "smoke": args.smoke, "finished": False,
               "sdpa_enabled": {k: getattr(torch.backends.cuda, f"{k}_sdp_enabled")()
                                for k in ("flash", "mem_efficient", "math", "cudnn")}}
    log(f"{results['device']}, torch {results['torch']}, transformers {results['transformers']}, "
        f"{'smoke' if args.smoke else 'full'} sizes")
    for key, part in PARTS:
        t0 = time.perf_counter()
        try:
            results.update(part(s, device))
        except (Exception, SystemExit) as e:  # one part's failure (out of memory, say) must not stop the others
            traceback.print_exc()
            results[key] = error_string(e)
        free(device)
        log(f"{key}: done in {time.perf_counter() - t0:.1f} s")
        output.write_text(json.dumps(results, indent=2) + "\n")
    results["failures"] = failures(results)
    results["ok"], results["finished"] = not results["failures"], True
    output.write_text(json.dumps(results, indent=2) + "\n")
    log(f"{'all parts passed' if results['ok'] else 'FAILED: ' + ', '.join(results['failures'])} -> {output}")
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
