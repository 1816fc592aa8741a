"""
Evaluate a model, or a model plus an adapter written by opsd.py, on AIME24, AIME25 and HMMT25.

    python eval.py --model Qwen/Qwen3-1.7B --output-dir runs/eval-base
    python eval.py --model Qwen/Qwen3-1.7B --adapter runs/opsd/final --output-dir runs/eval-opsd
    python eval.py --model /tmp/tiny-qwen3 --data tiny=tests/data/eval_tiny.jsonl --n 2 \
        --max-new-tokens 48 --enforce-eager --output-dir /tmp/eval-tiny   # CPU smoke run

As the released recipe evaluates (METHOD.md section 8): the prompt is the problem followed by
"Please reason step by step, ..." (no "Problem:" prefix) through the chat template, thinking on,
n samples per problem at temperature 1.0 and top_p 0.95, up to 38,912 new tokens. The answer is
the last \\boxed{...}; it is graded with math_verify (parse + verify, 5 s timeout), falling back
to a normalised string comparison. Over P problems and n samples each:

    avg@n   = correct samples / (P * n)                 (the paper's headline number)
    pass@n  = problems with at least one correct sample / P
    maj@n   = problems whose most common answer is correct / P

Every sample goes to <output-dir>/samples.jsonl as soon as it completes. Each sample has its own
seed, derived from (--seed, benchmark, problem, sample), so a run restarted with the same output
directory draws only the missing samples, and draws the ones an uninterrupted run would have.
summary.json is computed from samples.jsonl alone, so both paths write the same summary.
"""

import argparse
import hashlib
import json
import os
import re
import threading
from collections import Counter, defaultdict
from pathlib import Path

import math_verify

HUB_IDS = {  # METHOD.md section 8
    "aime24": "HuggingFaceH4/aime_2024",
    "aime25": "yentinglin/aime_2025",
    "hmmt25": "MathArena/hmmt_feb_2025",
}
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
GRADING_TIMEOUT_S = 5
# The settings that decide what a sample is: a restart must not mix samples drawn under others.
SAMPLING_KEYS = ("model", "adapter", "thinking", "temperature", "top_p", "max_new_tokens", "seed", "dtype")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    g = p.add_argument_group("model")
    g.add_argument("--model", required=True, help="hub id or local path of the base model")
    g.add_argument("--adapter", default=None,
                   help="LoRA adapter directory written by opsd.py, applied through vLLM's LoRA support")
    g.add_argument("--dtype", default="auto", help="vLLM weight dtype; auto takes the model config's")
    g.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs one vLLM engine is split over")
    g.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="fraction of GPU memory vLLM may take (default: vLLM's own, 0.9)")
    g.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=False,
                   help="skip CUDA graphs / compilation (start-up time; needed for quick CPU runs)")
    g = p.add_argument_group("data")
    g.add_argument("--benchmarks", default=None,
                   help=f"comma-separated names from {', '.join(HUB_IDS)} or given by --data "
                        "(default: the --data names if any, else all three)")
    g.add_argument("--data", action="append", default=[], metavar="NAME=PATH",
                   help="read benchmark NAME from a local .json/.jsonl/.parquet file instead of the hub (repeatable)")
    g.add_argument("--problem-column", default="problem", help="column holding the problem text")
    g.add_argument("--answer-column", default="answer", help="column holding the reference answer")
    g = p.add_argument_group("sampling")
    g.add_argument("--n", type=int, default=12, help="samples per problem")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    g.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling threshold")
    g.add_argument("--max-new-tokens", type=int, default=38912, help="generation budget per sample")
    g.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=True,
                   help="chat template's enable_thinking (--no-thinking for the non-thinking evaluation)")
    g.add_argument("--seed", type=int, default=42, help="root of every per-sample seed")
    p.add_argument("--output-dir", required=True, help="where samples.jsonl, summary.json and config.json go")
    return p.parse_args(argv)


# -----------------------------------------------------------------------------
# Benchmarks and prompts

