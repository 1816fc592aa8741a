"""The clip ablation in a scale-matched miniature: --clip entry, token and none at tau 0.05, each with and without the
first answer position, in a regime whose step-1 KL profile matches Qwen3-1.7B's. tests/miniature/clip/README.md holds
the protocol (committed before any arm ran) and the results.

    python tests/miniature/clip/ablation.py --pretrain --output-dir tests/miniature/clip/model   # the starting model
    python tests/miniature/clip/ablation.py --profile                 # its step-1 rollouts and KL profile
    python tests/miniature/clip/ablation.py --select --output-dir runs/clip-select   # the lrs, on dev (+ --arms, --lrs)
    python tests/miniature/clip/ablation.py --output-dir runs/clip     # every arm and seed (resumable; --arms, --seeds)
    python tests/miniature/clip/ablation.py --output-dir runs/clip --record tests/miniature/clip/results   # commit it
    python tests/miniature/clip/ablation.py --drift --output-dir runs/clip-drift --arms ...   # Part 3, on model-drift/

The lever: every step of the scratchpad has two valid forms ("x+y" or "y+x" in a column, ", " or " " between columns,
"so" or nothing before the box). The error-prone writer (the student's pre-training data) takes either with
probability 1/2; the teacher shown the reference writes the first with probability PREFER_TEACHER. So besides the
carry positions (where the teacher, who knows the sum, is near-certain) about six positions per answer carry a
moderate, learnable disagreement, at which the teacher is uncertain: what a third of the positions look like at 1.7B.
"""

import argparse
import json
import random
import re
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent  # tests/miniature/clip: this script, its model and its records
sys.path[:0] = [str(HERE.parent), str(HERE.parent.parent.parent)]

import miniature  # noqa: E402  (the reasoning miniature: the task, its split, pre-training, prompts, scoring)
import opsd  # noqa: E402

MODEL = HERE / "model"
DRIFT_MODEL, JUMP = HERE / "model-drift", 0.15  # Part 3: the drift teacher abandons the scratchpad per column at JUMP
PREFER_WRITER, PREFER_TEACHER = 0.5, 0.75  # the probability of each step's first form
PRETRAIN_SEED = 1
REFERENCE = HERE / "reference_step.json"
# the released recipe at Qwen3-1.7B (the researcher's logs, loss temperature 1.1, tau 0.05) and the window the
# protocol asks the step-1 profile to fall in: within a factor of 1.5 of each
AT_SCALE = {"kl_mean": 0.10, "frac_above_tau": 0.35, "clipped_mass_above_tau": (0.50, 0.80)}
MATCH_FACTOR = 1.5


# -----------------------------------------------------------------------------
# The starting model: the reasoning miniature's pre-training with the two writers' forms


def writer_trace(a, b, rng):
    return miniature.write_trace(a, b, rng, miniature.CARRY_DROP, miniature.SLIP, prefer=PREFER_WRITER)


def teacher_trace(a, b, rng, prefer=None, jump=0.0):
    """The teacher's correct trace in its preferred forms. With `jump` (the drift teacher of Part 3) it abandons the
    scratchpad for the boxed answer, the reference's style, at the start of each column with that probability."""
    text = miniature.write_trace(a, b, rng, prefer=prefer or PREFER_TEACHER)
    if not jump:
        return text
    cuts = [rng.random() < jump for _ in range(3)]  # three draws always: the stream does not depend on the outcome
    if not any(cuts):
        return text
    ends = [m.end() for m in re.finditer(COLUMN, text)]
    k = cuts.index(True)
    return (text[:ends[k - 1]] + " " if k else "") + f"\\boxed{{{a + b}}}"


COLUMN = r"(?<![0-9+])[0-9]\+[0-9](\+1)?=[0-9]{1,2}(?![0-9])"  # one column's work, as answer_style reads it


def answer_shape(text):
    """How many columns an answer writes before its box (0-3)."""
    return len(re.findall(COLUMN, text.split("\\boxed")[0]))


def pretrain_example(tok, row, fmt, rng, prefer_teacher=None, jump=0.0):
    """(prompt ids, answer ids): the reasoning miniature's four formats, the teacher shown the reference writing
    correct traces in its preferred forms, the others the error-prone writer's traces with either form."""
    a, b = miniature.operands(row["problem"])
    if fmt == "teacher":
        return (miniature.teacher_prompt(tok, row["problem"], row.get("solution", f"{a}+{b}={a + b}")),
                miniature.answer_ids(tok, teacher_trace(a, b, rng, prefer_teacher, jump)))
    prompt = {"student": miniature.student_prompt, "transfer": miniature.transfer_prompt}.get(fmt)
    prompt = prompt(tok, row["problem"]) if prompt else miniature.teacher_prompt(tok, row["problem"], "")
    return prompt, miniature.answer_ids(tok, writer_trace(a, b, rng))


def pretrain(out, seed=PRETRAIN_SEED, prefer_teacher=PREFER_TEACHER, jump=0.0):
    train, dev, heldout = miniature.make_task()
    tokenizer_rng = random.Random(0)
    writer = {"carry_drop": miniature.CARRY_DROP, "slip": miniature.SLIP, "prefer_writer": PREFER_WRITER,
              "prefer_teacher": prefer_teacher, "jump": jump}
    example = lambda tok, row, fmt, rng: pretrain_example(tok, row, fmt, rng, prefer_teacher, jump)  # noqa: E731
    return miniature.pretrain(out, train, dev, heldout, seed=seed, example=example, writer=writer,
                              trace=lambda r: writer_trace(*miniature.operands(r["problem"]), tokenizer_rng))


# -----------------------------------------------------------------------------
# The step-1 profile


