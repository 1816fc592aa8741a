"""
On-Policy Self-Distillation (OPSD) for LLM reasoning, in one file.

    torchrun --nproc_per_node 4 opsd.py --clip token --skip-first-tokens 1  # Qwen3-1.7B

One model plays two roles: the student sees the problem; the teacher, the same network,
also sees a reference solution. Each optimizer step:
  1. the student samples an answer to each problem with vLLM (one engine per rank);
  2. the teacher (by default the base model: LoRA off) scores that answer;
  3. at every answer position, the student's next-token distribution is pulled towards
     the teacher's with a full-vocabulary KL; only LoRA weights train;
  4. the merged LoRA weights are pushed into the running vLLM engine, in place, and read back.

Departures from the released recipe: README.md. Below: the helpers the method calls;
Part 1, the method; Part 2, the run; Part 3, the guards.
"""

import argparse
import faulthandler
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
import threading
import time
import traceback
import warnings
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

# -- Helpers the method calls

# set by torchrun; `python opsd.py` is one rank
RANK = int(os.environ.get("RANK", 0))
LOCAL_RANK = int(os.environ.get("LOCAL_RANK", 0))
WORLD_SIZE = int(os.environ.get("WORLD_SIZE", 1))


def print0(*args, **kwargs):
    if RANK == 0:
        print(*args, **kwargs, flush=True)


class Refusal(Exception):
    """A user's mistake, in one sentence."""


def fail(message):
    raise Refusal(message)


def all_reduce(tensor, op=dist.ReduceOp.SUM):
    """Sum (or `op`) over ranks."""
    if dist.is_initialized():
        dist.all_reduce(tensor, op)
    return tensor


# PART 1: THE METHOD ==========================================================

# -- Prompts: the released recipe's strings

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
TRANSITION = (
    "\n\nAfter reading the reference solution above, make sure you truly understand the "
    "reasoning behind each step \u2014 do not copy or paraphrase it. Now, using your own "
    "words and independent reasoning, derive the same final answer to the problem above. "
    "Think step by step, explore different approaches, and don't be afraid to backtrack "
    "or reconsider if something doesn't work out:\n"
)


def student_message(problem, prompt="recipe"):
    """The recipe's student message; with prompt="eval", eval.py's (no "Problem: "), so the
    student trains in the prompt it is scored in."""
    if prompt == "eval":
        return f"{problem}\n\n{INSTRUCTION}"
    return f"Problem: {problem}\n\n{INSTRUCTION}"


def teacher_message(problem, context):
    """The problem, the privileged context (a reference solution), the transition. Without a
    context (--teacher-context none), the recipe's student message, whatever --student-prompt
    is: the transition speaks of the reference, so it goes with it."""
    if context is None:
        return student_message(problem)
    return (
        f"Problem: {problem}\n\n"
        "Here is a reference solution to this problem:\n"
        "=== Reference Solution Begin ===\n"
        f"{context}\n"
        "=== Reference Solution End ===\n"
        f"{TRANSITION}\n{INSTRUCTION}"
    )


def extract_boxed(text):
    """The content of the last \\boxed{...}, braces matched, or None."""
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


TEACHER_CONTEXTS = ("reference", "none", "other", "answer")


def shown_contexts(rows, shown, seed):
    """The rows as --teacher-context shows them to the teacher."""
    if shown == "none":
        return [(problem, None) for problem, _ in rows]
    if shown == "other":  # another row's reference, alike on every rank and resume
        if len(rows) < 2:
            fail("--teacher-context other needs at least two rows: add rows to --dataset.")
        # one cycle through a seeded order: row order[i] gets row order[i + 1]'s
        order = list(range(len(rows)))
        random.Random(seed).shuffle(order)
        donor = dict(zip(order, order[1:] + order[:1]))
        return [(problem, rows[donor[i]][1]) for i, (problem, _) in enumerate(rows)]
    if shown == "answer":  # the last \boxed{} of the row's reference
        answers = []
        for number, (problem, reference) in enumerate(rows, 1):
            answer = extract_boxed(reference)
            if answer is None:
                fail(f"--teacher-context answer: row {number} ({problem[:40]!r}) has no "
                     "\\boxed{} in its reference: add one, or drop the row.")
            answers.append((problem, f"\\boxed{{{answer}}}"))
        return answers
    return rows


def render(tokenizer, message, thinking):
    chat = [{"role": "user", "content": message}]
    return tokenizer.apply_chat_template(
        chat, add_generation_prompt=True, tokenize=True, enable_thinking=thinking,
        return_dict=False)


def build_prompts(
        tokenizer, rows, *, student_thinking, teacher_thinking, max_prompt_length,
        student_prompt="recipe"):
    """[(student ids, teacher ids)] of the rows that fit max_prompt_length."""
    prompts = []
    for problem, context in rows:
        student = render(tokenizer, student_message(problem, student_prompt), student_thinking)
        teacher = render(tokenizer, teacher_message(problem, context), teacher_thinking)
        if max(len(student), len(teacher)) <= max_prompt_length:
            prompts.append((student, teacher))
    print0(f"data: {len(prompts)} prompts, {len(rows) - len(prompts)} dropped as longer "
           f"than {max_prompt_length} tokens")
    if not prompts:
        fail(f"No row fits --max-prompt-length {max_prompt_length}: raise it.")
    return prompts


