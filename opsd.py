"""
On-Policy Self-Distillation (OPSD) for LLM reasoning, in one file.

    torchrun --nproc_per_node 4 opsd.py --clip token --skip-first-tokens 1            # Qwen3-1.7B, recipe's budget
    python opsd.py --model DIR --dataset FILE.jsonl ...                               # one process, no torchrun
    torchrun --nproc_per_node 2 opsd.py --model tests/miniature/model ...             # on a CPU: the quickstart

One model plays two roles. The student sees only the problem; the teacher is the same network
whose prompt also holds a reference solution. Each optimizer step:
  1. the student samples an answer to each problem with vLLM (one engine per rank),
  2. the teacher (by default the base model: LoRA switched off) scores that answer under no_grad,
  3. the student's next-token distributions are pulled towards the teacher's with a
     full-vocabulary forward KL at every answer position; only LoRA weights train,
  4. the merged LoRA weights are pushed into the running vLLM engine in place, and read back.

Departures from the released recipe (README.md says why): rows [prompt | answer | pads], positions from the attention
mask; prompts reach vLLM as token ids; LoRA merged out of place (the fixed teacher never changes); softmax and KL in
float32, chunked, normalised by the step's tokens over micro-batches and ranks; a cosine schedule; `--clip token`.
Read top to bottom: helpers; part 1, the method; part 2, the run (main() and what it calls); part 3, the guards.
"""

import argparse
import hashlib
import importlib.util
import json
import logging
import math
import os
import shlex
import shutil
import signal
import sys
import time
import warnings
from array import array
from collections import deque
from contextlib import contextmanager, nullcontext, suppress
from datetime import timedelta
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

# =============================================================================
# HELPERS EVERY PART USES
# =============================================================================

# -----------------------------------------------------------------------------
# Ranks and errors: torchrun sets RANK / WORLD_SIZE (`python opsd.py` is one); one sentence per error, said once

RANK, WORLD_SIZE = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
AGREEING = False  # inside agreed(): a refusal is said after the ranks compare theirs

def print0(*a, **kw):
    if RANK == 0:
        print(*a, **kw, flush=True)

class Refusal(SystemExit):
    def __init__(self, text):  # a user error in one sentence; exit status 2
        super().__init__(2)
        self.text = text

def error_file(text):
    """Write `text` where torchrun's report reads it (its "Root Cause" then shows the sentence, not <N/A>)."""
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        Path(os.environ["TORCHELASTIC_ERROR_FILE"]).write_text(
            json.dumps({"message": {"message": text, "extraInfo": {"timestamp": int(time.time())}}}))
    return text

def fail(message, speaker=0, prog="opsd.py"):
    """Stop on a user error with one sentence: every rank finds it, only rank `speaker` says it."""
    text = f"{prog}: error: {message}"
    if RANK == speaker and not AGREEING:
        print(text, file=sys.stderr, flush=True)
    raise Refusal(error_file(text))

class RankLost(Exception):
    """A collective failed (gloo: "Connection closed by peer"; a timeout): another rank is gone or unreachable."""

def collective(op, *args, **kw):
    try:
        work = op(*args, **kw)
        while work and not work.is_completed():  # with async_op, waited for here, where a signal is handled at once
            time.sleep(0.001)
        return work and work.wait()
    except (RuntimeError, dist.DistError) as e:
        raise RankLost(str(e).splitlines()[0]) from e

def all_reduce(tensor, op=None):
    """Sum (or `op`) over ranks, in place; a no-op in a world of one."""
    if dist.is_initialized():
        collective(dist.all_reduce, tensor, op or dist.ReduceOp.SUM, async_op=True)
    return tensor

@contextmanager
def agreed():
    """Each rank's own checks, then a collective all reach: if any refused, all stop, each refusal said once."""
    global AGREEING
    AGREEING, mine = True, None
    try:
        yield
    except Refusal as e:
        mine = e.text
    finally:
        AGREEING = False
    texts = [mine] * WORLD_SIZE
    collective(dist.all_gather_object, texts, mine) if dist.is_initialized() else None
    same = len(set(texts)) == 1  # every rank, the same sentence: rank 0 says it; else each rank, after its rank
    ranked = {r: t if same else t.replace(": error: ", f": error: rank {r}: ", 1) for r, t in enumerate(texts) if t}
    if mine and not (same and RANK):
        print(ranked[RANK], file=sys.stderr, flush=True)
    if ranked:  # torchrun's report names the first refusal, whichever rank it picks
        raise Refusal(error_file(ranked[min(ranked)]))

# =============================================================================
# PART 1: THE METHOD
# =============================================================================

# -----------------------------------------------------------------------------
# Prompts and batches: the released recipe's strings, rendered once to token ids; rows [prompt | completion | pads]

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
TRANSITION = (
    "\n\nAfter reading the reference solution above, make sure you truly understand the reasoning behind each "
    "step \u2014 do not copy or paraphrase it. Now, using your own words and independent reasoning, derive the same "
    "final answer to the problem above. Think step by step, explore different approaches, and don't be afraid to "
    "backtrack or reconsider if something doesn't work out:\n"
)

def eval_message(problem):
    """The released evaluation's prompt (eval.py's): the problem and the instruction, no 'Problem: ' prefix."""
    return f"{problem}\n\n{INSTRUCTION}"

def student_message(problem, prompt="recipe"):
    """The recipe's student message, or (--student-prompt eval) eval.py's: the student trains as it is scored."""
    return eval_message(problem) if prompt == "eval" else f"Problem: {problem}\n\n{INSTRUCTION}"

def teacher_message(problem, context):
    return (f"Problem: {problem}\n\nHere is a reference solution to this problem:\n"
            f"=== Reference Solution Begin ===\n{context}\n=== Reference Solution End ===\n{TRANSITION}\n{INSTRUCTION}")

def render(tokenizer, message, thinking):
    """Token ids of a one-turn chat ending in the assistant's generation prompt (no system prompt)."""
    return tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True,
                                         enable_thinking=thinking, tokenize=True, return_dict=False)

def build_prompts(tokenizer, rows, *, student_thinking, teacher_thinking, max_prompt_length, student_prompt="recipe"):
    """[(student prompt ids, teacher prompt ids)], dropping rows whose prompts exceed max_prompt_length."""
    prompts = []
    for problem, context in rows:
        student = render(tokenizer, student_message(problem, student_prompt), student_thinking)
        teacher = render(tokenizer, teacher_message(problem, context), teacher_thinking)
        if max(len(student), len(teacher)) <= max_prompt_length:
            prompts.append((student, teacher))
    dropped = len(rows) - len(prompts)
    print0(f"data: {len(prompts)} prompts, {dropped} dropped as longer than {max_prompt_length} tokens")
    if not prompts:
        fail(f"No row fits --max-prompt-length {max_prompt_length}: raise it.")
    return prompts

