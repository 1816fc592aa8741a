"""OPSD in miniature: 2-digit addition on a 2-core CPU, opsd.py's arms against SFT and controls, scored by eval.py.

    python tests/miniature.py --output-dir runs/miniature                # a newcomer's run: token, none, sft x 3 seeds
    python tests/miniature.py --output-dir runs/miniature-quick --quick  # what the test suite runs
    python tests/miniature.py --output-dir runs/miniature-full --full    # every arm, 5 or 3 seeds, curves (75-80 min)
    python tests/miniature.py --output-dir runs/select --split dev --arms token,sft --seeds 1 --lr 2e-3 --curves
                                                                          # choosing lr and steps: dev only
    python tests/miniature.py --reference-step tests/data/miniature/reference_step.json  # port-check fixture

The task is 2-digit addition ("37+45", answer 82; every digit is one token): all 8,100 pairs of 10..99,
shuffled once by a fixed seed into 400 held-out problems (reported), 400 dev problems (for choosing the
learning rate and the step count) and 7,300 training problems. The model is a 0.8M-parameter Qwen3
pre-trained here, with plain PyTorch (full weights, loss on the answer tokens only), on the training split
only, in four prompt formats, each rendered by the builders opsd.py and eval.py use:
  1. opsd.py's student prompt (thinking off),
  2. eval.py's prompt (thinking on),
  3. opsd.py's teacher prompt with the reference solution "37+45=82" (thinking on),
  4. the teacher prompt with an empty reference, so a teacher without privileged information answers
     like the student instead of being lost (the control arm's teacher).
The pre-trained model ships in tests/data/miniature/model; --rebuild-model pre-trains a fresh one.

Then, from the same starting model, for every arm and seed (see ARMS): opsd.py through its command line,
or, for the sft arm, supervised fine-tuning written here with opsd.py's own LoRA, prompts, data order and
LR schedule; eval.py scores the base model and every adapter (avg@n at temperature 1.0). One process at
a time. Writes <output-dir>/results.json, miniature.png (accuracy per arm, kl_mean per step), with
--curves also curves.png (dev accuracy every --curve-every steps), and prints the table. A second run
into the same --output-dir is refused unless --overwrite clears this script's files there; --resume continues
an interrupted run with the same flags (finished pieces kept; opsd.py and eval.py resume where they stopped).
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

import eval as evaluation  # noqa: E402  (eval.py: its prompt builder and answer extraction)
import opsd  # noqa: E402  (opsd.py: its prompt builders, LoRA, data order, LR schedule, batches and loss)
from make_tiny_model import CHAT_TEMPLATE, SPECIAL_TOKENS  # noqa: E402

SHIPPED_MODEL = TESTS / "data" / "miniature" / "model"
TASK_FILE = "miniature.json"  # next to the model: the split it was pre-trained on, and how well it does

# arm: (opsd.py --clip, --tau, --context-column); "sft" trains in this script instead of opsd.py
ARMS = {
    "token": ("token", 0.05, "solution"),
    "none": ("none", 0.05, "solution"),  # tau only sets the diagnostic's threshold here
    "sft": None,
    "none-wrong": ("none", 0.05, "wrong_solution"),  # the two controls with the clip that learns on this model
    "none-control": ("none", 0.05, "no_solution"),
    "entry": ("entry", 0.05, "solution"),
    "control": ("token", 0.05, "no_solution"),
    "wrong": ("token", 0.05, "wrong_solution"),
    "token@0.5": ("token", 0.5, "solution"),
    "token@2": ("token", 2.0, "solution"),
    "entry@0.5": ("entry", 0.5, "solution"),
    "entry@2": ("entry", 2.0, "solution"),
}
DEFAULT_ARMS, DEFAULT_SEEDS = ("token", "none", "sft"), (1, 2, 3)
FULL_SEEDS = {arm: (1, 2, 3, 4, 5) if arm in DEFAULT_ARMS else (1, 2, 3) for arm in ARMS}  # --full
CURVE_ARMS = ("token", "none", "entry", "sft")  # --curves: dev accuracy along training, first seed only
QUICK_ARM = "none"  # --quick: the opsd.py arm that gained on dev (see the settings below)

# Settings chosen on the dev split with seed 1 (see the README): the learning rate of each arm family from 2e-3,
# 5e-3, 1e-2 (token and none for the opsd.py arms; sft also 2e-2), the step count from checkpoints every 25 steps,
# shared, so SFT gets as many optimizer steps as OPSD. At 5e-3 none and sft gained on dev, token did not at any lr.
OPSD_LR, SFT_LR, STEPS = 5e-3, 5e-3, 150
# opsd.py's settings for every arm (the seed, lr, steps and the arm's own flags are added per run); SFT uses the
# same rank, alpha, prompts per step and gradient clip
LORA_R, LORA_ALPHA, PROMPTS_PER_STEP, MAX_GRAD_NORM = 16, 32, 64, 0.1
OPSD_FLAGS = ["--device", "cpu", "--dtype", "float32", "--lora-r", str(LORA_R), "--lora-alpha", str(LORA_ALPHA),
              "--prompts-per-step", str(PROMPTS_PER_STEP), "--micro-batch-size", str(PROMPTS_PER_STEP),
              "--max-new-tokens", "32", "--max-prompt-length", "256", "--no-gradient-checkpointing",
              "--max-grad-norm", str(MAX_GRAD_NORM), "--log-rollouts-every", "50", "--kl-window", "512"]
EVAL_MAX_NEW_TOKENS = 32
TIMING_FIELDS = ("time_sample", "time_train", "time_push", "tokens_per_second")  # all else in metrics.jsonl repeats

# -----------------------------------------------------------------------------
# Config


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="miniature.py",
                                description="OPSD in miniature: 2-digit addition, a 0.8M-parameter Qwen3, opsd.py's "
                                            "arms against SFT and controls, scored by eval.py.")
    p.add_argument("--output-dir", help="results.json, the figures and one directory per run")
    p.add_argument("--arms", default=None,
                   help=f"comma-separated arms from {', '.join(ARMS)} "
                        f"(default: {','.join(DEFAULT_ARMS)}; --quick: {QUICK_ARM})")
    p.add_argument("--seeds", default=None, help="comma-separated seeds every chosen arm runs with (default 1,2,3; "
                                                 "--quick: 1)")
    p.add_argument("--quick", action="store_true",
                   help=f"the test suite's variant: the {QUICK_ARM} arm, one seed, 2 samples per problem (a check, "
                        "not the experiment)")
    p.add_argument("--full", action="store_true",
                   help="every arm, seeds 1-5 for token, none and sft and 1-3 for the others, with --curves")
    p.add_argument("--split", default=None, choices=["heldout", "dev"],
                   help="the split the arms are scored on: heldout (the reported numbers, the default) or dev")
    p.add_argument("--select", action="store_true",
                   help="choosing settings, on dev only: every arm and seed saves a checkpoint every --curve-every "
                        "steps, each scored by its probability of the exact answer (no sampling); selection.json")
    p.add_argument("--curves", action="store_true",
                   help=f"score checkpoints of the first seed of {', '.join(CURVE_ARMS)} on the dev split")
    p.add_argument("--curve-every", type=int, default=25, help="steps between scored checkpoints (with --curves)")
    p.add_argument("--curve-n", type=int, default=2, help="eval.py samples per dev problem for the curves")
    p.add_argument("--steps", type=int, default=STEPS, help="optimizer steps of every arm (opsd.py --max-steps)")
    p.add_argument("--lr", type=float, default=OPSD_LR, help="peak learning rate of the opsd.py arms")
    p.add_argument("--sft-lr", type=float, default=SFT_LR, help="peak learning rate of the sft arm")
    p.add_argument("--n", type=int, default=None, help="eval.py samples per scored problem (default 4; --quick: 2)")
    p.add_argument("--rebuild-model", action="store_true",
                   help=f"pre-train the model from scratch into <output-dir>/model instead of using "
                        f"{SHIPPED_MODEL.relative_to(ROOT)}")
    p.add_argument("--pretrain-steps", type=int, default=600, help="pre-training steps (with --rebuild-model)")
    p.add_argument("--pretrain-seed", type=int, default=PRETRAIN_SEED,
                   help="seed of the pre-training batches (with --rebuild-model; the shipped model's: %(default)s)")
    p.add_argument("--overwrite", action="store_true", help="clear this script's files in --output-dir first")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --output-dir with the same flags: finished trainings and scores are "
                        "kept, opsd.py resumes from its last checkpoint, eval.py draws only the samples it lacks")
    p.add_argument("--reference-step", metavar="PATH", default=None,
                   help="write the port-check fixture (step-1 rollouts of the shipped model and their loss) and stop")
    args = p.parse_args(argv)
    if args.reference_step:
        return args
    if not args.output_dir:
        p.error("--output-dir is required.")
    if args.resume and args.overwrite:
        p.error("--resume continues the run in --output-dir, --overwrite clears it: pass one.")
    if args.select and (args.split == "heldout" or args.full or args.quick or args.curves):
        p.error("--select scores the dev split by itself: leave out --split heldout, --full, --quick and --curves.")
    args.split = args.split or ("dev" if args.select else "heldout")
    if args.full and (args.quick or args.arms or args.seeds):
        p.error("--full chooses every arm and its seeds: leave out --quick, --arms and --seeds.")
    seeds = [s.strip() for s in (args.seeds or ("1" if args.quick else ",".join(map(str, DEFAULT_SEEDS)))).split(",")]
    if not all(s.isdigit() for s in seeds) or len(set(seeds)) != len(seeds):
        p.error(f"--seeds takes distinct non-negative integers separated by commas, got {args.seeds!r}.")
    arms = [a.strip() for a in (args.arms or (QUICK_ARM if args.quick else ",".join(DEFAULT_ARMS))).split(",")]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or len(set(arms)) != len(arms):
        p.error(f"--arms takes distinct arms from {', '.join(ARMS)}, got {args.arms!r}.")
    if args.full:
        arms, args.curves = list(ARMS), True
    args.seeds = {arm: list(FULL_SEEDS[arm]) if args.full else [int(s) for s in seeds] for arm in arms}
    args.arms = arms
    args.n = args.n or (2 if args.quick else 4)
    if min(args.steps, args.n, args.pretrain_steps, args.curve_every, args.curve_n) < 1 or args.lr <= 0 \
            or args.sft_lr <= 0:
        p.error("--steps, --n, --pretrain-steps, --curve-every, --curve-n, --lr and --sft-lr must be positive.")
    if not args.rebuild_model and not (SHIPPED_MODEL / "config.json").is_file():
        p.error(f"no shipped model in {SHIPPED_MODEL}: pass --rebuild-model to pre-train one.")
    return args


# -----------------------------------------------------------------------------
# The task: 2-digit addition, one fixed split

TASK_SEED, NUM_HELDOUT, NUM_DEV = 0, 400, 400
# the batches' seed of the shipped model's pre-training. Seed 0's model (same recipe) did not learn from any
# training on the labels (plain SFT: dev 8.5% -> 8.8%), so it could show nothing; seed 1's did (9.0% -> 19.0%).
PRETRAIN_SEED = 1


def make_task():
    """(train, dev, held-out rows): every a+b with 10 <= a, b <= 99, shuffled by a fixed seed.

    Train rows are opsd.py's format, plus the control arm's empty context and the wrong arm's context:
    another training problem's solution with another answer (a fixed derangement). Dev and held-out
    rows are eval.py's format.
    """
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(TASK_SEED).shuffle(pairs)
    rows = [{"problem": f"{a}+{b}", "solution": f"{a}+{b}={a + b}", "answer": str(a + b)} for a, b in pairs]
    heldout, dev, train = rows[:NUM_HELDOUT], rows[NUM_HELDOUT:NUM_HELDOUT + NUM_DEV], rows[NUM_HELDOUT + NUM_DEV:]
    other = wrong_derangement([r["answer"] for r in train])
    train = [{**r, "no_solution": "", "wrong_solution": train[other[i]]["solution"]} for i, r in enumerate(train)]
    strip = lambda split: [{"problem": r["problem"], "answer": r["answer"]} for r in split]  # noqa: E731
    return train, strip(dev), strip(heldout)


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
    """Fingerprint of a split's problems, stored with the model so a changed split is caught."""
    return hashlib.sha256("\n".join(r["problem"] for r in rows).encode()).hexdigest()[:16]


