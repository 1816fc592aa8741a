"""Check 4, the run: a training run recomputed in float64 from a dump any trainer can write.

    python tests/verify/run_check.py DUMP_DIR [--model MODEL_DIR] [--steps 1,3]

DUMP_DIR holds the run's settings (run.json), what each rank trained on at each step (prompt and answer token
ids, rank<r>.jsonl), the figures the trainer logged (figures.jsonl), and the student's LoRA before some steps, with
the teacher's, the LoRA after and the optimizer's moments where there are some (step-<s>/); README.md here,
"Check 4: the run", describes each file. For every step whose LoRA is dumped this script recomputes each row alone
through the merged weights in float64, the divergence written from its formulas, and compares: the loss (naming
another normalisation when it is that one's), the gradient's norm, the KL diagnostics and both entropies; the
adapter after the step (AdamW from the dumped moments and the clipped gradient); the EMA teacher's update; an
adapter written twice. It prints one line per check, `[matches]`, `[differs]` or `[not checked]`, and exits with 0
when every check that ran matches, 1 otherwise. Only torch, transformers and safetensors are needed, and no GPU.
"""

import argparse
import json
import math
import sys
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
from verify import divergence_terms  # noqa: E402  (check 3's divergence, written from its definition)

CLIPS = ("entry", "token", "none")
TEACHERS = ("base", "current", "ema")
NORMALISATIONS = ("step", "answer", "micro-batch")
# The figures a trainer may log per step, each the step's over every rank: loss and grad_norm (required), the
# others checked when present. MEANS and SHARES are over every answer position of the step (the skipped ones too),
# at the loss temperature, but kl_first_token, a mean over answers, and loss_frac_negative, a share of the positions
# in the loss; answer_tokens is the positions' number.
MEANS = ("kl_mean", "kl_first_token", "kl_clipped_teacher_mass", "entropy_student", "entropy_teacher")
SHARES = ("kl_frac_above_tau", "loss_frac_negative")
FIGURES = ("loss", "grad_norm", *MEANS, *SHARES, "answer_tokens")
REQUIRED_RUN = ("beta", "loss_temperature", "clip", "tau", "teacher")  # and lora, unless a full fine-tune

# Tolerances, for a trainer computing in float32 against this float64 recomputation (tests/test_run_oracle.py
# holds opsd.py's float32 run to them): the loss, the gradient's norm and the means within 2e-4 relative (or 1e-7);
# a share of positions past a threshold (tau, -1e-6) within one position, since a position within float32's
# rounding of the threshold may fall either side; each element of a step's change of the adapter within a
# thousandth of itself plus a thousandth of the learning rate, plus how far it moves when its gradient is off by
# GRAD_ERROR x the gradient's norm (what matters where a gradient element is near AdamW's eps); an adapter written
# twice, or the EMA's rule, within float32's rounding.
TOL_FIGURE = (2e-4, 1e-7)  # relative, absolute
SHARE_SLACK = 1  # positions
TOL_UPDATE = (1e-3, 1e-3)  # relative, absolute in units of the step's learning rate
TOL_ADAPTER = (1e-5, 1e-7)  # relative, absolute
# A float32 gradient element's error / the gradient's norm: float32's relative ~1e-6. Seen: 3e-9 on one CPU; on
# another, 1.2e-7 fell 2.1 times short for one element of a full fine-tune's 799,616 (a sum with cancellation).
GRAD_ERROR = 1e-6
NEGATIVE = -1e-6  # a loss term below this is negative (float32's rounding of 0 is not)
PREFIX = "base_model.model."


class Check(NamedTuple):
    name: str
    status: str  # "matches", "differs" or "not checked"
    lines: list


class Dump(NamedTuple):
    path: Path
    run: dict  # run.json
    rows: dict  # {step: [[row, ...] of each rank]}, a row {student_prompt_ids, teacher_prompt_ids, completion_ids}
    figures: dict  # {step: {name: value}}


# -----------------------------------------------------------------------------
# The dump: reading it, and writing its optimizer moments

