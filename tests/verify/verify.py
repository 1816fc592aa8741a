"""Verify another implementation of OPSD's loss against one optimizer step of the miniature model.

    python tests/verify/verify.py DUMP    # DUMP: the peer's numbers (README.md here: the dump)

fixture.json holds 24 rollouts of tests/miniature/model, each with its prompts (as strings, as token
ids, with their chat-template flags) and, per answer position, the divergence at several settings.
This script recomputes every row's logits alone (no padding) in float64 from the model, compares the
peer's numbers with them check by check (its prompts and batches when dumped, each side's log-probs,
the per-position divergence, the loss), and names a likely cause where the numbers identify one. It
prints the report; the exit status is 0 when every check that ran matches, 1 otherwise. Only torch,
transformers and safetensors are needed, and no GPU.
"""

import argparse
import copy
import functools
import hashlib
import json
import math
import re
import sys
from pathlib import Path
from typing import NamedTuple

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
FIXTURE = HERE / "fixture.json"
SIDES = ("student", "teacher")
CLIPS = ("none", "entry", "token")

# Tolerances, for a peer computing in float32 (the model's dtype) against this float64 reference,
# from tolerances.py: a float32 peer with left padding and no position ids (its rows' position ids
# shifted by their pad counts, which moves rotary rounding), over every setting and clip of
# fixture.json, errs by up to 2.4e-4 in log p (any vocabulary entry), 5.7e-6 on a divergence below
# 0.1 and 6.8e-5 relative above, 7.0e-6 relative on the loss. The tolerances are 10, 10, 10 and 7
# times those; the loss's normalisations differ by 14 times its tolerance or more.
TOL_LOGPROB = 2.5e-3  # the largest |delta log p| over the vocabulary at a position
TOL_DIVERGENCE = (6e-5, 7e-4)  # absolute, relative
TOL_LOSS = 5e-5  # relative
# A pad-predicted first position: its error is this many times the largest error at the row's other
# positions
PAD_FIRST_RATIO = 10.0


# -----------------------------------------------------------------------------
# The reference: each row alone, in float64; the divergence written from its definition

def sha16(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def load_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()


@torch.no_grad()
def row_logits(model, prompt, completion, gap=0):
    """(L + 2, V) raw logits of one row alone, prompt then answer, no padding: position ids 0, 1,
    ... (with `gap`, the answer's start `gap` later, as if counted over that many pads after the
    prompt). Index 1 + j is the output at the token before answer token j, the one that predicts it;
    index 0 and L + 1 are the outputs one position earlier than answer token 0's and one later than
    the last's, so that a peer shifted by one position either way can be recognised at every
    position."""
    P, L = len(prompt), len(completion)
    positions = torch.cat([torch.arange(P), torch.arange(P + gap, P + gap + L)])
    out = model(input_ids=torch.tensor([prompt + completion]),
                position_ids=positions[None]).logits[0]
    return out[P - 2:P + L].clone()  # apart from the whole sequence's logits (Reference keeps it)


# The terms a value over several entries is a weighted sum of (Config.weights), each entry's:
#   the divergence of beta:
#     beta 0:  p_T(v) (log p_T(v) - log p_S(v))                  forward KL(T || S)
#     beta 1:  p_S(v) (log p_S(v) - log p_T(v))                  reverse KL(S || T)
#     else:    beta KL_v(T || M) + (1 - beta) KL_v(S || M),      M = beta p_T + (1 - beta) p_S
#   the reverse KL, p_S(v) (log p_S(v) - log p_T(v)), whatever beta;
#   the cross-entropy, -p_T(v) log p_S(v), whose sum is KL(T || S) plus the teacher's entropy.
# A zero probability contributes zero, whatever its log. The declared forms are weights of these:
# "term" the divergence alone, "mixed:W" W times the forward KL (beta 0) and 1 - W the reverse,
# "cross-entropy" the cross-entropy alone.
PLAIN = (1.0, 0.0, 0.0)
CROSS_ENTROPY = (0.0, 0.0, 1.0)


def divergence_terms(log_s, log_t, beta, weights=PLAIN):
    """(..., V) terms d_v whose sum over the vocabulary is the position's value, from both sides'
    log-probs at the loss temperature: the terms above, weighted."""
    def term(log_p, log_q):  # p (log p - log q), 0 where p = 0
        p = log_p.exp()
        return torch.where(p > 0, p * (log_p - log_q), 0.0)

    def of_beta():
        if beta == 0.0:
            return term(log_t, log_s)
        if beta == 1.0:
            return term(log_s, log_t)
        log_m = torch.log(beta * log_t.exp() + (1.0 - beta) * log_s.exp())
        return beta * term(log_t, log_m) + (1.0 - beta) * term(log_s, log_m)

    def cross_entropy():
        p_t = log_t.exp()
        return torch.where(p_t > 0, -p_t * log_s, 0.0)

    parts = (of_beta, lambda: term(log_s, log_t), cross_entropy)
    return sum(w * part() for w, part in zip(weights, parts) if w)


def divergence(log_s, log_t, *, beta, clip, tau, weights=PLAIN):
    """(...,) each position's loss term: "entry" clips each d_v at tau before the sum, "token" clips
    the sum at tau, "none" leaves it."""
    d = divergence_terms(log_s, log_t, beta, weights)
    if clip == "entry":
        return d.clamp(max=tau).sum(-1)
    k = d.sum(-1)
    return k.clamp(max=tau) if clip == "token" else k


# What the field also computes: the divergence over one side's top k entries, renormalised over
# them, with one more entry for the rest of each side's mass, or one side renormalised and the
# other's log-probs used as they are; and one value from the sampled answer token y alone.

def top_k_log_probs(log_s, log_t, k, tail, order, raw):
    """Both sides' (..., k) log-probs on the top k entries of one side, renormalised over them (tail
    False) or (..., k + 1) with a last entry log(1 - their mass) holding the rest (tail True); the
    side named by `raw` keeps its log-probs there as they are (their sum below 1). order: (..., >=
    k) that side's entries, largest first (its argsort, descending)."""
    out = []
    for side, log_p in zip(SIDES, (log_s, log_t)):
        top = log_p.gather(-1, order[..., :k])
        mass = torch.logsumexp(top, -1, keepdim=True)
        if raw in (side, "both"):
            out.append(top)
        elif tail:
            out.append(torch.cat([top, torch.log(-torch.expm1(mass.clamp(max=0.0)))], -1))
        else:
            out.append(top - mass)
    return out


# The values a peer can take from the sampled token y alone, a = log p_S(y) and b = log p_T(y) (y
# drawn from the student). Their kind: a divergence's term, an estimator of a divergence, or a
# policy-gradient surrogate. An estimator's gradient through log p_S(y), with y drawn from the
# student, averages to zero; the two surrogates hold the advantage A = log p_T(y) - log p_S(y)
# fixed, so that theirs is the reverse KL's policy gradient, -A grad log p_S(y), whose average is
# the reverse KL's gradient.
SAMPLED_FORMS = {
    "term": ("a divergence's term", "its term at y, d_y"),
    "estimate": ("an estimator",
                 "its one-sample estimate d_y / p_S(y) (at beta 1, log p_S(y) - log p_T(y))"),
    "k2": ("an estimator", "(log p_S(y) - log p_T(y))^2 / 2, an estimate of the reverse KL"),
    "k3": ("an estimator",
           "p_T(y) / p_S(y) - 1 - log(p_T(y) / p_S(y)), an estimate of the reverse KL"),
    "surrogate": ("a policy-gradient surrogate (REINFORCE's)",
                  "-(log p_T(y) - log p_S(y)) log p_S(y), the advantage log p_T(y) - log p_S(y) "
                  "held fixed (its gradient is the reverse KL's policy gradient; its value is no "
                  "divergence)"),
    "importance": ("an importance-sampling surrogate",
                   "-exp(log p_S(y) - log p_sampler(y)) (log p_T(y) - log p_S(y)), the advantage "
                   "held fixed: at ratio 1 its value is log p_S(y) - log p_T(y) and its gradient "
                   "the reverse KL's policy gradient"),
}


def sampled_value(a, b, form, beta, clamp, ratio):
    """(N,) one value per position from a = log p_S(y), b = log p_T(y) (SAMPLED_FORMS); ratio: the
    log of the importance ratio p_S(y) / p_sampler(y), for "importance" (None: the ratio 1). The
    divergence's halves, for "term" and "estimate" (their sum; one half at beta 0 or 1):
      term:      beta p_T(y) (b - log m(y))  and  (1 - beta) p_S(y) (a - log m(y)),
                 m = beta p_T + (1 - beta) p_S
      estimate:  the same divided by p_S(y)
    (beta 0: p_T(y) (b - a); beta 1: p_S(y) (a - b); the generalized JSD vanishes as beta goes to 0
    or 1, so the ends are the KLs themselves). clamp: each half bounded below at 0."""
    if form == "k2":
        return 0.5 * (a - b) ** 2
    if form == "k3":
        return torch.expm1(b - a) - (b - a)
    if form == "surrogate":
        return (a - b) * a
    if form == "importance":
        if ratio is None:  # the ratio 1
            return a - b
        return -torch.exp(ratio) * (b - a)
    weight_t, weight_s = b.exp(), a.exp()
    if form == "estimate":
        weight_t, weight_s = (b - a).exp(), torch.ones_like(a)
    if beta == 0.0:
        halves = [weight_t * (b - a)]
    elif beta == 1.0:
        halves = [weight_s * (a - b)]
    else:
        log_m = torch.log(beta * b.exp() + (1.0 - beta) * a.exp())
        halves = [beta * weight_t * (b - log_m), (1.0 - beta) * weight_s * (a - log_m)]
    if clamp:
        halves = [h.clamp(min=0.0) for h in halves]
    return sum(halves)


def normalised(values, how, micro_batch_size, skip=0, count_skipped=False):
    """The loss from per-position values (one (L,) tensor a row), over the positions j >= skip:
      step:         their sum over the whole step / their number (opsd's)
      micro-batch:  the mean over micro-batches (consecutive rows) of each one's sum / its number
      answer:       the mean over answers of each answer's sum / its number
      row:          the mean over answers of each answer's sum (the step's sum / the number of
                    answers)
      sum:          the step's sum
    count_skipped: the step's sum over j >= skip divided by every position's number."""
    kept = [v[skip:] for v in values]
    total = float(sum(v.sum() for v in kept))
    if how == "step":
        return total / max(sum(len(v) for v in (values if count_skipped else kept)), 1)
    if how == "sum":
        return total
    if how == "row":
        return total / len(kept)
    if how == "answer":
        means = [v.mean() for v in kept if len(v)]
        return float(sum(means) / len(means))
    groups = [kept[i:i + micro_batch_size] for i in range(0, len(kept), micro_batch_size)]
    means = [sum(v.sum() for v in g) / n for g in groups if (n := sum(len(v) for v in g))]
    return float(sum(means) / len(means))


class Reference:
    """Rows (dicts with student_prompt_ids, teacher_prompt_ids, completion_ids) and, from the model
    in float64, each row's raw logits on both sides (row_logits)."""

    def __init__(self, rows, model_dir, micro_batch_size, fixture=None):
        self.model = load_model(model_dir)
        self.rows, self.fixture, self.micro_batch_size = rows, fixture, micro_batch_size
        self.lengths = [len(r["completion_ids"]) for r in rows]
        self.forwards = {}  # {(prompt ids, answer ids, gap): row_logits}, shared by its copies
        self.logits = {side: [self.forward(side, r) for r in range(len(rows))] for side in SIDES}

    @classmethod
    def from_fixture(cls, path=FIXTURE):
        fixture = json.loads(Path(path).read_text())
        model_dir = ROOT / fixture["model"]
        if sha16(model_dir / "model.safetensors") != fixture["model_sha256_16"]:
            raise SystemExit(f"verify.py: {fixture['model']} is not the model fixture.json was "
                             "made from.")
        return cls(fixture["rows"], model_dir, fixture["micro_batch_size"], fixture)

    def with_prompts(self, prompts):
        """This reference with some rows' prompts replaced (prompts: {side: {row: ids}}), their
        logits recomputed:
        the peer's own prompts, so that what else differs can be told."""
        if not any(prompts.values()):
            return self
        other = copy.copy(self)
        other.rows = [dict(r) for r in self.rows]
        other.logits = {side: list(x) for side, x in self.logits.items()}
        for side, changed in prompts.items():
            for row, ids in changed.items():
                other.rows[row][f"{side}_prompt_ids"] = ids
                other.logits[side][row] = other.forward(side, row)
        return other

    def forward(self, side, row, gap=0):
        """row_logits of a row, its prompt on `side` then its answer, each computed once."""
        r = self.rows[row]
        key = (tuple(r[f"{side}_prompt_ids"]), tuple(r["completion_ids"]), gap)
        if key not in self.forwards:
            self.forwards[key] = row_logits(self.model, *key)
        return self.forwards[key]

    def answers(self, rows, skip=0):
        """(N,) the answer tokens of `rows`, concatenated, and (N,) whether each of their positions
        is in the loss (from `skip` on)."""
        return (torch.cat([torch.tensor(self.rows[r]["completion_ids"]) for r in rows]),
                torch.cat([torch.arange(self.lengths[r]) >= skip for r in rows]))

    def pads(self, side, size):
        """Per row, how much shorter its prompt on `side` is than the longest of its micro-batch
        (`size` consecutive rows): the pads a batch that pads prompts on the right puts between its
        prompt and its answer."""
        lengths, gaps = [len(r[f"{side}_prompt_ids"]) for r in self.rows], []
        for first in range(0, len(lengths), size):
            group = lengths[first:first + size]
            gaps += [max(group) - n for n in group]
        return gaps

    def shorter(self, side, size):
        """The rows whose prompt on `side` is shorter than their micro-batch's longest."""
        return {r for r, gap in enumerate(self.pads(side, size)) if gap}

    def padded_logits(self, side, size):
        """Each row's logits with its answer at position ids counted over the pads that padding its
        prompt to the micro-batch's longest puts before it (the rows with the longest prompt
        unchanged)."""
        return [self.forward(side, r, gap) for r, gap in enumerate(self.pads(side, size))]

    def joined(self, rows, side, offset=0, padded=None):
        """(N, V) the side's raw logits at the answer positions of `rows`, concatenated, at the
        positions shifted by `offset`; padded: a micro-batch size, for the logits with the
        answer's position ids counted over the pads."""
        x = self.logits[side] if padded is None else self.padded_logits(side, padded)
        return torch.cat([x[r][1 + offset:1 + offset + self.lengths[r]] for r in rows])

    def log_probs(self, side, row, temperature, offset=0, padded=None):
        """(L, V) the side's log-probs at `temperature` (joined's positions)."""
        return torch.log_softmax(self.joined([row], side, offset, padded) / temperature, -1)

    def divergences(self, *, beta, temperature, clip, tau):
        """[(L,)] per row: the divergence at `temperature`."""
        return [divergence(*(self.log_probs(side, row, temperature) for side in SIDES), beta=beta,
                           clip=clip, tau=tau) for row in range(len(self.rows))]


# -----------------------------------------------------------------------------
# Identification: the configuration whose values explain a peer's numbers

class Config(NamedTuple):
    """What a peer computes at each answer position: each side's temperature, the value's form, the
    clip ("none", "entry", "token") at tau, and the support the value is taken over. The support:
    "full" (the whole vocabulary), "top-k" (the top k entries of side `by`, renormalised over them,
    with a tail entry for the rest, or with the side named by `raw` kept as it is) or
    "sampled-token" (the answer token alone). The value is composed: `scale` times a weighted sum
    of terms over the support, plus `nll` times the student's negative log-likelihood of y
    (config_values). The terms: over several entries, the divergence of beta, the reverse KL and the
    cross-entropy, weighted by `weights` (divergence_terms); at the sampled token, `form`, one of
    SAMPLED_FORMS, the halves of "term" and "estimate" clamped at >= 0 or not."""
    student_t: float
    teacher_t: float
    beta: float
    clip: str
    tau: float
    support: str = "full"
    by: str = "student"
    k: int = 0
    tail: bool = False
    form: str = "term"
    clamp: bool = False
    raw: str = ""
    weights: tuple = PLAIN
    scale: float = 1.0
    nll: float = 0.0


def parse_support(text):
    """Config fields of a declared support: "full", "top-k:SIDE:K" (":tail" after it: a tail entry;
    ":raw-SIDE": that side's log-probs as they are, the other's renormalised; ":raw": both as they
    are), or "sampled-token:FORM" (":clamped" after it: each half clamped at >= 0); None if it is
    none of these."""
    if text == "full":
        return {"support": "full"}
    top = re.fullmatch(r"top-k:(student|teacher):(\d+)(:tail|:raw|:raw-student|:raw-teacher)?",
                       text)
    if top and int(top[2]) > 0:
        raw = {":raw-student": "student", ":raw-teacher": "teacher", ":raw": "both"}.get(top[3], "")
        return {"support": "top-k", "by": top[1], "k": int(top[2]), "tail": top[3] == ":tail",
                "raw": raw}
    sampled = re.fullmatch(r"sampled-token:(\w+)(:clamped)?", text)
    if sampled and sampled[1] in SAMPLED_FORMS:
        return {"support": "sampled-token", "form": sampled[1], "clamp": bool(sampled[2])}
    return None


def parse_form(text):
    """Config fields of a declared form, the weights of the terms: "term", "cross-entropy" or
    "mixed:W" (W from 0 to 1, the forward KL at beta 0); None if it is none of these."""
    forms = {"term": PLAIN, "cross-entropy": CROSS_ENTROPY}
    if text in forms:
        return {"weights": forms[text]}
    if text.startswith("mixed:"):
        try:
            w = float(text[len("mixed:"):])
        except ValueError:
            return None
        if 0.0 <= w <= 1.0:
            return {"weights": (w, 1.0 - w, 0.0), "beta": 0.0}
    return None


def form_name(c):
    """The form the weights make, as its cause names it."""
    if c.weights[1]:
        return "mixed"
    if c.weights[2]:
        return "cross-entropy"
    return "term"


def uses_beta(c):
    return c.form == "estimate" or (c.form == "term" and c.weights == PLAIN)


def top_k_kind(c):
    """The top k's kind, as its cause names it: "renormalised", "tail" or "SIDE-raw"."""
    if c.tail:
        return "tail"
    if c.raw:
        return f"{c.raw}-raw"
    return "renormalised"


def kind_of(c):
    if c.support != "sampled-token":
        if form_name(c) == "cross-entropy":
            return "a cross-entropy"
        return "a divergence"
    kind = SAMPLED_FORMS[c.form][0]
    if c.form == "estimate" and c.beta == 1.0 and not c.clamp:
        kind += " (log p_S(y) - log p_T(y): an importance-sampling surrogate at ratio 1 has the " \
                "same values, and the reverse KL's policy gradient for its gradient; these " \
                "values cannot tell them apart)"
    return kind


def describe(c, temperatures=True):
    """The configuration in words (without its temperatures: those of fixed log-probs mean
    nothing)."""
    what = {0.0: "forward KL (beta 0)", 1.0: "reverse KL (beta 1)"}.get(
        c.beta, f"generalized JSD (beta {c.beta:.4g})")
    form = form_name(c)
    if form == "mixed":
        what = f"w KL(T || S) + (1 - w) KL(S || T) with w {c.weights[0]:.4g}"
    elif form == "cross-entropy":
        what = "the cross-entropy -sum p_T log p_S (the forward KL plus the teacher's entropy)"
    if c.support == "sampled-token" and not uses_beta(c):
        what = SAMPLED_FORMS[c.form][1]
    elif c.support == "full":
        what += " over the whole vocabulary"
    elif c.support == "top-k":
        what += f" over the {c.by}'s top {c.k} entries, {TOP_K[top_k_kind(c)]}"
    else:
        short = {"term": "its term there",
                 "estimate": "its one-sample estimate d_y / p_S(y)"}[c.form]
        what += f" at the sampled token y alone, {short}"
    if c.support == "sampled-token" and c.clamp:
        what += ", each half clamped at >= 0"
    if c.scale != 1.0:
        what = f"{c.scale:.4g} x ({what})"
    if c.nll:
        what += f" + {c.nll:.4g} x the student's negative log-likelihood of y"
    clip = {"none": "no clip", "entry": f"each entry clipped at tau {c.tau:.4g}",
            "token": f"the position's value clipped at tau {c.tau:.4g}"}[c.clip]
    if c.support == "sampled-token" and c.clip != "none":
        clip = f"clipped at tau {c.tau:.4g}"
    if not temperatures:
        return f"{what}, {clip}"
    temps = f"T {c.student_t:.4g}"
    if not same(c.student_t, c.teacher_t):
        temps = f"T {c.student_t:.4g} (student) and {c.teacher_t:.4g} (teacher)"
    return f"{what}, {clip}, {temps}"


def same(a, b, rel=1e-3):
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-12)


