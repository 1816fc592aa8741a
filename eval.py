"""
Evaluate a model, or a model plus an adapter written by opsd.py, on AIME24, AIME25 and HMMT25.

    python eval.py --model Qwen/Qwen3-1.7B --adapter runs/opsd/final --output-dir runs/eval-opsd

The protocol (the OPSD paper's released one), departures from it, restarts and a CPU run: README.md, "Evaluation".
"""

import argparse
import hashlib
import json
import os
import sys
import threading
from collections import Counter, defaultdict
from pathlib import Path

import math_verify

HUB_IDS = {"aime24": "HuggingFaceH4/aime_2024", "aime25": "yentinglin/aime_2025", "hmmt25": "MathArena/hmmt_feb_2025"}
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
GRADING_TIMEOUT_S = 5
# What decides what a sample is, settings and contents behind the paths: a restart must not mix samples of others.
SAMPLING_KEYS = ("model", "adapter", "thinking", "temperature", "top_p", "max_new_tokens", "seed", "dtype")
CONTENT_KEYS = {"model_fingerprint": "model weights", "adapter_sha256": "adapter weights"}
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM 0.32 takes

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip(),
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("--model", required=True, default=argparse.SUPPRESS, help="hub id or local path of the base model")
    g.add_argument("--adapter", help="LoRA adapter directory written by opsd.py, applied through vLLM's LoRA support")
    g.add_argument("--allow-other-base", action="store_true", help="evaluate --adapter on a model not its base")
    g.add_argument("--dtype", default="auto", help="vLLM weight dtype; auto takes the model config's")
    g.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs one vLLM engine is split over")
    g.add_argument("--gpu-memory-utilization", type=float, help="share of GPU memory vLLM may take (None: vLLM's)")
    g.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=False,
                   help="skip CUDA graphs and compilation: a quicker start, and what a CPU run needs")
    g = p.add_argument_group("data")
    g.add_argument("--benchmarks", help=f"comma-separated, of {', '.join(HUB_IDS)} and --data (None: --data's or all)")
    g.add_argument("--data", action="append", default=[], metavar="NAME=PATH",
                   help="benchmark NAME from a local file (repeatable): .jsonl (an object a line), .json (a list "
                        "of objects) or .parquet, a row per problem: a problem column and an answer column, not null")
    g.add_argument("--problem-column", default="problem", help="column holding the problem text")
    g.add_argument("--answer-column", default="answer", help="column holding the reference answer")
    g = p.add_argument_group("sampling")
    g.add_argument("--n", type=int, default=12, help="samples per problem")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    g.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling threshold")
    g.add_argument("--max-new-tokens", type=int, default=38912, help="generation budget per sample")
    g.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=True, help="enable_thinking")
    g.add_argument("--seed", type=int, default=42, help="root of every per-sample seed")
    p.add_argument("--output-dir", required=True, default=argparse.SUPPRESS, help="for samples, summary and config")
    args = p.parse_args(argv)
    check_flags(args)
    return args


# -----------------------------------------------------------------------------
# Prompts and sampling with vLLM: the released prompt as token ids; one engine samples everything, each sample
# with its own seed (a restart draws the same sample again) and written to samples.jsonl the moment it finishes.

def build_prompt(problem):
    return f"{problem}\n\n{INSTRUCTION}"

def prompt_ids(tokenizer, problem, thinking):
    messages = [{"role": "user", "content": build_prompt(problem)}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=thinking,
                                         tokenize=True, return_dict=False)

def sample_seed(seed, benchmark, problem, sample):
    digest = hashlib.sha256(f"{seed}/{benchmark}/{problem}/{sample}".encode()).digest()  # hash() is salted
    return int.from_bytes(digest[:4], "little")

