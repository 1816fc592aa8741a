"""
Evaluate a model, or a model plus an adapter written by opsd.py, on AIME24, AIME25 and HMMT25.

    python eval.py --model Qwen/Qwen3-1.7B --adapter runs/opsd/final --output-dir runs/eval-opsd

The protocol (the OPSD paper's released one), departures from it, restarts and a CPU run:
README.md, "Evaluation".
"""

import argparse
import hashlib
import json
import math
import os
import random
import shlex
import signal
import statistics
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import math_verify

# what both scripts share: the prompt, the answer's \boxed{}, the fingerprint, CPU settings
import opsd
from opsd import extract_boxed, model_dir, model_fingerprint

HUB_IDS = {"aime24": "HuggingFaceH4/aime_2024", "aime25": "yentinglin/aime_2025",
           "hmmt25": "MathArena/hmmt_feb_2025"}
GRADING_TIMEOUT_S = 5
LIMIT_SEED = 0  # the draw of --limit's problems; not --seed, so runs of other seeds pair up
# What decides what a sample is, settings and contents behind the paths: a restart must not mix
# samples of others.
SAMPLING_KEYS = ("model", "adapter", "thinking", "temperature", "top_p", "max_new_tokens", "seed",
                 "dtype")
CONTENT_KEYS = {"model_fingerprint": "model weights", "adapter_sha256": "adapter weights"}
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM 0.32 takes

def fail(message):
    """One sentence, "eval.py: error: ...", exit status 2."""
    print(f"eval.py: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def checked(kind, ok, rule):
    """An argparse type: the text read as `kind`, refused unless ok(value)."""
    def parse(text):
        value = kind(text)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value
    parse.__name__ = kind.__name__  # for argparse's own "invalid int value" sentence
    return parse


AT_LEAST_1 = checked(int, lambda v: v >= 1, "at least 1")
NON_NEGATIVE = checked(float, lambda v: v >= 0, "0 or more")
SHARE = checked(float, lambda v: 0 < v <= 1, "in (0, 1]")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="eval.py", description=__doc__.split("\n\n")[0].strip(),
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.error = fail  # argparse's refusals in the same one sentence
    g = p.add_argument_group("model")
    g.add_argument("--model", required=True, default=argparse.SUPPRESS,
                   help="hub id or local path of the base model")
    g.add_argument("--adapter",
                   help="LoRA adapter directory written by opsd.py, applied through vLLM's LoRA "
                        "support")
    g.add_argument("--allow-other-base", action="store_true",
                   help="evaluate --adapter on a model not its base")
    g.add_argument("--dtype", default="auto",
                   help="vLLM weight dtype; auto takes the model config's")
    g.add_argument("--tensor-parallel-size", type=AT_LEAST_1, default=1,
                   help="GPUs one vLLM engine is split over")
    g.add_argument("--gpu-memory-utilization", type=SHARE,
                   help="share of GPU memory vLLM may take (None: vLLM's)")
    g.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=False,
                   help="turn off vLLM's torch.compile and CUDA graph capture (vLLM's "
                        "enforce_eager): the fallback when the engine's start fails in either on "
                        "a GPU; a quicker start, slower sampling; what a CPU run needs")
    g = p.add_argument_group("data")
    g.add_argument("--benchmarks",
                   help=f"comma-separated, of {', '.join(HUB_IDS)} and --data (None: --data's or "
                        "all)")
    g.add_argument("--data", action="append", default=[], metavar="NAME=PATH",
                   help="benchmark NAME from a local file (repeatable): .jsonl (an object a "
                        "line), .json (a list of objects) or .parquet, a row per problem: a "
                        "problem column and an answer column, not null")
    g.add_argument("--problem-column", default="problem", help="column holding the problem text")
    g.add_argument("--answer-column", default="answer", help="column holding the reference answer")
    g.add_argument("--limit", type=AT_LEAST_1,
                   help="score LIMIT problems of each benchmark, drawn at random with a fixed "
                        "seed (not --seed: every run with this LIMIT scores the same ones), and "
                        "project the whole evaluation's hours from this run's answer length and "
                        "rate; a later run without it keeps these samples (None: all problems)")
    g = p.add_argument_group("sampling")
    g.add_argument("--n", type=AT_LEAST_1, default=12, help="samples per problem")
    g.add_argument("--temperature", type=NON_NEGATIVE, default=1.0, help="sampling temperature")
    g.add_argument("--top-p", type=SHARE, default=0.95, help="nucleus sampling threshold")
    g.add_argument("--max-new-tokens", type=AT_LEAST_1, default=38912,
                   help="generation budget per sample")
    g.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=True,
                   help="enable_thinking")
    g.add_argument("--seed", type=int, default=42, help="root of every per-sample seed")
    p.add_argument("--output-dir", required=True, default=argparse.SUPPRESS,
                   help="for samples, summary and config")
    p.add_argument("--baseline", metavar="DIR",
                   help="another run's --output-dir, of the same problems (the base model's, "
                        "say): the difference in avg@n from it, paired by problem, with its "
                        "standard error")
    return p.parse_args(argv)


