"""
On-Policy Self-Distillation (OPSD) for LLM reasoning, in one file.

One model plays two roles. The student sees only the problem; the teacher is the same
network whose prompt also holds a reference solution. The student samples its own answer
with vLLM, then at every position of that answer its next-token distribution is pulled
towards the teacher's with a full-vocabulary forward KL. Only LoRA weights train.

The sections below follow a step in the order it happens: LoRA, the loss, the schedule.
"""

import json
import math
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

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
    """[(HF parameter name, merged weight)] for every LoRA layer, ready to push into vLLM."""
    return [(f"{name}.weight", m.merged_weight()) for name, m in lora_layers(model).items()]


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


def opsd_loss(student_hidden, student_mask, teacher_hidden, teacher_mask, lm_head_weight, num_tokens,
              *, chunk_size=32, **divergence):
    """Sum of token_divergence over the masked positions, divided by num_tokens.

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
    need_grad = torch.is_grad_enabled() and hs.requires_grad
    total = hs.new_zeros((), dtype=torch.float32)
    grads = []
    for i in range(0, hs.shape[0], chunk_size):
        h = hs[i:i + chunk_size].detach().requires_grad_(need_grad)  # (C, H)
        with torch.enable_grad() if need_grad else torch.no_grad():
            teacher_logits = ht[i:i + chunk_size] @ lm_head_weight.detach().T  # (C, V)
            k = token_divergence(h @ lm_head_weight.detach().T, teacher_logits, **divergence)  # (C,)
            if need_grad:
                grads.append(torch.autograd.grad(k.sum(), h)[0])
        total = total + k.detach().sum()
    loss = total / max(num_tokens, 1)
    if need_grad:  # also with no positions at all, so backward (and DDP's gradient sync) still runs
        grad = torch.cat(grads) if grads else torch.zeros_like(hs)  # (N, H) d sum_n k_n / d hs
        surrogate = (hs * grad).sum() / max(num_tokens, 1)
        loss = loss + (surrogate - surrogate.detach())
    return loss


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
