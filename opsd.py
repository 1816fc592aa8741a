"""
On-Policy Self-Distillation (OPSD) for LLM reasoning, in one file.

    torchrun --nproc_per_node 4 opsd.py --clip token --skip-first-tokens 1   # Qwen3-1.7B, 4 GPUs
    python opsd.py --model DIR --dataset FILE.jsonl ...                      # one process
    torchrun --nproc_per_node 2 opsd.py --model tests/miniature/model ...    # the CPU quickstart

One model plays two roles. The student sees only the problem; the teacher is the same
network, and its prompt also holds a reference solution. Each optimizer step:
  1. the student samples an answer to each problem with vLLM (one engine per rank);
  2. the teacher (by default the base model: LoRA switched off) scores that answer;
  3. at every answer position, the student's next-token distribution is pulled towards
     the teacher's with a full-vocabulary KL; only LoRA weights train;
  4. the merged LoRA weights are pushed into the running vLLM engine, in place.

Where it departs from the released recipe, and why: README.md, "Departures".
Then: the helpers the method calls; Part 1, the method; Part 2, the run; Part 3, the guards.
"""

import argparse
import hashlib
import importlib.util
import json
import logging
import math
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import traceback
import warnings
import zlib
from array import array
from collections import deque
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

# -----------------------------------------------------------------------------
# Helpers the method calls

# torchrun sets RANK and WORLD_SIZE; `python opsd.py` is a world of one
RANK = int(os.environ.get("RANK", 0))
WORLD_SIZE = int(os.environ.get("WORLD_SIZE", 1))


def print0(*args, **kwargs):
    if RANK == 0:
        print(*args, **kwargs, flush=True)


class Refusal(Exception):
    """A mistake the user can fix, in one sentence."""


def fail(message):
    raise Refusal(message)


class CollectiveError(RuntimeError):
    """A collective failed: another rank is gone or cannot be reached."""


def all_reduce(tensor, op=dist.ReduceOp.SUM):
    """Sum (or `op`) over ranks, in place."""
    if not dist.is_initialized():
        return tensor
    try:
        dist.all_reduce(tensor, op)
    except torch.OutOfMemoryError:
        raise
    except RuntimeError as e:  # gloo: a lost peer or a timeout; NCCL: its error
        raise CollectiveError(str(e).splitlines()[0]) from e
    return tensor


# =============================================================================
# PART 1: THE METHOD
# =============================================================================

# -----------------------------------------------------------------------------
# Prompts and batches: the released recipe's strings, rendered once to token ids

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
TRANSITION = (
    "\n\nAfter reading the reference solution above, make sure you truly understand the "
    "reasoning behind each step \u2014 do not copy or paraphrase it. Now, using your own "
    "words and independent reasoning, derive the same final answer to the problem above. "
    "Think step by step, explore different approaches, and don't be afraid to backtrack "
    "or reconsider if something doesn't work out:\n"
)


def eval_message(problem):
    """The released evaluation's prompt (eval.py's): no 'Problem: ' prefix."""
    return f"{problem}\n\n{INSTRUCTION}"


def student_message(problem, prompt="recipe"):
    """The recipe's student message; with prompt="eval", eval.py's prompt, so that
    the student trains in the prompt it is scored in."""
    if prompt == "eval":
        return eval_message(problem)
    return f"Problem: {problem}\n\n{INSTRUCTION}"


def teacher_message(problem, context):
    """The problem, then the privileged context: a reference solution. With no
    context (--teacher-context none), the problem and the instruction alone: the
    transition speaks of the reference, so it goes with it."""
    if context is None:
        return f"Problem: {problem}\n\n{INSTRUCTION}"
    return (
        f"Problem: {problem}\n\n"
        "Here is a reference solution to this problem:\n"
        "=== Reference Solution Begin ===\n"
        f"{context}\n"
        "=== Reference Solution End ===\n"
        f"{TRANSITION}\n{INSTRUCTION}"
    )


def extract_boxed(text):
    """The content of the last \\boxed{...}, braces matched; None when there is none or
    its braces never close."""
    start = text.rfind("\\boxed{")
    if start < 0 or start != text.rfind("\\boxed"):
        return None
    depth = 0
    for end in range(start + len("\\boxed"), len(text)):
        if text[end] == "{":
            depth += 1
        elif text[end] == "}":
            depth -= 1
        if depth == 0:
            return text[start + len("\\boxed{"):end].strip()
    return None


# What the teacher is shown in place of its row's reference (--teacher-context)
TEACHER_CONTEXTS = ("reference", "none", "other", "answer")


def shown_contexts(rows, shown, seed):
    """(problem, context) rows as the teacher sees them (--teacher-context)."""
    if shown == "none":  # no reference block
        return [(problem, None) for problem, _ in rows]
    if shown == "other":  # another row's reference, the same on every rank and resume
        if len(rows) < 2:
            fail("--teacher-context other needs at least two rows.")
        # one cycle through a seeded order: row order[i] gets the reference of row
        # order[i + 1], so no row gets its own
        order = list(range(len(rows)))
        random.Random(seed).shuffle(order)
        donor = dict(zip(order, order[1:] + order[:1]))
        return [(problem, rows[donor[i]][1]) for i, (problem, _) in enumerate(rows)]
    if shown == "answer":  # the last \boxed{} of the row's reference, alone
        answers = []
        for number, (problem, reference) in enumerate(rows, 1):
            answer = extract_boxed(reference)
            if answer is None:
                fail(f"--teacher-context answer: row {number} ({problem[:40]!r}) has no "
                     "\\boxed{} in its reference.")
            answers.append((problem, f"\\boxed{{{answer}}}"))
        return answers
    return rows


def render(tokenizer, message, thinking):
    """Token ids of a one-turn chat ending in the assistant's generation prompt."""
    chat = [{"role": "user", "content": message}]
    return tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                         enable_thinking=thinking, return_dict=False)


def build_prompts(tokenizer, rows, *, student_thinking, teacher_thinking,
                  max_prompt_length, student_prompt="recipe"):
    """[(student prompt ids, teacher prompt ids)] of (problem, context) rows, less
    the rows whose prompts are longer than max_prompt_length."""
    prompts = []
    for problem, context in rows:
        student = render(tokenizer, student_message(problem, student_prompt),
                         student_thinking)
        teacher = render(tokenizer, teacher_message(problem, context), teacher_thinking)
        if max(len(student), len(teacher)) <= max_prompt_length:
            prompts.append((student, teacher))
    dropped = len(rows) - len(prompts)
    print0(f"data: {len(prompts)} prompts, {dropped} dropped as longer than "
           f"{max_prompt_length} tokens")
    if not prompts:
        fail(f"No row fits --max-prompt-length {max_prompt_length}: raise it.")
    return prompts


def step_indices(step, prompts_per_step, num_prompts, seed):
    """Prompt indices of optimizer step `step`. Each epoch is a fresh permutation
    seeded by seed + epoch, so the order is a function of (seed, step) alone and a
    resumed run needs no data-loader state."""
    indices = []
    permutations = {}
    first = step * prompts_per_step
    for position in range(first, first + prompts_per_step):
        epoch, i = divmod(position, num_prompts)
        if epoch not in permutations:
            generator = torch.Generator().manual_seed(seed + epoch)
            permutations[epoch] = torch.randperm(num_prompts, generator=generator).tolist()
        indices.append(permutations[epoch][i])
    return indices


def build_batch(prompts, completions, pad_id, device):
    """Model inputs of one micro-batch, and the mask of answer tokens (B, T).

    Each row is [prompt | completion | pads], and positions come from the attention
    mask, so every answer token sits at the position vLLM sampled it at. Pads go last:
    a left pad is a query row whose keys are all masked, for which some CUDA attention
    kernels return NaN, and the next layer spreads it to real tokens (0 x NaN). The
    mask selects answer tokens row after row, so the student's and the teacher's
    batches select the same tokens in the same order."""
    B = len(prompts)
    T = max(len(p) + len(c) for p, c in zip(prompts, completions))
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    completion_mask = torch.zeros_like(input_ids, dtype=torch.bool)
    for row, (prompt, completion) in enumerate(zip(prompts, completions)):
        P = len(prompt)
        L = len(completion)
        input_ids[row, :P + L] = torch.tensor(prompt + completion)
        attention_mask[row, :P + L] = 1
        completion_mask[row, P:P + L] = True
    position_ids = attention_mask.cumsum(-1) - 1  # (B, T) 0 .. P + L - 1, then constant
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask,
              "position_ids": position_ids}
    inputs = {name: x.to(device) for name, x in inputs.items()}
    return inputs, completion_mask.to(device)


