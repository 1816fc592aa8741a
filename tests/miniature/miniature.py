"""Reasoning in miniature: 3-digit addition with a scratchpad, on a 2-core CPU. opsd.py's arms against SFT on the
reference, SFT on expert traces and GRPO, scored by eval.py in the format the student trains in. tests/miniature/README.md
holds the protocol (fixed before any arm was run) and the results.

    python tests/miniature/miniature.py --output-dir runs/mini                # the default: the headline arms, 2 seeds (~25 min)
    python tests/miniature/miniature.py --output-dir runs/mini-quick --quick  # one arm, 40 steps (~1.5 min)
    python tests/miniature/miniature.py --quickstart --output-dir runs/qs  # the README quickstart, timed, and its curve
    python tests/miniature/miniature.py --output-dir runs/mini-full --full    # the whole protocol (~3 h; --resume continues it)
    python tests/miniature/miniature.py --output-dir runs/select --select --arms token --lr 5e-3   # dev: one lr, dev curves
    python tests/miniature/miniature.py --pretrain --pretrain-seed 1 --output-dir runs/model-p1  # a starting model, accepted?
    python tests/miniature/miniature.py --reference-step tests/miniature/reference_step.json  # the port-check fixture

The task: a+b with 100 <= a, b <= 999. The student (eval.py's prompt, thinking off: opsd.py --student-prompt eval
--no-student-thinking) writes a right-to-left column scratchpad, `7+5=12 5+8+1=14 4+3+1=8 \\boxed{842}`; the
teacher's prompt holds the terse reference `457+385=842`. The starting models (0.8M-parameter Qwen3s, digits one
token each) are pre-trained here in plain PyTorch on the training split only: traces by an error-prone writer (a
misconception, dropping an incoming carry into a column that carries again 70% of the time, and 10% random slips)
after the student's prompts, correct traces after the teacher's prompt with the reference.
"""

import argparse
import contextlib
import hashlib
import json
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent  # tests/miniature: this script, its models, data and records
ROOT = HERE.parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import eval as evaluation  # noqa: E402  (eval.py: its prompt builder and grading)
import opsd  # noqa: E402  (opsd.py: its prompts, LoRA, data order, sampling, weight push, LR schedule, loss)
from make_tiny_model import CHAT_TEMPLATE, SPECIAL_TOKENS  # noqa: E402

DATA = HERE
# the three starting models, by pre-training seed, fixed in advance; the first is the one every arm runs on
PRETRAIN_SEEDS = (1, 2, 3)
SHIPPED_MODELS = {1: DATA / "model", 2: DATA / "model-p2", 3: DATA / "model-p3"}
SHIPPED_MODEL = SHIPPED_MODELS[1]
# the style-drift model (tests/miniature/README.md, part 3): pre-training seed 1, its teacher shown the reference answers in
# the reference's style (the boxed answer alone) in DRIFT_TERSE of its teacher-format examples
DRIFT_MODEL, DRIFT_TERSE = DATA / "model-drift", 0.3
MODELS = {**SHIPPED_MODELS, "drift": DRIFT_MODEL}
TASK_FILE = "miniature.json"  # next to each model: its split, its pre-training, its acceptance figures

# -----------------------------------------------------------------------------
# The task: 3-digit addition, one fixed split

TASK_SEED, NUM_HELDOUT, NUM_DEV, NUM_TRAIN = 0, 400, 400, 12_000
LOW, HIGH = 100, 999


def make_task():
    """(train, dev, held-out rows), drawn once by TASK_SEED from all a+b with 100 <= a, b <= 999. No training
    problem is a dev or held-out problem or its operands-swapped twin. Every row: problem ("457+385"), answer
    ("842"); training rows also: solution (the terse reference "457+385=842"), trace (the correct scratchpad),
    no_solution (the control arm's empty reference) and wrong_solution (another training problem's reference with
    another answer, a fixed derangement)."""
    rng = random.Random(TASK_SEED)
    span = HIGH - LOW + 1
    picks = rng.sample(range(span * span), NUM_HELDOUT + NUM_DEV + NUM_TRAIN + 2_000)
    pairs = [(LOW + k // span, LOW + k % span) for k in picks]
    heldout, dev = pairs[:NUM_HELDOUT], pairs[NUM_HELDOUT:NUM_HELDOUT + NUM_DEV]
    scored = set(heldout + dev)
    train = [(a, b) for a, b in pairs[NUM_HELDOUT + NUM_DEV:] if (a, b) not in scored and (b, a) not in scored]
    train = train[:NUM_TRAIN]
    assert len(train) == NUM_TRAIN
    row = lambda a, b: {"problem": f"{a}+{b}", "answer": str(a + b)}  # noqa: E731
    train = [{**row(a, b), "solution": f"{a}+{b}={a + b}", "trace": correct_trace(a, b)} for a, b in train]
    other = wrong_derangement([r["answer"] for r in train])
    train = [{**r, "no_solution": "", "wrong_solution": train[other[i]]["solution"]} for i, r in enumerate(train)]
    return train, [row(a, b) for a, b in dev], [row(a, b) for a, b in heldout]


def wrong_derangement(answers):
    """other[i] != i with answers[other[i]] != answers[i], each index used once: a seeded cycle, then swaps."""
    order = list(range(len(answers)))
    random.Random(TASK_SEED + 1).shuffle(order)
    other = [0] * len(answers)
    for k, i in enumerate(order):
        other[i] = order[(k + 1) % len(order)]
    for i in range(len(answers)):
        if answers[other[i]] != answers[i]:
            continue
        for j in order:  # the first partner whose swap fixes i and breaks nothing at j
            if j != i and other[j] != i and other[i] != j and answers[other[j]] != answers[i] \
                    and answers[other[i]] != answers[j]:
                other[i], other[j] = other[j], other[i]
                break
    return other


def split_digest(rows):
    """Fingerprint of a split's problems, stored with each model so a changed split is caught."""
    return hashlib.sha256("\n".join(r["problem"] for r in rows).encode()).hexdigest()[:16]


def operands(problem):
    a, b = problem.split("+")
    return int(a), int(b)


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


# -----------------------------------------------------------------------------
# The scratchpad and its writers

CARRY_DROP, SLIP = 0.7, 0.1  # the error-prone writer: the misconception's rate, the random slips' rate per column


def write_trace(a, b, rng=None, carry_drop=0.0, slip=0.0, prefer=None):
    """The column scratchpad of a+b, right to left, "x+y=s" or "x+y+1=s" with an incoming carry, then the boxed
    answer the columns give. A writer with `carry_drop` drops an incoming carry into a column that carries again
    (x + y + 1 >= 10) with that probability (it writes "x+y=s" with s = x + y); with `slip` it writes a column's
    sum off by one (either way, kept within 0..19). The trace is always self-consistent: each column's written sum
    decides its digit and the carry out, so a wrong column makes a wrong answer. With `prefer` (the clip ablation's
    writers, tests/miniature/clip) each step has two valid forms and the first is taken with that probability:
    "x+y" or "y+x" in each column, ", " or " " between columns, "so " or nothing before the box."""
    columns, digits, carry = [], [], 0
    for i in range(3):
        x, y = a // 10 ** i % 10, b // 10 ** i % 10
        c = carry
        if c and x + y + c >= 10 and carry_drop and rng.random() < carry_drop:
            c = 0
        s = x + y + c
        if slip and rng.random() < slip:
            s = s + 1 if s == 0 or (s < 19 and rng.random() < 0.5) else s - 1
        first, second = (x, y) if prefer is None or rng.random() < prefer else (y, x)
        columns.append(f"{first}+{second}+1={s}" if c else f"{first}+{second}={s}")
        digits.append(s % 10)
        carry = s // 10
    answer = ("1" if carry else "") + "".join(str(d) for d in reversed(digits))
    if prefer is None:
        return " ".join(columns) + f" \\boxed{{{int(answer)}}}"
    seps = [", " if rng.random() < prefer else " " for _ in columns[1:]]
    body = columns[0] + "".join(sep + col for sep, col in zip(seps, columns[1:]))
    return body + (" so" if rng.random() < prefer else "") + f" \\boxed{{{int(answer)}}}"


def correct_trace(a, b):
    return write_trace(a, b)


def writer_trace(a, b, rng):
    return write_trace(a, b, rng, carry_drop=CARRY_DROP, slip=SLIP)


def misconception_applies(a, b):
    """Whether a+b has a column the misconception can hit: an incoming carry into a column that carries again."""
    carry = 0
    for i in range(3):
        s = a // 10 ** i % 10 + b // 10 ** i % 10 + carry
        if carry and s >= 10:
            return True
        carry = s // 10
    return False


def has_scratchpad(text):
    """Whether an answer shows column work before its box (issue 25's measure of style drift)."""
    head = text.split("\\boxed")[0]
    return "=" in head


def answer_style(text):
    """What an answer writes before its box: "columns" (the student's column sums of single digits, `7+5=12`),
    "reference" (the terse reference's whole sum, `457+385=842`, and no column), or "none" (the box alone, or
    anything else). has_scratchpad counts both of the first two as work."""
    head = text.split("\\boxed")[0]
    if re.search(r"(?<![0-9+])[0-9]\+[0-9](\+1)?=[0-9]{1,2}(?![0-9])", head):
        return "columns"
    return "reference" if re.search(r"[0-9]{2,}\+[0-9]{2,}=[0-9]+", head) else "none"


# -----------------------------------------------------------------------------
# Prompts: the student's (opsd.py --student-prompt eval --no-student-thinking, eval.py --no-thinking), the
# transfer format (eval.py's default, thinking on) and the teacher's (opsd.py's, with a reference)

STUDENT_FLAGS = ["--student-prompt", "eval", "--no-student-thinking"]


def student_prompt(tok, problem):
    """The student's prompt: eval.py --no-thinking's, which opsd.py --student-prompt eval --no-student-thinking
    renders token for token (tests/test_miniature.py checks that through opsd.py's own prompt loading)."""
    return evaluation.prompt_ids(tok, problem, thinking=False)


def transfer_prompt(tok, problem):
    return evaluation.prompt_ids(tok, problem, thinking=True)


def teacher_prompt(tok, problem, context):
    return opsd.render(tok, opsd.teacher_message(problem, context), thinking=True)


# -----------------------------------------------------------------------------
# Tokenizer and model: digits are single tokens, the chat template is the tests' Qwen3-style one


def build_tokenizer(train, trace=None):
    """A byte-level BPE of vocabulary 512, every digit its own token, learnt from prompts and answers (each row's
    correct trace, or `trace(row)`)."""
    trace = trace or (lambda row: row["trace"])
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    lines = [opsd.teacher_message(r["problem"], r["solution"]) + " " + trace(r) for r in train[:200]]
    lines += [opsd.student_message(r["problem"], "eval") + " " + trace(r) for r in train[:200]]
    lines += [opsd.student_message(r["problem"]) for r in train[:50]]
    bpe.train_from_iterator(lines, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  padding_side="left")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_model(tok, seed):
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=len(tok), hidden_size=128, intermediate_size=384, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64,  # vLLM's CPU attention needs 64
                         max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=None,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return model


def answer_ids(tok, text):
    """Token ids of an answer text and the end of the turn."""
    return tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]


# -----------------------------------------------------------------------------
# Pre-training: each training problem in four formats, a fresh writer's trace each time one is drawn

FORMATS = ("student", "transfer", "teacher", "teacher_empty")
PRETRAIN = {"steps": 1200, "batch_size": 64, "lr": 2e-3, "warmup": 30}


def pretrain_example(tok, row, fmt, rng, teacher_terse=0.0):
    """(prompt ids, answer ids) of one pre-training example. The student's two formats and the teacher with an
    empty reference (the control arm's teacher: it knows no more than the student) get the error-prone writer's
    trace; the teacher with the reference gets the correct trace, or with probability `teacher_terse` the boxed
    answer alone (the reference's style: the style-drift variant of issue 25; 0 here)."""
    a, b = operands(row["problem"])
    if fmt == "teacher":
        text = f"\\boxed{{{a + b}}}" if teacher_terse and rng.random() < teacher_terse else correct_trace(a, b)
        return teacher_prompt(tok, row["problem"], f"{a}+{b}={a + b}"), answer_ids(tok, text)
    prompt = {"student": student_prompt, "transfer": transfer_prompt}.get(fmt)
    prompt = prompt(tok, row["problem"]) if prompt else teacher_prompt(tok, row["problem"], "")
    return prompt, answer_ids(tok, writer_trace(a, b, rng))


def right_padded(batch, pad_id):
    """input_ids, attention_mask, labels (answer tokens only) of [(prompt, answer)], positions 0.. per row."""
    T = max(len(p) + len(a) for p, a in batch)
    input_ids = torch.full((len(batch), T), pad_id)
    labels = torch.full((len(batch), T), -100)
    attention_mask = torch.zeros((len(batch), T), dtype=torch.long)
    for row, (prompt, answer) in enumerate(batch):
        input_ids[row, :len(prompt) + len(answer)] = torch.tensor(prompt + answer)
        labels[row, len(prompt):len(prompt) + len(answer)] = torch.tensor(answer)
        attention_mask[row, :len(prompt) + len(answer)] = 1
    return input_ids, attention_mask, labels


def batch_loss(model, batch, pad_id):
    """The mean next-token loss over all answer tokens of the batch, computed in one forward per prompt length
    (the teacher's prompt is 3x the student's: padding every row to it would waste half the compute)."""
    groups = {}
    for example in batch:
        groups.setdefault(len(example[0]), []).append(example)
    total, count = 0.0, sum(len(a) for _, a in batch)
    for group in groups.values():
        input_ids, attention_mask, labels = right_padded(group, pad_id)
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
        total = total + torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels[:, 1:].flatten(),
                                                          ignore_index=-100, reduction="sum")
    return total / count


