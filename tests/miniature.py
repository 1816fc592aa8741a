"""OPSD in miniature: watch training through opsd.py make a small model better, on a 2-core CPU.

    python tests/miniature.py --output-dir runs/miniature                  # full run: 3 arms x 3 seeds
    python tests/miniature.py --output-dir runs/miniature-quick --quick    # what the test suite runs
    python tests/miniature.py --output-dir runs/miniature --rebuild-model  # pre-train the model from scratch first

The task is 2-digit addition ("37+45", answer 82; every digit is one token): all 8,100 pairs of
10..99, split once by a fixed seed into 7,700 training problems and 400 held-out ones. The model is a
0.8M-parameter Qwen3 pre-trained here, with plain PyTorch (full weights, loss on the answer tokens
only), on the training split in four prompt formats, each rendered by the builders opsd.py and
eval.py use:
  1. opsd.py's student prompt (thinking off),
  2. eval.py's prompt (thinking on),
  3. opsd.py's teacher prompt with the reference solution "37+45=82" (thinking on),
  4. the teacher prompt with an empty reference, so a teacher without privileged information answers
     like the student instead of being lost (the control arm's teacher).
It stops while the student is clearly imperfect and the teacher with the solution near perfect. The
pre-trained model ships in tests/data/miniature/model, so a run starts from it; --rebuild-model
pre-trains a fresh one (about 7 minutes on 2 cores; the time is printed) and uses that instead.

Then, from the same starting model, with every seed:
  token    opsd.py --clip token, the teacher sees the solution
  entry    opsd.py --clip entry, the teacher sees the solution
  control  opsd.py --clip token, the teacher's context column is empty (no privileged information)
and eval.py scores the base model and every adapter on the held-out split (avg@n at temperature 1.0).
Both scripts run unchanged, through their command lines, one process at a time.

Writes <output-dir>/results.json, <output-dir>/miniature.png (held-out accuracy per arm, kl_mean per
step) and prints the table. Every opsd.py / eval.py run gets its own fresh sub-directory; a second
run into the same --output-dir is refused unless --overwrite clears this script's sub-directories.
"""

import argparse
import hashlib
import json
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
import opsd  # noqa: E402  (opsd.py: its prompt builders and LR schedule)
from make_tiny_model import CHAT_TEMPLATE, SPECIAL_TOKENS  # noqa: E402

SHIPPED_MODEL = TESTS / "data" / "miniature" / "model"
TASK_FILE = "miniature.json"  # next to the model: the split it was pre-trained on, and how well it does
ARMS = {  # arm: (opsd.py --clip, --context-column)
    "token": ("token", "solution"),
    "entry": ("entry", "solution"),
    "control": ("token", "no_solution"),
}
# opsd.py's settings for every arm (the seed and the arm's own flags are added per run)
# (lr 5e-3 with 64 prompts per step; measured: 1e-2 breaks the answer format and drops the accuracy to 0)
OPSD_FLAGS = ["--device", "cpu", "--dtype", "float32", "--lr", "5e-3", "--lora-r", "16", "--lora-alpha", "32",
              "--prompts-per-step", "64", "--micro-batch-size", "64", "--max-new-tokens", "32",
              "--max-prompt-length", "256", "--no-gradient-checkpointing", "--save-every", "0",
              "--log-rollouts-every", "50", "--kl-window", "512"]
EVAL_MAX_NEW_TOKENS = 32