def differences(found, declared, k_note=None):
    """{cause: note}: how `found` departs from the declared configuration."""
    out = {}
    pairs = {side: (getattr(found, f"{side}_t"), getattr(declared, f"{side}_t")) for side in SIDES}
    moved = {side: pair for side, pair in pairs.items() if not same(*pair)}  # (fitted, declared)
    if len(moved) == 2 and same(found.student_t, found.teacher_t):
        out["temperature:both"] = f"T {found.student_t:.4g} on both sides, " \
                                  f"{declared.student_t:g} declared"
    else:
        for side, (fitted, asked) in moved.items():
            out[f"temperature:{side}"] = f"T {fitted:.4g}, {asked:g} declared"
    if found.support == "top-k" and any(getattr(found, f) != getattr(declared, f)
                                        for f in "support by k tail raw".split()):
        out[f"top-k:{found.by}:{top_k_kind(found)}"] = k_note or f"k = {found.k}"
    elif found.support == "sampled-token" and (found.support, found.form) != (declared.support,
                                                                               declared.form):
        out[f"sampled-token:{found.form}"] = kind_of(found)
    elif found.support == "full" and declared.support != "full":
        out["support:full"] = None
    reweighted = any(abs(a - b) > 1e-3 for a, b in zip(found.weights, declared.weights))
    form = form_name(found)
    if reweighted and found.support != "sampled-token":
        note = None
        if form == "mixed":
            note = f"w {found.weights[0]:.4g}"
            if form_name(declared) == "mixed":
                note += f", {declared.weights[0]:g} declared"
        out[f"form:{form}"] = note
    if found.support == "sampled-token" and found.clamp != declared.clamp:
        out["clamp:halves" if found.clamp else "clamp:none"] = None
    if uses_beta(found) and declared.weights == PLAIN and abs(found.beta - declared.beta) > 1e-3:
        note = f"beta {found.beta:.4g}, {declared.beta:g} declared"
        if declared.beta in (0.0, 1.0) and found.beta == 1.0 - declared.beta:
            note += ": the student and the teacher exchanged"
        out["beta"] = note
    if abs(found.nll - declared.nll) > 1e-3:
        out["term:nll"] = f"weight {found.nll:.4g}, the rest weighted {found.scale:.4g}"
    elif not same(found.scale, declared.scale):
        cause = "scale"
        if same(found.scale, found.student_t ** 2) and found.scale != 1.0:
            cause = "scale:T^2"  # the temperature squared
        out[cause] = f"x{found.scale:.4g}, {declared.scale:.4g} declared"
    if found.clip != declared.clip:
        out[f"clip:{found.clip}"] = None
    elif found.clip != "none" and not same(found.tau, declared.tau):
        out["tau"] = f"tau {found.tau:.4g}, {declared.tau:g} declared"
    return out


class Numbers:
    """One side's numbers at the step's positions, rows concatenated: raw logits (N, V) whose
    temperature is a parameter, log-probs (N, V) as they are, log-probs (N, K) at the ids (N, K) of
    the teacher's top K alone, or the sampled token's log-prob alone (N,); ratio: the log of the
    importance ratio at each sampled token (N,), from the peer's own numbers (importance_ratio)."""

    def __init__(self, logits=None, logprobs=None, token=None, ids=None, ratio=None):
        self.logits, self.logprobs, self.token = logits, logprobs, token
        self.ids, self.ratio = ids, ratio
        self.cache = {}  # {temperature: log-probs}
        self.ranks = None
        self.free = logits is not None  # whether the temperature is a parameter of these numbers
        self.sparse = ids is not None  # log-probs at the teacher's top K ids alone
        self.full = not self.sparse and (logits is not None or logprobs is not None)

    def at(self, index):
        """These numbers at some positions only."""
        fields = (self.logits, self.logprobs, self.token, self.ids, self.ratio)
        return Numbers(*[None if x is None else x[index] for x in fields])

    def log_probs(self, temperature):
        if self.logprobs is not None:
            return self.logprobs
        if temperature not in self.cache:
            if len(self.cache) > 16:
                self.cache.clear()
            self.cache[temperature] = torch.log_softmax(self.logits / temperature, -1)
        return self.cache[temperature]

    def of_token(self, temperature, y):
        """(N,) the log-prob of each sampled token: NaN where only the top K ids are known and y
        is not among them."""
        if self.token is not None:
            return self.token
        if self.sparse:
            hit = self.ids == y[:, None]
            value = torch.where(hit, self.logprobs, 0.0).sum(-1)
            return torch.where(hit.any(-1), value, math.nan)
        return self.log_probs(temperature).gather(-1, y[:, None])[:, 0]

    def order(self):
        """(N, V) the entries by rank, largest first (whatever the temperature); of the top K ids,
        their columns by rank."""
        if self.ranks is None:
            x = self.logits if self.logprobs is None else self.logprobs
            self.ranks = x.argsort(dim=-1, descending=True, stable=True)
        return self.ranks


def config_values(c, numbers, y, peer=None, tie=0.0):
    """(N,) each position's value under configuration c, from both sides' Numbers ({side:
    Numbers}) and the sampled tokens y: its scale times its form's value over its support, plus its
    weight of the student's negative log-likelihood of y (the composition; form_values the form's
    part)."""
    value = form_values(c, numbers, y, peer, tie)
    if c.scale == 1.0 and not c.nll:
        return value
    return c.scale * value - c.nll * numbers["student"].of_token(c.student_t, y)