@torch.no_grad()
def answer_loss(model, batch, pad_id):
    """Mean next-token loss over the answer tokens of a fixed batch (the convergence check's figure)."""
    model.eval()
    input_ids, attention_mask, labels = right_padded(batch, pad_id)
    loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss.item()
    model.train()
    return loss


def pretrain(out_dir, train, dev, heldout, *, seed, steps=PRETRAIN["steps"], teacher_terse=0.0, example=None,
             trace=None, writer=None):
    """Pre-train a fresh model (init and batches seeded by `seed`) on the training split only; save it with its
    pre-training record and acceptance figures (see ACCEPT) in miniature.json. Another experiment's model passes its
    own `example(tok, row, fmt, rng)`, the `trace(row)` its tokenizer learns from and the `writer` it records."""
    t0 = time.perf_counter()
    example = example or (lambda tok, row, fmt, rng: pretrain_example(tok, row, fmt, rng, teacher_terse))
    tok = build_tokenizer(train, trace)
    model = build_model(tok, seed)
    bs, lr = PRETRAIN["batch_size"], PRETRAIN["lr"]
    print(f"pre-training a {sum(p.numel() for p in model.parameters()):,}-parameter Qwen3 (vocab {len(tok)}, seed "
          f"{seed}) for {steps} steps of {bs} on {len(train)} problems in {len(FORMATS)} formats", flush=True)
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    # the convergence figure: the answer loss on dev problems in all four formats, writer draws fixed by seed 0
    dev_rng = random.Random(0)
    dev_batch = [example(tok, r, fmt, dev_rng) for r in dev[:64] for fmt in FORMATS]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    model.train()
    losses = []
    for step in range(steps):
        picks = torch.randint(len(train) * len(FORMATS), (bs,), generator=g).tolist()  # an equal mix of formats
        batch = [example(tok, train[k // len(FORMATS)], FORMATS[k % len(FORMATS)], rng) for k in picks]
        loss = batch_loss(model, batch, tok.pad_token_id)
        for group in optimizer.param_groups:
            group["lr"] = opsd.lr_at(step, lr=lr, max_steps=steps, warmup_steps=PRETRAIN["warmup"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % 100 == 0 or step + 1 == steps:
            losses.append([step + 1, answer_loss(model, dev_batch, tok.pad_token_id)])
            print(f"pre-train step {step + 1:4d}/{steps} | batch loss {loss.item():.4f} | dev answer loss "
                  f"{losses[-1][1]:.4f} | {time.perf_counter() - t0:.0f}s", flush=True)
    seconds = time.perf_counter() - t0
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    figures = acceptance_figures(model, tok, dev)
    verdict = accept(figures, losses)
    info = {"task_seed": TASK_SEED, "train_digest": split_digest(train), "dev_digest": split_digest(dev),
            "heldout_digest": split_digest(heldout), "pretrain_seed": seed, "pretrain_steps": steps,
            **{k: v for k, v in PRETRAIN.items() if k != "steps"}, "teacher_terse": teacher_terse,
            "writer": writer or {"carry_drop": CARRY_DROP, "slip": SLIP}, "pretrain_seconds": round(seconds, 1),
            "dev_answer_loss": losses, "dev": figures, "accepted": verdict["accepted"], "why": verdict["why"]}
    (out_dir / TASK_FILE).write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps({"dev": figures, **verdict}, indent=1), flush=True)
    return info


# The acceptance rule, fixed before any arm ran (tests/miniature/README.md): on the dev split, in the student's training
# prompt, the base model's greedy and sampled (temperature 1) accuracy in these windows, the teacher with the
# reference nearly perfect, and the pre-training converged (dev answer loss moved by under 2% in its last 100 steps).
ACCEPT = {"greedy": (0.40, 0.85), "sampled": (0.30, 0.75), "teacher_greedy_min": 0.95, "loss_change_max": 0.02}


def accept(figures, losses):
    why = []
    for key in ("greedy", "sampled"):
        low, high = ACCEPT[key]
        if not low <= figures[f"student_{key}"] <= high:
            why.append(f"student {key} {figures[f'student_{key}']:.3f} outside [{low}, {high}]")
    if figures["teacher_greedy"] < ACCEPT["teacher_greedy_min"]:
        why.append(f"teacher greedy {figures['teacher_greedy']:.3f} < {ACCEPT['teacher_greedy_min']}")
    change = abs(losses[-1][1] - losses[-2][1]) / losses[-2][1] if len(losses) > 1 else 1.0
    if change > ACCEPT["loss_change_max"]:
        why.append(f"dev answer loss changed by {100 * change:.1f}% in the last 100 steps: not converged")
    return {"accepted": not why, "why": why or ["every condition met"], "loss_change": change}


@torch.no_grad()
def generate(model, tok, prompts, *, sample=False, seed=0, batch_size=200, max_new_tokens=48):
    """Answer texts of HF generate (left-padded batches): greedy, or sampled at temperature 1 (no top-p)."""
    model.eval()
    texts = []
    torch.manual_seed(seed)
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        P = max(map(len, chunk))
        input_ids = torch.tensor([[tok.pad_token_id] * (P - len(p)) + p for p in chunk])
        attention_mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in chunk])
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                             do_sample=sample, temperature=1.0 if sample else None, top_p=1.0 if sample else None,
                             top_k=0 if sample else None)
        texts += [tok.decode(ids, skip_special_tokens=True) for ids in out[:, P:]]
    model.train()
    return texts


def acceptance_figures(model, tok, dev):
    """Dev accuracies of the starting model: the student (its training prompt, greedy and sampled), the transfer
    prompt (greedy), the teacher with the reference and with an empty one (greedy, and the reference sampled);
    how many of the student's greedy errors sit on problems the misconception can hit; how often the teacher
    answers without a scratchpad."""
    prompts = {"student": [student_prompt(tok, r["problem"]) for r in dev],
               "transfer": [transfer_prompt(tok, r["problem"]) for r in dev],
               "teacher": [teacher_prompt(tok, r["problem"], f"{r['problem']}={r['answer']}") for r in dev],
               "teacher_empty": [teacher_prompt(tok, r["problem"], "") for r in dev]}
    correct = lambda texts: [evaluation.extract_boxed(t) == r["answer"] for t, r in zip(texts, dev)]  # noqa: E731
    figures, greedy_texts = {}, {}
    for fmt, p in prompts.items():
        greedy_texts[fmt] = generate(model, tok, p)
        figures[f"{fmt}_greedy"] = sum(correct(greedy_texts[fmt])) / len(dev)
    for fmt in ("student", "teacher"):
        sampled = generate(model, tok, prompts[fmt], sample=True)
        figures[f"{fmt}_sampled"] = sum(correct(sampled)) / len(dev)
        figures[f"{fmt}_sampled_no_scratchpad"] = sum(not has_scratchpad(t) for t in sampled) / len(dev)
    wrong = [not c for c in correct(greedy_texts["student"])]
    figures["student_greedy_errors"] = sum(wrong)
    figures["student_greedy_errors_where_misconception_applies"] = sum(
        w and misconception_applies(*operands(r["problem"])) for w, r in zip(wrong, dev))
    figures["teacher_no_scratchpad"] = sum(not has_scratchpad(t) for t in greedy_texts["teacher"]) / len(dev)
    figures["example_student_greedy"] = greedy_texts["student"][:3]
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in figures.items()}


# -----------------------------------------------------------------------------
# The arms. opsd.py's through its command line; sft-reference, sft-trace and grpo here, from opsd.py's parts.

