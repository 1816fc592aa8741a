"""Before renting GPUs: would this opsd.py run start, and what will it cost? On your own CPU, with the
model's config and tokenizer only (no weights, no GPU). A hub id (--model, --dataset) is read from the
hub or its cache; offline, pass a local model directory and data file (budget.py --config reads a
config.json alone).

    python tests/gpu_check/preflight.py --gpu h100 --gpus 4 -- --model Qwen/Qwen3-1.7B --lora-r 64

Everything after `--` is opsd.py's own flags, as the run will be given them. In order:

- flags: opsd.parse_args's checks, with the world size --gpus implies (--prompts-per-step must be
  divisible by ranks x --micro-batch-size);
- model: its config (the hub's config.json, or a local directory's), built on torch's meta device
  (shapes, no memory): the parameters, each decoder layer's LoRA targets (opsd.missing_lora_targets),
  the logit soft-capping and scaling fields, all refused by opsd.check_model itself, run here with
  --device cpu so that this machine's lack of a GPU is not held against the run; and the context
  (max_position_embeddings, a multimodal config's text config's) against --max-prompt-length +
  --max-new-tokens, checked here;
- data: the dataset read by opsd.load_rows (a local .json, .jsonl or .parquet file, or a hub id),
  --teacher-context applied (opsd.shown_contexts), every row's student and teacher prompt rendered with
  the model's tokenizer and chat template as opsd.py renders them (opsd.render); the rows kept and
  dropped by --max-prompt-length (a row is kept when both its prompts fit), and each side's prompt
  lengths over all rows read: p50, p90, p99 (nearest rank: the smallest length at least that share of
  rows do not exceed) and the longest;
- the chat template: each side's first prompt rendered with enable_thinking as the flags set it and
  flipped; a template whose prompts do not change gets a warning (the run still starts);
- the first row's student and teacher prompts, decoded whole (special tokens shown);
- the budget: tests/gpu_check/budget.py's memory per GPU and hours on --gpus x --gpu, its prompt
  lengths taken from the data: the expected longest kept prompt of a micro-batch of rows drawn at
  random (a micro-batch is padded to its longest row), each side.

Exit status 0 when opsd.py would start (before it writes --output-dir, which is on the rented machine
and not checked here); 2, each reason in one sentence on stderr ("preflight.py: error: ..."), when
opsd.py would refuse it, no row fits, or budget.py says it does not fit.
"""

import argparse
import contextlib
import io
import math
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]
import budget  # noqa: E402
from eval import use_cache_if_hub_silent  # noqa: E402
import opsd  # noqa: E402

LOGIT_FIELDS = ("final_logit_softcapping", "logit_scale", "logits_scaling")  # as opsd.check_model
# More passes over the kept rows than this, and the student is trained on the same problems again and
# again: a warning
PASSES_WARNED = 3