def swapped_twins(rows, train):
    """How many of `rows` have their operands-swapped twin (b+a for a+b, a != b) in the training split."""
    train_problems = {r["problem"] for r in train}
    twins = 0
    for r in rows:
        a, b = r["problem"].split("+")
        twins += a != b and f"{b}+{a}" in train_problems
    return twins


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


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
    lines = [opsd.teacher_message(r["problem"], r["solution"]) for r in train[:200]]
    lines += [evaluation.build_prompt(r["problem"]) + f" \\boxed{{{r['answer']}}}" for r in train[:200]]
    bpe.train_from_iterator(lines, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  padding_side="left")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_model(tok):
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=len(tok), hidden_size=128, intermediate_size=384, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64,  # vLLM's CPU attention needs 64
                         max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=None,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return model


# -----------------------------------------------------------------------------
# Pre-training mix: each problem in the four formats, rendered by opsd.py's and eval.py's own builders

FORMATS = ("student", "eval", "teacher", "teacher_empty")


def format_prompt(tok, row, fmt):
    if fmt == "student":
        return opsd.render(tok, opsd.student_message(row["problem"]), thinking=False)
    if fmt == "eval":
        return evaluation.prompt_ids(tok, row["problem"], thinking=True)
    context = row["solution"] if fmt == "teacher" else ""
    return opsd.render(tok, opsd.teacher_message(row["problem"], context), thinking=True)


