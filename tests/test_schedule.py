# python -m pytest tests/test_schedule.py -q
"""lr_at against closed-form values and against transformers' cosine schedules."""

import math

import pytest
import torch
from transformers import get_cosine_schedule_with_warmup, get_cosine_with_min_lr_schedule_with_warmup

from opsd import lr_at

LR = 5e-6


def test_closed_form_values():
    # warmup 2 of 10 steps: warmup gives lr/2, lr; cosine progress = (step - 2) / 8
    kw = dict(lr=LR, max_steps=10, warmup_steps=2)
    assert lr_at(0, **kw) == pytest.approx(LR / 2)  # the first step is not at lr 0
    assert lr_at(1, **kw) == pytest.approx(LR)
    assert lr_at(2, **kw) == pytest.approx(LR)
    assert lr_at(4, **kw) == pytest.approx(LR * (1 + math.cos(math.pi / 4)) / 2)
    assert lr_at(6, **kw) == pytest.approx(LR / 2)
    assert lr_at(9, **kw) == pytest.approx(LR * (1 + math.cos(math.pi * 7 / 8)) / 2)
    assert lr_at(10, **kw) == pytest.approx(0.0, abs=1e-20)
    # with min_lr, the midpoint is halfway between lr and min_lr
    assert lr_at(6, **kw, min_lr=1e-6) == pytest.approx((LR + 1e-6) / 2)
    assert lr_at(10, **kw, min_lr=1e-6) == pytest.approx(1e-6)


def test_no_warmup_starts_at_full_lr_and_decreases():
    lrs = [lr_at(s, lr=LR, max_steps=100) for s in range(100)]
    assert lrs[0] == LR and lrs[-1] > 0
    assert all(a > b for a, b in zip(lrs, lrs[1:]))


def lambda_lrs(make_schedule, steps):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    sched = make_schedule(opt)
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


@pytest.mark.parametrize("warmup", [0, 5])
def test_agrees_with_transformers_after_warmup(warmup):
    # transformers warms up as step / warmup (first step at 0); ours as (step + 1) / warmup.
    # From the end of warmup on, both are the same cosine.
    steps = 100
    theirs = lambda_lrs(lambda o: get_cosine_schedule_with_warmup(o, warmup, steps), steps)
    theirs_min = lambda_lrs(lambda o: get_cosine_with_min_lr_schedule_with_warmup(o, warmup, steps, min_lr=1e-6), steps)
    for s in range(warmup, steps):
        assert lr_at(s, lr=LR, max_steps=steps, warmup_steps=warmup) == pytest.approx(theirs[s], rel=1e-9, abs=1e-20)
        assert lr_at(s, lr=LR, max_steps=steps, warmup_steps=warmup, min_lr=1e-6) == pytest.approx(theirs_min[s], rel=1e-9)
    for s in range(warmup):
        assert lr_at(s, lr=LR, max_steps=steps, warmup_steps=warmup) == pytest.approx(LR * (s + 1) / warmup)
