"""Reasoning in miniature: 3-digit addition with a scratchpad, on a 2-core CPU. opsd.py's arms against SFT on the
reference, SFT on expert traces and GRPO, scored by eval.py in the format the student trains in. tests/miniature.md
holds the protocol (fixed before any arm was run) and the results.

    python tests/miniature.py --output-dir runs/mini                # the default: the headline arms, 1 seed (~30 min)
    python tests/miniature.py --output-dir runs/mini-quick --quick  # what the test suite runs (~3 min)
    python tests/miniature.py --output-dir runs/mini-full --full    # the whole protocol (~3 h; --resume continues it)
    python tests/miniature.py --output-dir runs/select --select --arms token --lr 5e-3   # dev: one lr, dev curves
    python tests/miniature.py --pretrain --pretrain-seed 1 --output-dir runs/model-p1  # a starting model, accepted?
    python tests/miniature.py --reference-step tests/data/miniature/reference_step.json  # the port-check fixture

The task: a+b with 100 <= a, b <= 999. The student (eval.py's prompt, thinking off: opsd.py --student-prompt eval
--no-student-thinking) writes a right-to-left column scratchpad, `7+5=12 5+8+1=14 4+3+1=8 \\boxed{842}`; the
teacher's prompt holds the terse reference `457+385=842`. The starting models (0.8M-parameter Qwen3s, digits one
token each) are pre-trained here in plain PyTorch on the training split only: traces by an error-prone writer (a
misconception, dropping an incoming carry into a column that carries again 70% of the time, and 10% random slips)
after the student's prompts, correct traces after the teacher's prompt with the reference.
"""

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
sys.path[:0] = [str(ROOT), str(TESTS)]

import eval as evaluation  # noqa: E402  (eval.py: its prompt builder and grading)
import opsd  # noqa: E402  (opsd.py: its prompts, LoRA, data order, sampling, weight push, LR schedule, loss)
from make_tiny_model import CHAT_TEMPLATE, SPECIAL_TOKENS  # noqa: E402

DATA = TESTS / "data" / "miniature"
# the three starting models, by pre-training seed, fixed in advance; the first is the one every arm runs on
PRETRAIN_SEEDS = (1, 2, 3)
SHIPPED_MODELS = {1: DATA / "model", 2: DATA / "model-p2", 3: DATA / "model-p3"}
SHIPPED_MODEL = SHIPPED_MODELS[1]
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


def write_trace(a, b, rng=None, carry_drop=0.0, slip=0.0):
    """The column scratchpad of a+b, right to left, "x+y=s" or "x+y+1=s" with an incoming carry, then the boxed
    answer the columns give. A writer with `carry_drop` drops an incoming carry into a column that carries again
    (x + y + 1 >= 10) with that probability (it writes "x+y=s" with s = x + y); with `slip` it writes a column's
    sum off by one (either way, kept within 0..19). The trace is always self-consistent: each column's written sum
    decides its digit and the carry out, so a wrong column makes a wrong answer."""
    columns, digits, carry = [], [], 0
    for i in range(3):
        x, y = a // 10 ** i % 10, b // 10 ** i % 10
        c = carry
        if c and x + y + c >= 10 and carry_drop and rng.random() < carry_drop:
            c = 0
        s = x + y + c
        if slip and rng.random() < slip:
            s = s + 1 if s == 0 or (s < 19 and rng.random() < 0.5) else s - 1
        columns.append(f"{x}+{y}+1={s}" if c else f"{x}+{y}={s}")
        digits.append(s % 10)
        carry = s // 10
    answer = ("1" if carry else "") + "".join(str(d) for d in reversed(digits))
    return " ".join(columns) + f" \\boxed{{{int(answer)}}}"


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


def build_tokenizer(train):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    lines = [opsd.teacher_message(r["problem"], r["solution"]) + " " + r["trace"] for r in train[:200]]
    lines += [evaluation.build_prompt(r["problem"]) + " " + r["trace"] for r in train[:200]]
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
PRETRAIN = {"steps": 600, "batch_size": 64, "lr": 2e-3, "warmup": 30}


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


@torch.no_grad()
def answer_loss(model, batch, pad_id):
    """Mean next-token loss over the answer tokens of a fixed batch (the convergence check's figure)."""
    model.eval()
    input_ids, attention_mask, labels = right_padded(batch, pad_id)
    loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss.item()
    model.train()
    return loss


def pretrain(out_dir, train, dev, heldout, *, seed, steps=PRETRAIN["steps"], teacher_terse=0.0):
    """Pre-train a fresh model (init and batches seeded by `seed`) on the training split only; save it with its
    pre-training record and acceptance figures (see ACCEPT) in miniature.json."""
    t0 = time.perf_counter()
    tok = build_tokenizer(train)
    model = build_model(tok, seed)
    bs, lr = PRETRAIN["batch_size"], PRETRAIN["lr"]
    print(f"pre-training a {sum(p.numel() for p in model.parameters()):,}-parameter Qwen3 (vocab {len(tok)}, seed "
          f"{seed}) for {steps} steps of {bs} on {len(train)} problems in {len(FORMATS)} formats", flush=True)
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    # the convergence figure: the answer loss on dev problems in all four formats, writer draws fixed by seed 0
    dev_rng = random.Random(0)
    dev_batch = [pretrain_example(tok, r, fmt, dev_rng, teacher_terse) for r in dev[:64] for fmt in FORMATS]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    model.train()
    losses = []
    for step in range(steps):
        picks = torch.randint(len(train) * len(FORMATS), (bs,), generator=g).tolist()  # an equal mix of formats
        batch = [pretrain_example(tok, train[k // len(FORMATS)], FORMATS[k % len(FORMATS)], rng, teacher_terse)
                 for k in picks]
        input_ids, attention_mask, labels = right_padded(batch, tok.pad_token_id)
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
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
            "writer": {"carry_drop": CARRY_DROP, "slip": SLIP}, "pretrain_seconds": round(seconds, 1),
            "dev_answer_loss": losses, "dev": figures, "accepted": verdict["accepted"], "why": verdict["why"]}
    (out_dir / TASK_FILE).write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps({"dev": figures, **verdict}, indent=1), flush=True)
    return info


# The acceptance rule, fixed before any arm ran (tests/miniature.md): on the dev split, in the student's training
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
        figures[f"{fmt}_sampled"] = sum(correct(generate(model, tok, prompts[fmt], sample=True))) / len(dev)
    wrong = [not c for c in correct(greedy_texts["student"])]
    figures["student_greedy_errors"] = sum(wrong)
    figures["student_greedy_errors_where_misconception_applies"] = sum(
        w and misconception_applies(*operands(r["problem"])) for w, r in zip(wrong, dev))
    figures["teacher_no_scratchpad"] = sum(not has_scratchpad(t) for t in greedy_texts["teacher"]) / len(dev)
    figures["example_student_greedy"] = greedy_texts["student"][:3]
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in figures.items()}