def form_values(c, numbers, y, peer, tie):
    """(N,) the form's value of configuration c over its support. A top k whose k-th and
    (k + 1)-th log-probs lie within `tie`: the peer's choice, the nearer to `peer`. From the
    teacher's top K ids alone, the student's numbers are at those ids."""
    if c.support == "sampled-token":
        a, b = (numbers[side].of_token(getattr(c, f"{side}_t"), y) for side in SIDES)
        value = sampled_value(a, b, c.form, c.beta, c.clamp, numbers["student"].ratio)
        if c.clip != "none":
            value = value.clamp(max=c.tau)
        return value
    log = {side: numbers[side].log_probs(getattr(c, f"{side}_t")) for side in SIDES}
    terms = {"beta": c.beta, "clip": c.clip, "tau": c.tau, "weights": c.weights}
    if c.support == "full":
        return divergence(*log.values(), **terms)
    order = numbers[c.by].order()
    d = divergence(*top_k_log_probs(*log.values(), c.k, c.tail, order, c.raw), **terms)
    if tie and peer is not None and c.k < order.shape[-1]:
        ranked = log[c.by].gather(-1, order[:, c.k - 1:c.k + 1])
        tied = (ranked[:, 0] - ranked[:, 1]).abs() <= tie
        if tied.any():  # the k-th and (k + 1)-th exchanged: the peer's top k may hold either
            swapped = order[tied].clone()
            swapped[:, [c.k - 1, c.k]] = swapped[:, [c.k, c.k - 1]]
            other = divergence(*top_k_log_probs(*(x[tied] for x in log.values()), c.k, c.tail,
                                                swapped, c.raw), **terms)
            nearer = (peer[tied] - c.scale * other).abs() < (peer[tied] - c.scale * d[tied]).abs()
            d[tied] = torch.where(nearer, other, d[tied])
    return d


def minimise(f, low, high, log=False, points=10, steps=22):
    """The x in [low, high] where f(x) is least: the best of a grid of `points`, then a
    golden-section search between its neighbours (in log x when `log`)."""
    to, back = (math.log, math.exp) if log else (float, float)

    def g(x):  # f where x is searched (its log when `log`)
        return f(back(x))

    grid = [to(low) + (to(high) - to(low)) * i / (points - 1) for i in range(points)]
    scores = [g(x) for x in grid]
    best = min(range(points), key=scores.__getitem__)
    a, b = grid[max(best - 1, 0)], grid[min(best + 1, points - 1)]
    golden = (math.sqrt(5.0) - 1.0) / 2.0
    c, d = b - golden * (b - a), a + golden * (b - a)
    fc, fd = g(c), g(d)
    for _ in range(steps):
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - golden * (b - a)
            fc = g(c)
        else:
            a, c, fc = c, d, fd
            d = a + golden * (b - a)
            fd = g(d)
    x, fx = (c, fc) if fc <= fd else (d, fd)
    return back(x) if fx <= scores[best] else back(grid[best])


TEMPERATURES = (0.2, 5.0)  # the range a temperature is fitted in
TAUS = (1e-4, 20.0)  # and a clip's tau
TOP_K_GRID = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 25, 32, 50, 64, 100, 128, 200, 256, 400)
# the continuous parameters are searched on this many positions, then checked on all
FIT_POSITIONS = 160
# the structures whose temperatures are fitted when none fits without: the declared, the nearest
PHASE_TWO = 3


def close(a, b):
    return (a - b).abs() <= TOL_DIVERGENCE[0] + TOL_DIVERGENCE[1] * b.abs()


class Fit:
    """Fitting configurations to a peer's per-position values `peer` (N,), at the positions `kept`
    (N,) bool, from both sides' Numbers and the sampled tokens y: the declared configuration first,
    then every support, clip and sampled-token form, each with its free parameters (the temperatures
    where the numbers are logits, beta, tau, k) searched."""

    def __init__(self, numbers, y, peer, kept, declared, tie=0.0, narrow=False):
        self.numbers, self.y, self.peer, self.kept = numbers, y, peer, kept
        self.student, self.teacher = numbers["student"], numbers["teacher"]
        self.declared, self.narrow = declared, narrow  # narrow: the declared alone
        self.total = int(kept.sum())
        index = kept.nonzero()[:, 0]
        spread = torch.linspace(0, len(index) - 1, min(FIT_POSITIONS, len(index)))
        index = index[spread.round().long()]
        self.search = ({side: x.at(index) for side, x in numbers.items()}, y[index], peer[index])
        where = {False: (numbers, y, peer), True: self.search}

        def values(c, on_search=False):  # c's values (at the search positions alone when on_search)
            return config_values(c, *where[on_search], tie)

        # each configuration's values computed once (a function of the numbers, not of self: no
        # reference cycle keeps a Fit and its numbers after its last use)
        self.values = functools.cache(values)

    def count(self, c):
        return int((close(self.peer, self.values(c)) & self.kept).sum())

    def score(self, c):
        """The distance searched on: the sum of the absolute differences at the search positions
        (its basin is wide, so a grid finds it; its least is where every position matches)."""
        gap = (self.search[2] - self.values(c, on_search=True)).abs()
        return float(torch.nan_to_num(gap, nan=1e3).sum())  # NaN: a value these numbers lack

    def free(self, c):
        names = [f"{side}_t" for side, x in self.numbers.items() if x.free]
        if uses_beta(c):
            names.append("beta")
        if c.clip != "none":
            names.append("tau")
        return names

    def move(self, c, name):
        """c with the parameter `name` where the score is least (c itself if nothing found is
        better)."""
        def at(x):  # c with the parameter at x ("temperature": one loss temperature on both sides)
            if name == "temperature":
                return c._replace(student_t=x, teacher_t=x)
            return c._replace(**{name: x})

        def score(x):
            return self.score(at(x))

        if name == "beta":  # the ends are the KLs, not the JSD's limits: tried apart
            x = min((0.0, 1.0, minimise(score, 1e-3, 1.0 - 1e-3)), key=score)
        elif name == "tau":
            x = minimise(score, *TAUS, log=True)
        else:
            x = minimise(score, *TEMPERATURES, log=True)
        return min((c, at(x)), key=self.score)  # c where nothing found is better

    def k_bound(self):
        """The least k that is no top k: the vocabulary's size (a top k of it is the whole), or one
        more than K where the numbers are the teacher's top K ids alone (all K of them is a top
        k)."""
        if self.teacher.sparse:
            return self.teacher.ids.shape[-1] + 1
        return self.student.order().shape[-1]

    def top_k(self, c):
        """c with the k that matches the most search positions (the smallest of those)."""
        V = self.k_bound()
        grid = [k for k in TOP_K_GRID if k < V]
        if self.teacher.sparse:
            grid.append(V - 1)
        def count(k):  # the search positions matched
            return int(close(self.search[2], self.values(c._replace(k=k), on_search=True)).sum())

        return c._replace(k=max(grid, key=lambda k: (count(k), -k)))

    def k_note(self, c):
        """The range of k that match as many positions as c's k, in words."""
        V = self.k_bound()
        top = self.count(c)

        def matches(k):  # whether k matches as many positions
            return self.count(c._replace(k=k)) == top

        # the last k from c's towards `direction` (+1 or -1) that matches `top` positions
        def edge(direction):
            inside, step = c.k, 1
            while 1 <= inside + step * direction < V and matches(inside + step * direction):
                inside += step * direction
                step *= 2
            outside = min(max(inside + step * direction, 0), V)
            while abs(outside - inside) > 1:
                middle = (inside + outside) // 2
                if matches(middle):
                    inside = middle
                else:
                    outside = middle
            return inside

        low, high = edge(-1), edge(1)
        if low == high:
            return f"k = {c.k}"
        return f"k from {low} to {high}: these rows tell them apart no further"

    def fitted(self, c, free):
        """c with the parameters `free` fitted (and a top k's k), then put back to the declared
        values wherever those match as many positions. Temperatures are tried in turn, the first
        plan that matches every position ending it: one side's alone, one for both sides, each side
        in turn (their valley can run across both), each after one for both; beta and tau after
        each, in rounds while they gain."""
        if c.support == "top-k":
            c = self.top_k(c)
        rest = [name for name in free if not name.endswith("_t")]
        sides = [name for name in free if name.endswith("_t")]
        plans = [rest] + [[name] + rest for name in sides]
        if len(sides) == 2:
            plans += [["temperature"] + rest, sides + rest, ["temperature"] + sides + rest]
        best, n = c, self.count(c)
        for moves in plans:
            trial = c
            for _ in range(4):  # rounds, while they gain
                if n == self.total:
                    break
                before = self.score(trial)
                for name in moves:
                    trial = self.move(trial, name)
                    if trial.support == "top-k":
                        trial = self.top_k(trial)
                if self.count(trial) > n:
                    best, n = trial, self.count(trial)
                if not moves or self.score(trial) >= before * 0.999:
                    break
            if n == self.total:
                break
        for name in free:
            back = best._replace(**{name: getattr(self.declared, name)})
            if self.count(back) >= n:
                best = back
        unclipped = best._replace(clip="none", tau=self.declared.tau)
        if best.clip != "none" and best.tau != self.declared.tau and self.count(unclipped) >= n:
            best = unclipped  # a clip at a fitted tau that changes nothing is no clip
        if n < self.total:
            best = max((self.composed(c), self.composed(best)), key=self.count)
        return best

    def composed(self, c):
        """c with the composition's weights fitted by least squares, each position weighted by its
        tolerance: the weights of c's terms (those it weights), without and then with a weight of
        the student's negative log-likelihood of y; their sum is the scale (put at T^2 or the
        declared one where it is that), the terms' weights its shares. c itself where neither
        matches more positions."""
        terms = [i for i, w in enumerate(c.weights) if w]
        alone = [tuple(float(i == j) for j in range(3)) for i in terms]  # each term's weights
        columns = [self.values(c._replace(scale=1.0, nll=0.0, weights=w)) for w in alone]
        columns.append(-self.student.of_token(c.student_t, self.y))
        keep = self.kept & torch.stack(columns).isfinite().all(0)
        weight = 1.0 / (TOL_DIVERGENCE[0] + TOL_DIVERGENCE[1] * self.peer[keep].abs())
        best, n = c, self.count(c)
        for fitted in (columns[:-1], columns):
            a = torch.stack([x[keep] for x in fitted], -1) * weight[:, None]
            solution = torch.linalg.lstsq(a, self.peer[keep] * weight).solution.tolist() + [0.0]
            scale = sum(solution[:len(terms)])
            if not scale:
                continue
            weights = [0.0, 0.0, 0.0]
            for i, x in zip(terms, solution):
                weights[i] = x / scale
            for exact in (self.declared.scale, c.student_t ** 2):
                if same(scale, exact, 1e-4):
                    scale = exact
            trial = c._replace(scale=scale, nll=solution[len(terms)], weights=tuple(weights))
            if self.count(trial) > n:
                best, n = trial, self.count(trial)
        return best

    def structures(self):
        """Config fields of every structure tried, the declared one first, then the fixture's
        supports and the sampled token's forms, then the other forms over the whole vocabulary and
        over a top k. From the teacher's top K ids and the student's log-probs there, only a top k
        of the teacher (k up to K) and the sampled token where it is among them."""
        d = self.declared
        full = self.student.full and self.teacher.full
        sparse = self.student.sparse and self.teacher.sparse
        out = []
        # the declared structure itself, where these numbers give it (any k: fitted finds k); the
        # sampled token's log-probs alone give no other support
        if computable(d._replace(k=0), self.numbers):
            out.append({})
        plain = {"form": "term", "weights": PLAIN, "raw": "", "tail": False}
        top = {**plain, "support": "top-k", "by": "teacher", "clip": d.clip}
        clips = dict.fromkeys((d.clip, "none"))
        if full:
            out += [{**plain, "support": "full", "clip": clip} for clip in CLIPS]
        out += [{**top, "by": by, "tail": tail} for by in SIDES for tail in (False, True)
                if full or (sparse and by == "teacher")]
        out += [{"support": "sampled-token", "form": form, "weights": PLAIN, "clamp": clamp,
                 "clip": clip} for form in SAMPLED_FORMS for clamp in (False, True)
                for clip in clips if not clamp or form in ("term", "estimate")]
        # the other weights of the terms (their shares fitted by least squares, Fit.composed)
        mixed, entropy = {"weights": (0.5, 0.5, 0.0), "beta": 0.0}, {"weights": CROSS_ENTROPY}
        if full:
            out += [{**plain, **form, "support": "full", "clip": clip}
                    for form in (mixed, entropy) for clip in clips]
        if full or sparse:
            out += [{**top, **form, "raw": raw} for raw, form in (
                ("student", {}), ("student", entropy), ("", entropy), ("both", {}))]
        if full:
            out.append({**top, "by": "student", "raw": "teacher"})
        return out

    def identify(self):
        """(positions matched, configuration, the top k's note) of the best: the most positions
        matched, then the fewest differences from the declared configuration. The declared
        structure first, then every other, each with beta and tau fitted; then, if none matched
        every position and the numbers are logits, the declared structure and the nearest others
        (PHASE_TWO in all) with the temperatures fitted too. The first that matches every position
        ends the search."""
        found = []
        structures = self.structures()
        if self.narrow:
            structures = structures[:1]
        for fit_temperatures in (False, True):
            if fit_temperatures:
                if not (self.student.free or self.teacher.free):
                    break
                # the temperatures refitted for the declared structure and those that came nearest
                nearest = sorted(range(1, len(found)), key=lambda i: -found[i][0])[:PHASE_TWO - 1]
                structures = [structures[i] for i in [0] + sorted(nearest)]
            for fields in structures:
                c = self.declared._replace(**fields)  # a top k's k: fitted's
                c = self.fitted(c, [n for n in self.free(c) if fit_temperatures
                                    or not n.endswith("_t")])
                found.append((self.count(c), c))
                if found[-1][0] == self.total:
                    break
            if found[-1][0] == self.total:
                break
        n, c = min(found, key=lambda f: (-f[0], len(differences(f[1], self.declared))))
        if c.support == "top-k":
            return n, c, self.k_note(c)
        return n, c, None


