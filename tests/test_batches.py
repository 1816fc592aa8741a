# python -m pytest tests/test_batches.py -q
"""Left-padded batches: padding must not change any completion logit (and the released right padding does)."""

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
    P, L = 9, 7
    assert inputs["input_ids"].shape == (3, P + L)
    row = 1  # prompt of 3 tokens, completion of 7
    assert inputs["input_ids"][row].tolist() == [PAD] * 6 + PROMPTS[1] + COMPLETIONS[1]
    assert inputs["position_ids"][row, 6:].tolist() == list(range(10))  # real tokens at 0..9, as vLLM saw them
    row = 2  # prompt of 6, completion of 2, then right pads
    assert inputs["input_ids"][row].tolist() == [PAD] * 3 + PROMPTS[2] + COMPLETIONS[2] + [PAD] * 5
    assert inputs["attention_mask"][row].tolist() == [0] * 3 + [1] * 8 + [0] * 5
    assert inputs["position_ids"][row, 3:11].tolist() == list(range(8))
    # the completion mask covers exactly the sampled tokens, the final EOS included, never a pad
    for r, c in enumerate(COMPLETIONS):
        assert inputs["input_ids"][r][completion_mask[r]].tolist() == c
    assert not (completion_mask & (inputs["attention_mask"] == 0)).any()


def test_left_padding_leaves_every_completion_logit_unchanged(model):
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