# -----------------------------------------------------------------------------
# LoRA: y = W x + (alpha / r) B A x on every attention and MLP projection

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update. `weight` and `bias`
    keep their names, which are vLLM's. A and B are float32 even in a bf16 model:
    an update of lr 5e-6 would round away in bf16."""

    def __init__(self, base: nn.Linear, r: int, alpha: float, generator: torch.Generator):
        super().__init__()
        self.weight = base.weight  # (out, in)
        self.bias = base.bias  # (out,) or None
        self.r = r
        self.alpha = alpha
        self.scale = alpha / r
        # A is drawn on the CPU, then moved, so every device and rank starts alike;
        # B = 0, so training starts at the base model
        lora_A = torch.empty(r, base.in_features)
        nn.init.kaiming_uniform_(lora_A, a=math.sqrt(5), generator=generator)
        device = base.weight.device
        self.lora_A = nn.Parameter(lora_A.to(device))  # (r, in)
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r, device=device))  # (out, r)
        self.enabled = True

    def forward(self, x):
        y = F.linear(x, self.weight, self.bias)
        if not self.enabled:
            return y
        x = x.to(self.lora_A.dtype)
        update = F.linear(F.linear(x, self.lora_A), self.lora_B)  # B A x
        return y + (self.scale * update).to(y.dtype)

    def merged_weight(self):
        """W + (alpha / r) B A in the model's dtype, out of place: W itself is never
        touched, so the fixed teacher cannot drift."""
        update = self.scale * (self.lora_B @ self.lora_A)
        return (self.weight.float() + update).to(self.weight.dtype)


def lora_layers(model):
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def add_lora(model, r, alpha, seed=0, targets=LORA_TARGETS):
    """Wrap every nn.Linear named in `targets`, freeze everything else, and return
    the LoRA parameters. The A matrices come from one CPU generator seeded with
    `seed`, in module order."""
    model.requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if name in targets and isinstance(child, nn.Linear):
                setattr(module, name, LoRALinear(child, r, alpha, generator))
    return [p for m in lora_layers(model).values() for p in (m.lora_A, m.lora_B)]


@torch.no_grad()
def merged_weights(model):
    """(HF parameter name, merged weight) per LoRA layer, one at a time: never a
    second copy of the model."""
    for name, m in lora_layers(model).items():
        yield f"{name}.weight", m.merged_weight()


# -----------------------------------------------------------------------------
# Rollout: one vLLM engine per rank samples from token ids; weights pushed in place

# vLLM on a CPU (eval.py's too): no CUDA graphs to capture, and whole prompts. A
# prompt prefilled in chunks samples (and discards) a token per chunk, then rewinds
# its seeded generator, which a CPU torch.Generator cannot do.
CPU_ENGINE = {"enforce_eager": True, "enable_chunked_prefill": False}


def engine_environment(cpu):
    """vLLM logs errors only (also two notices a CPU start prints early); on a CPU
    its KV cache gets 1 GiB."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    logging.getLogger("vllm.triton_utils.importing").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", r"`torch\.distributed\.reduce_op` is deprecated",
                            FutureWarning)
    if cpu:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def start_engine(args, device):
    """This rank's vLLM engine. Under torchrun every rank runs its own engine,
    tensor-parallel 1, inside its own process ("external_launcher")."""
    from vllm import LLM
    max_model_len = args.max_prompt_length + args.max_new_tokens
    extra = {"gpu_memory_utilization": args.vllm_memory}
    if device.type == "cpu":
        extra = CPU_ENGINE
    launcher = None
    if WORLD_SIZE > 1:
        launcher = "external_launcher"
    return LLM(
        model=args.model, dtype=args.dtype, max_model_len=max_model_len,
        seed=args.seed + RANK,  # every request has a seed: this one keeps others apart
        max_num_seqs=max(1, args.prompts_per_step // WORLD_SIZE),  # a step's, at once
        max_num_batched_tokens=max(max_model_len, 8192),  # at least one whole sequence
        distributed_executor_backend=launcher, **extra)


def sample(llm, prompts, seeds, args):
    """Completions (token ids, ending in EOS when one was sampled), and vLLM's raw
    log-prob of each token (before temperature and top-k/top-p). One seed per
    request: the in-process engine shares torch's global RNG."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    params = [SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                             seed=seed, max_tokens=args.max_new_tokens, logprobs=0)
              for seed in seeds]
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    completions = []
    logprobs = []
    for out in llm.generate(requests, params, use_tqdm=False):
        tokens = list(out.outputs[0].token_ids)
        per_token = out.outputs[0].logprobs  # one {token id: Logprob} per token
        completions.append(tokens)
        logprobs.append([lp[t].logprob for lp, t in zip(per_token, tokens)])
    return completions, logprobs


def push_weights(llm, model):
    """Update the inference engine's weights: the merged LoRA weights go into the
    running engine, in place. Then its prefix cache is dropped: its KV entries were
    computed with the old weights. (Part 3 reads the weights back.)"""
    # vLLM stacks q/k/v and gate/up itself; all seven projections are sent, so every
    # fused group is complete
    weights = {"weights_iterator": merged_weights(model), "is_checkpoint_format": True}
    llm.collective_rpc("reload_weights", kwargs=weights)
    llm.reset_prefix_cache()


def stop_engine(llm):
    """Shut the engine down; vLLM's teardown also destroys the process group."""
    llm.llm_engine.engine_core.shutdown()


# -----------------------------------------------------------------------------
# The loss: a divergence per answer position between teacher and student

CLIP_MODES = ("entry", "token", "none")


def log_probs(student_logits, teacher_logits, temperature):
    """(log p_S, log p_T) at the loss temperature, in float32: (..., V) each."""
    log_s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    log_t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    return log_s, log_t


def clipped_divergence(log_s, log_t, *, beta, clip, tau):
    """token_divergence from the log-probs at the loss temperature, (..., V) each."""
    if clip not in CLIP_MODES:
        raise ValueError(f"clip must be one of {CLIP_MODES}, got {clip!r}.")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must lie in [0, 1], got {beta}.")
    # per vocabulary entry v:
    #   beta = 0:  d_v = p_T(v) (log p_T(v) - log p_S(v))              forward KL(T || S)
    #   beta = 1:  d_v = p_S(v) (log p_S(v) - log p_T(v))              reverse KL(S || T)
    #   else:      d_v = beta KL_v(T || m) + (1 - beta) KL_v(S || m),  m = beta p_T + (1 - beta) p_S
    if beta == 0.0:
        d = log_t.exp() * (log_t - log_s)
    elif beta == 1.0:
        d = log_s.exp() * (log_s - log_t)
    else:
        log_m = torch.logaddexp(log_t + math.log(beta), log_s + math.log(1.0 - beta))
        d = beta * log_t.exp() * (log_t - log_m) + (1.0 - beta) * log_s.exp() * (log_s - log_m)
    # entry clip (the released recipe): d_v <- min(d_v, tau), before the sum; a clamped
    # entry gets no gradient
    if clip == "entry":
        d = d.clamp(max=tau)
    k = d.sum(dim=-1)  # (...) k_n = sum_v d_v
    # token clip: k_n * min(1, tau / k_n), the factor detached. The value is min(k_n, tau);
    # the gradient keeps the true divergence's direction at every position, scaled down.
    if clip == "token":
        k = k * (tau / k.clamp(min=tau)).detach()
    return k


def token_divergence(student_logits, teacher_logits, *, beta=0.0, temperature=1.0,
                     clip="entry", tau=0.05):
    """Each position's loss term D(p_T || p_S) after clipping, in float32, from the
    logits. Shapes (..., V) -> (...)."""
    log_s, log_t = log_probs(student_logits, teacher_logits, temperature)
    return clipped_divergence(log_s, log_t, beta=beta, clip=clip, tau=tau)


class PositionStats(NamedTuple):
    """Diagnostics per answer position, (N,) each, whatever the loss's beta and clip.
    All but `logprob` are at the loss temperature."""
    kl: torch.Tensor  # unclipped KL(p_T || p_S)
    # the teacher's mass on the entries the entry clip clamps: the sum of p_T(v) over
    # the v with p_T(v) (log p_T(v) - log p_S(v)) > tau
    clipped_mass: torch.Tensor
    logprob: torch.Tensor  # the student's raw log-prob of the sampled token (as vLLM's)
    student_entropy: torch.Tensor  # H(p_S) = -sum_v p_S(v) log p_S(v)
    teacher_entropy: torch.Tensor  # H(p_T)
    # 1 where the loss term is below -1e-6 (the entry clip can make the sum negative),
    # else 0; float32's rounding of a zero divergence does not count
    negative: torch.Tensor


@torch.no_grad()
def divergence_stats(student_logits, log_s, log_t, targets, terms, *, tau):
    """PositionStats of C positions from the student's raw logits (C, V), both sides'
    log-probs at the loss temperature (C, V), the sampled tokens (C,) and the loss
    terms (C,)."""
    raw = student_logits.float()
    logprob = raw.gather(-1, targets[:, None])[:, 0] - raw.logsumexp(-1)
    p_t = log_t.exp()  # (C, V)
    d = p_t * (log_t - log_s)  # (C, V) p_T(v) (log p_T(v) - log p_S(v))
    kl = d.sum(-1)
    clipped_mass = (p_t * (d > tau)).sum(-1)
    student_entropy = -(log_s.exp() * log_s).sum(-1)
    teacher_entropy = -(p_t * log_t).sum(-1)
    negative = (terms < -1e-6).float()
    return PositionStats(kl, clipped_mass, logprob, student_entropy, teacher_entropy,
                         negative)


def join_stats(stats, like):
    """One PositionStats of a list of them (of none: empty tensors like `like`)."""
    if not stats:
        empty = like.new_zeros(0, dtype=torch.float32)
        return PositionStats._make(empty for _ in PositionStats._fields)
    return PositionStats(*(torch.cat(parts) for parts in zip(*stats)))


def final_hidden(model, inputs):
    """(B, T, H) hidden states after the final norm, before the lm_head: the loss
    makes the logits itself, in chunks."""
    return model.base_model(**inputs, use_cache=False).last_hidden_state


def opsd_loss(student_hidden, student_mask, teacher_hidden, teacher_mask, lm_head_weight,
              num_tokens, targets=None, *, loss_positions=None, beta=0.0, temperature=1.0,
              clip="entry", tau=0.05, chunk_size=256):
    """(loss, stats) of one micro-batch.

    loss = the sum of token_divergence over the N masked positions / num_tokens (the
    whole step's count, so that micro-batches and ranks add up to one big batch).
    The hidden states (B, T, H) come before the frozen lm_head. Each mask (B, T)
    selects the N positions whose hidden state predicts an answer token, in the same
    order on both sides: the answer-token mask moved one position left, since the
    hidden state at t predicts token t + 1. `loss_positions` (N,) leaves some out of
    the loss; `targets` (N,), the sampled tokens, asks for `stats`, their PositionStats.

    Logits exist for `chunk_size` positions at a time (C x V, never N x V). Each
    chunk's gradient with respect to the student's hidden states is taken while its
    logits exist, then attached to the graph by a surrogate whose value is exactly 0."""
    hs = student_hidden[student_mask]  # (N, H)
    ht = teacher_hidden[teacher_mask].detach()  # (N, H)
    if hs.shape != ht.shape:
        raise ValueError(f"Student and teacher masks select {hs.shape[0]} and "
                         f"{ht.shape[0]} positions: must match.")
    N = hs.shape[0]
    keep = torch.ones(N, device=hs.device)  # (N,) 1: in the loss, 0: left out
    if loss_positions is not None:
        keep = loss_positions.float()
    W = lm_head_weight.detach()  # (V, H)
    need_grad = torch.is_grad_enabled() and hs.requires_grad
    total = hs.new_zeros((), dtype=torch.float32)
    grads = []
    stats = []
    for i in range(0, N, chunk_size):
        h = hs[i:i + chunk_size].detach().requires_grad_(need_grad)  # (C, H)
        teacher_logits = ht[i:i + chunk_size] @ W.T  # (C, V)
        with torch.enable_grad() if need_grad else nullcontext():
            student_logits = h @ W.T  # (C, V)
            log_s, log_t = log_probs(student_logits, teacher_logits, temperature)
            k = clipped_divergence(log_s, log_t, beta=beta, clip=clip, tau=tau)  # (C,)
            k = k * keep[i:i + chunk_size]  # a position left out adds nothing, nor gradient
            if need_grad:
                grads.append(torch.autograd.grad(k.sum(), h)[0])
        total = total + k.detach().sum()
        if targets is not None:
            stats.append(divergence_stats(student_logits.detach(), log_s.detach(),
                                          log_t.detach(), targets[i:i + chunk_size],
                                          k.detach(), tau=tau))
    loss = total / max(num_tokens, 1)
    if need_grad:  # also with no positions at all, so that backward runs on every rank
        grad = torch.zeros_like(hs)  # (N, H) d sum_n k_n / d hs
        if grads:
            grad = torch.cat(grads)
        surrogate = (hs * grad).sum() / max(num_tokens, 1)
        loss = loss + (surrogate - surrogate.detach())
    if targets is None:
        return loss, None
    return loss, join_stats(stats, hs)


# -----------------------------------------------------------------------------
# The KL diagnostic: the unclipped KL per answer position, over a window of tokens

def diagnostic_sums(stats, sampler_logprobs, tau):
    """This step's sums over all ranks, from this rank's PositionStats of its answers'
    positions, in order, and vLLM's log-probs of the same tokens (one list per
    answer). gap = |vLLM's log-prob - the trainer's|."""
    kl = stats.kl
    device = kl.device
    gap = (stats.logprob - torch.tensor(sum(sampler_logprobs, []), device=device)).abs()
    lengths = [len(lp) for lp in sampler_logprobs]
    starts = [sum(lengths[:i]) for i, n in enumerate(lengths) if n]  # first positions
    local = {"tokens": len(kl), "kl": kl.sum(), "above_tau": (kl > tau).sum(),
             "clipped_mass": stats.clipped_mass.sum(), "first_kl": kl[starts].sum(),
             "first_tokens": len(starts), "gap": gap.sum(),
             "student_entropy": stats.student_entropy.sum(),
             "teacher_entropy": stats.teacher_entropy.sum(), "negative": stats.negative.sum()}
    values = torch.tensor([float(v) for v in local.values()], device=device)
    sums = dict(zip(local, all_reduce(values).tolist()))
    gap_max = kl.new_zeros(())
    if len(gap):
        gap_max = gap.max()
    sums["gap_max"] = float(all_reduce(gap_max, dist.ReduceOp.MAX))
    return sums


WINDOW_KEYS = ("tokens", "kl", "above_tau", "clipped_mass", "first_kl", "first_tokens",
               "student_entropy", "teacher_entropy", "negative")


def kl_window_means(window, kl_window):
    """Means over the newest steps that cover `kl_window` tokens. `window` holds
    per-step sums, newest last; the steps no longer needed leave it."""
    while len(window) > 1 and sum(w["tokens"] for w in list(window)[1:]) >= kl_window:
        window.popleft()
    w = {key: sum(step_sums[key] for step_sums in window) for key in WINDOW_KEYS}
    tokens = max(w["tokens"], 1)
    return {"kl_mean": w["kl"] / tokens, "kl_frac_above_tau": w["above_tau"] / tokens,
            "kl_clipped_teacher_mass": w["clipped_mass"] / tokens,
            "kl_first_token": w["first_kl"] / max(w["first_tokens"], 1),
            "entropy_student": w["student_entropy"] / tokens,
            "entropy_teacher": w["teacher_entropy"] / tokens,
            "loss_frac_negative": w["negative"] / tokens,
            "kl_window_tokens": int(w["tokens"])}


# -----------------------------------------------------------------------------
# The teacher's weights: the base model (LoRA off), the student's, or their EMA

@contextmanager
def lora_disabled(model):
    """The base model without a copy: the fixed teacher of the released recipe."""
    layers = lora_layers(model).values()
    for m in layers:
        m.enabled = False
    try:
        yield model
    finally:
        for m in layers:
            m.enabled = True


@contextmanager
@torch.no_grad()
def lora_values(lora_params, values):
    """Run with other LoRA values (the EMA teacher's), then put the student's back."""
    student = [p.detach().clone() for p in lora_params]
    for p, v in zip(lora_params, values):
        p.copy_(v)
    try:
        yield
    finally:
        for p, s in zip(lora_params, student):
            p.copy_(s)


def teacher_weights(model, lora_params, teacher, ema):
    """The context of the teacher's forward pass. The EMA teacher is the student
    itself until the first step makes an EMA."""
    if teacher == "base":
        return lora_disabled(model)
    if teacher == "ema" and ema is not None:
        return lora_values(lora_params, ema)
    return nullcontext()


@torch.no_grad()
def ema_update(ema, lora_params, decay):
    """The EMA teacher's LoRA after a step: first (ema None) a copy of the student's,
    then ema = decay * ema + (1 - decay) * student."""
    if ema is None:
        return [p.detach().clone() for p in lora_params]
    for e, p in zip(ema, lora_params):
        e.mul_(decay).add_(p.detach(), alpha=1.0 - decay)
    return ema


# -----------------------------------------------------------------------------
# One optimizer step: forward and backward over micro-batches, gradients summed over
# ranks; the learning-rate schedule

def backward_step(model, lora_params, student_prompts, teacher_prompts, completions, *,
                  pad_id, micro_batch_size, teacher, ema=None, skip_first_tokens=0,
                  **loss_kw):
    """(the step's loss, PositionStats of this rank's answer positions in order); the
    gradient is left in the LoRA parameters' .grad, summed over ranks. Each
    micro-batch's loss is divided by the step's token count over micro-batches and
    ranks (less `skip_first_tokens` per answer): one big batch's gradient."""
    device = lora_params[0].device
    lm_head = model.get_output_embeddings().weight  # (V, H), frozen
    loss_tokens = sum(max(0, len(c) - skip_first_tokens) for c in completions)
    num_tokens = int(all_reduce(torch.tensor(loss_tokens, device=device)))
    loss_sum = 0.0
    stats = []
    for first in range(0, len(completions), micro_batch_size):
        rows = slice(first, first + micro_batch_size)
        answers = completions[rows]
        student_inputs, student_mask = build_batch(student_prompts[rows], answers, pad_id,
                                                   device)
        teacher_inputs, teacher_mask = build_batch(teacher_prompts[rows], answers, pad_id,
                                                   device)
        with torch.no_grad(), teacher_weights(model, lora_params, teacher, ema):
            teacher_hidden = final_hidden(model, teacher_inputs)  # (B, T_teacher, H)
        student_hidden = final_hidden(model, student_inputs)  # (B, T_student, H)
        # The hidden state at position t predicts token t + 1, so the positions scored
        # are those before each answer token: from the prompt's last token to the
        # answer's last but one.
        student_scored = student_mask[:, 1:]
        teacher_scored = teacher_mask[:, 1:]
        targets = student_inputs["input_ids"][:, 1:][student_scored]  # (N,) sampled tokens
        in_loss = [j >= skip_first_tokens for c in answers for j in range(len(c))]
        loss, micro_stats = opsd_loss(
            student_hidden[:, :-1], student_scored, teacher_hidden[:, :-1], teacher_scored,
            lm_head, num_tokens, targets, loss_positions=torch.tensor(in_loss, device=device),
            **loss_kw)
        loss.backward()
        loss_sum += loss.item()
        stats.append(micro_stats)
    # One collective for all LoRA gradients. A sum, not DDP's mean: each loss is already
    # divided by the global token count.
    flat = all_reduce(torch.cat([p.grad.flatten() for p in lora_params]))
    for p, g in zip(lora_params, flat.split([p.numel() for p in lora_params])):
        p.grad.copy_(g.view_as(p))
    loss_value = float(all_reduce(torch.tensor(loss_sum, device=device)))
    return loss_value, join_stats(stats, flat)


def lr_at(step, *, lr, max_steps, warmup_steps=0, min_lr=0.0):
    """Learning rate of optimizer step `step` (0-based, 0 .. max_steps - 1)."""
    # 1) linear warmup: lr * (step + 1) / warmup_steps, so the first step moves the weights
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    # 2) cosine decay: min_lr + (lr - min_lr) (1 + cos(pi progress)) / 2, reaching min_lr
    #    at max_steps
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


# =============================================================================
# PART 2: THE RUN
# =============================================================================

# -----------------------------------------------------------------------------
# Config: every hyper-parameter with its range; the defaults are the recipe's

def checked(kind, ok, rule):
    """An argparse type: the text read as `kind`, refused unless ok(value)."""
    def parse(text):
        value = kind(text)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value
    parse.__name__ = kind.__name__  # for argparse's own "invalid int value" sentence
    return parse


AT_LEAST_1 = checked(int, lambda v: v >= 1, "at least 1")
AT_LEAST_0 = checked(int, lambda v: v >= 0, "0 or more")
POSITIVE = checked(float, lambda v: v > 0, "positive")
NON_NEGATIVE = checked(float, lambda v: v >= 0, "0 or more")
SHARE = checked(float, lambda v: 0 < v <= 1, "in (0, 1]")


def check_flags(args):
    """The rules that relate several flags (each flag's own range is its type)."""
    if args.ema_decay is not None and args.teacher != "ema":
        fail("--ema-decay needs --teacher ema.")
    if args.skip_first_tokens >= args.max_new_tokens:
        fail("--skip-first-tokens must lie in [0, --max-new-tokens).")
    if args.min_lr > args.lr:
        fail("--min-lr must lie in [0, --lr].")
    if args.warmup_steps >= args.max_steps:
        fail("--warmup-steps must lie in [0, --max-steps).")
    if args.prompts_per_step % (WORLD_SIZE * args.micro_batch_size):
        fail(f"--prompts-per-step {args.prompts_per_step} must be divisible by ranks x "
             f"--micro-batch-size = {WORLD_SIZE} x {args.micro_batch_size}.")
    if args.wandb_project and not importlib.util.find_spec("wandb"):
        fail("--wandb-project needs wandb: pip install wandb")


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="opsd.py", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="On-Policy Self-Distillation with LoRA and vLLM rollouts.")
    p.error = fail  # argparse's refusals in the one sentence of every other
    on_off = argparse.BooleanOptionalAction
    g = p.add_argument_group("model")
    g.add_argument("--model", default="Qwen/Qwen3-1.7B")
    g.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    g.add_argument("--lora-r", type=AT_LEAST_1, default=64)
    g.add_argument("--lora-alpha", type=POSITIVE, default=128)
    g.add_argument("--teacher", default="base", choices=["base", "current", "ema"],
                   help="base: LoRA off; current: the student; ema: its EMA")
    g.add_argument("--ema-decay", type=checked(float, lambda v: 0 < v < 1, "in (0, 1)"),
                   help="ema's decay (0.999)")
    g.add_argument("--gradient-checkpointing", action=on_off, default=True)
    g = p.add_argument_group("data and prompts")
    g.add_argument("--dataset", default="siyanzhao/Openthoughts_math_30k_opsd")
    g.add_argument("--dataset-split", default="train")
    g.add_argument("--problem-column", default="problem")
    g.add_argument("--context-column", default="solution", help="a,b joins two columns")
    g.add_argument("--data-select", default="all", choices=["all", "hard"])
    g.add_argument("--teacher-context", default="reference", choices=TEACHER_CONTEXTS,
                   help="what the teacher is shown: the row's reference, none, another "
                        "row's, or the reference's final answer")
    g.add_argument("--student-prompt", default="recipe", choices=["recipe", "eval"],
                   help="eval: eval.py's prompt")
    g.add_argument("--student-thinking", action=on_off, default=False)
    g.add_argument("--teacher-thinking", action=on_off, default=True)
    g.add_argument("--max-prompt-length", type=AT_LEAST_1, default=2048)
    g = p.add_argument_group("sampling (vLLM)")
    g.add_argument("--max-new-tokens", type=AT_LEAST_1, default=1024)
    g.add_argument("--temperature", default=1.1,
                   type=checked(float, lambda v: 0 < v <= 2, "in (0, 2], vLLM's range"))
    g.add_argument("--top-p", type=SHARE, default=0.95)
    g.add_argument("--top-k", default=20,
                   type=checked(int, lambda v: v == -1 or v >= 1, "-1 (off) or at least 1"))
    g.add_argument("--vllm-memory", type=SHARE, default=0.3, help="of each GPU")
    g = p.add_argument_group("loss")
    g.add_argument("--clip", default="entry", choices=CLIP_MODES,
                   help="entry: min(d_v, tau); token: min(k, tau)")
    g.add_argument("--tau", type=POSITIVE, default=0.05)
    g.add_argument("--beta", default=0.0, help="0: forward KL, 1: reverse KL",
                   type=checked(float, lambda v: 0 <= v <= 1, "in [0, 1]"))
    g.add_argument("--loss-temperature", type=POSITIVE, default=1.1)
    g.add_argument("--skip-first-tokens", type=AT_LEAST_0, default=0,
                   help="answer positions left out of the loss")
    g.add_argument("--loss-chunk-size", type=AT_LEAST_1, default=256)
    g = p.add_argument_group("optimization")
    g.add_argument("--max-steps", type=AT_LEAST_1, default=100)
    g.add_argument("--prompts-per-step", type=AT_LEAST_1, default=32, help="all ranks")
    g.add_argument("--micro-batch-size", type=AT_LEAST_1, default=4, help="per rank")
    g.add_argument("--lr", type=POSITIVE, default=5e-6)
    g.add_argument("--min-lr", type=NON_NEGATIVE, default=0.0, help="at --max-steps")
    g.add_argument("--warmup-steps", type=AT_LEAST_0, default=0)
    g.add_argument("--max-grad-norm", type=POSITIVE, default=0.1)
    g = p.add_argument_group("run")
    g.add_argument("--output-dir", default="runs/opsd")
    g.add_argument("--seed", type=int, default=42)
    g.add_argument("--save-every", type=AT_LEAST_0, default=25, help="steps (0: never)")
    once = g.add_mutually_exclusive_group()
    once.add_argument("--resume", action="store_true", help="continue --output-dir's run")
    once.add_argument("--overwrite", action="store_true", help="replace --output-dir's run")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    g.add_argument("--collective-timeout", type=POSITIVE, default=30,
                   help="minutes a rank waits for the others")
    g.add_argument("--kl-window", type=AT_LEAST_1, default=20_000, help="answer tokens")
    g.add_argument("--log-rollouts-every", type=AT_LEAST_0, default=10)
    g.add_argument("--wandb-project")
    args = p.parse_args(argv)
    check_flags(args)
    if args.ema_decay is None:
        args.ema_decay = 0.999
    return args