def refuse(message):
    """argparse's refusals of preflight.py's own flags: one sentence, exit status 2."""
    print(f"preflight.py: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def parse_own(argv):
    p = argparse.ArgumentParser(
        prog="preflight.py",
        description="Would an opsd.py run start, and its memory and hours, checked on a CPU before "
                    "renting GPUs: python tests/gpu_check/preflight.py [--gpu h100 --gpus 4] -- "
                    "<opsd.py's flags>")
    p.error = refuse
    p.add_argument("--gpu", default="h100", choices=list(budget.GPUS),
                   help="the GPU to rent (default: h100, the SXM card)")
    p.add_argument("--gpus", type=budget.AT_LEAST_1, default=4,
                   help="GPUs of the run, one rank each (default: 4)")
    p.add_argument("--gpu-gib", type=budget.POSITIVE,
                   help="memory of one GPU, GiB (default: --gpu's)")
    return p.parse_args(argv)


def nearest_rank(sorted_values, share):
    """The smallest value that at least `share` of the values do not exceed."""
    return sorted_values[max(1, math.ceil(share * len(sorted_values))) - 1]


def expected_longest(lengths, rows):
    """E[max] of `rows` lengths drawn at random (with replacement) from `lengths`."""
    ordered, n = sorted(lengths), len(lengths)
    return sum(v * ((k / n) ** rows - ((k - 1) / n) ** rows) for k, v in enumerate(ordered, 1))


def differing(a, b):
    """The parts of two texts between their common beginning and end."""
    start = 0
    while start < min(len(a), len(b)) and a[start] == b[start]:
        start += 1
    end = 0
    while end < min(len(a), len(b)) - start and a[-1 - end] == b[-1 - end]:
        end += 1
    return a[start:len(a) - end], b[start:len(b) - end]


def check_model(args):
    """Print what the config says; ([refusal sentences] (opsd.check_model's), whether the config loads)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    refusals = []
    try:
        opsd.check_model(argparse.Namespace(**{**vars(args), "device": "cpu"}))
    except opsd.Refusal as e:
        refusals.append(str(e))
    except (ValueError, KeyError) as e:  # transformers knows the config but builds no causal LM of it
        return [f"--model {args.model}: transformers builds no causal LM of its config "
                f"({str(e).splitlines()[0]}); choose a causal LM."], True
    try:
        config = AutoConfig.from_pretrained(args.model)
    except (OSError, ValueError):
        return refusals, False  # opsd.check_model said why
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    layers = getattr(config.get_text_config(), "num_hidden_layers", None)
    n = skeleton.num_parameters()
    print(f"model: {args.model} ({config.model_type}, {type(skeleton).__name__}): "
          f"{f'{n / 1e9:.2f}B' if n >= 1e8 else f'{n:,}'} parameters, {layers} decoder layers")
    missing = opsd.missing_lora_targets(skeleton)
    if missing:
        print(f"  LoRA targets: {missing}")
    else:
        print(f"  LoRA targets: all {layers} decoder layers hold {', '.join(opsd.LORA_TARGETS)} "
              "as linear layers")
    logits = {f: getattr(config, f) for f in LOGIT_FIELDS if getattr(config, f, None) is not None}
    print(f"  logits: {', '.join(f'{k} = {v}' for k, v in logits.items()) or 'no soft-capping or scaling'} "
          f"in the config")
    # the context (a multimodal config keeps it in its text config): a prompt and its answer must fit
    context = getattr(config.get_text_config(), "max_position_embeddings", None)
    needed = args.max_prompt_length + args.max_new_tokens
    if context:
        print(f"  context: {context:,} tokens; --max-prompt-length + --max-new-tokens = {needed:,}")
    else:
        print(f"  context: the config names none (max_position_embeddings); --max-prompt-length + "
              f"--max-new-tokens = {needed:,} not checked")
    if context and needed > context:
        refusals.append(f"--max-prompt-length {args.max_prompt_length} + --max-new-tokens "
                        f"{args.max_new_tokens} exceeds the model's context of {context} tokens: "
                        "lower one of them.")
    return list(dict.fromkeys(refusals)), True  # once, should opsd.check_model say it too


def render_rows(args):
    """(tokenizer, rows as the teacher sees them, student ids, teacher ids), or a refusal."""
    from transformers import AutoTokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    except (OSError, ValueError) as e:
        raise opsd.Refusal(f"--model {args.model}: cannot load its tokenizer "
                           f"({str(e).splitlines()[0]}); pass a model directory or hub id that has one.")
    rows = opsd.load_rows(args.dataset, args.dataset_split, args.problem_column, args.context_column,
                          args.data_select)
    rows = opsd.shown_contexts(rows, args.teacher_context, args.seed)
    student = [opsd.render(tokenizer, opsd.student_message(p, args.student_prompt), args.student_thinking)
               for p, _ in rows]
    teacher = [opsd.render(tokenizer, opsd.teacher_message(p, c), args.teacher_thinking) for p, c in rows]
    return tokenizer, rows, student, teacher


def check_thinking(args, tokenizer, rows):
    """Each side's first prompt with enable_thinking as set and flipped; a warning if nothing changes."""
    problem, context = rows[0]
    sides = (("student", opsd.student_message(problem, args.student_prompt), args.student_thinking),
             ("teacher", opsd.teacher_message(problem, context), args.teacher_thinking))
    ignored = True
    for side, message, thinking in sides:
        as_set, flipped = (tokenizer.decode(opsd.render(tokenizer, message, t)) for t in (thinking, not thinking))
        flag = f"--{'' if thinking else 'no-'}{side}-thinking"
        if as_set == flipped:
            print(f"  {side} ({flag}): the same prompt with enable_thinking {not thinking}")
            continue
        ignored = False
        mine, other = differing(as_set, flipped)
        print(f"  {side} ({flag}): renders {mine!r} where enable_thinking={not thinking} renders {other!r}")
    if ignored:
        print(f"warning: the chat template of --model {args.model} ignores enable_thinking (its prompts render "
              "the same with it on and off), so --student-thinking and --teacher-thinking change nothing: "
              "the student is not put in a non-thinking mode, both sides are in the template's one mode; use "
              "a model whose template honours it (Qwen3's) if the recipe's modes matter.")


def show(title, tokenizer, ids):
    text = tokenizer.decode(ids)
    print(f"{title} ({len(ids)} tokens), whole:")
    print("-" * 80)
    print(text, end="" if text.endswith("\n") else "\n")
    print("-" * 80)


def check_data(args):
    """Print the data's figures; ([refusals], the budget's prompt lengths or None)."""
    tokenizer, rows, student, teacher = render_rows(args)
    limit = args.max_prompt_length
    kept = [i for i in range(len(rows)) if max(len(student[i]), len(teacher[i])) <= limit]
    print(f"data: --dataset {args.dataset}: {len(rows):,} rows read, {len(kept):,} kept, "
          f"{len(rows) - len(kept):,} dropped as longer than --max-prompt-length {limit:,}")
    print(f"  {'prompt tokens':14s} {'p50':>8s} {'p90':>8s} {'p99':>8s} {'max':>8s}   (all rows read)")
    for side, ids in (("student", student), ("teacher", teacher)):
        lengths = sorted(len(x) for x in ids)
        cells = [nearest_rank(lengths, s) for s in (0.5, 0.9, 0.99)] + [lengths[-1]]
        print(f"  {side:14s} " + " ".join(f"{c:8d}" for c in cells))
    if kept:
        passes = args.max_steps * args.prompts_per_step / len(kept)
        print(f"  {args.max_steps} steps x {args.prompts_per_step} prompts = {passes:.2f} passes over the "
              "kept rows")
        if passes > PASSES_WARNED:
            print(f"warning: the run trains on each kept row about {passes:.0f} times (more than "
                  f"{PASSES_WARNED}): a few rows repeated are learnt by heart; give --dataset more rows, "
                  "or lower --max-steps or --prompts-per-step.")
    print("chat template (enable_thinking):")
    check_thinking(args, tokenizer, rows)
    show(f"first student prompt (row 1, --student-prompt {args.student_prompt})", tokenizer, student[0])
    show(f"first teacher prompt (row 1, --teacher-context {args.teacher_context})", tokenizer, teacher[0])
    if not kept:
        return [f"No row fits --max-prompt-length {limit}: raise it."], None  # opsd.build_prompts's
    m = args.micro_batch_size
    return [], [round(expected_longest([len(ids[i]) for i in kept], m)) for ids in (student, teacher)]


def run_budget(own, flags, prompt_lengths):
    """budget.py's memory and hours, its prompt lengths from the data; [refusals]."""
    argv = ["--gpu", own.gpu, "--gpus", str(own.gpus)]
    if own.gpu_gib:
        argv += ["--gpu-gib", str(own.gpu_gib)]
    student, teacher = prompt_lengths
    argv += ["--prompt-tokens", str(student), "--teacher-prompt-tokens", str(teacher), "--", *flags]
    print(f"budget: python tests/gpu_check/budget.py {' '.join(argv)}")
    print(f"  (--prompt-tokens, --teacher-prompt-tokens: the expected longest kept prompt of "
          "--micro-batch-size rows drawn at random)")
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            budget.main(argv)
    except SystemExit:
        pass
    said = [line.split(": ", 1)[1] for line in err.getvalue().splitlines() if line.startswith("budget.py: ")]
    return [f"budget.py: {s.removeprefix('error: ')}" for s in said]


def preflight(own, flags):
    """[refusal sentences]; prints what it checked."""
    try:
        args = opsd.parse_args(flags)
    except opsd.Refusal as e:
        return [str(e)]
    hub = [f"{flag} {value}" for flag, value in (("--model", args.model), ("--dataset", args.dataset))
           if not Path(value).expanduser().exists()]
    if hub:
        print(f"hub: {' and '.join(hub)} read from the Hugging Face hub, or its cache; offline, pass a "
              "local model directory (--model DIR) and data file (--dataset FILE)")
    if "huggingface_hub" not in sys.modules and hub:
        use_cache_if_hub_silent()  # a hub id: its files, or the cache's
    per_rank = args.prompts_per_step // own.gpus
    print(f"flags: opsd.py's checks pass on {own.gpus} ranks: --prompts-per-step {args.prompts_per_step} = "
          f"{own.gpus} ranks x {per_rank // args.micro_batch_size} micro-batches of --micro-batch-size "
          f"{args.micro_batch_size}")
    refusals, loaded = check_model(args)
    if not loaded:
        return refusals
    try:
        found, lengths = check_data(args)
    except opsd.Refusal as e:
        return refusals + [str(e)]
    refusals += found
    if refusals or lengths is None:
        print("budget: not estimated for a run that is refused")
        return refusals
    return run_budget(own, flags, lengths)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    ours, flags = argv, []
    if "--" in argv:
        ours, flags = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    own = parse_own(ours)
    world_size = opsd.WORLD_SIZE
    opsd.WORLD_SIZE = own.gpus  # what torchrun will set on every rank
    try:
        refusals = preflight(own, flags)
    finally:
        opsd.WORLD_SIZE = world_size
    sys.stdout.flush()
    for sentence in refusals:
        print(f"preflight.py: error: {sentence}", file=sys.stderr, flush=True)
    if refusals:
        return 2
    print(f"preflight: the run can start on {own.gpus} x {budget.GPUS[own.gpu]['name']}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
