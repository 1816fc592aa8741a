"""
On-Policy Self-Distillation (OPSD) for LLM reasoning, in one file.

    torchrun --nproc_per_node 4 opsd.py --clip token        # Qwen3-1.7B, the released recipe's budget
    python opsd.py --model DIR --dataset FILE.jsonl ...      # one process, no torchrun
    torchrun --nproc_per_node 2 opsd.py --model runs/tiny-qwen3 --dataset tests/data/math_train.jsonl \\
        --device cpu --dtype float32 --max-steps 5 --prompts-per-step 8 --micro-batch-size 2   # CPU quickstart

One model plays two roles. The student sees only the problem; the teacher is the same network
whose prompt also holds a reference solution. Each optimizer step:
  1. the student samples an answer to each problem with vLLM (one engine per rank),
  2. the teacher (the base model: LoRA switched off) scores that answer under no_grad,
  3. the student's next-token distributions are pulled towards the teacher's with a
     full-vocabulary forward KL at every answer position; only LoRA weights train,
  4. the merged LoRA weights are pushed into the running vLLM engine in place.

Departures from the released recipe (METHOD.md section 6 lists the problems they fix):
  1. Left padding with positions from the attention mask: every answer token is scored at the
     position vLLM sampled it at (the released code right-pads prompts, shifting RoPE positions).
  2. Prompts reach vLLM as token ids, never decoded and re-encoded.
  3. LoRA is merged out of place for vLLM; the base weights (the fixed teacher) never change.
  4. The loss is float32, normalised by the optimizer step's total token count across
     micro-batches and ranks, computed in chunks from hidden states (no B x T x V logits).
  5. A cosine LR schedule over the real step budget; `--clip token` as an alternative to the
     per-entry clip (the released recipe's `--clip entry` stays the default).
"""

import argparse
import json
import math
import os
import shutil
import time
from collections import deque
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

# -----------------------------------------------------------------------------
# Config: every hyper-parameter of the run, defaults from the released recipe (METHOD.md section 4)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="On-Policy Self-Distillation with a hand-rolled LoRA and vLLM rollouts.")
    g = p.add_argument_group("model")
    g.add_argument("--model", default="Qwen/Qwen3-1.7B", help="hub id or local path of the model (student and teacher)")
    g.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="weights and activations; float32 for exact CPU checks")
    g.add_argument("--lora-r", type=int, default=64, help="LoRA rank r")
    g.add_argument("--lora-alpha", type=float, default=128, help="LoRA alpha; the update is scaled by alpha / r")
    g.add_argument("--teacher", default="base", choices=["base", "current"],
                   help="base: the model with LoRA switched off (fixed teacher); current: the student's own weights")
    g.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=True,
                   help="recompute activations in backward to fit long answers in memory")
    g = p.add_argument_group("data and prompts")
    g.add_argument("--dataset", default="siyanzhao/Openthoughts_math_30k_opsd",
                   help="hub dataset id, or a local .json / .jsonl / .parquet file")
    g.add_argument("--dataset-split", default="train", help="split of a hub dataset")
    g.add_argument("--problem-column", default="problem", help="column holding the problem")
    g.add_argument("--context-column", default="solution",
                   help="column holding the teacher's privileged context (COT_Reason: the long verified trace)")
    g.add_argument("--student-thinking", action=argparse.BooleanOptionalAction, default=False,
                   help="enable_thinking in the student's chat template")
    g.add_argument("--teacher-thinking", action=argparse.BooleanOptionalAction, default=True,
                   help="enable_thinking in the teacher's chat template")
    g.add_argument("--max-prompt-length", type=int, default=2048,
                   help="rows whose student or teacher prompt has more tokens are dropped at load time")
    g = p.add_argument_group("sampling (vLLM)")
    g.add_argument("--max-new-tokens", type=int, default=1024, help="answer length limit")
    g.add_argument("--temperature", type=float, default=1.1, help="sampling temperature")
    g.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling threshold")
    g.add_argument("--top-k", type=int, default=20, help="top-k sampling (-1: off)")
    g.add_argument("--vllm-memory", type=float, default=0.3,
                   help="fraction of each GPU's memory the vLLM engine may take (GPU only)")
    g = p.add_argument_group("loss")
    g.add_argument("--clip", default="entry", choices=list(CLIP_MODES),
                   help="entry: min(d_v, tau) per vocabulary entry (released recipe); token: min(k, tau) per "
                        "position with the gradient direction kept; none: no clipping")
    g.add_argument("--tau", type=float, default=0.05, help="clip threshold (1e-6 in the non-thinking recipe)")
    g.add_argument("--beta", type=float, default=0.0, help="0: forward KL(T||S); 1: reverse KL; between: generalized JSD")
    g.add_argument("--loss-temperature", type=float, default=1.1, help="temperature applied to both logits in the loss")
    g = p.add_argument_group("optimization")
    g.add_argument("--max-steps", type=int, default=100, help="optimizer steps")
    g.add_argument("--prompts-per-step", type=int, default=32, help="prompts per optimizer step, across all ranks")
    g.add_argument("--micro-batch-size", type=int, default=4, help="prompts per forward/backward on one rank")
    g.add_argument("--lr", type=float, default=5e-6, help="peak learning rate (AdamW)")
    g.add_argument("--min-lr", type=float, default=0.0, help="learning rate the cosine reaches at --max-steps")
    g.add_argument("--warmup-steps", type=int, default=0, help="linear warmup steps before the cosine decay")
    g.add_argument("--max-grad-norm", type=float, default=0.1, help="gradient-norm clip")
    g = p.add_argument_group("run")
    g.add_argument("--output-dir", default="runs/opsd", help="checkpoints, final adapter, metrics.jsonl, rollouts.jsonl")
    g.add_argument("--seed", type=int, default=42, help="LoRA init, data order and every sampling seed")
    g.add_argument("--save-every", type=int, default=25, help="write a checkpoint every this many steps (0: never)")
    g.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --output-dir")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda when available")
    g.add_argument("--kl-window", type=int, default=20_000, help="completion tokens the KL diagnostic averages over")
    g.add_argument("--log-rollouts-every", type=int, default=10, help="write sampled answers to rollouts.jsonl every N steps")
    args = p.parse_args(argv)
    checks = [
        (args.max_steps > 0, "--max-steps must be positive."),
        (0 <= args.warmup_steps < args.max_steps, "--warmup-steps must lie in [0, --max-steps)."),
        (0.0 <= args.beta <= 1.0, "--beta must lie in [0, 1]."),
        (args.tau > 0 and args.loss_temperature > 0 and args.temperature > 0, "--tau and the temperatures must be positive."),
        (args.micro_batch_size > 0 and args.prompts_per_step > 0, "--prompts-per-step and --micro-batch-size must be positive."),
    ]
    for ok, message in checks:
        if not ok:
            p.error(message)
    return args