# -----------------------------------------------------------------------------
# Config


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="OPSD in miniature: 2-digit addition, a 0.8M-parameter Qwen3, "
                                            "opsd.py's arms against a control, scored by eval.py.")
    p.add_argument("--output-dir", required=True, help="results.json, miniature.png and one directory per run")
    p.add_argument("--seeds", default=None, help="comma-separated opsd.py seeds (default 1,2,3; --quick: 1)")
    p.add_argument("--quick", action="store_true",
                   help="the test suite's variant: the token arm only, one seed, 2 samples per problem")
    p.add_argument("--arms", default=None, help=f"comma-separated arms from {', '.join(ARMS)} (default: all; --quick: token)")
    p.add_argument("--steps", type=int, default=150, help="opsd.py --max-steps")
    p.add_argument("--n", type=int, default=None, help="eval.py samples per held-out problem (default 4; --quick: 2)")
    p.add_argument("--rebuild-model", action="store_true",
                   help=f"pre-train the model from scratch into <output-dir>/model instead of using {SHIPPED_MODEL.relative_to(ROOT)}")
    p.add_argument("--pretrain-steps", type=int, default=600, help="pre-training steps (with --rebuild-model)")
    p.add_argument("--overwrite", action="store_true", help="clear this script's sub-directories of --output-dir first")
    args = p.parse_args(argv)
    seeds = [s.strip() for s in (args.seeds or ("1" if args.quick else "1,2,3")).split(",") if s.strip()]
    if not all(s.isdigit() for s in seeds) or len(set(seeds)) != len(seeds):
        p.error(f"--seeds takes distinct non-negative integers separated by commas, got {args.seeds!r}.")
    args.seeds = [int(s) for s in seeds]
    args.arms = [a.strip() for a in (args.arms or ("token" if args.quick else ",".join(ARMS))).split(",") if a.strip()]
    args.n = args.n or (2 if args.quick else 4)
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown:
        p.error(f"unknown arm(s) {', '.join(unknown)}: choose from {', '.join(ARMS)}.")
    if not args.seeds or args.steps < 1 or args.n < 1 or args.pretrain_steps < 1:
        p.error("--seeds needs at least one seed; --steps, --n and --pretrain-steps must be positive.")
    if not args.rebuild_model and not (SHIPPED_MODEL / "config.json").is_file():
        p.error(f"no shipped model in {SHIPPED_MODEL}: pass --rebuild-model to pre-train one.")
    return args


# -----------------------------------------------------------------------------
# The task: 2-digit addition, one fixed split

TASK_SEED, NUM_HELDOUT = 0, 400


def make_task():
    """(train rows, held-out rows): every a+b with 10 <= a, b <= 99, shuffled by a fixed seed.

    Train rows are opsd.py's format plus an empty-string column for the control arm's teacher;
    held-out rows are eval.py's format.
    """
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(TASK_SEED).shuffle(pairs)
    rows = [{"problem": f"{a}+{b}", "solution": f"{a}+{b}={a + b}", "answer": str(a + b)} for a, b in pairs]
    train = [{**r, "no_solution": ""} for r in rows[NUM_HELDOUT:]]
    heldout = [{"problem": r["problem"], "answer": r["answer"]} for r in rows[:NUM_HELDOUT]]
    return train, heldout


def split_digest(heldout):
    """Fingerprint of the held-out problems, stored with the model so a changed split is caught."""
    return hashlib.sha256("\n".join(r["problem"] for r in heldout).encode()).hexdigest()[:16]


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