# a configuration that matches less than this share of positions is not offered as a hint
HINT_SHARE = 0.9


# -----------------------------------------------------------------------------
# Check 2: the batch's invariants

def check_batch(input_ids, attention_mask, position_ids, answer_mask, scored_mask=None):
    """[one sentence per broken invariant] of a peer's micro-batch, (B, T) each: answer_mask marks
    the answer tokens; scored_mask (optional) the positions whose outputs the peer scores them with.
    Whatever the padding, each row's real tokens (attention mask 1) must have contiguous position
    ids, its answer tokens must be real and adjacent, answer token 0 must come right after a real
    prompt token (it is predicted from the prompt's last token), and the scored positions must be
    those just before the answer tokens. An empty list: the batch keeps every row's order."""
    return [sentence for _, sentence in batch_problems(input_ids, attention_mask, position_ids,
                                                       answer_mask, scored_mask)]


def batch_problems(input_ids, attention_mask, position_ids, answer_mask, scored_mask=None):
    """check_batch's sentences, each with the cause it points to ("position-ids", "pad-first",
    "shift:+1", "shift:-1", "scored:beyond-answer" or None)."""
    problems = []
    for row in range(input_ids.shape[0]):
        real = attention_mask[row].bool()
        answer = answer_mask[row].bool().nonzero()[:, 0]
        positions = position_ids[row][real]
        gaps = (positions.diff() != 1).nonzero()[:, 0]
        if len(gaps):
            i = int(gaps[0])
            problems.append(("position-ids",
                             f"row {row}: its real tokens' position ids jump from "
                             f"{int(positions[i])} to {int(positions[i + 1])}: they must count the "
                             "real tokens without a gap."))
        if not len(answer):
            problems.append((None, f"row {row}: no answer token is marked."))
            continue
        if not real[answer].all() or (answer.diff() != 1).any():
            problems.append((None,
                             f"row {row}: its answer tokens are not one unmasked run of tokens."))
        first = int(answer[0])
        before = first - 1  # the real token before answer token 0
        while before >= 0 and not real[before]:
            before -= 1
        if before < 0:
            problems.append((None, f"row {row}: no real prompt token comes before answer token 0."))
        elif before != first - 1:
            problems.append(("pad-first",
                             f"row {row}: {first - 1 - before} pad(s) lie between the prompt and "
                             "answer token 0, so the output at the position before it (a pad's) "
                             "predicts it, not the prompt's last token's."))
        if scored_mask is not None:
            problems += scored_problems(row, scored_mask[row].bool(), real, answer)
    return problems


def scored_problems(row, scored, real, answer):
    """batch_problems' sentences on one row's scored positions: shifted, or more than the positions
    before the answer tokens (the cause "scored:beyond-answer"), or else not those."""
    wanted = (answer - 1).tolist()
    at = scored.nonzero()[:, 0].tolist()
    if at == wanted:
        return []
    first = wanted[0] + 1
    for offset in (1, -1):
        if at == [i + offset for i in wanted]:
            return [(f"shift:{offset:+d}", f"row {row}: answer token 0 (index {first}) is scored "
                     f"with the output at index {first - 1 + offset}, not at index {first - 1} "
                     "(the token before it).")]
    extra = sorted(set(at) - set(wanted))
    if set(wanted) <= set(at):
        last = wanted[-1] + 1
        kinds = []
        if last in extra:
            kinds.append(f"the output at the answer's last token (index {last}), which predicts no "
                         "answer token")
        prompt = [i for i in extra if i < first - 1 and real[i]]
        if prompt:
            kinds.append(f"{len(prompt)} outputs at prompt tokens (indices {prompt[0]} to "
                         f"{prompt[-1]})")
        pads = [i for i in extra if not real[i]]
        if pads:
            kinds.append(f"{len(pads)} outputs at pads")
        kinds = kinds or [f"{len(extra)} other outputs"]
        return [("scored:beyond-answer", f"row {row}: besides the {len(wanted)} outputs before its "
                 f"answer tokens, the loss scores {' and '.join(kinds)}.")]
    missing = sorted(set(wanted) - set(at))
    return [(None, f"row {row}: the output before answer token {missing[0] - first + 1} (index "
             f"{missing[0]}) is not scored; {len(extra)} other outputs are.")]


# -----------------------------------------------------------------------------
# The peer's dump

class Dump(NamedTuple):
    setting: str | None
    clip: str
    loss: float | None
    normalisation: str | None
    micro_batch_size: int | None
    rows: dict  # {row: {name: tensor}}
    batches: dict  # {(micro-batch, side): {name: tensor}}
    # "raw" (before the temperature) or "divided" (already divided by it); None: unsaid
    logits: str | None = None
    # what the metadata declares besides: temperature, beta, tau, skip_first_tokens, support
    declared: dict = {}


ROW_TENSORS = ("divergence", "beyond_divergence", "teacher_topk_ids", "sampler_token_logprobs",
               *(f"{side}_{kind}" for side in SIDES for kind in ("logprobs", "logits",
                 "token_logprobs", "topk_logprobs", "prompt_ids")))
BATCH_TENSORS = ("input_ids", "attention_mask", "position_ids", "answer_mask", "scored_mask")
DECLARABLE = {"temperature": float, "beta": float, "tau": float, "skip_first_tokens": int,
              "support": str, "form": str, "scale": str, "nll": float}


def write_dump(path, *, setting=None, clip, rows, loss=None, normalisation=None,
               micro_batch_size=None, batches=None, logits=None, **declared):
    """Write a dump: rows {fixture row: {name: tensor}} (names in ROW_TENSORS), batches
    {(k, side): {name: tensor}} (names in BATCH_TENSORS), the rest as text in the file's metadata;
    `declared`: any of DECLARABLE, a setting of the peer's own (with or instead of one of the
    fixture's)."""
    from safetensors.torch import save_file

    tensors = {f"row{i}.{name}": t for i, named in rows.items() for name, t in named.items()}
    for (k, side), named in (batches or {}).items():
        tensors.update({f"batch{k}.{side}.{name}": t for name, t in named.items()})
    if loss is not None:
        loss = float(loss)  # a tensor's as its number
    given = {"clip": clip, "setting": setting, "loss": loss, "normalisation": normalisation,
             "micro_batch_size": micro_batch_size, "logits": logits, **declared}
    meta = {key: str(value) for key, value in given.items() if value is not None}
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(path), metadata=meta)


def read_dump(path):
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    if "clip" not in meta:
        raise SystemExit(f"verify.py: {path} has no 'clip' in its metadata (README.md: the dump).")
    if "setting" not in meta and not ("temperature" in meta and ("beta" in meta or "form" in meta)):
        raise SystemExit(f"verify.py: {path} has neither a 'setting' nor a 'temperature' and a "
                         "'beta' (or a 'form') in its metadata (README.md: the dump).")
    rows, batches = {}, {}
    for name, t in tensors.items():
        row = re.fullmatch(r"row(\d+)\.(.+)", name)
        batch = re.fullmatch(r"batch(\d+)\.(student|teacher)\.(.+)", name)
        if row and row[2] in ROW_TENSORS:
            rows.setdefault(int(row[1]), {})[row[2]] = t
        elif batch and batch[3] in BATCH_TENSORS:
            batches.setdefault((int(batch[1]), batch[2]), {})[batch[3]] = t
        else:
            raise SystemExit(f"verify.py: {path} holds {name!r}, which is no tensor of a dump "
                             "(README.md).")
    if meta.get("logits", "raw") not in ("raw", "divided"):
        raise SystemExit(f"verify.py: {path}: its metadata's logits is {meta['logits']!r}; say "
                         "'raw' (before the temperature) or 'divided' (already divided by it).")
    declared = {}
    for key, kind in {**DECLARABLE, "loss": float, "micro_batch_size": int}.items():
        if key in meta:
            try:
                declared[key] = kind(meta[key])
            except ValueError:
                raise SystemExit(f"verify.py: {path}: its metadata's {key} is {meta[key]!r}, not a "
                                 "number.")
    if "form" in declared and parse_form(declared["form"]) is None:
        raise SystemExit(f"verify.py: {path}: its metadata's form is {declared['form']!r}; say "
                         "'term', 'cross-entropy' or 'mixed:W' (W from 0 to 1).")
    if "support" in declared and parse_support(declared["support"]) is None:
        raise SystemExit(f"verify.py: {path}: its metadata's support is {declared['support']!r}; "
                         "say 'full', 'top-k:SIDE:K' (':tail' after it for a tail entry, "
                         "':raw-SIDE' for that side's log-probs as they are) or "
                         f"'sampled-token:FORM' (FORM one of {', '.join(SAMPLED_FORMS)}; "
                         "':clamped' after it for halves clamped at >= 0).")
    return Dump(meta.get("setting"), meta["clip"], declared.pop("loss", None),
                meta.get("normalisation"), declared.pop("micro_batch_size", None), rows, batches,
                meta.get("logits"), declared)


# -----------------------------------------------------------------------------
# The checks

TOP_K = {"renormalised": "both sides' probabilities renormalised over them",
         "tail": "and one more entry holding the rest of each side's mass",
         "both-raw": "both sides' log-probs used as they are (their sums below 1)",
         **{f"{side}-raw": f"the {other}'s probabilities renormalised over them and the {side}'s "
            "log-probs used as they are" for side, other in zip(SIDES, reversed(SIDES))}}
CAUSES = {
    **{f"temperature:{side}": f"{whose} log-probs are at another temperature than the declared "
       "one" for side, whose in (("student", "the student's"), ("teacher", "the teacher's"),
                                 ("both", "both sides'"))},
    "beta": "another divergence than the declared one (beta 0 the forward KL, 1 the reverse, "
            "between the generalized JSD)",
    "clip:entry": "the clip bounds each vocabulary entry's term before the sum (the entry clip)",
    "clip:token": "the clip bounds the position's sum, after the sum (the token clip)",
    "clip:none": "no clip",
    "tau": "the clip bounds at another tau than the declared one",
    **{f"normalisation:{how}": f"the loss is {what}, not the step's sum over all its answer tokens "
       "/ their number" for how, what in (
           ("micro-batch", "the mean over micro-batches of each micro-batch's token mean"),
           ("answer", "the mean over answers of each answer's token mean"),
           ("row", "the mean over answers of each answer's sum (the step's sum / the number of "
                   "answers)"),
           ("sum", "the step's sum over its answer tokens"),
           ("divisor", "the step's sum divided by a count the dump shows (given)"))},
    "skip:ignored": "the first answer positions are not left out of the loss (--skip-first-tokens)",
    "skip:counted": "the left-out first positions still count in the loss's denominator",
    **{f"pad-first:{side}": f"the first answer position of each row whose {side} prompt is shorter "
       f"than its micro-batch's longest is predicted from a pad's hidden state (prompts padded on "
       "the right, answers after the pads, logits taken from the micro-batch's prompt length)"
       for side in SIDES},
    "pad-first:either": "the first answer position of rows whose prompts are shorter than their "
                        "micro-batch's longest on both sides is predicted from a pad's hidden "
                        "state (the rows cannot tell which side)",
    **{f"position-ids:{side}": f"the answer tokens of rows with a shorter {side} prompt sit at "
       "position ids counted over the pads after the prompt, not over the real tokens"
       for side in SIDES},
    "position-ids:either": "the answer tokens of rows with shorter prompts sit at position ids "
                           "counted over the pads (the rows cannot tell which side)",
    "shift:+1": "every position is one too late: position j is the output at answer token j itself "
                "(which predicts token j + 1), not at the token before it",
    "shift:-1": "every position is one too early: position j is the output two tokens before "
                "answer token j",
    **{f"prompt:{side}": f"the {side}'s prompt differs from the fixture's (compare your ids with "
       f"each row's {side}_prompt_ids)" for side in SIDES},
    "logits:divided": "these logits are already divided by a temperature, though the dump's "
                      "metadata (or the other side) says raw: dump both sides alike and say which "
                      "in the metadata's logits",
    **{f"top-k:{by}:{kind}": f"the value is taken over the {by}'s top k entries only, {how}"
       for by in SIDES for kind, how in TOP_K.items()},
    "form:mixed": "the value is a weighted sum of the two KLs, w KL(T || S) + (1 - w) KL(S || T), "
                  "not the declared divergence (at w 0.5 it is far from the JSD of beta 0.5)",
    "form:cross-entropy": "the value is the cross-entropy -sum_v p_T(v) log p_S(v), the forward KL "
                          "plus the teacher's entropy over the same entries: it does not vanish "
                          "where the two sides agree",
    "form:term": "the value is the divergence of beta (0 the forward KL, 1 the reverse, between "
                 "the generalized JSD), not the declared form",
    "prompt:teacher=student": "the teacher is given the student's own prompt, without the "
                              "reference: with one model on both sides its log-probs are the "
                              "student's, every value and the loss are 0, and the step carries "
                              "no signal",
    "value:unexplained": "your values at some positions are none of the configurations tried "
                         "(its size: those positions replaced by what explains the rest)",
    "loss:unexplained": "your loss is not reproduced from your rows: no normalisation of your "
                        "values, nor their sum over a count the dump shows, gives it (its size: "
                        "your loss against your values' step token mean)",
    "scored:beyond-answer": "the loss also scores outputs that predict no answer token (the "
                            "output at the answer's last token, prompt tokens or pads: the batch "
                            "check says which); its size: your loss without them",
    "scale": "every value is a constant times the declared one",
    "scale:T^2": "every value is the declared one times the temperature squared",
    "term:nll": "the value adds a weight of the student's negative log-likelihood of the sampled "
                "token, -log p_S(y), to the declared value (itself weighted)",
    "support:full": "the value is taken over the whole vocabulary, not over the declared support",
    "clamp:halves": "each half of the sampled-token value is clamped at >= 0",
    "clamp:none": "the sampled-token value's halves are not clamped, though declared so",
    **{f"sampled-token:{form}": "each position's value comes from the sampled answer token y "
                                f"alone: {text}"
       for form, (_, text) in SAMPLED_FORMS.items()},
}