TAU_GRID = (0.005, 0.05, 0.5)  # the tau sweep's decade grid, fixed in advance
# arm: (kind, settings). opsd: (--clip, --tau, --context-column); sft: the target column; grpo: none
ARMS = {
    "token": ("opsd", ("token", 0.05, "solution")),
    "none": ("opsd", ("none", 0.05, "solution")),  # tau only sets the diagnostic's threshold here
    "entry": ("opsd", ("entry", 0.05, "solution")),
    **{f"{clip}@{tau:g}": ("opsd", (clip, tau, "solution")) for clip in ("token", "entry") for tau in TAU_GRID
       if tau != 0.05},
    "sft-reference": ("sft", "reference_answer"),
    "sft-trace": ("sft", "trace"),
    "grpo": ("grpo", None),
    "wrong": ("opsd", ("none", 0.05, "wrong_solution")),
    "control": ("opsd", ("none", 0.05, "no_solution")),
}
OPSD_ARMS = [a for a, (kind, _) in ARMS.items() if kind == "opsd" and a not in ("wrong", "control")]
# the style-drift arms, on the drift model; "best": the clip's best tau in the reasoning miniature's sweep (best_tau)
DRIFT_ARMS = {
    "drift-token": ("opsd", ("token", 0.05, "solution")),
    "drift-none": ("opsd", ("none", 0.05, "solution")),
    "drift-entry": ("opsd", ("entry", 0.05, "solution")),
    "drift-entry@best": ("opsd", ("entry", "best", "solution")),
    "drift-skip1": ("opsd", ("none", 0.05, "solution", "--skip-first-tokens", "1")),  # the style's one position
    "drift-sft-trace": ("sft", "trace"),
    "drift-token@best": ("opsd", ("token", "best", "solution")),  # last: at tau 0.05 it repeats drift-token
}
DRIFT_OPSD_ARMS = [a for a, (kind, _) in DRIFT_ARMS.items() if kind == "opsd"]
# added after the drift arms' results were seen, outside the fixed protocol (tests/miniature/README.md part 4): the
# recommended clip with the first position left out, with drift (on the drift model) and without (the primary model)
TOKEN_SKIP1 = ("opsd", ("token", 0.05, "solution", "--skip-first-tokens", "1"))
ADDED_ARMS, ADDED_DRIFT_ARMS = {"token-skip1": TOKEN_SKIP1}, {"drift-token-skip1": TOKEN_SKIP1}
ON_DRIFT_MODEL = {**DRIFT_ARMS, **ADDED_DRIFT_ARMS}
ALL_ARMS = {**ARMS, **ON_DRIFT_MODEL, **ADDED_ARMS}
# the lr family of each arm (tests/miniature/README.md, "Learning rates"); a drift arm trains at its clip's family's lr
FAMILY = {arm: arm.split("@")[0] if arm not in ("wrong", "control") else "none" for arm in ARMS}
FAMILY.update({arm: {"drift-skip1": "none"}.get(arm, arm.removeprefix("drift-").split("@")[0]) for arm in DRIFT_ARMS})
FAMILY.update({"token-skip1": "token", "drift-token-skip1": "token"})
LR_GRID = (2e-3, 5e-3, 1.25e-2)
EXTEND_LIMIT = (LR_GRID[0] / 2.5 ** 2, LR_GRID[-1] * 2.5 ** 2)  # at most two grid points beyond either edge
# each family's lr as chosen on dev (selection.json in tests/miniature/selection); a family not yet chosen
# trains at PROVISIONAL_LR and results.json says so
CHOSEN_LR = {"token": 2e-3, "none": 2e-3, "entry": 3.2e-4, "sft-reference": 5e-3, "sft-trace": 2e-3, "grpo": 8e-4}
PROVISIONAL_LR = 5e-3
HEADLINE_ARMS = ("token", "none", "sft-reference", "sft-trace", "grpo")  # the default command's, seeds 1 and 2
DEFAULT_SEEDS = "1,2"
FIVE_SEED_ARMS = ("token", "none", "sft-reference", "sft-trace", "grpo")
QUICK_ARM, QUICK_STEPS = "none", 40

STEPS, WARMUP = 150, 10
LORA_R, LORA_ALPHA, COMPLETIONS_PER_STEP, MAX_GRAD_NORM, MAX_NEW_TOKENS = 16, 32, 64, 0.1, 48
GRPO_PROMPTS, GRPO_GROUP = 8, 8  # 8 prompts x 8 samples = COMPLETIONS_PER_STEP
OPSD_FLAGS = ["--device", "cpu", "--dtype", "float32", "--lora-r", str(LORA_R), "--lora-alpha", str(LORA_ALPHA),
              "--prompts-per-step", str(COMPLETIONS_PER_STEP), "--micro-batch-size", str(COMPLETIONS_PER_STEP),
              "--max-new-tokens", str(MAX_NEW_TOKENS), "--max-prompt-length", "256", "--no-gradient-checkpointing",
              "--max-grad-norm", str(MAX_GRAD_NORM), "--log-rollouts-every", "25",
              "--kl-window", "512"]
TIMING_FIELDS = ("time_sample", "time_train", "time_push", "tokens_per_second")
EVAL_N = 2


