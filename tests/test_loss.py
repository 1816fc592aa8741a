# python -m pytest tests/test_loss.py -q
"""The loss term (clipped_divergence of log_probs), plain_loss and the chunked opsd_loss against hand-computed
values and a float64 reference."""

import math

import pytest
import torch

from opsd import clipped_divergence, log_probs, opsd_loss, plain_loss

T = 1.1  # the recipe's loss temperature


def token_divergence(student_logits, teacher_logits, *, beta=0.0, temperature=1.0, clip="entry", tau=0.05):
    """Each position's loss term from the logits, as opsd.py computes it: log_probs, then clipped_divergence."""
    log_s, log_t = log_probs(student_logits, teacher_logits, temperature)
    return clipped_divergence(log_s, log_t, beta=beta, clip=clip, tau=tau)


def reference_divergence(student_logits, teacher_logits, beta, temperature, clip, tau):
    """Float64, written in probability space (not log space), independently of opsd.py."""
    p_s = torch.softmax(student_logits.double() / temperature, -1)
    p_t = torch.softmax(teacher_logits.double() / temperature, -1)
    if beta == 0:
        d = p_t * torch.log(p_t / p_s)
    elif beta == 1:
        d = p_s * torch.log(p_s / p_t)
    else:
        m = beta * p_t + (1 - beta) * p_s
        d = beta * p_t * torch.log(p_t / m) + (1 - beta) * p_s * torch.log(p_s / m)
    if clip == "entry":
        d = torch.minimum(d, torch.full_like(d, tau))
    k = d.sum(-1)
    if clip == "token":
        k = torch.where(k > tau, k * (tau / k).detach(), k)
    return k


def grad_wrt_student(student_logits, teacher_logits, **kw):
    s = student_logits.clone().requires_grad_()
    k = token_divergence(s, teacher_logits, **kw)
    (g,) = torch.autograd.grad(k.sum(), s)
    return k.detach(), g


def test_forward_and_reverse_kl_by_hand():
    log_s, log_t = torch.tensor([0.8, 0.2]).log(), torch.tensor([0.5, 0.5]).log()
    forward = token_divergence(log_s, log_t, beta=0.0, clip="none")
    reverse = token_divergence(log_s, log_t, beta=1.0, clip="none")
    # KL(T||S) = .5 ln(.5/.8) + .5 ln(.5/.2) = .5 ln(1.5625) = ln 1.25
    assert forward.item() == pytest.approx(math.log(1.25), abs=1e-6)
    # KL(S||T) = .8 ln(.8/.5) + .2 ln(.2/.5)
    assert reverse.item() == pytest.approx(0.8 * math.log(1.6) + 0.2 * math.log(0.4), abs=1e-6)
    assert reverse.item() != pytest.approx(forward.item(), abs=1e-3)


def test_forward_kl_gradient_is_ps_minus_pt_over_temperature():
    torch.manual_seed(0)
    s, t = torch.randn(5, 32) * 2, torch.randn(5, 32) * 2
    _, g = grad_wrt_student(s, t, beta=0.0, temperature=T, clip="none")
    expected = (torch.softmax(s.double() / T, -1) - torch.softmax(t.double() / T, -1)) / T
    # float32 against float64: entries up to ~0.9, so an absolute 1e-6 is float32's relative precision there (a
    # temperature on one side only, or a missing 1/T, moves them by 1e-2 and more)
    torch.testing.assert_close(g.double(), expected, atol=1e-6, rtol=0)


def test_entry_clip_gradient_matches_closed_form():
    # Only unclamped entries U carry gradient: d/ds_j of -sum_{v in U} p_T(v) log p_S(v)
    # = (p_S(j) * sum_{v in U} p_T(v) - p_T(j) [j in U]) / T
    torch.manual_seed(1)
    s, t, tau = torch.randn(6, 40) * 3, torch.randn(6, 40) * 3, 0.05
    _, g = grad_wrt_student(s, t, beta=0.0, temperature=T, clip="entry", tau=tau)
    p_s, p_t = torch.softmax(s.double() / T, -1), torch.softmax(t.double() / T, -1)
    unclamped = (p_t * torch.log(p_t / p_s)) < tau
    assert unclamped.any() and (~unclamped).any(), "the test needs both clamped and unclamped entries"
    mass_u = (p_t * unclamped).sum(-1, keepdim=True)
    expected = (p_s * mass_u - p_t * unclamped) / T
    torch.testing.assert_close(g.double(), expected, atol=1e-7, rtol=0)