# -----------------------------------------------------------------------------
# The run: main(), then how it starts (the device, the process group, the
# environment vLLM's engine needs)

def main(argv=None):
    run = {"argv": argv, "args": None, "step": None}  # for stop_cleanly's report
    with stop_cleanly(run):
        args = parse_args(argv)
        run["args"] = args
        if args.device != "cpu":
            check_cuda_build()
        device = init_distributed(args)
        out_dir = Path(args.output_dir)

        # ---- what a user can get wrong, checked before a model or vLLM loads
        with ranks_agree(device):
            resume_from, saved_identity = check_output_dir(args)
            check_model(args)
            tokenizer, prompts = load_prompts(args)
            run_identity = run_fingerprint(args, prompts, device)
            if resume_from:
                check_fingerprint(saved_identity, run_identity, resume_from)

        # ---- the model with LoRA; A is drawn from --seed, alike on every rank
        model, lora_params = load_model(args, device)
        optimizer = torch.optim.AdamW(lora_params, lr=args.lr, betas=(0.9, 0.999),
                                      weight_decay=0.0)

        # ---- the vLLM engine: every rank builds its own, all at the same time
        llm = start_engine(args, device)
        start_step = 0
        ema = None
        window = deque()  # the KL diagnostic's per-step sums, newest last
        if resume_from:
            start_step, ema, window = restore(resume_from, model, lora_params, optimizer)
            push_weights(llm, model)  # the new engine holds the base weights
            with ranks_agree(device):
                check_push(llm, model, out_dir)
            print0(f"resumed from {resume_from} at step {start_step}")
        check_same_on_every_rank(lora_params)
        tracker = None
        if RANK == 0:
            tracker = open_run(args, start_step, run_identity)
        loss_kw = {"beta": args.beta, "temperature": args.loss_temperature,
                   "clip": args.clip, "tau": args.tau, "chunk_size": args.loss_chunk_size}
        pad_id = tokenizer.pad_token_id
        if pad_id is None:
            pad_id = tokenizer.eos_token_id
        per_rank = args.prompts_per_step // WORLD_SIZE
        mine = range(RANK * per_rank, (RANK + 1) * per_rank)  # this rank's share of a step

        for step in range(start_step, args.max_steps):
            run["step"] = step
            # ---- generate: one seed per request, a function of (seed, step, request)
            t0 = time.perf_counter()
            indices = step_indices(step, args.prompts_per_step, len(prompts), args.seed)
            student_prompts = [prompts[indices[j]][0] for j in mine]
            teacher_prompts = [prompts[indices[j]][1] for j in mine]
            first_seed = args.seed * 1_000_003 + step * args.prompts_per_step
            seeds = [(first_seed + j) % 2**31 for j in mine]
            completions, sampler_logprobs = sample(llm, student_prompts, seeds, args)
            t1 = time.perf_counter()

            # ---- train: the loss over every answer token of the step, on all ranks
            loss, stats = backward_step(
                model, lora_params, student_prompts, teacher_prompts, completions,
                pad_id=pad_id, micro_batch_size=args.micro_batch_size, teacher=args.teacher,
                ema=ema, skip_first_tokens=args.skip_first_tokens, **loss_kw)
            grad_norm = torch.nn.utils.clip_grad_norm_(lora_params, args.max_grad_norm).item()
            check_finite(step, loss, grad_norm, out_dir)
            lr = lr_at(step, lr=args.lr, max_steps=args.max_steps,
                       warmup_steps=args.warmup_steps, min_lr=args.min_lr)
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if args.teacher == "ema":
                ema = ema_update(ema, lora_params, args.ema_decay)
            t2 = time.perf_counter()

            # ---- update the inference engine's weights, and read them back
            push_weights(llm, model)
            with ranks_agree(device):
                check_push(llm, model, out_dir)
            t3 = time.perf_counter()

            # ---- log: the KL diagnostic over its window; the gap over this step
            sums = diagnostic_sums(stats, sampler_logprobs, args.tau)
            window.append({key: sums[key] for key in WINDOW_KEYS})
            record = {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                      **kl_window_means(window, args.kl_window),
                      "logprob_gap_mean": sums["gap"] / max(sums["tokens"], 1),
                      "logprob_gap_max": sums["gap_max"],
                      "completion_len_mean": sums["tokens"] / args.prompts_per_step,
                      "time_sample": t1 - t0, "time_train": t2 - t1, "time_push": t3 - t2,
                      "tokens_per_second": sums["tokens"] / (t3 - t0)}
            if RANK == 0:
                rollouts = rollout_records(args, step, indices, mine, completions, stats.kl,
                                           tokenizer)
                log_step(args, record, rollouts, tracker)

            # ---- checkpoint (the last step writes final/ instead)
            due = args.save_every and (step + 1) % args.save_every == 0
            if due and step + 1 < args.max_steps:
                if RANK == 0:
                    state = {"step": step + 1, "optimizer": optimizer.state_dict(),
                             "kl_window": list(window)}
                    save_run_state(out_dir, model, lora_params, ema, args, state)
                all_reduce(torch.zeros(1, device=device))  # no rank runs ahead of it

        # ---- the end: the final adapter (and the EMA teacher's) in PEFT's layout
        if RANK == 0:
            save_run_state(out_dir, model, lora_params, ema, args)
            print(f"final adapter -> {out_dir / 'final'}")
            if tracker:
                tracker.finish()
        all_reduce(torch.zeros(1, device=device))  # every rank waits for the adapter
        stop_engine(llm)
    if dist.is_initialized():
        dist.destroy_process_group()