def step_indices(step, prompts_per_step, num_prompts, seed):
    """Prompt indices of optimizer step `step`: a fresh seeded permutation each epoch, so the order is a
    function of (seed, step) alone and a resumed run needs no data-loader state."""
    indices, perms = [], {}
    for position in range(step * prompts_per_step, (step + 1) * prompts_per_step):
        epoch, i = divmod(position, num_prompts)
        if epoch not in perms:
            perms[epoch] = torch.randperm(num_prompts, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        indices.append(perms[epoch][i])
    return indices

def build_batch(prompts, completions, pad_id, device):
    """Model inputs for one micro-batch, and the mask of completion tokens (B, T); positions from the attention mask,
    each token at the position vLLM sampled it at. Pads go last: a left pad is a query row with every key masked, for
    which some CUDA attention kernels return NaN, spread to real tokens by the next layer (0 x NaN). The masks select
    completion tokens row after row, so student and teacher batches select alike."""
    T = max(len(p) + len(c) for p, c in zip(prompts, completions))
    input_ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    completion_mask = torch.zeros_like(input_ids, dtype=torch.bool)
    for row, (prompt, completion) in enumerate(zip(prompts, completions)):
        P, L = len(prompt), len(completion)
        input_ids[row, :P + L] = torch.tensor(prompt + completion)
        attention_mask[row, :P + L] = 1
        completion_mask[row, P:P + L] = True
    position_ids = attention_mask.cumsum(-1) - 1  # (B, T) 0 .. P + L - 1 on real tokens, then constant on pads
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    return {k: v.to(device) for k, v in inputs.items()}, completion_mask.to(device)

# -----------------------------------------------------------------------------
# LoRA: y = W x + (alpha / r) B A x on every attention and MLP projection, hand-rolled

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update; `weight` and `bias` keep their names (vLLM's). A and B
    are float32 even in a bf16 model: updates of lr 5e-6 would round away in bf16."""

    def __init__(self, base: nn.Linear, r: int, alpha: float, generator: torch.Generator):
        super().__init__()
        self.weight, self.bias = base.weight, base.bias  # (out, in), (out,) or None
        self.r, self.alpha, self.scale = r, alpha, alpha / r
        # A drawn on the CPU, then moved: every device and rank starts alike; B = 0: training starts at the base model
        lora_A = nn.init.kaiming_uniform_(torch.empty(r, base.in_features), a=math.sqrt(5), generator=generator)
        self.lora_A = nn.Parameter(lora_A.to(base.weight.device))  # (r, in)
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r, device=base.weight.device))  # (out, r)
        self.enabled = True

    def forward(self, x):
        y = F.linear(x, self.weight, self.bias)
        if not self.enabled:
            return y
        update = F.linear(F.linear(x.to(self.lora_A.dtype), self.lora_A), self.lora_B)  # B A x
        return y + (self.scale * update).to(y.dtype)

    def merged_weight(self):
        # W + (alpha / r) B A, out of place, in the model dtype: W is never touched, so the fixed teacher cannot drift
        return (self.weight.float() + self.scale * (self.lora_B @ self.lora_A)).to(self.weight.dtype)

def lora_layers(model):
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}

def add_lora(model, r, alpha, seed=0, targets=LORA_TARGETS):
    """Wrap every nn.Linear child named in `targets` (each must exist, or only part would train), freeze all else;
    return the LoRA parameters. The A matrices come from one CPU generator seeded with `seed`, in module order."""
    linear_names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    missing = [t for t in targets if t not in linear_names]
    if missing:
        raise ValueError(f"the model ({model.config.model_type}) has no linear layer named {', '.join(missing)}; "
                         f"its linear layers are {', '.join(sorted(linear_names))}")
    model.requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if child_name in targets and isinstance(child, nn.Linear):
                setattr(module, child_name, LoRALinear(child, r, alpha, generator))
    return [p for m in lora_layers(model).values() for p in (m.lora_A, m.lora_B)]

@torch.no_grad()
def merged_weights(model):
    """(HF parameter name, merged weight) per LoRA layer, one at a time: a push never holds a second model copy."""
    for name, m in lora_layers(model).items():
        yield f"{name}.weight", m.merged_weight()

# -----------------------------------------------------------------------------
# Rollout: one vLLM engine per rank, sampling from token ids; weights pushed in place and read back

# vLLM on the CPU (eval.py's too): no CUDA graphs to capture, and whole prompts: one prefilled in chunks samples (and
# discards) a token per chunk, then rewinds its seeded generator, which a CPU torch.Generator cannot do.
CPU_ENGINE = {"enforce_eager": True, "enable_chunked_prefill": False}

def engine_environment(cpu):
    """vLLM's logs: errors only, also two notices every CPU start prints before its log is set up; a 1 GiB KV cache."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    logging.getLogger("vllm.triton_utils.importing").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", r"`torch\.distributed\.reduce_op` is deprecated", FutureWarning)
    if cpu:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

def start_engine(args, rank, world_size, device):
    from vllm import LLM
    extra = CPU_ENGINE if device.type == "cpu" else {"gpu_memory_utilization": args.vllm_memory}
    max_model_len = args.max_prompt_length + args.max_new_tokens
    return LLM(model=args.model, dtype=args.dtype, max_model_len=max_model_len,
               seed=args.seed + rank,  # every request carries its own seed; this only keeps unseeded ones apart
               max_num_seqs=max(1, args.prompts_per_step // world_size),  # this rank's prompts all run at once
               max_num_batched_tokens=max(max_model_len, 8192),  # tokens per engine step: one whole sequence at least
               # under torchrun every rank runs its own tensor-parallel-1 engine inside its own process
               distributed_executor_backend="external_launcher" if world_size > 1 else None, **extra)

def sample(llm, prompts, seeds, args):
    """Completions (token ids, with a sampled EOS) and vLLM's raw log-prob of each token (before temperature and
    top-k/top-p). One seed per request: the in-process engine shares torch's global RNG."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    params = [SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=seed,
                             max_tokens=args.max_new_tokens, logprobs=0) for seed in seeds]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    completions = [list(out.outputs[0].token_ids) for out in outputs]
    logprobs = [[lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, c)] for out, c in zip(outputs, completions)]
    return completions, logprobs

def fingerprint(weight):
    """An exact fingerprint of a weight's bits (-0.0 as 0.0): their plain, squared and position-weighted sums in
    wrapping int64 arithmetic, so the order of summation cannot change it."""
    bits = (weight.detach() + 0.0).contiguous().view(getattr(torch, f"int{8 * weight.element_size()}")).flatten()
    bits, position = bits.long(), torch.arange(1, bits.numel() + 1, device=bits.device)
    return tuple(int(s) for s in (bits.sum(), (bits * bits).sum(), (bits * position).sum()))

@torch.no_grad()
def engine_fingerprints(model):
    """In vLLM's worker: {checkpoint weight name: fingerprint}, each linear layer read back through the GEMM sampling
    uses (on the CPU the weight lives only in a repacked kernel handle) applied to the identity: I W^T = W^T exactly.
    Stacked layers (qkv_proj, gate_up_proj) are split back into the checkpoint's projections."""
    from vllm.model_executor.layers.linear import LinearBase
    stacked, prints = getattr(model, "packed_modules_mapping", {}), {}
    for name, m in model.named_modules():
        if isinstance(m, LinearBase):
            eye = torch.eye(m.input_size_per_partition, dtype=m.weight.dtype, device=m.weight.device)
            parent, _, short = name.rpartition(".")
            parts = m.quant_method.apply(m, eye).t().split(m.output_partition_sizes)
            prints.update({f"{parent}.{p}.weight": fingerprint(w) for p, w in zip(stacked.get(short, [short]), parts)})
    return prints

def push_weights(llm, model):
    """Update inference engine weights: merged LoRA weights into the running engine, read back and checked, then
    drop the prefix cache (its KV entries were computed with the old weights). Returns None, or what went wrong."""
    # vLLM stacks q/k/v and gate/up itself; all seven projections are sent, so every fused group is complete
    llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=merged_weights(model), is_checkpoint_format=True))
    # the verdict is the engine's weights, never vLLM's log: each LoRA layer is merged again and compared
    engine = llm.apply_model(engine_fingerprints)[0]
    for name, m in lora_layers(model).items():
        if engine.get(f"{name}.weight") != fingerprint(m.merged_weight()):
            return f"the weight push failed: vLLM's {name} does not hold the merged weights sent to it."
    if not llm.reset_prefix_cache():
        return "vLLM refused to reset its prefix cache after a weight push: cached KV would be stale."
    return None

def stop_engine(llm):
    """Shut the in-process engine down; vLLM's teardown also destroys the default process group."""
    llm.llm_engine.engine_core.shutdown()

# -----------------------------------------------------------------------------
# The loss: a per-token divergence between teacher and student; the KL diagnostic, at the scale the clip sees

CLIP_MODES = ("entry", "token", "none")

def log_probs(student_logits, teacher_logits, temperature):
    """(log p_S, log p_T) at the loss temperature, in float32: (..., V) each."""
    return tuple(F.log_softmax(x.float() / temperature, dim=-1) for x in (student_logits, teacher_logits))

def token_divergence(student_logits, teacher_logits, *, beta=0.0, temperature=1.0, clip="entry", tau=0.05, logps=None):
    """Per-position loss contribution D(p_T || p_S) after clipping, in float32. Shapes (..., V) -> (...)."""
    if clip not in CLIP_MODES:
        raise ValueError(f"clip must be one of {CLIP_MODES}, got {clip!r}.")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must lie in [0, 1], got {beta}.")
    log_s, log_t = logps or log_probs(student_logits, teacher_logits, temperature)  # (..., V) log p_S, log p_T
    # per vocabulary entry v:
    #   beta = 0:  d_v = p_T(v) (log p_T(v) - log p_S(v))                 forward KL(T || S)
    #   beta = 1:  d_v = p_S(v) (log p_S(v) - log p_T(v))                 reverse KL(S || T)
    #   else:      d_v = beta KL_v(T || m) + (1 - beta) KL_v(S || m),     m = beta p_T + (1 - beta) p_S
    if beta == 0.0:
        d = log_t.exp() * (log_t - log_s)
    elif beta == 1.0:
        d = log_s.exp() * (log_s - log_t)
    else:
        log_m = torch.logaddexp(log_t + math.log(beta), log_s + math.log(1.0 - beta))
        d = beta * log_t.exp() * (log_t - log_m) + (1.0 - beta) * log_s.exp() * (log_s - log_m)
    # entry clip (released recipe): d_v <- min(d_v, tau); clamped entries get no gradient
    if clip == "entry":
        d = d.clamp(max=tau)
    k = d.sum(dim=-1)  # (...) k_n = sum_v d_v
    # token clip: k_n * min(1, tau / k_n) with the factor detached. The value is min(k_n, tau) and the
    # gradient keeps the true divergence direction at every position, only scaled down.
    if clip == "token":
        k = k * (tau / k.clamp(min=tau)).detach()
    return k

class PositionStats(NamedTuple):
    """Per answer position, whatever the loss's beta and clip (both at the loss temperature), (N,) each."""
    kl: torch.Tensor  # unclipped KL(p_T || p_S)
    clipped_mass: torch.Tensor  # teacher mass on entries the entry clip clamps: p_T(v) (log p_T(v) - log p_S(v)) > tau
    logprob: torch.Tensor  # the student's raw log-prob of the sampled token (temperature 1, vLLM's convention)

@torch.no_grad()
def divergence_stats(student_logits, teacher_logits, targets, *, temperature, tau, logps=None):
    """PositionStats of C positions from their (C, V) logits (or log_probs, then overwritten) and sampled tokens."""
    raw = student_logits.float()
    logprob = raw.gather(-1, targets[:, None])[:, 0] - raw.logsumexp(-1)  # (C,)
    log_s, log_t = logps or log_probs(raw, teacher_logits, temperature)
    p_t = log_t.exp()
    d = log_t.sub_(log_s).mul_(p_t)  # (C, V) p_T(v) (log p_T(v) - log p_S(v)), in place: this runs per chunk
    kl, clipped_mass = d.sum(-1), p_t.mul_(d > tau).sum(-1)
    return PositionStats(kl, clipped_mass, logprob)

def diagnostic_sums(stats, sampler_logprobs, tau):
    """This step's sums over all ranks, from this rank's PositionStats of its completions' positions, in order, and
    vLLM's log-probs of the same tokens (one list per completion). gap = |vLLM's - trainer's log-prob|."""
    kl, device = stats.kl, stats.kl.device
    gap = (stats.logprob - torch.tensor(sum(sampler_logprobs, []), device=device)).abs()  # (N,)
    starts = [sum(map(len, sampler_logprobs[:i])) for i, lp in enumerate(sampler_logprobs) if lp]  # first positions
    local = {"tokens": len(kl), "kl": kl.sum(), "above_tau": (kl > tau).sum(), "clipped_mass": stats.clipped_mass.sum(),
             "first_kl": kl[starts].sum(), "first_tokens": len(starts), "gap": gap.sum()}
    sums = dict(zip(local, all_reduce(torch.tensor([float(v) for v in local.values()], device=device)).tolist()))
    gap_max = gap.max() if len(gap) else kl.new_zeros(())
    sums["gap_max"] = float(all_reduce(gap_max, dist.ReduceOp.MAX if dist.is_initialized() else None))
    return sums

def kl_window_means(window, kl_window):
    """Means over the newest steps (window: per-step sums) covering kl_window tokens; older steps leave `window`."""
    while len(window) > 1 and sum(w["tokens"] for w in list(window)[1:]) >= kl_window:
        window.popleft()
    w = {k: sum(step_sums[k] for step_sums in window) for k in ("tokens", "kl", "above_tau", "clipped_mass",
                                                                 "first_kl", "first_tokens")}
    return {"kl_mean": w["kl"] / max(w["tokens"], 1), "kl_frac_above_tau": w["above_tau"] / max(w["tokens"], 1),
            "kl_clipped_teacher_mass": w["clipped_mass"] / max(w["tokens"], 1),
            "kl_first_token": w["first_kl"] / max(w["first_tokens"], 1), "kl_window_tokens": int(w["tokens"])}

# -----------------------------------------------------------------------------
# The loss over a micro-batch: logits from hidden states, chunk by chunk, normalised by the step's tokens

def final_hidden(model, inputs):
    """(B, T, H) hidden states after the final norm, before the lm_head: the loss makes logits in chunks."""
    return model.base_model(**inputs, use_cache=False).last_hidden_state

def opsd_loss(student_hidden, student_mask, teacher_hidden, teacher_mask, lm_head_weight, num_tokens,
              targets=None, *, loss_positions=None, beta=0.0, temperature=1.0, clip="entry", tau=0.05, chunk_size=256):
    """(loss, stats): token_divergence summed over the masked positions / num_tokens, and the N positions'
    PositionStats when the sampled `targets` (N,) are given. Hidden states (B, T, H) are before the frozen lm_head;
    both masks select N positions in the same order; `loss_positions` (N,) keeps some out of the loss. Logits exist
    for `chunk_size` positions at a time (chunk x V, not B x T x V): each chunk's gradient w.r.t. the student hidden
    states is taken while its logits exist, then attached to the graph by a surrogate whose value is exactly 0."""
    hs, ht = student_hidden[student_mask], teacher_hidden[teacher_mask].detach()  # (N, H) each
    if hs.shape != ht.shape:
        raise ValueError(f"Student and teacher masks select {hs.shape[0]} and {ht.shape[0]} positions: must match.")
    keep = (torch.ones(hs.shape[0], device=hs.device) if loss_positions is None else loss_positions.float())  # (N,)
    W = lm_head_weight.detach()  # (V, H)
    need_grad = torch.is_grad_enabled() and hs.requires_grad
    total = hs.new_zeros((), dtype=torch.float32)
    grads, stats = [], []
    for i in range(0, hs.shape[0], chunk_size):
        h = hs[i:i + chunk_size].detach().requires_grad_(need_grad)  # (C, H)
        teacher_logits = ht[i:i + chunk_size] @ W.T  # (C, V)
        with torch.enable_grad() if need_grad else nullcontext():
            student_logits = h @ W.T  # (C, V)
            logps = log_probs(student_logits, teacher_logits, temperature)  # computed once: the diagnostics reuse them
            k = token_divergence(student_logits, teacher_logits, beta=beta, clip=clip, tau=tau, logps=logps)
            k = k * keep[i:i + chunk_size]  # (C,) skipped positions add nothing, not even gradient
            if need_grad:
                grads.append(torch.autograd.grad(k.sum(), h)[0])
        total = total + k.detach().sum()
        if targets is not None:
            stats.append(divergence_stats(student_logits.detach(), teacher_logits, targets[i:i + chunk_size],
                                          temperature=temperature, tau=tau, logps=[x.detach() for x in logps]))
    loss = total / max(num_tokens, 1)
    if need_grad:  # also with no positions at all, so backward still runs on every rank
        grad = torch.cat(grads) if grads else torch.zeros_like(hs)  # (N, H) d sum_n k_n / d hs
        surrogate = (hs * grad).sum() / max(num_tokens, 1)
        loss = loss + (surrogate - surrogate.detach())
    if targets is None:
        return loss, None
    empty = [hs.new_zeros(0, dtype=torch.float32)] * 3  # no position in this micro-batch
    return loss, PositionStats(*map(torch.cat, zip(*stats))) if stats else PositionStats(*empty)

# -----------------------------------------------------------------------------
# The teacher's weights: the base model (LoRA off), the student's own, or an EMA of the student's LoRA

@contextmanager
def lora_disabled(model):
    """The base model without copying it: the fixed teacher of the released recipe."""
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
    """Run with other LoRA values (the EMA teacher's) in place of the student's, then put the student's back."""
    student = [p.detach().clone() for p in lora_params]
    for p, v in zip(lora_params, values):
        p.copy_(v)
    try:
        yield
    finally:
        for p, s in zip(lora_params, student):
            p.copy_(s)

def teacher_weights(model, lora_params, teacher, ema):
    """The context manager of the teacher's forward; the EMA teacher is the student until the first step makes one."""
    if teacher == "base":
        return lora_disabled(model)
    if teacher == "ema" and ema is not None:
        return lora_values(lora_params, ema)
    return nullcontext()

@torch.no_grad()
def ema_update(ema, lora_params, decay):
    """The EMA teacher's LoRA after a step: at the first (ema None) a copy, then decay * ema + (1 - decay) * student."""
    if ema is None:
        return [p.detach().clone() for p in lora_params]
    for e, p in zip(ema, lora_params):
        e.mul_(decay).add_(p.detach(), alpha=1.0 - decay)
    return ema

# -----------------------------------------------------------------------------
# One optimizer step: forward and backward over micro-batches, the gradient summed over ranks; the LR schedule

def backward_step(model, lora_params, student_prompts, teacher_prompts, completions, *, pad_id, micro_batch_size,
                  teacher, ema=None, skip_first_tokens=0, **loss_kw):
    """(the step's loss, PositionStats of this rank's completion positions in order). Each micro-batch's loss is divided
    by the step's token count over micro-batches and ranks (less `skip_first_tokens` each): one big batch's gradient."""
    device = lora_params[0].device
    lm_head = model.get_output_embeddings().weight  # (V, H), frozen
    loss_tokens = sum(max(0, len(c) - skip_first_tokens) for c in completions)
    num_tokens = int(all_reduce(torch.tensor(loss_tokens, device=device)))
    loss_sum, stats = 0.0, []
    for mb in range(0, len(completions), micro_batch_size):
        rows = slice(mb, mb + micro_batch_size)
        student_inputs, student_mask = build_batch(student_prompts[rows], completions[rows], pad_id, device)
        teacher_inputs, teacher_mask = build_batch(teacher_prompts[rows], completions[rows], pad_id, device)
        with torch.no_grad(), teacher_weights(model, lora_params, teacher, ema):
            teacher_hidden = final_hidden(model, teacher_inputs)  # (B, T_teacher, H)
        student_hidden = final_hidden(model, student_inputs)  # (B, T_student, H)
        # hidden state t predicts token t + 1: shift the completion masks by one
        targets = student_inputs["input_ids"][:, 1:][student_mask[:, 1:]]  # (N,) the sampled tokens
        loss_positions = torch.tensor([j >= skip_first_tokens for c in completions[rows] for j in range(len(c))],
                                      device=device)
        loss, mb_stats = opsd_loss(student_hidden[:, :-1], student_mask[:, 1:], teacher_hidden[:, :-1],
                                   teacher_mask[:, 1:], lm_head, num_tokens, targets, loss_positions=loss_positions,
                                   **loss_kw)
        loss.backward()
        loss_sum += loss.item()
        stats.append(mb_stats)
    # one collective for all LoRA gradients; a sum, not DDP's mean: each loss is already divided by the global count
    grads = all_reduce(torch.cat([p.grad.flatten() for p in lora_params]))
    for p, g in zip(lora_params, grads.split([p.numel() for p in lora_params])):
        p.grad.copy_(g.view_as(p))
    loss_value = float(all_reduce(torch.tensor(loss_sum, device=device)))
    return loss_value, PositionStats(*map(torch.cat, zip(*stats)))  # one PositionStats per micro-batch, joined

def lr_at(step, *, lr, max_steps, warmup_steps=0, min_lr=0.0):
    """Learning rate of optimizer step `step` (0-based, 0 .. max_steps - 1)."""
    # 1) linear warmup: lr * (step + 1) / warmup_steps, so the first step already moves the weights
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    # 2) cosine decay: min_lr + (lr - min_lr) * (1 + cos(pi * progress)) / 2, reaching min_lr at max_steps
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))