def answer_ids(tok, answer):
    return tok.encode(f"\\boxed{{{answer}}}", add_special_tokens=False) + [tok.eos_token_id]


def with_solution(rows):
    """Dev or held-out rows with the reference solution written the way the training split's is."""
    return [{**r, "solution": f"{r['problem']}={r['answer']}"} for r in rows]


def pretrain(out_dir, train, dev, heldout, *, steps, seed=PRETRAIN_SEED, lr=2e-3, batch_size=64, warmup=30):
    """Pre-train a fresh model on the four-format mix of the training split (answer-only next-token loss)."""
    t0 = time.perf_counter()
    tok = build_tokenizer(train)
    model = build_model(tok)
    print(f"pre-training a {sum(p.numel() for p in model.parameters()):,}-parameter Qwen3 (vocab {len(tok)}) "
          f"for {steps} steps of {batch_size} on {len(train)} problems in {len(FORMATS)} formats", flush=True)
    examples = [(format_prompt(tok, r, fmt), answer_ids(tok, r["answer"])) for r in train for fmt in FORMATS]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    model.train()
    for step in range(steps):
        batch = [examples[i] for i in torch.randint(len(examples), (batch_size,), generator=g).tolist()]  # equal mix
        # right padding: positions 0..len-1 for every real token, pads masked; loss on answer tokens only
        T = max(len(p) + len(a) for p, a in batch)
        input_ids = torch.full((batch_size, T), tok.pad_token_id)
        labels = torch.full((batch_size, T), -100)
        attention_mask = torch.zeros((batch_size, T), dtype=torch.long)
        for row, (prompt, answer) in enumerate(batch):
            input_ids[row, :len(prompt) + len(answer)] = torch.tensor(prompt + answer)
            labels[row, len(prompt):len(prompt) + len(answer)] = torch.tensor(answer)
            attention_mask[row, :len(prompt) + len(answer)] = 1
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        for group in optimizer.param_groups:
            group["lr"] = opsd.lr_at(step, lr=lr, max_steps=steps, warmup_steps=warmup)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % 100 == 0 or step + 1 == steps:
            print(f"pre-train step {step + 1:4d}/{steps} | loss {loss.item():.4f} | {time.perf_counter() - t0:.0f}s",
                  flush=True)
        if (step + 1) % 300 == 0 and step + 1 < steps:  # progress only: the student's dev greedy accuracy
            progress = greedy_accuracy(model, tok, with_solution(dev[:200]), formats=("student",))
            print(f"  student greedy accuracy on 200 dev problems: {100 * progress['student']:.1f}%", flush=True)
    seconds = time.perf_counter() - t0
    print(f"pre-training took {seconds:.0f} s", flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    greedy = {name: greedy_accuracy(model, tok, with_solution(rows)) for name, rows in (("dev", dev),
                                                                                         ("heldout", heldout))}
    for name, accuracy in greedy.items():
        print(f"{name} greedy accuracy after pre-training: "
              + ", ".join(f"{fmt} {100 * a:.1f}%" for fmt, a in accuracy.items()), flush=True)
    info = {"task_seed": TASK_SEED, "train_digest": split_digest(train), "dev_digest": split_digest(dev),
            "heldout_digest": split_digest(heldout), "pretrain_steps": steps, "pretrain_seed": seed, "lr": lr,
            "batch_size": batch_size,
            "pretrain_seconds": round(seconds, 1), "dev_greedy": greedy["dev"], "heldout_greedy": greedy["heldout"]}
    (out_dir / TASK_FILE).write_text(json.dumps(info, indent=2) + "\n")
    return info


@torch.no_grad()
def greedy_accuracy(model, tok, rows, batch_size=100, formats=FORMATS):
    """Greedy accuracy of each prompt format (left-padded batches, HF generate)."""
    model.eval()
    accuracy = {}
    for fmt in formats:
        correct = 0
        for start in range(0, len(rows), batch_size):
            chunk = rows[start:start + batch_size]
            prompts = [format_prompt(tok, r, fmt) for r in chunk]
            P = max(map(len, prompts))
            input_ids = torch.tensor([[tok.pad_token_id] * (P - len(p)) + p for p in prompts])
            attention_mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=12,
                                 do_sample=False)
            for r, ids in zip(chunk, out[:, P:]):
                correct += evaluation.extract_boxed(tok.decode(ids, skip_special_tokens=True)) == r["answer"]
        accuracy[fmt] = correct / len(rows)
    model.train()
    return accuracy