# -----------------------------------------------------------------------------
# Prompts and sampling with vLLM: the released prompt as token ids; one engine samples everything,
# each sample with its own seed (a restart draws the same sample again) and written to samples.jsonl
# the moment it finishes.

def prompt_ids(tokenizer, problem, thinking):
    """The released evaluation's prompt (opsd.py --student-prompt eval trains in it), as token
    ids."""
    return opsd.render(tokenizer, opsd.student_message(problem, "eval"), thinking)

def limited(benchmark, count, limit):
    """The problems --limit scores, by index: the first `limit` of the benchmark's `count` problems
    shuffled by a generator seeded with LIMIT_SEED and the benchmark's name, in their own order. A
    year's problems run from easy to hard, so its first ones would understate the answers' length.
    A smaller limit's problems are among a larger one's; no limit: all of them."""
    if limit is None or limit >= count:
        return list(range(count))
    order = random.Random(f"{LIMIT_SEED}/{benchmark}").sample(range(count), count)
    return sorted(order[:limit])

def sample_seed(seed, benchmark, problem, sample):
    # hash() is salted
    digest = hashlib.sha256(f"{seed}/{benchmark}/{problem}/{sample}".encode()).digest()
    return int.from_bytes(digest[:4], "little")

def start_engine(args):
    """The tokenizer, the vLLM engine, and the LoRARequest that applies --adapter to every sample
    (None without one). A model without a chat template is refused before the engine starts."""
    from transformers import AutoConfig, AutoTokenizer
    try:  # a hub id without network: one sentence, not vLLM's traceback
        AutoConfig.from_pretrained(args.model)
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    except (OSError, ValueError) as e:
        fail(f"--model {args.model}: cannot load its config ({str(e).splitlines()[0]}); without "
             "network, pass a local model directory.")
    try:
        opsd.check_chat_template(tokenizer, args.model)
    except opsd.Refusal as e:  # opsd.py's sentence
        fail(str(e))
    from vllm import LLM
    from vllm.lora.request import LoRARequest
    from vllm.platforms import current_platform
    cpu = current_platform.is_cpu()
    # its ~90 start-up lines would bury the progress; the CPU build reserves 92% of RAM without a KV
    # cache size (and --gpu-memory-utilization is a share of RAM there)
    opsd.engine_environment(cpu and args.gpu_memory_utilization is None)
    extra = {"enforce_eager": args.enforce_eager, **(opsd.CPU_ENGINE if cpu else {})}
    if args.gpu_memory_utilization is not None:
        extra["gpu_memory_utilization"] = args.gpu_memory_utilization
    if cpu:
        # the engine in this process: a 2x quicker start
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # vLLM takes only some maximum ranks: the smallest that holds the adapter's (check_adapter)
    if args.adapter:
        rank = json.loads((Path(args.adapter) / "adapter_config.json").read_text())["r"]
        extra.update(enable_lora=True, max_lora_rank=min(r for r in VLLM_LORA_RANKS if r >= rank))
    llm = without_ctrl_c_in_children(lambda: LLM(
        model=args.model, dtype=args.dtype, seed=args.seed,
        tensor_parallel_size=args.tensor_parallel_size, use_tqdm_on_load=False, **extra))
    lora = None
    if args.adapter:
        lora = LoRARequest("adapter", 1, str(Path(args.adapter).resolve()))
    return tokenizer, llm, lora

