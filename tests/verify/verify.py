"""Verify another implementation of OPSD's loss against one optimizer step of the miniature model.

    python tests/verify/verify.py DUMP        # DUMP: the peer's numbers for fixture.json's rows (README.md here)

fixture.json holds 24 rollouts of tests/miniature/model, each with its prompts (as strings, as token ids, with
their chat-template flags) and, per answer position, the divergence at several settings. This script recomputes
every row's logits alone (no padding) in float64 from the model, compares the peer's numbers with them check by
check (its prompts and batches when dumped, each side's log-probs, the per-position divergence, the loss), and
names a likely cause where the numbers identify one. It prints the report; the exit status is 0 when every check
that ran matches, 1 otherwise. Only torch, transformers and safetensors are needed, and no GPU.
"""

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import NamedTuple

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
FIXTURE = HERE / "fixture.json"
SIDES = ("student", "teacher")
CLIPS = ("none", "entry", "token")

# Tolerances, for a peer computing in float32 (the model's dtype) against this float64 reference, from
# tolerances.py: a float32 peer with left padding and no position ids (its rows' position ids shifted by their pad
# counts, which moves rotary rounding), over every setting and clip of fixture.json, errs by up to 2.4e-4 in log p
# (any vocabulary entry), 5.7e-6 on a divergence below 0.1 and 6.8e-5 relative above, 7.0e-6 relative on the loss.
# The tolerances are 10, 10, 10 and 7 times those; the loss's normalisations differ by 14 times its tolerance or more.
TOL_LOGPROB = 2.5e-3  # the largest |delta log p| over the vocabulary at a position
TOL_DIVERGENCE = (6e-5, 7e-4)  # absolute, relative
TOL_LOSS = 5e-5  # relative
# A pad-predicted first position: its error is this many times the largest error at the row's other positions
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
    """(L + 2, V) raw logits of one row alone, prompt then answer, no padding: position ids 0, 1, ... (with
    `gap`, the answer's start `gap` later, as if counted over that many pads after the prompt). Index 1 + j
    is the output at the token before answer token j, the one that predicts it; index 0 and L + 1 are the
    outputs one position earlier than answer token 0's and one later than the last's, so that a peer
    shifted by one position either way can be recognised at every position."""
    P, L = len(prompt), len(completion)
    positions = torch.cat([torch.arange(P), torch.arange(P + gap, P + gap + L)])
    out = model(input_ids=torch.tensor([prompt + completion]), position_ids=positions[None]).logits[0]
    return out[P - 2:P + L]


def divergence_terms(log_s, log_t, beta):
    """(..., V) terms d_v whose sum over the vocabulary is the position's divergence, from both sides'
    log-probs at the loss temperature:
      beta 0:  p_T(v) (log p_T(v) - log p_S(v))                  forward KL(T || S)
      beta 1:  p_S(v) (log p_S(v) - log p_T(v))                  reverse KL(S || T)
      else:    beta KL_v(T || M) + (1 - beta) KL_v(S || M),      M = beta p_T + (1 - beta) p_S
    A zero probability contributes zero, whatever its log."""
    def term(log_p, log_q):  # p (log p - log q), 0 where p = 0
        p = log_p.exp()
        return torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p))

    if beta == 0.0:
        return term(log_t, log_s)
    if beta == 1.0:
        return term(log_s, log_t)
    log_m = torch.log(beta * log_t.exp() + (1.0 - beta) * log_s.exp())
    return beta * term(log_t, log_m) + (1.0 - beta) * term(log_s, log_m)


def divergence(log_s, log_t, *, beta, clip, tau):
    """(...,) each position's loss term: "entry" clips each d_v at tau before the sum, "token" clips the sum
    at tau, "none" leaves it."""
    d = divergence_terms(log_s, log_t, beta)
    if clip == "entry":
        return d.clamp(max=tau).sum(-1)
    k = d.sum(-1)
    return k.clamp(max=tau) if clip == "token" else k


# What the field also computes (recognised where a divergence differs): the divergence over one side's top k
# entries, renormalised over them or with one more entry for the rest of each side's mass; and a sampled-token
# estimate, one value from the answer token y alone.

def top_k_log_probs(log_s, log_t, k, tail, order):
    """Both sides' (..., k) log-probs on the top k entries of one side, renormalised over them (tail False) or
    (..., k + 1) with a last entry log(1 - their mass) holding the rest (tail True). order: (..., >= k) that
    side's entries, largest first (its argsort, descending)."""
    out = []
    for log_p in (log_s, log_t):
        top = log_p.gather(-1, order[..., :k])
        mass = torch.logsumexp(top, -1, keepdim=True)
        if tail:
            out.append(torch.cat([top, torch.log(-torch.expm1(mass.clamp(max=0.0)))], -1))
        else:
            out.append(top - mass)
    return out


def sampled_token(log_s, log_t, tokens, *, beta, clip, tau, form):
    """(L,) one value per position from the sampled token y = tokens alone: form "term", the divergence's own
    term d_y; "log-ratio", log p_S(y) - log p_T(y) (the one-sample estimate of the reverse KL). A clip (entry or
    token: one entry, so the same) bounds it at tau."""
    y = torch.as_tensor(tokens)[:, None]
    if form == "term":
        value = divergence_terms(log_s, log_t, beta).gather(-1, y)[:, 0]
    else:
        value = (log_s.gather(-1, y) - log_t.gather(-1, y))[:, 0]
    return value if clip == "none" else value.clamp(max=tau)


NORMALISATIONS = ("step", "micro-batch", "answer")


def normalised(values, how, micro_batch_size, skip=0, count_skipped=False):
    """The loss from per-position values (one (L,) tensor a row), over the positions j >= skip:
      step:         their sum over the whole step / their number (opsd's)
      micro-batch:  the mean over micro-batches (consecutive rows) of each one's sum / its number
      answer:       the mean over answers of each answer's sum / its number
    count_skipped: the step's sum over j >= skip divided by every position's number."""
    kept = [v[skip:] for v in values]
    if how == "step":
        count = sum(len(v) for v in (values if count_skipped else kept))
        return float(sum(v.sum() for v in kept) / max(count, 1))
    if how == "answer":
        means = [v.mean() for v in kept if len(v)]
        return float(sum(means) / len(means))
    groups = [kept[i:i + micro_batch_size] for i in range(0, len(kept), micro_batch_size)]
    means = [sum(v.sum() for v in g) / n for g in groups if (n := sum(len(v) for v in g))]
    return float(sum(means) / len(means))