def benchmark_sources(benchmarks, data):
    """{name: hub id or local path}, failing early on a malformed --data or an unknown name."""
    local = {}
    for item in data:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--data takes NAME=PATH, got '{item}'.")
        if not Path(path).is_file():
            raise SystemExit(f"--data {name}: no file at {path}.")
        local[name] = path
    names = [b.strip() for b in benchmarks.split(",") if b.strip()] if benchmarks else (list(local) or list(HUB_IDS))
    for name in names:
        if name not in local and name not in HUB_IDS:
            raise SystemExit(f"Unknown benchmark '{name}': choose from {', '.join(HUB_IDS)} "
                             f"or give a file with --data {name}=PATH.")
    return {name: local.get(name, HUB_IDS.get(name)) for name in names}


def load_problems(name, source, problem_column, answer_column):
    from datasets import load_dataset

    suffix = Path(source).suffix.lower()
    if Path(source).is_file():
        builder = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}.get(suffix)
        if builder is None:
            raise SystemExit(f"{name}: {source} is not .json, .jsonl or .parquet.")
        rows = load_dataset(builder, data_files=source, split="train")
    else:
        splits = load_dataset(source)  # the three hub sets hold a single split
        rows = splits["test"] if "test" in splits else splits[next(iter(splits))]
    for column in (problem_column, answer_column):
        if column not in rows.column_names:
            raise SystemExit(f"{name}: {source} has no column '{column}' (it has {', '.join(rows.column_names)}); "
                             "name the right one with --problem-column / --answer-column.")
    return [{"problem": r[problem_column], "answer": str(r[answer_column])} for r in rows]


def build_prompt(problem):
    return f"{problem}\n\n{INSTRUCTION}"


def prompt_ids(tokenizer, problem, thinking):
    messages = [{"role": "user", "content": build_prompt(problem)}]
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, enable_thinking=thinking, tokenize=True, return_dict=False
    )


def sample_seed(seed, benchmark, problem, sample):
    # A stable hash (Python's hash() is salted per process), so a restart draws the same sample.
    digest = hashlib.sha256(f"{seed}/{benchmark}/{problem}/{sample}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


# -----------------------------------------------------------------------------
# Resume: samples.jsonl is the only state

def read_samples(path):
    """Records already written, keyed by (benchmark, problem, sample). A line cut by a kill is
    dropped and the file rewritten without it, so new lines are not appended to a fragment."""
    if not path.exists():
        return {}
    done, broken = {}, 0
    for line in path.read_text().splitlines():
        try:
            s = json.loads(line)
            done[s["benchmark"], s["problem"], s["sample"]] = s
        except (json.JSONDecodeError, TypeError, KeyError):
            broken += 1
    if broken:
        print(f"dropping {broken} unreadable line(s) of {path}")
    if broken:  # rewrite through a temporary file, so a kill now cannot lose the good lines
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(s) + "\n" for s in done.values()))
        os.replace(tmp, path)
    return done


def check_config(out_dir, config):
    path = out_dir / "config.json"
    if path.exists():
        old = json.loads(path.read_text())
        changed = [k for k in SAMPLING_KEYS if old.get(k) != config[k]]
        if changed:
            raise SystemExit(f"{out_dir} holds samples drawn with other {', '.join(changed)}: "
                             "use a new --output-dir.")
    path.write_text(json.dumps(config, indent=2) + "\n")


# -----------------------------------------------------------------------------
# Grading: the last \boxed{...}, math_verify, then a string fallback

def extract_boxed(text):
    """Content of the last complete \\boxed{...} (nested braces kept), or None when there is none.

    A trailing box left unclosed (a completion cut at the token budget) is not an answer, so the
    last *closed* box counts.
    """
    answer, start = None, text.find("\\boxed")
    while start != -1:
        i = start + len("\\boxed")
        while i < len(text) and text[i].isspace():
            i += 1
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, len(text)):
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                if depth == 0:
                    answer = text[i + 1 : j]
                    break
        start = text.find("\\boxed", start + 1)
    return answer