# -----------------------------------------------------------------------------
# Distributed: torchrun sets RANK / WORLD_SIZE; plain `python opsd.py` is a world of one


def init_distributed(device_flag):
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if device_flag == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda, but no CUDA device is visible: use --device cpu.")
    use_cuda = device_flag == "cuda" or (device_flag == "auto" and torch.cuda.is_available())
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)  # vLLM builds its engine on the current device
    if world_size > 1:
        dist.init_process_group("nccl" if use_cuda else "gloo")
    return rank, world_size, device


def all_reduce(tensor, op=None):
    """Sum (or `op`) over ranks, in place; a no-op in a world of one."""
    if dist.is_initialized():
        dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM)
    return tensor


def print0(*a, **kw):
    if int(os.environ.get("RANK", 0)) == 0:
        print(*a, **kw, flush=True)


# -----------------------------------------------------------------------------
# LoRA, hand-rolled: y = W x + (alpha / r) B A x on every attention and MLP projection

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update.

    `weight` and `bias` are the wrapped layer's own tensors, registered under the same names,
    so the model's parameter names (and so the names vLLM expects) do not change. A and B are
    float32 even in a bf16 model: updates of lr 5e-6 would round away in bf16.
    """

    def __init__(self, base: nn.Linear, r: int, alpha: float):
        super().__init__()
        self.weight, self.bias = base.weight, base.bias  # (out, in), (out,) or None
        self.r, self.alpha, self.scale = r, alpha, alpha / r
        self.lora_A = nn.Parameter(torch.empty(r, base.in_features, device=base.weight.device))  # (r, in)
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r, device=base.weight.device))  # (out, r)
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # B = 0, so training starts at the base model
        self.enabled = True

    def forward(self, x):
        y = F.linear(x, self.weight, self.bias)
        if not self.enabled:
            return y
        update = F.linear(F.linear(x.to(self.lora_A.dtype), self.lora_A), self.lora_B)  # B A x
        return y + (self.scale * update).to(y.dtype)

    def merged_weight(self):
        # W + (alpha / r) B A, out of place and in the model dtype: W itself is never touched,
        # so the base model (the fixed teacher) cannot drift from repeated merges.
        return (self.weight.float() + self.scale * (self.lora_B @ self.lora_A)).to(self.weight.dtype)


def add_lora(model, r, alpha, targets=LORA_TARGETS):
    """Wrap every nn.Linear child named in `targets`, freeze all else; return the LoRA parameters."""
    for p in model.parameters():
        p.requires_grad_(False)
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if child_name in targets and isinstance(child, nn.Linear):
                setattr(module, child_name, LoRALinear(child, r, alpha))
    layers = lora_layers(model)
    if not layers:
        raise ValueError(f"The model has no linear layer named any of {list(targets)}: choose other LoRA targets.")
    return [p for m in layers.values() for p in (m.lora_A, m.lora_B)]


def lora_layers(model):
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


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


@torch.no_grad()
def merged_weights(model):
    """Yield (HF parameter name, merged weight) per LoRA layer, ready to push into vLLM. A generator:
    a push holds one merged matrix at a time, never a second copy of the model."""
    for name, m in lora_layers(model).items():
        yield f"{name}.weight", m.merged_weight()


# Adapters are stored in PEFT's on-disk layout so PEFT, vLLM's LoRA loader and eval.py read them.
ADAPTER_WEIGHTS, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"


def save_adapter(model, out_dir, base_model_name_or_path):
    layers = lora_layers(model)
    tensors = {}
    for name, m in layers.items():
        tensors[f"base_model.model.{name}.lora_A.weight"] = m.lora_A.detach().cpu().contiguous()
        tensors[f"base_model.model.{name}.lora_B.weight"] = m.lora_B.detach().cpu().contiguous()
    first = next(iter(layers.values()))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base_model_name_or_path),
        "r": first.r,
        "lora_alpha": first.alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "target_modules": sorted({name.rsplit(".", 1)[-1] for name in layers}),
        "inference_mode": True,
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / ADAPTER_WEIGHTS))
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")


@torch.no_grad()
def load_adapter(model, adapter_dir):
    """Copy a saved adapter into a model that already has LoRA layers of the same shape."""
    adapter_dir = Path(adapter_dir)
    if not (adapter_dir / ADAPTER_WEIGHTS).is_file():
        raise FileNotFoundError(f"No {ADAPTER_WEIGHTS} in {adapter_dir}: pass a directory written by opsd.py.")
    config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    tensors = load_file(str(adapter_dir / ADAPTER_WEIGHTS))
    layers = lora_layers(model)
    first = next(iter(layers.values()))
    if (config["r"], config["lora_alpha"]) != (first.r, first.alpha):
        raise ValueError(
            f"Adapter in {adapter_dir} has r={config['r']}, alpha={config['lora_alpha']} but the model's LoRA has "
            f"r={first.r}, alpha={first.alpha}: use the same --lora-r and --lora-alpha."
        )
    expected = {f"base_model.model.{n}.lora_{ab}.weight" for n in layers for ab in "AB"}
    if set(tensors) != expected:
        raise ValueError(f"Adapter in {adapter_dir} targets other modules than this model's LoRA layers.")
    for name, m in layers.items():
        m.lora_A.copy_(tensors[f"base_model.model.{name}.lora_A.weight"])
        m.lora_B.copy_(tensors[f"base_model.model.{name}.lora_B.weight"])


# -----------------------------------------------------------------------------
# Prompts and data (METHOD.md sections 2-3): the released recipe's strings, through the chat template

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
TRANSITION = (
    "\n\nAfter reading the reference solution above, make sure you truly understand the reasoning behind each "
    "step \u2014 do not copy or paraphrase it. Now, using your own words and independent reasoning, derive the same "
    "final answer to the problem above. Think step by step, explore different approaches, and don't be afraid to "
    "backtrack or reconsider if something doesn't work out:\n"
)


def student_message(problem):
    return f"Problem: {problem}\n\n{INSTRUCTION}"


def teacher_message(problem, context):
    return (
        f"Problem: {problem}\n\n"
        "Here is a reference solution to this problem:\n"
        f"=== Reference Solution Begin ===\n{context}\n=== Reference Solution End ===\n"
        f"{TRANSITION}\n"
        f"{INSTRUCTION}"
    )


def render(tokenizer, message, thinking):
    """Token ids of a one-turn chat ending in the assistant's generation prompt (no system prompt)."""
    return tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True,
                                         enable_thinking=thinking, tokenize=True, return_dict=False)