# =============================================================================
# PART 2: THE RUN
# =============================================================================

# -----------------------------------------------------------------------------
# Config: every hyper-parameter, each range with its flag, then the rules that relate flags; the recipe's defaults

def checked(kind, ok, rule):
    """An argparse type: the flag's text read as `kind`, refused with "must be <rule>" unless ok(value)."""
    def parse(text):
        value = kind(text)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value
    parse.__name__ = kind.__name__  # argparse names the type in its own "invalid int value" sentence
    return parse

AT_LEAST_1, AT_LEAST_0 = checked(int, lambda v: v >= 1, "at least 1"), checked(int, lambda v: v >= 0, "0 or more")
POSITIVE, NON_NEGATIVE = checked(float, lambda v: v > 0, "positive"), checked(float, lambda v: v >= 0, "0 or more")
SHARE = checked(float, lambda v: 0 < v <= 1, "in (0, 1]")

def check_flags(args):
    """The rules that relate several flags (each flag's own range is its argparse type)."""
    checks = [
        (args.ema_decay is None or args.teacher == "ema", "--ema-decay needs --teacher ema."),
        (args.skip_first_tokens < args.max_new_tokens, "--skip-first-tokens must lie in [0, --max-new-tokens)."),
        (args.min_lr <= args.lr, "--min-lr must lie in [0, --lr]."),
        (args.warmup_steps < args.max_steps, "--warmup-steps must lie in [0, --max-steps)."),
        (args.prompts_per_step % (WORLD_SIZE * args.micro_batch_size) == 0,
         f"--prompts-per-step {args.prompts_per_step} must be divisible by ranks x --micro-batch-size "
         f"= {WORLD_SIZE} x {args.micro_batch_size}."),
        (not args.wandb_project or importlib.util.find_spec("wandb"), "--wandb-project needs wandb: pip install wandb"),
    ]
    for ok, message in checks:
        if not ok:
            fail(message)