class Check(NamedTuple):
    name: str
    status: str  # "matches", "differs" or "not checked"
    lines: list
    causes: list = []  # keys of CAUSES
    notes: dict = {}  # {cause: what the numbers say of it, e.g. the k of a top-k divergence}
    found: str | None = None  # what the check identified the peer computes, with the residual
    # {cause: (the loss with the departures found, the loss with that one alone undone)}, each the
    # step's token mean
    sizes: dict = {}


def span(rows):
    """'rows 1, 2, 5' of a set of rows (at most 12 named)."""
    rows = sorted(rows)
    named = ", ".join(map(str, rows[:12]))
    if len(rows) > 12:
        named += f" and {len(rows) - 12} more"
    return f"row{'s' if len(rows) > 1 else ''} {named}"


def side_of(rows, shorter):
    """Which side's shorter-prompt rows hold `rows` (shorter: {side: rows}, one side or both): that
    side, 'either' (every such row is shorter on both sides), 'both' (some are shorter on one side
    only, some on the other only) or None."""
    on = [side for side in shorter if rows <= shorter[side]]
    if len(on) == 2:
        return "either"
    if on:
        return on[0]
    return "both" if len(shorter) == 2 and rows <= set().union(*shorter.values()) else None


def side_causes(kind, side):
    return [f"{kind}:{s}" for s in SIDES] if side == "both" else [f"{kind}:{side}"]


class Reading(NamedTuple):
    """What diagnose reads: its lines and causes, whether every position is explained, the
    hypothesis that explains most, and {cause: {row: (L,) bool}} the positions each cause
    explains."""
    lines: list
    causes: list
    explained: bool
    best: str
    positions: dict


def diagnose(hypotheses, errors, matched, shorter):
    """Reading of a comparison, explained False where positions are left that nothing names.
    hypotheses: {name: [its causes]}, the first the fixture's (no cause); errors, matched: {name:
    {row: (L,)}}, each position's distance to the hypothesis and whether it lies within the
    tolerance; shorter: {side: rows shorter than their micro-batch's longest prompt}, of the side
    compared (or of both, for the divergence). The hypothesis matching most positions explains them;
    the positions it leaves are read by their pattern:
      - the first position of rows with a shorter prompt, off by far more than the row's other
        positions (PAD_FIRST_RATIO times): the first position predicted from a pad;
      - other positions, only in rows with a shorter prompt: position ids counted over pads;
      - every position of some rows, on one side: that side's prompt."""
    asked = next(iter(hypotheses))
    rows = sorted(errors[asked])
    total = sum(len(errors[asked][r]) for r in rows)
    count = {h: sum(int(matched[h][r].sum()) for r in rows) for h in hypotheses}
    if count[asked] == total:
        return Reading([f"all {total} positions match (largest difference "
                        f"{max_error(errors[asked]):.1e})"], [], True, asked, {})
    best = max(hypotheses, key=lambda h: (count[h], h == asked))
    lines, causes, positions = [f"{count[asked]} of {total} positions match"], [], {}

    def name(found, at):  # the causes found, each explaining the positions `at`
        causes.extend(found)
        positions.update(dict.fromkeys(found, at))

    if best != asked:
        lines.append(f"{count[best]} of {total} positions match {best}")
        name(hypotheses[best], {r: matched[best][r] for r in rows})
    err = errors[best]
    left = {r: ~matched[best][r] for r in rows}  # what the best hypothesis leaves unexplained
    rest = lambda r: float(err[r][1:].max()) if len(err[r]) > 1 else 0.0  # noqa: E731
    pad_first = {r for r in rows if left[r][0] and err[r][0] > PAD_FIRST_RATIO * rest(r)}
    where = side_of(pad_first, shorter) if pad_first else None
    if where:
        of = ""
        if where in shorter:
            of = f" ({len(pad_first)} of the {len(shorter[where])} shorter rows)"
        against = "the fixture's" if best == asked else f"those of {best}"
        lines.append(f"the first position of {span(pad_first)}{of} differs from {against} by up to "
                     f"{max(float(err[r][0]) for r in pad_first):.3g}, their other positions by at "
                     f"most {max(rest(r) for r in pad_first):.1e}")
        firsts = {r: torch.arange(len(err[r])) == 0 for r in pad_first}
        name(side_causes("pad-first", where), firsts)
        for r in pad_first:
            left[r][0] = False
    drift = {r: left[r] for r in rows if left[r].any()}
    if drift:
        n = sum(int(left[r].sum()) for r in drift)
        largest = max(float(err[r][left[r]].max()) for r in drift)
        where = side_of(set(drift), shorter)
        if where:
            lines.append(f"{n} positions of {span(drift)}, every one a row with a shorter prompt "
                         f"than its micro-batch's longest, differ (by up to {largest:.1e})")
            name(side_causes("position-ids", where), drift)
        elif len(shorter) == 1 and all(left[r].all() for r in drift):
            lines.append(f"every position of {span(drift)} differs (by up to {largest:.3g})")
            name([f"prompt:{next(iter(shorter))}"], drift)
        else:
            worst = max((float(err[r][j]), r, j) for r in drift for j in range(len(err[r]))
                        if left[r][j])
            lines.append(f"{n} positions of {span(drift)} differ; the largest difference, "
                         f"{worst[0]:.3g}, at row {worst[1]} position {worst[2]}")
            return Reading(lines, causes, False, best, positions)
    return Reading(lines, causes, True, best, positions)


def max_error(per_row):
    return max((float(e.max()) for e in per_row.values() if len(e)), default=0.0)


def side_numbers(dump, side):
    """(key, {row: float64 tensor}): the side's numbers in the dump, its log-probs, logits,
    log-probs at the teacher's top K ids (with those ids in every row) or sampled-token log-probs,
    whichever every row holds; (None, {}) if none."""
    keys = (f"{side}_logprobs", f"{side}_logits", f"{side}_topk_logprobs", f"{side}_token_logprobs")
    for key in keys:
        needs = {key}
        if key.endswith("_topk_logprobs"):
            needs.add("teacher_topk_ids")
        if dump.rows and all(needs <= set(t) for t in dump.rows.values()):
            return key, {r: t[key].double() for r, t in dump.rows.items()}
    return None, {}