def pads_after(prompt_lengths, micro_batch_size):
    """Per row, how much shorter its prompt is than the longest of its micro-batch (consecutive rows): the
    pads a batch that pads prompts on the right puts between its prompt and its answer."""
    gaps = []
    for first in range(0, len(prompt_lengths), micro_batch_size):
        group = prompt_lengths[first:first + micro_batch_size]
        gaps += [max(group) - n for n in group]
    return gaps


class Reference:
    """Rows (dicts with student_prompt_ids, teacher_prompt_ids, completion_ids) and, from the model in
    float64, each row's raw logits on both sides (row_logits)."""

    def __init__(self, rows, model_dir, micro_batch_size, fixture=None):
        self.model = load_model(model_dir)
        self.rows, self.fixture, self.micro_batch_size = rows, fixture, micro_batch_size
        self.lengths = [len(r["completion_ids"]) for r in rows]
        self.prompt_lengths = {side: [len(r[f"{side}_prompt_ids"]) for r in rows] for side in SIDES}
        self.logits = {side: [row_logits(self.model, r[f"{side}_prompt_ids"], r["completion_ids"]) for r in rows]
                       for side in SIDES}
        self.padded = {}  # {(side, micro-batch size): the logits with each answer's positions after the pads}

    @classmethod
    def from_fixture(cls, path=FIXTURE):
        fixture = json.loads(Path(path).read_text())
        model_dir = ROOT / fixture["model"]
        if sha16(model_dir / "model.safetensors") != fixture["model_sha256_16"]:
            raise SystemExit(f"verify.py: {fixture['model']} is not the model fixture.json was made from.")
        return cls(fixture["rows"], model_dir, fixture["micro_batch_size"], fixture)

    def shorter(self, side, size):
        """The rows whose prompt on `side` is shorter than their micro-batch's longest."""
        return {r for r, gap in enumerate(pads_after(self.prompt_lengths[side], size)) if gap}

    def padded_logits(self, side, size):
        """Each row's logits with its answer at position ids counted over the pads that padding its prompt
        to the micro-batch's longest puts before it (the rows with the longest prompt unchanged)."""
        if (side, size) not in self.padded:
            gaps = pads_after(self.prompt_lengths[side], size)
            self.padded[(side, size)] = [
                row_logits(self.model, r[f"{side}_prompt_ids"], r["completion_ids"], gap) if gap else x
                for r, x, gap in zip(self.rows, self.logits[side], gaps)]
        return self.padded[(side, size)]

    def log_probs(self, side, row, temperature, offset=0, padded=None):
        """(L, V) the side's log-probs at `temperature`, at the positions shifted by `offset`; padded: a
        micro-batch size, for the logits with the answer's position ids counted over the pads."""
        x = self.logits[side][row] if padded is None else self.padded_logits(side, padded)[row]
        L = self.lengths[row]
        return torch.log_softmax(x[1 + offset:1 + offset + L] / temperature, -1)

    def divergences(self, *, beta, temperature, clip, tau, student_t=None, teacher_t=None, offset=0,
                    swapped=False, padded=(), size=None):
        """[(L,)] per row: the divergence at `temperature` (or student_t / teacher_t on one side), both
        sides at positions shifted by `offset`; swapped: the student's and teacher's roles exchanged;
        padded: the sides whose answers sit at position ids counted over pads (micro-batches of `size`)."""
        out = []
        for row in range(len(self.rows)):
            log_s, log_t = (self.log_probs(side, row, t or temperature, offset,
                                           size if side in padded else None)
                            for side, t in (("student", student_t), ("teacher", teacher_t)))
            if swapped:
                log_s, log_t = log_t, log_s
            out.append(divergence(log_s, log_t, beta=beta, clip=clip, tau=tau))
        return out


# -----------------------------------------------------------------------------
# Check 2: the batch's invariants

def check_batch(input_ids, attention_mask, position_ids, answer_mask, scored_mask=None):
    """[one sentence per broken invariant] of a peer's micro-batch, (B, T) each: answer_mask marks the
    answer tokens; scored_mask (optional) the positions whose outputs the peer scores them with. Whatever
    the padding, each row's real tokens (attention mask 1) must have contiguous position ids, its answer
    tokens must be real and adjacent, answer token 0 must come right after a real prompt token (it is
    predicted from the prompt's last token), and the scored positions must be those just before the
    answer tokens. An empty list: the batch keeps every row's order."""
    return [sentence for _, sentence in batch_problems(input_ids, attention_mask, position_ids, answer_mask,
                                                       scored_mask)]


def batch_problems(input_ids, attention_mask, position_ids, answer_mask, scored_mask=None):
    """check_batch's sentences, each with the cause it points to ("position-ids", "pad-first", "shift:+1",
    "shift:-1" or None)."""
    problems = []
    for row in range(input_ids.shape[0]):
        real = attention_mask[row].bool()
        answer = answer_mask[row].bool().nonzero()[:, 0]
        positions = position_ids[row][real]
        gaps = (positions.diff() != 1).nonzero()[:, 0]
        if len(gaps):
            i = int(gaps[0])
            problems.append(("position-ids", f"row {row}: its real tokens' position ids jump from "
                             f"{int(positions[i])} to {int(positions[i + 1])}: they must count the real tokens "
                             "without a gap."))
        if not len(answer):
            problems.append((None, f"row {row}: no answer token is marked."))
            continue
        if not real[answer].all() or (answer.diff() != 1).any():
            problems.append((None, f"row {row}: its answer tokens are not one unmasked run of tokens."))
        first = int(answer[0])
        before = first - 1  # the real token before answer token 0
        while before >= 0 and not real[before]:
            before -= 1
        if before < 0:
            problems.append((None, f"row {row}: no real prompt token comes before answer token 0."))
        elif before != first - 1:
            problems.append(("pad-first", f"row {row}: {first - 1 - before} pad(s) lie between the prompt and "
                             "answer token 0, so the output at the position before it (a pad's) predicts it, "
                             "not the prompt's last token's."))
        if scored_mask is not None:
            scored = scored_mask[row].bool().nonzero()[:, 0]
            if scored.tolist() != (answer - 1).tolist():
                offset = next((k for k in (1, -1) if scored.tolist() == (answer - 1 + k).tolist()), None)
                at = scored.tolist()[:1]
                problems.append((offset and f"shift:{offset:+d}",
                                 f"row {row}: answer token 0 (index {first}) is scored with the output at index "
                                 f"{at[0] if at else None}, not at index {first - 1} (the token before it)."))
    return problems