def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="opsd.py", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="On-Policy Self-Distillation with a hand-rolled LoRA and vLLM rollouts. The dataset needs a "
                    "problem column and a privileged-context column (see --problem-column, --context-column).")
    g = p.add_argument_group("model")
    g.add_argument("--model", default="Qwen/Qwen3-1.7B", help="hub id or local path (student and teacher)")
    g.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="weights and activations")
    g.add_argument("--lora-r", type=AT_LEAST_1, default=64, help="LoRA rank r")
    g.add_argument("--lora-alpha", type=POSITIVE, default=128, help="LoRA alpha; the update is scaled by alpha / r")
    g.add_argument("--teacher", default="base", choices=["base", "current", "ema"], help="base: LoRA off")
    g.add_argument("--ema-decay", type=checked(float, lambda v: 0 < v < 1, "in (0, 1)"), help="ema's decay: 0.999")
    g.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=True, help="saves memory")
    g = p.add_argument_group("data and prompts")
    g.add_argument("--dataset", default="siyanzhao/Openthoughts_math_30k_opsd", help="hub id, .json, .jsonl, .parquet")
    g.add_argument("--dataset-split", default="train", help="split of a hub dataset")
    g.add_argument("--problem-column", default="problem", help="column holding the problem")
    g.add_argument("--context-column", default="solution", help="the teacher's privileged context; a,b joins two")
    g.add_argument("--data-select", default="all", choices=["all", "hard"], help="hard: the researcher's selection")
    g.add_argument("--student-prompt", default="recipe", choices=["recipe", "eval"], help="eval: eval.py's prompt")
    g.add_argument("--student-thinking", action=argparse.BooleanOptionalAction, default=False, help="enable_thinking")
    g.add_argument("--teacher-thinking", action=argparse.BooleanOptionalAction, default=True, help="enable_thinking")
    g.add_argument("--max-prompt-length", type=AT_LEAST_1, default=2048, help="rows with a longer prompt are dropped")
    g = p.add_argument_group("sampling (vLLM)")
    g.add_argument("--max-new-tokens", type=AT_LEAST_1, default=1024, help="answer length limit")
    g.add_argument("--temperature", type=checked(float, lambda v: 0 < v <= 2, "in (0, 2], vLLM's range"), default=1.1)
    g.add_argument("--top-p", type=SHARE, default=0.95, help="nucleus sampling threshold")
    g.add_argument("--top-k", type=checked(int, lambda v: v == -1 or v >= 1, "-1 (off) or at least 1"), default=20)
    g.add_argument("--vllm-memory", type=SHARE, default=0.3, help="share of each GPU's memory for vLLM (GPU only)")
    g = p.add_argument_group("loss")
    g.add_argument("--clip", default="entry", choices=CLIP_MODES, help="entry: min(d_v, tau); token: min(k, tau)")
    g.add_argument("--tau", type=POSITIVE, default=0.05, help="clip threshold (1e-6 in the non-thinking recipe)")
    g.add_argument("--beta", type=checked(float, lambda v: 0 <= v <= 1, "in [0, 1]"), default=0.0, help="0: forward KL")
    g.add_argument("--loss-temperature", type=POSITIVE, default=1.1, help="temperature of both logits in the loss")
    g.add_argument("--skip-first-tokens", type=AT_LEAST_0, default=0, help="answer positions left out of the loss")
    g.add_argument("--loss-chunk-size", type=AT_LEAST_1, default=256, help="positions whose logits exist at once")
    g = p.add_argument_group("optimization")
    g.add_argument("--max-steps", type=AT_LEAST_1, default=100, help="optimizer steps")
    g.add_argument("--prompts-per-step", type=AT_LEAST_1, default=32, help="prompts per optimizer step, all ranks")
    g.add_argument("--micro-batch-size", type=AT_LEAST_1, default=4, help="prompts per forward/backward on one rank")
    g.add_argument("--lr", type=POSITIVE, default=5e-6, help="peak learning rate (AdamW)")
    g.add_argument("--min-lr", type=NON_NEGATIVE, default=0.0, help="learning rate the cosine reaches at --max-steps")
    g.add_argument("--warmup-steps", type=AT_LEAST_0, default=0, help="linear warmup steps before the cosine decay")
    g.add_argument("--max-grad-norm", type=POSITIVE, default=0.1, help="gradient-norm clip")
    g = p.add_argument_group("run")
    g.add_argument("--output-dir", default="runs/opsd", help="checkpoints, final adapter, metrics, rollouts")
    g.add_argument("--seed", type=int, default=42, help="LoRA init, data order and every sampling seed")
    g.add_argument("--save-every", type=AT_LEAST_0, default=25, help="checkpoint every N steps (0: never)")
    once = g.add_mutually_exclusive_group()
    once.add_argument("--resume", action="store_true", help="continue the run in --output-dir from its last checkpoint")
    once.add_argument("--overwrite", action="store_true", help="delete the run --output-dir holds and start afresh")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda when available")
    g.add_argument("--kl-window", type=AT_LEAST_1, default=20_000, help="completion tokens the KL diagnostic averages")
    g.add_argument("--log-rollouts-every", type=AT_LEAST_0, default=10, help="rollouts.jsonl every N steps (0: never)")
    g.add_argument("--wandb-project", default=None, help="also log to Weights & Biases (needs wandb)")
    p.error = fail  # argparse's refusals (a bad value, a typo) in the one-sentence form of every other, said once
    args = p.parse_args(argv)
    check_flags(args)
    args.ema_decay = 0.999 if args.ema_decay is None else args.ema_decay
    return args