# -----------------------------------------------------------------------------
# The arms: opsd.py through its command line; SFT here, with opsd.py's LoRA, prompts, data order and schedule


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


def opsd_command(model_dir, train_file, arm, seed, steps, lr, out_dir, save_every=0):
    """opsd.py's command line for one arm and seed."""
    clip, tau, context = ARMS[arm]
    return [sys.executable, str(ROOT / "opsd.py"), "--model", str(model_dir), "--dataset", str(train_file),
            "--clip", clip, "--tau", str(tau), "--context-column", context, "--max-steps", str(steps),
            "--lr", str(lr), "--seed", str(seed), "--save-every", str(save_every), "--output-dir", str(out_dir),
            *OPSD_FLAGS]


def train_sft(model_dir, train, seed, steps, lr, out_dir, save_every=0):
    """Supervised fine-tuning on the reference answer ("\\boxed{82}" and EOS) after the student's prompt:
    opsd.py's LoRA (rank, alpha, A seeded by `seed`), prompts, data order (step_indices), AdamW, gradient clip
    and LR schedule, the loss a token mean over the step's answer tokens. No sampling. Writes checkpoint-<step>/
    every `save_every` steps, final/ and metrics.jsonl, as opsd.py does."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)  # nothing here draws from it; fixed anyway
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opsd.disable_dropout(model)
    lora_params = opsd.add_lora(model, LORA_R, LORA_ALPHA, seed=seed)
    model.train()
    prompts = opsd.build_prompts(tok, [(r["problem"], r["solution"]) for r in train], student_thinking=False,
                                 teacher_thinking=True, max_prompt_length=256)
    targets = [answer_ids(tok, r["answer"]) for r in train]
    optimizer = torch.optim.AdamW(lora_params, lr=lr, betas=(0.9, 0.999), weight_decay=0.0)  # opsd.py's
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "metrics.jsonl", "w") as log:
        for step in range(steps):
            indices = opsd.step_indices(step, PROMPTS_PER_STEP, len(prompts), seed)
            inputs, mask = opsd.build_batch([prompts[i][0] for i in indices], [targets[i] for i in indices],
                                            tok.pad_token_id, "cpu")
            logits = model(**inputs, use_cache=False).logits[:, :-1]  # (B, T - 1, V): position t predicts t + 1
            loss = torch.nn.functional.cross_entropy(logits[mask[:, 1:]].float(),
                                                     inputs["input_ids"][:, 1:][mask[:, 1:]])
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(lora_params, MAX_GRAD_NORM).item()
            lr_now = opsd.lr_at(step, lr=lr, max_steps=steps)
            for group in optimizer.param_groups:
                group["lr"] = lr_now
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            log.write(json.dumps({"step": step + 1, "loss": loss.item(), "lr": lr_now, "grad_norm": grad_norm}) + "\n")
            if save_every and (step + 1) % save_every == 0 and step + 1 < steps:
                opsd.save_adapter(model, out_dir / f"checkpoint-{step + 1}", model_dir)
    opsd.save_adapter(model, out_dir / "final", model_dir)


def train_arm(model_dir, train_file, train, arm, seed, args, out_dir, save_every=0):
    """Train one arm and seed; returns the final adapter and the seconds it took (None: finished before, with
    --resume). A resumed opsd.py run continues from its last checkpoint; an unfinished SFT run starts over."""
    if args.resume and (out_dir / "final").is_dir():
        return out_dir / "final", None
    if arm == "sft":
        shutil.rmtree(out_dir, ignore_errors=True)
        t0 = time.perf_counter()
        train_sft(model_dir, train, seed, args.steps, args.sft_lr, out_dir, save_every)
        return out_dir / "final", time.perf_counter() - t0
    cmd = opsd_command(model_dir, train_file, arm, seed, args.steps, args.lr, out_dir, save_every)
    resumable = args.resume and opsd.latest_checkpoint(out_dir) is not None
    return out_dir / "final", run_logged(cmd + ["--resume" if resumable else "--overwrite"],
                                         log_path(out_dir, "resumed" if resumable else ""))


def evaluate(model_dir, data_file, n, out_dir, adapter=None):
    """eval.py's avg@n on one split, its standard error over problems, and the seconds it took (None when its
    summary was already there: eval.py then only reads its samples back). An interrupted evaluation continues:
    eval.py keeps the samples in out_dir and draws the rest."""
    finished = (out_dir / "summary.json").is_file()
    cmd = [sys.executable, str(ROOT / "eval.py"), "--model", str(model_dir), "--data", f"split={data_file}",
           "--n", str(n), "--max-new-tokens", str(EVAL_MAX_NEW_TOKENS), "--dtype", "float32", "--enforce-eager",
           "--output-dir", str(out_dir)] + (["--adapter", str(adapter)] if adapter else [])
    seconds = run_logged(cmd, log_path(out_dir, "resumed" if finished else ""))
    avg = json.loads((out_dir / "summary.json").read_text())["metrics"]["split"][f"avg@{n}"]
    per_problem = {}
    for line in (out_dir / "samples.jsonl").read_text().splitlines():
        s = json.loads(line)
        per_problem.setdefault(s["problem"], []).append(s["correct"])
    means = [sum(c) / len(c) for c in per_problem.values()]
    stderr = (sum((m - avg) ** 2 for m in means) / (len(means) - 1) / len(means)) ** 0.5
    return avg, stderr, None if finished else seconds


@torch.no_grad()
def answer_probability(model_dir, rows, adapter=None):
    """The mean over `rows` of the probability that the model, at temperature 1 after eval.py's prompt, writes
    exactly the reference answer ("\\boxed{82}" and the end of turn): what avg@n estimates, less eval.py's top-p
    and other spellings of a right answer, from one forward pass instead of a sampling run."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if adapter:
        opsd.add_lora(model, LORA_R, LORA_ALPHA)
        opsd.load_adapter(model, adapter)
    prompts = [evaluation.prompt_ids(tok, r["problem"], thinking=True) for r in rows]
    inputs, mask = opsd.build_batch(prompts, [answer_ids(tok, r["answer"]) for r in rows], tok.pad_token_id, "cpu")
    logp = torch.log_softmax(model(**inputs).logits[:, :-1].float(), -1)  # (B, T - 1, V): t predicts t + 1
    answer_logp = logp.gather(-1, inputs["input_ids"][:, 1:, None])[..., 0] * mask[:, 1:]  # (B, T - 1)
    return answer_logp.sum(-1).exp().mean().item()