def compare_side(ref, dump, side, declared, size, divided, inferred, own_prompts, skip):
    """Check: the side's log-probs (or logits: raw, or already divided by the temperature when
    `divided`; `inferred`: the form read from the numbers, the dump not saying; or the sampled
    token's log-probs) at every answer position, against the reference's; the temperature they are
    at, fitted; and against what positions shifted by one or position ids counted over the pads of
    micro-batches of `size` rows would give. Each cause's size: the loss from these numbers (the
    other side the reference's), against the same with the positions it explains as they would be
    without it (skip: the positions left out of the loss)."""
    name = f"{side} log-probs"
    key, numbers = side_numbers(dump, side)
    if key is None:
        return Check(name, "not checked",
                     [f"the dump holds no {side}_logprobs (nor {side}_logits, nor "
                      f"{side}_token_logprobs) for every row"])
    T = getattr(declared, f"{side}_t")
    logits = key.endswith("_logits")
    token = key.endswith("_token_logprobs")
    ids = {}
    if key.endswith("_topk_logprobs"):
        ids = {r: t["teacher_topk_ids"].long() for r, t in dump.rows.items()}
    raw = logits and not divided
    expected = T  # the temperature the reference's log-softmax is compared at
    if raw:
        expected = 1.0  # raw logits hide the temperature
    lines, x = [], {}
    for row, v in sorted(numbers.items()):
        want = None
        if row < len(ref.rows):
            want = tuple(ref.logits[side][row][1:-1].shape)  # (L, V): the answer positions
            if token:
                want = want[:1]
            if ids:
                want = tuple(ids[row].shape)
        if v.shape != want:
            lines.append(f"row {row}: shape {tuple(v.shape)}, the fixture's "
                         f"{want or 'has no such row'}")
            continue
        x[row] = torch.log_softmax(v, -1) if logits else v
    if lines:
        return Check(name, "differs", lines)

    lengths = [ref.lengths[row] for row in x]
    total = sum(lengths)
    seen = torch.cat(list(x.values())).view(total, -1)  # the rows joined
    picks = None  # the columns compared: the teacher's top K ids, the sampled token or all
    if ids:
        picks = torch.cat([ids[row] for row in x])
    if token:
        picks = ref.answers(x)[0][:, None]

    ours = functools.cache(functools.partial(ref.joined, x))  # the reference's logits of x's rows

    # each row's distances to the reference's log-probs: the fixture's, or at another temperature,
    # positions shifted by `offset`, position ids counted over the pads of micro-batches of
    # `padded` rows, or the `source` side's numbers
    def errors(temperature=expected, offset=0, padded=None, source=None):
        want = torch.log_softmax(ours(source or side, offset, padded) / temperature, -1)
        if picks is not None:
            want = want.gather(-1, picks)
        return dict(zip(x, want.sub_(seen).abs_().amax(-1).split(lengths)))

    def count(*args, **kw):  # the positions within the tolerance
        return sum(int((e <= TOL_LOGPROB).sum()) for e in errors(*args, **kw).values())

    # name: (reference's arguments, {cause: the argument it sets}); the temperature fitted at each
    # alignment of the positions, so that one at the positions a shift puts them is not read at the
    # unshifted ones
    hypotheses = {"the fixture": ({}, {})}
    notes, fits = {}, {}
    for offset in (0, 1, -1):
        shift, where = {}, ""
        if offset:
            shift, where = {f"shift:{offset:+d}": "offset"}, f"positions shifted by {offset:+d}"
            hypotheses[where] = ({"offset": offset}, shift)
        fitted = minimise(lambda t: sum(float(e.sum()) for e in errors(t, offset).values()),
                          *TEMPERATURES, log=True)
        fits[offset] = fitted
        if same(fitted, expected) or count(fitted, offset) <= max(count(expected, offset),
                                                                  total // 2):
            continue
        cause, label = f"temperature:{side}", f"temperature {fitted:.4g}"
        note = f"T {fitted:.4g}, {expected:g} declared"
        if raw:
            cause, label, note = "logits:divided", f"logits divided by {fitted:.4g}", \
                f"by {fitted:.4g}"
        label = ", ".join(filter(None, [label, where]))
        hypotheses[label] = ({"temperature": fitted, "offset": offset},
                             {cause: "temperature", **shift})
        notes[label] = {cause: note}
    hypotheses["position ids counted over the pads"] = ({"padded": size},
                                                        {f"position-ids:{side}": "padded"})
    student_like = "the student's log-probs"
    # named only where the teacher's numbers are mostly the student's
    if side == "teacher" and count(source="student") > total // 2:
        hypotheses[student_like] = ({"source": "student"}, {"prompt:teacher=student": "source"})
    errs = {h: errors(**kw) for h, (kw, _) in hypotheses.items()}
    matched = {h: {r: e <= TOL_LOGPROB for r, e in errs[h].items()} for h in hypotheses}
    reading = diagnose({h: list(c) for h, (_, c) in hypotheses.items()}, errs, matched,
                       {side: ref.shorter(side, size)})
    found, causes = reading.lines, reading.causes
    if not reading.explained:  # a hypothesis that explains some positions only is no verified cause
        causes = []
        found.append("no hypothesis tried explains every position: nothing is named")
    best, sets = hypotheses[reading.best]  # reference's arguments, {cause: the argument it sets}
    offset = best.get("offset", 0)
    at, fitted = best.get("temperature", expected), fits[offset]
    notes = notes.get(reading.best, {})
    sizes = {}
    if causes:
        # each cause's size: the step's token mean under the declared configuration from these
        # log-probs (the reference's under the best hypothesis, where they are a sampled token's or
        # a top K's) and the other side's reference, against the same with the positions the cause
        # explains replaced by the reference's without it: the argument it sets put back to the
        # fixture's
        scale = 1.0
        if raw:
            scale = T  # the hypotheses' temperatures are this many times the loss temperature's

        def reference(row, temperature=expected, offset=0, padded=None, source=None):  # a row's
            # log-probs under a hypothesis's arguments (errors'), its temperature times `scale`
            return ref.log_probs(source or side, row, temperature * scale, offset, padded)

        if token or ids:  # a sampled token's or a top K's: the reference's under the best one
            rows = list(range(len(ref.rows)))
            own = {row: reference(row, **best) for row in rows}
        else:
            rows = list(x)
            own = {row: torch.log_softmax(v / scale, -1) for row, v in x.items()}
        y, kept = ref.answers(rows, skip)

        def loss(log_p, offset):  # the other side's log-probs at the same positions as these
            pair = reference_numbers(ref, rows, offset=offset)
            pair[side] = Numbers(logprobs=torch.cat([log_p[row] for row in rows]))
            values = config_values(declared, pair, y)
            return float(values[kept].sum()) / max(int(kept.sum()), 1)

        with_it = loss(own, offset)
        for cause in causes:
            arguments = dict(best)
            if cause in sets:  # the argument it sets back at the fixture's
                del arguments[sets[cause]]
            undone = dict(own)
            for row, positions in reading.positions[cause].items():
                without = reference(row, **arguments)
                undone[row] = torch.where(positions[:, None], without, own[row])
            # a shift moves both sides' positions: undone on both
            sizes[cause] = (with_it, loss(undone, arguments.get("offset", 0)))
    unit = f"log-probs at temperature {T:g}"
    if token:
        unit = f"the sampled token's {unit}"
    if ids:
        K = next(iter(ids.values())).shape[-1]
        unit = f"log-probs at the teacher's top {K} ids at temperature {T:g}"
    if logits:
        unit = "raw logits (before the temperature, which cannot be seen in them)"
        if divided:
            unit = f"logits already divided by T = {T:g}"
        if inferred and T != 1.0:
            unit += " (read from the numbers: say which in the dump's metadata logits)"
        unit += ", log-softmaxed"
    if own_prompts:
        unit += ", against your own prompt ids"
    ok = found[0].startswith("all")  # every position matches the fixture's: no cause
    head = f"{unit}, |delta log p| within {TOL_LOGPROB:g}: {found[0]}"
    if ids and side == "teacher":
        found.append(top_ids_line(ref, ids, at))
    residual = f"|delta log p| up to {max_error(errs[reading.best]):.1e}"
    identified = f"log-probs at T {at:.4g} (fitted: {fitted:.4g}), {residual}"
    if raw:
        identified = f"logits divided by {at:.4g}, {residual}"
    if raw and at == expected:
        identified = "raw logits (the temperature is not in them; the divergence shows it)"
    if reading.best == student_like:
        identified = f"the student's log-probs (the teacher given the student's prompt), {residual}"
    if not reading.explained:
        identified = "no hypothesis tried explains every position (|delta log p| up to " \
                     f"{max_error(errs['the fixture']):.1e} from the declared)"
    return Check(name, "matches" if ok else "differs", [head, *found[1:]], causes, notes,
                 f"{side}: {identified}", sizes)


def top_ids_line(ref, ids, temperature):
    """A line saying at how many positions the dumped ids are the reference teacher's top K (each
    id's log-prob no lower than the K-th largest's, within the tolerance)."""
    wrong, total = 0, 0
    for row, top in ids.items():
        log_t = ref.log_probs("teacher", row, temperature)
        K = top.shape[-1]
        kth = log_t.topk(K, -1).values[:, -1]
        wrong += int((log_t.gather(-1, top).amin(-1) < kth - TOL_LOGPROB).sum())
        total += len(top)
    if not wrong:
        return f"the ids are the teacher's top {K} at all {total} positions"
    return f"the ids are not the teacher's top {K} at {wrong} of {total} positions"


def logits_form(ref, dump, T):
    """(divided, inferred): whether the dumped logits are already divided by the temperature T, and
    whether that was read from the numbers (the metadata not saying). Read from the numbers, both
    sides together: the form under which more of their positions match the reference (a tie, e.g.
    one side each, reads as divided: a peer that divides its logits by T and forgets one side)."""
    if dump.logits is not None:
        return dump.logits == "divided", False
    sides = [s for s in SIDES if dump.rows and all(f"{s}_logits" in t and f"{s}_logprobs" not in t
                                                    for t in dump.rows.values())]
    if T == 1.0 or not sides:
        return False, False
    count = {1.0: 0, T: 0}  # {temperature: the positions matched}
    for t in count:
        for side in sides:
            for row, tensors in dump.rows.items():
                x = torch.log_softmax(tensors[f"{side}_logits"].double(), -1)
                # the reference's answer positions (row_logits)
                if row < len(ref.rows) and x.shape == ref.logits[side][row][1:-1].shape:
                    e = (x - ref.log_probs(side, row, t)).abs().amax(-1)
                    count[t] += int((e <= TOL_LOGPROB).sum())
    return count[T] >= count[1.0] and count[T] > 0, True


def joined(dump, rows, name):
    """The tensors `name` of `rows`, in float64, concatenated; None where a row lacks it."""
    if not rows or not all(name in dump.rows.get(r, {}) for r in rows):
        return None
    return torch.cat([dump.rows[r][name].double() for r in rows])


def own_numbers(dump, rows, divided, sides=SIDES, ratio=None):
    """{side: Numbers} of the dump's own numbers over `rows`, concatenated (raw logits keep their
    temperature a parameter; log-probs at the teacher's top K ids keep the sampled token's too), or
    None if one of `sides` has none; ratio: the student's log importance ratio
    (importance_ratio)."""
    out = {}
    for side in sides:
        key, numbers = side_numbers(dump, side)
        if key is None or not all(r in numbers for r in rows):
            return None
        x = torch.cat([numbers[r] for r in rows])
        if key.endswith("_token_logprobs"):
            out[side] = Numbers(token=x)
        elif key.endswith("_topk_logprobs"):
            ids, token = joined(dump, rows, "teacher_topk_ids"), f"{side}_token_logprobs"
            out[side] = Numbers(logprobs=x, ids=ids.long(), token=joined(dump, rows, token))
        elif key.endswith("_logits") and not divided:
            out[side] = Numbers(logits=x)
        elif key.endswith("_logits"):
            out[side] = Numbers(logprobs=torch.log_softmax(x, -1))
        else:
            out[side] = Numbers(logprobs=x)
    out["student"].ratio = ratio
    return out


def importance_ratio(dump, rows, y, temperature, divided):
    """(N,) the log of the importance ratio p_S(y) / p_sampler(y) over `rows`, from the dump's own
    numbers alone: the sampler's log-probs against the student's the dump holds, which are of the
    same prompt (the peer's), whatever the fixture's; None where the dump lacks either."""
    sampler = joined(dump, rows, "sampler_token_logprobs")
    if sampler is None:
        return None
    own = own_numbers(dump, rows, divided, ("student",))
    if own is None:
        return None
    a = own["student"].of_token(temperature, y)
    if a.isnan().any():
        return None
    return a - sampler


def reference_numbers(ref, rows, ratio=None, offset=0, padded=(), size=None):
    """{side: Numbers} of the reference's raw logits over `rows`, concatenated (positions shifted by
    `offset`; `padded`: the sides whose answers sit at position ids counted over the pads of
    micro-batches of `size`), the student's with the log importance ratio `ratio`."""
    out = {side: Numbers(logits=ref.joined(rows, side, offset, size if side in padded else None))
           for side in SIDES}
    out["student"].ratio = ratio
    return out


STRUCTURE = "support by k tail raw form weights clamp"
REVERTS = {  # a cause's kind: the Config fields that undoing it puts back to the declared ones
    "temperature": "student_t teacher_t", "beta": "beta", "tau": "tau", "clip": "clip tau",
    "clamp": "clamp", "form": "weights beta", "top-k": "support by k tail raw clamp",
    "support": STRUCTURE, "sampled-token": STRUCTURE, "scale": "scale", "term": "scale nll"}


def undone(c, cause, declared):
    """c with the departure `cause` alone put back to the declared configuration."""
    fields = REVERTS[cause.split(":")[0]]
    if cause in ("temperature:student", "temperature:teacher"):
        fields = f"{cause.split(':')[1]}_t"
    if cause.startswith("top-k") and declared.support == "sampled-token":
        fields = STRUCTURE
    return c._replace(**{name: getattr(declared, name) for name in fields.split()})


def zero_note(peer, values, kept):
    """A note of how many of the kept positions match only because both values lie within the
    absolute tolerance of zero (they say nothing of the form); "" where none do."""
    both = (peer.abs() <= TOL_DIVERGENCE[0]) & (values.abs() <= TOL_DIVERGENCE[0])
    zeros = int((both & close(peer, values) & kept).sum())
    if not zeros:
        return ""
    return f" ({zeros} of them only because both values lie within {TOL_DIVERGENCE[0]:g} of zero)"


def allowance(own):
    """[a sentence on what a dump of the teacher's top K ids alone allows and cannot show], or []
    for other numbers."""
    if not own["teacher"].sparse:
        return []
    K = own["teacher"].ids.shape[-1]
    if own["student"].sparse:
        return [f"from the teacher's top {K} and the student's log-probs at those ids, the kit "
                f"fits the forms over a top k of the teacher (k up to {K}) and the sampled token "
                "where it is among them; these numbers cannot show a value over the whole "
                f"vocabulary, the mass outside the {K} entries, nor a top k of the student"]
    return [f"from the teacher's top {K} and the student's sampled-token log-probs, the kit fits "
            "the sampled token's forms where it is among them; these numbers cannot show any "
            "value over several entries (dump the student's log-probs at the teacher's ids)"]


def equal_sides(own, declared, y):
    """Whether both sides' own numbers are equal within the log-probs' tolerance (at the sampled
    token where that is all a side holds)."""
    if own["student"].full and own["teacher"].full:
        pair = [own[side].log_probs(getattr(declared, f"{side}_t")) for side in SIDES]
    else:
        pair = [own[side].of_token(getattr(declared, f"{side}_t"), y) for side in SIDES]
    return bool(((pair[0] - pair[1]).abs() <= TOL_LOGPROB).all())


def compare_divergence(ref, dump, declared, skip, size, divided, own_prompts, ratio):
    """(Check, the peer's per-position values {row: (L,)} or None): the per-position values, against
    the reference's under the declared configuration; what configuration explains them, fitted to
    the peer's own log-probs when it dumped them, else to the reference's (with the positions
    shifted or counted over pads, or the teacher given the student's prompt). Each cause's size:
    the step's token mean of the values as found, against the same with that departure alone
    undone; a value nothing explains is a cause too (`value:unexplained`), its size that of the
    positions it holds. ratio: the log importance ratio (importance_ratio). Values that carry no
    information (all within the tolerance of 0, or from two equal sides) are fitted to nothing."""
    name = "divergence"
    if not dump.rows or not all("divergence" in t for t in dump.rows.values()):
        return Check(name, "not checked", ["the dump holds no divergence for every row"]), None
    peer = {r: t["divergence"].double() for r, t in dump.rows.items()}
    fixture = dict(enumerate(ref.lengths))  # {row: its answer's positions}
    bad = [r for r in peer if peer[r].shape != (fixture.get(r),)]
    if bad:
        return Check(name, "differs", [f"row {r}: {tuple(peer[r].shape)} values, the fixture's "
                                       f"answer has {fixture.get(r, 'no such row')} positions"
                                       for r in bad[:5]]), None
    rows = sorted(peer)
    lengths = [ref.lengths[r] for r in rows]
    y, kept = ref.answers(rows, skip)
    P = torch.cat([peer[r] for r in rows])
    total = int(kept.sum())

    def per_row(values):  # {row: its values at the positions in the loss}, views of `values`
        return {r: v[skip:] for r, v in zip(rows, values.split(lengths))}

    def step(values):  # the step's token mean over the positions in the loss
        return float(values[kept].sum()) / max(total, 1)

    def fixture_values(c=declared, **kw):  # c's values from the reference's logits
        return config_values(c, reference_numbers(ref, rows, ratio, **kw), y, P, TOL_LOGPROB)

    asked = fixture_values()
    n = int((close(P, asked) & kept).sum())
    against = "the fixture's"
    if own_prompts:
        against = "the reference's (with your prompt ids)"
    head = f"{describe(declared)}: {n} of {total} positions within {TOL_DIVERGENCE[0]:g} + " \
           f"{TOL_DIVERGENCE[1]:g} x |value| of {against}"
    if n < total:
        head += zero_note(P, asked, kept)
    if skip:
        head += f" (positions {skip} on; the first {skip} are left out of the loss)"
    def largest(values):  # the largest difference from the peer's at the positions in the loss
        return float(((P - values).abs() * kept).max())

    if n == total:
        return Check(name, "matches", [head + f" (largest difference {largest(asked):.1e})"],
                     found=f"the value: {kind_of(declared)}, {describe(declared)} (as declared), "
                           f"all {total} positions within tolerance (largest difference "
                           f"{largest(asked):.1e})"), peer
    unexplained = (step(P), step(torch.where(close(P, asked), P, asked)))

    def unexplained_check(lines):  # no configuration tried explains the values: the rest sized
        return Check(name, "differs", lines, ["value:unexplained"], {},
                     "the value: no configuration tried explains it",
                     {"value:unexplained": unexplained}), peer

    def nearest(fit, count, c, said):  # a line on the nearest, where it is near enough to help
        values = fit.values(c)
        # values all near zero match whatever lies near zero (the peer's do not: `silent` below)
        if count < HINT_SHARE * total or (values[kept].abs() <= TOL_DIVERGENCE[0]).all():
            return []
        return [f"the nearest configuration tried, {said}, matches {count} of {total} positions "
                f"({count / total:.0%}){zero_note(P, values, kept)}"]

    own = own_numbers(dump, rows, divided, ratio=ratio)
    silent = bool((P[kept].abs() <= TOL_DIVERGENCE[0]).all())
    if silent or own is not None and equal_sides(own, declared, y):
        why, causes = "your two sides' log-probs are equal", []
        if silent:  # what a teacher given the student's prompt gives
            why = f"every value of yours lies within {TOL_DIVERGENCE[0]:g} of 0"
            causes = ["prompt:teacher=student"]
        return Check(name, "differs", [head, f"{why}: such values tell no form, beta, support, "
                                             "temperature or scale, and none is fitted"],
                     causes, {}, f"the value: nothing can be told ({why})",
                     {c: (step(P), step(asked)) for c in causes}), peer
    if own is not None:
        fit = Fit(own, y, P, kept, declared)
        count, c, note = fit.identify()
        full = own["student"].full and own["teacher"].full
        numbers = "sampled-token log-probs"
        if full:
            numbers = "log-probs"
        if own["teacher"].sparse:
            numbers = "top-K log-probs"
        if own["student"].free or own["teacher"].free:
            numbers = "logits"
        said = describe(c, numbers == "logits")
        allowed = allowance(own)
        if count == total:
            causes = differences(c, declared, note)
            values = fit.values(c)
            lines = [head, f"every position equals {said}, from your {numbers}", *allowed]
            if not causes:
                lines[1] = "every position is computed as asked from your log-probs, so the " \
                           "differences come from the log-probs (above)"
            sized = own
            if not full:
                sized = reference_numbers(ref, rows)

            def loss(config):  # the step's token mean of config's values
                return step(config_values(config, sized, y))

            sizes = {cause: (loss(c), loss(undone(c, cause, declared))) for cause in causes}
            found = f"the value: {kind_of(c)}, {said}, from your {numbers}: all {total} " \
                    f"positions within tolerance{zero_note(P, values, kept)} " \
                    f"(largest difference {largest(values):.1e})"
            return Check(name, "differs", lines, list(causes), causes,
                         found, sizes), peer
        return unexplained_check([head, "no configuration tried explains your values from your "
                                  f"own {numbers} within tolerance", *allowed,
                                  *nearest(fit, count, c, said)])
    # no numbers of its own: the reference's, under the declared configuration with the positions
    # shifted or counted over pads or the teacher given the student's prompt, then every
    # configuration fitted. {name: (values, {cause: the values with that cause alone undone})}
    hypotheses = {"the fixture": (asked, {})}
    for offset in (1, -1):
        hypotheses[f"positions shifted by {offset:+d}"] = (fixture_values(offset=offset),
                                                           {f"shift:{offset:+d}": asked})
    for sides in (("student",), ("teacher",), SIDES):
        hypotheses[f"position ids counted over the pads ({' and '.join(sides)})"] = (
            fixture_values(padded=sides, size=size),
            dict.fromkeys([f"position-ids:{s}" for s in sides], asked))
    student = reference_numbers(ref, rows)["student"]  # the declared temperatures are one T
    as_student = config_values(declared, dict.fromkeys(SIDES, student), y)
    if close(P, as_student)[kept].all():  # what a teacher shown the student's prompt gives
        hypotheses["the teacher given the student's prompt"] = (
            as_student, {"prompt:teacher=student": asked})
    shorter = {side: ref.shorter(side, size) for side in SIDES}

    def read(hypotheses):  # diagnose's reading, over the positions in the loss
        errors, matched = {}, {}
        for h, (v, _) in hypotheses.items():
            errors[h], matched[h] = per_row((P - v).abs()), per_row(close(P, v))
        return diagnose({h: list(u) for h, (_, u) in hypotheses.items()}, errors, matched, shorter)

    reading = read(hypotheses)
    notes, identified = {}, None
    if not reading.explained:
        found = []  # fitted where a shift puts the positions too; the most positions matched
        for offset in (0, 1, -1):
            numbers = reference_numbers(ref, rows, ratio, offset)
            if offset:  # shifted, at the declared temperatures (not fitted there)
                numbers = {side: Numbers(logprobs=x.log_probs(getattr(declared, f"{side}_t")),
                                         ratio=x.ratio) for side, x in numbers.items()}
            fit = Fit(numbers, y, P, kept, declared, TOL_LOGPROB, bool(offset))
            found.append((*fit.identify(), offset, fit))
            if found[-1][0] == total:
                break
        count, c, note, offset, fit = max(found, key=lambda f: f[0])
        if count > total // 2:  # a majority: the positions it leaves are read by their pattern
            changes = differences(c, declared, note)
            undoing = {cause: fit.values(undone(c, cause, declared)) for cause in changes}
            label = describe(c)
            if offset:
                undoing[f"shift:{offset:+d}"] = fixture_values(c)  # c at the unshifted positions
                changes[f"shift:{offset:+d}"] = None
                label += f", positions shifted by {offset:+d}"
            trial = {**hypotheses, label: (fit.values(c), undoing)}
            second = read(trial)
            if second.explained:
                reading, hypotheses, notes = second, trial, changes
                identified = f"the value: {kind_of(c)}, {label}"
                if count == total:
                    identified += f": all {total} positions within tolerance"
        if not reading.explained:
            reading.lines.extend(nearest(fit, count, c, describe(c)))
    if not reading.explained:  # what explains some positions only is no verified cause
        return unexplained_check([head, *reading.lines[1:], "no configuration tried explains your "
                                  "values within tolerance"])
    (best, undoing), causes, sizes = hypotheses[reading.best], reading.causes, {}
    for cause in causes:
        instead = undoing.get(cause, best)  # what the positions it explains would be without it
        mask = torch.zeros_like(kept)
        for r, m in reading.positions[cause].items():
            per_row(mask)[r][:] = m  # per_row's pieces are views of the mask
        sizes[cause] = (step(P), step(torch.where(mask, instead, P)))
    return Check(name, "differs", [head, *reading.lines[1:]], causes, notes, identified,
                 sizes), peer


def setting_figures(ref, setting):
    """{clip: [(L,) per row]} of a setting, from the reference."""
    return {c: ref.divergences(beta=setting["beta"], temperature=setting["temperature"], clip=c,
                               tau=setting["tau"]) for c in CLIPS}


def compare_loss(dump, size, skip, peer_values, source, expected, counts, scored_beyond):
    """Check: the loss, against the expected one; its normalisation (micro-batches of `size` rows)
    from per-position values `peer_values` ({row: (L,)} of every row, from `source`), with the
    values the dump holds beyond the answers (beyond_divergence) where it holds them; a divisor
    named only where it is one of `counts` ({what: number}, the counts the dump shows);
    scored_beyond: the batch check found outputs the loss scores beyond the answers."""
    name = "loss"
    if dump.loss is None:
        return Check(name, "not checked", ["the dump states no loss"])
    values = [peer_values[r] for r in range(len(peer_values))]
    kinds = {"step": "the step's token mean",
             "micro-batch": f"the mean of micro-batches' token means ({size} rows each)",
             "answer": "the mean of answers' token means", "row": "the mean of answers' sums",
             "sum": "the step's sum"}
    sets = [("", values, [])]
    if all("beyond_divergence" in dump.rows.get(r, {}) for r in peer_values):
        with_beyond = [torch.cat([v, dump.rows[r]["beyond_divergence"].double()])
                       for r, v in enumerate(values)]
        sets.append((", with the positions beyond the answers", with_beyond,
                     ["scored:beyond-answer"]))
    candidates = {}  # {label: (causes, value)}
    for suffix, v, extra in sets:
        for how, label in kinds.items():
            causes = extra + [f"normalisation:{how}"]
            if how == "step":  # opsd's
                causes = extra
            candidates[label + suffix] = (causes, normalised(v, how, size, skip))
        if skip:
            candidates["the step's token mean over every position" + suffix] = (
                extra + ["skip:ignored"], normalised(v, "step", size, 0))
            candidates[f"the sum over positions {skip} on / every position's number" + suffix] = (
                extra + ["skip:counted"], normalised(v, "step", size, skip, count_skipped=True))
    rel = lambda a, b: (a - b) / max(abs(b), 1e-30)  # noqa: E731
    hits = [h for h, (_, v) in candidates.items() if abs(rel(dump.loss, v)) <= TOL_LOSS]
    named = ""
    if dump.normalisation:
        named = f" ({dump.normalisation})"
    lines = [f"your loss {dump.loss:.9g}{named}; the expected {expected:.9g} "
             f"({rel(dump.loss, expected):+.2e} relative)",
             f"from {source}: " + "; ".join(f"{h} {v:.9g}" for h, (_, v) in candidates.items())]
    causes, notes, sizes = [], {}, {}
    step = candidates["the step's token mean"][1]
    total = candidates["the step's sum"][1]
    identified = None
    mine = source.startswith("your")
    if all((v[skip:].abs() <= TOL_DIVERGENCE[0]).all() for v in values):
        lines.append(f"every value lies within {TOL_DIVERGENCE[0]:g} of 0: no normalisation or "
                     "divisor can be told from them")
    elif len(hits) == 1:
        causes, value = candidates[hits[0]]
        line = f"your loss is {hits[0]}"
        if causes:
            line += f" ({rel(dump.loss, step):+.2%} against the step's token mean)"
        lines.append(line)
        identified = f"the loss: {hits[0]}, {abs(rel(dump.loss, value)):.1e} relative from it"
        by_causes = {tuple(c): v for c, v in candidates.values()}
        for cause in causes:  # undone alone: the candidate with the other causes
            sizes[cause] = (dump.loss, by_causes[tuple(c for c in causes if c != cause)])
    elif hits:
        lines.append("your loss equals several of these (they coincide at this setting): "
                     + ", ".join(hits))
    elif dump.loss != 0 and total != 0:
        divisor = total / dump.loss
        count = next((what for what, n in counts.items() if same(divisor, n, TOL_LOSS)), None)
        if count and mine:
            n = counts[count]
            lines.append(f"your loss is the step's sum divided by {n} ({count})")
            causes = ["normalisation:divisor"]
            notes = {"normalisation:divisor": f"divided by {n}: {count}"}
            if scored_beyond and "scored" in count:  # those beyond the answers add 0 to the sum
                causes = ["scored:beyond-answer"]
                notes = {causes[0]: f"{n} positions in the loss, those beyond the answers each 0"}
            identified = f"the loss: the step's sum / {n} ({count})"
        else:
            lines.append("your loss is not reproduced from your rows: it is none of these "
                         f"normalisations, and the step's sum over it, {divisor:.6g}, is none of "
                         "the counts the dump shows ("
                         + ", ".join(f"{what} {n}" for what, n in counts.items()) + ")")
            reason = "positions your loss scores that the rows do not hold (dump the batches' " \
                     "scored_mask, and the values there as row{i}.beyond_divergence)"
            if scored_beyond:
                reason = "the positions the batch check finds your loss scores beyond the " \
                         "answers, whose values the dump does not hold (row{i}.beyond_divergence)"
            lines.append(f"what the rows cannot show: {reason}, or values other than the "
                         "dumped ones")
            if mine:
                causes = ["loss:unexplained"]
        sizes = {cause: (dump.loss, step) for cause in causes}  # undone: the step's token mean
    else:
        lines.append("your loss is none of these normalisations of those values")
    ok = abs(rel(dump.loss, expected)) <= TOL_LOSS
    return Check(name, "matches" if ok else "differs", lines, causes, notes, identified, sizes)


def compare_prompts(ref, prompts):
    """Check: the prompt ids the peer dumped ({side: {row: ids}}), token for token; a teacher's ids
    equal to the student's (the student's dumped, or else the fixture's) are said as such. Where
    both sides differ, the first rows of each are listed."""
    lines, causes = {side: [] for side in SIDES}, []
    for side in SIDES:
        for row, theirs in prompts[side].items():
            ours = ref.rows[row][f"{side}_prompt_ids"]
            student = prompts["student"].get(row, ref.rows[row]["student_prompt_ids"])
            if side == "teacher" and theirs == student:
                lines[side].append(f"row {row}, teacher: the student's own {len(theirs)} ids "
                                   f"(the fixture's teacher has {len(ours)}, with the reference)")
                causes.append("prompt:teacher=student")
            elif ours != theirs:
                at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b),
                          min(len(ours), len(theirs)))
                lines[side].append(f"row {row}, {side}: {len(theirs)} ids, the fixture's "
                                   f"{len(ours)}; the first difference at token {at} (the "
                                   f"fixture's ids {ours[max(0, at - 2):at + 3]}, yours "
                                   f"{theirs[max(0, at - 2):at + 3]})")
                causes.append(f"prompt:{side}")
    dumped = sum(map(len, prompts.values()))
    if not dumped:
        return Check("prompts", "not checked", ["the dump holds no prompt ids"])
    count = sum(len(x) for x in lines.values())
    if not count:
        return Check("prompts", "matches",
                     [f"all {dumped} dumped prompts are the fixture's, token for token"])
    shown = 6
    if all(lines.values()):
        shown = 3  # of each side
    listed = [line for side in SIDES for line in lines[side][:shown]]
    return Check("prompts", "differs", [f"{count} of {dumped} dumped prompts differ", *listed],
                 list(dict.fromkeys(causes)))