def without_ctrl_c_in_children(start):
    """start(), the processes it starts blind to Ctrl-C. vLLM's engine and worker processes would
    each take the terminal's SIGINT and die with a traceback; started with it blocked (a mask they
    inherit, and keep), they leave it to this process, which shuts them down (draw). A thread
    started before the mask lets a Ctrl-C during the start still reach this process."""
    threading.Thread(target=threading.Event().wait, daemon=True).start()
    unblocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        return start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)

def record(key, problems, completion):
    """What samples.jsonl keeps of one finished sample."""
    b, i, j = key
    return {"benchmark": b, "problem": i, "sample": j, "hash": problems[b][i]["hash"],
            "answer": extract_boxed(completion.text),
            "correct": is_correct(completion.text, problems[b][i]["answer"]),
            "tokens": len(completion.token_ids), "truncated": completion.finish_reason == "length",
            # kept so samples can be regraded without resampling
            "completion": completion.text}

def draw(args, problems, todo, out_dir, config):
    """Sample every (benchmark, problem, sample) in `todo`, appending each record as it finishes.
    Returns the seconds to start (engine and tokenizer) and the seconds of sampling."""
    started = time.perf_counter()
    tokenizer, llm, lora = start_engine(args)
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    # once up, before any sample exists
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    # The engine's own loop, not llm.generate(): a sample is written as it finishes, a kill loses
    # those in flight.
    engine = llm.llm_engine
    sampling = time.perf_counter()
    try:
        for k, (b, i, j) in enumerate(todo):
            params = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                                    max_tokens=args.max_new_tokens,
                                    seed=sample_seed(args.seed, b, i, j),
                                    output_kind=RequestOutputKind.FINAL_ONLY)
            ids = prompt_ids(tokenizer, problems[b][i]["problem"], args.thinking)
            prompt = TokensPrompt(prompt_token_ids=ids)
            engine.add_request(str(k), prompt, params, lora_request=lora)
        finished = 0
        with (out_dir / "samples.jsonl").open("a") as f:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if not out.finished:
                        continue
                    key = todo[int(out.request_id)]
                    f.write(json.dumps(record(key, problems, out.outputs[0])) + "\n")
                    f.flush()
                    finished += 1
                    if finished % max(1, len(todo) // 20) == 0 or finished == len(todo):
                        print(f"{finished}/{len(todo)} samples", flush=True)
        sampled = time.perf_counter()
    finally:
        # Stopped here, also on Ctrl-C: left to vLLM's exit handlers, the engine process is killed
        # and reported "exited unexpectedly".
        engine.engine_core.shutdown(timeout=60)
    return sampling - started, sampled - sampling


# -----------------------------------------------------------------------------
# Grading and metrics: the released evaluation's verdict (the last \boxed's content against the gold
# answer, by math_verify), and the metrics from the sample records alone, so that a resumed run and
# an uninterrupted one agree.

def verdict(predicted, gold):
    """Is `predicted` (None: no answer) equal to `gold`? math_verify decides, with no fallback and
    5 s timeouts (SIGALRM alarms: main thread only); only if it raises are the two compared as
    strings."""
    if predicted is None:
        return False
    predicted, gold = (s if "$" in s else f"${s}$" for s in (predicted, gold))
    try:
        gold_parsed, predicted_parsed = (
            math_verify.parse(s, parsing_timeout=GRADING_TIMEOUT_S, fallback_mode="no_fallback")
            for s in (gold, predicted))
        return bool(math_verify.verify(gold_parsed, predicted_parsed,
                                       timeout_seconds=GRADING_TIMEOUT_S))
    except Exception:
        plain_predicted, plain_gold = (s.replace("$", "").replace(" ", "").lower().strip()
                                       for s in (predicted, gold))
        return plain_predicted == plain_gold

def require_main_thread():
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("eval.py grades in the main thread only: math_verify's 5 s timeout is a "
                           "SIGALRM alarm, which no other thread can set.")

def is_correct(completion, answer):
    require_main_thread()
    return verdict(extract_boxed(completion), str(answer))

def majority_correct(samples):
    """Is the most common answer correct? Votes by equivalence ("033" = "33"), ties to the
    earliest; no vote: False."""
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
    """Per benchmark and pooled ('all'), over P problems of n samples: avg@n = correct samples /
    (P n), pass@n = problems with a correct sample / P, maj@n = problems whose majority answer is
    right / P; tokens; cut-off share."""
    by_problem = defaultdict(list)
    for s in samples:
        by_problem[s["benchmark"], s["problem"]].append(s)
    counts = {name: Counter() for name in sorted({b for b, _ in by_problem})}
    for (benchmark, _), group in by_problem.items():
        counts[benchmark] += Counter(
            problems=1, samples=len(group), correct=sum(s["correct"] for s in group),
            solved=any(s["correct"] for s in group), majority=majority_correct(group),
            tokens=sum(s["tokens"] for s in group), truncated=sum(s["truncated"] for s in group))
    counts["all"] = sum(counts.values(), Counter())
    return {name: {"problems": c["problems"], "samples": c["samples"],
                   f"avg@{n}": c["correct"] / c["samples"],
                   f"pass@{n}": c["solved"] / c["problems"],
                   f"maj@{n}": c["majority"] / c["problems"],
                   "mean_tokens": c["tokens"] / c["samples"],
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
# Run: check what a user can get wrong, read the problems, draw what samples.jsonl lacks, summarise
# the file.

def main(argv=None):
    args = parse_args(argv)
    # before anything loads: a CPU build of torch on a GPU machine would sample on the CPU (vLLM's
    # CPU build)
    try:
        opsd.check_cuda_build()
    except opsd.Refusal as e:  # opsd.py's sentence
        fail(str(e))
    try:
        return evaluate(args)
    except KeyboardInterrupt:
        interrupted(args, sys.argv[1:] if argv is None else argv)


def interrupted(args, argv):
    """Ctrl-C: one line, what samples.jsonl keeps and the command that draws the rest; exit 130."""
    path = Path(args.output_dir) / "samples.jsonl"
    kept = len(read_samples(path, repair=False))
    again = shlex.join(["python", "eval.py", *argv])
    print(f"eval.py: stopped by Ctrl-C; {kept} samples kept in {path}; to draw the rest: {again}",
          file=sys.stderr, flush=True)
    raise SystemExit(130)


def evaluate(args):
    sources = benchmark_sources(args.benchmarks, args.data)
    # opsd.py's rule
    if local_path(args.model) and not Path(args.model).expanduser().is_dir():
        fail(f"--model {args.model}: no such directory; pass a model's directory or a hub id such "
             "as Qwen/Qwen3-1.7B.")
    if args.adapter:
        check_adapter(args.adapter, args.model, args.allow_other_base)
    problems = {b: load_problems(b, src, args.problem_column, args.answer_column)
                for b, src in sources.items()}
    # --limit: a draw of each benchmark's problems (a rerun without it draws the others into the
    # same directory)
    scored = {b: limited(b, len(problems[b]), args.limit) for b in problems}
    if args.limit:
        drawn = "; ".join(f"{b} {', '.join(map(str, scored[b]))}" for b in scored)
        print(f"--limit {args.limit}: problems (counted from 0) {drawn}")
    wanted = [(b, i, j) for b in problems for i in scored[b] for j in range(args.n)]
    baseline = None
    if args.baseline:
        baseline = baseline_shares(args.baseline, problems, scored)
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    samples_path = out_dir / "samples.jsonl"
    done = read_samples(samples_path)
    # config, then weights
    adapter_files = sorted(Path(args.adapter).glob("adapter_*")) if args.adapter else []
    adapter_sha256 = None
    if adapter_files:
        adapter_sha256 = hashlib.sha256(b"".join(f.read_bytes() for f in adapter_files)).hexdigest()
    config = {**{k: getattr(args, k) for k in SAMPLING_KEYS},
              "model_fingerprint": model_fingerprint(args.model), "adapter_sha256": adapter_sha256}
    check_resume(out_dir, config, problems, done)
    todo = [key for key in wanted if key not in done]
    print(f"{len(wanted) - len(todo)} of {len(wanted)} samples already in {samples_path}")
    seconds = None
    if todo:
        seconds = draw(args, problems, todo, out_dir, config)
    # The summary reads the file back, not this process's memory: exactly what a restarted run sees.
    done = read_samples(samples_path)
    assert all(key in done for key in wanted), f"samples missing from {samples_path}"
    samples = [done[key] for key in wanted]
    summary = {"config": {**config, "n": args.n, "limit": args.limit, "benchmarks": sources},
               "metrics": summarize(samples, args.n)}
    print(format_table(summary["metrics"], args.n))
    if args.limit:
        whole = args.n * sum(len(p) for p in problems.values())
        drawn = [done[key] for key in todo]
        summary["cost"] = measure_cost(summary["metrics"]["all"], drawn, seconds, whole)
    if baseline:
        summary["baseline"] = {"dir": args.baseline, "metrics": compare(samples, baseline, args.n)}
        print(format_comparison(summary["baseline"], args.n))
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


# -----------------------------------------------------------------------------
# What an evaluation costs, measured on a few problems (--limit) before the whole is paid for.

def measure_cost(measured, drawn, seconds, whole):
    """This run's mean answer length and rate, and the whole evaluation's hours projected from
    them: `whole` answers of that mean length at the rate this run drew its own, after a start as
    long as its own. Printed."""
    if not drawn:
        print("cost: no sample was drawn by this run, so no rate was measured: use a new "
              "--output-dir to measure.")
        return None
    start_s, sampling_s = seconds
    tokens = sum(s["tokens"] for s in drawn)
    rate = tokens / sampling_s
    hours = (start_s + whole * measured["mean_tokens"] / rate) / 3600
    print(f"cost: {measured['samples']:,} answers of {measured['mean_tokens']:,.0f} tokens on "
          f"average; {tokens:,} tokens drawn in {sampling_s:,.1f} s ({rate:,.0f} tokens/s), after "
          f"{start_s:,.1f} s to start")
    print(f"the whole evaluation, {whole:,} answers at this rate: {hours:.2f} h on this machine, "
          "an estimate (a longer run keeps more answers going at once, faster per token); for "
          f"other GPUs, pass --answer-tokens {round(measured['mean_tokens'])} to "
          "tests/gpu_check/budget.py --eval")
    return {"mean_tokens": measured["mean_tokens"], "drawn_tokens": tokens,
            "start_seconds": start_s, "sampling_seconds": sampling_s, "tokens_per_second": rate,
            "whole_answers": whole, "projected_hours": hours}


# -----------------------------------------------------------------------------
# Two runs of the same problems compared problem by problem: a checkpoint against its base model,
# say.

# Problems as a sample: the standard error says whether this run beats the baseline on problems like
# these; each problem's difficulty, common to both runs, cancels in d_i, and each share's sampling
# noise stays in sd(d_i).
NOISE_MODEL = ("d_i = this run's share correct on problem i minus the baseline's; the difference "
               "is mean(d_i), its standard error sd(d_i) / sqrt(N) over the N problems, beyond "
               "noise when over 2 standard errors")

def shares_correct(samples):
    """{(benchmark, problem): the share of its samples graded correct}."""
    graded = defaultdict(list)
    for s in samples:
        graded[s["benchmark"], s["problem"]].append(s["correct"])
    return {key: sum(c) / len(c) for key, c in graded.items()}

def baseline_shares(directory, problems, scored):
    """shares_correct of another run's samples on this run's problems, refused unless it scored
    each of them and the same one (its problem and answer, hashed); read, never rewritten."""
    path = Path(directory) / "samples.jsonl"
    if not path.is_file():
        fail(f"--baseline {directory}: no samples.jsonl there; pass an --output-dir that eval.py "
             "wrote.")
    shared = [s for s in read_samples(path, repair=False).values()
              if s["benchmark"] in scored and s["problem"] in scored[s["benchmark"]]]
    for s in shared:
        if s.get("hash") != problems[s["benchmark"]][s["problem"]]["hash"]:
            fail(f"--baseline {directory} scored another {s['benchmark']} problem {s['problem']} "
                 "than this run: compare runs of the same problems.")
    shares = shares_correct(shared)
    for b in scored:
        for i in scored[b]:
            if (b, i) not in shares:
                fail(f"--baseline {directory} holds no sample of {b} problem {i}: compare runs of "
                     "the same problems.")
    return shares

def compare(samples, baseline, n):
    """Per benchmark and pooled ('all'): avg@n here and the baseline's on the same problems, their
    difference and its paired standard error (NOISE_MODEL; None for one problem), and whether it is
    beyond noise."""
    shares = shares_correct(samples)
    by_benchmark = defaultdict(list)
    for (b, i), share in shares.items():
        by_benchmark[b].append((share, baseline[b, i]))
    by_benchmark["all"] = [pair for pairs in list(by_benchmark.values()) for pair in pairs]
    table = {}
    for name, pairs in by_benchmark.items():
        d = [here - there for here, there in pairs]
        difference = sum(d) / len(d)
        error = None
        if len(d) > 1:
            error = statistics.stdev(d) / math.sqrt(len(d))
        table[name] = {"problems": len(d), f"avg@{n}": sum(here for here, _ in pairs) / len(d),
                       "baseline": sum(there for _, there in pairs) / len(d),
                       "difference": difference, "standard_error": error,
                       "beyond_noise": error is not None and abs(difference) > 2 * error}
    return table

def format_comparison(comparison, n):
    cols = ("problems", f"avg@{n}", "baseline", "difference", "std. error", "beyond noise")
    lines = [f"against {comparison['dir']}, paired by problem: {NOISE_MODEL}.",
             f"{'benchmark':<12}" + "".join(f"{c:>13}" for c in cols[:-1]) + f"{cols[-1]:>14}"]
    for name, m in comparison["metrics"].items():
        error = "-"
        if m["standard_error"] is not None:
            error = f"{100 * m['standard_error']:.1f}"
        beyond = "no"
        if m["beyond_noise"]:
            beyond = "yes"
        cells = [f"{m['problems']:d}", f"{100 * m[f'avg@{n}']:.1f}", f"{100 * m['baseline']:.1f}",
                 f"{100 * m['difference']:+.1f}", error, beyond]
        lines.append(f"{name:<12}" + "".join(f"{c:>13}" for c in cells[:-1]) + f"{cells[-1]:>14}")
    return "\n".join(lines)

# =============================================================================
# What keeps an evaluation honest
# Bad input is refused early, in one sentence, before any engine starts; a restart cannot mix in
# other samples.

# -----------------------------------------------------------------------------
# Data: benchmark names, and reading the problems; a bad file is named with its line or row.

def benchmark_sources(benchmarks, data):
    """{name: hub id or local path}, failing early on a malformed --data or an unknown name."""
    local = {}
    for item in data:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            fail(f"--data takes NAME=PATH, got '{item}': pass e.g. --data aime24=aime24.jsonl.")
        if not Path(path).is_file():
            fail(f"--data {name}: no file at {path}; pass the path of a .jsonl, .json or .parquet "
                 "file.")
        local[name] = path
    names = list(local) or list(HUB_IDS)
    if benchmarks:
        names = [b.strip() for b in benchmarks.split(",") if b.strip()]
    for name in names:
        if name not in local and name not in HUB_IDS:
            fail(f"Unknown benchmark '{name}': choose from {', '.join(HUB_IDS)} "
                 f"or give a file with --data {name}=PATH.")
    return {name: local.get(name, HUB_IDS.get(name)) for name in names}

def local_path(value):
    """True when `value` names a local file or directory, not a hub id (org/name): opsd.py's
    rule."""
    path = Path(value).expanduser()
    if path.exists() or value.startswith((".", "/", "~")) or value.count("/") > 1:
        return True
    return len(path.parts) > 1 and Path(path.parts[0]).is_dir()

def use_cache_if_hub_silent(timeout_s=3):
    """Without network the Hugging Face libraries retry each request for ~25 s: set HF_HUB_OFFLINE
    (read when they are imported) if the Hub does not answer within timeout_s, so that they go to
    their cache at once."""
    import urllib.error
    import urllib.request
    try:
        endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
        request = urllib.request.Request(endpoint, method="HEAD")
        urllib.request.urlopen(request, timeout=timeout_s).close()
    except (OSError, ValueError) as e:  # no answer in time; an HTTP error is an answer
        if not isinstance(e, urllib.error.HTTPError):
            os.environ["HF_HUB_OFFLINE"] = "1"

def read_rows(name, source):
    """Rows (dicts) of a local .jsonl (an object a line), .json (a list of objects, or an object a
    line) or .parquet file, or of a hub dataset's train split; a bad file is named with its line."""
    path = Path(source)
    if not path.is_file():
        use_cache_if_hub_silent()
        from datasets import load_dataset
        try:
            return [dict(row) for row in load_dataset(source, split="train")]
        except Exception as e:  # the hub's many failures all mean one thing here
            fail(f"{source}: cannot load split 'train' from the hub ({str(e).splitlines()[0]}); "
                 f"without network, use a local copy: --data {name}=FILE (a .jsonl, .json or "
                 ".parquet of problem and answer columns).")
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq
        return pq.read_table(path).to_pylist()
    if path.suffix.lower() not in (".json", ".jsonl"):
        fail(f"{source}: a benchmark file must be .jsonl, .json or .parquet; convert it, or rename "
             "it if it is one.")
    text = path.read_text()
    # lines end at "\n" only: JSON allows U+2028 and U+0085 inside a string, where str.splitlines
    # would cut
    chunks = [(1, text)] if text.lstrip().startswith("[") else enumerate(text.split("\n"), 1)
    rows = []
    for number, chunk in chunks:
        if chunk.strip():
            try:
                value = json.loads(chunk)
            except json.JSONDecodeError as e:
                fail(f"{source}, line {number + e.lineno - 1}: not valid JSON ({e.msg}); fix that "
                     "line.")
            rows.extend(value if isinstance(value, list) else [value])
    if not all(isinstance(row, dict) for row in rows):
        fail(f"{source}: every row must be a JSON object: write one object a line (.jsonl), or a "
             "list of objects (.json).")
    return rows

def check_column(rows, source, flag, column):
    """Every row holds `column`, a string or a number (a bool is none), else a sentence naming the
    row or flag."""
    if column not in rows[0]:
        fail(f"{source} has no column {column!r}; its columns are {list(rows[0])}: name the right "
             f"one with {flag}.")
    for number, row in enumerate(rows, 1):
        value = row.get(column)
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            fail(f"{source}, row {number}: {column!r} is {value!r}, not a string or a number; fix "
                 "or remove that row.")

def load_problems(name, source, problem_column, answer_column):
    """[{problem, answer, hash}], the answer as text; no rows, a missing column or a missing answer
    is refused."""
    rows = read_rows(name, source)
    if not rows:
        fail(f"{name}: {source} holds no problems; write a row per problem in it, or pass another "
             f"file with --data {name}=FILE.")
    check_column(rows, source, "--problem-column", problem_column)
    check_column(rows, source, "--answer-column", answer_column)
    problems = []
    for row in rows:
        problem, answer = str(row[problem_column]), str(row[answer_column])
        digest = hashlib.sha256(json.dumps([problem, answer]).encode()).hexdigest()[:16]
        problems.append({"problem": problem, "answer": answer, "hash": digest})
    return problems


# -----------------------------------------------------------------------------
# Resume, and contents rather than paths: samples.jsonl is the only state; a restart refuses samples
# drawn under other settings, problems or weights (a fingerprint of the model's files, a hash of the
# adapter's); adapters must fit.

def read_samples(path, repair=True):
    """Records by (benchmark, problem, sample); a line cut by a kill is dropped, and with `repair`
    the file rewritten without it, so none is appended to a fragment."""
    done, broken = {}, 0
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            s = json.loads(line)
            done[s["benchmark"], s["problem"], s["sample"]] = s
        except (json.JSONDecodeError, TypeError, KeyError):
            broken += 1
    if broken and repair:
        print(f"dropping {broken} unreadable line(s) of {path}")
        # written whole, then renamed: a kill now cannot lose the good lines
        opsd.write_atomically(path, "".join(json.dumps(s) + "\n" for s in done.values()))
    return done

def check_resume(out_dir, config, problems, done):
    """Settings count once a sample exists (a run that died before one binds no rerun); contents
    where both hashed."""
    if not done:
        return
    path = out_dir / "config.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    changed = [k for k in SAMPLING_KEYS if old.get(k) != config[k]]
    changed += [what for k, what in CONTENT_KEYS.items()
                if None not in (old.get(k), config[k]) and old[k] != config[k]]
    if changed:
        fail(f"{out_dir} holds samples drawn with other {', '.join(changed)}: use a new "
             "--output-dir.")
    for b, i, _ in done:
        if b not in problems:
            continue
        if i >= len(problems[b]) or done[b, i, _].get("hash") != problems[b][i]["hash"]:
            fail(f"{out_dir} holds samples of another {b} (problem {i} differs from the one "
                 "read now): use a new --output-dir.")

def check_adapter(adapter, model, allow_other_base):
    path = Path(adapter)
    if not (path / "adapter_config.json").is_file():
        fail(f"No adapter_config.json in {adapter}: pass a directory written by opsd.py.")
    weights = ("adapter_model.safetensors", "adapter_model.bin")
    if not any((path / name).is_file() for name in weights):
        fail(f"{adapter} holds an adapter config but no adapter_model.safetensors: "
             "pass a directory written by opsd.py.")
    config = json.loads((path / "adapter_config.json").read_text())
    rank, base = config.get("r"), config.get("base_model_name_or_path")
    if type(rank) is not int or not 1 <= rank <= max(VLLM_LORA_RANKS):
        fail(f"{adapter} has LoRA rank {rank}, and vLLM serves ranks 1 to {max(VLLM_LORA_RANKS)}: "
             "train with a smaller --lora-r.")
    base_dir = model_dir(base) if base else None
    same_dir = base_dir is not None and base_dir == model_dir(model)
    if allow_other_base or base in (None, model) or same_dir:
        return
    if model_fingerprint(base) is None or model_fingerprint(base) != model_fingerprint(model):
        fail(f"{adapter} was trained on {base}, which is neither the directory nor the weights of "
             f"--model {model}: pass --model {base}, or --allow-other-base to evaluate it on this "
             "model.")

if __name__ == "__main__":
    main()
    # Every sample and the summary are written and the engine is shut down: the interpreter's
    # teardown of torch and vLLM would add seconds and do nothing for them.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