# -----------------------------------------------------------------------------
# The peer's dump

class Dump(NamedTuple):
    setting: str
    clip: str
    loss: float | None
    normalisation: str | None
    micro_batch_size: int | None
    rows: dict  # {row: {name: tensor}}
    batches: dict  # {(micro-batch, side): {name: tensor}}
    logits: str | None = None  # "raw" (before the temperature) or "divided" (already divided by it); None: unsaid


ROW_TENSORS = ("student_logprobs", "teacher_logprobs", "student_logits", "teacher_logits", "divergence",
               "student_prompt_ids", "teacher_prompt_ids")
BATCH_TENSORS = ("input_ids", "attention_mask", "position_ids", "answer_mask", "scored_mask")


def write_dump(path, *, setting, clip, rows, loss=None, normalisation=None, micro_batch_size=None,
               batches=None, logits=None):
    """Write a dump: rows {fixture row: {name: tensor}} (names in ROW_TENSORS), batches {(k, side): {name:
    tensor}} (names in BATCH_TENSORS), the rest as text in the file's metadata."""
    from safetensors.torch import save_file

    tensors = {f"row{i}.{name}": t.contiguous() for i, named in rows.items() for name, t in named.items()}
    for (k, side), named in (batches or {}).items():
        tensors.update({f"batch{k}.{side}.{name}": t.contiguous() for name, t in named.items()})
    meta = {"setting": setting, "clip": clip}
    if loss is not None:
        meta["loss"] = repr(float(loss))
    if normalisation is not None:
        meta["normalisation"] = normalisation
    if micro_batch_size is not None:
        meta["micro_batch_size"] = str(micro_batch_size)
    if logits is not None:
        meta["logits"] = logits
    save_file(tensors, str(path), metadata=meta)


def read_dump(path):
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    for key in ("setting", "clip"):
        if key not in meta:
            raise SystemExit(f"verify.py: {path} has no '{key}' in its metadata (README.md: the dump).")
    rows, batches = {}, {}
    for name, t in tensors.items():
        head, _, field = name.partition(".")
        if head.startswith("row") and head[3:].isdigit() and field in ROW_TENSORS:
            rows.setdefault(int(head[3:]), {})[field] = t
        elif head.startswith("batch") and head[5:].isdigit() and field.split(".")[0] in SIDES \
                and field.split(".", 1)[-1] in BATCH_TENSORS:
            side, tensor = field.split(".", 1)
            batches.setdefault((int(head[5:]), side), {})[tensor] = t
        else:
            raise SystemExit(f"verify.py: {path} holds {name!r}, which is no tensor of a dump (README.md).")
    if meta.get("logits", "raw") not in ("raw", "divided"):
        raise SystemExit(f"verify.py: {path}: its metadata's logits is {meta['logits']!r}; say 'raw' (before the "
                         "temperature) or 'divided' (already divided by it).")
    size = meta.get("micro_batch_size")
    return Dump(meta["setting"], meta["clip"], float(meta["loss"]) if "loss" in meta else None,
                meta.get("normalisation"), int(size) if size else None, rows, batches, meta.get("logits"))


# -----------------------------------------------------------------------------
# The checks

CAUSES = {
    "temperature:student": "the loss temperature is not applied to the student's logits (its log-probs are "
                           "those at temperature 1)",
    "temperature:teacher": "the loss temperature is not applied to the teacher's logits (its log-probs are "
                           "those at temperature 1)",
    "temperature:both": "no loss temperature on either side",
    "clip:entry": "the clip bounds each vocabulary entry's term before the sum (the entry clip)",
    "clip:token": "the clip bounds the position's sum, after the sum (the token clip)",
    "clip:none": "no clip",
    "swapped": "the student's and the teacher's roles are exchanged in the divergence",
    "normalisation:micro-batch": "the loss is the mean over micro-batches of each micro-batch's token mean, "
                                 "not the step's sum over all its answer tokens / their number",
    "normalisation:answer": "the loss is the mean over answers of each answer's token mean, not the step's "
                            "sum over all its answer tokens / their number",
    "skip:ignored": "the first answer positions are not left out of the loss (--skip-first-tokens)",
    "skip:counted": "the left-out first positions still count in the loss's denominator",
    "pad-first:student": "the first answer position of each row whose student prompt is shorter than its "
                         "micro-batch's longest is predicted from a pad's hidden state (prompts padded on the "
                         "right, answers after the pads, logits taken from the micro-batch's prompt length)",
    "pad-first:teacher": "the first answer position of each row whose teacher prompt is shorter than its "
                         "micro-batch's longest is predicted from a pad's hidden state (prompts padded on the "
                         "right, answers after the pads, logits taken from the micro-batch's prompt length)",
    "pad-first:either": "the first answer position of rows whose prompts are shorter than their micro-batch's "
                        "longest on both sides is predicted from a pad's hidden state (the rows cannot tell "
                        "which side)",
    "position-ids:student": "the answer tokens of rows with a shorter student prompt sit at position ids "
                            "counted over the pads after the prompt, not over the real tokens",
    "position-ids:teacher": "the answer tokens of rows with a shorter teacher prompt sit at position ids "
                            "counted over the pads after the prompt, not over the real tokens",
    "position-ids:either": "the answer tokens of rows with shorter prompts sit at position ids counted over "
                           "the pads (the rows cannot tell which side)",
    "shift:+1": "every position is one too late: position j is the output at answer token j itself (which "
                "predicts token j + 1), not at the token before it",
    "shift:-1": "every position is one too early: position j is the output two tokens before answer token j",
    "prompt:student": "the student's prompt differs from the fixture's: every position of those rows differs "
                      "(compare your ids with each row's student_prompt_ids)",
    "prompt:teacher": "the teacher's prompt differs from the fixture's: every position of those rows differs "
                      "(compare your ids with each row's teacher_prompt_ids)",
    "logits:divided": "these logits are already divided by the temperature, though the dump's metadata (or the "
                      "other side) says raw: dump both sides alike and say which in the metadata's logits",
    "top-k:student:renormalised": "the divergence is taken over the student's top k entries only, both sides' "
                                  "probabilities renormalised over them",
    "top-k:student:tail": "the divergence is taken over the student's top k entries and one more entry holding "
                          "the rest of each side's mass",
    "top-k:teacher:renormalised": "the divergence is taken over the teacher's top k entries only, both sides' "
                                  "probabilities renormalised over them",
    "top-k:teacher:tail": "the divergence is taken over the teacher's top k entries and one more entry holding "
                          "the rest of each side's mass",
    "sampled-token:term": "each position's value is the divergence's term at the sampled answer token alone, "
                          "not the sum over the vocabulary",
    "sampled-token:log-ratio": "each position's value is log p_S(y) - log p_T(y) at the sampled answer token y "
                               "(a one-sample estimate of the reverse KL), not the divergence over the vocabulary",
}