@torch.no_grad()
def position_figures(model_dir, rows, temperature, tau):
    """Per completion position of `rows`, from the unchanged model (student and teacher both the base model):
    KL(p_T || p_S), the teacher mass the entry clip clamps (entries with p_T(v) log(p_T(v) / p_S(v)) > tau), the
    teacher's top probability, all at the loss temperature, float64 from the float32 logits; (N,) each."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    kl, clipped, top = [], [], []
    for r in rows:
        n = len(r["completion_ids"])
        logits = {}
        for side in ("student", "teacher"):
            ids = torch.tensor([r[f"{side}_prompt_ids"] + r["completion_ids"]])
            logits[side] = model(input_ids=ids).logits[0, -n - 1:-1].double() / temperature  # (n, V)
        log_s, log_t = logits["student"].log_softmax(-1), logits["teacher"].log_softmax(-1)
        d = log_t.exp() * (log_t - log_s)
        kl.append(d.sum(-1))
        clipped.append((log_t.exp() * (d > tau)).sum(-1))
        top.append(log_t.exp().max(-1).values)
    return torch.cat(kl), torch.cat(clipped), torch.cat(top)


def step1_profile(reference=REFERENCE, model_dir=MODEL):
    """The step-1 figures the protocol matches against Qwen3-1.7B's, from the committed step-1 rollouts."""
    ref = json.loads(Path(reference).read_text())
    tau, temperature = ref["settings"]["tau"], ref["settings"]["temperature"]
    kl, clipped, top = position_figures(model_dir, ref["rows"], temperature, tau)
    above = kl > tau
    got = {"kl_mean": kl.mean().item(), "frac_above_tau": above.double().mean().item(),
           "clipped_mass_above_tau": clipped[above].mean().item()}
    low, high = AT_SCALE["clipped_mass_above_tau"]
    window = {"kl_mean": (AT_SCALE["kl_mean"] / MATCH_FACTOR, AT_SCALE["kl_mean"] * MATCH_FACTOR),
              "frac_above_tau": (AT_SCALE["frac_above_tau"] / MATCH_FACTOR, AT_SCALE["frac_above_tau"] * MATCH_FACTOR),
              "clipped_mass_above_tau": (low / MATCH_FACTOR, min(1.0, high * MATCH_FACTOR))}
    lengths = [len(r["completion_ids"]) for r in ref["rows"]]
    bins = {}  # the positions above tau by their KL: the forms' moderate disagreement, the carries' large one
    for low_kl, high_kl in ((tau, 0.1), (0.1, 0.5), (0.5, float("inf"))):
        m = (kl > low_kl) & (kl <= high_kl)
        bins[f"{low_kl:g}-{high_kl:g}"] = {"positions": int(m.sum()), "clipped_mass": clipped[m].mean().item(),
                                           "teacher_top_prob": top[m].mean().item()}
    return {"positions": len(kl), "tau": tau, "temperature": temperature, **got,
            "teacher_top_prob_above_tau": top[above].mean().item(),
            "clipped_mass_mean": clipped.mean().item(), "above_tau_by_kl": bins,
            "histogram": miniature.kl_profile(kl.float(), lengths, tau),
            "at_scale": AT_SCALE, "window": window,
            "matched": all(lo <= got[k] <= hi for k, (lo, hi) in window.items())}


def temperature_sweep(path=HERE / "reasoning_miniature_temperatures.json"):
    """Why a loss temperature cannot match the profile: the reasoning miniature's step-1 figures (its model and its
    committed step-1 rollouts) at loss temperatures 1.1 to 3.0."""
    ref = json.loads((miniature.DATA / "reference_step.json").read_text())
    sweep = []
    for temperature in (1.1, 1.5, 2.0, 3.0):
        kl, clipped, top = position_figures(miniature.SHIPPED_MODEL, ref["rows"], temperature, TAU)
        above = kl > TAU
        sweep.append({"temperature": temperature, "kl_mean": kl.mean().item(),
                      "frac_above_tau": above.double().mean().item(),
                      "clipped_mass_above_tau": clipped[above].mean().item(),
                      "teacher_top_prob_above_tau": top[above].mean().item()})
    Path(path).write_text(json.dumps(sweep, indent=1) + "\n")
    return sweep


def jump_positions(tok, completion_ids):
    """Answer positions where the drift teacher may leave the scratchpad for the box: the first, and the one right
    after each of the first two columns (there the teacher writes the separator, or the box)."""
    starts, text = [], ""
    for token in completion_ids:
        starts.append(len(text))
        text += tok.decode([token])
    ends = [m.end() for m in re.finditer(COLUMN, text.split("\\boxed")[0])][:2]
    return [0] + [starts.index(end) for end in ends if end in starts]