def start_engine(args):
    """The vLLM engine, and the LoRARequest that applies --adapter to every sample (None without one)."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its ~90 start-up lines would bury the progress
    from vllm import LLM
    from vllm.lora.request import LoRARequest
    from vllm.platforms import current_platform
    extra = {}
    if args.gpu_memory_utilization is not None:  # on the CPU build it is a share of RAM: leave it unset there
        extra["gpu_memory_utilization"] = args.gpu_memory_utilization
    elif current_platform.is_cpu():  # else the CPU build reserves 92% of RAM, and will not start with less free
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if current_platform.is_cpu():
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: a 2x quicker start
        # Whole prompts: one prefilled in chunks (past 4,096 queued tokens) rewinds its seeded generator, which a CPU
        # torch.Generator cannot do ("CPU Generator does not use offset").
        extra["enable_chunked_prefill"] = False
    if args.adapter:  # vLLM takes only some maximum ranks: the smallest that holds the adapter's (check_adapter)
        rank = json.loads((Path(args.adapter) / "adapter_config.json").read_text())["r"]
        extra.update(enable_lora=True, max_lora_rank=min(r for r in VLLM_LORA_RANKS if r >= rank))
    llm = LLM(model=args.model, dtype=args.dtype, seed=args.seed, tensor_parallel_size=args.tensor_parallel_size,
              enforce_eager=args.enforce_eager, use_tqdm_on_load=False, **extra)
    return llm, (LoRARequest("adapter", 1, str(Path(args.adapter).resolve())) if args.adapter else None)

def draw(args, problems, todo, out_dir, config):
    """Sample every (benchmark, problem, sample) in `todo`, appending each record as it finishes."""
    llm, lora = start_engine(args)
    from transformers import AutoTokenizer
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")  # once up, before any sample exists
    # The engine's own loop, not llm.generate(): a sample is written as it finishes, a kill loses those in flight.
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
                record = {"benchmark": b, "problem": i, "sample": j, "hash": problems[b][i]["hash"],
                          "answer": extract_boxed(completion.text),
                          "correct": is_correct(completion.text, problems[b][i]["answer"]),
                          "tokens": len(completion.token_ids), "truncated": completion.finish_reason == "length",
                          "completion": completion.text}  # kept so samples can be regraded without resampling
                f.write(json.dumps(record) + "\n")
                f.flush()
                finished += 1
                if finished % max(1, len(todo) // 20) == 0 or finished == len(todo):
                    print(f"{finished}/{len(todo)} samples", flush=True)
    # Stopped here: left to vLLM's exit handlers, the engine process is killed and reported "exited unexpectedly".
    engine.engine_core.shutdown(timeout=60)


# -----------------------------------------------------------------------------
# Grading and metrics: the released evaluation's verdict (the last \boxed's content against the gold answer, by
# math_verify), and the metrics from the sample records alone, so that a resumed run and an uninterrupted one agree.

def extract_boxed(text):
    """The content of the LAST \\boxed{...}, braces matched; None if they never close or no brace follows \\boxed."""
    start = text.rfind("\\boxed{")
    if start < 0 or start != text.rfind("\\boxed"):
        return None
    depth = 0
    for end in range(start + len("\\boxed"), len(text)):
        depth += {"{": 1, "}": -1}.get(text[end], 0)
        if depth == 0:
            return text[start + len("\\boxed{") : end].strip()
    return None

def verdict(predicted, gold):
    """Is `predicted` (None: no answer) equal to `gold`? math_verify decides, with no fallback and 5 s timeouts
    (SIGALRM alarms: main thread only); only if it raises are the two compared as strings."""
    if predicted is None:
        return False
    predicted, gold = (s if "$" in s else f"${s}$" for s in (predicted, gold))
    try:
        gold_parsed, predicted_parsed = (math_verify.parse(s, parsing_timeout=GRADING_TIMEOUT_S,
                                                           fallback_mode="no_fallback") for s in (gold, predicted))
        return bool(math_verify.verify(gold_parsed, predicted_parsed, timeout_seconds=GRADING_TIMEOUT_S))
    except Exception:
        plain_predicted, plain_gold = (s.replace("$", "").replace(" ", "").lower().strip() for s in (predicted, gold))
        return plain_predicted == plain_gold

def require_main_thread():
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("eval.py grades in the main thread only: math_verify's 5 s timeout is a SIGALRM "
                           "alarm, which no other thread can set.")

def is_correct(completion, answer):
    require_main_thread()
    return verdict(extract_boxed(completion), str(answer))

def majority_correct(samples):
    """Is the most common answer correct? Votes by equivalence ("033" = "33"), ties to the earliest; no vote: False."""
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
    """Per benchmark and pooled ('all'), over P problems of n samples: avg@n = correct samples / (P n), pass@n =
    problems with a correct sample / P, maj@n = problems whose majority answer is right / P; tokens; cut-off share."""
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
# Run: check what a user can get wrong, read the problems, draw what samples.jsonl lacks, summarise the file.

def main(argv=None):
    args = parse_args(argv)
    sources = benchmark_sources(args.benchmarks, args.data)
    if not Path(args.model).exists() and (args.model.startswith((".", "/", "~")) or args.model.count("/") != 1):
        raise SystemExit(f"--model {args.model}: no such directory, and not a hub id of the form owner/name.")
    if args.adapter:
        check_adapter(args.adapter, args.model, args.allow_other_base)
    problems = {b: load_problems(b, src, args.problem_column, args.answer_column) for b, src in sources.items()}
    wanted = [(b, i, j) for b in problems for i in range(len(problems[b])) for j in range(args.n)]
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    samples_path = out_dir / "samples.jsonl"
    done = read_samples(samples_path)
    adapter_files = sorted(Path(args.adapter).glob("adapter_*")) if args.adapter else []  # config, then weights
    config = {**{k: getattr(args, k) for k in SAMPLING_KEYS}, "model_fingerprint": model_fingerprint(args.model),
              "adapter_sha256": hashlib.sha256(b"".join(f.read_bytes() for f in adapter_files)).hexdigest()
              if adapter_files else None}
    check_resume(out_dir, config, problems, done)
    todo = [key for key in wanted if key not in done]
    print(f"{len(wanted) - len(todo)} of {len(wanted)} samples already in {samples_path}")
    if todo:
        draw(args, problems, todo, out_dir, config)
    # The summary reads the file back, not this process's memory: exactly what a restarted run sees.
    done = read_samples(samples_path)
    assert all(key in done for key in wanted), f"samples missing from {samples_path}"
    summary = {"config": {**config, "n": args.n, "benchmarks": sources},
               "metrics": summarize([done[key] for key in wanted], args.n)}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(format_table(summary["metrics"], args.n))
    return summary

# =============================================================================
# What keeps an evaluation honest
# Bad input is refused early, in one sentence, before any engine starts; a restart cannot mix in other samples.

# -----------------------------------------------------------------------------
# Flags and data: flag ranges, benchmark names, and reading the problems; a bad file is named with its line or row.

def check_flags(args):
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

def use_cache_if_hub_silent(timeout_s=3):
    """Without network the Hugging Face libraries retry each request for ~25 s: set HF_HUB_OFFLINE (read when they
    are imported) if the Hub does not answer within timeout_s, so that they go to their cache at once."""
    import urllib.error
    import urllib.request
    try:
        request = urllib.request.Request(os.environ.get("HF_ENDPOINT", "https://huggingface.co"), method="HEAD")
        urllib.request.urlopen(request, timeout=timeout_s).close()
    except (OSError, ValueError) as e:  # no answer in time; an HTTP error is an answer
        if not isinstance(e, urllib.error.HTTPError):
            os.environ["HF_HUB_OFFLINE"] = "1"

def read_rows(source):
    """Rows of a local file or a hub data set, each with its place ('line 7', 'row 7') for error messages."""
    path, rows = Path(source), None
    suffix = path.suffix.lower()
    if not path.is_file():
        use_cache_if_hub_silent()
        from datasets import load_dataset
        try:
            splits = load_dataset(source)  # the three hub sets hold a single split
        except (ConnectionError, FileNotFoundError):
            raise SystemExit(f"{source} is not in the local cache and the Hugging Face Hub cannot be reached: "
                             "evaluate offline from a local copy with --data NAME=PATH.") from None
        rows = [dict(r) for r in (splits["test"] if "test" in splits else splits[next(iter(splits))])]
    elif suffix == ".parquet":
        import pyarrow.parquet as pq
        rows = pq.read_table(path).to_pylist()
    elif suffix not in (".json", ".jsonl"):
        raise SystemExit(f"{source} is not .json, .jsonl or .parquet.")
    elif suffix == ".json":
        try:
            rows = json.loads(path.read_text())
        except json.JSONDecodeError:
            pass  # many .json files are JSON lines: read it as such below
        if rows is not None and (not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows)):
            raise SystemExit(f"{source} holds JSON that is not a list of objects (one per problem).")
    if rows is not None:
        return [(f"row {i}", r) for i, r in enumerate(rows)]
    numbered = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise SystemExit(f"{source}, line {number}: not valid JSON ({e.msg}).") from None
        if not isinstance(row, dict):
            raise SystemExit(f"{source}, line {number}: not a JSON object.")
        numbered.append((f"line {number}", row))
    return numbered

def load_problems(name, source, problem_column, answer_column):
    """[{problem, answer, hash}], the answer as text; no rows, a missing column or a null is refused."""
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


# -----------------------------------------------------------------------------
# Resume, and contents rather than paths: samples.jsonl is the only state; a restart refuses samples drawn under
# other settings, problems or weights (a fingerprint of the model's files, a hash of the adapter's); adapters must fit.

def read_samples(path):
    """Records by (benchmark, problem, sample); a line cut by a kill is dropped, so none is appended to a fragment."""
    done, broken = {}, 0
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            s = json.loads(line)
            done[s["benchmark"], s["problem"], s["sample"]] = s
        except (json.JSONDecodeError, TypeError, KeyError):
            broken += 1
    if broken:
        print(f"dropping {broken} unreadable line(s) of {path}")
        tmp = path.with_suffix(".tmp")  # written whole, then renamed: a kill now cannot lose the good lines
        tmp.write_text("".join(json.dumps(s) + "\n" for s in done.values()))
        os.replace(tmp, path)
    return done

def check_resume(out_dir, config, problems, done):
    """Settings count once a sample exists (a run that died before one binds no rerun); contents where both hashed."""
    if not done:
        return
    path = out_dir / "config.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    changed = [k for k in SAMPLING_KEYS if old.get(k) != config[k]]
    changed += [what for k, what in CONTENT_KEYS.items() if None not in (old.get(k), config[k]) and old[k] != config[k]]
    if changed:
        raise SystemExit(f"{out_dir} holds samples drawn with other {', '.join(changed)}: use a new --output-dir.")
    for b, i, _ in done:
        if b in problems and (i >= len(problems[b]) or done[b, i, _].get("hash") != problems[b][i]["hash"]):
            raise SystemExit(f"{out_dir} holds samples of another {b} (problem {i} differs from the one "
                             "read now): use a new --output-dir.")

def check_adapter(adapter, model, allow_other_base):
    path = Path(adapter)
    if not (path / "adapter_config.json").is_file():
        raise SystemExit(f"No adapter_config.json in {adapter}: pass a directory written by opsd.py.")
    if not any((path / name).is_file() for name in ("adapter_model.safetensors", "adapter_model.bin")):
        raise SystemExit(f"{adapter} holds an adapter config but no adapter_model.safetensors: "
                         "pass a directory written by opsd.py.")
    config = json.loads((path / "adapter_config.json").read_text())
    rank, base = config.get("r"), config.get("base_model_name_or_path")
    if type(rank) is not int or not 1 <= rank <= max(VLLM_LORA_RANKS):
        raise SystemExit(f"{adapter} has LoRA rank {rank}, and vLLM serves ranks 1 to {max(VLLM_LORA_RANKS)}: "
                         "train with a smaller --lora-r.")
    base_dir = model_dir(base) if base else None
    if allow_other_base or base in (None, model) or (base_dir is not None and base_dir == model_dir(model)):
        return
    if model_fingerprint(base) is None or model_fingerprint(base) != model_fingerprint(model):
        raise SystemExit(f"{adapter} was trained on {base}, which is neither the directory nor the weights of "
                         f"--model {model}: pass --model {base}, or --allow-other-base to evaluate it on this model.")

def model_dir(model):
    """A local model's directory, or a hub model's cached snapshot, found without network; None if neither."""
    if Path(model).expanduser().is_dir():
        return Path(model).expanduser().resolve()
    from huggingface_hub import try_to_load_from_cache
    try:
        config = try_to_load_from_cache(model, "config.json")
    except ValueError:  # not a hub id either
        return None
    return Path(config).parent.resolve() if isinstance(config, str) else None

def model_fingerprint(model, chunk=64 << 10):
    """opsd.py's: sha256 of config.json and of each weight file's name, size and 16 evenly spaced samples; else None."""
    directory = model_dir(model)
    weights = (sorted(directory.glob("*.safetensors")) or sorted(directory.glob("*.bin"))) if directory else []
    if not weights or not (directory / "config.json").is_file():
        return None
    h = hashlib.sha256((directory / "config.json").read_bytes())
    for file in weights:
        size = file.stat().st_size
        h.update(f"{file.name}\0{size}\0".encode())
        read = chunk if size >= 16 * chunk else size
        with file.open("rb") as f:
            for k in range(16 if read < size else 1):
                f.seek(k * (size - read) // 15)
                h.update(f.read(read))
    return h.hexdigest()

if __name__ == "__main__":
    try:
        main()
    except SystemExit as e:  # a refusal's sentence, in argparse's form and with its exit code
        if not isinstance(e.code, str):
            raise
        print(f"eval.py: error: {e.code}", file=sys.stderr)
        raise SystemExit(2) from None