# -----------------------------------------------------------------------------
# The run: main() (generate, train, push, log, checkpoint), then how it starts: the device, the process group, and
# the environment vLLM's engine must run in

def main(argv=None):
    args = parse_args(argv)
    rank, world_size, device = init_distributed(args.device)
    is_main, per_rank, out_dir = rank == 0, args.prompts_per_step // world_size, Path(args.output_dir)
    with stopping_together(args, argv) as progress:
        # ---- every check a user can fail, before a model or vLLM loads, each rank its own, then agreed on
        logging.getLogger("huggingface_hub.utils._http").setLevel(logging.ERROR)  # offline: a dozen retry warnings
        with agreed():
            resume_from, saved_identity = check_output_dir(args, rank)
            load_config(args)
            tokenizer, prompts = load_prompts(args)

        # ---- model + LoRA: A drawn on the CPU from --seed, so every rank and device starts alike
        model, lora_params = load_model(args, device)
        run_identity = run_fingerprint(args, prompts, device)  # what a resume must find unchanged
        if resume_from:
            check_fingerprint(saved_identity, run_identity, resume_from)
        optimizer = torch.optim.AdamW(lora_params, lr=args.lr, betas=(0.9, 0.999), weight_decay=0.0)

        # ---- vLLM engine (a collective step: all ranks build theirs together)
        llm = start_engine(args, rank, world_size, device)
        start_step, ema, window = 0, None, deque()  # window: per-step diagnostic sums, newest last
        if resume_from:
            start_step, ema, window = restore(resume_from, model, lora_params, optimizer)
            push_checked(llm, model, out_dir)  # the fresh engine holds base weights
            print0(f"resumed from {resume_from} at step {start_step}")
        check_same_on_every_rank(lora_params)
        tracker = open_run(args, start_step, run_identity) if is_main else None
        loss_kw = dict(beta=args.beta, temperature=args.loss_temperature, clip=args.clip, tau=args.tau,
                       chunk_size=args.loss_chunk_size)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

        for step in range(start_step, args.max_steps):
            progress["step"] = step
            # ---- generate: this rank's shard of the step's prompts, one seed per request
            t0 = time.perf_counter()
            indices = step_indices(step, args.prompts_per_step, len(prompts), args.seed)
            mine = range(rank * per_rank, (rank + 1) * per_rank)
            seeds = [(args.seed * 1_000_003 + step * args.prompts_per_step + j) % 2**31 for j in mine]
            student_prompts, teacher_prompts = ([prompts[indices[j]][k] for j in mine] for k in (0, 1))
            completions, sampler_logprobs = sample(llm, student_prompts, seeds, args)
            t1 = time.perf_counter()

            # ---- train: loss = sum over the step's completion tokens / their count over micro-batches and ranks
            loss, stats = backward_step(model, lora_params, student_prompts, teacher_prompts, completions,
                                        pad_id=pad_id, micro_batch_size=args.micro_batch_size, teacher=args.teacher,
                                        ema=ema, skip_first_tokens=args.skip_first_tokens, **loss_kw)
            grad_norm = torch.nn.utils.clip_grad_norm_(lora_params, args.max_grad_norm).item()
            check_finite(step, loss, grad_norm, out_dir)
            lr = lr_at(step, lr=args.lr, max_steps=args.max_steps, warmup_steps=args.warmup_steps, min_lr=args.min_lr)
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if args.teacher == "ema":
                ema = ema_update(ema, lora_params, args.ema_decay)
            t2 = time.perf_counter()

            # ---- update inference engine weights, and read them back
            push_checked(llm, model, out_dir)
            t3 = time.perf_counter()
            if step == start_step and dist.is_initialized():  # all are up: a collective waits 5 min, or 4 first steps
                dist.distributed_c10d._set_pg_timeout(timedelta(seconds=max(300, 4 * (t3 - t0))))

            # ---- log: the KL diagnostic over the window, the gap over this step
            sums = diagnostic_sums(stats, sampler_logprobs, args.tau)
            window.append({k: v for k, v in sums.items() if k not in ("gap", "gap_max")})
            record = {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                      **kl_window_means(window, args.kl_window),
                      "logprob_gap_mean": sums["gap"] / max(sums["tokens"], 1), "logprob_gap_max": sums["gap_max"],
                      "completion_len_mean": sums["tokens"] / args.prompts_per_step,
                      "time_sample": t1 - t0, "time_train": t2 - t1, "time_push": t3 - t2,
                      "tokens_per_second": sums["tokens"] / (t3 - t0)}
            if is_main:
                every = args.log_rollouts_every
                due = every and (step == 0 or (step + 1) % every == 0 or step + 1 == args.max_steps)
                kls = stats.kl.split([len(c) for c in completions]) if due else []  # each token's KL(p_T || p_S)
                rollouts = [{"step": step + 1, "prompt_index": indices[j], "tokens": len(c), "completion":
                             tokenizer.decode(c), "token_ids": c, "kl": kl.tolist(), "skipped_by_loss":
                             min(args.skip_first_tokens, len(c))} for j, c, kl in zip(mine, completions, kls)]
                log_step(args, record, rollouts, tracker)  # rollouts: rank 0's share, when due

            # ---- checkpoint
            if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.max_steps:
                if is_main:
                    save_run_state(out_dir, model, lora_params, ema, args, state={
                        "step": step + 1, "optimizer": optimizer.state_dict(), "kl_window": list(window)})
                all_reduce(torch.zeros(1, device=device))  # a barrier: no rank runs ahead of the checkpoint

        # ---- teardown: the final adapter (and the EMA teacher's), in PEFT's layout; then the engine
        if is_main:
            save_run_state(out_dir, model, lora_params, ema, args)
            print(f"final adapter -> {out_dir / 'final'}")
            if tracker:
                tracker.finish()
        all_reduce(torch.zeros(1, device=device))  # a barrier: every rank here before the engines stop
        stop_engine(llm)
    if dist.is_initialized():
        dist.destroy_process_group()

def choose_attention_kernels():
    """SDPA's flash, memory-efficient, math; not cuDNN's (NaN for a row whose keys are all masked; as vLLM chooses)."""
    for kernel, on in (("flash", True), ("mem_efficient", True), ("math", True), ("cudnn", False)):
        getattr(torch.backends.cuda, f"enable_{kernel}_sdp")(on)

def init_distributed(device_flag):
    """(rank, world size, device); the process group under torchrun; the environment vLLM's engine must see."""
    if device_flag == "cuda" and not torch.cuda.is_available():
        fail("--device cuda, but no CUDA device is visible: use --device cpu.")
    use_cuda = device_flag == "cuda" or (device_flag == "auto" and torch.cuda.is_available())
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)  # vLLM builds its engine on the current device
    choose_attention_kernels()
    if WORLD_SIZE > 1:  # until the first step ends, a slow node may still be loading its model
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(minutes=30))
    # What the push needs, whatever was exported: the engine in this process (another process cannot take the weights'
    # generator); full-precision float32 matmuls in trainer and vLLM (a TF32 GEMM on the identity rounds the read-back).
    for name, value in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("VLLM_FLOAT32_MATMUL_PRECISION", "highest")):
        if os.environ.get(name, value) != value:
            print0(f"opsd.py: note: {name}={os.environ[name]} replaced by {value}: the weight push and its read-back "
                   "need it.", file=sys.stderr)
        os.environ[name] = value
    torch.set_float32_matmul_precision("highest")
    engine_environment(cpu=not use_cuda)
    return RANK, WORLD_SIZE, device

# -----------------------------------------------------------------------------
# Data reading: local JSON / JSONL / Parquet or a hub dataset, every bad row named by file and number