def select_settings(args, out, model_dir, files, train, dev):
    """--select: train every arm and seed with a checkpoint every --curve-every steps and score each checkpoint on
    the dev split with answer_probability; write selection.json and print the table (in %)."""
    steps = sorted(set(range(args.curve_every, args.steps, args.curve_every)) | {args.steps})
    selection = {"base": answer_probability(model_dir, dev), "steps": steps, "lr": args.lr, "sft_lr": args.sft_lr,
                 "runs": {}}
    for arm in args.arms:
        for seed in args.seeds[arm]:
            run = run_dir(out, "sft" if arm == "sft" else "opsd", arm, seed)
            adapter, _ = train_arm(model_dir, files["train"], train, arm, seed, args, run, save_every=args.curve_every)
            selection["runs"][f"{arm} seed {seed}"] = [
                answer_probability(model_dir, dev, adapter if step == args.steps else run / f"checkpoint-{step}")
                for step in steps]
    (out / "selection.json").write_text(json.dumps(selection, indent=2) + "\n")
    print(f"dev: probability of the exact answer in % (base {100 * selection['base']:.2f}), "
          f"lr {args.lr:g} (sft {args.sft_lr:g})\n{'step':<16}" + "".join(f"{s:>8}" for s in steps))
    for name, points in selection["runs"].items():
        print(f"{name:<16}" + "".join(f"{100 * v:>8.2f}" for v in points))
    return selection


def log_path(run, tag=""):
    """<run>.log next to the run's directory (<run>.<tag>.log for a resumed piece); not with_suffix: "tau0.5"."""
    return run.parent / f"{run.name}{'.' + tag if tag else ''}.log"


def run_dir(out, kind, arm, seed):
    return out / f"{kind}-{arm.replace('@', '-tau')}-s{seed}"


# -----------------------------------------------------------------------------
# Report: statistics, table and figures

T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}  # Student t


def summarize(values, base, base_stderr):
    """Mean over seeds, the half-width of its 95% interval (Student t over seeds; None with one seed), and the
    difference to the base model with the half-width of its interval (the seeds' and the base score's errors)."""
    k, mean = len(values), sum(values) / len(values)
    if k < 2:
        return {"mean": mean, "ci95": None, "vs_base": mean - base, "vs_base_ci95": None}
    sem = (sum((v - mean) ** 2 for v in values) / (k - 1) / k) ** 0.5
    half = T_975.get(k - 1, 1.96) * sem
    return {"mean": mean, "ci95": half, "vs_base": mean - base,
            "vs_base_ci95": (half ** 2 + (1.96 * base_stderr) ** 2) ** 0.5}