def fail(path, text):
    raise SystemExit(f"run_check.py: {path}: {text} (tests/verify/README.md, \"Check 4: the run\").")


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_dump(path):
    """The Dump in directory `path`; a malformed one ends the program with a sentence saying what is wrong."""
    path = Path(path)
    if not (path / "run.json").is_file():
        fail(path, "no run.json")
    run = json.loads((path / "run.json").read_text())
    missing = [key for key in REQUIRED_RUN if key not in run]
    if missing:
        fail(path / "run.json", f"no {', '.join(missing)}")
    if run["clip"] not in CLIPS or run["teacher"] not in TEACHERS:
        fail(path / "run.json", f"clip must be one of {CLIPS} and teacher one of {TEACHERS}")
    if run.get("normalisation", "step") not in NORMALISATIONS:
        fail(path / "run.json", f"normalisation must be one of {NORMALISATIONS}")
    if run.get("normalisation") == "micro-batch" and not run.get("micro_batch_size"):
        fail(path / "run.json", "the micro-batch normalisation needs micro_batch_size")
    if run.get("lora") is None:
        run["lora"] = None  # a full fine-tune: the trained weights themselves are dumped (model.safetensors)
    elif not all(key in run["lora"] for key in ("r", "alpha")):
        fail(path / "run.json", "lora needs r and alpha (or, for a full fine-tune, no lora at all)")
    ranks = len(list(path.glob("rank*.jsonl")))
    if not ranks or any(not (path / f"rank{r}.jsonl").is_file() for r in range(ranks)):
        fail(path, "the rows must be in rank0.jsonl, rank1.jsonl, ... one file a rank")
    rows = {}
    for rank in range(ranks):
        for record in read_jsonl(path / f"rank{rank}.jsonl"):
            for row in record["rows"]:
                if not all(row.get(key) for key in ("student_prompt_ids", "teacher_prompt_ids", "completion_ids")):
                    fail(path / f"rank{rank}.jsonl", f"a row of step {record['step']} lacks student_prompt_ids, "
                         "teacher_prompt_ids or completion_ids (or one is empty)")
            rows.setdefault(record["step"], [None] * ranks)[rank] = record["rows"]
    if not rows:
        fail(path, "no rows in the rank files")
    for step, per_rank in rows.items():
        if None in per_rank:
            fail(path, f"step {step} has rows in some rank files only")
    if not (path / "figures.jsonl").is_file():
        fail(path, "no figures.jsonl")
    figures = {record["step"]: record for record in read_jsonl(path / "figures.jsonl")}
    for step, record in figures.items():
        if "loss" not in record or "grad_norm" not in record:
            fail(path / "figures.jsonl", f"step {step} has no loss or no grad_norm")
    return Dump(path, run, rows, figures)


def write_moments(path, moments, steps_before):
    """optimizer.safetensors: {PEFT key of a LoRA matrix: (exp_avg, exp_avg_sq)}, AdamW's moments before the
    step, and `steps_before`, the optimizer steps already taken (AdamW's step count, its bias corrections')."""
    tensors = {f"{key}.{name}": t.detach().cpu().contiguous() for key, pair in moments.items()
               for name, t in zip(("exp_avg", "exp_avg_sq"), pair)}
    save_file(tensors, str(path), metadata={"steps_before": str(int(steps_before))})


def read_adapter(directory):
    """{module name: (A, B)} in float64 from a PEFT-layout adapter directory, or None where there is none."""
    file = Path(directory) / "adapter_model.safetensors"
    if not file.is_file():
        return None
    pairs = {}
    for key, t in load_file(str(file)).items():
        if not key.startswith(PREFIX) or not key.endswith((".lora_A.weight", ".lora_B.weight")):
            fail(file, f"{key!r} is not a LoRA matrix named {PREFIX}<module>.lora_A.weight / lora_B.weight")
        module, ab = key[len(PREFIX):-len(".lora_A.weight")], key[-len("A.weight")]
        pairs.setdefault(module, {})[ab] = t.double()
    if any(len(pair) != 2 for pair in pairs.values()):
        fail(file, "a module has lora_A or lora_B only")
    return {n: (pair["A"], pair["B"]) for n, pair in pairs.items()}


def read_weights(directory):
    """{parameter name: (W,)} in float64 from a full fine-tune's model.safetensors (the trained parameters under
    the model's own names, e.g. model.layers.0.mlp.up_proj.weight), or None where there is none."""
    file = Path(directory) / "model.safetensors"
    if not file.is_file():
        return None
    return {name: (t.double(),) for name, t in load_file(str(file)).items()}