def choose_attention_kernels():
    """SDPA's flash, memory-efficient and math kernels, not cuDNN's: it returns NaN
    for a row whose keys are all masked (vLLM chooses alike)."""
    torch.backends.cuda.enable_flash_sdp(True)
    torch.backends.cuda.enable_mem_efficient_sdp(True)
    torch.backends.cuda.enable_math_sdp(True)
    torch.backends.cuda.enable_cudnn_sdp(False)


# What the push needs, whatever was exported: the engine in this process (no other
# can take the weights' generator); float32 matmuls without TF32 (for the read-back)
PUSH_ENVIRONMENT = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                    "VLLM_FLOAT32_MATMUL_PRECISION": "highest"}


def init_distributed(args):
    """The device; under torchrun, the process group (NCCL on GPUs, gloo on CPUs);
    then the environment vLLM's engine must see."""
    use_cuda = args.device != "cpu" and torch.cuda.is_available()
    device = torch.device("cpu")
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)  # vLLM builds its engine on it
    choose_attention_kernels()
    if WORLD_SIZE > 1:
        backend = "gloo"
        if use_cuda:
            backend = "nccl"
        dist.init_process_group(backend, timeout=timedelta(minutes=args.collective_timeout))
    os.environ.update(PUSH_ENVIRONMENT)
    torch.set_float32_matmul_precision("highest")
    engine_environment(cpu=not use_cuda)
    return device


