# python -m pytest tests/test_batches.py -q
"""Batches padded at the end of each row: padding must not change any completion logit (the released recipe's pads
between prompt and completion do), and no attention row is left without a key (left pads were)."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

import opsd

PAD = 0
PROMPTS = [[5, 17, 230, 41, 99, 3, 250, 12, 7], [1, 400, 64], [88, 12, 301, 45, 45, 9]]
COMPLETIONS = [[31, 32, 33, 2], [200, 201, 202, 203, 204, 205, 2], [90, 91]]  # 2 = EOS ends two of them


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@torch.no_grad()
def alone(model, prompt, completion):
    """Logits predicting each completion token, the row run by itself with no padding at all."""
    ids = torch.tensor([prompt + completion])
    logits = model(ids).logits[0]
    return logits[len(prompt) - 1:len(prompt) + len(completion) - 1]  # (len(completion), V)


def test_layout_masks_and_positions():
    inputs, completion_mask = opsd.build_batch(PROMPTS, COMPLETIONS, PAD, "cpu")
    assert inputs["input_ids"].shape == (3, 13)  # the longest row: 9 + 4 = 3 + 7 = 13 tokens
    assert inputs["input_ids"][0].tolist() == PROMPTS[0] + COMPLETIONS[0] and inputs["attention_mask"][0].all()
    row = 1  # prompt of 3 tokens, completion of 7, then 3 pads
    assert inputs["input_ids"][row].tolist() == PROMPTS[1] + COMPLETIONS[1] + [PAD] * 3
    assert inputs["position_ids"][row, :10].tolist() == list(range(10))
    row = 2  # prompt of 6, completion of 2, then 5 pads
    assert inputs["input_ids"][row].tolist() == PROMPTS[2] + COMPLETIONS[2] + [PAD] * 5
    assert inputs["attention_mask"][row].tolist() == [1] * 8 + [0] * 5
    assert inputs["position_ids"][row, :8].tolist() == list(range(8))  # real tokens at 0..7, as vLLM saw them
    # the completion mask covers exactly the sampled tokens, the final EOS included, never a pad
    for r, c in enumerate(COMPLETIONS):
        assert inputs["input_ids"][r][completion_mask[r]].tolist() == c
    assert not (completion_mask & (inputs["attention_mask"] == 0)).any()
    # every query row has a key: under the causal mask, column 0 of every row is a real token
    assert inputs["attention_mask"][:, 0].all()


def test_padding_leaves_every_completion_logit_unchanged(model):
    inputs, completion_mask = opsd.build_batch(PROMPTS, COMPLETIONS, PAD, "cpu")
    with torch.no_grad():
        hidden = opsd.final_hidden(model, inputs)
    logits = hidden @ model.lm_head.weight.T  # (B, T, V)
    for r, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS)):
        batched = logits[r, :-1][completion_mask[r, 1:]]  # the training code's shift by one
        torch.testing.assert_close(batched, alone(model, p, c), atol=1e-5, rtol=0)


def test_released_right_padding_breaks_the_invariant(model):
    """The released recipe: [prompt | pads | completion], default positions. Every row with pads is off."""
    P = max(map(len, PROMPTS))
    worst = []
    for r, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS)):
        ids = torch.tensor([p + [PAD] * (P - len(p)) + c])
        mask = torch.tensor([[1] * len(p) + [0] * (P - len(p)) + [1] * len(c)])
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits[0, P - 1:P + len(c) - 1]
        worst.append((logits - alone(model, p, c)).abs().max().item())
    assert worst[0] < 1e-5  # the longest prompt has no pads
    assert worst[1] > 1e-2 and worst[2] > 1e-2


def test_student_and_teacher_batches_score_the_same_tokens():
    teacher_prompts = [p + [77] * (3 + i) for i, p in enumerate(PROMPTS)]  # longer, privileged prompts
    s_inputs, s_mask = opsd.build_batch(PROMPTS, COMPLETIONS, PAD, "cpu")
    t_inputs, t_mask = opsd.build_batch(teacher_prompts, COMPLETIONS, PAD, "cpu")
    assert s_mask.sum() == t_mask.sum() == sum(map(len, COMPLETIONS))
    assert torch.equal(s_inputs["input_ids"][s_mask], t_inputs["input_ids"][t_mask])


# A stand-in for the CUDA attention kernels that return NaN for a query row whose mask allows no key (PyTorch's CPU
# SDPA returns 0 there): SDPA's result, with such rows set to NaN. Registered with transformers under its own name.
def nan_on_rows_without_key(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)  # out (B, Q, H, D)
    if attention_mask is not None:
        without_key = ~attention_mask.bool().any(-1)  # (B, 1, Q) or (B, H, Q)
        NAN_KERNEL["rows_without_key"] += int(without_key.sum())
        out = out.masked_fill(without_key.any(1)[:, :, None, None], float("nan"))
    return out, weights

NAN_KERNEL = {"rows_without_key": 0}


@pytest.fixture(scope="module")
def nan_kernel_model(tiny_model_dir):
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register("nan_on_rows_without_key", nan_on_rows_without_key)
    AttentionMaskInterface.register("nan_on_rows_without_key", sdpa_mask)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32,
                                                 attn_implementation="nan_on_rows_without_key")
    lora_params = opsd.add_lora(model, r=4, alpha=8, seed=0)
    with torch.no_grad():  # a student apart from the base teacher, so the loss and every gradient are non-zero
        for p in lora_params:
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    return model, lora_params


def test_the_nan_kernel_stand_in_returns_nan_for_a_left_pad(nan_kernel_model):
    """The stand-in is not vacuous: a left-padded row (its pads see no key) turns the real tokens' logits NaN."""
    model, _ = nan_kernel_model
    ids = torch.tensor([[PAD, PAD] + PROMPTS[1]])
    mask = torch.tensor([[0, 0, 1, 1, 1]])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    assert torch.isnan(logits[0, 2:]).all()


def test_a_padded_micro_batch_equals_its_rows_alone_under_a_nan_kernel(nan_kernel_model):
    """Loss and LoRA gradient of one padded micro-batch of three rows of different lengths (student and teacher),
    against the same rows each in a micro-batch of its own (no padding, so no mask at all)."""
    model, lora_params = nan_kernel_model
    teacher_prompts = [p + [77] * (5 - 2 * i) for i, p in enumerate(PROMPTS)]
    results = []
    for micro_batch_size in (3, 1):
        NAN_KERNEL["rows_without_key"] = 0
        for p in lora_params:
            p.grad = None
        loss, _ = opsd.backward_step(model, lora_params, PROMPTS, teacher_prompts, COMPLETIONS, pad_id=PAD,
                                     micro_batch_size=micro_batch_size, teacher="base", temperature=1.1,
                                     clip="none")
        results.append((loss, [p.grad.clone() for p in lora_params], NAN_KERNEL["rows_without_key"]))
    (padded, padded_grads, empty_rows), (alone_loss, alone_grads, _) = results
    assert math.isfinite(padded) and padded > 0  # left pads: NaN (48 rows without a key reached the kernel)
    assert empty_rows == 0
    assert padded == pytest.approx(alone_loss, rel=1e-5)
    for g, h in zip(padded_grads, alone_grads):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, h, rtol=1e-4, atol=1e-7)