def format_table(results):
    split = results["split"]
    scores, base = results[f"{split}_avg"], results[f"{split}_avg"]["base"]
    w = max(10, *(len(arm) + 1 for arm in results["arms"]))  # the first column fits the longest arm name
    lines = [f"{split} avg@{results['n']} in % ({results['problems']} problems x {results['n']} samples per model; "
             f"base standard error {100 * results['base_stderr']:.1f}); 95% intervals over seeds",
             f"{'arm':<{w}}{'seeds':>6}{'mean':>7}{'95% interval':>15}{'vs base':>17}   per seed",
             f"{'base':<{w}}{'':>6}{100 * base:>7.1f}"]
    for arm in results["arms"]:
        s = results["stats"][arm]
        interval = f"{100 * (s['mean'] - s['ci95']):.1f}..{100 * (s['mean'] + s['ci95']):.1f}" if s["ci95"] else "-"
        diff = f"{100 * s['vs_base']:+.1f}" + (f" +- {100 * s['vs_base_ci95']:.1f}" if s["vs_base_ci95"] else "")
        per_seed = "  ".join(f"{100 * v:.1f}" for v in scores[arm])
        lines.append(f"{arm:<{w}}{len(scores[arm]):>6}{100 * s['mean']:>7.1f}{interval:>15}{diff:>17}   {per_seed}")
    return "\n".join(lines)


COLORS = {"token": "tab:blue", "none": "tab:green", "sft": "tab:red", "none-wrong": "peru", "none-control": "silver",
          "entry": "tab:orange", "control": "tab:gray", "wrong": "tab:brown", "token@0.5": "tab:cyan",
          "token@2": "navy", "entry@0.5": "gold", "entry@2": "tab:olive"}


def figure_titles(results):
    """(the accuracy panel's title, the figure's title or None): a one-seed run shows no means, a quick run says so."""
    arms, scores = results["arms"], results[f"{results['split']}_avg"]
    if any(len(scores[arm]) > 1 for arm in arms):
        left = "accuracy per arm (bars: mean over seeds, dots: seeds)"
    else:
        seeds = sorted({results["seeds"][arm][0] for arm in arms})
        left = f"accuracy per arm: one run each (seed {', '.join(map(str, seeds))})"
    if not results["quick"]:
        return left, None
    return left, f"quick variant (--quick): one seed, avg@{results['n']}; not the full experiment"


