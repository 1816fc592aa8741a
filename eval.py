"""
Evaluate a model, or a model plus an adapter written by opsd.py, on AIME24, AIME25 and HMMT25.

    python eval.py --model Qwen/Qwen3-1.7B --output-dir runs/eval-base
    python eval.py --model Qwen/Qwen3-1.7B --adapter runs/opsd/final --output-dir runs/eval-opsd
    python eval.py --model /tmp/tiny-qwen3 --data tiny=tests/data/eval_tiny.jsonl --n 2 \
        --max-new-tokens 48 --enforce-eager --output-dir /tmp/eval-tiny   # CPU smoke run

Protocol: the released evaluation of the OPSD paper. The prompt is the problem followed by
"Please reason step by step, ..." (no "Problem:" prefix) through the chat template, thinking on,
n samples per problem at temperature 1.0 and top_p 0.95, up to 38,912 new tokens. A sample's
verdict is the released one, case by case:
  1. its answer sits after the LAST "\\boxed" of the completion, between the brace that follows it
     and the brace that closes it; if the braces never close (a completion cut off at the budget),
     or no brace follows, the sample has no answer and is wrong;
  2. answer and gold are wrapped in $...$ unless they already hold a "$", parsed by math_verify
     (no fallback extraction) and compared with math_verify.verify, 5 s timeout each;
  3. only if math_verify raises are they compared as strings ("$" and spaces removed, any case).
Over P problems and n samples each:

    avg@n   = correct samples / (P * n)                 (the paper's headline number)
    pass@n  = problems with at least one correct sample / P
    maj@n   = problems whose most common answer is correct / P

Where eval.py departs: maj@n counts votes by mathematical equivalence (math_verify), so "033" and
"33", or "0.5" and "\\frac{1}{2}", are one answer; the released evaluation counts identical strings,
so its maj@n can differ. avg@n and pass@n follow the released verdicts exactly. The summary also
gives, per benchmark, the mean completion length and the fraction of samples cut off at the token
budget: such a sample counts only if its last box closed before the cut, and protocols that fall
back to an earlier box score these samples differently.

Every sample goes to <output-dir>/samples.jsonl as soon as it completes, with a hash of its problem
and gold answer. Each sample has its own seed, derived from (--seed, benchmark, problem, sample), so
a run restarted with the same output directory draws only the missing samples. On CPU the redrawn
samples are bitwise those an uninterrupted run draws (tested); on GPU vLLM's kernels depend on the
batch a request shares, so a redrawn sample is an equally likely draw, not necessarily the same one.
summary.json is computed from samples.jsonl alone.
"""

import argparse
import hashlib
import json
import os
import threading
from collections import Counter, defaultdict
from pathlib import Path

import math_verify

HUB_IDS = {
    "aime24": "HuggingFaceH4/aime_2024",
    "aime25": "yentinglin/aime_2025",
    "hmmt25": "MathArena/hmmt_feb_2025",
}
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
GRADING_TIMEOUT_S = 5
# The settings that decide what a sample is: a restart must not mix samples drawn under others.
SAMPLING_KEYS = ("model", "adapter", "thinking", "temperature", "top_p", "max_new_tokens", "seed", "dtype")
DATA_HELP = ("A --data file is .jsonl (one JSON object per line), .json (a list of objects) or .parquet, "
             "with one row per problem: a problem column and an answer column (--problem-column, "
             "--answer-column), neither of them null.")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip(), epilog=DATA_HELP,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("--model", required=True, default=argparse.SUPPRESS, help="hub id or local path of the base model")
    g.add_argument("--adapter", default=None,
                   help="LoRA adapter directory written by opsd.py, applied through vLLM's LoRA support")
    g.add_argument("--dtype", default="auto", help="vLLM weight dtype; auto takes the model config's")
    g.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs one vLLM engine is split over")
    g.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="fraction of GPU memory vLLM may take (None: vLLM's own, 0.9)")
    g.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=False,
                   help="skip CUDA graphs / compilation (start-up time; needed for quick CPU runs)")
    g = p.add_argument_group("data")
    g.add_argument("--benchmarks", default=None,
                   help=f"comma-separated names from {', '.join(HUB_IDS)} or given by --data "
                        "(None: the --data names if any, else all three)")
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
    p.add_argument("--output-dir", required=True, default=argparse.SUPPRESS, help="where samples.jsonl, summary.json and config.json go")
    args = p.parse_args(argv)
    for flag, ok, rule in [
        ("--n", args.n >= 1, "at least 1"),
        ("--temperature", args.temperature >= 0, "0 or more"),
        ("--top-p", 0 < args.top_p <= 1, "in (0, 1]"),
        ("--max-new-tokens", args.max_new_tokens >= 1, "at least 1"),
        ("--tensor-parallel-size", args.tensor_parallel_size >= 1, "at least 1"),
        ("--gpu-memory-utilization", args.gpu_memory_utilization is None or 0 < args.gpu_memory_utilization <= 1,
         "in (0, 1]"),
    ]:
        if not ok:
            raise SystemExit(f"{flag} must be {rule}, got {getattr(args, flag[2:].replace('-', '_'))}.")
    return args


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