def warmup_for(steps):
    """WARMUP steps of linear warmup, fewer in a run too short for them (the tests' few-step runs)."""
    return min(WARMUP, steps // 4)


def optimizer_step(optimizer, lora_params, step, lr, steps):
    """One AdamW step as opsd.py takes it: the gradient-norm clip, opsd.py's LR schedule. Returns (grad norm, lr)."""
    grad_norm = torch.nn.utils.clip_grad_norm_(lora_params, MAX_GRAD_NORM).item()
    lr_now = opsd.lr_at(step, lr=lr, max_steps=steps, warmup_steps=warmup_for(steps))
    for group in optimizer.param_groups:
        group["lr"] = lr_now
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, lr_now


def lr_of(arm):
    return CHOSEN_LR.get(FAMILY[arm], PROVISIONAL_LR)


def opsd_has_student_prompt():
    """Whether this opsd.py has --student-prompt (the student in eval.py's prompt), which the opsd.py arms need."""
    import inspect

    return "--student-prompt" in inspect.getsource(opsd.parse_args)


def opsd_command(model_dir, train_file, arm, seed, steps, lr, out_dir, save_every=0):
    """opsd.py's command line for one arm and seed."""
    clip, tau, context, *extra = ALL_ARMS[arm][1]
    tau = best_tau(clip) if tau == "best" else tau
    return [sys.executable, str(ROOT / "opsd.py"), "--model", str(model_dir), "--dataset", str(train_file),
            "--clip", clip, "--tau", str(tau), "--context-column", context, "--max-steps", str(steps),
            "--lr", str(lr), "--seed", str(seed), "--save-every", str(save_every), "--output-dir", str(out_dir),
            "--warmup-steps", str(warmup_for(steps)), *OPSD_FLAGS, *STUDENT_FLAGS, *extra]


RESULTS = DATA / "results" / "results.json"  # the reasoning miniature's full run, committed


def best_tau(clip, results=RESULTS):
    """The clip's best tau in the reasoning miniature's sweep (rule fixed before that sweep was seen, tests/
    miniature.md part 3): the highest mean held-out primary score over seeds 1-3 among tau 0.005, 0.05, 0.5; a tie
    goes to 0.05, the default."""
    if not Path(results).is_file():
        raise SystemExit(f"the @best drift arms need the reasoning miniature's results ({results}): run --full first.")
    r = json.loads(Path(results).read_text())
    means = {}
    for tau in TAU_GRID:
        arm = clip if tau == 0.05 else f"{clip}@{tau:g}"
        scores = [v for seed, v in zip(r["seeds"][arm], r["heldout_avg"][arm]) if seed in (1, 2, 3)]
        means[tau] = sum(scores) / len(scores)
    best = max(means.values())
    return 0.05 if means[0.05] == best else max(t for t, m in means.items() if m == best)


# The tests set this: eval.py's main() and a GRPO training in their own process, where vLLM is imported already
# (7 s less an evaluation, 5 s less a GRPO run). A run of this script starts each as a process of its own, as a user
# does.
IN_PROCESS = False


def run_in_process(main_function, argv, log_path):
    """main_function(argv) in this process (IN_PROCESS), its output in log_path; the seconds it took."""
    t0 = time.perf_counter()
    with open(log_path, "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        main_function(argv)
    return time.perf_counter() - t0


def run_logged(cmd, log_path, env=None):
    """Run a command with its output in log_path; stop with the log's tail if it fails."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"), **(env or {})}
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    if proc.returncode != 0:
        tail = "".join(Path(log_path).read_text().splitlines(keepends=True)[-30:])
        raise SystemExit(f"{tail}\nthis command failed (exit {proc.returncode}), full log in {log_path}:\n"
                         + " ".join(map(str, cmd)))
    return time.perf_counter() - t0


def sft_target(row, column):
    if column == "reference_answer":  # the terse reference, then the boxed answer: what OPSD's teacher is shown
        return f"{row['solution']} \\boxed{{{row['answer']}}}"
    return row[column]


def load_student(model_dir, seed):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opsd.disable_dropout(model)
    lora_params = opsd.add_lora(model, LORA_R, LORA_ALPHA, seed=seed)
    model.train()
    return tok, model, lora_params


def train_sft(model_dir, train, column, seed, steps, lr, out_dir, save_every=0):
    """Supervised fine-tuning on sft_target(row, column) and EOS after the student's prompt: opsd.py's LoRA (rank,
    alpha, A seeded by `seed`), data order (step_indices, 64 prompts a step), AdamW, gradient clip and LR schedule
    (warmup, cosine), the loss a token mean over the step's target tokens. Writes checkpoint-<step>/ every
    `save_every` steps, final/ and metrics.jsonl (with the seconds of each step), as opsd.py does."""
    torch.manual_seed(seed)  # nothing here draws from it; fixed anyway
    tok, model, lora_params = load_student(model_dir, seed)
    prompts = [student_prompt(tok, r["problem"]) for r in train]
    targets = [answer_ids(tok, sft_target(r, column)) for r in train]
    optimizer = torch.optim.AdamW(lora_params, lr=lr, betas=(0.9, 0.999), weight_decay=0.0)  # opsd.py's
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "metrics.jsonl", "w") as log:
        for step in range(steps):
            t0 = time.perf_counter()
            indices = opsd.step_indices(step, COMPLETIONS_PER_STEP, len(prompts), seed)
            inputs, mask = opsd.build_batch([prompts[i] for i in indices], [targets[i] for i in indices],
                                            tok.pad_token_id, "cpu")
            logits = model(**inputs, use_cache=False).logits[:, :-1]  # (B, T - 1, V): position t predicts t + 1
            loss = torch.nn.functional.cross_entropy(logits[mask[:, 1:]].float(),
                                                     inputs["input_ids"][:, 1:][mask[:, 1:]])
            loss.backward()
            grad_norm, lr_now = optimizer_step(optimizer, lora_params, step, lr, steps)
            log.write(json.dumps({"step": step + 1, "loss": loss.item(), "lr": lr_now, "grad_norm": grad_norm,
                                  "time_train": time.perf_counter() - t0}) + "\n")
            if save_every and (step + 1) % save_every == 0 and step + 1 < steps:
                opsd.save_adapter(model, out_dir / f"checkpoint-{step + 1}", model_dir)
    opsd.save_adapter(model, out_dir / "final", model_dir)


def group_advantages(rewards, group):
    """GRPO's advantages: (r - mean of its group) / (std of its group + 1e-4), groups of `group` in order."""
    r = torch.tensor(rewards, dtype=torch.float64).view(-1, group)
    return ((r - r.mean(-1, keepdim=True)) / (r.std(-1, unbiased=False, keepdim=True) + 1e-4)).flatten()


def grpo_loss(model, prompts, completions, advantages, pad_id, temperature):
    """-sum over all completion tokens of advantage x log p(token) at the sampling temperature / their number."""
    inputs, mask = opsd.build_batch(prompts, completions, pad_id, "cpu")
    logits = model(**inputs, use_cache=False).logits[:, :-1][mask[:, 1:]].float() / temperature  # (N, V)
    targets = inputs["input_ids"][:, 1:][mask[:, 1:]]  # (N,) row after row, in order
    logp = torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]  # (N,)
    per_token = torch.repeat_interleave(advantages.float(), torch.tensor([len(c) for c in completions]))
    return -(per_token * logp).sum() / max(len(targets), 1)


def grpo_args(model_dir, train_file, seed, steps, lr):
    """opsd.py's parsed settings for the engine and the sampler (its defaults: temperature 1.1, top-p 0.95,
    top-k 20), with the miniature's flags."""
    return opsd.parse_args(["--model", str(model_dir), "--dataset", str(train_file), "--seed", str(seed),
                            "--max-steps", str(steps), "--lr", str(lr), "--warmup-steps", str(warmup_for(steps)),
                            *OPSD_FLAGS])


def train_grpo(model_dir, train_file, seed, steps, lr, out_dir, save_every=0):
    """GRPO from opsd.py's parts: its LoRA (seeded init), vLLM engine, seeded sampling, checked weight push and LR
    schedule. Each step: GRPO_PROMPTS prompts of opsd.py's data order (step_indices), GRPO_GROUP samples each
    (one seed per request, as opsd.py draws them), reward 1 when the last boxed answer equals the reference's,
    one on-policy update of grpo_loss. Writes metrics.jsonl (reward, sampled tokens, seconds), checkpoints every
    `save_every` steps and final/."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    args = grpo_args(model_dir, train_file, seed, steps, lr)
    rows = [json.loads(line) for line in Path(train_file).read_text().splitlines()]
    tok, model, lora_params = load_student(model_dir, seed)
    prompts = [student_prompt(tok, r["problem"]) for r in rows]
    optimizer = torch.optim.AdamW(lora_params, lr=lr, betas=(0.9, 0.999), weight_decay=0.0)
    llm = opsd.start_engine(args, torch.device("cpu"))
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "metrics.jsonl", "w") as log:
        for step in range(steps):
            t0 = time.perf_counter()
            indices = [i for i in opsd.step_indices(step, GRPO_PROMPTS, len(prompts), seed) for _ in range(GRPO_GROUP)]
            seeds = [(seed * 1_000_003 + step * COMPLETIONS_PER_STEP + j) % 2**31 for j in range(len(indices))]
            batch = [prompts[i] for i in indices]
            completions, _ = opsd.sample(llm, batch, seeds, args)
            rewards = [float(evaluation.extract_boxed(tok.decode(c, skip_special_tokens=True)) == rows[i]["answer"])
                       for c, i in zip(completions, indices)]
            t1 = time.perf_counter()
            loss = grpo_loss(model, batch, completions, group_advantages(rewards, GRPO_GROUP), tok.pad_token_id,
                             args.temperature)
            loss.backward()
            grad_norm, lr_now = optimizer_step(optimizer, lora_params, step, lr, steps)
            t2 = time.perf_counter()
            opsd.push_weights(llm, model)
            opsd.check_push(llm, model)  # a Refusal if the engine does not hold what was sent
            time_push = time.perf_counter() - t2
            tokens = sum(map(len, completions))
            log.write(json.dumps({"step": step + 1, "loss": loss.item(), "reward_mean": sum(rewards) / len(rewards),
                                  "lr": lr_now, "grad_norm": grad_norm, "completion_len_mean": tokens / len(batch),
                                  "sampled_tokens": tokens, "time_sample": t1 - t0, "time_train": t2 - t1,
                                  "time_push": time_push}) + "\n")
            log.flush()
            if save_every and (step + 1) % save_every == 0 and step + 1 < steps:
                opsd.save_adapter(model, out_dir / f"checkpoint-{step + 1}", model_dir)
    opsd.save_adapter(model, out_dir / "final", model_dir)
    opsd.stop_engine(llm)


def train_arm(model_dir, files, train, arm, seed, steps, lr, out_dir, resume, save_every=0):
    """Train one arm and seed into out_dir; returns (final adapter, seconds or None when kept from before). A
    resumed opsd.py run continues from its last checkpoint; an unfinished SFT or GRPO run starts over."""
    if resume and (out_dir / "final").is_dir():
        return out_dir / "final", None
    kind, setting = ALL_ARMS[arm]
    t0 = time.perf_counter()
    if kind == "sft":
        shutil.rmtree(out_dir, ignore_errors=True)
        train_sft(model_dir, train, setting, seed, steps, lr, out_dir, save_every)
    elif kind == "grpo":  # its own process (IN_PROCESS aside): its vLLM engine apart from the dev scorer's
        shutil.rmtree(out_dir, ignore_errors=True)
        out_dir.mkdir(parents=True)
        job = {"model_dir": str(model_dir), "train_file": str(files["train"]), "seed": seed, "steps": steps,
               "lr": lr, "out_dir": str(out_dir), "save_every": save_every}
        argv = ["--grpo-job", json.dumps(job)]
        if IN_PROCESS:
            run_in_process(main, argv, log_path(out_dir))
        else:
            run_logged([sys.executable, str(Path(__file__).resolve()), *argv], log_path(out_dir))
    else:
        if not opsd_has_student_prompt():
            raise SystemExit("this opsd.py has no --student-prompt: the opsd.py arms train the student in eval.py's "
                             "prompt (opsd.py --student-prompt eval --no-student-thinking).")
        cmd = opsd_command(model_dir, files["train"], arm, seed, steps, lr, out_dir, save_every)
        resumable = resume and opsd.latest_checkpoint(out_dir) is not None
        run_logged(cmd + ["--resume" if resumable else "--overwrite"],
                   log_path(out_dir, "resumed" if resumable else ""))
    return out_dir / "final", time.perf_counter() - t0


def log_path(run, tag=""):
    """<run>.log next to the run's directory (<run>.<tag>.log for a resumed piece); not with_suffix: "@0.5"."""
    return run.parent / f"{run.name}{'.' + tag if tag else ''}.log"


def run_name(model_tag, arm, seed, lr=None):
    slug = arm.replace("@", "-tau")
    return f"{model_tag}-{slug}" + (f"-lr{lr:g}" if lr is not None else "") + f"-s{seed}"


def read_metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


# -----------------------------------------------------------------------------
# Scoring. The reported scores: eval.py itself. Dev curves and the lr selection: one vLLM engine in this process
# serving every checkpoint as a LoRA adapter, with eval.py's prompt, sampling settings, per-sample seeds and grading.


def evaluate(model_dir, data_file, n, out_dir, adapter=None, thinking=False):
    """eval.py's avg@n on one split (thinking off: the student's training prompt; on: the transfer prompt), the
    samples' answers without a scratchpad, and the seconds it took (None when its summary was there already: then
    eval.py only reads its samples back). An interrupted evaluation continues where it stopped."""
    finished = (out_dir / "summary.json").is_file()
    argv = ["--model", str(model_dir), "--data", f"split={data_file}", "--n", str(n), "--max-new-tokens",
            str(MAX_NEW_TOKENS), "--dtype", "float32", "--enforce-eager", "--output-dir", str(out_dir),
            "--thinking" if thinking else "--no-thinking"]
    argv += ["--adapter", str(adapter)] if adapter else []
    out_dir.mkdir(parents=True, exist_ok=True)
    log = log_path(out_dir, "resumed" if finished else "")
    if IN_PROCESS:
        seconds = run_in_process(evaluation.main, argv, log)
    else:
        seconds = run_logged([sys.executable, str(ROOT / "eval.py"), *argv], log)
    avg = json.loads((out_dir / "summary.json").read_text())["metrics"]["split"][f"avg@{n}"]
    samples = [json.loads(line) for line in (out_dir / "samples.jsonl").read_text().splitlines() if line.strip()]
    no_pad = sum(not has_scratchpad(s["completion"]) for s in samples) / len(samples)
    return {"avg": avg, "stderr": problem_stderr(samples, avg), "no_scratchpad": no_pad,
            "tokens_mean": sum(s["tokens"] for s in samples) / len(samples), "seconds": None if finished else seconds}


def problem_stderr(samples, avg):
    per_problem = {}
    for s in samples:
        per_problem.setdefault(s["problem"], []).append(s["correct"])
    means = [sum(c) / len(c) for c in per_problem.values()]
    return (sum((m - avg) ** 2 for m in means) / max(len(means) - 1, 1) / len(means)) ** 0.5


class DevScorer:
    """avg@n of the base model or an adapter on a split, from one vLLM engine kept for the whole run."""

    def __init__(self, model_dir):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        from transformers import AutoTokenizer
        from vllm import LLM

        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.llm = LLM(model=str(model_dir), dtype="float32", enforce_eager=True, seed=0, max_model_len=512,
                       enable_lora=True, max_lora_rank=LORA_R, max_loras=1, enable_chunked_prefill=False,
                       max_num_batched_tokens=8192, max_num_seqs=256)
        self.adapters = 0

    def score(self, rows, adapter=None, n=EVAL_N, thinking=False, seed=42, name="split"):
        """avg@n as eval.py --data NAME=... scores it, sample for sample (its seeds come from `name`)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.lora.request import LoRARequest

        lora = None
        if adapter is not None:
            self.adapters += 1  # a fresh id per adapter: vLLM caches adapters by id
            lora = LoRARequest(f"adapter-{self.adapters}", self.adapters, str(Path(adapter).resolve()))
        keys = [(i, j) for i in range(len(rows)) for j in range(n)]
        prompts = [TokensPrompt(prompt_token_ids=evaluation.prompt_ids(self.tok, rows[i]["problem"], thinking))
                   for i, _ in keys]
        params = [SamplingParams(temperature=1.0, top_p=0.95, max_tokens=MAX_NEW_TOKENS,
                                 seed=evaluation.sample_seed(seed, name, i, j)) for i, j in keys]
        outputs = self.llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
        texts = [o.outputs[0].text for o in outputs]
        correct = [evaluation.is_correct(t, rows[i]["answer"]) for t, (i, _) in zip(texts, keys)]
        return {"avg": sum(correct) / len(keys), "no_scratchpad": sum(not has_scratchpad(t) for t in texts) / len(keys),
                "tokens_mean": sum(len(o.outputs[0].token_ids) for o in outputs) / len(keys)}


def curve(scorer, dev, run, steps, every, base_score):
    """[[step, sampled tokens so far, seconds so far, dev avg, no-scratchpad share, mean answer tokens]] from step 0
    (the base model) to `steps`, one point every `every` steps, from a run's checkpoints and metrics.jsonl."""
    records = {r["step"]: r for r in read_metrics(run)}
    points = [[0, 0, 0.0, base_score["avg"], base_score["no_scratchpad"], base_score["tokens_mean"]]]
    tokens = seconds = 0.0
    for step in range(1, steps + 1):
        r = records[step]
        tokens += r.get("sampled_tokens", r.get("completion_len_mean", 0) * COMPLETIONS_PER_STEP)
        seconds += sum(r.get(k, 0.0) for k in ("time_sample", "time_train", "time_push"))
        if step % every == 0 or step == steps:
            adapter = run / ("final" if step == steps else f"checkpoint-{step}")
            s = scorer.score(dev, adapter)
            points.append([step, round(tokens), round(seconds, 1), s["avg"], s["no_scratchpad"], s["tokens_mean"]])
    return points


# -----------------------------------------------------------------------------
# The README's quickstart: its commands as written, timed, then the same training with a checkpoint every
# QUICKSTART_EVERY steps, each scored on the held-out problems as its eval.py command scores (same seeds)

README = ROOT / "README.md"
QUICKSTART_RECORD, QUICKSTART_EVERY = DATA / "quickstart", 5


def quickstart_commands(readme=README):
    """The commands of the README's quickstart block, continuation lines joined, in order."""
    section = Path(readme).read_text().split("\n## Quickstart", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [" ".join(line.split()) for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def in_dir(command, out):
    """A quickstart command writing under `out` instead of runs/, as argv."""
    return [str(out / a.removeprefix("runs/")) if a.startswith("runs/") else a for a in shlex.split(command)]


def quickstart(out, overwrite=False):
    """Run the quickstart as written into `out` (timed, alone), then its curve; write quickstart.json and the figure."""
    if (out / "quickstart.json").exists() and not overwrite:
        raise SystemExit(f"{out} already holds a quickstart record: pass --overwrite or choose another --output-dir.")
    out.mkdir(parents=True, exist_ok=True)
    commands, seconds = quickstart_commands(), []
    for i, command in enumerate(commands):
        seconds.append(round(run_logged(in_dir(command, out), out / f"command-{i + 1}.log"), 1))
    train, base_eval, trained_eval = (in_dir(c, out) for c in commands)
    run = Path(train[train.index("--output-dir") + 1])
    summary = lambda argv: json.loads((Path(argv[argv.index("--output-dir") + 1]) / "summary.json").read_text())  # noqa: E731
    heldout = [json.loads(line) for line in (ROOT / base_eval[base_eval.index("--data") + 1].split("=", 1)[1])
               .read_text().splitlines()]
    curve_run = out / "curve-run"
    run_logged([*train[:train.index("--output-dir")], "--output-dir", str(curve_run), "--save-every",
                str(QUICKSTART_EVERY), *train[train.index("--output-dir") + 2:]], out / "curve-run.log")
    scorer, steps = DevScorer(ROOT / train[train.index("--model") + 1]), len(read_metrics(curve_run))
    points = [[0, scorer.score(heldout, n=1, name="heldout")["avg"]]]
    for step in range(QUICKSTART_EVERY, steps + 1, QUICKSTART_EVERY):
        adapter = curve_run / ("final" if step == steps else f"checkpoint-{step}")
        points.append([step, scorer.score(heldout, adapter, n=1, name="heldout")["avg"]])
    record = {"commands": commands, "seconds": seconds, "seconds_total": round(sum(seconds), 1),
              "machine": this_machine(), "heldout_base": summary(base_eval)["metrics"]["heldout"]["avg@1"],
              "heldout_trained": summary(trained_eval)["metrics"]["heldout"]["avg@1"],
              "kl_mean": [[r["step"], r["kl_mean"]] for r in read_metrics(run)],
              "curve_every": QUICKSTART_EVERY, "curve_heldout": points}
    write_quickstart_record(out, record, run, base_eval, trained_eval, curve_run)
    print(f"held-out {100 * record['heldout_base']:.1f} -> {100 * record['heldout_trained']:.1f}; the three commands "
          f"{record['seconds_total']:.0f} s ({', '.join(f'{x:.0f}' for x in seconds)}) -> {out / 'quickstart.json'}")
    return record


def write_quickstart_record(out, record, run, base_eval, trained_eval, curve_run):
    """out/record/: what tests/miniature/quickstart/ commits: quickstart.json, the figure, the step lines, both runs'
    metrics and the two scorings' samples."""
    dest = out / "record"
    dest.mkdir(exist_ok=True)
    (dest / "quickstart.json").write_text(json.dumps(record, indent=2) + "\n")
    plot_quickstart(record, dest / "quickstart.png")
    lines = [line for line in (out / "command-1.log").read_text().splitlines() if line.startswith("step ")]
    (dest / "step-lines.txt").write_text("\n".join(lines) + "\n")
    shutil.copy(run / "metrics.jsonl", dest / "metrics.jsonl")
    shutil.copy(curve_run / "metrics.jsonl", dest / "curve-run-metrics.jsonl")
    for name, argv in (("base", base_eval), ("trained", trained_eval)):
        shutil.copy(Path(argv[argv.index("--output-dir") + 1]) / "samples.jsonl", dest / f"{name}-samples.jsonl")


def plot_quickstart(record, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, acc = plt.subplots(figsize=(7, 3.6))
    steps, scores = zip(*record["curve_heldout"])
    acc.plot(steps, [100 * v for v in scores], marker="o", color="tab:blue")
    acc.set_xlabel("optimizer step")
    acc.set_ylabel("held-out accuracy, avg@1 (%)", color="tab:blue")
    acc.set_ylim(0, 105)
    kl = acc.twinx()
    kl.plot(*zip(*record["kl_mean"]), color="tab:red", linewidth=1.2)
    kl.set_yscale("log")
    kl.set_ylabel("kl_mean of the step (log scale)", color="tab:red")
    acc.set_title("quickstart: 400 held-out 3-digit sums; the teacher, shown the sum, corrects the carries", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -----------------------------------------------------------------------------
# Statistics

T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}  # Student t


def mean_interval(values):
    """(mean, half-width of the 95% t-interval over the values; None with one value)."""
    k, mean = len(values), sum(values) / len(values)
    if k < 2:
        return mean, None
    sem = (sum((v - mean) ** 2 for v in values) / (k - 1) / k) ** 0.5
    return mean, T_975.get(k - 1, 1.96) * sem


def summarize(values, base, base_stderr):
    """Mean over seeds, the half-width of its 95% interval, and the difference to the base model with the
    half-width of its interval (the seeds' and the base score's errors combined)."""
    mean, half = mean_interval(values)
    return {"mean": mean, "ci95": half, "vs_base": mean - base,
            "vs_base_ci95": None if half is None else (half ** 2 + (1.96 * base_stderr) ** 2) ** 0.5}


def paired(a_scores, b_scores, a_seeds, b_seeds):
    """The paired difference a - b over the seeds both ran: per seed, mean, 95% t-interval."""
    common = [s for s in a_seeds if s in b_seeds]
    diffs = [a_scores[a_seeds.index(s)] - b_scores[b_seeds.index(s)] for s in common]
    if not diffs:
        return None
    mean, half = mean_interval(diffs)
    return {"seeds": common, "differences": diffs, "mean": mean, "ci95": half}


def token_efficiency(curves, a, b):
    """Sampled tokens (and seconds) arms a and b each need to first reach the lower of their final dev accuracies,
    by linear interpolation between checkpoints; and the ratio b / a."""
    if a not in curves or b not in curves:
        return None
    target = min(curves[a][-1][3], curves[b][-1][3])

    def reach(points):
        for (s0, t0, w0, acc0, *_), (s1, t1, w1, acc1, *_) in zip(points, points[1:]):
            if acc1 >= target > acc0 or (acc0 >= target and s0 == 0):
                f = 1.0 if acc1 == acc0 else (target - acc0) / (acc1 - acc0)
                return t0 + f * (t1 - t0), w0 + f * (w1 - w0)
        return None, None

    (ta, wa), (tb, wb) = reach(curves[a]), reach(curves[b])
    return {"arms": [a, b], "target_dev_avg": target, "tokens": [ta, tb], "seconds": [wa, wb],
            "token_ratio": tb / ta if ta and tb else None, "seconds_ratio": wb / wa if wa and wb else None}


def format_table(results, key="heldout_avg", title="held-out, in the training format"):
    scores, stats = results[key], results["stats"][key]
    w = max(14, *(len(arm) + 1 for arm in results["arms"]))
    what = "share of eval.py's samples" if key == "no_scratchpad" else f"eval.py avg@{results['n']}"
    lines = [f"{title}: {what} in % ({results['problems']} problems); 95% intervals over seeds",
             f"{'arm':<{w}}{'seeds':>6}{'mean':>7}{'95% interval':>15}{'vs base':>17}   per seed",
             f"{'base':<{w}}{'':>6}{100 * scores['base']:>7.1f}"]
    for arm in results["arms"]:
        s = stats[arm]
        interval = "-" if s["ci95"] is None else \
            f"{100 * (s['mean'] - s['ci95']):.1f}..{100 * (s['mean'] + s['ci95']):.1f}"
        diff = f"{100 * s['vs_base']:+.1f}"
        diff += "" if s["vs_base_ci95"] is None else f" +- {100 * s['vs_base_ci95']:.1f}"
        per_seed = "  ".join(f"{100 * v:.1f}" for v in scores[arm])
        lines.append(f"{arm:<{w}}{len(scores[arm]):>6}{100 * s['mean']:>7.1f}{interval:>15}{diff:>17}   {per_seed}")
    return "\n".join(lines)


# -----------------------------------------------------------------------------
# Figures

COLORS = {"token": "tab:blue", "none": "tab:green", "entry": "tab:orange", "token@0.005": "tab:cyan",
          "token@0.5": "navy", "entry@0.005": "gold", "entry@0.5": "tab:olive", "sft-reference": "tab:red",
          "sft-trace": "tab:purple", "grpo": "black", "wrong": "tab:brown", "control": "tab:gray"}
COLORS.update({"drift-token": "tab:blue", "drift-none": "tab:green", "drift-entry": "tab:orange",
               "drift-token@best": "navy", "drift-entry@best": "tab:olive", "drift-skip1": "tab:pink",
               "drift-sft-trace": "tab:purple", "token-skip1": "tab:pink", "drift-token-skip1": "tab:pink"})


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms, primary, transfer = results["arms"], results["heldout_avg"], results["transfer_avg"]
    fig, axes = plt.subplots(1, 4, figsize=(22, 4.8))
    left = axes[0]
    left.axhline(100 * primary["base"], color="black", linestyle="--", label="base, training format")
    left.axhline(100 * transfer["base"], color="gray", linestyle=":", label="base, transfer")
    for x, arm in enumerate(arms):
        values = [100 * v for v in primary[arm]]
        left.bar(x, sum(values) / len(values), color=COLORS[arm], alpha=0.5)
        left.scatter([x] * len(values), values, color=COLORS[arm], zorder=3, s=12)
        moved = [100 * v for v in transfer[arm]]
        left.scatter([x + 0.25] * len(moved), moved, color=COLORS[arm], marker="x", zorder=3, s=14)
    left.set_xticks(range(len(arms)), arms, rotation=40, ha="right", rotation_mode="anchor")
    left.set_ylabel(f"held-out avg@{results['n']} (%)")
    seeds = "one seed" if all(len(primary[a]) == 1 for a in arms) else "bars: mean of the seeds"
    left.set_title(f"held-out ({seeds}; x: transfer)", fontsize=10)
    left.set_ylim(0, 105)
    left.legend(loc="lower right", fontsize=8)
    for ax, column, label in ((axes[1], 1, "sampled completion tokens"),
                              (axes[2], 2, "seconds (sample + train + push)")):
        for arm, points in results.get("dev_curves", {}).items():
            ax.plot([p[column] for p in points], [100 * p[3] for p in points], marker="o", ms=3,
                    color=COLORS.get(arm.split(" ")[0], "k"), label=arm)
        ax.set_xlabel(label)
        ax.set_ylabel(f"dev avg@{EVAL_N}, training format (%)")
        ax.set_title("token efficiency (seed 1)" if column == 1 else "wall-clock (2 CPU cores)")
        if ax.lines:
            ax.legend(fontsize=8)
    profile, ax = results.get("step1_kl"), axes[3]
    if profile:  # the step-1 KL profile of the shipped model (step1_kl.json)
        edges = profile["histogram_edges"]
        labels = [f"<{edges[1]:g}"] + [f"{lo:g}-{hi:g}" for lo, hi in zip(edges[1:-2], edges[2:-1])] + \
            [f">{edges[-2]:g}"]
        ax.bar(range(len(profile["histogram_counts"])), profile["histogram_counts"], color="tab:blue")
        ax.set_xticks(range(len(labels)), labels, rotation=40, ha="right", rotation_mode="anchor", fontsize=8)
        ax.set_xlabel("per-position KL(T||S) at step 1 (loss temperature 1.1)")
        ax.set_ylabel("answer positions")
        ax.set_title(f"step 1: kl_mean {profile['kl_mean']:.3f}, {100 * profile['frac_above_tau']:.1f}% above "
                     f"{profile['tau']:g}\n(Qwen3-1.7B recipe: 0.10-0.19, 35-50%)", fontsize=9)
    else:
        ax.set_axis_off()
    if results.get("quick"):
        fig.suptitle("quick variant (--quick): one seed, a short run; not the experiment")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_drift(results, path):
    """What drift does over training (seed 1 of each drift arm, dev, every 25 steps): in-format accuracy, mean
    answer length, the share of answers without a scratchpad."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
    panels = ((axes[0], 3, f"dev avg@{EVAL_N}, training format (%)"), (axes[1], 5, "mean answer length (tokens)"),
              (axes[2], 4, "answers without a scratchpad (%)"))
    for ax, column, label in panels:
        for arm, points in results["dev_curves"].items():
            scale = 1 if column == 5 else 100
            dashed = arm in ("drift-token@best", "drift-sft-trace")  # each can lie on another arm's line
            ax.plot([p[0] for p in points], [scale * p[column] for p in points], marker="o", ms=3,
                    color=COLORS.get(arm, "k"), label=arm, linestyle="--" if dashed else "-", lw=2.5 if dashed else 1.5)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(label)
    axes[0].legend(fontsize=8)
    fig.suptitle("style drift: the teacher shown the reference answers in its style part of the time (seed 1, dev)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -----------------------------------------------------------------------------
# The port-check fixture and the step-1 KL profile: step-1 rollouts of the shipped model, as opsd.py computes them

REFERENCE_SEED, REFERENCE_TEMPERATURE, REFERENCE_TAU, REFERENCE_BETA = 1, 1.1, 0.05, 0.0


def stat(stats, name):
    """One per-position diagnostic of opsd_loss, (N,): an attribute of its PositionStats."""
    return getattr(stats, name)


def model_digest(model_dir):
    return hashlib.sha256((Path(model_dir) / "model.safetensors").read_bytes()).hexdigest()[:16]


@torch.no_grad()
def step_figures(model_dir, rows, *, temperature, tau, beta, per_position=False):
    """{clip: {loss, kl_mean, kl_clipped_teacher_mass}} of one optimizer step over `rows` from the unchanged
    model (LoRA B = 0, so student and teacher are both the base model), through opsd.py's functions: loss is the
    sum of the clipped per-position divergence over all completion positions divided by their number; kl_mean and
    kl_clipped_teacher_mass are the means over the same positions of opsd.py's diagnostics. per_position: also the
    (N,) per-position KL."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    completions = [r["completion_ids"] for r in rows]
    s_inputs, s_mask = opsd.build_batch([r["student_prompt_ids"] for r in rows], completions, tok.pad_token_id, "cpu")
    t_inputs, t_mask = opsd.build_batch([r["teacher_prompt_ids"] for r in rows], completions, tok.pad_token_id, "cpu")
    hs, ht = opsd.final_hidden(model, s_inputs), opsd.final_hidden(model, t_inputs)
    targets = s_inputs["input_ids"][:, 1:][s_mask[:, 1:]]  # (N,) the completion tokens
    positions = sum(map(len, completions))
    figures = {}
    for clip in ("token", "entry", "none"):
        loss, stats = opsd.opsd_loss(hs[:, :-1], s_mask[:, 1:], ht[:, :-1], t_mask[:, 1:],
                                     model.get_output_embeddings().weight, positions, targets, beta=beta,
                                     temperature=temperature, clip=clip, tau=tau)
        figures[clip] = {"loss": loss.item(), "kl_mean": stat(stats, "kl").mean().item(),
                         "kl_clipped_teacher_mass": stat(stats, "clipped_mass").mean().item()}
    return (figures, stat(stats, "kl")) if per_position else figures


def kl_profile(kl, lengths, tau):
    """The step-1 KL profile: mean, the share above tau, the first answer position's mean, a histogram (log bins)."""
    first = torch.tensor([0] + list(lengths[:-1])).cumsum(0)
    edges = [-float("inf"), 1e-4, 1e-3, 1e-2, 0.05, 0.1, 0.5, 1.0, 2.0, float("inf")]  # float32 KL can be -1e-8
    counts = [int(((kl >= lo) & (kl < hi)).sum()) for lo, hi in zip(edges, edges[1:])]
    return {"positions": len(kl), "kl_mean": kl.mean().item(), "frac_above_tau": (kl > tau).float().mean().item(),
            "tau": tau, "first_position_kl_mean": kl[first].mean().item(),
            "rest_kl_mean": kl[torch.ones(len(kl), dtype=torch.bool).index_fill_(0, first, False)].mean().item(),
            "histogram_edges": ["-inf"] + edges[1:-1] + ["inf"], "histogram_counts": counts,
            "released_recipe_qwen3_1.7b": {"kl_mean": [0.10, 0.19], "frac_above_0.05": [0.35, 0.50]}}


def repo_path(path):
    """How a record names a file: relative to the repository's root when inside it (tests/miniature/model), so the
    record holds on any checkout; as given otherwise (a model elsewhere on the machine that ran it)."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def write_step1_profile(reference=DATA / "reference_step.json", model_dir=SHIPPED_MODEL):
    """step1_kl.json from the fixture's rows (the step-1 rollouts), without sampling them again."""
    from transformers import AutoTokenizer

    ref = json.loads(Path(reference).read_text())
    rows = ref["rows"]
    _, kl = step_figures(model_dir, rows, **ref["settings"], per_position=True)
    profile = kl_profile(kl, [len(r["completion_ids"]) for r in rows], ref["settings"]["tau"])
    tok, train = AutoTokenizer.from_pretrained(model_dir), make_task()[0]
    answers = {tuple(student_prompt(tok, r["problem"])): r["answer"] for r in train}
    right = [evaluation.extract_boxed(tok.decode(r["completion_ids"], skip_special_tokens=True))
             == answers[tuple(r["student_prompt_ids"])] for r in rows]
    profile["rollouts_correct"] = sum(right) / len(rows)
    (Path(reference).parent / "step1_kl.json").write_text(json.dumps(profile, indent=1) + "\n")
    return profile


def write_reference_step(path, model_dir=SHIPPED_MODEL, seed=REFERENCE_SEED):
    """Sample one step's rollouts from the model the way opsd.py's first step does (its data order, engine settings
    and per-request seeds for --seed `seed`), compute their figures, write the fixture, and the step-1 KL profile
    (step1_kl.json beside it)."""
    from transformers import AutoTokenizer

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    train = make_task()[0]
    tok = AutoTokenizer.from_pretrained(model_dir)
    args = opsd.parse_args(["--model", str(model_dir), "--dataset", "unused", "--seed", str(seed),
                            "--loss-temperature", str(REFERENCE_TEMPERATURE), *OPSD_FLAGS])
    prompts = [(student_prompt(tok, r["problem"]), teacher_prompt(tok, r["problem"], r["solution"])) for r in train]
    indices = opsd.step_indices(0, COMPLETIONS_PER_STEP, len(prompts), seed)
    sampling_seeds = [(seed * 1_000_003 + j) % 2**31 for j in range(COMPLETIONS_PER_STEP)]  # opsd.py's, step 0
    llm = opsd.start_engine(args, torch.device("cpu"))
    completions, _ = opsd.sample(llm, [prompts[i][0] for i in indices], sampling_seeds, args)
    opsd.stop_engine(llm)
    rows = [{"student_prompt_ids": prompts[i][0], "teacher_prompt_ids": prompts[i][1], "completion_ids": c}
            for i, c in zip(indices, completions)]
    settings = {"temperature": REFERENCE_TEMPERATURE, "tau": REFERENCE_TAU, "beta": REFERENCE_BETA}
    expected = step_figures(model_dir, rows, **settings)
    header = {
        "about": f"Step-1 rollouts of the miniature model {Path(model_dir).name} (opsd.py --seed 1 --student-prompt "
                 "eval --no-student-thinking with tests/miniature/miniature.py's settings) and the figures opsd.py computes for "
                 "them with LoRA B = 0 (student and teacher both the unchanged model, float32). loss: sum over "
                 "completion positions of the clipped per-position divergence / number of positions. kl_mean: mean "
                 "over the positions of KL(p_T || p_S) at the loss temperature. kl_clipped_teacher_mass: mean over the"
                 " positions of the teacher's probability on entries with p_T(v) (log p_T(v) - log p_S(v)) > tau. A "
                 "position predicts a completion token from the prompt and the completion tokens before it, at "
                 "positions 0, 1, 2, ... from the prompt's first token.",
        "model": repo_path(model_dir),
        "model_sha256_16": model_digest(model_dir), "positions": sum(map(len, completions)),
        "settings": settings, "expected": expected}
    # one row per line: the file stays readable and diffs stay small
    text = json.dumps(header, indent=1)[:-2] + ',\n "rows": [\n' + ",\n".join(json.dumps(r) for r in rows) + "\n ]\n}\n"
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text)
    profile = write_step1_profile(path, model_dir)
    print(json.dumps(expected, indent=1), json.dumps(profile, indent=1))
    print(f"{len(rows)} rows, {header['positions']} positions -> {path}")


# -----------------------------------------------------------------------------
# Config


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="miniature.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--output-dir", help="results.json, the figure and one directory per run")
    p.add_argument("--arms", default=None, help=f"comma-separated, of {', '.join(ARMS)} (default: "
                                                f"{','.join(HEADLINE_ARMS)}; --quick: {QUICK_ARM})")
    p.add_argument("--seeds", default=None,
                   help="comma-separated training seeds every chosen arm runs (default 1,2; --quick, --select: 1)")
    p.add_argument("--quick", action="store_true",
                   help=f"the test suite's check: {QUICK_ARM}, seed 1, {QUICK_STEPS} steps, held-out avg@1")
    p.add_argument("--full", action="store_true", help="the whole protocol of tests/miniature/README.md (resumable)")
    p.add_argument("--drift", action="store_true",
                   help="the style-drift arms on the drift model, seeds 1-3 (--arms, --seeds select among them); with "
                        "--reference-step: the drift model's step-1 rollouts")
    p.add_argument("--select", action="store_true",
                   help="dev lr selection: each arm at each --lrs, a dev score every --curve-every steps")
    p.add_argument("--lrs", default=",".join(f"{lr:g}" for lr in LR_GRID), help="with --select: the lr grid")
    p.add_argument("--steps", type=int, default=None, help=f"optimizer steps of every arm (default {STEPS})")
    p.add_argument("--curve-every", type=int, default=25, help="steps between dev-scored checkpoints")
    p.add_argument("--n", type=int, default=None, help=f"eval.py samples per problem (default {EVAL_N}; --quick 1)")
    p.add_argument("--start-model", type=int, default=PRETRAIN_SEEDS[0], choices=PRETRAIN_SEEDS,
                   help="the shipped starting model (pre-training seed) every arm runs on, but in --full")
    p.add_argument("--pretrain", action="store_true",
                   help="pre-train a starting model from scratch into --output-dir, report its acceptance, stop")
    p.add_argument("--pretrain-seed", type=int, default=1, help="with --pretrain: init and batches")
    p.add_argument("--teacher-terse", type=float, default=0.0,
                   help="with --pretrain: the share of teacher-format examples answered with the boxed answer alone "
                        "(the reference's style; the style-drift model of issue 25)")
    p.add_argument("--overwrite", action="store_true", help="clear this script's files in --output-dir first")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --output-dir with the same flags (finished pieces are kept)")
    p.add_argument("--reference-step", metavar="PATH", default=None,
                   help="write the port-check fixture (step-1 rollouts of the shipped model and their loss) and stop")
    p.add_argument("--quickstart", action="store_true",
                   help="run the README's quickstart as written, timed, and its held-out curve; write its record")
    p.add_argument("--grpo-job", default=None, help=argparse.SUPPRESS)  # one GRPO training, in its own process
    args = p.parse_args(argv)
    if args.reference_step or args.grpo_job:
        return args
    if args.quickstart and not args.output_dir:
        p.error("--quickstart needs --output-dir.")
    if args.quickstart:
        return args
    arms = [a.strip() for a in args.arms.split(",")] if args.arms else []
    if arms and all(a in ON_DRIFT_MODEL for a in arms):
        args.drift = True  # drift arms run on the drift model
    elif args.drift and arms:
        p.error(f"--drift runs the drift arms ({', '.join(ON_DRIFT_MODEL)}) on the drift model; got {args.arms!r}.")
    elif any(a in ON_DRIFT_MODEL for a in arms):
        p.error("--arms mixes drift arms (on the drift model) with the others: run them apart.")
    if not args.output_dir:
        p.error("--output-dir is required.")
    if args.resume and args.overwrite:
        p.error("--resume continues the run in --output-dir, --overwrite clears it: pass one.")
    if sum((args.quick, args.full, args.select, args.pretrain, args.drift)) > 1:
        p.error("--quick, --full, --select, --pretrain and --drift are separate runs: pass one.")
    if args.full and (args.arms or args.seeds):
        p.error("--full chooses every arm and its seeds: leave out --arms and --seeds.")
    if not 0 <= args.teacher_terse < 1:
        p.error("--teacher-terse must lie in [0, 1).")
    if args.pretrain:
        return args
    default_seeds = "1" if args.quick or args.select else "1,2,3" if args.drift else DEFAULT_SEEDS
    seeds = [s.strip() for s in (args.seeds or default_seeds).split(",")]
    if not all(s.isdigit() for s in seeds) or len(set(seeds)) != len(seeds):
        p.error(f"--seeds takes distinct non-negative integers separated by commas, got {args.seeds!r}.")
    default_arms = QUICK_ARM if args.quick else ",".join(DRIFT_ARMS if args.drift else HEADLINE_ARMS)
    arms = [a.strip() for a in (args.arms or default_arms).split(",")]
    if any(a not in ALL_ARMS for a in arms) or len(set(arms)) != len(arms):
        p.error(f"--arms takes distinct arms from {', '.join(ALL_ARMS)}, got {args.arms!r}.")
    try:
        args.lrs = [float(x) for x in args.lrs.split(",")]
    except ValueError:
        p.error(f"--lrs takes numbers separated by commas, got {args.lrs!r}.")
    args.arms = list(ARMS) if args.full else arms
    args.seeds = {arm: [int(s) for s in seeds] for arm in args.arms}
    if args.full:
        args.seeds = {arm: [1, 2, 3, 4, 5] if arm in FIVE_SEED_ARMS else [1, 2, 3] for arm in args.arms}
    args.steps = args.steps or (QUICK_STEPS if args.quick else STEPS)
    args.n = args.n or (1 if args.quick else EVAL_N)
    if min(args.steps, args.n, args.curve_every) < 1 or min(args.lrs) <= 0:
        p.error("--steps, --n, --curve-every and --lrs must be positive.")
    if args.drift:
        args.start_model = "drift"
        if any(a.endswith("@best") for a in args.arms) and not RESULTS.is_file():
            p.error(f"the @best drift arms take their tau from the reasoning miniature's results ({RESULTS}), "
                    "which do not exist yet: run --full first, or leave them out of --arms.")
    missing = [str(MODELS[s]) for s in ([*PRETRAIN_SEEDS] if args.full else [args.start_model])
               if not (MODELS[s] / "config.json").is_file()]
    if missing:
        p.error(f"no shipped model in {', '.join(missing)}: pre-train one with --pretrain"
                + (f" --teacher-terse {DRIFT_TERSE}." if args.drift else "."))
    return args


# what a resumed run must share with the run it continues
RESULT_FLAGS = ("arms", "seeds", "quick", "full", "select", "lrs", "steps", "curve_every", "n", "start_model")
# (--drift is start_model "drift")
SELECT_FLAGS = ("select", "steps", "curve_every", "n", "start_model")


def check_resume(out, args):
    path = out / "settings.json"
    if not path.is_file():
        raise SystemExit(f"--resume: {out} holds no run of this script (no settings.json): drop --resume.")
    saved, now = json.loads(path.read_text()), json.loads(json.dumps({k: vars(args)[k] for k in RESULT_FLAGS}))
    # a selection grows run by run (each invocation may add arms and lrs); its scoring must stay the same
    flags = SELECT_FLAGS if args.select else RESULT_FLAGS
    changed = ["--" + k.replace("_", "-") for k in flags if saved.get(k) != now[k]]
    if changed:
        raise SystemExit(f"--resume with other {', '.join(changed)} than the run in {out} would mix settings: use "
                         "the same flags, or start another --output-dir.")
    if not args.select and saved.get("chosen_lr") != {arm: lr_of(arm) for arm in now["arms"]}:
        raise SystemExit(f"--resume: the learning rates chosen on dev changed since the run in {out} started.")


def this_machine():
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), None) if Path("/proc/cpuinfo").is_file() else None
    return {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "cpu": cpu, "cores": os.cpu_count(),
            "torch": torch.__version__}