class Check(NamedTuple):
    name: str
    status: str  # "matches", "differs" or "not checked"
    lines: list
    causes: list  # keys of CAUSES
    notes: dict = {}  # {cause: what the numbers say of it, e.g. the k of a top-k divergence}


def span(rows):
    """'rows 1, 2, 5' of a set of rows (at most 12 named)."""
    rows = sorted(rows)
    named = ", ".join(map(str, rows[:12])) + (f" and {len(rows) - 12} more" if len(rows) > 12 else "")
    return f"row{'s' if len(rows) > 1 else ''} {named}"


def side_of(rows, shorter):
    """Which side's shorter-prompt rows hold `rows` (shorter: {side: rows}, one side or both): that side,
    'either' (every such row is shorter on both sides), 'both' (some are shorter on one side only, some on
    the other only) or None."""
    on = [side for side in shorter if rows <= shorter[side]]
    if len(on) == 2:
        return "either"
    if on:
        return on[0]
    return "both" if len(shorter) == 2 and rows <= set().union(*shorter.values()) else None


def side_causes(kind, side):
    return [f"{kind}:{s}" for s in SIDES] if side == "both" else [f"{kind}:{side}"]


def diagnose(hypotheses, errors, matched, lengths, shorter):
    """(lines, causes) explaining a comparison. hypotheses: {name: [its causes]}, the first the fixture's
    (no cause); errors, matched: {name: {row: (L,)}}, each position's distance to the hypothesis and whether
    it lies within the tolerance; shorter: {side: rows shorter than their micro-batch's longest prompt}, of
    the side compared (or of both, for the divergence). The hypothesis matching most positions explains
    them; the positions it leaves are read by their pattern:
      - the first position of rows with a shorter prompt, off by far more than the row's other positions
        (PAD_FIRST_RATIO times): the first position predicted from a pad;
      - other positions, only in rows with a shorter prompt: position ids counted over pads;
      - every position of some rows, on one side: that side's prompt."""
    asked = next(iter(hypotheses))
    rows = sorted(errors[asked])
    total = sum(lengths[r] for r in rows)
    count = {h: sum(int(matched[h][r].sum()) for r in rows) for h in hypotheses}
    if count[asked] == total:
        return [f"all {total} positions match (largest difference {max_error(errors[asked]):.1e})"], []
    best = max(hypotheses, key=lambda h: (count[h], h == asked))
    lines, causes = [f"{count[asked]} of {total} positions match"], []
    if best != asked:
        lines.append(f"{count[best]} of {total} positions match {best}")
        causes += hypotheses[best]
    err = errors[best]
    left = {r: ~matched[best][r] for r in rows}  # what the best hypothesis leaves unexplained
    rest = lambda r: float(err[r][1:].max()) if lengths[r] > 1 else 0.0  # noqa: E731
    pad_first = {r for r in rows if left[r][0] and err[r][0] > PAD_FIRST_RATIO * rest(r)}
    where = side_of(pad_first, shorter) if pad_first else None
    if where:
        of = f" ({len(pad_first)} of the {len(shorter[where])} shorter rows)" if where in shorter else ""
        against = "the fixture's" if best == asked else f"those of {best}"
        lines.append(f"the first position of {span(pad_first)}{of} differs from {against} by up to "
                     f"{max(float(err[r][0]) for r in pad_first):.3g}, their other positions by at most "
                     f"{max(rest(r) for r in pad_first):.1e}")
        causes += side_causes("pad-first", where)
        for r in pad_first:
            left[r][0] = False
    drift = {r for r in rows if left[r].any()}
    if not drift:
        return lines, causes
    n = sum(int(left[r].sum()) for r in drift)
    largest = max(float(err[r][left[r]].max()) for r in drift)
    where = side_of(drift, shorter)
    if where:
        lines.append(f"{n} positions of {span(drift)}, every one a row with a shorter prompt than its "
                     f"micro-batch's longest, differ (by up to {largest:.1e})")
        causes += side_causes("position-ids", where)
    elif len(shorter) == 1 and all(left[r].all() for r in drift):
        lines.append(f"every position of {span(drift)} differs (by up to {largest:.3g})")
        causes.append(f"prompt:{next(iter(shorter))}")
    else:
        worst = max((float(err[r][j]), r, j) for r in drift for j in range(lengths[r]) if left[r][j])
        lines.append(f"{n} positions of {span(drift)} differ; the largest difference, {worst[0]:.3g}, at "
                     f"row {worst[1]} position {worst[2]}")
    return lines, causes


def max_error(per_row):
    return max((float(e.max()) for e in per_row.values() if len(e)), default=0.0)