def plot(results, out_dir, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms, split = results["arms"], results["split"]
    scores = results[f"{split}_avg"]
    left_title, suptitle = figure_titles(results)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    left.axhline(100 * scores["base"], color="black", linestyle="--", label="base model")
    for x, arm in enumerate(arms):
        values = [100 * v for v in scores[arm]]
        left.bar(x, sum(values) / len(values), color=COLORS[arm], alpha=0.5)
        if len(values) > 1:
            left.scatter([x] * len(values), values, color=COLORS[arm], zorder=3, s=12)
    left.set_xticks(range(len(arms)), arms, rotation=40, ha="right", rotation_mode="anchor")
    left.set_ylabel(f"{split} avg@{results['n']} (%)")
    left.set_title(left_title)
    left.margins(y=0.2)  # room above the highest seed for the legend
    left.legend(loc="upper right")
    for arm in arms:
        if ARMS[arm] is None:
            continue  # sft has no teacher, so no KL
        for k, seed in enumerate(results["seeds"][arm]):
            records = [json.loads(line) for line in
                       (run_dir(out_dir, "opsd", arm, seed) / "metrics.jsonl").read_text().splitlines()]
            right.plot([r["step"] for r in records], [r["kl_mean"] for r in records], color=COLORS[arm],
                       alpha=0.7, label=arm if k == 0 else None)
    right.set_xlabel("optimizer step")
    right.set_ylabel("kl_mean: KL(T||S), last ~512 answer tokens")
    right.set_yscale("log")
    right.set_title("teacher-student KL during training (opsd.py arms)")
    if right.lines:
        right.legend(fontsize=8)
    if suptitle:
        fig.suptitle(suptitle)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_curves(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = results["dev_curves"]
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for arm, points in curves["arms"].items():
        steps = [0] + [p[0] for p in points]
        ax.plot(steps, [100 * curves["base"]] + [100 * p[1] for p in points], marker="o", color=COLORS[arm],
                label=f"{arm} (seed {curves['seed'][arm]})")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(f"dev avg@{curves['n']} (%)")
    ax.set_title("dev accuracy along training (one seed; step 0: base model)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -----------------------------------------------------------------------------
# The port-check fixture: step-1 rollouts of the shipped model and their loss, as opsd.py computes them


REFERENCE_SEED, REFERENCE_TEMPERATURE, REFERENCE_TAU, REFERENCE_BETA = 1, 1.1, 0.05, 0.0


def model_digest(model_dir):
    return hashlib.sha256((Path(model_dir) / "model.safetensors").read_bytes()).hexdigest()[:16]


@torch.no_grad()
def step_figures(model_dir, rows, *, temperature, tau, beta):
    """{clip: {loss, kl_mean, kl_clipped_teacher_mass}} of one optimizer step over `rows` from the unchanged
    model (LoRA B = 0, so student and teacher are both the base model), through opsd.py's functions: loss is
    the sum of the clipped per-position divergence over all completion positions divided by their number;
    kl_mean and kl_clipped_teacher_mass are the means over the same positions of divergence_stats."""
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
        figures[clip] = {"loss": loss.item(), "kl_mean": stats[:, 0].mean().item(),
                         "kl_clipped_teacher_mass": stats[:, 1].mean().item()}
    return figures


def write_reference_step(path, model_dir=SHIPPED_MODEL, seed=REFERENCE_SEED):
    """Sample one step's rollouts from the model the way opsd.py's first step does (its data order, engine
    settings and per-request seeds for --seed `seed`), compute their figures, write the fixture."""
    from transformers import AutoTokenizer

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    train = make_task()[0]
    tok = AutoTokenizer.from_pretrained(model_dir)
    args = opsd.parse_args(["--model", str(model_dir), "--dataset", "unused", "--seed", str(seed),
                            "--loss-temperature", str(REFERENCE_TEMPERATURE), *OPSD_FLAGS])
    prompts = opsd.build_prompts(tok, [(r["problem"], r["solution"]) for r in train], student_thinking=False,
                                 teacher_thinking=True, max_prompt_length=args.max_prompt_length)
    indices = opsd.step_indices(0, PROMPTS_PER_STEP, len(prompts), seed)
    sampling_seeds = [(seed * 1_000_003 + j) % 2**31 for j in range(PROMPTS_PER_STEP)]  # opsd.py's, step 0
    llm = opsd.start_engine(args, 0, 1, torch.device("cpu"))
    completions, _ = opsd.sample(llm, [prompts[i][0] for i in indices], sampling_seeds, args)
    opsd.stop_engine(llm)
    rows = [{"student_prompt_ids": prompts[i][0], "teacher_prompt_ids": prompts[i][1], "completion_ids": c}
            for i, c in zip(indices, completions)]
    settings = {"temperature": REFERENCE_TEMPERATURE, "tau": REFERENCE_TAU, "beta": REFERENCE_BETA}
    expected = step_figures(model_dir, rows, **settings)
    header = {
        "about": "Step-1 rollouts of the shipped miniature model (opsd.py --seed 1 with tests/miniature.py's "
                 "settings) and the figures opsd.py computes for them with LoRA B = 0 (student and teacher both "
                 "the unchanged model, float32). loss: sum over completion positions of the clipped per-position "
                 "divergence / number of positions. kl_mean: mean over the positions of KL(p_T || p_S) at the "
                 "loss temperature. kl_clipped_teacher_mass: mean over the positions of the teacher's probability "
                 "on entries with p_T(v) (log p_T(v) - log p_S(v)) > tau. A position predicts a completion token "
                 "from the prompt and the completion tokens before it, at positions 0, 1, 2, ... from the "
                 "prompt's first token.",
        "model": str(Path(model_dir).relative_to(ROOT)) if Path(model_dir).is_relative_to(ROOT) else str(model_dir),
        "model_sha256_16": model_digest(model_dir), "positions": sum(map(len, completions)),
        "settings": settings, "expected": expected}
    # one row per line: the file stays readable and diffs stay small
    text = json.dumps(header, indent=1)[:-2] + ',\n "rows": [\n' + ",\n".join(json.dumps(r) for r in rows) + "\n ]\n}\n"
    Path(path).write_text(text)
    print(json.dumps(expected, indent=1))
    print(f"{len(rows)} rows, {header['positions']} positions -> {path}")


# -----------------------------------------------------------------------------
# The run


# what a resumed run must share with the run it continues (the rest only say where and how to write)
RESULT_FLAGS = ("arms", "seeds", "split", "curves", "curve_every", "curve_n", "steps", "lr", "sft_lr", "n",
                "rebuild_model", "pretrain_steps", "pretrain_seed", "quick", "full", "select")


def check_resume(out, args):
    """The saved flags of the run in `out` (settings.json), refusing a resume that would mix other settings in."""
    path = out / "settings.json"
    if not path.is_file():
        raise SystemExit(f"--resume: {out} holds no run of this script (no settings.json): drop --resume.")
    saved, now = json.loads(path.read_text()), json.loads(json.dumps({k: vars(args)[k] for k in RESULT_FLAGS}))
    changed = ["--" + k.replace("_", "-") for k in RESULT_FLAGS if saved.get(k) != now[k]]
    if changed:
        raise SystemExit(f"--resume with other {', '.join(changed)} than the run in {out} would mix settings: use "
                         "the same flags, or start another --output-dir.")


def this_machine():
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), None) if Path("/proc/cpuinfo").is_file() else None
    return {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "cpu": cpu, "cores": os.cpu_count(),
            "kernels": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__}


def owned_files(out):
    names = ["data", "model", "results.json", "miniature.png", "curves.png", "settings.json", "timings.json",
             "selection.json"]
    return [out / n for n in names if (out / n).exists()] + sorted(out.glob("eval-*")) + sorted(out.glob("opsd-*")) \
        + sorted(out.glob("sft-*"))


def main(argv=None):
    args = parse_args(argv)
    if args.reference_step:
        return write_reference_step(args.reference_step)
    t_start = time.perf_counter()
    out = Path(args.output_dir)
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
        (out / "settings.json").write_text(json.dumps({k: vars(args)[k] for k in RESULT_FLAGS}, indent=2) + "\n")
    # each invocation's machine: a fixed seed reproduces exactly on one machine only (see the README)
    settings = json.loads((out / "settings.json").read_text())
    settings["invocations"] = settings.get("invocations", []) + [this_machine()]
    (out / "settings.json").write_text(json.dumps(settings, indent=2) + "\n")

    # ---- the task, written in the formats opsd.py and eval.py read
    train, dev, heldout = make_task()
    files = {"train": out / "data" / "train.jsonl", "dev": out / "data" / "dev.jsonl",
             "heldout": out / "data" / "heldout.jsonl"}
    for name, rows in (("train", train), ("dev", dev), ("heldout", heldout)):
        write_jsonl(files[name], rows)

    # ---- the starting model: shipped, or pre-trained now
    if args.rebuild_model:
        model_dir = out / "model"
        if args.resume and (model_dir / TASK_FILE).is_file():
            info = json.loads((model_dir / TASK_FILE).read_text())
        else:
            info = pretrain(model_dir, train, dev, heldout, steps=args.pretrain_steps, seed=args.pretrain_seed)
    else:
        model_dir = SHIPPED_MODEL
        info = json.loads((model_dir / TASK_FILE).read_text())
        if (info.get("train_digest"), info.get("heldout_digest")) != (split_digest(train), split_digest(heldout)):
            raise SystemExit(f"{model_dir} was pre-trained on another split of the task: pass --rebuild-model.")
    print(f"starting model: {model_dir} ({args.split} greedy: "
          + ", ".join(f"{k} {100 * v:.1f}%" for k, v in info[f"{args.split}_greedy"].items()) + ")", flush=True)

    if args.select:
        return select_settings(args, out, model_dir, files, train, dev)

    # ---- base model, then every arm and seed: train, score with eval.py
    scored = files[args.split]
    base, base_stderr, seconds = evaluate(model_dir, scored, args.n, out / "eval-base")
    print(f"base: {args.split} avg@{args.n} {100 * base:.1f} (+-{100 * base_stderr:.1f} s.e.), "
          + (f"eval {seconds:.0f}s" if seconds is not None else "eval kept"), flush=True)
    timings_file = out / "timings.json"  # seconds per piece, kept across resumed invocations
    timings = json.loads(timings_file.read_text()) if args.resume and timings_file.is_file() else {}
    scores = {"base": base}

    def timed(name, seconds):
        if seconds is not None:  # None: the piece was finished before this invocation
            timings[name] = round(seconds, 1)
            timings_file.write_text(json.dumps(timings, indent=2) + "\n")

    timed("eval-base", seconds)
    curves = {"n": args.curve_n, "every": args.curve_every, "arms": {}, "seed": {}} if args.curves else None
    same_eval = args.split == "dev" and args.n == args.curve_n  # a curve point is then the arm's own score
    if curves:
        if same_eval:
            curves["base"] = base
        else:
            curves["base"], _, seconds = evaluate(model_dir, files["dev"], args.curve_n, out / "eval-curve-base")
            timed("eval-curve-base", seconds)
    for arm in args.arms:
        scores[arm] = []
        for k, seed in enumerate(args.seeds[arm]):
            kind = "sft" if arm == "sft" else "opsd"
            run = run_dir(out, kind, arm, seed)
            with_curve = curves is not None and arm in CURVE_ARMS and k == 0
            adapter, train_s = train_arm(model_dir, files["train"], train, arm, seed, args, run,
                                         save_every=args.curve_every if with_curve else 0)
            timed(run.name, train_s)
            avg, stderr, eval_s = evaluate(model_dir, scored, args.n, run_dir(out, "eval", arm, seed), adapter)
            timed(f"eval-{run.name}", eval_s)
            scores[arm].append(avg)
            print(f"{arm} seed {seed}: {args.split} avg@{args.n} {100 * avg:.1f} (+-{100 * stderr:.1f} s.e.)"
                  + (f", training {train_s:.0f}s" if train_s is not None else ", training kept")
                  + (f", eval {eval_s:.0f}s" if eval_s is not None else ", eval kept"), flush=True)
            if with_curve:
                points = []
                for step in range(args.curve_every, args.steps + 1, args.curve_every):
                    if step == args.steps and same_eval:
                        points.append([step, avg])
                        continue
                    checkpoint = adapter if step == args.steps else run / f"checkpoint-{step}"
                    dev_avg, _, eval_s = evaluate(model_dir, files["dev"], args.curve_n,
                                                  out / f"eval-curve-{run.name}-step{step}", checkpoint)
                    points.append([step, dev_avg])
                    timed(f"eval-curve-{run.name}-step{step}", eval_s)
                curves["arms"][arm], curves["seed"][arm] = points, seed
                print(f"{arm} seed {seed}: dev avg@{args.curve_n} every {args.curve_every} steps: "
                      + ", ".join(f"{s} {100 * a:.1f}" for s, a in points), flush=True)

    # ---- results
    problems = len(heldout if args.split == "heldout" else dev)
    results = {f"{args.split}_avg": scores, "split": args.split, "problems": problems,
               "samples_per_model": problems * args.n,
               "n": args.n, "arms": args.arms, "seeds": args.seeds, "steps": args.steps, "lr": args.lr,
               "sft_lr": args.sft_lr, "base_stderr": base_stderr, "quick": args.quick, "full": args.full,
               "stats": {arm: summarize(scores[arm], base, base_stderr) for arm in args.arms},
               "swapped_twins_in_train": {"heldout": swapped_twins(heldout, train), "dev": swapped_twins(dev, train)},
               "model": str(model_dir), "pretrain": info, "dev_curves": curves, "timings": timings,
               "seconds": round(time.perf_counter() - t_start, 1), "resumed": args.resume,
               "seconds_all_pieces": round(sum(timings.values()), 1), "invocations": settings["invocations"]}
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, out, out / "miniature.png")
    if curves:
        plot_curves(results, out / "curves.png")
    print(format_table(results))
    print(f"total {results['seconds']:.0f} s -> {out / 'results.json'}, {out / 'miniature.png'}"
          + (f", {out / 'curves.png'}" if curves else ""))
    return results


if __name__ == "__main__":
    main()