def load_rows(dataset, split, problem_column, context_column):
    """[(problem, privileged context)] from a hub dataset id or a local JSON / JSONL / Parquet file."""
    from datasets import load_dataset

    path = Path(dataset)
    if path.is_file():
        kind = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}.get(path.suffix.lower())
        if kind is None:
            raise SystemExit(f"--dataset {dataset}: a local file must be .json, .jsonl or .parquet.")
        rows = load_dataset(kind, data_files=str(path), split="train")
    else:
        rows = load_dataset(dataset, split=split)
    for column in (problem_column, context_column):
        if column not in rows.column_names:
            raise SystemExit(f"--dataset {dataset} has no column {column!r}; its columns are {rows.column_names}.")
    return list(zip(rows[problem_column], rows[context_column]))


def build_prompts(tokenizer, rows, *, student_thinking, teacher_thinking, max_prompt_length):
    """[(student prompt ids, teacher prompt ids)], dropping rows whose prompts exceed max_prompt_length."""
    prompts = []
    for problem, context in rows:
        student = render(tokenizer, student_message(problem), student_thinking)
        teacher = render(tokenizer, teacher_message(problem, context), teacher_thinking)
        if max(len(student), len(teacher)) <= max_prompt_length:
            prompts.append((student, teacher))
    print0(f"data: {len(prompts)} prompts, {len(rows) - len(prompts)} dropped as longer than {max_prompt_length} tokens")
    if not prompts:
        raise SystemExit(f"No row fits --max-prompt-length {max_prompt_length}: raise it.")
    return prompts