# -----------------------------------------------------------------------------
# Data: a local JSON, JSONL or Parquet file, or a hub dataset

def load_prompts(args):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    rows = load_rows(args.dataset, args.dataset_split, args.problem_column,
                     args.context_column, args.data_select)
    rows = shown_contexts(rows, args.teacher_context, args.seed)
    prompts = build_prompts(tokenizer, rows, student_thinking=args.student_thinking,
                            teacher_thinking=args.teacher_thinking,
                            max_prompt_length=args.max_prompt_length,
                            student_prompt=args.student_prompt)
    return tokenizer, prompts


def load_rows(dataset, split, problem_column, context_column, data_select="all"):
    """[(problem, privileged context)] after the --data-select rule. `context_column`
    may name columns as a,b: their texts are joined by a blank line, in that order."""
    label = f"--dataset {dataset}"
    rows = read_table(dataset, split, label)
    if not rows:
        fail(f"{label} holds no rows.")
    context_columns = [c.strip() for c in context_column.split(",")]
    if not all(context_columns):
        fail(f"--context-column {context_column!r}: an empty column name; give one "
             "column, or columns as a,b.")
    check_columns(rows, label, "--problem-column", str, problem_column)
    check_columns(rows, label, "--context-column", str, *context_columns)
    if data_select == "hard":
        rows = select_hard(rows, label)
    return [(row[problem_column], "\n\n".join(row[c] for c in context_columns))
            for row in rows]


def read_table(source, split, label):
    """Rows (dicts) of a local .json, .jsonl or .parquet file, or of a hub dataset's
    split; `label` names the source."""
    path = Path(source).expanduser()
    if not path.is_file():
        if local_path(source):
            fail(f"{label}: no such file.")
        from datasets import load_dataset
        try:
            return [dict(row) for row in load_dataset(source, split=split)]
        except Exception as e:  # the hub's many failures all mean one thing here
            fail(f"{label}: cannot load split {split!r} from the hub "
                 f"({str(e).splitlines()[0]}); without network, use a local copy.")
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq
        return pq.read_table(path).to_pylist()
    if path.suffix.lower() not in (".json", ".jsonl"):
        fail(f"{label}: a local file must be .json, .jsonl or .parquet.")
    text = path.read_text()
    chunks = enumerate(text.splitlines(), 1)  # a JSON object a line, or one array
    if text.lstrip().startswith("["):
        chunks = [(1, text)]
    rows = []
    for number, chunk in chunks:
        if not chunk.strip():
            continue
        try:
            value = json.loads(chunk)
        except json.JSONDecodeError as e:
            fail(f"{label}, line {number + e.lineno - 1}: not valid JSON ({e.msg}).")
        if isinstance(value, list):
            rows.extend(value)
        else:
            rows.append(value)
    if not all(isinstance(row, dict) for row in rows):
        fail(f"{label}: every row must be a JSON object.")
    return rows


def check_columns(rows, source, needed_by, kinds, *columns):
    """Every row holds each of `columns`, a value of `kinds` (a bool is no number),
    else a refusal naming the column or row, and the flag `needed_by`."""
    for column in columns:
        if column not in rows[0]:
            fail(f"{source} has no column {column!r} ({needed_by}); its columns are "
                 f"{list(rows[0])}.")
    if not isinstance(kinds, tuple):
        kinds = (kinds,)
    noun = " or ".join(dict.fromkeys({str: "a string"}.get(k, "a number") for k in kinds))
    for number, row in enumerate(rows, 1):
        for column in columns:
            value = row.get(column)
            if not isinstance(value, kinds) or isinstance(value, bool):
                fail(f"{source}, row {number}: {column!r} is {value!r}, not {noun}.")