def test_token_clip_value_and_gradient_scale():
    torch.manual_seed(2)
    s, tau = torch.randn(64, 50) * 2, 0.5
    t = s + torch.randn(64, 50) * torch.linspace(0.05, 2.0, 64)[:, None]  # divergences from ~0 to >> tau
    k, g_none = grad_wrt_student(s, t, temperature=T, clip="none")
    k_tok, g_tok = grad_wrt_student(s, t, temperature=T, clip="token", tau=tau)
    assert (k > tau).any() and (k < tau).any(), "the test needs positions on both sides of tau"
    torch.testing.assert_close(k_tok, torch.minimum(k, torch.tensor(tau)), atol=1e-6, rtol=0)
    # every position keeps its gradient direction, scaled by min(1, tau / k)
    scale = torch.clamp(tau / k, max=1.0)[:, None]
    torch.testing.assert_close(g_tok, scale * g_none, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("clip", ["entry", "token", "none"])
def test_random_logits_against_float64_reference(beta, clip):
    torch.manual_seed(3)
    s, t, tau = torch.randn(4, 7, 300) * 3, torch.randn(4, 7, 300) * 3, 0.05
    k, g = grad_wrt_student(s, t, beta=beta, temperature=T, clip=clip, tau=tau)
    s64 = s.double().requires_grad_()
    k64 = reference_divergence(s64, t, beta, T, clip, tau)
    (g64,) = torch.autograd.grad(k64.sum(), s64)
    assert k.dtype == torch.float32 and k.shape == (4, 7)
    torch.testing.assert_close(k.double(), k64.detach(), atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(g.double(), g64, atol=1e-7, rtol=1e-4)


def test_bf16_inputs_are_computed_in_float32():
    torch.manual_seed(4)
    s, t = (torch.randn(3, 100) * 3).bfloat16(), (torch.randn(3, 100) * 3).bfloat16()
    k = token_divergence(s, t, temperature=T, clip="none")
    assert k.dtype == torch.float32
    # a float32 computation of the bf16 values agrees to float32 precision, far below bf16's ~4e-3
    torch.testing.assert_close(k.double(), reference_divergence(s.float(), t.float(), 0, T, "none", 0), atol=1e-6, rtol=1e-5)


# -- the chunked loss --------------------------------------------------------------------------


def hidden_batch(seed, B=3, T_len=11, H=16, V=97):
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(B, T_len, H, generator=g)
    ht = torch.randn(B, T_len + 4, H, generator=g)  # teacher prompts are longer
    W = torch.randn(V, H, generator=g) * 0.5
    lengths = [5, 8, 2]  # completion positions per row
    s_mask = torch.zeros(B, T_len, dtype=torch.bool)
    t_mask = torch.zeros(B, T_len + 4, dtype=torch.bool)
    for b, n in enumerate(lengths):
        s_mask[b, 2:2 + n] = True
        t_mask[b, 6:6 + n] = True
    return hs, ht, W, s_mask, t_mask


@pytest.mark.parametrize("clip", ["entry", "token", "none"])
@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_chunked_equals_unchunked_value_and_gradient(clip, beta):
    hs, ht, W, s_mask, t_mask = hidden_batch(5)
    kw = dict(beta=beta, temperature=T, clip=clip, tau=0.05)
    num_tokens = 40  # a global count larger than this micro-batch's 15 positions

    hs_ref = hs.clone().requires_grad_()
    # the plain form: full (B, T, V) logits for both, then the scored positions, the loss terms summed / num_tokens
    ref = plain_loss((hs_ref @ W.T)[s_mask], (ht @ W.T)[t_mask], num_tokens, **kw)
    # which is the float64 reference's sum
    want = reference_divergence((hs @ W.T)[s_mask], (ht @ W.T)[t_mask], beta, T, clip, 0.05).sum() / num_tokens
    assert ref.item() == pytest.approx(want.item(), rel=1e-5)
    (g_ref,) = torch.autograd.grad(ref, hs_ref)

    for chunk_size in (1, 4, 1000):
        h = hs.clone().requires_grad_()
        loss, _ = opsd_loss(h, s_mask, ht, t_mask, W, num_tokens, chunk_size=chunk_size, **kw)
        (g,) = torch.autograd.grad(loss, h)
        torch.testing.assert_close(loss, ref, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(g, g_ref, atol=1e-7, rtol=1e-5)


def test_masked_positions_contribute_nothing():
    hs, ht, W, s_mask, t_mask = hidden_batch(6)
    h1 = hs.clone().requires_grad_()
    loss1, _ = opsd_loss(h1, s_mask, ht, t_mask, W, 15, chunk_size=4, clip="token", temperature=T)
    (g1,) = torch.autograd.grad(loss1, h1)
    # change every masked-out hidden state, student and teacher: nothing may move
    hs2, ht2 = hs.clone(), ht.clone()
    hs2[~s_mask] = 1e3
    ht2[~t_mask] = -1e3
    h2 = hs2.requires_grad_()
    loss2, _ = opsd_loss(h2, s_mask, ht2, t_mask, W, 15, chunk_size=4, clip="token", temperature=T)
    (g2,) = torch.autograd.grad(loss2, h2)
    assert loss1.item() == loss2.item() and loss1.item() > 0
    assert torch.equal(g1, g2)
    assert (g1[~s_mask] == 0).all() and (g1[s_mask] != 0).any()


def test_all_masked_gives_zero_loss_and_zero_gradient():
    hs, ht, W, s_mask, t_mask = hidden_batch(7)
    h = hs.clone().requires_grad_()
    for num_tokens in (0, 12):
        loss, _ = opsd_loss(h, torch.zeros_like(s_mask), ht, torch.zeros_like(t_mask), W, num_tokens, clip="entry",
                             temperature=T)
        (g,) = torch.autograd.grad(loss, h)
        assert loss.item() == 0.0 and torch.isfinite(loss)
        assert torch.equal(g, torch.zeros_like(g))


def test_teacher_and_lm_head_get_no_gradient():
    hs, ht, W, s_mask, t_mask = hidden_batch(8)
    ht.requires_grad_()
    h = hs.clone().requires_grad_()
    opsd_loss(h, s_mask, ht, t_mask, W, 15, temperature=T)[0].backward()
    assert ht.grad is None and h.grad is not None


def test_diagnostics_against_float64_reference():
    hs, ht, W, s_mask, t_mask = hidden_batch(10)
    s_logits, t_logits = (hs @ W.T)[s_mask], (ht @ W.T)[t_mask]  # (N, V)
    targets = torch.randint(0, W.shape[0], (s_logits.shape[0],), generator=torch.Generator().manual_seed(0))
    tau = 0.05
    _, stats = opsd_loss(hs, s_mask, ht, t_mask, W, 15, targets, clip="token", beta=0.5, temperature=T, tau=tau, chunk_size=4)
    p_s, p_t = torch.softmax(s_logits.double() / T, -1), torch.softmax(t_logits.double() / T, -1)
    entries = p_t * torch.log(p_t / p_s)
    kl = entries.sum(-1)  # unclipped forward KL, whatever the loss's clip and beta
    clipped_mass = (p_t * (entries > tau)).sum(-1)
    raw_logprob = torch.log_softmax(s_logits.double(), -1).gather(-1, targets[:, None])[:, 0]  # temperature 1
    assert all(t.shape == (15,) for t in stats)
    torch.testing.assert_close(stats.kl.double(), kl, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stats.clipped_mass.double(), clipped_mass, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(stats.logprob.double(), raw_logprob, atol=1e-5, rtol=1e-6)
    assert (clipped_mass > 0).any() and (clipped_mass < 1).all()
    # entropies at the loss temperature, -sum_v p(v) log p(v), written in probability space
    torch.testing.assert_close(stats.student_entropy.double(), -(p_s * p_s.log()).sum(-1), atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(stats.teacher_entropy.double(), -(p_t * p_t.log()).sum(-1), atol=1e-5, rtol=1e-6)
    assert (p_s * p_s.log()).sum(-1).sub((p_t * p_t.log()).sum(-1)).abs().min() > 1e-3  # the two sides apart
    assert stats.negative.sum() == 0  # a JSD, token-clipped, is never below 0


def test_negative_loss_terms_are_counted_where_the_entry_clip_makes_them():
    """The entry clip bounds each entry's p_T (log p_T - log p_S) by tau before the sum; the entries where p_T < p_S
    are negative and unbounded, so the clipped sum can fall below 0 (the unclipped KL never does)."""
    hs, ht, W, s_mask, t_mask = hidden_batch(10)
    ht[t_mask] = hs[s_mask] + 0.4 * torch.randn(15, 16, generator=torch.Generator().manual_seed(1))  # nearby
    s_logits, t_logits = (hs @ W.T)[s_mask], (ht @ W.T)[t_mask]
    targets = torch.zeros(s_logits.shape[0], dtype=torch.long)
    for tau, clip in ((0.02, "entry"), (0.02, "token"), (0.02, "none")):
        loss, stats = opsd_loss(hs, s_mask, ht, t_mask, W, 15, targets, clip=clip, temperature=T, tau=tau,
                                chunk_size=4, loss_positions=torch.arange(15) != 3)  # position 3 out of the loss
        k = reference_divergence(s_logits, t_logits, 0.0, T, clip, tau) * (torch.arange(15) != 3)
        assert ((k + 1e-6).abs() > 1e-7).all()  # no term at the threshold: the count is exact on any CPU
        torch.testing.assert_close(stats.negative.double(), (k < -1e-6).double())
        assert stats.in_loss.tolist() == [1.0] * 3 + [0.0] + [1.0] * 11  # loss_frac_negative's positions
        if clip == "entry":
            assert 0 < stats.negative.sum() < 14, k  # some terms below 0, not all
        else:
            assert stats.negative.sum() == 0