def owned_files(out):
    names = ["data", "results.json", "miniature.png", "drift.png", "settings.json", "timings.json", "selection.json",
             "selection.txt", "selection.png"]
    return [out / n for n in names if (out / n).exists()] + sorted(p for p in out.glob("p[0-9d]-*"))


def load_starting_model(seed, train, heldout):
    model_dir = MODELS[seed]
    info = json.loads((model_dir / TASK_FILE).read_text())
    if (info.get("train_digest"), info.get("heldout_digest")) != (split_digest(train), split_digest(heldout)):
        raise SystemExit(f"{model_dir} was pre-trained on another split of the task: pre-train it again.")
    return model_dir, info


# -----------------------------------------------------------------------------
# The run


def main(argv=None):
    args = parse_args(argv)
    if args.grpo_job:
        job = json.loads(args.grpo_job)
        return train_grpo(Path(job["model_dir"]), Path(job["train_file"]), job["seed"], job["steps"], job["lr"],
                          Path(job["out_dir"]), job["save_every"])
    if args.quickstart:
        return quickstart(Path(args.output_dir), args.overwrite)
    if args.reference_step:
        return write_reference_step(args.reference_step, DRIFT_MODEL if args.drift else SHIPPED_MODEL)
    train, dev, heldout = make_task()
    out = Path(args.output_dir)
    if args.pretrain:
        if (out / "model.safetensors").exists() and not args.overwrite:
            raise SystemExit(f"{out} already holds a model: pass --overwrite or choose another --output-dir.")
        return pretrain(out, train, dev, heldout, seed=args.pretrain_seed, teacher_terse=args.teacher_terse)
    t_start = time.perf_counter()
    present = owned_files(out)
    if args.resume:
        check_resume(out, args)
    elif present and not args.overwrite:
        raise SystemExit(f"{out} already holds a run ({', '.join(p.name for p in present[:4])}...): pass "
                         "--resume to continue it, --overwrite to start over, or choose another --output-dir.")
    else:
        for path in present:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        out.mkdir(parents=True, exist_ok=True)
        saved = {k: vars(args)[k] for k in RESULT_FLAGS}
        saved["chosen_lr"] = {arm: lr_of(arm) for arm in args.arms}
        (out / "settings.json").write_text(json.dumps(saved, indent=2) + "\n")
    settings = json.loads((out / "settings.json").read_text())
    settings["invocations"] = settings.get("invocations", []) + [
        {**this_machine(), "argv": sys.argv[1:] if argv is None else list(argv)}]
    (out / "settings.json").write_text(json.dumps(settings, indent=2) + "\n")
    files = {name: out / "data" / f"{name}.jsonl" for name in ("train", "dev", "heldout")}
    for name, rows in (("train", train), ("dev", dev), ("heldout", heldout)):
        write_jsonl(files[name], rows)
    timings_file = out / "timings.json"
    timings = json.loads(timings_file.read_text()) if args.resume and timings_file.is_file() else {}

    def timed(name, seconds):
        if seconds is not None:  # None: finished before this invocation
            timings[name] = round(seconds, 1)
            timings_file.write_text(json.dumps(timings, indent=2) + "\n")

    scorer = {}

    def dev_scorer(model_dir):
        if model_dir not in scorer:
            scorer.clear()
            scorer[model_dir] = DevScorer(model_dir)
        return scorer[model_dir]

    if args.select:
        return select(args, out, files, train, dev, heldout, dev_scorer, timed)
    return experiment(args, out, files, train, dev, heldout, dev_scorer, timed, timings, t_start)