def select_hard(rows, label):
    """The researcher's `hard` selection, where teacher and student disagree: 1) drop
    the rows whose source is 'math' (their KL is near zero); 2) keep the rows whose
    generated_token_count is at least the element at len // 2 of the sorted counts."""
    check_columns(rows, label, "--data-select hard", str, "source")
    check_columns(rows, label, "--data-select hard", (int, float), "generated_token_count")
    kept = [r for r in rows if r["source"] != "math"]
    if not kept:
        fail(f"--data-select hard: every row of {label} has source 'math'.")
    threshold = sorted(r["generated_token_count"] for r in kept)[len(kept) // 2]
    kept = [r for r in kept if r["generated_token_count"] >= threshold]
    print0(f"data-select hard: {len(rows)} rows -> {len(kept)} (source != 'math', "
           f"generated_token_count >= {threshold})")
    return kept


# -----------------------------------------------------------------------------
# Model, adapters and checkpoints: adapters in PEFT's layout; checkpoints written
# aside, then renamed, never half-written

def load_model(args, device):
    """The model with LoRA on all seven projections, once its logits check out."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
    model = model.to(device)
    disable_dropout(model)
    problem = check_logits_path(model)
    if problem:
        fail(f"--model {args.model} ({model.config.model_type}) is not supported: {problem}.")
    lora_params = add_lora(model, args.lora_r, args.lora_alpha, seed=args.seed)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()  # for gradient checkpointing; dropout is off
    return model, lora_params


def disable_dropout(model):
    """No dropout, as in the recipe; train() would switch it on."""
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        elif isinstance(getattr(m, "attention_dropout", None), float):  # attention's own
            m.attention_dropout = 0.0


ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def adapter_parameters(model):
    """{name in adapter_model.safetensors: parameter}, A and B of every LoRA layer."""
    names = {}
    for name, m in lora_layers(model).items():
        names[f"base_model.model.{name}.lora_A.weight"] = m.lora_A
        names[f"base_model.model.{name}.lora_B.weight"] = m.lora_B
    return names


def save_adapter(model, out_dir, base_model_name_or_path):
    """The adapter in PEFT's layout, which PEFT, vLLM and eval.py read."""
    layers = lora_layers(model)
    tensors = {name: p.detach().cpu().contiguous()
               for name, p in adapter_parameters(model).items()}
    first = next(iter(layers.values()))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM",
              "base_model_name_or_path": str(base_model_name_or_path), "r": first.r,
              "lora_alpha": first.alpha, "lora_dropout": 0.0, "bias": "none",
              "fan_in_fan_out": False, "inference_mode": True,
              "target_modules": sorted({name.rsplit(".", 1)[-1] for name in layers})}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / ADAPTER_WEIGHTS))
    (out_dir / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")


@torch.no_grad()
def load_adapter(model, adapter_dir):
    tensors = load_file(str(Path(adapter_dir) / ADAPTER_WEIGHTS))
    for name, p in adapter_parameters(model).items():
        p.copy_(tensors[name])


def restore(checkpoint, model, lora_params, optimizer):
    """Load a checkpoint into the model and the optimizer; return (step, the EMA
    teacher's LoRA or None, the KL window)."""
    state = torch.load(checkpoint / "trainer_state.pt", map_location="cpu", weights_only=True)
    optimizer.load_state_dict(state["optimizer"])  # moved to the parameters' device
    ema = None
    if (checkpoint / "ema").is_dir():
        load_adapter(model, checkpoint / "ema")
        ema = [p.detach().clone() for p in lora_params]
    load_adapter(model, checkpoint)
    return state["step"], ema, deque(state["kl_window"])


def save_run_state(out_dir, model, lora_params, ema, args, state=None):
    """checkpoint-<step>/ (given `state`) or final/: the adapter, the EMA teacher's
    in ema/, the step, optimizer and KL window. No RNG state: the data order and the
    sampling seeds are functions of (seed, step)."""
    name = "final"
    if state:
        name = f"checkpoint-{state['step']}"
    final_dir = Path(out_dir) / name
    tmp = final_dir.with_name(f".tmp-{name}")
    shutil.rmtree(tmp, ignore_errors=True)
    save_adapter(model, tmp, args.model)
    if ema is not None:
        with lora_values(lora_params, ema):
            save_adapter(model, tmp / "ema", args.model)
    if state is not None:
        torch.save(state, tmp / "trainer_state.pt")
    # on disk before the rename, the rename on disk after it: a crash leaves one whole
    for path in [*tmp.rglob("*"), tmp]:
        flush(path)
    shutil.rmtree(final_dir, ignore_errors=True)
    os.rename(tmp, final_dir)
    flush(final_dir.parent)


def flush(path):
    """fsync a file, or a directory (its entries: a rename in it)."""
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


# -----------------------------------------------------------------------------
# Logs: args.json, the step line, metrics.jsonl, rollouts.jsonl; wandb when asked

def open_run(args, start_step, run_identity):
    """Rank 0: delete the old run (--overwrite); write args.json with the run's
    fingerprint; cut the logs back to the resumed step (and a line a kill cut
    short); start Weights & Biases when asked."""
    out_dir = Path(args.output_dir)
    if args.overwrite:
        for path in run_files(out_dir):
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
    out_dir.mkdir(parents=True, exist_ok=True)  # the first thing written: all checks passed
    record = {**vars(args), "fingerprint": run_identity}
    write_atomically(out_dir / "args.json", json.dumps(record, indent=2) + "\n")
    for path in (out_dir / "metrics.jsonl", out_dir / "rollouts.jsonl"):
        if path.exists():
            lines = path.read_text().splitlines()
            kept = [line + "\n" for line in lines if record_step(line) <= start_step]
            write_atomically(path, "".join(kept))
    if not args.wandb_project:
        return None
    import wandb
    return wandb.init(project=args.wandb_project, name=out_dir.name, config=vars(args),
                      dir=str(out_dir))


def record_step(line):
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):  # a line a kill cut short
        return math.inf


def write_atomically(path, text):
    tmp = path.with_name(f".tmp-{path.name}")
    tmp.write_text(text)
    flush(tmp)
    os.replace(tmp, path)


def rollout_records(args, step, indices, mine, completions, kl, tokenizer):
    """Rank 0's answers when rollouts.jsonl is due (else none), with each token's
    KL(p_T || p_S)."""
    every = args.log_rollouts_every
    last = step + 1 == args.max_steps
    if not every or not (step == 0 or (step + 1) % every == 0 or last):
        return []
    kls = kl.split([len(c) for c in completions])
    return [{"step": step + 1, "prompt_index": indices[j], "tokens": len(c),
             "completion": tokenizer.decode(c), "token_ids": c, "kl": token_kl.tolist(),
             "skipped_by_loss": min(args.skip_first_tokens, len(c))}
            for j, c, token_kl in zip(mine, completions, kls)]


GAP_ALARM = {"float32": 1e-4, "bfloat16": 5e-2}  # its floor on CPU kernels: 1e-6, 1e-2
STEP_LINE = ("step {step:4d}/{max_steps} | loss {loss:.4f} | lr {lr:.2e} | grad {grad_norm:.4f}"
             " | kl {kl_mean:.4f} >tau {kl_frac_above_tau:.1%} | len {completion_len_mean:.0f}"
             " | entropy {entropy_student:.2f}/{entropy_teacher:.2f} neg {loss_frac_negative:.1%}"
             " | sample {time_sample:.1f}s train {time_train:.1f}s push {time_push:.2f}s"
             " | {tokens_per_second:.0f} tok/s | gap {logprob_gap_mean:.1e}/{logprob_gap_max:.1e}")