def compare_side(ref, dump, side, setting, size, divided=False, inferred=False):
    """Check: the side's log-probs (or logits: raw, or already divided by the temperature when `divided`;
    `inferred`: the form read from the numbers, the dump not saying) at every answer position, against the
    reference's, and against what a temperature of 1, positions shifted by one, or position ids counted over
    the pads of micro-batches of `size` rows would give."""
    name = f"{side} log-probs"
    key = next((k for k in (f"{side}_logprobs", f"{side}_logits") if all(k in t for t in dump.rows.values())),
               None)
    if not dump.rows or key is None:
        return Check(name, "not checked", [f"the dump holds no {side}_logprobs (nor {side}_logits) for "
                                           "every row"], [])
    T = setting["temperature"]
    logits = key.endswith("logits")
    # [(the temperature its log-softmax is compared at, the cause when it is another's)], the asked one first.
    # Raw logits hide the temperature; logits already divided by it show it, as log-probs do.
    if logits and not divided:
        temps = [(1.0, None)] + ([(T, "logits:divided")] if T != 1.0 else [])
    else:
        temps = [(T, None)] + ([(1.0, f"temperature:{side}")] if T != 1.0 else [])
    hypotheses = {"the fixture": ({"temperature": temps[0][0]}, [])}  # name: (log_probs' arguments, causes)
    for t, cause in temps:
        for offset in (0, 1, -1):
            label = ", ".join(filter(None, [f"temperature {t:g}" if cause else "",
                                            f"positions shifted by {offset:+d}" if offset else ""]))
            if label:
                hypotheses[label] = ({"temperature": t, "offset": offset},
                                     ([cause] if cause else []) + ([f"shift:{offset:+d}"] if offset else []))
    hypotheses["position ids counted over the pads"] = ({"temperature": temps[0][0], "padded": size},
                                                        [f"position-ids:{side}"])
    errors, matched = {h: {} for h in hypotheses}, {h: {} for h in hypotheses}
    lines = []
    for row, tensors in sorted(dump.rows.items()):
        x = tensors[key].double()
        want = (ref.lengths[row], ref.logits[side][row].shape[-1]) if row < len(ref.rows) else None
        if tuple(x.shape) != want:
            lines.append(f"row {row}: shape {tuple(x.shape)}, the fixture's {want or 'has no such row'}")
            continue
        if logits:
            x = torch.log_softmax(x, -1)
        for h, (kw, _) in hypotheses.items():
            e = (x - ref.log_probs(side, row, **kw)).abs().amax(-1)
            errors[h][row], matched[h][row] = e, e <= TOL_LOGPROB
    if lines:
        return Check(name, "differs", lines, [])
    found, causes = diagnose({h: c for h, (_, c) in hypotheses.items()}, errors, matched, ref.lengths,
                             {side: ref.shorter(side, size)})
    if logits:
        unit = (f"logits already divided by T = {T:g}" if divided else
                "raw logits (before the temperature, which cannot be seen in them)") + \
            (" (read from the numbers: say which in the dump's metadata logits)" if inferred and T != 1.0 else "") + \
            ", log-softmaxed"
    else:
        unit = f"log-probs at temperature {T:g}"
    ok = not causes and found[0].startswith("all")
    head = f"{unit}, |delta log p| within {TOL_LOGPROB:g}: {found[0]}"
    return Check(name, "matches" if ok else "differs", [head, *found[1:]], causes)


def logits_form(ref, dump, setting):
    """(divided, inferred): whether the dumped logits are already divided by the temperature, and whether that
    was read from the numbers (the metadata not saying). Read from the numbers, both sides together: the form
    under which more of their positions match the reference (a tie, e.g. one side each, reads as divided: a
    peer that divides its logits by T and forgets one side)."""
    if dump.logits is not None:
        return dump.logits == "divided", False
    T = setting["temperature"]
    sides = [s for s in SIDES if dump.rows and all(f"{s}_logits" in t and f"{s}_logprobs" not in t
                                                    for t in dump.rows.values())]
    if T == 1.0 or not sides:
        return False, False
    count = {}
    for t in (1.0, T):
        count[t] = 0
        for side in sides:
            for row, tensors in dump.rows.items():
                x = tensors[f"{side}_logits"].double()
                if row < len(ref.rows) and tuple(x.shape) == (ref.lengths[row], ref.logits[side][row].shape[-1]):
                    e = (torch.log_softmax(x, -1) - ref.log_probs(side, row, t)).abs().amax(-1)
                    count[t] += int((e <= TOL_LOGPROB).sum())
    return count[T] >= count[1.0] and count[T] > 0, True


def close(a, b):
    return (a - b).abs() <= TOL_DIVERGENCE[0] + TOL_DIVERGENCE[1] * b.abs()


TOP_K_GRID = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 25, 32, 50, 64, 100, 128, 200, 256, 400)