def read_rows(source):
    """Rows of a local .jsonl / .json / .parquet file or a hub data set, with a place for each
    ('line 7', 'row 7') that error messages can name."""
    path = Path(source)
    suffix = path.suffix.lower()
    if not path.is_file():
        from datasets import load_dataset

        splits = load_dataset(source)  # the three hub sets hold a single split
        rows = splits["test"] if "test" in splits else splits[next(iter(splits))]
        return [(f"row {i}", dict(r)) for i, r in enumerate(rows)]
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return [(f"row {i}", r) for i, r in enumerate(pq.read_table(path).to_pylist())]
    if suffix not in (".json", ".jsonl"):
        raise SystemExit(f"{source} is not .json, .jsonl or .parquet.")
    text = path.read_text()
    if suffix == ".json":
        try:
            rows = json.loads(text)
        except json.JSONDecodeError:
            rows = None  # many .json files are JSON lines: read it as such below
        if rows is not None:
            if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
                raise SystemExit(f"{source} holds JSON that is not a list of objects (one per problem).")
            return [(f"row {i}", r) for i, r in enumerate(rows)]
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise SystemExit(f"{source}, line {number}: not valid JSON ({e.msg}).") from None
        if not isinstance(row, dict):
            raise SystemExit(f"{source}, line {number}: not a JSON object.")
        rows.append((f"line {number}", row))
    return rows


def load_problems(name, source, problem_column, answer_column):
    """[{problem, answer, hash}], the answer as text, failing in one sentence on a file that has no
    rows, lacks a column or holds a null."""
    rows = read_rows(source)
    if not rows:
        raise SystemExit(f"{name}: {source} holds no problems.")
    problems = []
    for where, row in rows:
        for column in (problem_column, answer_column):
            if column not in row:
                raise SystemExit(f"{name}: {source} has no column '{column}' ({where} has {', '.join(row)}); "
                                 "name the right one with --problem-column / --answer-column.")
            if row[column] is None:
                raise SystemExit(f"{name}: {source}, {where}: '{column}' is null.")
        problem, answer = str(row[problem_column]), str(row[answer_column])
        digest = hashlib.sha256(json.dumps([problem, answer]).encode()).hexdigest()[:16]
        problems.append({"problem": problem, "answer": answer, "hash": digest})
    return problems


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
        # rewrite through a temporary file, so a kill now cannot lose the good lines
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(s) + "\n" for s in done.values()))
        os.replace(tmp, path)
    return done