def select(args, out, files, train, dev, heldout, dev_scorer, timed):
    """--select: every arm at every lr of --lrs, seed(s) as given, on the starting model; each run's dev curve
    (checkpoints every --curve-every steps) into selection.json; the table; each complete family's chosen lr."""
    model_dir, _ = load_starting_model(args.start_model, train, heldout)
    path = out / "selection.json"
    selection = json.loads(path.read_text()) if args.resume and path.is_file() else {
        "model": repo_path(model_dir), "steps": args.steps, "every": args.curve_every, "runs": {}}
    base = selection.setdefault("base", None) or dev_scorer(model_dir).score(dev)
    selection["base"] = base
    tag = model_tag(args.start_model)
    for arm in args.arms:
        for lr in args.lrs:
            for seed in args.seeds[arm]:
                name = run_name(tag, arm, seed, lr)
                if name in selection["runs"]:
                    continue
                run = out / name
                _, seconds = train_arm(model_dir, files, train, arm, seed, args.steps, lr, run, args.resume,
                                       save_every=args.curve_every)
                timed(name, seconds)
                points = curve(dev_scorer(model_dir), dev, run, args.steps, args.curve_every, base)
                selection["runs"][name] = {"arm": arm, "family": FAMILY[arm], "lr": lr, "seed": seed,
                                           "curve": points}
                path.write_text(json.dumps(selection, indent=2) + "\n")
                print(f"{name}: dev avg@{EVAL_N} " + ", ".join(f"{p[0]}:{100 * p[3]:.1f}" for p in points),
                      flush=True)
    selection["chosen"] = choose_lrs(selection)
    path.write_text(json.dumps(selection, indent=2) + "\n")
    (out / "selection.txt").write_text(format_selection(selection) + "\n")
    plot_selection(selection, out / "selection.png")
    print(format_selection(selection))
    return selection