def step_indices(step, prompts_per_step, num_prompts, seed):
    """Prompt indices of step `step`: each epoch a permutation seeded by seed + epoch, so the
    order is a function of (seed, step) and a resumed run needs no data-loader state."""
    positions = range(step * prompts_per_step, (step + 1) * prompts_per_step)
    orders = {}  # epoch -> its permutation, drawn once
    for epoch in {p // num_prompts for p in positions}:
        generator = torch.Generator().manual_seed(seed + epoch)
        orders[epoch] = torch.randperm(num_prompts, generator=generator).tolist()
    return [orders[p // num_prompts][p % num_prompts] for p in positions]


# -- LoRA: y = W x + (alpha / r) B A x on every attention and MLP projection

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRALinear(nn.Module):
    """A frozen linear layer plus a float32 low-rank update (an lr of 5e-6 rounds away
    in bf16). `weight` and `bias` keep vLLM's names."""

    def __init__(self, base, r, alpha, generator):
        super().__init__()
        self.weight = base.weight  # (out, in)
        self.bias = base.bias  # (out,) or None
        self.r = r
        self.alpha = alpha
        self.scale = alpha / r
        # A drawn on the CPU: every device and rank starts alike; B = 0: the base model
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
        """W + (alpha / r) B A in the model's dtype, out of place: W is never touched, so the
        fixed teacher (LoRA off) cannot drift."""
        update = self.scale * (self.lora_B @ self.lora_A)
        return (self.weight.float() + update).to(self.weight.dtype)


def lora_layers(model):
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def add_lora(model, r, alpha, seed=0, targets=LORA_TARGETS):
    """Wrap every nn.Linear named in `targets`, freeze the rest; the LoRA parameters."""
    model.requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if name in targets and isinstance(child, nn.Linear):
                setattr(module, name, LoRALinear(child, r, alpha, generator))
    return [p for m in lora_layers(model).values() for p in (m.lora_A, m.lora_B)]


@torch.no_grad()
def merged_weights(model):
    """(HF parameter name, merged weight) per LoRA layer, one at a time: never a second copy
    of the model."""
    for name, m in lora_layers(model).items():
        yield f"{name}.weight", m.merged_weight()


# -- Rollout: one vLLM engine per rank; weights pushed in place, and read back

# vLLM on a CPU: eager; no chunked prefill (it rewinds a seeded CPU generator)
CPU_ENGINE = {"enforce_eager": True, "enable_chunked_prefill": False}


def engine_environment(cpu):
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    logging.getLogger("vllm.triton_utils.importing").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", ".*reduce_op", FutureWarning)
    if cpu:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def start_engine(args, device):
    """This rank's vLLM engine, in this process (its start-up under the caller's time limit)."""
    from vllm import LLM
    max_model_len = args.max_prompt_length + args.max_new_tokens
    extra = {"gpu_memory_utilization": args.vllm_memory, "enforce_eager": args.enforce_eager}
    if device.type == "cpu":
        extra = CPU_ENGINE
    launcher = None
    if WORLD_SIZE > 1:
        launcher = "external_launcher"
    timeout = int(args.collective_timeout * 60)
    return LLM(
        model=args.model, dtype=args.dtype, max_model_len=max_model_len,
        seed=args.seed + RANK, max_num_seqs=args.prompts_per_step // WORLD_SIZE,
        max_num_batched_tokens=max(max_model_len, 8192),  # at least one whole sequence
        distributed_executor_backend=launcher, distributed_timeout_seconds=timeout,
        cpu_distributed_timeout_seconds=timeout, **extra)


def sample(llm, prompts, seeds, args):
    """Completions (token ids, with EOS when sampled) and vLLM's raw log-prob of each
    token (before temperature, top-k, top-p). A seed per request: the engine in this
    process shares torch's global RNG with training."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    params = [SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=seed,
        max_tokens=args.max_new_tokens, logprobs=0) for seed in seeds]
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    completions = []
    logprobs = []
    for out in llm.generate(requests, params, use_tqdm=False):
        tokens = list(out.outputs[0].token_ids)
        completions.append(tokens)
        logprobs.append([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens)])
    return completions, logprobs


def push_weights(llm, model):
    """The merged LoRA weights into the running engine, in place; its prefix cache
    (of the old weights) dropped. check_push, below, reads them back."""
    # all seven projections: vLLM stacks q/k/v and gate/up itself
    weights = {"weights_iterator": merged_weights(model), "is_checkpoint_format": True}
    llm.collective_rpc("reload_weights", kwargs=weights)
    llm.reset_prefix_cache()


def fingerprint(weight):
    """Exact: a weight's bits' plain, squared and position-weighted sums in wrapping int64,
    which no summation order changes."""
    # + 0.0 turns -0.0 into 0.0, as the engine's read-back (a sum of products) may
    bits = (weight.detach() + 0.0).contiguous()
    bits = bits.view(getattr(torch, f"int{8 * weight.element_size()}")).flatten().long()
    position = torch.arange(1, bits.numel() + 1, device=bits.device)
    sums = (bits.sum(), (bits * bits).sum(), (bits * position).sum())
    return tuple(int(s) for s in sums)


@torch.no_grad()
def engine_fingerprints(model):
    """In vLLM's worker: each linear layer's fingerprint, read through the GEMM sampling uses
    (on a CPU the weight lives only in a repacked kernel handle) applied to the identity:
    I W^T = W^T exactly. Stacked layers (qkv_proj, gate_up_proj) are split back."""
    from vllm.model_executor.layers.linear import LinearBase
    stacked = getattr(model, "packed_modules_mapping", {})
    prints = {}
    for name, m in model.named_modules():
        if isinstance(m, LinearBase):
            eye = torch.eye(m.input_size_per_partition).to(m.weight)
            parts = m.quant_method.apply(m, eye).t().split(m.output_partition_sizes)
            parent, _, short = name.rpartition(".")
            for part_name, part in zip(stacked.get(short, [short]), parts):
                prints[f"{parent}.{part_name}.weight"] = fingerprint(part)
    return prints


def check_push(llm, model):
    """Each LoRA layer merged again, compared bit for bit with the engine's weights."""
    engine = llm.apply_model(engine_fingerprints)[0]
    for name, m in lora_layers(model).items():
        if engine.get(f"{name}.weight") != fingerprint(m.merged_weight()):
            fail(f"the weight push failed: vLLM's {name} does not hold the merged weights "
                 "sent to it (is vllm the version requirements.txt pins?).")


def stop_engine(llm):
    llm.llm_engine.engine_core.shutdown()


# -- The teacher's weights: the base model (LoRA off), the student's, or their EMA

@contextmanager
def lora_disabled(model):
    """The base model, no copy: the released recipe's fixed teacher."""
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
    if teacher == "base":
        return lora_disabled(model)
    if teacher == "ema" and ema is not None:
        return lora_values(lora_params, ema)
    # --teacher current; and --teacher ema at step 1, before any EMA exists (as in the
    # released code): the student itself, at step 1 the base model (B = 0)
    return nullcontext()


@torch.no_grad()
def ema_update(ema, lora_params, decay):
    """The EMA teacher's LoRA after a step: ema = decay * ema + (1 - decay) * student, on A
    and B apart (B_ema A_ema, not an average of B A)."""
    # After step 1 no EMA exists yet: its first value is a copy of the student's LoRA, not
    # an average with the base's (the released code's start)
    if ema is None:
        return [p.detach().clone() for p in lora_params]
    for e, p in zip(ema, lora_params):
        e.mul_(decay).add_(p.detach(), alpha=1.0 - decay)
    return ema


# -- The loss: the batch and its shift by one, the forward, a position's divergence, a
# micro-batch's loss (plain, then in chunks), a step over micro-batches and ranks, the
# logged KL

def build_batch(prompts, completions, pad_id, device):
    """Model inputs of one micro-batch, and the mask of answer tokens (B, T).

    Each row is [prompt | completion | pads]; positions come from the attention mask,
    so each answer token sits where vLLM sampled it. Pads go last: some CUDA attention
    kernels give NaN for a left pad's all-masked query row, which spreads (0 x NaN)."""
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
    inputs = {
        "input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
    inputs = {name: x.to(device) for name, x in inputs.items()}
    return inputs, completion_mask.to(device)


def scored_positions(student_answer, teacher_answer, input_ids, skip_first_tokens):
    """The shift by one, decided here only, and the pairing of the two sides. From
    build_batch's answer masks: the student's and the teacher's masks of the outputs that
    score an answer token, (B, T_s) and (B, T_t); the answer tokens they predict (N,); and
    which of them are in the loss (N,).

    Output t (the final hidden state of token t) predicts token t + 1. In a row with a
    prompt of P tokens and an answer a_0 .. a_{L-1} at columns P .. P + L - 1, output
    P - 1 (the prompt's last token's) scores a_0, output P - 1 + j scores a_j, and the
    last output scored, P + L - 2, predicts a_{L-1} (the EOS, when sampled); output
    P + L - 1 predicts past the answer and scores nothing. E.g. the student's row
    [5, 17, 230 | 31, 32, 2]: outputs 2, 3 and 4 score 31, 32 and 2, output 5 nothing.
    The teacher's prompt is longer: in its row [5, 17, 230, 88, 9 | 31, 32, 2], outputs
    4, 5 and 6 score them. The sides pair by row and by j, never by column."""
    # Each mask moves one column left and gains a last column of False: still (B, T), its
    # column t marks output t where token t + 1 is an answer token, and the hidden states
    # need no slicing.
    student_scored = F.pad(student_answer[:, 1:], (0, 1))  # (B, T_s)
    teacher_scored = F.pad(teacher_answer[:, 1:], (0, 1))  # (B, T_t)
    # Boolean indexing lists a mask's positions row by row, each row left to right. Row r
    # of both batches holds the same answer, so both masks list a_0 .. a_{L-1}'s outputs
    # of row r, in order, after row r - 1's: position n is the same (row, j) on both
    # sides, and in the targets and in_loss below, taken from the same answer mask.
    targets = input_ids[student_answer]  # (N,) a_j
    j = (student_answer.cumsum(-1) - 1)[student_answer]  # (N,) each token's place in its answer
    return student_scored, teacher_scored, targets, j >= skip_first_tokens


def final_hidden(model, inputs):
    """(B, T, H) hidden states after the final norm: the loss makes the logits."""
    return model.base_model(**inputs, use_cache=False).last_hidden_state


def log_probs(student_logits, teacher_logits, temperature):
    """(log p_S, log p_T) at the loss temperature T, in float32: (..., V) each."""
    log_s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    log_t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    return log_s, log_t


def clipped_divergence(log_s, log_t, *, beta, clip, tau):
    """Each position's loss term k from both sides' log-probs at the loss temperature:
    (..., V) each -> (...)."""
    # per vocabulary entry v:
    #   beta = 0:  d_v = p_T(v) (log p_T(v) - log p_S(v))              forward KL(T || S)
    #   beta = 1:  d_v = p_S(v) (log p_S(v) - log p_T(v))              reverse KL(S || T)
    #   else:      d_v = beta KL_v(T || m) + (1 - beta) KL_v(S || m),  m = beta p_T + (1 - beta) p_S
    # Not a mix of the two KLs: the JSD vanishes at both ends (near 0 as beta KL(T || S),
    # near 1 as (1 - beta) KL(S || T)), so the ends are defined as those KLs.
    if beta == 0.0:
        d = log_t.exp() * (log_t - log_s)
    elif beta == 1.0:
        d = log_s.exp() * (log_s - log_t)
    else:
        log_m = torch.logaddexp(log_t + math.log(beta), log_s + math.log(1.0 - beta))
        d = beta * log_t.exp() * (log_t - log_m) + (1.0 - beta) * log_s.exp() * (log_s - log_m)
    # entry clip (the recipe's): d_v <- min(d_v, tau) before the sum; a clamped entry
    # gets no gradient
    if clip == "entry":
        d = d.clamp(max=tau)
    k = d.sum(dim=-1)  # (...) k_n = sum_v d_v
    # token clip: k_n * min(1, tau / k_n), the factor detached, written as
    # tau / max(k_n, tau). The value is min(k_n, tau); the gradient keeps the true
    # divergence's direction at every position, scaled down.
    if clip == "token":
        k = k * (tau / k.clamp(min=tau)).detach()
    return k


def plain_loss(
        student_logits, teacher_logits, num_tokens, *, temperature, beta=0.0, clip="entry",
        tau=0.05):
    """A micro-batch's loss, plainly: the scored positions' logits (N, V) each, the
    divergence at each, summed, / the step's token count; autograd gives the gradient.
    opsd_loss computes the same without holding N x V logits."""
    log_s, log_t = log_probs(student_logits, teacher_logits, temperature)
    k = clipped_divergence(log_s, log_t, beta=beta, clip=clip, tau=tau)  # (N,)
    return k.sum() / num_tokens


class PositionStats(NamedTuple):
    """What is logged of each answer position, (N,) each, whatever --beta and --clip;
    all but `logprob` at the loss temperature."""
    # KL(p_T || p_S), unclipped: sum_v of the forward-KL terms d_v. The logged kl_mean is
    # its mean over every answer position of the newest steps that hold --kl-window
    # tokens, all ranks, the positions --skip-first-tokens leaves out of the loss included
    kl: torch.Tensor
    # the teacher's mass on the entries whose forward-KL term d_v exceeds tau: what an
    # entry clip at tau would clamp, computed whatever --clip and --beta are
    clipped_mass: torch.Tensor
    logprob: torch.Tensor  # the student's raw log-prob of the sampled token (as vLLM's)
    student_entropy: torch.Tensor  # H(p_S) = -sum_v p_S(v) log p_S(v)
    teacher_entropy: torch.Tensor  # H(p_T)
    # 1 where the loss term is below -1e-6 (the entry clip's), else 0; the logged
    # loss_frac_negative is its share of the positions in the loss
    negative: torch.Tensor
    in_loss: torch.Tensor  # 1 in the loss, 0 where --skip-first-tokens leaves the position out


@torch.no_grad()
def divergence_stats(student_logits, log_s, log_t, targets, terms, in_loss, *, tau):
    """PositionStats from the student's raw logits (C, V), both log-probs at the loss
    temperature (C, V), the sampled tokens (C,), the loss terms (C,) and which positions
    are in the loss (C,)."""
    raw = student_logits.float()
    logprob = raw.gather(-1, targets[:, None])[:, 0] - raw.logsumexp(-1)
    p_t = log_t.exp()  # (C, V)
    d = p_t * (log_t - log_s)  # (C, V) forward-KL terms
    clipped_mass = (p_t * (d > tau)).sum(-1)
    student_entropy = -(log_s.exp() * log_s).sum(-1)
    teacher_entropy = -(p_t * log_t).sum(-1)
    negative = (terms < -1e-6).float()  # float32's rounding of a zero term is not negative
    return PositionStats(
        d.sum(-1), clipped_mass, logprob, student_entropy, teacher_entropy, negative, in_loss)


def join_stats(stats):
    return PositionStats(*(torch.cat(parts) for parts in zip(*stats)))


def opsd_loss(
        student_hidden, student_scored, teacher_hidden, teacher_scored, lm_head_weight,
        num_tokens, targets=None, *, temperature, loss_positions=None, beta=0.0, clip="entry",
        tau=0.05, chunk_size=256):
    """(loss, stats) of one micro-batch: plain_loss's value and gradient over the
    positions in the loss, in chunks.

    Hidden states come before the frozen lm_head, the student's (B, T_s, H) with its mask
    (B, T_s), the teacher's (B, T_t, H) with (B, T_t): scored_positions's masks, which
    select the N outputs that predict an answer token, paired. loss = the sum of the N loss
    terms / num_tokens, the step's count over micro-batches and ranks. `temperature` is the
    loss's T, the caller's to give (the recipe's is 1.1). `loss_positions` (N,) is 0 where
    --skip-first-tokens leaves a position out; `targets` (N,), the sampled tokens, asks
    for `stats`, the PositionStats of all N positions."""
    hs = student_hidden[student_scored]  # (N, H)
    ht = teacher_hidden[teacher_scored].detach()  # (N, H)
    N = hs.shape[0]
    in_loss = torch.ones(N, device=hs.device)  # (N,) 1: in the loss, 0: left out
    if loss_positions is not None:
        in_loss = loss_positions.float()
    W = lm_head_weight.detach()  # (V, H)
    need_grad = torch.is_grad_enabled() and hs.requires_grad
    total = hs.new_zeros((), dtype=torch.float32)
    grads = []
    stats = []
    # Chunks, for memory: logits exist for chunk_size positions at a time (C x V, never
    # N x V); each chunk's gradient for its hidden states is taken while they exist.
    for i in range(0, N, chunk_size):
        h = hs[i:i + chunk_size].detach().requires_grad_(need_grad)  # (C, H)
        teacher_logits = ht[i:i + chunk_size] @ W.T  # (C, V)
        with torch.enable_grad() if need_grad else nullcontext():
            student_logits = h @ W.T  # (C, V)
            log_s, log_t = log_probs(student_logits, teacher_logits, temperature)
            k = clipped_divergence(log_s, log_t, beta=beta, clip=clip, tau=tau)  # (C,)
            k = k * in_loss[i:i + chunk_size]  # a position left out adds nothing, nor gradient
            if need_grad:
                grads.append(torch.autograd.grad(k.sum(), h)[0])  # (C, H)
        total = total + k.detach().sum()
        if targets is not None:
            stats.append(divergence_stats(
                student_logits.detach(), log_s.detach(), log_t.detach(),
                targets[i:i + chunk_size], k.detach(), in_loss[i:i + chunk_size], tau=tau))
    loss = total / max(num_tokens, 1)
    # Value and gradient are plain_loss's. The loss reaches the weights only through hs (W
    # frozen, the teacher detached), so by the chain rule backward needs only
    # d loss / d hs = grad / num_tokens, which the chunks computed: surrogate =
    # sum(hs * grad) / num_tokens has that gradient, and surrogate - surrogate.detach()
    # adds it at value 0 (tests/test_loss.py: test_chunked_equals_unchunked_value_and_gradient).
    # Built with no positions too, so backward runs on every rank.
    if need_grad:
        grad = torch.zeros_like(hs)  # (N, H) d sum_n k_n / d hs
        if grads:
            grad = torch.cat(grads)
        surrogate = (hs * grad).sum() / max(num_tokens, 1)
        loss = loss + (surrogate - surrogate.detach())
    if targets is None:
        return loss, None
    return loss, join_stats(stats)


def backward_step(
        model, lora_params, student_prompts, teacher_prompts, completions, *, pad_id,
        micro_batch_size, teacher, ema=None, skip_first_tokens=0, **loss_kw):
    """(the step's loss, PositionStats of this rank's answer positions in order); the
    gradient, summed over ranks, in the LoRA parameters' .grad. Each micro-batch's
    loss is divided by the step's token count over micro-batches and ranks (less
    `skip_first_tokens` per answer): one big batch's gradient. `loss_kw` goes to opsd_loss:
    its temperature, clip, tau, beta and chunk_size."""
    device = lora_params[0].device
    lm_head = model.get_output_embeddings().weight  # (V, H), frozen
    loss_tokens = sum(max(0, len(c) - skip_first_tokens) for c in completions)
    num_tokens = int(all_reduce(torch.tensor(loss_tokens, device=device)))
    loss_sum = 0.0
    stats = []
    for first in range(0, len(completions), micro_batch_size):
        rows = slice(first, first + micro_batch_size)
        answers = completions[rows]
        student_inputs, student_answer = build_batch(
            student_prompts[rows], answers, pad_id, device)
        teacher_inputs, teacher_answer = build_batch(
            teacher_prompts[rows], answers, pad_id, device)
        student_scored, teacher_scored, targets, in_loss = scored_positions(
            student_answer, teacher_answer, student_inputs["input_ids"], skip_first_tokens)
        with torch.no_grad(), teacher_weights(model, lora_params, teacher, ema):
            teacher_hidden = final_hidden(model, teacher_inputs)  # (B, T_teacher, H)
        student_hidden = final_hidden(model, student_inputs)  # (B, T_student, H)
        loss, micro_stats = opsd_loss(
            student_hidden, student_scored, teacher_hidden, teacher_scored, lm_head,
            num_tokens, targets, loss_positions=in_loss, **loss_kw)
        loss.backward()
        loss_sum += loss.item()
        stats.append(micro_stats)
    # One collective for all LoRA gradients: a sum over ranks, not DDP's mean. Each rank's
    # loss is already divided by num_tokens, the count over all ranks, so the ranks'
    # gradients add up to one batch's; a mean would divide by the number of ranks again.
    flat = all_reduce(torch.cat([p.grad.flatten() for p in lora_params]))
    for p, g in zip(lora_params, flat.split([p.numel() for p in lora_params])):
        p.grad.copy_(g.view_as(p))
    loss_value = float(all_reduce(torch.tensor(loss_sum, device=device)))
    return loss_value, join_stats(stats)


def diagnostic_sums(stats, sampler_logprobs, tau):
    """This step's sums over all ranks, from this rank's PositionStats and vLLM's
    log-probs of its tokens."""
    kl = stats.kl
    gap = (stats.logprob - torch.tensor(sum(sampler_logprobs, []), device=kl.device)).abs()
    lengths = [len(lp) for lp in sampler_logprobs]
    starts = [sum(lengths[:i]) for i, n in enumerate(lengths) if n]  # first positions
    local = {
        "tokens": len(kl), "kl": kl.sum(), "above_tau": (kl > tau).sum(),
        "clipped_mass": stats.clipped_mass.sum(), "first_kl": kl[starts].sum(),
        "first_tokens": len(starts), "gap": gap.sum(),
        "student_entropy": stats.student_entropy.sum(),
        "teacher_entropy": stats.teacher_entropy.sum(), "negative": stats.negative.sum(),
        "loss_tokens": stats.in_loss.sum()}
    values = torch.tensor([float(v) for v in local.values()], device=kl.device)
    sums = dict(zip(local, all_reduce(values).tolist()))
    gap_max = torch.cat([gap, gap.new_zeros(1)]).max()  # 0 without positions
    sums["gap_max"] = float(all_reduce(gap_max, dist.ReduceOp.MAX))
    return sums


def kl_window_means(window, kl_window):
    """The logged means (PositionStats defines each) over the newest whole steps that
    hold `kl_window` tokens; older steps leave `window`."""
    while len(window) > 1 and sum(w["tokens"] for w in list(window)[1:]) >= kl_window:
        window.popleft()
    w = {key: sum(step_sums[key] for step_sums in window) for key in window[-1]}
    tokens = max(w["tokens"], 1)
    return {
        "kl_mean": w["kl"] / tokens, "kl_frac_above_tau": w["above_tau"] / tokens,
        "kl_clipped_teacher_mass": w["clipped_mass"] / tokens,
        "kl_first_token": w["first_kl"] / max(w["first_tokens"], 1),
        "entropy_student": w["student_entropy"] / tokens,
        "entropy_teacher": w["teacher_entropy"] / tokens,
        "loss_frac_negative": w["negative"] / max(w["loss_tokens"], 1),
        "kl_window_tokens": int(w["tokens"])}


# -- The learning-rate schedule

def lr_at(step, *, lr, max_steps, warmup_steps=0, min_lr=0.0):
    """Learning rate of step `step`, 0-based."""
    # 1) linear warmup: lr * (step + 1) / warmup_steps, so the first step moves the weights
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    # 2) cosine decay: min_lr + (lr - min_lr) (1 + cos(pi progress)) / 2. Progress would
    #    reach 1 (min_lr) at step max_steps, one past the last: no step runs at min_lr.
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


# PART 2: THE RUN =============================================================

# -- Config: the defaults are the released recipe's

def check_flags(args):
    """What would fail late or run wrongly, said before anything loads."""
    positive = (
        "lora_r", "lora_alpha", "max_prompt_length", "max_new_tokens", "tau",
        "loss_temperature", "loss_chunk_size", "max_steps", "prompts_per_step",
        "micro_batch_size", "lr", "max_grad_norm", "collective_timeout")
    for name in positive:
        if getattr(args, name) <= 0:
            fail(f"--{name.replace('_', '-')} must be positive.")
    # ranges (vLLM checks its own at the first step)
    ranges = [
        ("--top-p", 0 < args.top_p <= 1, "(0, 1]"),
        ("--vllm-memory", 0 < args.vllm_memory <= 1, "(0, 1]"),
        ("--temperature", 0 < args.temperature <= 2, "(0, 2]"),
        ("--beta", 0 <= args.beta <= 1, "[0, 1]"),
        ("--ema-decay", 0 < args.ema_decay < 1, "(0, 1)"),
        ("--skip-first-tokens", 0 <= args.skip_first_tokens < args.max_new_tokens,
         "[0, --max-new-tokens)"),
        ("--min-lr", 0 <= args.min_lr <= args.lr, "[0, --lr]"),
        ("--warmup-steps", 0 <= args.warmup_steps < args.max_steps, "[0, --max-steps)")]
    for flag, within, interval in ranges:
        if not within:
            fail(f"{flag} must lie in {interval}.")
    if args.top_k == 0 or args.top_k < -1:
        fail("--top-k must be -1 (off) or at least 1.")
    if args.prompts_per_step % (WORLD_SIZE * args.micro_batch_size):
        fail(f"--prompts-per-step {args.prompts_per_step} must be divisible by ranks x "
             f"--micro-batch-size = {WORLD_SIZE} x {args.micro_batch_size}.")


COLLECTIVE_TIMEOUT = 30.0  # minutes; also the start's while the flags are refused


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="opsd.py", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="On-Policy Self-Distillation. Defaults: the released recipe for Qwen3-1.7B; "
        "recommended: --clip token --skip-first-tokens 1.")

    p.error = fail  # argparse's refusals, as one sentence

    def add(flag, default, help, **kwargs):  # typed by its default; a bool: on/off
        if isinstance(default, bool):
            kwargs["action"] = argparse.BooleanOptionalAction
        elif default is not None:
            kwargs["type"] = type(default)
        p.add_argument(flag, default=default, help=help, **kwargs)

    add("--model", "Qwen/Qwen3-1.7B", "hub id or local directory")
    add("--dtype", "bfloat16", "of the weights; LoRA and the loss are float32",
        choices=["bfloat16", "float32"])
    add("--lora-r", 64, "LoRA's rank")
    add("--lora-alpha", 128.0, "LoRA's scale is alpha / r")
    add("--teacher", "base", "base: LoRA off; current: the student; ema: its EMA",
        choices=["base", "current", "ema"])
    add("--ema-decay", 0.999, "the EMA teacher's decay (--teacher ema)")
    add("--gradient-checkpointing", True, "less memory, more time")
    add("--dataset", "siyanzhao/Openthoughts_math_30k_opsd", "hub id, or a local .json, .jsonl "
        "or .parquet file")
    add("--dataset-split", "train", "of a hub dataset")
    add("--problem-column", "problem", "the problem, a string")
    add("--context-column", "solution", "the teacher's reference, a string; a,b joins two "
        "columns")
    add("--data-select", "all", "hard: no source 'math', the longer half by "
        "generated_token_count", choices=["all", "hard"])
    add("--teacher-context", "reference", "what the teacher is shown: its row's reference, none, "
        "another row's, or its \\boxed{} answer", choices=TEACHER_CONTEXTS)
    add("--student-prompt", "recipe", "recipe: 'Problem: ...'; eval: eval.py's prompt",
        choices=["recipe", "eval"])
    add("--student-thinking", False, "the chat template's enable_thinking")
    add("--teacher-thinking", True, "the chat template's enable_thinking")
    add("--max-prompt-length", 2048, "tokens; longer rows are dropped")
    add("--max-new-tokens", 1024, "an answer's longest")
    add("--temperature", 1.1, "vLLM's sampling temperature")
    add("--top-p", 0.95, "vLLM's nucleus sampling")
    add("--top-k", 20, "vLLM's top-k sampling; -1: off")
    add("--vllm-memory", 0.3, "share of each GPU's")
    add("--enforce-eager", False, "vLLM without CUDA graphs or torch.compile: a slower engine "
        "to fall back on if they fail")
    add("--clip", "entry", "entry: the recipe's min(d_v, tau); token: min(k, tau), "
        "recommended", choices=["entry", "token", "none"])
    add("--tau", 0.05, "the clip's threshold")
    add("--beta", 0.0, "0: forward KL, 1: reverse, between: a JSD (zero at both ends)")
    add("--loss-temperature", 1.1, "the loss divides logits by it")
    add("--skip-first-tokens", 0, "answer positions left out of the loss (not out of the logged "
        "kl); recommended: 1")
    add("--loss-chunk-size", 256, "positions whose logits exist at once")
    add("--max-steps", 100, "optimizer steps")
    add("--prompts-per-step", 32, "prompts per optimizer step, all ranks")
    add("--micro-batch-size", 4, "prompts, per rank")
    add("--lr", 5e-6, "AdamW's peak learning rate")
    add("--min-lr", 0.0, "the cosine's floor, which no step reaches")
    add("--warmup-steps", 0, "linear warmup")
    add("--max-grad-norm", 0.1, "gradient clipping")
    add("--output-dir", "runs/opsd", "one run's directory")
    add("--seed", 42, "data order, sampling, LoRA's A")
    add("--save-every", 25, "steps; 0: never")
    once = p.add_mutually_exclusive_group()
    once.add_argument("--resume", action="store_true", help="continue --output-dir's run")
    once.add_argument("--overwrite", action="store_true", help="replace --output-dir's run")
    add("--device", "auto", "auto: CUDA when torch sees it; a CUDA build that sees none is "
        "refused", choices=["auto", "cpu", "cuda"])
    add("--collective-timeout", COLLECTIVE_TIMEOUT, "T, minutes: the most each start-up phase may "
        "take (healthy: minutes; a first 8B download in the model's load needs 9 MB/s), and each "
        "wait for other ranks (1.1 T at an agreement)")
    add("--kl-window", 20_000, "answer tokens the logged means span")
    add("--log-rollouts-every", 10, "steps; rank 0's answers to rollouts.jsonl; 0: never")
    add("--wandb-project", None, "also log to wandb (pip install wandb)")

    args = p.parse_args(argv)
    check_flags(args)
    return args


# -- The run

def main(argv=None):
    flags = list(argv or sys.argv[1:])
    again = [flag for flag in flags if flag not in ("--overwrite", "--resume")]
    # the commands a stop prints, made before vLLM starts; "again" once this run has written
    run = {"resume": launch_command(again + ["--resume"]), "again": launch_command(flags),
           "args": None, "step": None}
    with stop_cleanly(run):
        train(argv, run)
    # The run is finished: its files are written and closed, its engine stopped. The
    # interpreter's teardown of torch and vLLM would add seconds and do nothing for it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def train(argv, run):
    args, tokenizer, prompts, model, lora_params, optimizer, llm, tracker, resumed = start_up(
        argv, run)
    start_step, ema, window = resumed
    minutes = args.collective_timeout
    out_dir = Path(args.output_dir)
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = tokenizer.eos_token_id
    per_rank = args.prompts_per_step // WORLD_SIZE
    mine = range(RANK * per_rank, (RANK + 1) * per_rank)  # this rank's requests

    for step in range(start_step, args.max_steps):
        run["step"] = step
        # ---- generate; a request's seed is a function of (seed, step, request)
        t0 = time.perf_counter()
        indices = step_indices(step, args.prompts_per_step, len(prompts), args.seed)
        student_prompts, teacher_prompts = zip(*[prompts[indices[j]] for j in mine])

        first_seed = args.seed * 1_000_003 + step * args.prompts_per_step
        seeds = [(first_seed + j) % 2**31 for j in mine]
        completions, sampler_logprobs = sample(llm, student_prompts, seeds, args)
        t1 = time.perf_counter()

        # ---- train
        loss, stats = backward_step(
            model, lora_params, student_prompts, teacher_prompts, completions,
            pad_id=pad_id, micro_batch_size=args.micro_batch_size, teacher=args.teacher,
            ema=ema, skip_first_tokens=args.skip_first_tokens, beta=args.beta, clip=args.clip,
            temperature=args.loss_temperature, tau=args.tau, chunk_size=args.loss_chunk_size)
        grad_norm = torch.nn.utils.clip_grad_norm_(lora_params, args.max_grad_norm).item()
        check_finite(step, loss, grad_norm)
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
        with ranks_agree("the weight push's check", minutes):
            check_push(llm, model)
        t3 = time.perf_counter()

        # ---- log
        sums = diagnostic_sums(stats, sampler_logprobs, args.tau)
        window.append(sums)
        record = {
            "step": step + 1, "loss": loss, "lr": lr, "grad_norm": grad_norm,
            **kl_window_means(window, args.kl_window),
            "logprob_gap_mean": sums["gap"] / max(sums["tokens"], 1),
            "logprob_gap_max": sums["gap_max"],
            "completion_len_mean": sums["tokens"] / args.prompts_per_step,
            "time_sample": t1 - t0, "time_train": t2 - t1, "time_push": t3 - t2,
            "tokens_per_second": sums["tokens"] / (t3 - t0)}
        if RANK == 0:
            rollouts = rollout_records(args, step, indices, mine, completions, stats.kl, tokenizer)
            log_step(args, record, rollouts, tracker)

        # ---- checkpoint (the last step writes final/ instead)
        due = args.save_every and (step + 1) % args.save_every == 0
        if RANK == 0 and due and step + 1 < args.max_steps:
            state = {"step": step + 1, "optimizer": optimizer.state_dict(),
                     "kl_window": list(window)}
            save_run_state(out_dir, model, lora_params, ema, args, state)
            print(f"checkpoint-{step + 1}; to resume: {run['resume']}", flush=True)

    # ---- the end: no rank waits for a slow disk or wandb here
    if RANK == 0:
        save_run_state(out_dir, model, lora_params, ema, args)
        print(f"final adapter -> {out_dir / 'final'}", flush=True)
        if tracker:
            tracker.finish()
    stop_engine(llm)


def start_up(argv, run):
    """Everything before step 1, phase by phase, each within its time limit (T, from
    --collective-timeout); what a rank can get wrong is agreed by all ranks (ranks_agree), so
    every node says it. Returns what the loop needs."""
    refusal = None
    try:
        args = parse_args(argv)
        minutes = args.collective_timeout
    except Refusal as e:  # said in the start's agreement, so that every node says it
        refusal = e
        minutes = COLLECTIVE_TIMEOUT

    # ---- what a node can get wrong, agreed before the process group exists
    with ranks_agree("the start", minutes):
        connect_store(minutes)
        if refusal is not None:
            raise refusal
        run["args"] = args
        device = choose_device(args)
        check_launch(args)
    out_dir = Path(args.output_dir)
    with time_limit("the process group's start", minutes, lock_held=True):
        init_distributed(args, device)

    # ---- what a user can get wrong, before a model loads
    with ranks_agree("the input checks", minutes):
        resume_from = check_output_dir(args)
        check_model(args)
        tokenizer, prompts = load_prompts(args)
        args_record = run_record(args, prompts, device)
        if args.resume:
            check_resume(args_record, out_dir)
        try:  # the first thing written
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            fail(f"--output-dir {out_dir}: {e.strerror}: choose another.")
    print0(f"to resume: {run['resume']}")
    with ranks_agree("the checkpoint's check", minutes):  # every rank, with a checkpoint or not
        check_checkpoint(resume_from)
    check_same_checkpoint(resume_from)

    # ---- the model with LoRA, and this rank's vLLM engine
    with ranks_agree("the model's load", minutes):
        model, lora_params = load_model(args, device)
    optimizer = torch.optim.AdamW(lora_params, lr=args.lr, weight_decay=0.0)
    with time_limit("vLLM's start", minutes, lock_held=True):
        llm = start_engine(args, device)
    resumed = (0, None, deque())  # the first step, the EMA, the KL window's per-step sums
    if resume_from:
        resumed = restore(resume_from, model, lora_params, optimizer)
        push_weights(llm, model)
        with ranks_agree("the weight push's check", minutes):
            check_push(llm, model)
        print0(f"resumed from {resume_from}")
    tracker = None
    if RANK == 0:
        tracker = open_run(args, resumed[0], args_record)
    # the run is written: --resume without a checkpoint starts it again
    run["again"] = run["resume"]
    return args, tokenizer, prompts, model, lora_params, optimizer, llm, tracker, resumed


def choose_attention_kernels():
    """Not cuDNN's: NaN for a row whose keys are all masked."""
    for name, on in (("flash", True), ("mem_efficient", True), ("math", True), ("cudnn", False)):
        getattr(torch.backends.cuda, f"enable_{name}_sdp")(on)


# the engine in this process (it takes a generator); no TF32 (the read-back)
PUSH_ENVIRONMENT = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_FLOAT32_MATMUL_PRECISION": "highest"}


def init_distributed(args, device):
    if device.type == "cuda":
        torch.cuda.set_device(device)  # vLLM builds its engine on it
    choose_attention_kernels()
    if WORLD_SIZE > 1:
        timeout = timedelta(minutes=args.collective_timeout)
        backend = "gloo"
        device_id = None
        if device.type == "cuda":
            # gloo (CPU tensors) connects first, timed; then NCCL's connect (device_id), which
            # only the caller's time limit bounds
            backend = "cpu:gloo,cuda:nccl"
            device_id = device
        dist.init_process_group(
            backend, store=STORE, rank=RANK, world_size=WORLD_SIZE, timeout=timeout,
            device_id=device_id)
    os.environ.update(PUSH_ENVIRONMENT)
    torch.set_float32_matmul_precision("highest")
    engine_environment(cpu=device.type == "cpu")


# -- Data

def load_prompts(args):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    check_chat_template(tokenizer, args.model)
    rows = load_rows(
        args.dataset, args.dataset_split, args.problem_column, args.context_column,
        args.data_select)
    rows = shown_contexts(rows, args.teacher_context, args.seed)
    prompts = build_prompts(
        tokenizer, rows, student_thinking=args.student_thinking,
        teacher_thinking=args.teacher_thinking, max_prompt_length=args.max_prompt_length,
        student_prompt=args.student_prompt)
    return tokenizer, prompts


LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def load_rows(dataset, split, problem_column, context_column, data_select="all"):
    """[(problem, context)] after --data-select; `context_column` a,b joins two columns'
    texts, a blank line between."""
    import datasets
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    builder = LOCAL_FORMATS.get(Path(dataset).suffix.lower())
    try:
        if builder:
            table = datasets.load_dataset(builder, data_files=dataset, split="train")
        else:
            table = datasets.load_dataset(dataset, split=split)
    except Exception as e:  # datasets' words, or none
        words = str(e.__cause__ or e).strip() or "no rows"
        if not builder:
            words += " (a hub id needs network; else give a local .json, .jsonl or .parquet file)"
        elif "JSON parse error" in words:  # datasets counts rows from 0, past blank lines
            for number, line in enumerate(Path(dataset).read_text(errors="replace").split("\n"), 1):
                try:
                    json.loads(line.strip() or "{}")  # a blank line passes
                except json.JSONDecodeError as bad:
                    words = f"line {number} is not JSON ({bad.msg})"
                    break
        fail(f"--dataset {dataset}: {words}")
    contexts = [c.strip() for c in context_column.split(",")]
    needed = {column: "--context-column" for column in contexts}  # column: its flag
    needed[problem_column] = "--problem-column"
    if data_select == "hard":
        needed["source"] = "--data-select hard"
        needed["generated_token_count"] = "--data-select hard"
    for column, flag in needed.items():
        if column not in table.column_names:
            fail(f"--dataset {dataset} has no column {column!r} ({flag}); its columns are "
                 f"{table.column_names}.")
    rows = table.to_list()
    if not rows:
        fail(f"--dataset {dataset} holds no rows: give one that has some.")
    kinds = {"generated_token_count": ((int, float), "a number")}
    for number, row in enumerate(rows, 1):
        for column in needed:
            kind, noun = kinds.get(column, (str, "a string"))
            value = row[column]
            if not isinstance(value, kind) or isinstance(value, bool):
                fail(f"--dataset {dataset}, row {number}: {column!r} is {value!r}, not {noun}: "
                     "fix or drop the row.")
    if data_select == "hard":
        rows = select_hard(rows)
    return [(row[problem_column], "\n\n".join(row[c] for c in contexts)) for row in rows]


def select_hard(rows):
    """Where teacher and student disagree: no source 'math' (KL near zero), then the longer
    half, generated_token_count at or above the element at len // 2 of the sorted counts."""
    kept = [r for r in rows if r["source"] != "math"]
    if not kept:
        fail("--data-select hard: every row has source 'math': use --data-select all.")
    threshold = sorted(r["generated_token_count"] for r in kept)[len(kept) // 2]
    kept = [r for r in kept if r["generated_token_count"] >= threshold]
    print0(f"data-select hard: {len(rows)} rows -> {len(kept)} (source != 'math', "
           f"generated_token_count >= {threshold})")
    return kept


# -- Model, adapters and checkpoints

def load_model(args, device):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
    model = model.to(device)
    disable_dropout(model)
    problem = check_logits_path(model)
    if problem:
        fail(f"--model {args.model} ({model.config.model_type}) is not supported: {problem}.")
    lora_params = add_lora(model, args.lora_r, args.lora_alpha, seed=args.seed)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()  # for gradient checkpointing
    return model, lora_params


def disable_dropout(model):
    """No dropout, as in the released recipe."""
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        elif isinstance(getattr(m, "attention_dropout", None), float):  # attention's own
            m.attention_dropout = 0.0


ADAPTER_WEIGHTS = "adapter_model.safetensors"


def adapter_parameters(model):
    names = {}
    for name, m in lora_layers(model).items():
        names[f"base_model.model.{name}.lora_A.weight"] = m.lora_A
        names[f"base_model.model.{name}.lora_B.weight"] = m.lora_B
    return names


def save_adapter(model, out_dir, base_model_name_or_path):
    """The adapter in PEFT's layout, which PEFT, vLLM and eval.py read."""
    layers = lora_layers(model)
    tensors = {name: p.detach().cpu().contiguous() for name, p in adapter_parameters(model).items()}
    first = next(iter(layers.values()))
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": first.r, "lora_alpha": first.alpha,
        "base_model_name_or_path": str(base_model_name_or_path),
        "target_modules": sorted({name.rsplit(".", 1)[-1] for name in layers})}
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / ADAPTER_WEIGHTS))
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")


@torch.no_grad()
def load_adapter(model, adapter_dir):
    tensors = load_file(str(Path(adapter_dir) / ADAPTER_WEIGHTS))
    for name, p in adapter_parameters(model).items():
        p.copy_(tensors[name])


def restore(checkpoint, model, lora_params, optimizer):
    state = torch.load(checkpoint / "trainer_state.pt", map_location="cpu", weights_only=True)
    optimizer.load_state_dict(state["optimizer"])  # moved to the parameters' device
    ema = None
    if (checkpoint / "ema").is_dir():
        load_adapter(model, checkpoint / "ema")
        ema = [p.detach().clone() for p in lora_params]
    load_adapter(model, checkpoint)
    return state["step"], ema, deque(state["kl_window"])


# what trainer_state.pt holds: 1, the step, the optimizer's state and the KL window's per-step
# sums (diagnostic_sums); any change of these (a key added, renamed or read otherwise) adds 1
CHECKPOINT_FORMAT = 1


def save_run_state(out_dir, model, lora_params, ema, args, state=None):
    """checkpoint-<step>/ or final/, written aside, then renamed. No RNG state: the data
    order and the sampling seeds are functions of (seed, step)."""
    name = "final"
    if state:
        name = f"checkpoint-{state['step']}"
    target = Path(out_dir) / name
    tmp = target.with_name(f".tmp-{name}")
    shutil.rmtree(tmp, ignore_errors=True)
    save_adapter(model, tmp, args.model)
    if ema is not None:
        with lora_values(lora_params, ema):
            save_adapter(model, tmp / "ema", args.model)
    if state is not None:
        torch.save({**state, "format": CHECKPOINT_FORMAT}, tmp / "trainer_state.pt")
    # flushed before the rename, and it after
    for path in [*tmp.rglob("*"), tmp]:
        flush(path)
    shutil.rmtree(target, ignore_errors=True)
    os.rename(tmp, target)
    flush(target.parent)


def flush(path):
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


# -- Logs

def open_run(args, start_step, args_record):
    out_dir = Path(args.output_dir)
    if args.overwrite:
        for path in run_files(out_dir):
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
    write_atomically(out_dir / "args.json", json.dumps(args_record, indent=2) + "\n")
    for path in (out_dir / "metrics.jsonl", out_dir / "rollouts.jsonl"):
        if path.exists():
            lines = path.read_text().splitlines()
            kept = [line + "\n" for line in lines if record_step(line) <= start_step]
            write_atomically(path, "".join(kept))
    if not args.wandb_project:
        return None
    import wandb
    return wandb.init(
        project=args.wandb_project, name=out_dir.name, config=vars(args), dir=str(out_dir))


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
    every = args.log_rollouts_every
    if not every or not (step == 0 or (step + 1) % every == 0 or step + 1 == args.max_steps):
        return []
    kls = kl.split([len(c) for c in completions])
    return [
        {"step": step + 1, "prompt_index": indices[j], "tokens": len(c),
         "completion": tokenizer.decode(c), "token_ids": c, "kl": token_kl.tolist(),
         "skipped_by_loss": min(args.skip_first_tokens, len(c))}
        for j, c, token_kl in zip(mine, completions, kls)]



GAP_ALARM = {"float32": 1e-4, "bfloat16": 5e-2}  # its floor on CPU kernels: 1e-6, 1e-2
# `loss` is this step's, clipped, over the positions in the loss; `kl`, `>tau`, `entropy` and
# `neg` are means over the --kl-window's steps (PositionStats defines each), kl the unclipped
# forward KL: compare each with itself across steps, not kl with loss.
STEP_LINE = (
    "step {step:4d}/{max_steps} | loss {loss:.4f} | lr {lr:.2e} | grad {grad_norm:.4f}"
    " | kl {kl_mean:.4f} >tau {kl_frac_above_tau:.1%} | len {completion_len_mean:.0f}"
    " | entropy {entropy_student:.2f}/{entropy_teacher:.2f} neg {loss_frac_negative:.1%}"
    " | sample {time_sample:.1f}s train {time_train:.1f}s push {time_push:.2f}s"
    " | {tokens_per_second:.0f} tok/s | gap {logprob_gap_mean:.1e}/{logprob_gap_max:.1e}")


def log_step(args, record, rollouts, tracker):
    out_dir = Path(args.output_dir)
    line = STEP_LINE.format(**record, max_steps=args.max_steps)
    if record["logprob_gap_mean"] > GAP_ALARM[args.dtype]:
        line += f" <- gap above the {args.dtype} noise floor measured on CPU"
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


# PART 3: THE GUARDS ==========================================================

# -- No run overwritten unless asked; a resume is the same run

# flags a resume may change: how it runs or logs, not what it computes
RESUMABLE_CHANGES = (
    "output_dir", "resume", "overwrite", "micro_batch_size", "gradient_checkpointing",
    "loss_chunk_size", "vllm_memory", "enforce_eager", "device", "collective_timeout", "save_every",
    "kl_window", "log_rollouts_every", "wandb_project")


def run_files(out_dir):
    names = ["args.json", "metrics.jsonl", "rollouts.jsonl", "final"]
    found = [out_dir / n for n in names if (out_dir / n).exists()]
    return found + sorted(checkpoints(out_dir).values())


def checkpoints(out_dir):
    """{step: directory} of each checkpoint-<step>: any other name is not a checkpoint."""
    found = {}
    for path in Path(out_dir).glob("checkpoint-*"):
        if re.fullmatch(r"checkpoint-\d+", path.name):
            found[int(path.name.split("-")[1])] = path
    return found


def latest_checkpoint(out_dir):
    steps = [step for step, d in checkpoints(out_dir).items() if (d / "trainer_state.pt").exists()]
    if not steps:
        return None
    return Path(out_dir) / f"checkpoint-{max(steps)}"


def check_output_dir(args):
    """The checkpoint to resume, or None (a run without one starts again)."""
    out_dir = Path(args.output_dir)
    existing = run_files(out_dir)
    if not args.resume:
        if existing and not args.overwrite:
            names = ", ".join(p.name for p in existing[:3])
            fail(f"--output-dir {out_dir} already holds a run ({names}): pass --resume to "
                 "continue it, --overwrite to replace it, or choose another --output-dir.")
        return None
    if not (out_dir / "args.json").is_file():
        fail(f"--resume: {out_dir} holds no run to resume (no args.json): drop --resume to start "
             "one; across nodes every rank must see one --output-dir.")
    if (out_dir / "final").exists():
        fail(f"--resume: the run in {out_dir} has finished: choose a new --output-dir.")
    checkpoint = latest_checkpoint(out_dir)
    if checkpoint is None:
        print0(f"--resume: {out_dir} holds no checkpoint yet: the run starts again at step 1")
    return checkpoint


def check_checkpoint(checkpoint):
    """Each file of the checkpoint (if any) loads, in the format this opsd.py reads."""
    if checkpoint is None:
        return
    try:
        ema = checkpoint.glob(f"ema/{ADAPTER_WEIGHTS}")
        for path in [checkpoint / "trainer_state.pt", checkpoint / ADAPTER_WEIGHTS, *ema]:
            if path.suffix == ".pt":
                state = torch.load(path, map_location="cpu", weights_only=True)
            else:
                load_file(path)
    except Exception as e:
        fail(f"--resume: {path} does not load ({str(e).split('. ')[0]}): rename "
             f"{checkpoint.name} to bad-{checkpoint.name} to resume from the one before.")
    written = state.get("format")
    if written is None:  # written before the format was: 1 if its KL window holds loss_tokens
        written = int(all("loss_tokens" in s for s in state["kl_window"]))
    if written != CHECKPOINT_FORMAT:
        fail(f"--resume: {checkpoint} is in format {written}, this opsd.py's is "
             f"{CHECKPOINT_FORMAT}: resume with the opsd.py that wrote it, or start a new "
             "--output-dir.")


def check_same_checkpoint(checkpoint):
    """Every rank resumes from the same step, none if one has no checkpoint (one --output-dir
    on every node)."""
    step = 0
    if checkpoint:
        step = int(checkpoint.name.split("-")[1])
    steps = all_reduce(torch.tensor([step, -step]), dist.ReduceOp.MAX).tolist()
    if steps[0] != -steps[1]:
        fail(f"--resume: ranks see checkpoints {-steps[1]} to {steps[0]} as the newest (0: none): "
             "give every node one --output-dir (a lagging shared filesystem?).")


def run_record(args, prompts, device):
    """args.json: the flags, and what else fixes the results: the prompts' ids, the model's
    files, the device type (CPU and CUDA sample apart)."""
    ids = hashlib.sha256()
    for student, teacher in prompts:
        ids.update(array("q", [len(student), len(teacher), *student, *teacher]).tobytes())
    return {**vars(args), "prompt_ids_sha256": ids.hexdigest(),
            "model_sha256": model_fingerprint(args.model), "device_type": device.type}


CONTENTS = {
    "prompt_ids_sha256": "prompts", "model_sha256": "model files", "device_type": "device type"}


def check_resume(args_record, out_dir):
    saved = json.loads((out_dir / "args.json").read_text())
    changed = [key for key, value in args_record.items()
               if key not in RESUMABLE_CHANGES and saved.get(key) != value]
    if changed:
        names = [CONTENTS.get(key, "--" + key.replace("_", "-")) for key in changed]
        fail(f"--resume with other {', '.join(names)} than the run in {out_dir} would "
             "change its results: use the same, or a new --output-dir.")


def model_fingerprint(model):
    """sha256 of config.json and samples of each weight file; None without local weights."""
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
    path = Path(model).expanduser()
    if path.is_dir():
        return path.resolve()
    from huggingface_hub import try_to_load_from_cache
    try:
        config = try_to_load_from_cache(model, "config.json")
    except ValueError:  # not a hub id either
        return None
    if not isinstance(config, str):
        return None
    return Path(config).parent.resolve()


# -- The model: its logits, LoRA's targets, the device

def check_model(args):
    """Refusals from the model's config alone, before its weights load."""
    from transformers import AutoConfig, AutoModelForCausalLM
    try:
        config = AutoConfig.from_pretrained(args.model)
    except (OSError, ValueError) as e:
        fail(f"--model {args.model}: cannot load its config ({str(e).splitlines()[0]}): "
             "give a model directory that exists, or a hub id (with network).")
    for field in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(config, field, None) not in (None, 1):
            fail(f"--model {args.model}: its config sets {field} = {getattr(config, field)}, "
                 "but the loss needs logits = final_hidden @ lm_head.weight^T.")
    with torch.device("meta"):  # no weights
        skeleton = AutoModelForCausalLM.from_config(config)
    missing = missing_lora_targets(skeleton)
    if missing:
        fail(f"--model {args.model} ({config.model_type}): LoRA needs "
             f"{', '.join(LORA_TARGETS)} in every decoder layer, but {missing}.")
    parameters = skeleton.num_parameters()
    if args.device == "auto" and parameters > 1e8 and not torch.cuda.is_available():
        fail(f"--device auto: torch {torch.__version__} sees no CUDA device, and --model "
             f"{args.model} has {parameters / 1e9:.2f}B parameters, too many for a CPU: make "
             "a GPU visible, or pass --device cpu.")
    context = getattr(config.get_text_config(), "max_position_embeddings", None)
    if context and args.max_prompt_length + args.max_new_tokens > context:
        fail(f"--max-prompt-length {args.max_prompt_length} + --max-new-tokens "
             f"{args.max_new_tokens} exceeds the model's context of {context} tokens: "
             "lower one of them.")


def check_chat_template(tokenizer, model):
    """Both scripts render prompts with the model's chat template."""
    if tokenizer.chat_template is None:
        fail(f"--model {model} has no chat template (its tokenizer sets none): use a chat or "
             "instruct model, or give its directory a chat_template.jinja.")


def missing_lora_targets(model):
    """None, or which decoder layers lack which targets as nn.Linear."""
    by_layer = {}  # layer number -> its linear layers' names
    for name, m in model.named_modules():
        number = re.search(r"\.(\d+)\.", name)
        if isinstance(m, nn.Linear) and number:
            by_layer.setdefault(int(number[1]), set()).add(name.rsplit(".", 1)[-1])
    if not by_layer:
        return "its decoder layers hold no nn.Linear"
    lacking = {}  # targets missing -> the layers that miss them
    for number, names in sorted(by_layer.items()):
        missing = ", ".join(t for t in LORA_TARGETS if t not in names)
        if missing:
            lacking.setdefault(missing, []).append(str(number))
    parts = [f"layers {', '.join(layers)} lack {targets}" for targets, layers in lacking.items()]
    return "; ".join(parts) or None


def choose_device(args):
    """CUDA when asked for or seen. A node that asks for it and cannot have it is refused: it
    would train on its CPU, or leave the other nodes waiting."""
    if args.device == "cpu":
        return torch.device("cpu")
    check_cuda_build()
    if torch.cuda.is_available():
        if LOCAL_RANK >= torch.cuda.device_count():
            fail(f"this node sees {torch.cuda.device_count()} GPUs, fewer than its ranks: "
                 "lower torchrun's --nproc_per_node.")
        return torch.device("cuda", LOCAL_RANK)
    if args.device == "cuda" and not torch.version.cuda:
        fail(f"--device cuda: torch {torch.__version__} is a CPU build: pip install -r "
             "requirements.txt in a fresh venv, or pass --device cpu.")
    if torch.version.cuda:
        fail(f"--device {args.device}: torch {torch.__version__} sees no GPU (a driver too old for "
             f"CUDA {torch.version.cuda}, CUDA_VISIBLE_DEVICES, a container without GPUs?): make "
             "one visible, or pass --device cpu.")
    return torch.device("cpu")


def check_launch(args):
    """wandb's login, asked now rather than by a prompt after the engine starts; torchrun's
    restarts, which would meet this run's files and torch's keys of the first attempt."""
    if args.wandb_project and not importlib.util.find_spec("wandb"):
        fail("--wandb-project needs wandb: pip install wandb.")
    offline = os.environ.get("WANDB_MODE") in ("offline", "disabled")
    if args.wandb_project and RANK == 0 and not offline:
        import wandb
        if not wandb.login(prompt=False, verify=False):
            fail("--wandb-project: wandb has no API key on rank 0's node: wandb login, or set "
                 "WANDB_API_KEY or WANDB_MODE=offline.")
    restarts = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    if restarts != "0":
        fail(f"torchrun --max-restarts {restarts}: a restart would meet this run's files: pass 0, "
             "and resume with the command a stop prints.")


def check_cuda_build():
    if torch.version.cuda or not shutil.which("nvidia-smi"):
        return
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    if "GPU" in listed.stdout:
        fail(f"torch {torch.__version__} is a CPU build, but nvidia-smi lists a GPU: "
             "pip install -r requirements.txt in a fresh venv.")


@torch.no_grad()
def check_logits_path(model):
    """None if final_hidden @ lm_head.weight^T are the logits on a probe, else why: the
    loss makes its logits so, and would be silently wrong (soft-capping, scaling, a bias)."""
    W = model.get_output_embeddings().weight
    if getattr(model.get_output_embeddings(), "bias", None) is not None:
        return "its lm_head has a bias"
    positions = torch.arange(16, device=model.device)[None]  # (1, 16)
    ids = (positions + 3) % model.config.vocab_size
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "position_ids": positions}

    model.eval()  # no dropout; the caller sets the mode it trains in
    want = model(**inputs, use_cache=False).logits.float()  # (1, 16, V)
    got = (final_hidden(model, inputs) @ W.T).float()
    if not torch.allclose(got, want, rtol=1e-2, atol=1e-3 * float(want.abs().max())):
        return "its logits are not final_hidden @ lm_head.weight^T (soft-capping, scaling?)"
    return None