def normalize_answer(s):
    """A canonical string for the fallback compare and for majority votes: '\\text{Alice}.' -> 'alice'."""
    s = re.sub(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}", r"\1", s)
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)  # \frac12 -> \frac{1}{2}
    s = re.sub(r"\\left|\\right|\\[,;:! ]|\$", "", s)
    return re.sub(r"\s+", "", s).rstrip(".").lower()


def is_correct(completion, answer):
    predicted = extract_boxed(completion)
    if predicted is None:
        return False
    # math_verify's timeouts are SIGALRM based, which only the main thread may set: elsewhere
    # we run without one rather than have math_verify raise.
    timeout = GRADING_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold = math_verify.parse(f"${answer}$", parsing_timeout=timeout)
    guess = math_verify.parse(f"\\boxed{{{predicted}}}", parsing_timeout=timeout)
    if gold and guess and math_verify.verify(gold, guess, timeout_seconds=timeout):
        return True
    # Answers math_verify cannot read as math (names, words) still match as text.
    return normalize_answer(predicted) == normalize_answer(str(answer))


# -----------------------------------------------------------------------------
# Sampling with vLLM

def start_engine(args):
    """The vLLM engine, and the LoRARequest that applies --adapter to every sample (None without one)."""
    from vllm import LLM
    from vllm.lora.request import LoRARequest

    from vllm.platforms import current_platform

    extra = {}
    if args.gpu_memory_utilization is not None:  # on the CPU build it is a share of RAM: leave it unset there
        extra["gpu_memory_utilization"] = args.gpu_memory_utilization
    if current_platform.is_cpu():
        # When vLLM prefills a prompt in chunks, it samples a token after every chunk but the last,
        # throws it away and rewinds that request's seeded generator with set_offset(). A CPU
        # torch.Generator has no offset, so the rewind raises "CPU Generator does not use offset".
        # Chunking happens as soon as the queued prompts exceed one step's token budget (4,096 on
        # CPU), e.g. ~100 AIME prompts. Without chunked prefill every prompt is prefilled whole, and
        # vLLM raises the budget to at least max_model_len so that any single prompt fits.
        # CUDA generators can rewind, so GPU runs keep chunked prefill.
        extra["enable_chunked_prefill"] = False
    if args.adapter:
        rank = json.loads((Path(args.adapter) / "adapter_config.json").read_text())["r"]
        # vLLM takes only some maximum ranks (8, 16, 32, ...): round up to the next one.
        extra.update(enable_lora=True, max_lora_rank=min(r for r in (8, 16, 32, 64, 128, 256, 320, 512) if r >= rank))
    llm = LLM(model=args.model, dtype=args.dtype, seed=args.seed, tensor_parallel_size=args.tensor_parallel_size,
              enforce_eager=args.enforce_eager, **extra)
    return llm, (LoRARequest("adapter", 1, str(Path(args.adapter).resolve())) if args.adapter else None)