def load_prompts(args):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    rows = load_rows(args.dataset, args.dataset_split, args.problem_column, args.context_column, args.data_select)
    return tokenizer, build_prompts(tokenizer, rows, student_thinking=args.student_thinking,
                                    teacher_thinking=args.teacher_thinking, max_prompt_length=args.max_prompt_length,
                                    student_prompt=args.student_prompt)

def read_table(source, split, label, prog="opsd.py", offline="a local copy with --dataset FILE"):
    """Rows (dicts) of a local .json / .jsonl / .parquet file or a hub split; `label` names the source in a refusal."""
    path = Path(source).expanduser()
    if not path.is_file():
        if local_path(source):
            fail(f"{label}: no such file.", prog=prog)
        from datasets import load_dataset
        try:
            return [dict(row) for row in load_dataset(source, split=split)]
        except Exception as e:  # the hub's many failure types all mean the same to a user
            fail(f"{label}: cannot load split {split!r} from the hub ({str(e).splitlines()[0]}); without network, "
                 f"use {offline}.", prog=prog)
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq
        return pq.read_table(path).to_pylist()
    if path.suffix.lower() not in (".json", ".jsonl"):
        fail(f"{label}: a local file must be .json, .jsonl or .parquet.", prog=prog)
    text, rows = path.read_text(), []
    # one JSON array, or one JSON object per line
    for number, chunk in [(1, text)] if text.lstrip().startswith("[") else enumerate(text.splitlines(), 1):
        try:
            value = json.loads(chunk) if chunk.strip() else []
        except json.JSONDecodeError as e:
            fail(f"{label}, line {number + e.lineno - 1}: not valid JSON ({e.msg}).", prog=prog)
        rows.extend(value if isinstance(value, list) else [value])
    if not all(isinstance(row, dict) for row in rows):
        fail(f"{label}: every row must be a JSON object.", prog=prog)
    return rows

def check_columns(rows, source, needed_by, kinds, *columns, prog="opsd.py"):
    """Every row holds each of `columns` with a value of `kinds` (a bool is no number): else one sentence naming the
    column or the first bad row. `source` names the data (e.g. '--dataset FILE'), `needed_by` the flag that asks."""
    for column in columns:
        if column not in rows[0]:
            fail(f"{source} has no column {column!r} ({needed_by}); its columns are {list(rows[0])}.", prog=prog)
    names = {str: "a string", int: "a number", float: "a number"}
    noun = " or ".join(dict.fromkeys(names[k] for k in (kinds if isinstance(kinds, tuple) else (kinds,))))
    for number, row in enumerate(rows, 1):
        for column in columns:
            if not isinstance(row.get(column), kinds) or isinstance(row.get(column), bool):
                fail(f"{source}, row {number}: {column!r} is {row.get(column)!r}, not {noun}.", prog=prog)

def load_rows(dataset, split, problem_column, context_column, data_select="all"):
    """[(problem, privileged context)], after the --data-select rule. `context_column` may name several columns,
    comma-separated (e.g. solution,COT_Reason): their texts are joined with a blank line, in that order."""
    rows = read_table(dataset, split, f"--dataset {dataset}")
    if not rows:
        fail(f"--dataset {dataset} holds no rows.")
    context_columns = [c.strip() for c in context_column.split(",")]
    if not all(context_columns):
        fail(f"--context-column {context_column!r}: an empty column name; give one column, or columns as a,b.")
    check_columns(rows, f"--dataset {dataset}", "--problem-column", str, problem_column)
    check_columns(rows, f"--dataset {dataset}", "--context-column", str, *context_columns)
    if data_select == "hard":
        rows = select_hard(rows, dataset)
    return [(row[problem_column], "\n\n".join(row[c] for c in context_columns)) for row in rows]

def select_hard(rows, name):
    """The researcher's `hard` selection, where teacher and student disagree: 1) drop rows whose source is 'math'
    (KL near zero); 2) keep rows whose generated_token_count >= the element at len // 2 of the sorted counts."""
    check_columns(rows, f"--dataset {name}", "--data-select hard", str, "source")
    check_columns(rows, f"--dataset {name}", "--data-select hard", (int, float), "generated_token_count")
    kept = [r for r in rows if r["source"] != "math"]
    if not kept:
        fail(f"--data-select hard: every row of --dataset {name} has source 'math'.")
    threshold = sorted(r["generated_token_count"] for r in kept)[len(kept) // 2]
    kept = [r for r in kept if r["generated_token_count"] >= threshold]
    print0(f"data-select hard: {len(rows)} rows -> {len(kept)} (source != 'math', "
           f"generated_token_count >= {threshold})")
    return kept

# -----------------------------------------------------------------------------
# Model, adapters and checkpoints: LoRA on all seven projections after the model guards; adapters in PEFT's layout;
# checkpoints written aside and renamed, never half-written

def load_model(args, device):
    """The model with LoRA on all seven projections, after the guards."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).to(device)
    disable_dropout(model)
    refused = check_logits_path(model)
    if refused:
        fail(f"--model {args.model} ({model.config.model_type}) is not supported: {refused}.")
    try:
        lora_params = add_lora(model, args.lora_r, args.lora_alpha, seed=args.seed)
    except ValueError as e:
        fail(f"--model {args.model}: LoRA needs all of {', '.join(LORA_TARGETS)}, but {e}.")
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()  # for gradient checkpointing; dropout is off
    return model, lora_params

def disable_dropout(model):
    """No dropout, as in the recipe: train() (on for gradient checkpointing) would switch it on."""
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        elif isinstance(getattr(m, "attention_dropout", None), float):  # attention's own dropout probability
            m.attention_dropout = 0.0

ADAPTER_WEIGHTS, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"

def adapter_parameters(model):
    """{name in adapter_model.safetensors: parameter} for the A and B of every LoRA layer."""
    return {f"base_model.model.{name}.lora_{ab}.weight": getattr(m, f"lora_{ab}")
            for name, m in lora_layers(model).items() for ab in "AB"}

def save_adapter(model, out_dir, base_model_name_or_path):
    """The adapter in PEFT's layout, which PEFT, vLLM and eval.py read."""
    layers = lora_layers(model)
    tensors = {name: p.detach().cpu().contiguous() for name, p in adapter_parameters(model).items()}
    first = next(iter(layers.values()))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base_model_name_or_path),
              "r": first.r, "lora_alpha": first.alpha, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
              "target_modules": sorted({name.rsplit(".", 1)[-1] for name in layers}), "inference_mode": True}
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(Path(out_dir) / ADAPTER_WEIGHTS))
    (Path(out_dir) / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")

@torch.no_grad()
def load_adapter(model, adapter_dir):
    """Copy a checkpoint's adapter into the model's LoRA (--resume has checked its flags and that its files load)."""
    tensors = load_file(str(Path(adapter_dir) / ADAPTER_WEIGHTS))
    for name, p in adapter_parameters(model).items():
        p.copy_(tensors[name])

def restore(checkpoint, model, lora_params, optimizer):
    """Load a checkpoint into the model and optimizer; returns (step, EMA weights or None, KL window)."""
    state = torch.load(checkpoint / "trainer_state.pt", map_location="cpu", weights_only=True)  # then to any device
    optimizer.load_state_dict(state["optimizer"])
    ema = None
    if (checkpoint / "ema").is_dir():
        load_adapter(model, checkpoint / "ema")
        ema = [p.detach().clone() for p in lora_params]
    load_adapter(model, checkpoint)
    return state["step"], ema, deque(state["kl_window"])

def save_run_state(out_dir, model, lora_params, ema, args, state=None):
    """checkpoint-<step>/ (with `state`) or final/: the adapters (the EMA teacher's in ema/), step, optimizer and
    KL window, flushed; no RNG state: data order and sampling seeds are functions of (seed, step)."""
    final_dir = Path(out_dir) / (f"checkpoint-{state['step']}" if state else "final")
    tmp = final_dir.with_name(f".tmp-{final_dir.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    save_adapter(model, tmp, args.model)
    if ema is not None:
        with lora_values(lora_params, ema):
            save_adapter(model, tmp / "ema", args.model)
    if state is not None:
        torch.save(state, tmp / "trainer_state.pt")
    for path in [*tmp.rglob("*"), tmp]:  # on disk before the rename, and the rename after it: a power loss leaves
        flush(path)                      # the old checkpoint or the new one, whole
    shutil.rmtree(final_dir, ignore_errors=True)
    os.rename(tmp, final_dir)
    flush(final_dir.parent)

def flush(path):
    """fsync a file or a directory (a directory's entries: a rename in it)."""
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)

# -----------------------------------------------------------------------------
# Logs: args.json, the step line, metrics.jsonl and rollouts.jsonl; Weights & Biases when asked

def open_run(args, start_step, run_identity):
    """Rank 0: delete the old run (--overwrite), record the flags and the run fingerprint, cut the logs back to the
    resumed step (dropping records of later steps and a line a kill cut short), start Weights & Biases when asked."""
    out_dir = Path(args.output_dir)
    if args.overwrite:
        for path in run_files(out_dir):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    record = {**vars(args), "fingerprint": run_identity}  # the flags, and what a resume must find unchanged
    out_dir.mkdir(parents=True, exist_ok=True)  # the first thing a run writes: every check has passed
    write_atomically(out_dir / "args.json", json.dumps(record, indent=2) + "\n")
    for path in (out_dir / "metrics.jsonl", out_dir / "rollouts.jsonl"):
        if path.exists():
            keep = [line for line in path.read_text().splitlines() if record_step(line) <= start_step]
            write_atomically(path, "".join(line + "\n" for line in keep))
    if args.wandb_project:
        import wandb
        return wandb.init(project=args.wandb_project, name=out_dir.name, config=vars(args), dir=str(out_dir))
    return None

def record_step(line):
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):  # the tail of a write that a kill cut short
        return math.inf