def dumped_problems(t):
    """batch_problems of one dumped micro-batch's tensors {name: tensor}."""
    return batch_problems(*[t[n] for n in BATCH_TENSORS[:4]], t.get("scored_mask"))


def compare_batches(dump):
    """Check 2: the invariants of every micro-batch the peer dumped (check_batch)."""
    if not dump.batches:
        return Check("batch", "not checked", ["the dump holds no batch tensors"])
    lines, causes = [], []
    for (k, side), t in sorted(dump.batches.items()):
        missing = [n for n in BATCH_TENSORS[:4] if n not in t]
        if missing:
            lines.append(f"micro-batch {k}, {side}: no {', '.join(missing)}")
            continue
        for cause, sentence in dumped_problems(t):
            lines.append(f"micro-batch {k}, {side}, {sentence}")
            if cause in ("pad-first", "position-ids"):
                cause = f"{cause}:{side}"
            if cause:
                causes.append(cause)
    if not lines:
        return Check("batch", "matches",
                     [f"all {len(dump.batches)} micro-batch inputs (both sides) keep each row's "
                      "tokens contiguous, answer token 0 after the prompt's last"])
    shown = lines[:8] + ([f"... and {len(lines) - 8} more"] if len(lines) > 8 else [])
    return Check("batch", "differs", [f"{len(lines)} broken invariants", *shown],
                 list(dict.fromkeys(causes)))