def check_resume(out_dir, config, problems, done):
    """Refuse to add samples to a directory whose samples were drawn under other settings or from
    other problems. Settings count only once a sample exists: a run that died before sampling
    (a mistyped --model, say) leaves nothing a corrected rerun must match."""
    if not done:
        return
    path = out_dir / "config.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    changed = [k for k in SAMPLING_KEYS if old.get(k) != config[k]]
    if changed:
        raise SystemExit(f"{out_dir} holds samples drawn with other {', '.join(changed)}: use a new --output-dir.")
    for b, i, _ in done:
        if b in problems and (i >= len(problems[b]) or done[b, i, _].get("hash") != problems[b][i]["hash"]):
            raise SystemExit(f"{out_dir} holds samples of another {b} (problem {i} differs from the one "
                             "read now): use a new --output-dir.")


# -----------------------------------------------------------------------------
# Grading: the released evaluation's verdict

def extract_boxed(text):
    """The answer of a completion, or None: the content of the LAST \\boxed, braces matched from it.

    None when those braces never close (a completion cut off mid-box) or when the last \\boxed is not
    followed by a brace ("\\boxed 5"). An earlier, closed box does not stand in for the last one.
    """
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    depth = 0
    for end in range(start, len(text)):
        if text[end] == "{":
            depth += 1
        elif text[end] == "}":
            depth -= 1
            if depth == 0:
                box = text[start : end + 1]
                return box[len("\\boxed{") : -1].strip() if box.startswith("\\boxed{") else None
    return None


def as_math(s):
    return s if "$" in s else f"${s}$"


def verdict(predicted, gold):
    """Is the extracted answer `predicted` (None: no answer) equal to `gold`, by the released rule?

    math_verify decides, with no fallback extraction and a 5 s timeout on each parse and on the
    comparison; an answer it cannot parse, or a timeout, is wrong. Only if math_verify raises are
    the two compared as strings. Its timeouts are SIGALRM alarms, which only the main thread can
    set: elsewhere math_verify raises, and the string compare decides (as in the released code).
    """
    if predicted is None:
        return False
    predicted, gold = as_math(predicted), as_math(gold)
    try:
        gold_parsed, predicted_parsed = (math_verify.parse(s, fallback_mode="no_fallback",
                                                           parsing_timeout=GRADING_TIMEOUT_S)
                                         for s in (gold, predicted))
        return bool(math_verify.verify(gold_parsed, predicted_parsed, timeout_seconds=GRADING_TIMEOUT_S))
    except Exception:
        def plain(s):
            return s.replace("$", "").replace(" ", "").lower().strip()

        return plain(predicted) == plain(gold)


def require_main_thread():
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("eval.py grades in the main thread only: math_verify's 5 s timeout is a SIGALRM "
                           "alarm, which no other thread can set.")


def is_correct(completion, answer):
    require_main_thread()
    return verdict(extract_boxed(completion), str(answer))


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


def draw(args, problems, todo, out_dir):
    """Sample every (benchmark, problem, sample) in `todo`, appending each record as it finishes."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    llm, lora = start_engine(args)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    # The settings are recorded once the engine is up, just before the first sample can exist.
    (out_dir / "config.json").write_text(json.dumps({k: getattr(args, k) for k in SAMPLING_KEYS}, indent=2) + "\n")
    # The engine's own loop rather than llm.generate(): each sample is written the moment it finishes,
    # so a kill loses only the samples in flight.
    engine = llm.llm_engine
    for k, (b, i, j) in enumerate(todo):
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_new_tokens,
                                seed=sample_seed(args.seed, b, i, j), output_kind=RequestOutputKind.FINAL_ONLY)
        prompt = TokensPrompt(prompt_token_ids=prompt_ids(tokenizer, problems[b][i]["problem"], args.thinking))
        engine.add_request(str(k), prompt, params, lora_request=lora)
    finished = 0
    with (out_dir / "samples.jsonl").open("a") as f:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if not out.finished:
                    continue
                (b, i, j), completion = todo[int(out.request_id)], out.outputs[0]
                record = {
                    "benchmark": b, "problem": i, "sample": j, "hash": problems[b][i]["hash"],
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

    Answers vote by mathematical equivalence: a sample joins the group of the first earlier answer
    that is the same string or that math_verify finds equal to it, so "033" and "33" are one vote
    each for the same answer. Samples without an answer do not vote. A tie goes to the group whose
    first sample has the lowest index. No vote at all: incorrect.
    """
    require_main_thread()
    groups = []  # [first sample of the group, votes]
    for s in sorted((s for s in samples if s["answer"] is not None), key=lambda s: s["sample"]):
        for group in groups:
            if s["answer"] == group[0]["answer"] or verdict(s["answer"], group[0]["answer"]):
                group[1] += 1
                break
        else:
            groups.append([s, 1])
    if not groups:
        return False
    return max(groups, key=lambda g: g[1])[0]["correct"]  # max keeps the first of equal counts