def choose_lrs(selection):
    """Each family's lr by the protocol's rule as amended (tests/miniature/README.md): of the lrs whose dev score at the
    last step is within 1 point of the best, the one with the highest mean dev score over the checkpoints after
    step 0 (the area under its dev curve); an exact tie goes to the smaller lr. 'extend' when the winner sits at
    an edge of the lrs run and the next grid point beyond it (x2.5) lies within EXTEND_LIMIT: it must run too."""
    chosen = {}
    families = sorted({r["family"] for r in selection["runs"].values()})
    for family in families:
        finals, areas = {}, {}
        for r in selection["runs"].values():
            if r["family"] == family and r["arm"] == family:
                finals.setdefault(r["lr"], []).append(r["curve"][-1][3])
                areas.setdefault(r["lr"], []).append(sum(p[3] for p in r["curve"][1:]) / (len(r["curve"]) - 1))
        if not finals:
            continue
        final = {lr: sum(v) / len(v) for lr, v in finals.items()}
        area = {lr: sum(v) / len(v) for lr, v in areas.items()}
        best = max(final.values())
        tied = [lr for lr, v in final.items() if v >= best - 0.01 - 1e-9]
        lr = max(tied, key=lambda x: (area[x], -x))
        grid = sorted(final)
        beyond = lr / 2.5 if lr == grid[0] else lr * 2.5 if lr == grid[-1] else None
        extend = len(grid) > 1 and beyond is not None and EXTEND_LIMIT[0] * 0.999 <= beyond <= EXTEND_LIMIT[1] * 1.001
        chosen[family] = {"lr": lr, "dev_avg": final[lr], "dev_area": area[lr],
                          "grid": {f"{k:g}": v for k, v in sorted(final.items())},
                          "area": {f"{k:g}": v for k, v in sorted(area.items())}, "extend": bool(extend)}
    return chosen