# -- While it runs: no non-finite update

def check_finite(step, loss, grad_norm):
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        fail(f"step {step + 1}: non-finite loss ({loss}) or gradient norm ({grad_norm}), "
             "stopped before the update: try a lower --lr.")


# -- When a run stops: a refusal agreed, a failure at once, no start-up phase unbounded

STORE = None  # torchrun's key-value store (connect_store): the ranks' agreements go through it
AGREEMENTS = {}  # {phase: how many agreements on it so far}: every rank makes the same ones
ENDING = threading.Lock()  # held by what ends this rank first: a time limit, or stop_cleanly


def say(text, all_ranks=False):
    """Print (once a node if all ranks say it); also for torchrun's report."""
    if LOCAL_RANK == 0 or not all_ranks:
        print(text, file=sys.stderr, flush=True)
    report(text)


def report(text, began=None):
    """`text` for torchrun's report of this rank, should it end before saying anything else;
    None: nothing. torchrun's root cause is the earliest: a rank that fails in a phase is dated
    as the phase's start, as are the others torchrun ends there, who come after it."""
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return
    path = Path(os.environ["TORCHELASTIC_ERROR_FILE"])
    if text is None:
        path.unlink(missing_ok=True)
        return
    if began is None and path.exists():  # within a phase
        began = json.loads(path.read_text())["timestamp"]
    path.write_text(json.dumps({"message": text, "timestamp": int(began or time.time())}))