def pretrain(out_dir, train, heldout, *, steps, lr=2e-3, batch_size=64, warmup=30, seed=0):
    """Pre-train a fresh model on the four-format mix (answer-only next-token loss), save it to out_dir."""
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
        if (step + 1) % 300 == 0 and step + 1 < steps:  # progress only: the student's held-out greedy accuracy
            progress = greedy_accuracy(model, tok, [{**r, "solution": ""} for r in heldout[:200]], formats=("student",))
            print(f"  student greedy accuracy on 200 held-out problems: {100 * progress['student']:.1f}%", flush=True)
    seconds = time.perf_counter() - t0
    print(f"pre-training took {seconds:.0f} s", flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    # the teacher's reference solution for a held-out problem is written the way the training split's is
    accuracy = greedy_accuracy(model, tok, [{**r, "solution": f"{r['problem']}={r['answer']}"} for r in heldout])
    print("held-out greedy accuracy after pre-training: "
          + ", ".join(f"{fmt} {100 * a:.1f}%" for fmt, a in accuracy.items()), flush=True)
    info = {"task_seed": TASK_SEED, "heldout_digest": split_digest(heldout), "pretrain_steps": steps, "lr": lr,
            "batch_size": batch_size, "pretrain_seconds": round(seconds, 1), "heldout_greedy": accuracy}
    (out_dir / TASK_FILE).write_text(json.dumps(info, indent=2) + "\n")
    return info


@torch.no_grad()
def greedy_accuracy(model, tok, rows, batch_size=100, formats=FORMATS):
    """Held-out greedy accuracy of each prompt format (left-padded batches, HF generate)."""
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
# The real scripts, through their command lines, one process at a time


def run_logged(cmd, log_path):
    """Run a command with its output in log_path; stop with the log's tail if it fails."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    if proc.returncode != 0:
        tail = "".join(Path(log_path).read_text().splitlines(keepends=True)[-30:])
        raise SystemExit(f"{tail}\nthis command failed (exit {proc.returncode}), full log in {log_path}:\n"
                         + " ".join(map(str, cmd)))
    return time.perf_counter() - t0


def train_arm(model_dir, train_file, arm, seed, steps, out_dir):
    clip, context = ARMS[arm]
    cmd = [sys.executable, str(ROOT / "opsd.py"), "--model", str(model_dir), "--dataset", str(train_file),
           "--clip", clip, "--context-column", context, "--max-steps", str(steps), "--seed", str(seed),
           "--output-dir", str(out_dir), *OPSD_FLAGS]
    seconds = run_logged(cmd, out_dir.with_suffix(".log"))
    return out_dir / "final", seconds


def evaluate(model_dir, heldout_file, n, out_dir, adapter=None):
    """eval.py's avg@n on the held-out split, and its standard error over problems."""
    cmd = [sys.executable, str(ROOT / "eval.py"), "--model", str(model_dir), "--data", f"heldout={heldout_file}",
           "--n", str(n), "--max-new-tokens", str(EVAL_MAX_NEW_TOKENS), "--dtype", "float32", "--enforce-eager",
           "--output-dir", str(out_dir)] + (["--adapter", str(adapter)] if adapter else [])
    seconds = run_logged(cmd, out_dir.with_suffix(".log"))
    avg = json.loads((out_dir / "summary.json").read_text())["metrics"]["heldout"][f"avg@{n}"]
    per_problem = {}
    for line in (out_dir / "samples.jsonl").read_text().splitlines():
        s = json.loads(line)
        per_problem.setdefault(s["problem"], []).append(s["correct"])
    means = [sum(c) / len(c) for c in per_problem.values()]
    stderr = (sum((m - avg) ** 2 for m in means) / (len(means) - 1) / len(means)) ** 0.5
    return avg, stderr, seconds


# -----------------------------------------------------------------------------
# Report: table and figure


def mean_std(values):
    mean = sum(values) / len(values)
    std = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5 if len(values) > 1 else 0.0
    return mean, std


def format_table(results):
    heldout, base = results["heldout_avg"], results["heldout_avg"]["base"]
    lines = [f"held-out avg@{results['n']} ({results['samples_per_model']} samples per model; "
             f"base standard error {100 * results['base_stderr']:.1f} points)",
             f"{'arm':<9}{'mean':>7}{'spread':>9}{'vs base':>9}   per seed"]
    lines.append(f"{'base':<9}{100 * base:>7.1f}{'':>9}{'':>9}")
    for arm in results["arms"]:
        mean, std = mean_std(heldout[arm])
        per_seed = "  ".join(f"{100 * v:.1f}" for v in heldout[arm])
        lines.append(f"{arm:<9}{100 * mean:>7.1f}{'+-' + format(100 * std, '.1f'):>9}{100 * (mean - base):>+9.1f}   {per_seed}")
    return "\n".join(lines)


def plot(results, out_dir, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms, heldout = results["arms"], results["heldout_avg"]
    colors = {"token": "tab:blue", "entry": "tab:orange", "control": "tab:gray"}
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.axhline(100 * heldout["base"], color="black", linestyle="--", label="base model")
    for x, arm in enumerate(arms):
        values = [100 * v for v in heldout[arm]]
        left.bar(x, sum(values) / len(values), color=colors[arm], alpha=0.5)
        left.scatter([x] * len(values), values, color=colors[arm], zorder=3)
    left.set_xticks(range(len(arms)), arms)
    left.set_ylabel(f"held-out avg@{results['n']} (%)")
    left.set_title("accuracy per arm (bars: mean, dots: seeds)")
    left.legend(loc="upper right")
    for arm in arms:
        for k, seed in enumerate(results["seeds"]):
            records = [json.loads(l) for l in (out_dir / f"opsd-{arm}-s{seed}" / "metrics.jsonl").read_text().splitlines()]
            right.plot([r["step"] for r in records], [r["kl_mean"] for r in records], color=colors[arm],
                       alpha=0.7, label=arm if k == 0 else None)
    right.set_xlabel("opsd.py step")
    right.set_ylabel("kl_mean: KL(T||S), last ~512 answer tokens")
    right.set_yscale("log")
    right.set_title("teacher-student KL during training")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -----------------------------------------------------------------------------
# The run


def main(argv=None):
    args = parse_args(argv)
    t_start = time.perf_counter()
    out = Path(args.output_dir)
    owned = ["data", "model", "results.json", "miniature.png"] + [p.name for p in out.glob("eval-*")] + \
            [p.name for p in out.glob("opsd-*")]
    present = [name for name in owned if (out / name).exists()]
    if present and not args.overwrite:
        raise SystemExit(f"{out} already holds a run ({', '.join(sorted(present)[:4])}...): "
                         "pass --overwrite to start over, or choose another --output-dir.")
    for name in present:
        path = out / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    out.mkdir(parents=True, exist_ok=True)

    # ---- the task, written in the formats opsd.py and eval.py read
    train, heldout = make_task()
    train_file, heldout_file = out / "data" / "train.jsonl", out / "data" / "heldout.jsonl"
    write_jsonl(train_file, train)
    write_jsonl(heldout_file, heldout)

    # ---- the starting model: shipped, or pre-trained now
    if args.rebuild_model:
        model_dir = out / "model"
        info = pretrain(model_dir, train, heldout, steps=args.pretrain_steps)
    else:
        model_dir = SHIPPED_MODEL
        info = json.loads((model_dir / TASK_FILE).read_text())
        if info["heldout_digest"] != split_digest(heldout):
            raise SystemExit(f"{model_dir} was pre-trained on another split of the task: pass --rebuild-model.")
    print(f"starting model: {model_dir} (held-out greedy: "
          + ", ".join(f"{k} {100 * v:.1f}%" for k, v in info["heldout_greedy"].items()) + ")", flush=True)

    # ---- base model, then every arm and seed: train with opsd.py, score with eval.py
    base, base_stderr, seconds = evaluate(model_dir, heldout_file, args.n, out / "eval-base")
    print(f"base: avg@{args.n} {100 * base:.1f} (+-{100 * base_stderr:.1f} s.e.), eval {seconds:.0f}s", flush=True)
    heldout_avg, timings = {"base": base}, {"eval-base": round(seconds, 1)}
    for arm in args.arms:
        heldout_avg[arm] = []
        for seed in args.seeds:
            adapter, train_s = train_arm(model_dir, train_file, arm, seed, args.steps, out / f"opsd-{arm}-s{seed}")
            avg, stderr, eval_s = evaluate(model_dir, heldout_file, args.n, out / f"eval-{arm}-s{seed}", adapter)
            heldout_avg[arm].append(avg)
            timings[f"opsd-{arm}-s{seed}"], timings[f"eval-{arm}-s{seed}"] = round(train_s, 1), round(eval_s, 1)
            print(f"{arm} seed {seed}: avg@{args.n} {100 * avg:.1f} (+-{100 * stderr:.1f} s.e.), "
                  f"opsd.py {train_s:.0f}s, eval {eval_s:.0f}s", flush=True)

    # ---- results
    results = {"heldout_avg": heldout_avg, "samples_per_model": len(heldout) * args.n,
               "seconds": round(time.perf_counter() - t_start, 1), "n": args.n, "arms": args.arms,
               "seeds": args.seeds, "steps": args.steps, "base_stderr": base_stderr, "quick": args.quick,
               "model": str(model_dir), "pretrain": info, "timings": timings}
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, out, out / "miniature.png")
    print(format_table(results))
    print(f"total {results['seconds']:.0f} s -> {out / 'results.json'}, {out / 'miniature.png'}")
    return results


if __name__ == "__main__":
    main()