def format_selection(selection):
    steps = [p[0] for p in next(iter(selection["runs"].values()))["curve"]] if selection["runs"] else []
    lines = [f"dev avg@{EVAL_N} in % by step (base {100 * selection['base']['avg']:.1f})",
             f"{'run':<32}" + "".join(f"{s:>7}" for s in steps)]
    for name, r in selection["runs"].items():
        lines.append(f"{name:<32}" + "".join(f"{100 * p[3]:>7.1f}" for p in r["curve"]))
    for family, c in selection.get("chosen", {}).items():
        lines.append(f"chosen: {family} lr {c['lr']:g} (dev {100 * c['dev_avg']:.1f} at the last step, "
                     f"{100 * c['dev_area']:.2f} over the curve)"
                     + ("; at the edge of the lrs run: run the next one beyond" if c["extend"] else ""))
    return "\n".join(lines)


def plot_selection(selection, path):
    """The dev curves of the selection runs, one panel per lr family."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = sorted({r["family"] for r in selection["runs"].values()})
    fig, axes = plt.subplots(1, len(families), figsize=(4.2 * len(families), 3.8), squeeze=False)
    for ax, family in zip(axes[0], families):
        for name, r in selection["runs"].items():
            if r["family"] == family:
                ax.plot([p[0] for p in r["curve"]], [100 * p[3] for p in r["curve"]], marker="o", ms=3,
                        label=f"{r['arm']} lr {r['lr']:g}")
        chosen = selection.get("chosen", {}).get(family)
        ax.set_title(family + (f" (chosen lr {chosen['lr']:g})" if chosen else ""), fontsize=10)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(f"dev avg@{EVAL_N}, training format (%)")
        ax.set_ylim(-2, 102)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def model_tag(key):
    """The run-name prefix of a starting model: p1, p2, p3; pd for the drift model."""
    return "pd" if key == "drift" else f"p{key}"


def best_opsd_arm(scores, candidates=OPSD_ARMS):
    ran = [a for a in candidates if a in scores and scores[a]]
    return max(ran, key=lambda a: sum(scores[a]) / len(scores[a])) if ran else None


def experiment(args, out, files, train, dev, heldout, dev_scorer, timed, timings, t_start):
    """The arms, seeds and starting models of the run: train, score with eval.py in both formats, dev curves."""
    primary_model = args.start_model if not args.full else PRETRAIN_SEEDS[0]
    save_every = 25 if args.full or args.drift else 0  # checkpoints make a long run resumable
    curve_arms = ("token", "none", "entry", "grpo", *DRIFT_ARMS)
    results = {"n": args.n, "steps": args.steps, "problems": len(heldout), "quick": args.quick, "full": args.full,
               "drift": args.drift, "model": model_tag(primary_model),
               "arms": args.arms, "seeds": args.seeds, "lr": {arm: lr_of(arm) for arm in args.arms},
               "lr_chosen_on_dev": {arm: FAMILY[arm] in CHOSEN_LR for arm in args.arms},
               "dev_curves": {}, "by_model": {}}

    def score_model(tag, model_dir, arms, seeds):
        """Base and each arm and seed on one starting model: {heldout_avg, transfer_avg, no_scratchpad, ...}."""
        block = {"heldout_avg": {}, "transfer_avg": {}, "no_scratchpad": {}, "tokens_mean": {}, "seeds": {}}
        for fmt, thinking in (("primary", False), ("transfer", True)):
            e = evaluate(model_dir, files["heldout"], args.n, out / f"{tag}-base-eval-{fmt}", thinking=thinking)
            timed(f"{tag}-base-eval-{fmt}", e["seconds"])
            key = "heldout_avg" if fmt == "primary" else "transfer_avg"
            block[key]["base"] = e["avg"]
            block[f"base_stderr_{fmt}"] = e["stderr"]
            if fmt == "primary":
                block["no_scratchpad"]["base"], block["tokens_mean"]["base"] = e["no_scratchpad"], e["tokens_mean"]
            print(f"{tag} base: held-out avg@{args.n} {fmt} {100 * e['avg']:.1f}", flush=True)
        for arm in arms:
            block["seeds"][arm] = seeds[arm]
            for k in ("heldout_avg", "transfer_avg", "no_scratchpad", "tokens_mean"):
                block[k][arm] = []
        # seed by seed: every arm's first seed before any arm's second (a run cut short still covers every arm)
        for i, k in sorted((i, k) for k, arm in enumerate(arms) for i in range(len(seeds[arm]))):
            arm = arms[k]
            seed = seeds[arm][i]
            name = run_name(tag, arm, seed)
            run = out / name
            with_curve = (arm in curve_arms and seed == seeds[arm][0] and tag == model_tag(primary_model)
                          and not args.quick)
            adapter, seconds = train_arm(model_dir, files, train, arm, seed, args.steps, lr_of(arm), run,
                                         args.resume, save_every=args.curve_every if with_curve else save_every)
            timed(name, seconds)
            line = f"{name}:"
            for fmt, thinking in (("primary", False), ("transfer", True)):
                e = evaluate(model_dir, files["heldout"], args.n, out / f"{name}-eval-{fmt}", adapter, thinking)
                timed(f"{name}-eval-{fmt}", e["seconds"])
                block["heldout_avg" if fmt == "primary" else "transfer_avg"][arm].append(e["avg"])
                if fmt == "primary":
                    block["no_scratchpad"][arm].append(e["no_scratchpad"])
                    block["tokens_mean"][arm].append(e["tokens_mean"])
                line += f" {fmt} {100 * e['avg']:.1f}"
            print(line + (f", training {seconds:.0f}s" if seconds is not None else ", training kept"), flush=True)
            if with_curve:
                cache = out / f"{name}-curve.json"
                if args.resume and cache.is_file():
                    points = json.loads(cache.read_text())
                else:
                    s = dev_scorer(model_dir)
                    points = curve(s, dev, run, args.steps, args.curve_every, s.score(dev))
                    cache.write_text(json.dumps(points) + "\n")
                results["dev_curves"][arm] = points
        return block

    primary = score_model(model_tag(primary_model), MODELS[primary_model], args.arms, args.seeds)
    results.update({k: primary[k] for k in ("heldout_avg", "transfer_avg", "no_scratchpad", "tokens_mean")})
    results["base_stderr"] = {"primary": primary["base_stderr_primary"], "transfer": primary["base_stderr_transfer"]}
    results["pretrain"] = json.loads((MODELS[primary_model] / TASK_FILE).read_text())
    if args.full:
        best = best_opsd_arm(results["heldout_avg"])
        headline = [best, "sft-reference", "grpo"]
        for seed in PRETRAIN_SEEDS[1:]:
            block = score_model(f"p{seed}", SHIPPED_MODELS[seed], headline, {arm: [1, 2] for arm in headline})
            block["pretrain"] = json.loads((SHIPPED_MODELS[seed] / TASK_FILE).read_text())
            block["stats"] = {key: {arm: summarize(block[key][arm], block[key]["base"], block[f"base_stderr_{fmt}"])
                                    for arm in headline}
                              for key, fmt in (("heldout_avg", "primary"), ("transfer_avg", "transfer"))}
            results["by_model"][f"p{seed}"] = block
        for arm, steps in (("token", 300), ("none", 300)):  # a delayed gain or none: one long run, dev curve
            name = run_name(f"p{primary_model}", arm, 1) + f"-long{steps}"
            cache = out / f"{name}-curve.json"
            if not (args.resume and cache.is_file()):
                _, seconds = train_arm(SHIPPED_MODELS[primary_model], files, train, arm, 1, steps, lr_of(arm),
                                       out / name, args.resume, save_every=args.curve_every)
                timed(name, seconds)
                s = dev_scorer(SHIPPED_MODELS[primary_model])
                cache.write_text(json.dumps(curve(s, dev, out / name, steps, args.curve_every, s.score(dev))) + "\n")
            results["dev_curves"][f"{arm} ({steps} steps)"] = json.loads(cache.read_text())
    results["stats"] = {key: {arm: summarize(results[key][arm], results[key]["base"],
                                             results["base_stderr"]["primary" if key == "heldout_avg" else "transfer"])
                              for arm in args.arms} for key in ("heldout_avg", "transfer_avg")}
    share, samples = results["no_scratchpad"]["base"], len(heldout) * args.n  # the base share's binomial error
    results["stats"]["no_scratchpad"] = {arm: summarize(results["no_scratchpad"][arm], share,
                                                        (share * (1 - share) / samples) ** 0.5) for arm in args.arms}
    best = best_opsd_arm(results["heldout_avg"], DRIFT_OPSD_ARMS if args.drift else OPSD_ARMS)
    results["best_opsd_arm"] = best
    if best:
        results["paired_vs_best_opsd"] = {
            key: {arm: paired(results[key][best], results[key][arm], args.seeds[best], args.seeds[arm])
                  for arm in args.arms if arm != best} for key in ("heldout_avg", "transfer_avg")}
        results["token_efficiency"] = None if args.drift else token_efficiency(results["dev_curves"], best, "grpo")
    if args.drift:
        results["best_tau"] = {clip: best_tau(clip) for clip in ("token", "entry")}
    step1 = DATA / ("drift" if args.drift else "") / "step1_kl.json"
    results["step1_kl"] = json.loads(step1.read_text()) if step1.is_file() and primary_model in (1, "drift") else None
    results["timings"], results["seconds"] = timings, round(time.perf_counter() - t_start, 1)
    results["seconds_all_pieces"] = round(sum(timings.values()), 1)
    results["resumed"] = args.resume
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, out / "miniature.png")
    if args.drift:
        plot_drift(results, out / "drift.png")
    print(format_table(results))
    print(format_table(results, "transfer_avg", "held-out, transfer (eval.py's default prompt)"))
    print(format_table(results, "no_scratchpad", "held-out answers without a scratchpad"))
    for tag, block in results["by_model"].items():
        print(format_table({**block, "arms": list(block["seeds"]), "n": args.n, "problems": len(heldout)},
                           title=f"starting model {tag}, held-out, in the training format"))
    print(f"total {results['seconds']:.0f} s -> {out / 'results.json'}, {out / 'miniature.png'}")
    return results


if __name__ == "__main__":
    main()