def step_indices(step, prompts_per_step, num_prompts, seed):
    """Prompt indices of optimizer step `step`: the data stream walks a fresh seeded permutation each
    epoch, so the order depends only on (seed, step) and a resumed run needs no data-loader state."""
    indices, perms = [], {}
    for position in range(step * prompts_per_step, (step + 1) * prompts_per_step):
        epoch, i = divmod(position, num_prompts)
        if epoch not in perms:
            perms[epoch] = torch.randperm(num_prompts, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        indices.append(perms[epoch][i])
    return indices


# -----------------------------------------------------------------------------
# Batches: [left pads | prompt | completion | right pads], the prompt flush against the completion


def build_batch(prompts, completions, pad_id, device):
    """Model inputs for one micro-batch, and the mask of completion tokens (B, P + L).

    Left padding puts every prompt's last token in the same column P - 1, so student and teacher
    batches score the same completion at the same columns relative to P. Positions come from the
    attention mask (cumsum - 1): each real token sits at the position vLLM gave it when sampling,
    whatever the padding. (Right-padded prompts would leave pads between prompt and completion
    and shift every completion token's RoPE position.)
    """
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
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    return {k: v.to(device) for k, v in inputs.items()}, completion_mask.to(device)


def final_hidden(model, inputs):
    """(B, T, H) hidden states after the final norm, before the lm_head: the loss makes logits in chunks."""
    return model.model(**inputs, use_cache=False).last_hidden_state


# -----------------------------------------------------------------------------
# Rollout with vLLM: one engine per rank, sampling from token ids, weights pushed in place


def start_engine(args, rank, world_size, device):
    from vllm import LLM

    extra = {"gpu_memory_utilization": args.vllm_memory} if device.type == "cuda" else {}
    return LLM(
        model=args.model,
        dtype=args.dtype,
        seed=args.seed + rank,  # every request carries its own seed; this only keeps unseeded ones apart
        max_model_len=args.max_prompt_length + args.max_new_tokens,
        enforce_eager=device.type == "cpu",
        # under torchrun every rank runs its own tensor-parallel-1 engine inside its own process
        distributed_executor_backend="external_launcher" if world_size > 1 else None,
        tensor_parallel_size=1,
        **extra,
    )


def sample(llm, prompts, seeds, args):
    """Completions (token ids, with the final EOS when one was sampled) and vLLM's log-prob of each token.

    Each request has its own seed: the in-process engine shares torch's global RNG, so a global seed
    would not make sampling reproducible. vLLM's log-probs are raw (log-softmax of the logits before
    temperature and top-k/top-p), the convention the trainer's side of the gap uses too.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=seed,
                             max_tokens=args.max_new_tokens, logprobs=0) for seed in seeds]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    completions, logprobs = [], []
    for out in outputs:
        tokens = list(out.outputs[0].token_ids)
        completions.append(tokens)
        logprobs.append([lp[token].logprob for lp, token in zip(out.outputs[0].logprobs, tokens)])
    return completions, logprobs


def push_weights(llm, model):
    """Update inference engine weights: merged LoRA weights into the running engine, then drop the
    prefix cache (its KV entries were computed with the old weights). Returns the seconds it took."""
    start = time.perf_counter()
    # vLLM stacks q/k/v and gate/up itself; all seven projections are sent, so every fused group is complete
    llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=merged_weights(model), is_checkpoint_format=True))
    llm.reset_prefix_cache()
    return time.perf_counter() - start


# -----------------------------------------------------------------------------
# The loss: a per-token divergence between teacher and student next-token distributions

CLIP_MODES = ("entry", "token", "none")


def token_divergence(student_logits, teacher_logits, *, beta=0.0, temperature=1.0, clip="entry", tau=0.05):
    """Per-position loss contribution D(p_T || p_S) after clipping, in float32. Shapes (..., V) -> (...)."""
    if clip not in CLIP_MODES:
        raise ValueError(f"clip must be one of {CLIP_MODES}, got {clip!r}.")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must lie in [0, 1], got {beta}.")
    log_s = F.log_softmax(student_logits.float() / temperature, dim=-1)  # (..., V) log p_S
    log_t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)  # (..., V) log p_T
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


@torch.no_grad()
def divergence_stats(student_logits, teacher_logits, targets, *, temperature, tau):
    """Diagnostics per position (METHOD.md section 7), whatever the loss's beta and clip:
    kl: unclipped KL(p_T || p_S); clipped_mass: teacher mass on entries the entry clip clamps
    (p_T(v) (log p_T(v) - log p_S(v)) > tau); logprob: the student's raw log-prob of the sampled
    token (temperature 1, vLLM's convention), for the sampler/trainer gap."""
    raw = student_logits.float()
    logprob = raw.gather(-1, targets[:, None])[:, 0] - raw.logsumexp(-1)  # (C,)
    log_s = F.log_softmax(raw / temperature, dim=-1)
    log_t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    p_t = log_t.exp()
    d = log_t.sub_(log_s).mul_(p_t)  # (C, V) p_T(v) (log p_T(v) - log p_S(v)), in place: this runs per chunk
    kl, clipped_mass = d.sum(-1), p_t.mul_(d > tau).sum(-1)
    return torch.stack([kl, clipped_mass, logprob], dim=-1)  # (C, 3)


def opsd_loss(student_hidden, student_mask, teacher_hidden, teacher_mask, lm_head_weight, num_tokens,
              targets=None, *, beta=0.0, temperature=1.0, clip="entry", tau=0.05, chunk_size=32):
    """(loss, stats): the sum of token_divergence over the masked positions divided by num_tokens, and
    divergence_stats (N, 3) [kl, clipped_mass, logprob] when the sampled `targets` (N,) are given.

    Hidden states are (B, T, H) before the lm_head; the two masks select the positions that
    predict completion tokens, the same count in the same order in both. Logits exist for at most
    `chunk_size` positions at a time, so peak memory grows with chunk_size x V instead of
    B x T x V. Each chunk's gradient w.r.t. the student hidden states is taken while the chunk's
    logits exist (no recompute), then attached to the graph through a surrogate term whose value
    is exactly zero. The lm_head is frozen (LoRA never trains it), so it gets no gradient.
    """
    hs, ht = student_hidden[student_mask], teacher_hidden[teacher_mask].detach()  # (N, H) each
    if hs.shape != ht.shape:
        raise ValueError(f"Student and teacher masks select {hs.shape[0]} and {ht.shape[0]} positions: they must match.")
    W = lm_head_weight.detach()  # (V, H)
    need_grad = torch.is_grad_enabled() and hs.requires_grad
    total = hs.new_zeros((), dtype=torch.float32)
    grads, stats = [], []
    for i in range(0, hs.shape[0], chunk_size):
        h = hs[i:i + chunk_size].detach().requires_grad_(need_grad)  # (C, H)
        teacher_logits = ht[i:i + chunk_size] @ W.T  # (C, V)
        with torch.enable_grad() if need_grad else nullcontext():
            student_logits = h @ W.T  # (C, V)
            k = token_divergence(student_logits, teacher_logits, beta=beta, temperature=temperature, clip=clip, tau=tau)
            if need_grad:
                grads.append(torch.autograd.grad(k.sum(), h)[0])
        total = total + k.detach().sum()
        if targets is not None:
            stats.append(divergence_stats(student_logits.detach(), teacher_logits, targets[i:i + chunk_size],
                                          temperature=temperature, tau=tau))
    loss = total / max(num_tokens, 1)
    if need_grad:  # also with no positions at all, so backward still runs on every rank
        grad = torch.cat(grads) if grads else torch.zeros_like(hs)  # (N, H) d sum_n k_n / d hs
        surrogate = (hs * grad).sum() / max(num_tokens, 1)
        loss = loss + (surrogate - surrogate.detach())
    if targets is None:
        return loss, None
    return loss, (torch.cat(stats) if stats else hs.new_zeros((0, 3), dtype=torch.float32))


# -----------------------------------------------------------------------------
# Learning-rate schedule


def lr_at(step, *, lr, max_steps, warmup_steps=0, min_lr=0.0):
    """Learning rate of optimizer step `step` (0-based, 0 .. max_steps - 1)."""
    # 1) linear warmup: lr * (step + 1) / warmup_steps, so the first step already moves the weights
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    # 2) cosine decay: min_lr + (lr - min_lr) * (1 + cos(pi * progress)) / 2, reaching min_lr at max_steps
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


# -----------------------------------------------------------------------------
# One optimizer step's gradient


def backward_step(model, lora_params, student_prompts, teacher_prompts, completions, *, pad_id, micro_batch_size,
                  teacher, **loss_kw):
    """Forward and backward over this rank's micro-batches, then the gradient summed over ranks.

    Each micro-batch's loss is its sum of per-token divergences divided by the step's completion-token
    count over all micro-batches and ranks, so the summed gradient equals that of one big batch.
    Returns the step's loss (summed over ranks) and per-position diagnostics of this rank: all
    completion positions (N, 3) and the first position of each completion (rows, 3).
    """
    device = lora_params[0].device
    lm_head = model.get_output_embeddings().weight  # (V, H), frozen
    num_tokens = int(all_reduce(torch.tensor(sum(map(len, completions)), device=device)))
    loss_sum, stats, first = 0.0, [], []
    for mb in range(0, len(completions), micro_batch_size):
        rows = slice(mb, mb + micro_batch_size)
        student_inputs, student_mask = build_batch(student_prompts[rows], completions[rows], pad_id, device)
        teacher_inputs, teacher_mask = build_batch(teacher_prompts[rows], completions[rows], pad_id, device)
        with torch.no_grad(), lora_disabled(model) if teacher == "base" else nullcontext():
            teacher_hidden = final_hidden(model, teacher_inputs)  # (B, T_teacher, H)
        student_hidden = final_hidden(model, student_inputs)  # (B, T_student, H)
        # hidden state t predicts token t + 1: shift the completion masks by one
        targets = student_inputs["input_ids"][:, 1:][student_mask[:, 1:]]  # (N,) the sampled tokens
        loss, mb_stats = opsd_loss(student_hidden[:, :-1], student_mask[:, 1:], teacher_hidden[:, :-1],
                                   teacher_mask[:, 1:], lm_head, num_tokens, targets, **loss_kw)
        loss.backward()
        loss_sum += loss.item()
        stats.append(mb_stats)
        starts = torch.tensor([0] + [len(c) for c in completions[rows]][:-1]).cumsum(0)  # first position per row
        first.append(mb_stats[starts])
    for p in lora_params:  # a sum, not DDP's mean: each rank's loss is already divided by the global count
        all_reduce(p.grad)
    loss_value = float(all_reduce(torch.tensor(loss_sum, device=device)))
    return loss_value, torch.cat(stats), torch.cat(first)


# -----------------------------------------------------------------------------
# Checkpoints: written to a temporary directory and renamed, so a kill never leaves a half checkpoint


def save_atomically(final_dir, write):
    final_dir = Path(final_dir)
    tmp = final_dir.with_name(f".tmp-{final_dir.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp)
    shutil.rmtree(final_dir, ignore_errors=True)
    os.rename(tmp, final_dir)


def save_checkpoint(out_dir, step, model, optimizer, args):
    def write(tmp):
        save_adapter(model, tmp, args.model)
        # the data order and every sampling seed are functions of (seed, step), so the step fixes the data
        # position; the RNG state is kept for completeness (nothing draws from it after the LoRA init)
        torch.save({"step": step, "data_position": step * args.prompts_per_step, "optimizer": optimizer.state_dict(),
                    "torch_rng": torch.get_rng_state()}, tmp / "trainer_state.pt")
    save_atomically(out_dir / f"checkpoint-{step}", write)


# settings a resumed run must share with the run it continues (the data order and seeds depend on them)
RESUME_KEYS = ("model", "dataset", "dataset_split", "problem_column", "context_column", "max_prompt_length", "seed",
               "prompts_per_step", "lora_r", "lora_alpha")


def latest_checkpoint(out_dir):
    steps = [int(d.name.split("-")[1]) for d in Path(out_dir).glob("checkpoint-*") if (d / "trainer_state.pt").is_file()]
    return Path(out_dir) / f"checkpoint-{max(steps)}" if steps else None


def truncate_log(path, last_step):
    """Drop records of steps after `last_step` (written after the checkpoint a resumed run starts from)."""
    if path.exists():
        keep = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= last_step]
        path.write_text("".join(line + "\n" for line in keep))


# -----------------------------------------------------------------------------
# The run


def main(argv=None):
    args = parse_args(argv)
    rank, world_size, device = init_distributed(args.device)
    is_main = rank == 0
    per_rank = args.prompts_per_step // world_size
    if args.prompts_per_step % (world_size * args.micro_batch_size):
        raise SystemExit(f"--prompts-per-step {args.prompts_per_step} must be divisible by ranks x --micro-batch-size "
                         f"= {world_size} x {args.micro_batch_size}.")
    out_dir = Path(args.output_dir)
    resume_from = latest_checkpoint(out_dir) if args.resume else None
    if not args.resume and latest_checkpoint(out_dir):
        raise SystemExit(f"{out_dir} already holds checkpoints: pass --resume, or choose another --output-dir.")
    if resume_from:
        saved = json.loads((out_dir / "args.json").read_text())
        changed = [k for k in RESUME_KEYS if saved.get(k) != getattr(args, k)]
        if changed:
            raise SystemExit(f"--resume with other {', '.join(changed)} than the run in {out_dir}: use the same flags.")
    # vLLM: the engine in this process (its worker is then reachable for weight pushes); quiet, because each
    # push of the seven projections logs a warning for every layer it leaves alone; a small CPU KV cache
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    if device.type == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # ---- data first, so a bad column or length limit fails before the model loads. Every rank renders
    #      all prompts; step_indices picks each rank's shard of each step
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    rows = load_rows(args.dataset, args.dataset_split, args.problem_column, args.context_column)
    prompts = build_prompts(tokenizer, rows, student_thinking=args.student_thinking,
                            teacher_thinking=args.teacher_thinking, max_prompt_length=args.max_prompt_length)

    # ---- model + LoRA: the same seed on every rank gives every rank the same LoRA init
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device)
    torch.manual_seed(args.seed)
    lora_params = add_lora(model, args.lora_r, args.lora_alpha)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()  # Qwen3 has no dropout; train() only switches gradient checkpointing on
    optimizer = torch.optim.AdamW(lora_params, lr=args.lr, betas=(0.9, 0.999), weight_decay=0.0)

    # ---- vLLM engine (a collective step: all ranks build theirs together)
    llm = start_engine(args, rank, world_size, device)
    start_step = 0
    if resume_from:
        load_adapter(model, resume_from)
        state = torch.load(resume_from / "trainer_state.pt", map_location=device, weights_only=True)
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        start_step = state["step"]
        push_weights(llm, model)  # the fresh engine holds base weights
        print0(f"resumed from {resume_from} at step {start_step}")
    if is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "args.json").write_text(json.dumps(vars(args), indent=2) + "\n")
        for name in ("metrics.jsonl", "rollouts.jsonl"):
            truncate_log(out_dir / name, start_step)
    loss_kw = dict(beta=args.beta, temperature=args.loss_temperature, clip=args.clip, tau=args.tau)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id  # pads are masked
    window = deque()  # per-step diagnostic sums, newest last, covering at least --kl-window tokens

    for step in range(start_step, args.max_steps):
        # ---- generate: this rank's shard of the step's prompts, one seed per request
        t0 = time.perf_counter()
        indices = step_indices(step, args.prompts_per_step, len(prompts), args.seed)
        mine = range(rank * per_rank, (rank + 1) * per_rank)
        seeds = [(args.seed * 1_000_003 + step * args.prompts_per_step + j) % 2**31 for j in mine]
        student_prompts = [prompts[indices[j]][0] for j in mine]
        teacher_prompts = [prompts[indices[j]][1] for j in mine]
        completions, sampler_logprobs = sample(llm, student_prompts, seeds, args)
        t1 = time.perf_counter()

        # ---- train: loss = sum over the step's completion tokens / their count across micro-batches and ranks
        loss_value, stats, first = backward_step(model, lora_params, student_prompts, teacher_prompts, completions,
                                                 pad_id=pad_id, micro_batch_size=args.micro_batch_size,
                                                 teacher=args.teacher, **loss_kw)
        grad_norm = torch.nn.utils.clip_grad_norm_(lora_params, args.max_grad_norm).item()
        if not (math.isfinite(loss_value) and math.isfinite(grad_norm)):
            last = latest_checkpoint(out_dir)
            raise SystemExit(f"step {step + 1}: non-finite loss ({loss_value}) or gradient norm ({grad_norm}); "
                             f"stopped before the update, last checkpoint: {last or 'none'}.")
        lr = lr_at(step, lr=args.lr, max_steps=args.max_steps, warmup_steps=args.warmup_steps, min_lr=args.min_lr)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t2 = time.perf_counter()

        # ---- update inference engine weights
        time_push = push_weights(llm, model)
        t3 = time.perf_counter()

        # ---- diagnostics (METHOD.md section 7): sums over ranks, averaged over the most recent steps that
        #      cover at least --kl-window completion tokens
        kl = stats[:, 0]  # unclipped KL(T||S) per position
        gap = (stats[:, 2] - torch.tensor(sum(sampler_logprobs, []), device=device)).abs()  # |sampler - trainer|
        local = {"tokens": len(kl), "kl": kl.sum(), "above_tau": (kl > args.tau).sum(), "clipped_mass": stats[:, 1].sum(),
                 "first_kl": first[:, 0].sum(), "first_tokens": len(first), "gap": gap.sum()}
        totals = all_reduce(torch.tensor([float(v) for v in local.values()], device=device)).tolist()
        sums = dict(zip(local, totals))
        gap_max = float(all_reduce(gap.max(), dist.ReduceOp.MAX if dist.is_initialized() else None))
        window.append(sums)
        while len(window) > 1 and sum(w["tokens"] for w in list(window)[1:]) >= args.kl_window:
            window.popleft()
        w = {k: sum(step_sums[k] for step_sums in window) for k in sums}
        record = {
            "step": step + 1, "loss": loss_value, "lr": lr, "grad_norm": grad_norm,
            "kl_mean": w["kl"] / w["tokens"], "kl_frac_above_tau": w["above_tau"] / w["tokens"],
            "kl_clipped_teacher_mass": w["clipped_mass"] / w["tokens"], "kl_first_token": w["first_kl"] / w["first_tokens"],
            "kl_window_tokens": int(w["tokens"]),
            "logprob_gap_mean": sums["gap"] / sums["tokens"], "logprob_gap_max": gap_max,
            "completion_len_mean": sums["tokens"] / args.prompts_per_step,
            "time_sample": t1 - t0, "time_train": t2 - t1, "time_push": time_push,
            "tokens_per_second": sums["tokens"] / (t3 - t0),
        }
        if is_main:
            print(f"step {step + 1:4d}/{args.max_steps} | loss {loss_value:.4f} | lr {lr:.2e} | grad {grad_norm:.4f} | "
                  f"kl {record['kl_mean']:.4f} >tau {record['kl_frac_above_tau']:.1%} | len {record['completion_len_mean']:.0f} | "
                  f"sample {t1 - t0:.1f}s train {t2 - t1:.1f}s push {time_push:.2f}s | "
                  f"{record['tokens_per_second']:.0f} tok/s | gap {record['logprob_gap_mean']:.1e}/{gap_max:.1e}", flush=True)
            with open(out_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
            if args.log_rollouts_every and (step + 1) % args.log_rollouts_every == 0:  # rank 0's share
                with open(out_dir / "rollouts.jsonl", "a") as f:
                    for j, completion in zip(mine, completions):
                        f.write(json.dumps({"step": step + 1, "prompt_index": indices[j], "tokens": len(completion),
                                            "completion": tokenizer.decode(completion)}) + "\n")

        # ---- checkpoint
        if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.max_steps:
            if is_main:
                save_checkpoint(out_dir, step + 1, model, optimizer, args)
            if dist.is_initialized():
                dist.barrier()

    # ---- teardown: the final adapter, in PEFT's layout
    if is_main:
        save_atomically(out_dir / "final", lambda tmp: save_adapter(model, tmp, args.model))
        print(f"final adapter -> {out_dir / 'final'}")
    if dist.is_initialized():
        dist.barrier()
    del llm  # shutting the engine down also destroys the default process group
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