def log_step(args, record, rollouts, tracker):
    """Rank 0: the step line, metrics.jsonl, rollouts.jsonl, Weights & Biases."""
    out_dir = Path(args.output_dir)
    line = STEP_LINE.format(**record, max_steps=args.max_steps)
    if record["logprob_gap_mean"] > GAP_ALARM[args.dtype]:
        line += (f" <- gap above the {args.dtype} noise floor measured on CPU: stale "
                 "weights or wrong positions?")
    print(line, flush=True)
    with open(out_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    if rollouts:
        with open(out_dir / "rollouts.jsonl", "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rollouts)
    if tracker:
        import wandb
        logged = dict(record)
        if rollouts:
            rows = [list(r.values()) for r in rollouts]
            logged["rollouts"] = wandb.Table(columns=list(rollouts[0]), data=rows)
        tracker.log(logged, step=record["step"])


# =============================================================================
# PART 3: THE GUARDS
# =============================================================================

# -----------------------------------------------------------------------------
# Output directory and resume: no run is overwritten unless asked; a resume must be
# the same run

# the flags a resume may change: how it runs or logs, not what it computes
RESUMABLE_CHANGES = ("output_dir", "resume", "overwrite", "micro_batch_size",
                     "gradient_checkpointing", "loss_chunk_size", "vllm_memory", "device",
                     "collective_timeout", "save_every", "kl_window", "log_rollouts_every",
                     "wandb_project")


def run_files(out_dir):
    """What a run leaves in its directory."""
    names = ["args.json", "metrics.jsonl", "rollouts.jsonl", "final"]
    found = [out_dir / n for n in names if (out_dir / n).exists()]
    return found + sorted(out_dir.glob("checkpoint-*"))


def latest_checkpoint(out_dir):
    steps = [int(d.name.split("-")[1]) for d in Path(out_dir).glob("checkpoint-*")
             if (d / "trainer_state.pt").exists()]
    if not steps:
        return None
    return Path(out_dir) / f"checkpoint-{max(steps)}"


def check_output_dir(args):
    """(the checkpoint to resume, its run's fingerprint), or (None, None)."""
    out_dir = Path(args.output_dir)
    # a file of this rank's, in the nearest directory that exists: nothing is made
    # before every check has passed
    nearest = next(p for p in (out_dir, *out_dir.parents) if p.exists())
    probe = nearest / f".write-test-{RANK}"
    try:
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        fail(f"--output-dir {out_dir} is not writable ({e.strerror}).")
    existing = run_files(out_dir)
    if not args.resume:
        if existing and not args.overwrite:
            names = ", ".join(p.name for p in existing[:3])
            fail(f"--output-dir {out_dir} already holds a run ({names}): pass --resume to "
                 "continue it, --overwrite to replace it, or choose another --output-dir.")
        return None, None
    if not (out_dir / "args.json").is_file():
        fail(f"--resume: {out_dir} holds no run to resume (no args.json); across nodes "
             "--output-dir must be one directory that every rank sees.")
    saved = json.loads((out_dir / "args.json").read_text())
    if "fingerprint" not in saved:
        fail(f"--resume: {out_dir / 'args.json'} records no run fingerprint (an older "
             "opsd.py): start a new --output-dir.")
    changed = ["--" + k.replace("_", "-") for k, v in vars(args).items()
               if k not in RESUMABLE_CHANGES and saved.get(k) != v]
    if changed:
        fail(f"--resume with other {', '.join(changed)} than the run in {out_dir} would "
             "change its results: use the same values, or a new --output-dir.")
    if (out_dir / "final").exists():
        fail(f"--resume: the run in {out_dir} has finished ({out_dir / 'final'} exists); "
             "nothing to resume.")
    checkpoint = latest_checkpoint(out_dir)
    if checkpoint is None:
        fail(f"--resume: {out_dir} holds no checkpoint yet; restart with --overwrite.")
    loaders = {".safetensors": load_file, ".json": lambda f: json.loads(f.read_text()),
               ".pt": lambda f: torch.load(f, map_location="cpu", weights_only=True)}
    for path in sorted(checkpoint.rglob("*.*")):  # a file a full disk cut short
        try:
            loaders[path.suffix](path)
        except Exception as e:  # each loader fails its own way
            fail(f"--resume: {path} does not load ({type(e).__name__}): delete "
                 f"{checkpoint} to resume from the checkpoint before it, or start afresh "
                 "with --overwrite.")
    return checkpoint, saved["fingerprint"]


def run_fingerprint(args, prompts, device):
    """What a resume must find unchanged: the prompts (their number and token ids fix
    every step's data), the model's files, the device type (CPU and CUDA sample
    apart)."""
    ids = hashlib.sha256()
    for student, teacher in prompts:
        ids.update(array("q", [len(student), len(teacher), *student, *teacher]).tobytes())
    return {"prompts": len(prompts), "prompt_ids_sha256": ids.hexdigest(),
            "model": model_fingerprint(args.model), "device": device.type}


def model_fingerprint(model):
    """sha256 of config.json and of each weight file's name, size and 16 spread 64 KiB
    samples (a file under 1 MiB whole); None without local weights."""
    folder = model_dir(model)
    if folder is None or not (folder / "config.json").is_file():
        return None
    weights = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin"))
    if not weights:
        return None
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    chunk = 64 << 10
    for path in weights:
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with open(path, "rb") as f:
            if size < 16 * chunk:
                digest.update(f.read())
                continue
            for k in range(16):
                f.seek(k * (size - chunk) // 15)
                digest.update(f.read(chunk))
    return digest.hexdigest()


def model_dir(model):
    """A local model's directory, or a hub model's cached snapshot; else None."""
    if Path(model).expanduser().is_dir():
        return Path(model).expanduser().resolve()
    from huggingface_hub import try_to_load_from_cache
    try:
        config = try_to_load_from_cache(model, "config.json")
    except ValueError:  # not a hub id either
        return None
    if not isinstance(config, str):
        return None
    return Path(config).parent.resolve()


def check_fingerprint(saved, current, checkpoint):
    """The run fingerprint args.json recorded (`saved`) against this run's."""
    what = {"prompts": "the number of prompts", "prompt_ids_sha256": "the prompts' token ids",
            "model": "the model's files", "device": "the device type"}
    changed = [f"{what[k]} ({saved.get(k)} -> {v})" for k, v in current.items()
               if saved.get(k) != v]
    if changed:
        fail(f"--resume: {', '.join(changed)} changed since {checkpoint} was written, so "
             "the resumed steps would differ from the run's: resume with the same data, "
             "model and device, or use a new --output-dir.")


# -----------------------------------------------------------------------------
# Model guards: logits = final hidden state @ lm_head.weight^T; LoRA on all seven
# projections of every decoder layer

def local_path(value):
    """True when `value` names a local file or directory, not a hub id (org/name)."""
    path = Path(value).expanduser()
    if path.exists() or value.startswith((".", "/", "~")) or value.count("/") > 1:
        return True
    return len(path.parts) > 1 and Path(path.parts[0]).is_dir()


def check_model(args):
    """The model's config, before its weights load: its logits, LoRA targets, size,
    context."""
    from transformers import AutoConfig, AutoModelForCausalLM
    name = f"--model {args.model}"
    if local_path(args.model) and not Path(args.model).expanduser().is_dir():
        fail(f"{name}: no such directory.")
    try:
        config = AutoConfig.from_pretrained(args.model)
    except (OSError, ValueError) as e:
        fail(f"{name}: cannot load its config ({str(e).splitlines()[0]}).")
    for field in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(config, field, None) not in (None, 1):
            fail(f"{name} ({config.model_type}) is not supported: its config sets {field} "
                 f"= {getattr(config, field)}, but the loss builds logits as "
                 "final_hidden @ lm_head.weight^T.")
    with torch.device("meta"):  # the modules without their weights
        skeleton = AutoModelForCausalLM.from_config(config)
    missing = missing_lora_targets(skeleton)
    if missing:
        fail(f"{name} ({config.model_type}): LoRA needs {', '.join(LORA_TARGETS)} in every "
             f"decoder layer, but {missing}.")
    check_device(args, skeleton.num_parameters())
    context = getattr(config, "max_position_embeddings", None)
    if context and args.max_prompt_length + args.max_new_tokens > context:
        fail(f"--max-prompt-length {args.max_prompt_length} + --max-new-tokens "
             f"{args.max_new_tokens} exceeds the model's context of {context} tokens: "
             "lower one of them.")


def missing_lora_targets(model):
    """None when every decoder layer holds each LoRA target as an nn.Linear, else
    what is missing where."""
    everywhere = set()
    by_layer = {}  # layer number -> the names of its linear layers
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            short = name.rsplit(".", 1)[-1]
            everywhere.add(short)
            number = re.search(r"\.(\d+)\.", name)
            if number:
                by_layer.setdefault(int(number[1]), set()).add(short)
    absent = [t for t in LORA_TARGETS if t not in everywhere]
    if absent:
        return (f"it has no linear layer named {', '.join(absent)}; its linear layers are "
                f"{', '.join(sorted(everywhere))}")
    lacking = {}  # the targets a layer lacks -> the layers that lack them
    for number, names in sorted(by_layer.items()):
        missing = tuple(t for t in LORA_TARGETS if t not in names)
        if missing:
            lacking.setdefault(missing, []).append(str(number))
    if not lacking:
        return None
    return "; ".join(f"layers {', '.join(layers)} lack {', '.join(targets)}"
                     for targets, layers in lacking.items())


def check_device(args, parameters):
    """--device cuda needs a GPU; --device auto trains no model above 0.1B parameters
    on a CPU."""
    if torch.cuda.is_available() or args.device == "cpu":
        return
    if args.device == "cuda":
        fail("--device cuda, but no CUDA device is visible: use --device cpu.")
    if parameters > 1e8:
        build = "a CPU-only build"
        if torch.version.cuda:
            build = f"built for CUDA {torch.version.cuda}, finds no GPU"
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
        fail(f"--device auto: no CUDA device is visible (CUDA_VISIBLE_DEVICES={visible}; "
             f"torch {torch.__version__}: {build}), and --model {args.model} has "
             f"{parameters / 1e9:.2f}B parameters, too many for a CPU: make a GPU visible, "
             "or pass --device cpu.")


def check_cuda_build():
    """A CPU build of torch on a machine with an NVIDIA GPU would run on the CPU."""
    if torch.version.cuda or not shutil.which("nvidia-smi"):
        return
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    if "GPU" in listed:
        fail(f"torch {torch.__version__} is a CPU build, but nvidia-smi lists a GPU: "
             "install the GPU build in a fresh environment (python -m venv, then "
             "pip install -r requirements.txt).")


@torch.no_grad()
def check_logits_path(model):
    """None when final_hidden @ lm_head.weight^T gives the model's logits on a 16-token
    probe, else why not (soft-capping, scaling, a bias: a silently wrong loss)."""
    if getattr(model.get_output_embeddings(), "bias", None) is not None:
        return "its lm_head has a bias"
    positions = torch.arange(16, device=model.device)[None]  # (1, 16)
    ids = (positions + 3) % model.config.vocab_size
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
              "position_ids": positions}
    W = model.get_output_embeddings().weight
    training = model.training
    try:
        model.eval()  # no dropout in either forward
        want = model(**inputs, use_cache=False).logits.float()  # (1, 16, V)
        got = (final_hidden(model, inputs) @ W.T).float()
    except (AttributeError, TypeError) as e:
        return f"its hidden states cannot be taken apart from its logits ({e})"
    finally:
        model.train(training)
    if not torch.allclose(got, want, rtol=1e-2, atol=1e-3 * float(want.abs().max())):
        return "its logits are not final_hidden @ lm_head.weight^T (soft-capping, scaling?)"
    return None


def check_same_on_every_rank(lora_params):
    """The LoRA weights' checksum alike on every rank: one MAX over ranks of
    (checksum, -checksum) gives the largest and the smallest."""
    checksum = torch.cat([p.detach().flatten() for p in lora_params]).double().sum()
    high, neg_low = all_reduce(torch.stack([checksum, -checksum]), dist.ReduceOp.MAX).tolist()
    if high != -neg_low:
        fail(f"the ranks hold different LoRA weights (checksums {-neg_low!r} to {high!r}): "
             "run the same opsd.py, torch and --seed, and resume the same files.")


# -----------------------------------------------------------------------------
# While it runs: every push read back from the engine; no update from a non-finite loss

def fingerprint(weight):
    """An exact fingerprint of a weight's bits (-0.0 as 0.0): their plain, squared and
    position-weighted sums in wrapping int64, which no summation order changes."""
    bits = (weight.detach() + 0.0).contiguous()
    bits = bits.view(getattr(torch, f"int{8 * weight.element_size()}")).flatten().long()
    position = torch.arange(1, bits.numel() + 1, device=bits.device)
    sums = (bits.sum(), (bits * bits).sum(), (bits * position).sum())
    return tuple(int(s) for s in sums)


@torch.no_grad()
def engine_fingerprints(model):
    """In vLLM's worker: {checkpoint weight name: fingerprint}. Each linear layer is
    read back through the GEMM sampling uses (on a CPU the weight lives only in a
    repacked kernel handle), applied to the identity: I W^T = W^T exactly. Stacked
    layers (qkv_proj, gate_up_proj) are split back into the checkpoint's projections."""
    from vllm.model_executor.layers.linear import LinearBase
    stacked = getattr(model, "packed_modules_mapping", {})
    prints = {}
    for name, m in model.named_modules():
        if isinstance(m, LinearBase):
            eye = torch.eye(m.input_size_per_partition, dtype=m.weight.dtype,
                            device=m.weight.device)
            parts = m.quant_method.apply(m, eye).t().split(m.output_partition_sizes)
            parent, _, short = name.rpartition(".")
            for part_name, part in zip(stacked.get(short, [short]), parts):
                prints[f"{parent}.{part_name}.weight"] = fingerprint(part)
    return prints


def check_push(llm, model, out_dir):
    """The engine holds what the push sent: each LoRA layer merged again, compared bit
    for bit with the engine's weights."""
    engine = llm.apply_model(engine_fingerprints)[0]
    for name, m in lora_layers(model).items():
        if engine.get(f"{name}.weight") != fingerprint(m.merged_weight()):
            fail(f"the weight push failed: vLLM's {name} does not hold the merged weights "
                 f"sent to it. Stopped; the last checkpoint is "
                 f"{latest_checkpoint(out_dir) or 'none'}.")


def check_finite(step, loss, grad_norm, out_dir):
    """Stop before an update that would write NaN or inf into the adapter."""
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        fail(f"step {step + 1}: non-finite loss ({loss}) or gradient norm ({grad_norm}); "
             "stopped before the update, last checkpoint: "
             f"{latest_checkpoint(out_dir) or 'none'}.")


# -----------------------------------------------------------------------------
# When a run stops early. torchrun ends a node's other ranks when one fails, and its
# report names the first failure. Done here: a refusal said once, by the rank that has
# it; after Ctrl-C, the command that resumes; after an out of memory, the flags that
# lower it; a failed rank ended without vLLM's or NCCL's teardown, which could wait.

def error_file(text):
    """Leave `text` where torchrun's report reads a rank's error (its Root Cause)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        message = {"message": text, "extraInfo": {"timestamp": int(time.time())}}
        Path(path).write_text(json.dumps({"message": message}))


def say(text):
    print(text, file=sys.stderr, flush=True)
    error_file(text)


def say_once(text):
    """A sentence every rank has: rank 0 prints it, every rank leaves it for torchrun."""
    print0(text, file=sys.stderr)
    error_file(text)


@contextmanager
def ranks_agree(device):
    """Checks each rank makes on its own, then one collective: if any refused, all
    stop. A refusal every rank made alike is said by rank 0; else each refusing rank
    says its own, after its rank, and ends first."""
    problem = None
    try:
        yield
    except Refusal as e:
        problem = str(e)
    refused = int(problem is not None)
    crc = -1
    if problem:
        crc = zlib.crc32(problem.encode())
    # one MAX over ranks: did any refuse, did all, the largest and smallest sentence
    flags = torch.tensor([refused, -refused, crc, -crc], device=device)
    any_refused, not_all, high, neg_low = all_reduce(flags, dist.ReduceOp.MAX).tolist()
    if not any_refused:
        return
    if not_all == -1 and high == -neg_low:  # every rank, the same sentence
        say_once(f"opsd.py: error: {problem}")
        raise SystemExit(2)
    if problem:
        say(f"opsd.py: error: rank {RANK}: {problem}")
        raise SystemExit(2)
    time.sleep(2)  # the refusing ranks end first, so that torchrun's report names one
    say(f"opsd.py: rank {RANK} stopped: another rank refused the run (its log says why).")
    raise SystemExit(2)


@contextmanager
def stop_cleanly(run):
    """How main() ends early (`run`: its argv, args and step). A refusal every rank
    meets alike (a flag, a non-finite loss) is said by rank 0."""
    interrupted = []

    def on_interrupt(signum, frame):
        interrupted.append(signum)
        raise KeyboardInterrupt
    previous = signal.signal(signal.SIGINT, on_interrupt)
    try:
        yield
    except Refusal as e:
        say_once(f"opsd.py: error: {e}")
        raise SystemExit(2)
    except (Exception, KeyboardInterrupt) as e:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # torchrun passes Ctrl-C on: once is enough
        where = "before the first step"
        if run["step"] is not None:
            where = f"at step {run['step'] + 1} of {run['args'].max_steps}"
        last = None
        if run["args"]:
            last = latest_checkpoint(run["args"].output_dir)
        if interrupted:
            if RANK == 0:
                say(interrupt_message(run["argv"], where, last))
            os._exit(130)
        if isinstance(e, torch.OutOfMemoryError):
            print(f"torch.OutOfMemoryError: {e}", file=sys.stderr)
            say(f"opsd.py: rank {RANK}: out of memory {where}: lower --micro-batch-size, "
                f"--loss-chunk-size or --vllm-memory; the last checkpoint is {last}.")
            os._exit(1)
        if isinstance(e, CollectiveError):
            say(f"opsd.py: rank {RANK} stopped {where}: a collective failed ({e}); if "
                f"another rank stopped first, its log says why. The last checkpoint is {last}.")
            os._exit(1)
        if WORLD_SIZE == 1:
            raise  # no other rank waits: Python's own traceback and exit
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler
        print(f"opsd.py: rank {RANK}: error {where} (the last checkpoint is {last}):\n"
              f"{traceback.format_exc()}", file=sys.stderr, flush=True)
        ErrorHandler().record_exception(e)  # the traceback, for torchrun's report
        os._exit(1)  # not through vLLM's teardown, which could wait for the others
    finally:
        signal.signal(signal.SIGINT, previous)


def interrupt_message(argv, where, last):
    """What rank 0 says after Ctrl-C: where the run stopped, and how to go on."""
    if last is None:
        return f"opsd.py: interrupted {where}; no checkpoint yet, so nothing to resume."
    flags = [a for a in argv or sys.argv[1:] if a not in ("--overwrite", "--resume")]
    launcher = "python"
    if WORLD_SIZE > 1:
        launcher = f"torchrun --nproc_per_node {WORLD_SIZE}"
    return (f"opsd.py: interrupted {where}; the last checkpoint is {last}; continue "
            f"with: {launcher} opsd.py {shlex.join(flags)} --resume")


if __name__ == "__main__":
    main()