def write_atomically(path, text):
    tmp = path.with_name(f".tmp-{path.name}")
    tmp.write_text(text)
    flush(tmp)
    os.replace(tmp, path)

GAP_ALARM = {"float32": 1e-4, "bfloat16": 5e-2}  # the gap's floor on CPU kernels: ~1e-6, ~1e-2; a warning, no stop

def log_step(args, record, rollouts, tracker):
    """Rank 0: the step line, metrics.jsonl, the rollouts when due (rollouts.jsonl), Weights & Biases."""
    step, out_dir = record["step"], Path(args.output_dir)
    stale = record["logprob_gap_mean"] > GAP_ALARM[args.dtype]
    line = ("step {step:4d}/{max_steps} | loss {loss:.4f} | lr {lr:.2e} | grad {grad_norm:.4f} | kl {kl_mean:.4f} "
            ">tau {kl_frac_above_tau:.1%} | len {completion_len_mean:.0f} | sample {time_sample:.1f}s train "
            "{time_train:.1f}s push {time_push:.2f}s | {tokens_per_second:.0f} tok/s | gap {logprob_gap_mean:.1e}/"
            "{logprob_gap_max:.1e}").format(**record, max_steps=args.max_steps)
    print(line + (f" <- gap above the {args.dtype} noise floor measured on CPU: stale weights or wrong positions?"
                  if stale else ""), flush=True)
    with open(out_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    if rollouts:
        with open(out_dir / "rollouts.jsonl", "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rollouts)
    if tracker:
        import wandb
        table = rollouts and wandb.Table(columns=list(rollouts[0]), data=[list(r.values()) for r in rollouts])
        tracker.log({**record, **({"rollouts": table} if rollouts else {})}, step=step)

# =============================================================================
# PART 3: WHAT KEEPS A RUN HONEST
# =============================================================================

# -----------------------------------------------------------------------------
# Resume: never overwrite a run unless told to; resume only the same run (flags, prompts, model, device)

# flags a resumed run may change: they cannot change what the run computes, only how or what it logs
RESUMABLE_CHANGES = ("output_dir", "resume", "overwrite", "micro_batch_size", "gradient_checkpointing",
                     "loss_chunk_size", "vllm_memory", "device", "save_every", "kl_window", "log_rollouts_every",
                     "wandb_project")

def run_files(out_dir):  # what a run leaves in its directory
    names = ["args.json", "metrics.jsonl", "rollouts.jsonl", "final"]
    return [out_dir / n for n in names if (out_dir / n).exists()] + sorted(out_dir.glob("checkpoint-*"))

def latest_checkpoint(out_dir):
    steps = [int(d.name.split("-")[1]) for d in Path(out_dir).glob("checkpoint-*") if (d / "trainer_state.pt").exists()]
    return Path(out_dir) / f"checkpoint-{max(steps)}" if steps else None

def check_output_dir(args, rank):
    """Before anything loads: (checkpoint to resume, its recorded fingerprint), (None, None) if new, or why not."""
    out_dir = Path(args.output_dir)
    try:  # every rank probes with its own file, in it or the nearest directory above that exists: nothing is made
        probe = next(p for p in (out_dir, *out_dir.parents) if p.exists()) / f".write-test-{rank}"  # before open_run
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        fail(f"--output-dir {out_dir} is not writable ({e.strerror}).")
    existing = run_files(out_dir)
    if not args.resume:
        if existing and not args.overwrite:
            fail(f"--output-dir {out_dir} already holds a run ({', '.join(p.name for p in existing[:3])}): pass "
                 "--resume to continue it, --overwrite to replace it, or choose another --output-dir.")
        return None, None
    if not (out_dir / "args.json").is_file():
        fail(f"--resume: {out_dir} holds no run to resume (no args.json)" + (WORLD_SIZE > 1) * "; across nodes "
             "--output-dir must be one directory that every rank sees" + ".")
    saved = json.loads((out_dir / "args.json").read_text())
    if "fingerprint" not in saved:
        fail(f"--resume: {out_dir / 'args.json'} records no run fingerprint (an older opsd.py wrote it), so the "
             "resumed steps cannot be checked against the run's: start a new run in another --output-dir.")
    changed = ["--" + k.replace("_", "-") for k, v in vars(args).items()
               if k not in RESUMABLE_CHANGES and saved.get(k) != v]
    if changed:
        fail(f"--resume with other {', '.join(changed)} than the run in {out_dir} would change its results: "
             "use the same values, or start a new run in another --output-dir.")
    if (out_dir / "final").exists():
        fail(f"--resume: the run in {out_dir} has finished ({out_dir / 'final'} exists); nothing to resume.")
    checkpoint = latest_checkpoint(out_dir)
    if checkpoint is None:
        fail(f"--resume: {out_dir} holds no checkpoint yet; restart the run with --overwrite.")
    load = {".safetensors": load_file, ".json": lambda f: json.loads(f.read_text()),
            ".pt": lambda f: torch.load(f, map_location="cpu", weights_only=True)}
    for path in sorted(checkpoint.rglob("*.*")):  # every file loads, before a model does: a write cut short
        try:
            load[path.suffix](path)
        except Exception as e:  # a damaged file fails in its loader's own way: each means the same to a user
            fail(f"--resume: {path} does not load ({type(e).__name__}): delete {checkpoint} to resume from the "
                 "checkpoint before it, or start afresh with --overwrite.")
    return checkpoint, saved["fingerprint"]

def run_fingerprint(args, prompts, device):
    """What a resume must find unchanged, by content: the prompts (their number and a hash of their token ids:
    together they fix every step's data), the model's files and the device type (CPU and CUDA sample apart)."""
    ids = hashlib.sha256()
    for student, teacher in prompts:
        ids.update(array("q", [len(student), len(teacher), *student, *teacher]).tobytes())
    return {"prompts": len(prompts), "prompt_ids_sha256": ids.hexdigest(), "model": model_fingerprint(args.model),
            "device": device.type}

def model_fingerprint(model):
    """sha256 of config.json and each weight file's name, size and 16 evenly spaced 64 KiB samples (all of it under
    1 MiB): cheap at any size. None unless a local directory or cached hub snapshot holds the weights (no network)."""
    folder = model_dir(model)
    weights = (sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin"))) if folder else []
    if not weights or not (folder / "config.json").is_file():
        return None
    digest, chunk = hashlib.sha256((folder / "config.json").read_bytes()), 64 << 10
    for path in weights:
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        read = chunk if size >= 16 * chunk else size
        with open(path, "rb") as f:
            for k in range(16 if read < size else 1):
                f.seek(k * (size - read) // 15)
                digest.update(f.read(read))
    return digest.hexdigest()

def model_dir(model):
    """A local model's directory, or a hub model's cached snapshot; None if neither."""
    if Path(model).expanduser().is_dir():
        return Path(model).expanduser().resolve()
    from huggingface_hub import try_to_load_from_cache
    try:
        config = try_to_load_from_cache(model, "config.json")
    except ValueError:  # not a hub id either
        return None
    return Path(config).parent.resolve() if isinstance(config, str) else None

def check_fingerprint(saved, current, checkpoint):
    """The run fingerprint args.json recorded (`saved`) against this run's: the same prompts, model files, device."""
    what = {"prompts": "the number of prompts", "prompt_ids_sha256": "the prompts' token ids",
            "model": "the model's files", "device": "the device type"}
    changed = [f"{what[k]} ({saved.get(k)} -> {v})" for k, v in current.items() if saved.get(k) != v]
    if changed:
        fail(f"--resume: {', '.join(changed)} changed since {checkpoint} was written, so the resumed steps would "
             "differ from the run's: resume with the same data, model and device, or start a new --output-dir.")

# -----------------------------------------------------------------------------
# Model guards: the loss assumes logits = final hidden state @ lm_head.weight^T and all seven LoRA projections

def local_path(value):
    """True when `value` names a local file or directory rather than a hub id (org/name)."""
    path = Path(value).expanduser()
    return (path.exists() or value.startswith((".", "/", "~")) or value.count("/") > 1
            or (len(path.parts) > 1 and Path(path.parts[0]).is_dir()))

def load_config(args):
    """The config, before anything big loads: fields that change logits refused; prompt + answer must fit."""
    from transformers import AutoConfig, AutoModelForCausalLM
    if local_path(args.model) and not Path(args.model).expanduser().is_dir():
        fail(f"--model {args.model}: no such directory.")
    try:
        config = AutoConfig.from_pretrained(args.model)
    except (OSError, ValueError) as e:
        fail(f"--model {args.model}: cannot load its config ({str(e).splitlines()[0]}).")
    for field in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(config, field, None) not in (None, 1):
            fail(f"--model {args.model} ({config.model_type}) is not supported: its config sets {field} = "
                 f"{getattr(config, field)}, but the loss builds logits as final_hidden @ lm_head.weight^T.")
    if args.device == "auto" and not torch.cuda.is_available():  # never a GPU-sized run on the CPU by default
        with torch.device("meta"):  # the parameter count, no weights
            size = AutoModelForCausalLM.from_config(config).num_parameters()
        if size > 1e8:  # parameters (the test models: 0.8M)
            cuda = f"built for CUDA {torch.version.cuda}, finds no GPU" if torch.version.cuda else "a CPU-only build"
            fail(f"--device auto: no CUDA device is visible (CUDA_VISIBLE_DEVICES="
                 f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}; torch {torch.__version__}: {cuda}), and --model "
                 f"{args.model} has {size / 1e9:.2f}B parameters, more than auto trains on a CPU (0.1B): "
                 "make a GPU visible (nvidia-smi lists what the driver offers), or pass --device cpu to use the CPU.")
    context = getattr(config, "max_position_embeddings", None)
    if context and args.max_prompt_length + args.max_new_tokens > context:
        fail(f"--max-prompt-length {args.max_prompt_length} + --max-new-tokens {args.max_new_tokens} exceeds the "
             f"model's context of {context} tokens: lower one of them.")
    return config

@torch.no_grad()
def check_logits_path(model):
    """None when final_hidden @ lm_head.weight^T reproduces the model's logits on a 16-token probe, else why not.
    A model whose forward does more (soft-capping, scaling, an lm_head bias) would get a silently wrong loss."""
    if getattr(model.get_output_embeddings(), "bias", None) is not None:
        return "its lm_head has a bias"
    positions = torch.arange(16, device=model.device)[None]  # (1, 16)
    ids = (positions + 3) % model.config.vocab_size
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=positions)
    training = model.training
    try:
        model.eval()  # no dropout in either forward
        want = model(**inputs, use_cache=False).logits.float()  # (1, 16, V)
        got = (final_hidden(model, inputs) @ model.get_output_embeddings().weight.T).float()
    except (AttributeError, TypeError) as e:
        return f"its hidden states cannot be taken apart from its logits ({e})"
    finally:
        model.train(training)
    if not torch.allclose(got, want, rtol=1e-2, atol=1e-3 * float(want.abs().max())):
        return "its logits are not final_hidden @ lm_head.weight^T (soft-capping, scaling or a bias?)"
    return None

def check_same_on_every_rank(lora_params):
    """One all-reduce of (checksum, -checksum) with MAX: every rank then knows the largest and the smallest."""
    checksum = torch.cat([p.detach().flatten() for p in lora_params]).double().sum()
    high, neg_low = all_reduce(torch.stack([checksum, -checksum]), dist.ReduceOp.MAX).tolist()
    if high != -neg_low:
        fail(f"the ranks hold different LoRA weights (checksums {-neg_low!r} to {high!r}); they must start from the "
             "same adapter: check that every rank runs the same opsd.py, torch and --seed, and resumes the same files.")

# -----------------------------------------------------------------------------
# While it runs: each push read back, no update from a non-finite loss; a rank that stops says why, none waits for it

def push_checked(llm, model, out_dir):
    """push_weights; when a rank's engine does not hold what was sent, every rank stops and the lowest such says why."""
    problem = push_weights(llm, model)
    first = int(all_reduce(torch.tensor(RANK if problem else WORLD_SIZE, device=model.device), dist.ReduceOp.MIN))
    if first < WORLD_SIZE:
        fail(f"{problem} Stopped; the last checkpoint is {latest_checkpoint(out_dir) or 'none'}.", speaker=first)

def check_finite(step, loss, grad_norm, out_dir):
    """Stop before an update that would write NaN or inf into the adapter (a NaN loss at step 1 on a GPU: README)."""
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        fail(f"step {step + 1}: non-finite loss ({loss}) or gradient norm ({grad_norm}); "
             f"stopped before the update, last checkpoint: {latest_checkpoint(out_dir) or 'none'}.")

def words_of_ranks(word, wait=True):
    """Leave this rank's word in torchrun's store (every node reaches it); {rank: its word, or None after 5 s}."""
    try:
        store, attempt = dist.distributed_c10d._get_default_store(), os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)
        keys = [f"opsd/{attempt}/stopped/{r}" for r in range(WORLD_SIZE)]
        store.set(keys[RANK], word)
        with suppress(RuntimeError, dist.DistError):  # a rank that never answers: the wait times out
            store.wait(keys, timedelta(seconds=5)) if wait else None
        return {r: store.get(k).decode() if store.check([k]) else None for r, k in enumerate(keys)}
    except (RuntimeError, ValueError, dist.DistError):  # no process group, or its store is gone
        return {RANK: word}