def jump_profile(reference, model_dir):
    """Mean KL at the positions where the drift teacher may jump, and at the others (the drift model's step 1)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    ref = json.loads(Path(reference).read_text())
    kl, _, _ = position_figures(model_dir, ref["rows"], ref["settings"]["temperature"], ref["settings"]["tau"])
    at = torch.zeros(len(kl), dtype=torch.bool)
    offset = 0
    for r in ref["rows"]:
        for i in jump_positions(tok, r["completion_ids"]):
            at[offset + i] = True
        offset += len(r["completion_ids"])
    return {"jump_positions": int(at.sum()), "kl_mean_at_jump_positions": kl[at].mean().item(),
            "kl_mean_elsewhere": kl[~at].mean().item(),
            "share_of_summed_kl_at_jump_positions": (kl[at].sum() / kl.sum()).item()}


def write_profile(model_dir=MODEL, reference=REFERENCE):
    """Sample the step-1 rollouts (opsd.py's first step, --seed 1) into reference_step.json, unless it holds this
    model's already, and write the profile."""
    reference = Path(reference)
    if not (reference.is_file() and json.loads(reference.read_text())["model_sha256_16"]
            == miniature.model_digest(model_dir)):
        miniature.write_reference_step(reference, model_dir)  # also writes the reasoning miniature's step1_kl.json
    profile = {**step1_profile(reference, model_dir), "at_jump_positions": jump_profile(reference, model_dir)}
    (Path(reference).parent / "step1_profile.json").write_text(json.dumps(profile, indent=1) + "\n")
    print(json.dumps({k: v for k, v in profile.items() if k != "histogram"}, indent=1))
    return profile


# -----------------------------------------------------------------------------
# The arms: opsd.py at tau 0.05 with each clip, with and without the first answer position; GRPO from the reasoning
# miniature's implementation at this budget. Names say clip and skip.

TAU, SECOND_TAU = 0.05, 0.2
STEPS, PROMPTS, EVERY, WARMUP = 100, 16, 10, 10  # the recipe's 100 steps, of 16 prompts; a checkpoint every 10
SEEDS, GRPO_SEEDS = (1, 2, 3, 4, 5), (1, 2, 3)
GRPO_GROUP = 8  # 2 prompts x 8 samples: the same 16 completions a step as the OPSD arms
CLIPS = ("entry", "token", "none")
ARMS = {f"{clip}{'-skip1' if skip else ''}": ("opsd", clip, TAU, skip) for clip in CLIPS for skip in (0, 1)}
ARMS["grpo"] = ("grpo", None, None, 0)
LR_GRID = miniature.LR_GRID  # 2e-3, 5e-3, 1.25e-2, extended by the rule (x2.5, at most twice beyond an edge)
# each family's lr chosen on dev by the rule (selection.json here); None until the selection has run
CHOSEN_LR = {"entry": 2e-3, "token": 2e-3, "none": 2e-3, "grpo": 8e-4}
# Part 5: each tau's lr for token-skip1, chosen on dev by the same rule (cross/selection/, 2026-12-04)
CROSS_LR = {"token-skip1": 2e-3, "token@0.2-skip1": 5e-3}
EVAL_N, EVAL_SEED = 2, 100  # held-out avg@2; a training seed s is scored with eval seed EVAL_SEED + s
DEV_SEED = 42  # the selection's dev scoring (eval.py's default seed)
FLAGS = ["--device", "cpu", "--dtype", "float32", "--lora-r", str(miniature.LORA_R), "--lora-alpha",
         str(miniature.LORA_ALPHA), "--prompts-per-step", str(PROMPTS), "--micro-batch-size", str(PROMPTS),
         "--max-new-tokens", str(miniature.MAX_NEW_TOKENS), "--max-prompt-length", "256", "--no-gradient-checkpointing",
         "--max-grad-norm", str(miniature.MAX_GRAD_NORM), "--log-rollouts-every", "50", "--kl-window", "1",
         "--warmup-steps", str(WARMUP), "--context-column", "solution", *miniature.STUDENT_FLAGS]


NUMBER = r"[0-9]*\.?[0-9]+(?:e-?[0-9]+)?"
ARM_NAME = re.compile(rf"(entry|token|none)(?:@({NUMBER}))?(?:-skip([0-9]+))?(?:-lr({NUMBER}))?")


def arm_settings(arm):
    """(kind, clip, tau, skip) of an arm's name: grpo, or CLIP[@TAU][-skipN][-lrLR] (tau 0.05, no skip and the
    clip's chosen lr unless named)."""
    if arm == "grpo":
        return ARMS[arm]
    m = ARM_NAME.fullmatch(arm)
    if not m:
        raise ValueError(f"{arm!r} names no arm")
    return "opsd", m[1], float(m[2]) if m[2] else TAU, int(m[3] or 0)


def named_lr(arm):
    """The lr an arm's name sets (-lrLR, Part 5's cross), or None."""
    m = ARM_NAME.fullmatch(arm)
    return float(m[4]) if m and m[4] else None


def family(arm):
    """The lr family: the arm's clip (skips and other taus train at their clip's lr), or grpo."""
    return arm_settings(arm)[1] or "grpo"


def opsd_command(model_dir, train_file, arm, seed, lr, out_dir):
    _, clip, tau, skip = arm_settings(arm)
    return [sys.executable, str(miniature.ROOT / "opsd.py"), "--model", str(model_dir), "--dataset", str(train_file),
            "--clip", clip, "--tau", str(tau), "--skip-first-tokens", str(skip), "--max-steps", str(STEPS),
            "--lr", str(lr), "--seed", str(seed), "--save-every", str(EVERY), "--output-dir", str(out_dir), *FLAGS]


def train(model_dir, train_file, arm, seed, lr, run):
    """Train one arm and seed into `run` (checkpoints every EVERY steps, final/); an interrupted opsd.py run resumes
    from its last checkpoint, an interrupted GRPO run starts over. Returns the seconds, None when kept."""
    if (run / "final").is_dir():
        return None
    if arm_settings(arm)[0] == "grpo":
        job = {"model_dir": str(model_dir), "train_file": str(train_file), "seed": seed, "lr": lr, "out_dir": str(run)}
        return miniature.run_logged([sys.executable, str(Path(__file__).resolve()), "--grpo-job", json.dumps(job)],
                                    miniature.log_path(run))
    resumable = opsd.latest_checkpoint(run) is not None
    return miniature.run_logged(opsd_command(model_dir, train_file, arm, seed, lr, run)
                                + ["--resume" if resumable else "--overwrite"],
                                miniature.log_path(run, "resumed" if resumable else ""))


def grpo_job(job):
    """One GRPO training at this budget, in its own process (its engine apart from the scorer's): the reasoning
    miniature's train_grpo with 16 completions a step, 2 prompts x GRPO_GROUP samples."""
    miniature.COMPLETIONS_PER_STEP, miniature.GRPO_PROMPTS = PROMPTS, PROMPTS // GRPO_GROUP
    miniature.OPSD_FLAGS = [*miniature.OPSD_FLAGS]
    miniature.OPSD_FLAGS[miniature.OPSD_FLAGS.index("--prompts-per-step") + 1] = str(PROMPTS)
    miniature.OPSD_FLAGS[miniature.OPSD_FLAGS.index("--micro-batch-size") + 1] = str(PROMPTS)
    miniature.train_grpo(Path(job["model_dir"]), Path(job["train_file"]), job["seed"], STEPS, job["lr"],
                         Path(job["out_dir"]), EVERY)


def score_curve(scorer, rows, run, base, seed, name):
    """[[step, sampled tokens so far, accuracy, correct samples, no-scratchpad share, mean answer tokens]] at step 0
    (the base model, `base`) and every checkpoint; each point eval.py's avg@EVAL_N sample for sample (seed, name)."""
    metrics = {r["step"]: r for r in miniature.read_metrics(run)}
    points, tokens = [[0, 0, *base]], 0
    for step in range(1, STEPS + 1):
        r = metrics[step]
        tokens += r.get("sampled_tokens", r.get("completion_len_mean", 0) * PROMPTS)
        if step % EVERY == 0:
            s = scorer.score(rows, run / ("final" if step == STEPS else f"checkpoint-{step}"), n=EVAL_N, seed=seed,
                             name=name)
            points.append([step, round(tokens), s["avg"], round(s["avg"] * len(rows) * EVAL_N), s["no_scratchpad"],
                           s["tokens_mean"]])
    return points


def base_point(scorer, rows, seed, name):
    s = scorer.score(rows, None, n=EVAL_N, seed=seed, name=name)
    return [s["avg"], round(s["avg"] * len(rows) * EVAL_N), s["no_scratchpad"], s["tokens_mean"]]


KL_FIELDS = ("kl_mean", "kl_frac_above_tau", "kl_clipped_teacher_mass", "kl_first_token", "loss",
             "completion_len_mean")


def kl_curve(run):
    """Per step, from metrics.jsonl: [step, kl_mean, share above tau, clipped teacher mass, first position KL, loss,
    answer length] (each step's own: --kl-window 1)."""
    return [[r["step"], *(r.get(k) for k in KL_FIELDS)] for r in miniature.read_metrics(run)]


def eval_final(model_dir, heldout_file, run, seed):
    """eval.py itself on the final adapter (its samples and summary kept beside the run), eval seed EVAL_SEED + seed."""
    out = run.parent / f"{run.name}-eval"
    finished = (out / "summary.json").is_file()
    cmd = [sys.executable, str(miniature.ROOT / "eval.py"), "--model", str(model_dir), "--data",
           f"heldout={heldout_file}", "--n", str(EVAL_N), "--max-new-tokens", str(miniature.MAX_NEW_TOKENS),
           "--dtype", "float32", "--enforce-eager", "--output-dir", str(out), "--no-thinking", "--seed",
           str(EVAL_SEED + seed), "--adapter", str(run / "final")]
    out.mkdir(parents=True, exist_ok=True)
    seconds = miniature.run_logged(cmd, miniature.log_path(out, "resumed" if finished else ""))
    return json.loads((out / "summary.json").read_text())["metrics"]["heldout"][f"avg@{EVAL_N}"], \
        None if finished else seconds


class Scorers:
    """One DevScorer (a vLLM engine serving each checkpoint as a LoRA adapter) for the whole run."""

    def __init__(self, model_dir):
        self.model_dir, self.scorer = model_dir, None

    def __call__(self):
        self.scorer = self.scorer or miniature.DevScorer(self.model_dir)
        return self.scorer


def run_dir(out, arm, seed, lr=None):
    return out / (arm.replace("@", "-tau") + (f"-lr{lr:g}" if lr is not None else "") + f"-s{seed}")


def select(out, arms, lrs, model_dir, files, dev):
    """Dev selection, seed 1: each family's arm (entry, token, none, grpo: no skip) at each lr, a dev curve each."""
    path = out / "selection.json"
    selection = json.loads(path.read_text()) if path.is_file() else {
        "model": miniature.repo_path(model_dir), "steps": STEPS, "every": EVERY, "runs": {}}
    scorer = Scorers(model_dir)
    if "base" not in selection:
        selection["base"] = base_point(scorer(), dev, DEV_SEED, "dev")
    for arm in arms:
        for lr in lrs:
            name = run_dir(out, arm, 1, lr).name
            if name in selection["runs"]:
                continue
            run = out / name
            seconds = train(model_dir, files["train"], arm, 1, lr, run)
            points = score_curve(scorer(), dev, run, selection["base"], DEV_SEED, "dev")
            # choose_lrs reads [step, tokens, seconds, accuracy]: the accuracy at index 3
            # each arm its own family: Part 2's arms are their clips' names; Part 5's (a skip, a tau) choose apart
            selection["runs"][name] = {"arm": arm, "family": arm, "lr": lr, "seed": 1, "seconds": seconds,
                                       "curve": [[p[0], p[1], None, p[2], *p[3:]] for p in points],
                                       "kl": kl_curve(run)}
            path.write_text(json.dumps(selection, indent=1) + "\n")
            print(f"{name}: dev " + ", ".join(f"{p[0]}:{100 * p[2]:.1f}" for p in points) + f" ({seconds or 0:.0f}s)",
                  flush=True)
    selection["chosen"] = miniature.choose_lrs(selection)
    path.write_text(json.dumps(selection, indent=1) + "\n")
    (out / "selection.txt").write_text(format_selection(selection) + "\n")
    print(format_selection(selection))
    return selection


def format_selection(selection):
    """The reasoning miniature's selection table (dev avg@2 in % by step, then each family's choice)."""
    return miniature.format_selection({**selection, "base": {"avg": selection["base"][0]}})


def lr_of(arm):
    lr = named_lr(arm) or CHOSEN_LR[family(arm)]
    if lr is None:
        raise SystemExit(f"no learning rate chosen on dev for {family(arm)} yet: run --select first and set CHOSEN_LR.")
    return lr


def experiment(out, arms, seeds, model_dir, files, heldout):
    """Each arm and seed, seed by seed (every arm's first seed before any arm's second): train, the held-out curve
    (every checkpoint, eval seed EVAL_SEED + seed), eval.py on the final adapter, the per-step KL figures. Finished
    pieces are kept; results.json is rewritten after each run."""
    scorer = Scorers(model_dir)
    path = out / "results.json"
    results = json.loads(path.read_text()) if path.is_file() else {"runs": {}, "base": {}}
    for i, arm in sorted((i, arm) for arm in arms for i in range(len(seeds[arm]))):
        seed = seeds[arm][i]
        run = run_dir(out, arm, seed)
        key = f"{arm}/s{seed}"
        if key in results["runs"]:
            continue
        if str(seed) not in results["base"]:  # the base model under this seed's evaluation samples
            results["base"][str(seed)] = base_point(scorer(), heldout, EVAL_SEED + seed, "heldout")
        seconds = train(model_dir, files["train"], arm, seed, lr_of(arm), run)
        points = score_curve(scorer(), heldout, run, results["base"][str(seed)], EVAL_SEED + seed, "heldout")
        final, eval_seconds = eval_final(model_dir, files["heldout"], run, seed)
        samples = [json.loads(line) for line in (run.parent / f"{run.name}-eval" / "samples.jsonl").read_text()
                   .splitlines() if line.strip()]
        if abs(final - points[-1][2]) > 1e-9:  # the same samples by construction: a difference is a finding
            print(f"{run.name}: eval.py scored {final}, the scorer's last point {points[-1][2]}", flush=True)
        results["runs"][key] = {"arm": arm, "seed": seed, "lr": lr_of(arm), "heldout_avg": final,
                                "scorer_equals_eval": abs(final - points[-1][2]) <= 1e-9, "shape": shapes(samples),
                                "curve": points, "kl": kl_curve(run), "seconds": seconds, "eval_seconds": eval_seconds}
        path.write_text(json.dumps(results, indent=1) + "\n")
        kl = results["runs"][key]["kl"]  # GRPO logs none
        print(f"{run.name}: held-out " + ", ".join(f"{p[0]}:{100 * p[2]:.1f}" for p in points)
              + (f" | kl_mean step 1 {kl[0][1]:.3f}, step {STEPS} {kl[-1][1]:.4f}" if kl[0][1] is not None else "")
              + f" ({seconds or 0:.0f}s)", flush=True)
    return results


def shapes(samples):
    """The final samples by how many columns they write before the box: the share of each count (0-3) and the
    accuracy of whole (3 columns) and cut-short (fewer) answers."""
    count = [answer_shape(s["completion"]) for s in samples]
    whole = [s["correct"] for s, c in zip(samples, count) if c == 3]
    cut = [s["correct"] for s, c in zip(samples, count) if c < 3]
    return {"columns_share": [sum(c == k for c in count) / len(count) for k in range(4)],
            "whole_correct": sum(whole) / len(whole) if whole else None,
            "cut_correct": sum(cut) / len(cut) if cut else None}


# -----------------------------------------------------------------------------
# The statistics


def clopper_pearson(k, n, level=0.95):
    """The exact binomial interval of k successes in n trials, by bisection on the binomial tail."""
    from math import exp, lgamma, log

    def tail_at_least(p, j):  # P(X >= j), X ~ Binomial(n, p)
        if j <= 0:
            return 1.0
        if p <= 0.0:
            return 0.0
        if p >= 1.0:
            return 1.0
        return sum(exp(lgamma(n + 1) - lgamma(i + 1) - lgamma(n - i + 1) + i * log(p) + (n - i) * log(1 - p))
                   for i in range(j, n + 1))

    def solve(f, target):  # f increasing in p
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
        return (lo + hi) / 2

    alpha = 1 - level
    low = 0.0 if k == 0 else solve(lambda p: tail_at_least(p, k), alpha / 2)
    high = 1.0 if k == n else solve(lambda p: tail_at_least(p, k + 1), 1 - alpha / 2)
    return low, high


def area(points):
    """Mean accuracy over the checkpoints after step 0: the area under the curve, rewarding the earlier gain."""
    return sum(p[2] for p in points[1:]) / (len(points) - 1)


def analyze(results, problems):
    """Per arm: final held-out (eval.py) and area per seed, their means and t-intervals over seeds (each seed its
    own evaluation samples, so the interval holds the evaluation's noise too), the pooled exact binomial interval
    of the final samples; the best arm by the protocol's primary score and its paired differences to each arm;
    the KL figures' first and last ten steps."""
    by_arm = {}
    for r in results["runs"].values():
        by_arm.setdefault(r["arm"], []).append(r)
    arms = [a for a in list(ARMS) + sorted(set(by_arm) - set(ARMS)) if a in by_arm]
    table = {"arms": arms, "seeds": {}, "heldout_avg": {}, "heldout_area": {}, "stats": {}, "kl": {}}
    samples = problems * EVAL_N
    for arm in arms:
        runs = sorted(by_arm[arm], key=lambda r: r["seed"])
        table["seeds"][arm] = [r["seed"] for r in runs]
        table["heldout_avg"][arm] = [r["heldout_avg"] for r in runs]
        table["heldout_area"][arm] = [area(r["curve"]) for r in runs]
        k = sum(round(v * samples) for v in table["heldout_avg"][arm])
        mean, half = miniature.mean_interval(table["heldout_avg"][arm])
        amean, ahalf = miniature.mean_interval(table["heldout_area"][arm])
        table["stats"][arm] = {"mean": mean, "ci95": half, "area_mean": amean, "area_ci95": ahalf,
                               "pooled_correct": k, "pooled_samples": samples * len(runs),
                               "pooled_exact95": clopper_pearson(k, samples * len(runs))}
        table["kl"][arm] = {}
        fields = KL_FIELDS[:3] if arm_settings(arm)[0] == "opsd" else ()  # kl_mean, share above tau, clamped mass
        for j, field in enumerate(fields, start=1):
            per_seed = [[row[j] for row in r["kl"]] for r in runs]
            per_step = [sum(v[t] for v in per_seed) / len(per_seed) for t in range(min(map(len, per_seed)))]
            table["kl"][arm][field] = {"first10": sum(per_step[:10]) / 10, "last10": sum(per_step[-10:]) / 10,
                                       "per_step_seed_mean": per_step,
                                       "last10_minus_first10_per_seed": [sum(v[-10:]) / 10 - sum(v[:10]) / 10
                                                                         for v in per_seed]}
    base = [v[0] for _, v in sorted(results["base"].items())]
    table["base_heldout"] = {"per_seed": base, "mean": sum(base) / len(base)}  # not "base": results.json keeps that
    best_final = max(table["stats"][a]["mean"] for a in arms)
    table["primary"] = "heldout_avg" if best_final < CEILING else "heldout_area"
    key = table["primary"]
    opsd_arms = [a for a in arms if a in ARMS and a != "grpo"]  # the protocol's six; the others are compared to it
    best = max(opsd_arms, key=lambda a: sum(table[key][a]) / len(table[key][a])) if opsd_arms else None
    table["best_opsd_arm"] = best
    table["token_efficiency"] = token_efficiency(results, best) if best and "grpo" in arms else None
    table["paired_vs_best"] = {k: {a: miniature.paired(table[k][best], table[k][a], table["seeds"][best],
                                                       table["seeds"][a]) for a in arms if a != best}
                               for k in ("heldout_avg", "heldout_area")} if best else {}
    return table


THRESHOLDS = (0.70, 0.80, 0.90, 0.95)


def tokens_to_reach(points, target):
    """Sampled completion tokens a held-out curve first reaches `target` with, linear between checkpoints; None if
    it never does. Points: [step, tokens, accuracy, ...]."""
    for (_, t0, a0, *_), (_, t1, a1, *_) in zip(points, points[1:]):
        if a0 >= target:
            return t0
        if a1 >= target:
            return t0 + (target - a0) / (a1 - a0) * (t1 - t0)
    return None


def token_efficiency(results, arm, other="grpo"):
    """Per seed both ran and per threshold: the tokens `arm` and `other` first reach it with, and their ratio."""
    runs = {(r["arm"], r["seed"]): r for r in results["runs"].values()}
    seeds = sorted(s for a, s in runs if a == arm and (other, s) in runs)
    rows = {}
    for target in THRESHOLDS:
        per_seed = []
        for seed in seeds:
            mine, theirs = (tokens_to_reach(runs[(a, seed)]["curve"], target) for a in (arm, other))
            per_seed.append({"seed": seed, arm: mine, other: theirs,
                             "ratio": theirs / mine if mine and theirs else None})
        rows[f"{target:g}"] = per_seed
    return {"arms": [arm, other], "seeds": seeds, "by_threshold": rows}


def second_tau_arm(table):
    """The protocol's second-tau arm: the best OPSD arm's clip (if that is none, the better of entry and token by the
    primary score at the best arm's skip) at SECOND_TAU, with the best arm's skip."""
    best = table["best_opsd_arm"]
    _, clip, _, skip = arm_settings(best)
    suffix = f"-skip{skip}" if skip else ""
    if clip == "none":
        mean = lambda arm: sum(table[table["primary"]][arm]) / len(table[table["primary"]][arm])  # noqa: E731
        clip = max(("entry", "token"), key=lambda c: mean(c + suffix))
    return f"{clip}@{SECOND_TAU:g}{suffix}"


CEILING = 0.95  # at or above it (the best arm's mean final held-out score) the area decides instead


def format_results(table):
    lines = [f"held-out avg@{EVAL_N} in % (400 problems, eval seed {EVAL_SEED} + seed); base "
             f"{100 * table['base_heldout']['mean']:.1f}; primary score: {table['primary']}",
             f"{'arm':<16}{'seeds':>6}{'final':>8}{'95% CI':>14}{'pooled exact 95%':>20}{'area':>8}{'95% CI':>14}"
             f"   kl_mean first10 -> last10   clipped mass   per seed (final)"]
    for arm in table["arms"]:
        st, kl = table["stats"][arm], table["kl"][arm] or {f: {"first10": 0, "last10": 0} for f in KL_FIELDS}
        ci = lambda m, h: f"{100 * (m - h):.1f}..{100 * (m + h):.1f}" if h is not None else "-"  # noqa: E731
        lo, hi = st["pooled_exact95"]
        lines.append(f"{arm:<16}{len(table['seeds'][arm]):>6}{100 * st['mean']:>8.1f}{ci(st['mean'], st['ci95']):>14}"
                     f"{f'{100 * lo:.1f}..{100 * hi:.1f}':>20}{100 * st['area_mean']:>8.1f}"
                     f"{ci(st['area_mean'], st['area_ci95']):>14}"
                     f"   {kl['kl_mean']['first10']:.3f} -> {kl['kl_mean']['last10']:.3f}"
                     f"   {kl['kl_clipped_teacher_mass']['first10']:.3f} -> "
                     f"{kl['kl_clipped_teacher_mass']['last10']:.3f}"
                     f"   " + " ".join(f"{100 * v:.1f}" for v in table["heldout_avg"][arm]))
    best = table["best_opsd_arm"]
    for key in ("heldout_avg", "heldout_area"):
        pairs = table["paired_vs_best"].get(key, {})
        lines.append(f"paired, {best} minus each ({key}, points, 95% t-interval over seeds): " + "; ".join(
            f"{a} {100 * d['mean']:+.1f} +- {100 * d['ci95']:.1f}" if d and d["ci95"] is not None else f"{a} -"
            for a, d in pairs.items()))
    eff = table.get("token_efficiency")
    if eff:
        a, b = eff["arms"]
        fmt = lambda v: "-" if v is None else f"{v / 1000:.1f}k"  # noqa: E731
        for target, rows in eff["by_threshold"].items():
            lines.append(f"tokens to {100 * float(target):.0f}% held-out, {a} / {b} (ratio) per seed: " + "; ".join(
                f"s{r['seed']} {fmt(r[a])} / {fmt(r[b])}" + (f" ({r['ratio']:.1f}x)" if r["ratio"] else "")
                for r in rows))
    return "\n".join(lines)


# -----------------------------------------------------------------------------
# Part 5: tau crossed with the learning rate. Every cell (tau, lr) of token-skip1 from the records that hold it
# (Part 2's results/ at 2e-3, cross/heldout/ at the others; on the drift model drift/ and cross/drift/)

CROSS = HERE / "cross"
CROSS_ARMS = ("token-skip1", "token@0.2-skip1")  # tau 0.05 and tau 0.2, both leaving the first position out
CROSS_GRID = {"token-skip1": (8e-4, 2e-3, 5e-3), "token@0.2-skip1": (8e-4, 2e-3, 5e-3, 1.25e-2)}  # the lrs run on dev


def cross_cells(*results):
    """{(arm without its -lr, lr): {seed: run}} of the cross's two arms, over results.json files."""
    cells = {}
    for res in results:
        for r in res["runs"].values():
            arm = re.sub(rf"-lr{NUMBER}$", "", r["arm"])
            if arm in CROSS_ARMS:
                cells.setdefault((arm, r["lr"]), {})[r["seed"]] = r
    return cells


def compare_taus(cells, lrs):
    """Each cell's scores over seeds; the primary score by Part 1's rule over the cells; D = tau 0.2 - tau 0.05, each
    at its lr in `lrs`, paired by seed on every score and at every checkpoint."""
    scored = {}
    for (arm, lr), runs in sorted(cells.items()):
        seeds = sorted(runs)
        cell = {"arm": arm, "lr": lr, "seeds": seeds, "heldout_avg": [runs[s]["heldout_avg"] for s in seeds],
                "heldout_area": [area(runs[s]["curve"]) for s in seeds],
                "area_20_100": [area(runs[s]["curve"][1:]) for s in seeds],  # without step 10, the warmup's end
                "curve": [[runs[s]["curve"][j][2] for s in seeds] for j in range(len(runs[seeds[0]]["curve"]))]}
        for key in ("heldout_avg", "heldout_area", "area_20_100"):
            cell[f"{key}_mean"], cell[f"{key}_ci95"] = miniature.mean_interval(cell[key])
        scored[f"{arm} lr {lr:g}"] = cell
    primary = "heldout_avg" if max(c["heldout_avg_mean"] for c in scored.values()) < CEILING else "heldout_area"
    low, high = (scored.get(f"{arm} lr {lrs[arm]:g}") for arm in CROSS_ARMS)
    if not (low and high):
        return {"cells": scored, "lrs": lrs, "primary": primary, "D": None}
    D = {key: miniature.paired(high[key], low[key], high["seeds"], low["seeds"])
         for key in ("heldout_avg", "heldout_area", "area_20_100")}
    steps = [EVERY * j for j in range(len(low["curve"]))]
    D["per_checkpoint"] = {str(step): miniature.paired(high["curve"][j], low["curve"][j], high["seeds"], low["seeds"])
                           for j, step in enumerate(steps) if step}
    return {"cells": scored, "lrs": lrs, "primary": primary, "D": D}


def cross_verdict(held_out, drift):
    """The README's rule, fixed before the runs (Part 5): tau 0.2 stays only if D's interval excludes 0 in its
    favour and on the drift model tau 0.2 is not worse by an interval excluding 0; else tau 0.05."""
    if not (held_out["D"] and drift["D"]):
        return "pending: a chosen cell has not run"
    d, dd = held_out["D"][held_out["primary"]], drift["D"][drift["primary"]]
    if len(d["seeds"]) < len(SEEDS) or len(dd["seeds"]) < 3:
        return "pending: a chosen cell has not run every seed"
    favours, against = d["mean"] - d["ci95"] > 0, d["mean"] + d["ci95"] < 0
    drift_worse = dd["mean"] + dd["ci95"] < 0
    if favours and not drift_worse:
        return "tau 0.2 stays recommended"
    if favours:
        return "tau 0.05: tau 0.2 leads on held-out but is worse on the drift model"
    return "tau 0.05: better here" if against else "tau 0.05: the two tie here"


def cross_result(records=CROSS, lrs=None):
    """Part 5's analysis from the committed records (Part 2's and 4's at 2e-3, `records`' heldout/ and drift/)."""
    read = lambda path: json.loads(path.read_text()) if path.is_file() else {"runs": {}}  # noqa: E731
    lrs = lrs or CROSS_LR
    held_out = compare_taus(cross_cells(read(HERE / "results" / "results.json"),
                                        read(records / "heldout" / "results.json")), lrs)
    drift = compare_taus(cross_cells(read(HERE / "drift" / "results.json"), read(records / "drift" / "results.json")),
                         lrs)
    missing = [f"{arm} lr {lr:g}" for arm, grid in CROSS_GRID.items() for lr in grid
               if len(held_out["cells"].get(f"{arm} lr {lr:g}", {}).get("seeds", [])) < len(SEEDS)]
    return {"chosen_lr": lrs, "held_out": held_out, "drift": drift, "verdict": cross_verdict(held_out, drift),
            "held_out_cells_missing": missing}


def cross(records=CROSS):
    """cross.json and cross.txt in `records`."""
    result = cross_result(records)
    (records / "cross.json").write_text(json.dumps(result, indent=1) + "\n")
    (records / "cross.txt").write_text(format_cross(result) + "\n")
    return result


def format_cross(result):
    pct = lambda m, h: f"{100 * m:6.1f} +- {100 * h:.1f}" if h is not None else f"{100 * m:6.1f}"  # noqa: E731
    lines = [f"Part 5: token-skip1, tau x lr; chosen on dev: " + ", ".join(f"{a} {lr:g}" if lr else f"{a} -"
                                                                           for a, lr in result["chosen_lr"].items())]
    for name in ("held_out", "drift"):
        part = result[name]
        lines.append(f"{name} (primary score: {part['primary']}); seed means, 95% t-interval, in points")
        lines.append(f"{'cell':<28}{'seeds':>6}{'final':>16}{'area 10-100':>16}{'area 20-100':>16}")
        for key, c in part["cells"].items():
            lines.append(f"{key:<28}{len(c['seeds']):>6}{pct(c['heldout_avg_mean'], c['heldout_avg_ci95']):>16}"
                         f"{pct(c['heldout_area_mean'], c['heldout_area_ci95']):>16}"
                         f"{pct(c['area_20_100_mean'], c['area_20_100_ci95']):>16}")
        if part["D"]:
            lines.append("D = tau 0.2 - tau 0.05 at their chosen lrs, paired: " + "; ".join(
                f"{k} {pct(d['mean'], d['ci95']).strip()}" for k, d in part["D"].items() if k != "per_checkpoint"))
            lines.append("  by checkpoint: " + "; ".join(f"{s}: {100 * d['mean']:+.1f}"
                                                          for s, d in part["D"]["per_checkpoint"].items()))
    lines.append(f"verdict by the rule: {result['verdict']}")
    lines.append("held-out cells not yet run on every seed (they decide nothing): "
                 + (", ".join(result["held_out_cells_missing"]) or "none"))
    return "\n".join(lines)


def plot(results, table, path):
    """Held-out accuracy by step (seed means), kl_mean and the clipped teacher mass by step, per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for arm in table["arms"]:
        runs = [r for r in results["runs"].values() if r["arm"] == arm]
        steps = [p[0] for p in runs[0]["curve"]]
        acc = [100 * sum(r["curve"][j][2] for r in runs) / len(runs) for j in range(len(steps))]
        kind, clip, tau, skip = arm_settings(arm)
        # the skip by the line (none, 1, 8, 16 positions: solid, dashed, dotted, sparse dots); a second tau dash-dot
        style = {0: "-", 1: "--", 8: ":"}.get(skip, (0, (1, 4))) if tau in (TAU, None) else "-."
        color = {"entry": "tab:orange", "token": "tab:blue", "none": "tab:green"}.get(clip, "tab:purple")
        axes[0].plot(steps, acc, linestyle=style, color=color, marker="o", ms=3, label=f"{arm} ({len(runs)} seeds)")
        for ax, field in zip(axes[1:], ("kl_mean", "kl_clipped_teacher_mass")):
            if kind == "opsd":
                v = table["kl"][arm][field]["per_step_seed_mean"]
                ax.plot(range(1, len(v) + 1), v, linestyle=style, color=color, label=arm)
    axes[0].set(xlabel="optimizer step", ylabel=f"held-out avg@{EVAL_N}, training format (%)", ylim=(-2, 102))
    axes[1].set(xlabel="optimizer step", ylabel="kl_mean (each step's, loss temperature)", yscale="log")
    axes[2].set(xlabel="optimizer step", ylabel="teacher mass the entry clip clamps (mean per position)")
    axes[0].legend(fontsize=7)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def record(out, dest):
    """Copy what the report needs from a run directory into `dest` (committed): results.json, table.txt, the
    figure, selection.json/.txt, invocations.json; per run its metrics.jsonl; per eval.py scoring its summary,
    config and gzipped samples."""
    import gzip
    import shutil

    dest.mkdir(parents=True, exist_ok=True)
    for name in ("results.json", "table.txt", "ablation.png", "selection.json", "selection.txt", "invocations.json"):
        if (out / name).is_file():
            shutil.copy(out / name, dest / name)
    for metrics in sorted(out.glob("*/metrics.jsonl")):
        (dest / "runs" / metrics.parent.name).mkdir(parents=True, exist_ok=True)
        shutil.copy(metrics, dest / "runs" / metrics.parent.name / "metrics.jsonl")
    for summary in sorted(out.glob("*-eval/summary.json")):
        target = dest / "runs" / summary.parent.name
        target.mkdir(parents=True, exist_ok=True)
        for name in ("summary.json", "config.json"):
            shutil.copy(summary.parent / name, target / name)
        (target / "samples.jsonl.gz").write_bytes(gzip.compress((summary.parent / "samples.jsonl").read_bytes(),
                                                                mtime=0))


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="ablation.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--output-dir", help="where the runs and their records go")
    p.add_argument("--pretrain", action="store_true", help="pre-train the starting model into --output-dir")
    p.add_argument("--pretrain-seed", type=int, default=PRETRAIN_SEED)
    p.add_argument("--prefer-teacher", type=float, default=PREFER_TEACHER,
                   help="with --pretrain: how often the teacher shown the reference takes each step's first form")
    p.add_argument("--jump", type=float, default=0.0,
                   help=f"with --pretrain: the drift teacher's chance to abandon the scratchpad per column (Part 3: "
                        f"{JUMP})")
    p.add_argument("--drift", action="store_true", help="the arms on the drift model (model-drift/)")
    p.add_argument("--profile", action="store_true", help="the step-1 rollouts and KL profile of --model")
    p.add_argument("--model", default=str(MODEL), help="the starting model (default: the committed one)")
    p.add_argument("--reference", default=str(REFERENCE), help="with --profile: where the step-1 rollouts go")
    p.add_argument("--temperatures", action="store_true",
                   help="the reasoning miniature's step-1 figures at loss temperatures 1.1-3.0, into this folder")
    p.add_argument("--select", action="store_true", help="dev selection of each family's lr (seed 1, --lrs)")
    p.add_argument("--lrs", default=",".join(f"{lr:g}" for lr in LR_GRID))
    p.add_argument("--arms", default=None, help=f"comma-separated, of {', '.join(ARMS)} or CLIP@TAU[-skip1] "
                                                "(default: every arm; --select: entry,token,none,grpo)")
    p.add_argument("--seeds", default=None, help="comma-separated (default: 1-5, grpo 1-3)")
    p.add_argument("--analyze", action="store_true", help="only the tables and figure of --output-dir's results")
    p.add_argument("--cross", action="store_true", help="Part 5's analysis of the committed records (cross/)")
    p.add_argument("--record", metavar="DIR", help="copy --output-dir's records into DIR (the committed folder), stop")
    p.add_argument("--grpo-job", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.grpo_job or args.profile or args.temperatures or args.cross:
        return args
    if not args.output_dir:
        p.error("--output-dir is required.")
    if args.pretrain or args.analyze or args.record:
        return args
    default = "entry,token,none,grpo" if args.select else ",".join(ARMS)
    args.arms = [a.strip() for a in (args.arms or default).split(",")]
    for arm in args.arms:
        try:
            kind, clip, tau, _ = arm_settings(arm)
        except ValueError:
            p.error(f"--arms: {arm!r} is neither grpo nor CLIP[@TAU][-skipN] with CLIP one of {', '.join(CLIPS)}.")
        if kind == "opsd" and not tau > 0:
            p.error(f"--arms: {arm!r} has tau {tau:g}: it must be positive.")
    seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else None
    args.seeds = {arm: seeds or list(GRPO_SEEDS if arm == "grpo" else SEEDS) for arm in args.arms}
    args.lrs = [float(x) for x in args.lrs.split(",")]
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.grpo_job:
        return grpo_job(json.loads(args.grpo_job))
    if args.pretrain:
        return pretrain(Path(args.output_dir), args.pretrain_seed, args.prefer_teacher, args.jump)
    if args.profile:
        return write_profile(Path(args.model), Path(args.reference))
    if args.temperatures:
        return print(json.dumps(temperature_sweep(), indent=1))
    if args.cross:
        return print(format_cross(cross()))
    out = Path(args.output_dir)
    if args.record:
        return record(out, Path(args.record))
    model_dir = DRIFT_MODEL if args.drift and args.model == str(MODEL) else Path(args.model)
    train_rows, dev, heldout = miniature.make_task()
    info = json.loads((model_dir / miniature.TASK_FILE).read_text())
    if info.get("train_digest") != miniature.split_digest(train_rows):
        raise SystemExit(f"{model_dir} was pre-trained on another split of the task.")
    files = {name: out / "data" / f"{name}.jsonl" for name in ("train", "dev", "heldout")}
    for name, rows in (("train", train_rows), ("dev", dev), ("heldout", heldout)):
        miniature.write_jsonl(files[name], rows)
    invocations = out / "invocations.json"
    seen = json.loads(invocations.read_text()) if invocations.is_file() else []
    invocations.write_text(json.dumps(seen + [{**miniature.this_machine(), "argv": sys.argv[1:] if argv is None
                                               else list(argv), "chosen_lr": CHOSEN_LR,
                                               "cross_lr": CROSS_LR}], indent=1) + "\n")
    if args.select:
        return select(out, args.arms, args.lrs, model_dir, files, dev)
    if not args.analyze:
        experiment(out, args.arms, args.seeds, model_dir, files, heldout)
    results = json.loads((out / "results.json").read_text())
    table = analyze(results, len(heldout))
    # results.json: every run's record ("runs", "base") and the analysis of them, in the reasoning miniature's shape
    # ("heldout_avg": per arm one value per seed, "seeds" beside it)
    (out / "results.json").write_text(json.dumps({"runs": results["runs"], "base": results["base"], **table},
                                                 indent=1) + "\n")
    (out / "table.txt").write_text(format_results(table) + "\n")
    plot(results, table, out / "ablation.png")
    print(format_results(table))
    return table


if __name__ == "__main__":
    main()