def field_forms(log_s, log_t, rows, peer, count, *, beta, clip, tau, tie):
    """{label: (causes, {row: (L,)}, note)}: what the field computes besides the divergence over the whole
    vocabulary, from log_s, log_t: {row: (L, V)} at the loss temperature: the sampled-token estimates, and the
    top-k divergence that matches the peer's values `peer` ({row: (L,)}) at the most positions, over either
    side's top k, renormalised or with a tail entry (k searched over TOP_K_GRID for the best of the four, then
    the range of k that match as many positions, by bisection). Which entries make a top k is the peer's choice
    where that side's k-th and (k + 1)-th log-probs lie within `tie` of each other: there the candidate is the
    nearer to the peer's value of the two top k that hold one or the other. count({row: (L,)}): how many
    positions a candidate matches."""
    out = {}
    for form in ("term", "log-ratio"):
        for c in dict.fromkeys((clip, "none")):
            values = {r: sampled_token(log_s[r], log_t[r], rows[r]["completion_ids"], beta=beta, clip=c, tau=tau,
                                       form=form) for r in log_s}
            what = "the divergence's term" if form == "term" else "log p_S(y) - log p_T(y)"
            label = f"{what} at the sampled token y alone" + (", unclipped" if c != clip else "")
            out[label] = ([f"sampled-token:{form}"] + ([f"clip:{c}"] if c != clip else []), values, None)
    order = sorted(log_s)
    lengths = [len(log_s[r]) for r in order]
    S, T = torch.cat([log_s[r] for r in order]), torch.cat([log_t[r] for r in order])
    P = torch.cat([peer[r] for r in order])
    V = S.shape[-1]
    ranked = {by: x.sort(dim=-1, descending=True, stable=True) for by, x in (("student", S), ("teacher", T))}

    def at(by, tail, k):
        values, indices = ranked[by]
        d = divergence(*top_k_log_probs(S, T, k, tail, indices), beta=beta, clip=clip, tau=tau)
        tied = (values[:, k - 1] - values[:, k]).abs() <= tie
        if tied.any():  # the k-th and (k + 1)-th exchanged: the peer's top k may hold either
            swapped = indices[tied].clone()
            swapped[:, [k - 1, k]] = swapped[:, [k, k - 1]]
            other = divergence(*top_k_log_probs(S[tied], T[tied], k, tail, swapped), beta=beta, clip=clip, tau=tau)
            d[tied] = torch.where((P[tied] - other).abs() < (P[tied] - d[tied]).abs(), other, d[tied])
        return dict(zip(order, d.split(lengths)))

    grid = [k for k in TOP_K_GRID if k < V]
    counts = {(by, tail, k): count(at(by, tail, k)) for by in SIDES for tail in (False, True) for k in grid}
    by, tail, k = max(counts, key=counts.get)
    top = counts[(by, tail, k)]

    def edge(inside, outside):  # the last k from `inside` towards `outside` that matches `top` positions
        while abs(outside - inside) > 1:
            middle = (inside + outside) // 2
            inside, outside = (middle, outside) if count(at(by, tail, middle)) == top else (inside, middle)
        return inside

    low = edge(k, max([g for g in grid if g < k and counts[(by, tail, g)] < top], default=0))
    high = edge(k, min([g for g in grid if g > k and counts[(by, tail, g)] < top], default=V))
    note = f"k = {k}" if low == high else f"k from {low} to {high}: these rows tell them apart no further"
    label = f"the divergence over the {by}'s top k entries, " + \
        ("with a tail entry for the rest" if tail else "renormalised over them") + f" ({note})"
    out[label] = ([f"top-k:{by}:{'tail' if tail else 'renormalised'}"], at(by, tail, k), note)
    return out


def own_log_probs(dump, setting, divided=False):
    """{side: {row: (L, V)}} the log-probs the dump's own numbers give at the loss temperature (from logits
    already divided by it when `divided`), or None."""
    T = 1.0 if divided else setting["temperature"]
    out = {}
    for side in SIDES:
        if all(f"{side}_logprobs" in t for t in dump.rows.values()):
            out[side] = {r: t[f"{side}_logprobs"].double() for r, t in dump.rows.items()}
        elif all(f"{side}_logits" in t for t in dump.rows.values()):
            out[side] = {r: torch.log_softmax(t[f"{side}_logits"].double() / T, -1) for r, t in dump.rows.items()}
        else:
            return None
    return out


def compare_divergence(ref, dump, setting, clip, size, divided=False):
    """Check: the per-position divergence, against the fixture's; the cause from the peer's own log-probs
    when it dumped them, else from the reference's alternatives."""
    name = "divergence"
    if not dump.rows or not all("divergence" in t for t in dump.rows.values()):
        return Check(name, "not checked", ["the dump holds no divergence for every row"], []), None
    skip = setting["skip_first_tokens"]
    figures = setting_figures(ref, setting)
    peer = {r: t["divergence"].double() for r, t in dump.rows.items()}
    bad = [r for r in peer if peer[r].shape != (ref.lengths[r],)]
    if bad:
        return Check(name, "differs", [f"row {r}: {tuple(peer[r].shape)} values, the fixture's answer has "
                                       f"{ref.lengths[r]} positions" for r in bad[:5]], []), None
    kept = {r: slice(skip, None) for r in peer}  # the positions in the loss
    lengths = [max(0, n - skip) for n in ref.lengths]

    def compare(alternatives):
        errors = {h: {r: (peer[r] - v[r])[kept[r]].abs() for r in peer} for h, v in alternatives.items()}
        matched = {h: {r: close(peer[r], v[r])[kept[r]] for r in peer} for h, v in alternatives.items()}
        return errors, matched

    def matches(values):  # how many kept positions a candidate's values match
        return sum(int(close(peer[r], values[r])[kept[r]].sum()) for r in peer)

    beta, T, tau = setting["beta"], setting["temperature"], setting["tau"]
    asked = {r: figures[clip][r] for r in peer}
    errors, matched = compare({"the fixture": asked})
    total = sum(lengths[r] for r in peer)
    n = sum(int(m.sum()) for m in matched["the fixture"].values())
    head = f"clip {clip!r}, beta {beta:g}, temperature {T:g}, tau {tau:g}: {n} of {total} positions " \
           f"within {TOL_DIVERGENCE[0]:g} + {TOL_DIVERGENCE[1]:g} x |value| of the fixture's"
    if skip:
        head += f" (positions {skip} on; the first {skip} are left out of the loss)"
    if n == total:
        return Check(name, "matches", [head + f" (largest difference {max_error(errors['the fixture']):.1e})"],
                     []), peer
    own = own_log_probs(dump, setting, divided)
    if own is not None:
        # the peer's own log-probs, each clip, and the roles swapped: what did it compute from them?
        alternatives = {}
        for c in (clip, *[c for c in CLIPS if c != clip]):
            alternatives[f"the clip {c!r} of your log-probs"] = (
                {r: divergence(own["student"][r], own["teacher"][r], beta=beta, clip=c, tau=tau) for r in peer},
                [] if c == clip else [f"clip:{c}"])
        alternatives["the divergence of your log-probs with the roles swapped"] = (
            {r: divergence(own["teacher"][r], own["student"][r], beta=beta, clip=clip, tau=tau) for r in peer},
            ["swapped"])
        errors, matched = compare({h: v for h, (v, _) in alternatives.items()})
        count = {h: sum(int(m.sum()) for m in matched[h].values()) for h in alternatives}
        best = max(alternatives, key=lambda h: (count[h], h.startswith(f"the clip {clip!r}")))
        lines, notes = [head], {}
        if count[best] < total:  # what the field computes besides: a top-k divergence, a sampled-token estimate
            forms = field_forms(own["student"], own["teacher"], ref.rows, peer, matches, beta=beta, clip=clip,
                                tau=tau, tie=0.0)  # a tie in the peer's own numbers is exact
            for label, (causes, values, note) in forms.items():
                alternatives[f"{label}, from your log-probs"] = (values, causes)
                count[f"{label}, from your log-probs"] = matches(values)
                if note:
                    notes.update({c: note for c in causes})
            best = max(alternatives, key=lambda h: (count[h], h.startswith(f"the clip {clip!r}")))
        if count[best] == total:
            causes = alternatives[best][1]
            lines.append(f"every position equals {best}: " + (
                "computed as asked from your log-probs, so the differences come from the log-probs (above)"
                if not causes else CAUSES[causes[0]]))
            return Check(name, "differs", lines, causes, {c: n for c, n in notes.items() if c in causes}), peer
        lines.append(f"your divergence is none of the clips of your own log-probs, nor a top-k divergence or a "
                     f"sampled-token estimate of them ({count[best]} of {total} positions match {best})")
        return Check(name, "differs", lines, []), peer
    # no log-probs: the reference's alternatives
    hyps = {"the fixture": (asked, [])}
    for c in CLIPS:
        if c != clip:
            hyps[f"clip {c!r}"] = (figures[c], [f"clip:{c}"])
    if T != 1.0:
        for label, kw, cause in (("the student at temperature 1", {"student_t": 1.0}, "temperature:student"),
                                 ("the teacher at temperature 1", {"teacher_t": 1.0}, "temperature:teacher"),
                                 ("both at temperature 1", {"temperature": 1.0}, "temperature:both")):
            hyps[label] = (ref.divergences(**{"beta": beta, "temperature": T, "clip": clip, "tau": tau, **kw}),
                           [cause])
    if beta != 0.5:
        hyps["the roles swapped"] = (ref.divergences(beta=beta, temperature=T, clip=clip, tau=tau,
                                                     swapped=True), ["swapped"])
    for offset in (1, -1):
        hyps[f"positions shifted by {offset:+d}"] = (
            ref.divergences(beta=beta, temperature=T, clip=clip, tau=tau, offset=offset), [f"shift:{offset:+d}"])
    for sides in (("student",), ("teacher",), SIDES):
        hyps[f"position ids counted over the pads ({' and '.join(sides)})"] = (
            ref.divergences(beta=beta, temperature=T, clip=clip, tau=tau, padded=sides, size=size),
            [f"position-ids:{s}" for s in sides])
    reference = {side: {r: ref.log_probs(side, r, T) for r in peer} for side in SIDES}
    notes = {}
    for label, (causes, values, note) in field_forms(reference["student"], reference["teacher"], ref.rows, peer,
                                                     matches, beta=beta, clip=clip, tau=tau,
                                                     tie=TOL_LOGPROB).items():
        hyps[label] = (values, causes)
        if note:
            notes.update({c: note for c in causes})
    errors, matched = compare({h: {r: v[r] for r in peer} for h, (v, _) in hyps.items()})
    found, causes = diagnose({h: c for h, (_, c) in hyps.items()}, errors, matched, lengths,
                             {side: ref.shorter(side, size) for side in SIDES})
    return Check(name, "differs", [head, *found[1:]] if found else [head], causes,
                 {c: n for c, n in notes.items() if c in causes}), peer