def draw(args, problems, todo, samples_path):
    """Sample every (benchmark, problem, sample) in `todo`, appending each record as it finishes."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    llm, lora = start_engine(args)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    # The engine's own loop rather than llm.generate(): each sample is written the moment it finishes,
    # so a kill loses only the samples in flight.
    engine = llm.llm_engine
    for k, (b, i, j) in enumerate(todo):
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_new_tokens,
                                seed=sample_seed(args.seed, b, i, j), output_kind=RequestOutputKind.FINAL_ONLY)
        prompt = TokensPrompt(prompt_token_ids=prompt_ids(tokenizer, problems[b][i]["problem"], args.thinking))
        engine.add_request(str(k), prompt, params, lora_request=lora)
    finished = 0
    with samples_path.open("a") as f:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if not out.finished:
                    continue
                (b, i, j), completion = todo[int(out.request_id)], out.outputs[0]
                record = {
                    "benchmark": b, "problem": i, "sample": j,
                    "answer": extract_boxed(completion.text),
                    "correct": is_correct(completion.text, problems[b][i]["answer"]),
                    "tokens": len(completion.token_ids),
                    "truncated": completion.finish_reason == "length",
                    "completion": completion.text,  # kept so samples can be regraded without resampling
                }
                f.write(json.dumps(record) + "\n")
                f.flush()
                finished += 1
                if finished % max(1, len(todo) // 20) == 0 or finished == len(todo):
                    print(f"{finished}/{len(todo)} samples", flush=True)


# -----------------------------------------------------------------------------
# Metrics, from sample records alone (so a resumed run and an uninterrupted one agree)

def majority_correct(samples):
    """Is the most common answer among one problem's samples correct?

    Answers are grouped by normalize_answer; samples without a box do not vote. A tie goes to
    the answer whose first occurrence has the lowest sample index. No vote at all: incorrect.
    """
    voted = sorted((s for s in samples if s["answer"] is not None), key=lambda s: s["sample"])
    if not voted:
        return False
    votes = Counter(normalize_answer(s["answer"]) for s in voted)
    winner = max(votes, key=votes.get)  # max keeps the first of equal counts, i.e. the earliest
    return next(s["correct"] for s in voted if normalize_answer(s["answer"]) == winner)


def summarize(samples, n):
    """Per-benchmark and pooled ('all') avg@n, pass@n, maj@n and mean completion tokens."""
    by_problem = defaultdict(list)
    for s in samples:
        by_problem[s["benchmark"], s["problem"]].append(s)
    counts = {name: Counter() for name in sorted({b for b, _ in by_problem}) + ["all"]}
    for (benchmark, _), group in by_problem.items():
        for c in (counts[benchmark], counts["all"]):
            c["problems"] += 1
            c["samples"] += len(group)
            c["correct"] += sum(s["correct"] for s in group)
            c["solved"] += any(s["correct"] for s in group)
            c["majority"] += majority_correct(group)
            c["tokens"] += sum(s["tokens"] for s in group)
    return {name: {"problems": c["problems"], "samples": c["samples"],
                   f"avg@{n}": c["correct"] / c["samples"], f"pass@{n}": c["solved"] / c["problems"],
                   f"maj@{n}": c["majority"] / c["problems"], "mean_tokens": c["tokens"] / c["samples"]}
            for name, c in counts.items()}


def format_table(summary, n):
    cols = ("problems", f"avg@{n}", f"pass@{n}", f"maj@{n}", "mean_tokens")
    lines = [f"{'benchmark':<12}" + "".join(f"{c:>13}" for c in cols)]
    for name, m in summary.items():
        cells = [f"{m['problems']:>13d}"] + [f"{100 * m[c]:>13.1f}" for c in cols[1:4]] + [f"{m['mean_tokens']:>13.0f}"]
        lines.append(f"{name:<12}" + "".join(cells))
    return "\n".join(lines)


# -----------------------------------------------------------------------------
# Run

def main(argv=None):
    args = parse_args(argv)
    if args.n < 1:
        raise SystemExit("--n must be at least 1.")
    sources = benchmark_sources(args.benchmarks, args.data)
    if args.adapter and not (Path(args.adapter) / "adapter_config.json").is_file():
        raise SystemExit(f"No adapter_config.json in {args.adapter}: pass a directory written by opsd.py.")
    problems = {b: load_problems(b, src, args.problem_column, args.answer_column) for b, src in sources.items()}
    wanted = [(b, i, j) for b in problems for i in range(len(problems[b])) for j in range(args.n)]

    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    check_config(out_dir, {k: getattr(args, k) for k in SAMPLING_KEYS})
    samples_path = out_dir / "samples.jsonl"
    done = read_samples(samples_path)
    todo = [key for key in wanted if key not in done]
    print(f"{len(wanted) - len(todo)} of {len(wanted)} samples already in {samples_path}")
    if todo:
        draw(args, problems, todo, samples_path)

    # The summary reads the file back, not this process's memory: exactly what a restarted run sees.
    done = read_samples(samples_path)
    assert all(key in done for key in wanted), f"samples missing from {samples_path}"
    summary = {
        "config": {**{k: getattr(args, k) for k in SAMPLING_KEYS}, "n": args.n, "benchmarks": sources},
        "metrics": summarize([done[key] for key in wanted], args.n),
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(format_table(summary["metrics"], args.n))
    return summary


if __name__ == "__main__":
    main()