def summarize(samples, n):
    """Per-benchmark and pooled ('all') avg@n, pass@n, maj@n, mean completion tokens and the fraction
    of samples cut off at the token budget."""
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
            c["truncated"] += sum(s["truncated"] for s in group)
    return {name: {"problems": c["problems"], "samples": c["samples"],
                   f"avg@{n}": c["correct"] / c["samples"], f"pass@{n}": c["solved"] / c["problems"],
                   f"maj@{n}": c["majority"] / c["problems"], "mean_tokens": c["tokens"] / c["samples"],
                   "truncated": c["truncated"] / c["samples"]}
            for name, c in counts.items()}


def format_table(summary, n):
    cols = ("problems", f"avg@{n}", f"pass@{n}", f"maj@{n}", "mean_tokens", "truncated")
    lines = [f"{'benchmark':<12}" + "".join(f"{c:>13}" for c in cols)]
    for name, m in summary.items():
        cells = ([f"{m['problems']:>13d}"] + [f"{100 * m[c]:>13.1f}" for c in cols[1:4]]
                 + [f"{m['mean_tokens']:>13.0f}", f"{100 * m['truncated']:>13.1f}"])
        lines.append(f"{name:<12}" + "".join(cells))
    return "\n".join(lines)


# -----------------------------------------------------------------------------
# Run

def check_adapter(adapter):
    path = Path(adapter)
    if not (path / "adapter_config.json").is_file():
        raise SystemExit(f"No adapter_config.json in {adapter}: pass a directory written by opsd.py.")
    if not any((path / name).is_file() for name in ("adapter_model.safetensors", "adapter_model.bin")):
        raise SystemExit(f"{adapter} holds an adapter config but no adapter_model.safetensors: "
                         "pass a directory written by opsd.py.")


def main(argv=None):
    args = parse_args(argv)
    sources = benchmark_sources(args.benchmarks, args.data)
    if args.adapter:
        check_adapter(args.adapter)
    problems = {b: load_problems(b, src, args.problem_column, args.answer_column) for b, src in sources.items()}
    if not Path(args.model).exists() and (args.model.startswith((".", "/", "~")) or args.model.count("/") != 1):
        raise SystemExit(f"--model {args.model}: no such directory, and not a hub id of the form owner/name.")
    wanted = [(b, i, j) for b in problems for i in range(len(problems[b])) for j in range(args.n)]

    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    samples_path = out_dir / "samples.jsonl"
    done = read_samples(samples_path)
    config = {k: getattr(args, k) for k in SAMPLING_KEYS}
    check_resume(out_dir, config, problems, done)
    todo = [key for key in wanted if key not in done]
    print(f"{len(wanted) - len(todo)} of {len(wanted)} samples already in {samples_path}")
    if todo:
        draw(args, problems, todo, out_dir)

    # The summary reads the file back, not this process's memory: exactly what a restarted run sees.
    done = read_samples(samples_path)
    assert all(key in done for key in wanted), f"samples missing from {samples_path}"
    summary = {
        "config": {**config, "n": args.n, "benchmarks": sources},
        "metrics": summarize([done[key] for key in wanted], args.n),
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(format_table(summary["metrics"], args.n))
    return summary


if __name__ == "__main__":
    main()