def read_state(directory, run):
    """What the student trains, in float64: a LoRA's {module: (A, B)}, or a full fine-tune's {parameter: (W,)};
    None where the directory holds none."""
    return read_adapter(directory) if run["lora"] else read_weights(directory)


def read_moments(path, full=False):
    """({module name: ((m_A, v_A), (m_B, v_B))} in float64 (full: {parameter name: ((m, v),)}), the optimizer
    steps taken before), or None."""
    if not Path(path).is_file():
        return None
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k).double() for k in f.keys()}
    if "steps_before" not in meta:
        fail(path, "no steps_before in its metadata")
    if full:
        names = [k[:-len(".exp_avg")] for k in tensors if k.endswith(".exp_avg")]
        if len(tensors) != 2 * len(names) or any(n + ".exp_avg_sq" not in tensors for n in names):
            fail(path, "every tensor must be <parameter name>.exp_avg with its .exp_avg_sq beside it")
        return {n: ((tensors[n + ".exp_avg"], tensors[n + ".exp_avg_sq"]),) for n in names}, int(meta["steps_before"])
    moments = {}
    for key in tensors:
        if not key.endswith(".exp_avg_sq"):
            if not key.startswith(PREFIX) or not key.endswith((".lora_A.weight.exp_avg", ".lora_B.weight.exp_avg")) \
                    or key + "_sq" not in tensors:
                fail(path, f"{key!r} is not <LoRA matrix's name>.exp_avg with its .exp_avg_sq beside it")
            module, ab = key[len(PREFIX):-len(".lora_A.weight.exp_avg")], key[-len("A.weight.exp_avg")]
            moments.setdefault(module, {})[ab] = (tensors[key], tensors[key + "_sq"])
    if any(len(pair) != 2 for pair in moments.values()):
        fail(path, "a module has the moments of lora_A or lora_B only")
    return {n: (m["A"], m["B"]) for n, m in moments.items()}, int(meta["steps_before"])


# -----------------------------------------------------------------------------
# The recomputation: each row alone, in float64, through W + (alpha / r) B A

def load_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()


def answer_logits(model, state, scale, prompt, completion):
    """(len(completion), V) float64 logits predicting each answer token: the output at the token before it, the
    row alone (position ids 0, 1, ...), each LoRA module's weight W + scale B A (scale None: a full fine-tune's
    weights in place of the model's; state None: the base model)."""
    if scale is None:
        weights = {n: w for n, (w,) in (state or {}).items()}
    else:
        weights = {f"{n}.weight": model.get_submodule(n).weight + scale * B @ A for n, (A, B) in (state or {}).items()}
    ids = torch.tensor([prompt + completion])
    out = torch.func.functional_call(model, weights, (ids,), {"use_cache": False}).logits[0]
    return out[len(prompt) - 1:len(prompt) - 1 + len(completion)]


def loss_terms(log_s, log_t, *, beta, clip, tau):
    """(L,) each position's loss term, and (L,) whether the clip cut it. The divergence's terms d_v are check 3's
    (verify.divergence_terms: beta 0 the forward KL, 1 the reverse, else the JSD). entry: the sum of min(d_v,
    tau), a clamped entry without gradient; token: the value min(k, tau) of the sum k, its gradient k's scaled by
    min(1, tau / k); none: k."""
    d = divergence_terms(log_s, log_t, beta)
    if clip == "entry":
        return d.clamp(max=tau).sum(-1), (d > tau).any(-1)
    k = d.sum(-1)
    if clip == "token":
        return k * (tau / k.clamp(min=tau)).detach(), k > tau
    return k, torch.zeros_like(k, dtype=torch.bool)