def setting_figures(ref, setting):
    """{clip: [(L,) per row]} of a setting, from the reference."""
    return {c: ref.divergences(beta=setting["beta"], temperature=setting["temperature"], clip=c,
                               tau=setting["tau"]) for c in CLIPS}


def compare_loss(ref, dump, setting, clip, peer_values, divided=False):
    """Check: the loss, against the fixture's; the normalisation from the peer's own per-position values
    (or the fixture's when it dumped none)."""
    name = "loss"
    if dump.loss is None:
        return Check(name, "not checked", ["the dump states no loss"], [])
    expected = ref.fixture["expected"][dump.setting][clip]["loss"] if ref.fixture else None
    skip = setting["skip_first_tokens"]
    if peer_values is None or len(peer_values) != len(ref.rows):
        own = own_log_probs(dump, setting, divided) if len(dump.rows) == len(ref.rows) else None
        if own is not None:
            peer_values = {r: divergence(own["student"][r], own["teacher"][r], beta=setting["beta"], clip=clip,
                                         tau=setting["tau"]) for r in own["student"]}
            source = "your log-probs' divergence"
        else:
            figures = setting_figures(ref, setting)[clip]
            peer_values = dict(enumerate(figures))
            source = "the fixture's per-position figures"
    else:
        source = "your per-position divergences"
    values = [peer_values[r] for r in range(len(ref.rows))]
    size = dump.micro_batch_size or ref.micro_batch_size
    candidates = {"the step's token mean": ([], normalised(values, "step", size, skip))}
    candidates[f"the mean of micro-batches' token means ({size} rows each)"] = (
        ["normalisation:micro-batch"], normalised(values, "micro-batch", size, skip))
    candidates["the mean of answers' token means"] = (["normalisation:answer"],
                                                      normalised(values, "answer", size, skip))
    if skip:
        candidates["the step's token mean over every position"] = (["skip:ignored"],
                                                                   normalised(values, "step", size, 0))
        candidates[f"the sum over positions {skip} on / every position's number"] = (
            ["skip:counted"], normalised(values, "step", size, skip, count_skipped=True))
    rel = lambda a, b: (a - b) / max(abs(b), 1e-30)  # noqa: E731
    hits = [h for h, (_, v) in candidates.items() if abs(rel(dump.loss, v)) <= TOL_LOSS]
    lines = [f"your loss {dump.loss:.9g}" + (f" ({dump.normalisation})" if dump.normalisation else "")
             + (f"; the fixture's {expected:.9g} ({rel(dump.loss, expected):+.2e} relative)"
                if expected is not None else "")]
    lines.append(f"from {source}: " + "; ".join(f"{h} {v:.9g}" for h, (_, v) in candidates.items()))
    causes = []
    step = candidates["the step's token mean"][1]
    if len(hits) == 1:
        causes = candidates[hits[0]][0]
        lines.append(f"your loss is {hits[0]}" + (f" ({rel(dump.loss, step):+.2%} against the step's token mean)"
                                                  if causes else ""))
    elif hits:
        lines.append("your loss equals several of these (they coincide at this setting): " + ", ".join(hits))
    else:
        lines.append("your loss is none of these normalisations of those values")
    ok = expected is not None and abs(rel(dump.loss, expected)) <= TOL_LOSS
    return Check(name, "matches" if ok else "differs", lines, causes)