def connect_store(minutes):
    """The store torchrun's agent on node 0 keeps (env://). It exists before the process
    group, so a refusal made before the group reaches every node too."""
    global STORE
    if WORLD_SIZE > 1:
        timeout = timedelta(minutes=minutes)
        STORE = next(dist.rendezvous("env://", RANK, WORLD_SIZE, timeout=timeout))[0]


def end_rank(message):
    """A time limit has passed: this rank's line, where each thread was, then exit 1."""
    if ENDING.acquire(blocking=False):
        say(message)
        faulthandler.dump_traceback(sys.__stderr__)
        os._exit(1)


@contextmanager
def time_limit(phase, minutes, lock_held=False, why="--collective-timeout"):
    """End this rank if `phase` has not ended within `minutes`: a thread says so. Meanwhile
    torchrun's report says the phase, should a signal end the rank (its exit code names it).
    Where the main thread may hold Python's lock inside a C call (NCCL's split, CUDA's start),
    that thread cannot run: faulthandler's own thread, which needs no lock, ends the rank a
    minute later with every thread's stack (faulthandler keeps one such watchdog a process:
    this one replaces any other, pytest's faulthandler_timeout among them)."""
    seconds = minutes * 60
    message = (f"opsd.py: rank {RANK}: {phase} did not end within {minutes:g} minutes ({why}); "
               "where each thread was:")
    timer = threading.Timer(seconds, end_rank, [message])
    timer.daemon = True
    timer.start()
    if lock_held:
        faulthandler.dump_traceback_later(seconds + 60, exit=True, file=sys.__stderr__)
    if STORE is not None:  # where this rank is, for a rank that waits for it
        STORE.set(store_key("at", RANK), phase)
    began = time.time()
    clock = time.strftime("%H:%M:%S", time.localtime(began))
    report(f"opsd.py: rank {RANK}: ended during {phase}, begun at {clock}", began)
    try:
        yield
    finally:
        timer.cancel()
        if lock_held:
            faulthandler.cancel_dump_traceback_later()
    report(None)  # the phase is over (a failure in it is dated as its start)