def declared_config(dump, fixture):
    """(Config, skip_first_tokens, whether it is a stored setting as stored): the fixture's setting
    the dump names, with what its metadata declares besides (DECLARABLE)."""
    settings = fixture["settings"]
    if dump.setting is not None and dump.setting not in settings:
        raise SystemExit(f"verify.py: setting {dump.setting!r} is not one of the fixture's: "
                         f"{', '.join(settings)} (or declare your own: temperature, beta, tau, "
                         "skip_first_tokens, support, form).")
    if dump.clip not in CLIPS:
        raise SystemExit(f"verify.py: clip {dump.clip!r} is not one of {', '.join(CLIPS)} (a peer "
                         "without a clip compares with 'none').")
    setting = {"skip_first_tokens": 0, "support": "full", "beta": 0.0, "form": "term", "scale": "1",
               "nll": 0.0}
    setting.update(settings.get(dump.setting, {}))
    stored = not dump.declared
    setting.update(dump.declared)
    if "tau" not in setting and dump.clip != "none":
        raise SystemExit("verify.py: the dump's clip acts at a tau its metadata does not give: "
                         "declare 'tau'.")
    rules = (("temperature", lambda v: v > 0, "above 0"), ("beta", lambda v: 0 <= v <= 1,
             "from 0 to 1"), ("tau", lambda v: v > 0, "above 0"),
             ("skip_first_tokens", lambda v: v >= 0, "0 or more"), ("nll", lambda v: v >= 0,
                                                                     "0 or more"))
    for key, ok, rule in rules:
        if key in setting and not ok(setting[key]):
            raise SystemExit(f"verify.py: the dump's {key} is {setting[key]}; it must be {rule}.")
    support = parse_support(setting["support"])
    if "form" in dump.declared and support["support"] == "sampled-token":
        raise SystemExit("verify.py: the dump declares a form and a sampled-token support: the "
                         "sampled token's form is the support's (sampled-token:FORM); leave 'form' "
                         "out.")
    T, scale = setting["temperature"], setting["scale"]
    if scale == "T^2":
        scale = T * T
    try:
        scale = float(scale)
    except ValueError:
        raise SystemExit(f"verify.py: the dump's scale is {scale!r}; say a number or 'T^2'.")
    c = Config(T, T, setting["beta"], dump.clip, setting.get("tau", 0.05), **support, scale=scale,
               nll=setting["nll"])
    return c._replace(**parse_form(setting["form"])), setting["skip_first_tokens"], stored


def computable(c, numbers):
    """Whether configuration c's values can be computed from these {side: Numbers}."""
    if numbers["student"].full and numbers["teacher"].full or c.support == "sampled-token":
        return True
    sparse = numbers["student"].sparse and numbers["teacher"].sparse
    return sparse and c.support == "top-k" and c.by == "teacher" \
        and c.k <= numbers["teacher"].ids.shape[-1]


def verify(dump, ref):
    """[Check] of a Dump against a Reference, in the order they are best read; each cause's size
    given with the expected loss: {cause: (with it, undone, expected)}."""
    declared, skip, stored = declared_config(dump, ref.fixture)
    size = dump.micro_batch_size or ref.micro_batch_size
    rows = list(range(len(ref.rows)))
    y = ref.answers(rows)[0]
    lengths = ref.lengths

    def step_loss(reference):  # the declared loss from a reference's numbers
        asked = config_values(declared, reference_numbers(reference, rows, ratio), y)
        return normalised(asked.split(lengths), "step", size, skip)

    dumped = {side: {r: t[f"{side}_prompt_ids"].tolist() for r, t in sorted(dump.rows.items())
                     if f"{side}_prompt_ids" in t} for side in SIDES}  # the prompt ids it holds
    prompts = compare_prompts(ref, dumped)
    checks = [compare_batches(dump), prompts]
    theirs = {side: {r: ids for r, ids in dumped[side].items()
                     if r < len(ref.rows) and ids != ref.rows[r][f"{side}_prompt_ids"]}
              for side in SIDES}
    peer_ref = ref.with_prompts(theirs)  # what else differs is read with the peer's own prompts
    divided, inferred = logits_form(peer_ref, dump, declared.student_t)
    # an importance ratio from the dump's own numbers of one prompt, never the fixture's against
    # the sampler's of the peer's own prompt
    ratio = importance_ratio(dump, rows, y, declared.student_t, divided)
    if stored:  # a setting of the fixture's (a dump without one declares what it runs at)
        expected = ref.fixture["expected"][dump.setting][dump.clip]["loss"]
    else:
        expected = step_loss(ref)
    if prompts.causes:
        with_it, sizes = step_loss(peer_ref), {}
        for cause in prompts.causes:  # undone: the fixture's prompts on the cause's side
            rest = {s: ids for s, ids in theirs.items() if not cause.startswith(f"prompt:{s}")}
            sizes[cause] = (with_it, step_loss(ref.with_prompts(rest)))
        checks[1] = prompts._replace(sizes=sizes)
    sides = [compare_side(peer_ref, dump, side, declared, size, divided, inferred,
                          bool(theirs[side]), skip) for side in SIDES]
    if all("logits:divided" in c.causes for c in sides):
        divided = True  # the dump says raw; both sides show them divided
    checks += sides
    divergence_check, values = compare_divergence(peer_ref, dump, declared, skip, size, divided,
                                                  any(theirs.values()), ratio)
    if ratio is None and any("sampler_token_logprobs" in t for t in dump.rows.values()):
        divergence_check = divergence_check._replace(lines=divergence_check.lines + [
            "your sampler's log-probs are not used: an importance ratio is taken only against the "
            "student's log-probs of the same prompt, which the dump does not hold for every row "
            "(student_token_logprobs); the ratio is taken as 1"])
    source = "your per-position divergences"
    if values is None or len(values) != len(ref.rows):
        own = None  # the dump's own numbers, where it holds every row's
        if len(dump.rows) == len(ref.rows):
            own = own_numbers(dump, rows, divided, ratio=ratio)
        source = "your log-probs' values"
        if own is None or not computable(declared, own):
            own = reference_numbers(peer_ref, rows, ratio)
            source = "the reference's per-position values"
        values = dict(enumerate(config_values(declared, own, y).split(lengths)))
    counts = {"answer positions": sum(lengths), "answers": len(rows),
              "micro-batches": -(-len(rows) // size)}
    if skip:
        counts["positions in the loss"] = sum(max(0, n - skip) for n in lengths)
    shown = (("real tokens", "attention_mask", torch.sum),  # (what, its tensor, its count)
             ("scored positions", "scored_mask", torch.sum),
             ("tokens with pads", "input_ids", torch.numel))
    for (k, side), t in sorted(dump.batches.items()):
        for what, name, count in shown:
            if name in t:
                key = f"the {side}'s {what}"
                counts[key] = counts.get(key, 0) + int(count(t[name]))
    beyond = "scored:beyond-answer" in checks[0].causes  # the batch check's
    checks += [divergence_check, compare_loss(dump, size, skip, values, source, expected, counts,
                                              beyond)]
    checks = [c._replace(sizes={cause: (*pair, expected) for cause, pair in c.sizes.items()})
              for c in checks]
    return rule_out(checks, ruled_out(dump, ref, size, dumped))


def ruled_out(dump, ref, size, prompts):
    """{cause: the check that rules it out}: a side's prompt, when every row's prompt ids on that
    side were dumped (prompts: {side: {row: ids}}) and are the fixture's; a side's pad-predicted
    first position and pad-counted position ids, when every micro-batch of that side was dumped and
    keeps the batch's invariants."""
    out = {}
    for side in SIDES:
        if all(prompts[side].get(r) == row[f"{side}_prompt_ids"]
               for r, row in enumerate(ref.rows)):
            out[f"prompt:{side}"] = "prompts"
        batches = [dump.batches.get((k, side)) for k in range(-(-len(ref.rows) // size))]
        if all(b is not None and all(n in b for n in BATCH_TENSORS[:4])
               and not dumped_problems(b) for b in batches):
            out.update({f"{kind}:{side}": "batch" for kind in ("pad-first", "position-ids")})
    if all(f"pad-first:{side}" in out for side in SIDES):
        out.update({"pad-first:either": "batch", "position-ids:either": "batch"})
    return out


def rule_out(checks, ruled):
    """The checks with every cause in `ruled` taken out of their causes, a line saying so in its
    place: no cause is named that a check which matched contradicts."""
    return [c._replace(causes=[cause for cause in c.causes if cause not in ruled],
                       lines=c.lines + [f"not named: {cause}, which the {ruled[cause]} check "
                                        "(matched) rules out"
                                        for cause in c.causes if cause in ruled])
            for c in checks]


def causes_of(checks):
    return list(dict.fromkeys(c for check in checks for c in check.causes))


def size_of(with_it, without, expected):
    """(the size causes are ordered by, its words): how far one departure moves the loss, against
    the expected loss."""
    scale = max(abs(expected), 1e-12)
    moved = (with_it - without) / scale
    change = f"by {moved:+.2%} of the expected"
    if with_it * without > 0 and with_it / without >= 1.5:
        change = f"x{with_it / without:.3g}"
    return abs(moved), f"it moves the loss {change}; undone alone, the loss would be " \
                       f"{without:.6g} ({(without - expected) / scale:+.2%} from the expected " \
                       f"{expected:.6g})"


def report(checks, dump, path):
    declared = ", ".join(f"{k} {v}" for k, v in dump.declared.items())
    head = f"verify.py: {path}: setting {dump.setting or 'your own'}"
    if declared:
        head += f" ({declared})"
    out = [head + f", clip {dump.clip}, {len(dump.rows)} rows"]
    for check in checks:
        out.append(f"[{check.status}] {check.name}: {check.lines[0]}")
        out += [f"    {line}" for line in check.lines[1:]]
    found = [c.found for c in checks if c.found]
    if found:
        out.append("What your numbers show:")
        out += [f"  - {line}" for line in found]
    causes = causes_of(checks)
    if causes:
        out.append("Likely causes (where you differ from the declared definition), the largest "
                   "effect on the loss first:")
        notes = {c: n for check in checks for c, n in check.notes.items() if n}
        # each cause's size from the first check that sizes it
        sizes = {cause: size_of(*size) for check in reversed(checks)
                 for cause, size in check.sizes.items()}
        unmeasured = (-1.0, "its size is not measured: the dump holds no numbers it acts on")
        causes.sort(key=lambda c: -sizes.get(c, unmeasured)[0])
        for c in causes:
            line = f"  - {c}: {CAUSES[c]}"
            if c in notes:
                line += f" ({notes[c]})"
            out += [line, f"      {sizes.get(c, unmeasured)[1]}"]
    elif any(c.status == "differs" for c in checks):
        out.append("No cause is identified by the numbers: see the differences above.")
    else:
        out.append("Every check that ran matches.")
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(prog="verify.py", description=__doc__.split("\n\n")[0])
    p.add_argument("dump", help="the peer's safetensors dump (tests/verify/README.md)")
    p.add_argument("--fixture", default=str(FIXTURE))
    args = p.parse_args(argv)
    dump = read_dump(args.dump)
    checks = verify(dump, Reference.from_fixture(args.fixture))
    print(report(checks, dump, args.dump))
    return 1 if any(c.status == "differs" for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