def compare_prompts(ref, dump):
    """Check: the prompt ids the peer dumped, token for token."""
    lines, causes, dumped = [], [], 0
    for side in SIDES:
        for row, tensors in sorted(dump.rows.items()):
            if f"{side}_prompt_ids" not in tensors:
                continue
            dumped += 1
            ours, theirs = ref.rows[row][f"{side}_prompt_ids"], tensors[f"{side}_prompt_ids"].tolist()
            if ours != theirs:
                at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
                lines.append(f"row {row}, {side}: {len(theirs)} ids, the fixture's {len(ours)}; the first "
                             f"difference at token {at} (the fixture's ids {ours[max(0, at - 2):at + 3]}, yours "
                             f"{theirs[max(0, at - 2):at + 3]})")
                causes.append(f"prompt:{side}")
    if not dumped:
        return Check("prompts", "not checked", ["the dump holds no prompt ids"], [])
    if not lines:
        return Check("prompts", "matches", [f"all {dumped} dumped prompts are the fixture's, token for token"], [])
    return Check("prompts", "differs", [f"{len(lines)} of {dumped} dumped prompts differ", *lines[:6]],
                 list(dict.fromkeys(causes)))


def compare_batches(dump):
    """Check 2: the invariants of every micro-batch the peer dumped (check_batch)."""
    if not dump.batches:
        return Check("batch", "not checked", ["the dump holds no batch tensors"], [])
    lines, causes = [], []
    for (k, side), t in sorted(dump.batches.items()):
        missing = [n for n in BATCH_TENSORS[:4] if n not in t]
        if missing:
            lines.append(f"micro-batch {k}, {side}: no {', '.join(missing)}")
            continue
        for cause, sentence in batch_problems(t["input_ids"], t["attention_mask"], t["position_ids"],
                                              t["answer_mask"], t.get("scored_mask")):
            lines.append(f"micro-batch {k}, {side}, {sentence}")
            if cause:
                causes.append(cause if cause.startswith("shift") else f"{cause}:{side}")
    if not lines:
        return Check("batch", "matches", [f"all {len(dump.batches)} micro-batch inputs (both sides) keep each "
                                          "row's tokens contiguous, answer token 0 after the prompt's last"], [])
    shown = lines[:8] + ([f"... and {len(lines) - 8} more"] if len(lines) > 8 else [])
    return Check("batch", "differs", [f"{len(lines)} broken invariants", *shown], list(dict.fromkeys(causes)))


def verify(dump, ref):
    """[Check] of a Dump against a Reference, in the order they are best read."""
    settings = ref.fixture["settings"]
    if dump.setting not in settings:
        raise SystemExit(f"verify.py: setting {dump.setting!r} is not one of the fixture's: "
                         f"{', '.join(settings)}.")
    if dump.clip not in CLIPS:
        raise SystemExit(f"verify.py: clip {dump.clip!r} is not one of {', '.join(CLIPS)} "
                         "(a peer without a clip compares with 'none').")
    setting = settings[dump.setting]
    size = dump.micro_batch_size or ref.micro_batch_size
    divided, inferred = logits_form(ref, dump, setting)
    checks = [compare_batches(dump), compare_prompts(ref, dump)]
    sides = [compare_side(ref, dump, side, setting, size, divided, inferred) for side in SIDES]
    if all("logits:divided" in c.causes for c in sides):  # the dump says raw; both sides show them divided
        divided = True
    checks += sides
    divergence_check, values = compare_divergence(ref, dump, setting, dump.clip, size, divided)
    checks += [divergence_check, compare_loss(ref, dump, setting, dump.clip, values, divided)]
    return rule_out(checks, ruled_out(checks, dump, ref, size))


def ruled_out(checks, dump, ref, size):
    """{cause: the check that rules it out}: a side's prompt, when the prompts check matched with every row's
    prompt on that side dumped; a side's pad-predicted first position and pad-counted position ids, when the
    batch check matched with every micro-batch of that side dumped."""
    status = {c.name: c.status for c in checks}
    out = {}
    for side in SIDES:
        if status["prompts"] == "matches" and all(f"{side}_prompt_ids" in dump.rows.get(r, {})
                                                  for r in range(len(ref.rows))):
            out[f"prompt:{side}"] = "prompts"
        if status["batch"] == "matches" and all((k, side) in dump.batches
                                                for k in range(-(-len(ref.rows) // size))):
            out.update({f"{kind}:{side}": "batch" for kind in ("pad-first", "position-ids")})
    if all(f"{kind}:{side}" in out for side in SIDES for kind in ("pad-first",)):
        out.update({"pad-first:either": "batch", "position-ids:either": "batch"})
    return out


def rule_out(checks, ruled):
    """The checks with every cause in `ruled` taken out of their causes, a line saying so in its place: no cause
    is named that a check which matched contradicts."""
    out = []
    for c in checks:
        gone = [cause for cause in c.causes if cause in ruled]
        if gone:
            c = c._replace(causes=[cause for cause in c.causes if cause not in ruled],
                           lines=c.lines + [f"not named: {cause}, which the {ruled[cause]} check (matched) rules "
                                            "out" for cause in gone])
        out.append(c)
    return out


def causes_of(checks):
    return list(dict.fromkeys(c for check in checks for c in check.causes))


def report(checks, dump, path):
    out = [f"verify.py: {path}: setting {dump.setting}, clip {dump.clip}, {len(dump.rows)} rows"]
    for check in checks:
        out.append(f"[{check.status}] {check.name}: {check.lines[0]}")
        out += [f"    {line}" for line in check.lines[1:]]
    causes = causes_of(checks)
    if causes:
        out.append("Likely causes:")
        notes = {c: n for check in checks for c, n in check.notes.items()}
        out += [f"  - {c}: {CAUSES[c]}" + (f" ({notes[c]})" if c in notes else "") for c in causes]
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