def store_key(*parts):
    """A key of this run's in the store; a restart of the workers starts with fresh ones."""
    return "/".join(["opsd", os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"), *map(str, parts)])


def agreement_keys(phase):
    """Each rank's key for the next agreement on `phase`: ranks on different paths never pair."""
    AGREEMENTS[phase] = AGREEMENTS.get(phase, 0) + 1
    return [store_key(phase, AGREEMENTS[phase], rank) for rank in range(WORLD_SIZE)]


def exchange(phase, text, minutes):
    """Every rank's `text` for this agreement, through the store; a rank that has not given
    its own within `minutes` is named, with the phase it is in. The store's client reads a
    reply without a bound (a frozen node 0, a network that drops without a reset): a time
    limit of 1.1 `minutes` ends this rank then."""
    if STORE is None:
        return [text]
    why = "1.1 x --collective-timeout: torchrun's store on node 0 did not answer"
    with time_limit(f"the agreement on {phase}", 1.1 * minutes, why=why):
        report(None)  # not dated as this wait's start: a rank that fails meanwhile is first
        keys = agreement_keys(phase)
        STORE.set(keys[RANK], text)
        try:
            STORE.wait(keys, timedelta(minutes=minutes))
        except dist.DistStoreError:  # the wait's timeout
            missing = [rank for rank, key in enumerate(keys) if not STORE.check([key])]
            where = [f"rank {rank} is in {STORE.get(store_key('at', rank)).decode()}; "
                     for rank in missing if STORE.check([store_key("at", rank)])]
            fail(f"rank {', '.join(map(str, missing))} did not reach {phase} within {minutes:g} "
                 f"minutes (--collective-timeout): {''.join(where)}the log of its node says "
                 "where it stopped.")
        except dist.DistError as e:
            fail(f"torchrun's store on node 0 went away during {phase} ({e}): node 0's log says "
                 "why.")
        return [STORE.get(key).decode() for key in keys]


@contextmanager
def ranks_agree(phase, minutes):
    """Run `phase` within its time limit, then all ranks refuse with the first refusal (naming
    its rank if not all's). A rank that fails instead tells the others, who end at once."""
    problem = ""
    try:
        with time_limit(phase, minutes):
            yield
    except Refusal as e:
        problem = str(e)
    except Exception as e:
        if STORE is not None:  # its key for this agreement, so no rank waits for it
            failed = f"{phase} failed ({type(e).__name__}): the log of its node says why."
            STORE.set(agreement_keys(phase)[RANK], failed)
        raise
    problems = exchange(phase, problem, minutes)
    refusals = [(rank, p) for rank, p in enumerate(problems) if p]
    if refusals:
        rank, problem = refusals[0]
        if len(set(problems)) > 1:
            problem = f"rank {rank}: {problem}"
        fail(problem)


def launch_command(flags):
    """The command that runs opsd.py with `flags`, launched as this run was."""
    launcher = "python"
    if WORLD_SIZE > 1:
        launcher = f"torchrun --nproc_per_node {WORLD_SIZE}"
    if int(os.environ.get("LOCAL_WORLD_SIZE", WORLD_SIZE)) != WORLD_SIZE:
        launcher = "torchrun (on every node, launched as before)"
    return f"{launcher} opsd.py {shlex.join(flags)}"


@contextmanager
def stop_cleanly(run):
    interrupted = []

    def on_interrupt(signum, frame):
        interrupted.append(signum)
        raise KeyboardInterrupt
    previous = signal.signal(signal.SIGINT, on_interrupt)
    faulthandler.enable(sys.__stderr__)  # a rank a signal ends (SIGSEGV, SIGABRT): its stacks
    try:
        yield
    except Refusal as e:
        with ENDING:  # a time limit that is ending this rank says it alone
            say(f"opsd.py: error: {e}", all_ranks=True)
        raise SystemExit(2)
    except (Exception, KeyboardInterrupt) as e:
        ENDING.acquire()
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # torchrun passes Ctrl-C on: once is enough
        where = "before the first step"
        if run["step"] is not None:
            where = f"at step {run['step'] + 1} of {run['args'].max_steps}"
        last = None
        if run["args"]:
            last = latest_checkpoint(run["args"].output_dir)
        saved = f"the last checkpoint is {last}"
        if last is None:
            saved = "no checkpoint yet"
        if interrupted and last is None:  # rank 0 says it; the others may be ended first
            print0(f"opsd.py: interrupted {where}, before any checkpoint: nothing to resume; "
                   f"to start again: {run['again']}", file=sys.stderr)
        elif interrupted:  # the command was also printed at the start
            print0(f"opsd.py: interrupted {where} ({saved}); to resume: {run['resume']}",
                   file=sys.stderr)
        if interrupted:
            os._exit(130)
        hint = ""
        if isinstance(e, torch.OutOfMemoryError):
            hint = "; lower --micro-batch-size, --loss-chunk-size or --vllm-memory"
        # a failed collective is this rank's error too
        error = traceback.format_exc()
        say(f"opsd.py: rank {RANK}: error {where} ({saved}){hint}:\n{error}")
        os._exit(1)  # past vLLM's teardown, which could wait for others
    finally:
        signal.signal(signal.SIGINT, previous)


if __name__ == "__main__":
    main()