def row_weights(ranks, skip, micro_batch_size):
    """{normalisation: [[weight of each row's sum of kept loss terms] of each rank]}: the loss is the sum over rows
    of weight x sum. The kept terms are those of positions skip on.
      step:         1 / the kept positions' number over every rank (one big batch)
      answer:       each rank's mean of its answers' token means, the mean over ranks
      micro-batch:  each rank's mean of its micro-batches' token means (consecutive rows), the mean over ranks
    The last two are what data parallelism gives a per-rank mean; an answer with no kept position is left out."""
    kept = [[max(0, len(row["completion_ids"]) - skip) for row in rows] for rows in ranks]
    total, R = max(sum(map(sum, kept)), 1), len(ranks)
    out = {"step": [[1 / total for _ in counts] for counts in kept],
           "answer": [[1 / (R * sum(1 for c in counts if c) * n) if n else 0.0 for n in counts] for counts in kept]}
    if micro_batch_size:
        out["micro-batch"] = []
        for counts in kept:
            groups = [sum(counts[i:i + micro_batch_size]) for i in range(0, len(counts), micro_batch_size)]
            used = sum(1 for g in groups if g)
            out["micro-batch"].append([1 / (R * used * groups[i // micro_batch_size]) if n else 0.0
                                       for i, n in enumerate(counts)])
    return out


class StepResult(NamedTuple):
    figures: dict  # the recomputed figures, named as the dump's (under the run's normalisation)
    losses: dict  # {name: the loss}: each normalisation's, and with the skip ignored or counted
    grads: dict  # {normalisation: {module: (dA, dB)}}
    grad_norms: dict  # {normalisation: the gradient's norm}
    rows_kl: list  # per row, rank 0's first: (L,) KL(p_T || p_S) at each position
    clipped_share: float  # the share of the kept positions the clip cut
    negative_terms: int  # kept positions with a loss term below NEGATIVE
    kept_positions: int  # the positions in the loss


def recompute_step(model, run, ranks, student, teacher):
    """A step from its rows (ranks: [[row] of each rank]), the student's LoRA as it began ({module: (A, B)}) and
    the teacher's (None: the base model). The gradient is the loss's with respect to the student's A and B."""
    scale = run["lora"]["alpha"] / run["lora"]["r"] if run["lora"] else None
    T, tau, beta, clip = run["loss_temperature"], run["tau"], run["beta"], run["clip"]
    skip = run.get("skip_first_tokens", 0)
    leaves = {n: tuple(t.clone().requires_grad_() for t in group) for n, group in student.items()}
    params = [p for pair in leaves.values() for p in pair]
    weights = row_weights(ranks, skip, run.get("micro_batch_size"))
    flat = {name: [torch.zeros_like(p) for p in params] for name in weights}
    losses = dict.fromkeys(weights, 0.0)
    sums = dict.fromkeys(("kl", "above", "mass", "first", "h_s", "h_t", "kept", "kept_all", "cut", "negative"), 0.0)
    answers, positions, rows_kl = 0, 0, []
    for rank, rows in enumerate(ranks):
        for i, row in enumerate(rows):
            prompt_s, prompt_t, c = row["student_prompt_ids"], row["teacher_prompt_ids"], row["completion_ids"]
            with torch.no_grad():
                log_t = torch.log_softmax(answer_logits(model, teacher, scale, prompt_t, c) / T, -1)
            log_s = torch.log_softmax(answer_logits(model, leaves, scale, prompt_s, c) / T, -1)
            k, cut = loss_terms(log_s, log_t, beta=beta, clip=clip, tau=tau)
            with torch.no_grad():  # the diagnostics: the unclipped forward KL whatever beta, both entropies
                p_s, p_t = log_s.exp(), log_t.exp()
                entries = p_t * (log_t - log_s)
                kl = entries.sum(-1)
                rows_kl.append(kl)
                sums["kl"] += kl.sum().item()
                sums["above"] += (kl > tau).sum().item()
                sums["mass"] += (p_t * (entries > tau)).sum().item()
                sums["first"] += kl[0].item()
                sums["h_s"] += -(p_s * log_s).sum().item()
                sums["h_t"] += -(p_t * log_t).sum().item()
                sums["kept_all"] += k.sum().item()
                sums["cut"] += cut[skip:].sum().item()
                sums["negative"] += (k[skip:] < NEGATIVE).sum().item()
                answers, positions = answers + 1, positions + len(c)
            kept = k[skip:]
            if not len(kept):
                continue
            sums["kept"] += kept.sum().item()
            row_grads = torch.autograd.grad(kept.sum(), params)
            for name, w in weights.items():
                losses[name] += w[rank][i] * kept.sum().item()
                for acc, g in zip(flat[name], row_grads):
                    acc.add_(g, alpha=w[rank][i])
    n = max(positions, 1)
    kept_positions = sum(max(0, len(row["completion_ids"]) - skip) for rows in ranks for row in rows)
    if skip:  # two ways to get the skip wrong: keep the first positions, or count them in the denominator
        losses["skip ignored"] = sums["kept_all"] / n
        losses["skip counted"] = sums["kept"] / n
    starts = [0]
    for group in leaves.values():
        starts.append(starts[-1] + len(group))
    grads = {name: {m: tuple(g[starts[j]:starts[j + 1]]) for j, m in enumerate(leaves)} for name, g in flat.items()}
    norms = {name: math.sqrt(sum((g ** 2).sum().item() for g in gs)) for name, gs in flat.items()}
    norm = run.get("normalisation", "step")
    figures = {"loss": losses[norm], "grad_norm": norms[norm], "kl_mean": sums["kl"] / n,
               "kl_first_token": sums["first"] / max(answers, 1), "kl_clipped_teacher_mass": sums["mass"] / n,
               "entropy_student": sums["h_s"] / n, "entropy_teacher": sums["h_t"] / n,
               "kl_frac_above_tau": sums["above"] / n,
               "loss_frac_negative": sums["negative"] / max(kept_positions, 1),
               "answer_tokens": positions}
    return StepResult(figures, losses, grads, norms, rows_kl, sums["cut"] / max(kept_positions, 1),
                      int(sums["negative"]), kept_positions)


# -----------------------------------------------------------------------------
# The checks

LOSS_NAMES = {"step": "the step's token mean (the kept positions of every rank / their number)",
              "answer": "the mean of answers' token means (each rank's, then over ranks)",
              "micro-batch": "the mean of micro-batches' token means (each rank's, then over ranks)",
              "skip ignored": "the step's token mean with the skipped first positions kept",
              "skip counted": "the kept positions' sum / every position's number (the skipped ones counted)"}


def close(got, want, rel, absolute):
    return abs(got - want) <= max(rel * abs(want), absolute)


def relative(got, want):
    return (got - want) / max(abs(want), 1e-30)


def compare_figures(step, got, result, run):
    """[Check] of the step's logged figures against the recomputed ones; a loss or gradient norm that differs is
    compared with the other normalisations' too, and one it equals is named."""
    declared, want, checks = run.get("normalisation", "step"), result.figures, []
    tokens = max(want["answer_tokens"], 1)
    for name in FIGURES:
        if name not in got:
            continue
        value, ref = got[name], want[name]
        if name == "answer_tokens":
            ok, lines = value == ref, [f"{value}, recomputed {ref}"]
        elif name in SHARES:
            of = tokens  # the share's positions
            if name == "loss_frac_negative":
                of = max(result.kept_positions, 1)
            ok = abs(value - ref) <= SHARE_SLACK / of + 1e-12
            lines = [f"{value:.6g}, recomputed {ref:.6g} ({(value - ref) * of:+.2f} positions of {of}; "
                     f"tolerance {SHARE_SLACK})"]
        else:
            ok = close(value, ref, *TOL_FIGURE)
            lines = [f"{value:.9g}, recomputed {ref:.9g} ({relative(value, ref):+.2e} relative; tolerance "
                     f"{TOL_FIGURE[0]:g}, or {TOL_FIGURE[1]:g} absolute)"]
        if name == "loss":
            lines[0] += f" (normalisation {declared!r})"
        if not ok and name in ("loss", "grad_norm"):
            pool = result.losses if name == "loss" else result.grad_norms
            others = {h: v for h, v in pool.items() if h != declared}
            lines.append("recomputed under the others: " + "; ".join(f"{h} {v:.9g}" for h, v in others.items()))
            hits = [h for h, v in others.items() if close(value, v, *TOL_FIGURE)]
            lines.append(f"yours is {LOSS_NAMES[hits[0]]} ('{hits[0]}'), not the declared {declared!r}" if hits
                         else "yours is none of these")
        checks.append(Check(f"step {step} {name}", "matches" if ok else "differs", lines))
    unlogged = [name for name in FIGURES if name not in got]
    if unlogged:
        checks.append(Check(f"step {step} figures", "not checked", [f"not logged: {', '.join(unlogged)}"]))
    return checks


def adamw(before, grad, factor, lr, optimizer, moments):
    """{module: (A, B)} after one step of torch's AdamW from `before`, with the gradient times `factor` (the
    clip's), the moments (None: zero, the first step) and their step count; the weight decay is decoupled:
      p <- p (1 - lr wd);  m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2;  t <- t + 1
      p <- p - lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)"""
    (b1, b2), eps, wd = optimizer["betas"], optimizer["eps"], optimizer["weight_decay"]
    state, steps_before = moments or ({}, 0)
    t = steps_before + 1
    out = {}
    for name, pair in before.items():
        new = []
        for j, p in enumerate(pair):
            g = factor * grad[name][j]
            m0, v0 = state[name][j] if state else (torch.zeros_like(p), torch.zeros_like(p))
            m, v = b1 * m0 + (1 - b1) * g, b2 * v0 + (1 - b2) * g ** 2
            new.append(p * (1 - lr * wd) - lr * (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps))
        out[name] = tuple(new)
    return out


def change_misses(before, after, predicted, lr, slack):
    """(elements outside the tolerance, all elements, the largest difference in units of lr, the largest share of
    its tolerance) of the step's change after - before against predicted - before; slack: {module: (sA, sB)}
    added to each element's tolerance."""
    outside, total, largest, share = 0, 0, 0.0, 0.0
    for name, pair in before.items():
        for p, q, r, extra in zip(pair, after[name], predicted[name], slack[name]):
            diff = ((q - p) - (r - p)).abs()
            tolerance = TOL_UPDATE[0] * (r - p).abs() + TOL_UPDATE[1] * lr + extra
            outside += int((diff > tolerance).sum())
            total += diff.numel()
            largest, share = max(largest, float(diff.max()) / lr), max(share, float((diff / tolerance).max()))
    return outside, total, largest, share


def compare_update(step, before, after, moments, result, run, lr):
    """Check: the adapter after the step against AdamW's step with the clipped gradient; where it differs, the
    step with the unclipped gradient and with another normalisation's are tried."""
    name = f"step {step} update"
    if "optimizer" not in run:
        return Check(name, "not checked", ["run.json states no optimizer"])
    if lr is None:
        return Check(name, "not checked", ["figures.jsonl logs no lr for this step"])
    if moments is None and step != 1:
        return Check(name, "not checked", ["no optimizer.safetensors: only step 1 is checked without one "
                                           "(its moments are 0)"])
    if set(after) != set(before):
        return Check(name, "differs", ["the adapter after the step holds other modules than the one before"])
    if moments is not None and set(moments[0]) != set(before):
        return Check(name, "differs", ["optimizer.safetensors holds the moments of other modules than the adapter's"])
    norm, max_norm = run.get("normalisation", "step"), run.get("max_grad_norm")

    def predicted(normalisation, clipped=True, shift=0.0):
        """The adapter after AdamW's step, each gradient element moved by `shift` x the gradient's norm."""
        g = result.grad_norms[normalisation]
        factor = min(1.0, max_norm / (g + 1e-6)) if max_norm and clipped else 1.0  # torch's clip_grad_norm_
        grad = {n: tuple(x + shift * g for x in pair) for n, pair in result.grads[normalisation].items()}
        return adamw(before, grad, factor, lr, run["optimizer"], moments), factor

    def slack(normalisation, clipped=True):
        """Per element, how far the step moves when its gradient is off by GRAD_ERROR x the gradient's norm, as a
        float32 gradient's may be: where the gradient is near AdamW's eps (on the first step it takes
        lr g / (|g| + eps)), its rounding moves the step by more than a thousandth of lr. A full fine-tune's
        weights are dumped rounded to float32, which moves their change by up to 2^-24 x (|before| + |after|):
        far more than a thousandth of a small step where a weight is large."""
        centre = predicted(normalisation, clipped)[0]
        up, down = (predicted(normalisation, clipped, shift)[0] for shift in (GRAD_ERROR, -GRAD_ERROR))
        out = {n: tuple(torch.maximum((up[n][j] - c).abs(), (down[n][j] - c).abs()) for j, c in enumerate(pair))
               for n, pair in centre.items()}
        if run["lora"] is None:
            out = {n: tuple(e + 2.0 ** -24 * (p.abs() + q.abs()) for e, p, q in zip(group, before[n], after[n]))
                   for n, group in out.items()}
        return out

    want, factor = predicted(norm)
    outside, total, largest, share = change_misses(before, after, want, lr, slack(norm))
    head = (f"{total - outside} of {total} elements of the change within {TOL_UPDATE[0]:g} x itself + "
            f"{TOL_UPDATE[1]:g} x lr + a gradient error's effect (lr {lr:.4g}, the gradient x {factor:.4g} by the "
            f"clip, AdamW step {(moments[1] if moments else 0) + 1}); the largest difference {largest:.2e} x lr, "
            f"{share:.2f} of its tolerance")
    if not outside:
        return Check(name, "matches", [head])
    lines = [head]
    alternatives = {f"normalisation {n!r}": (n, True) for n in result.grads if n != norm}
    if max_norm:
        alternatives["the unclipped gradient"] = (norm, False)
    for label, (n, clipped) in alternatives.items():
        miss = change_misses(before, after, predicted(n, clipped)[0], lr, slack(n, clipped))[0]
        if not miss:
            lines.append(f"every element matches the step with {label}")
    return Check(name, "differs", lines)


def compare_adapters(name, got, want, what):
    """Check: two adapters alike to float32's rounding."""
    if set(got) != set(want):
        return Check(name, "differs", [f"{what}: other modules"])
    largest = max(float((g - w).abs().max()) for n in got for g, w in zip(got[n], want[n]))
    ok = all(torch.allclose(g, w, rtol=TOL_ADAPTER[0], atol=TOL_ADAPTER[1]) for n in got
             for g, w in zip(got[n], want[n]))
    return Check(name, "matches" if ok else "differs", [f"{what} (largest difference {largest:.1e})"])


def check_structure(dump, model, adapter):
    """[Check] of the dump's rows (no teacher prompt the student's) and of an adapter (or a full fine-tune's
    weights) against the model."""
    steps = sorted(dump.rows)
    counts = sorted({len(rows) for per_rank in dump.rows.values() for rows in per_rank})
    same = [(s, r, i) for s in steps for r, rows in enumerate(dump.rows[s]) for i, row in enumerate(rows)
            if row["teacher_prompt_ids"] == row["student_prompt_ids"]]
    total = sum(len(rows) for per_rank in dump.rows.values() for rows in per_rank)
    head = f"{len(steps)} steps, {len(dump.rows[steps[0]])} ranks, {'/'.join(map(str, counts))} rows a rank a step"
    if same:
        s, r, i = same[0]
        rows = Check("rows", "differs", [head, f"{len(same)} of {total} rows give the teacher the student's prompt "
                                         f"(the first: step {s}, rank {r}, row {i}): the teacher sees nothing "
                                         "the student does not"])
    else:
        rows = Check("rows", "matches", [head + "; every teacher prompt differs from its student's"])
    if adapter is None:
        return [rows]
    if dump.run["lora"] is None:
        params = dict(model.named_parameters())
        problems = [f"{n}: no parameter of the model" if n not in params else
                    f"{n}: {tuple(w.shape)}, the model's {tuple(params[n].shape)}" for n, (w,) in adapter.items()
                    if n not in params or w.shape != params[n].shape]
        size = sum(w.numel() for (w,) in adapter.values())
        head = f"a full fine-tune: {len(adapter)} of the model's {len(params)} parameters trained ({size:,} weights)"
        return [rows, Check("weights", "differs" if problems else "matches", [head, *problems[:6]])]
    r, problems = dump.run["lora"]["r"], []
    for name, (A, B) in adapter.items():
        try:
            weight = model.get_submodule(name).weight
        except AttributeError:
            problems.append(f"{name} is no module of the model")
            continue
        if A.shape != (r, weight.shape[1]) or B.shape != (weight.shape[0], r):
            problems.append(f"{name}: A {tuple(A.shape)}, B {tuple(B.shape)}; the layer is {tuple(weight.shape)} "
                            f"(out, in) at r {r}")
    targets = dump.run["lora"].get("target_modules")
    if targets:
        wanted = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
                  and n.rsplit(".", 1)[-1] in targets}
        if wanted != set(adapter):
            problems.append(f"the adapter holds {len(adapter)} modules, the model's {', '.join(targets)} are "
                            f"{len(wanted)}; e.g. {sorted(wanted ^ set(adapter))[:3]}")
    kinds = sorted({n.rsplit(".", 1)[-1] for n in adapter})
    head = f"{len(adapter)} modules ({', '.join(kinds)}), r {r}, scale alpha / r = " \
           f"{dump.run['lora']['alpha'] / r:g}"
    return [rows, Check("adapter", "differs" if problems else "matches", [head, *problems[:6]])]


def check(dump, model, steps=None):
    """([Check], {step: StepResult}) of a Dump, with the model in float64: every step with a LoRA before it (or
    those of `steps`) recomputed and compared."""
    run, path = dump.run, dump.path
    before = {s: read_state(path / f"step-{s}" / "before", run) for s in sorted(dump.rows)}
    done = [s for s in sorted(dump.rows) if before[s] is not None and (steps is None or s in steps)]
    checks = check_structure(dump, model, before[done[0]] if done else None)
    untouched = [s for s in sorted(dump.rows) if s not in done and (steps is None or s in steps)]
    if untouched:
        checks.append(Check("steps", "not checked", [f"steps {', '.join(map(str, untouched))}: no step-<s>/before "
                                                     "adapter (or weights), nothing to recompute them from"]))
    results, teachers = {}, {}
    for s in done:
        teachers[s] = read_state(path / f"step-{s}" / "teacher", run) if run["teacher"] == "ema" else None
        # the teacher: the base model, the student's LoRA, or the EMA's (the student's own before the EMA exists)
        teacher = {"base": None, "current": before[s],
                   "ema": before[s] if teachers[s] is None else teachers[s]}[run["teacher"]]
        results[s] = result = recompute_step(model, run, dump.rows[s], before[s], teacher)
        got = dump.figures.get(s)
        if got is None:
            checks.append(Check(f"step {s} figures", "not checked", ["figures.jsonl has no line for this step"]))
            got = {}
        else:
            checks += compare_figures(s, got, result, run)
        after = read_state(path / f"step-{s}" / "after", run)
        if after is not None:
            moments = read_moments(path / f"step-{s}" / "optimizer.safetensors", full=run["lora"] is None)
            checks.append(compare_update(s, before[s], after, moments, result, run, got.get("lr")))
            following = read_state(path / f"step-{s + 1}" / "before", run)
            if following is not None:
                checks.append(compare_adapters(f"step {s} after", following, after,
                                               f"the adapter after step {s} and the one before step {s + 1}"))
        if teachers[s] is not None and teachers.get(s - 1) is not None:
            name = f"step {s} teacher"
            if "ema_decay" not in run:
                checks.append(Check(name, "not checked", ["run.json states no ema_decay"]))
                continue
            d = run["ema_decay"]
            rule = {n: tuple(d * e + (1 - d) * p for e, p in zip(teachers[s - 1][n], before[s][n]))
                    for n in before[s]}
            checks.append(compare_adapters(name, teachers[s], rule, f"the EMA teacher = {d:g} x step {s - 1}'s + "
                                           f"{1 - d:g} x the student before step {s}"))
    return checks, results


def report(checks, dump):
    run = dump.run
    out = [f"run_check.py: {dump.path}: teacher {run['teacher']}, clip {run['clip']}, beta {run['beta']:g}, "
           f"loss temperature {run['loss_temperature']:g}, tau {run['tau']:g}, skip "
           f"{run.get('skip_first_tokens', 0)}, normalisation {run.get('normalisation', 'step')}"]
    for c in checks:
        out.append(f"[{c.status}] {c.name}: {c.lines[0]}")
        out += [f"    {line}" for line in c.lines[1:]]
    differs = [c.name for c in checks if c.status == "differs"]
    out.append(f"{len(differs)} of {sum(c.status != 'not checked' for c in checks)} checks differ: "
               f"{', '.join(differs)}" if differs else "Every check that ran matches.")
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(prog="run_check.py", description=__doc__.split("\n\n")[0])
    p.add_argument("dump", help="the dump's directory (tests/verify/README.md, \"Check 4: the run\")")
    p.add_argument("--model", help="the base model's directory (default: run.json's model)")
    p.add_argument("--steps", help="the steps to recompute, e.g. 1,3 (default: every step with a LoRA dumped)")
    args = p.parse_args(argv)
    dump = read_dump(args.dump)
    model_dir = args.model or dump.run.get("model")
    if not model_dir:
        fail(dump.path / "run.json", "no model: name it there or with --model")
    steps = {int(s) for s in args.steps.split(",")} if args.steps else None
    checks, _ = check(dump, load_model(model_dir), steps)
    print(report(checks, dump))
    return 1 if any(c.status == "differs" for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