@contextmanager
def stopping_together(args, argv):
    """However a rank stops, it says why in one line, and the others end with it (one node: torchrun signals them;
    across nodes: the collective timeout). Its own refusal or error (an out-of-memory in a sentence, a bug with its
    traceback) is said by it and left in torchrun's store; after a signal or a lost rank, rank 0 says an interrupt of
    all (with the command that resumes), else each names the rank that stopped first; then it exits at once."""
    progress = {"step": None, "signal": None}

    def on_signal(signum, frame):
        progress["signal"] = signum
        raise KeyboardInterrupt
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield progress
    except BaseException as e:
        for s in previous:  # torchrun's SIGTERM, when another rank ends, must not cut this short
            signal.signal(s, signal.SIG_IGN)
        step, last, sig = progress["step"], latest_checkpoint(args.output_dir), progress["signal"]
        where = f"at step {step + 1} of {args.max_steps}" if step is not None else "before the first step"
        if sig is None and not isinstance(e, RankLost):  # this rank's own refusal or error
            oom = isinstance(e, torch.OutOfMemoryError)
            text = e.text if isinstance(e, Refusal) else error_file(
                f"opsd.py: error: rank {RANK}: out of memory {where} ({str(e).splitlines()[0]}): lower "
                f"--micro-batch-size, --loss-chunk-size or --vllm-memory; the last checkpoint is {last or 'none'}."
            ) if oom else f"{type(e).__name__}: {e}"
            words_of_ranks(text, wait=False)
            if not oom:
                raise
            print(text, file=sys.stderr, flush=True)
            os._exit(1)
        words = words_of_ranks("signal" if sig else "lost")
        first = min((r for r, w in words.items() if w not in ("signal", "lost")), default=None)
        if first is None:  # every rank signalled (the user's Ctrl-C, a scheduler's stop), or left with them
            command = [a for a in (sys.argv[1:] if argv is None else argv) if a not in ("--overwrite", "--resume")]
            launcher = f"torchrun --nproc_per_node {WORLD_SIZE}" if WORLD_SIZE > 1 else "python"
            resume = f"continue with: {launcher} opsd.py {shlex.join(command)} --resume"
            print0(error_file(f"opsd.py: interrupted {where}; " + (f"the last checkpoint is {last}; {resume}" if last
                   else "no checkpoint yet, so nothing to resume.")), file=sys.stderr)
        else:
            why = "stopped first (its error is in its log)" if words[first] else "ended without a word (killed?)"
            print(error_file(f"opsd.py: rank {RANK} stopped {where}: rank {first} {why}; the last checkpoint is "
                             f"{last or 'none'}."), file=sys.stderr, flush=True)
        os._exit(128 + sig if sig else 1)  # not vLLM's teardown, which could wait on a dead rank
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)

if __name__ == "__main__":
    # torch's recorder: an error escaping main() (a bug, not a refusal) goes into torchrun's report with its traceback
    from torch.distributed.elastic.multiprocessing.errors import record
    record(main)()
