"""Before renting GPUs: the memory per GPU and the hours of an opsd.py run, or of
eval.py's protocol. No weights are loaded and no GPU is needed.

    python tests/gpu_check/budget.py -- --clip token --skip-first-tokens 1
    python tests/gpu_check/budget.py --gpu h200 --config CONFIG_JSON -- --model ...
    python tests/gpu_check/budget.py --eval --answer-tokens 14000 -- --n 12

Everything after `--` is opsd.py's own flags, read by opsd.parse_args (its
defaults, its checks), or with --eval eval.py's, read by eval.parse_args. The
model's config comes from --config, else from their --model (a local directory,
or a hub id: network or the hub's cache). The model is built on torch's meta
device (shapes, no memory) to count its parameters, and opsd.add_lora on it
counts the LoRA's.

Memory. Every rank holds all of what follows on its own GPU:

- weights: every parameter in --dtype;
- LoRA: its A and B in float32, their gradients, AdamW's two moments and the
  flat copy the gradient all-reduce makes (5 x 4 bytes a parameter), and the
  EMA teacher's copy with --teacher ema;
- activations: what the student's forward keeps for its backward at the longest
  micro-batch (--micro-batch-size rows of --max-prompt-length + --max-new-tokens
  tokens), counted tensor by tensor for a Qwen3-style layer (norms, projections
  and their LoRA, RoPE, SDPA's inputs and output, the MLP) in `layer_bytes`;
  with gradient checkpointing each layer's input plus one layer recomputed in
  the backward, without it every layer's; plus the backward's working set, the
  padding mask, and the final hidden states of student and teacher;
- one loss chunk: --loss-chunk-size positions of full-vocabulary logits and the
  float32 tensors alive at once in the loss, its gradient and its diagnostics
  (`LOSS_CHUNK_COPIES`);
- vLLM: --vllm-memory of the GPU (vLLM takes that share whatever it needs).

Not counted: the CUDA context and the caching allocator's fragmentation
(together about 1-2 GiB on a recent GPU), which is why a budget within 2 GiB of
the card is said not to fit. tests/test_gpu_check.py checks the trainer-side
formula against the peak memory a CPU run of opsd.backward_step and AdamW takes
at several tiny sizes; gpu_check.py prints the same estimate beside each peak it
measures on CUDA.

Time. Each phase's work is counted, then timed on the GPU of --gpu (`GPUS`:
NVIDIA's datasheet peaks, dense) twice. The lower bound runs every GEMM at its
dtype's peak FLOP/s and every other kernel at the peak memory bandwidth, one
after another. The expected time runs them at --flops-utilisation and
--bandwidth-utilisation of those peaks, plus --decode-step-ms for each decode
step (vLLM's scheduling, sampling and launches). One optimizer step, on each
of --gpus ranks, which share --prompts-per-step:

- sample: decoding, bound by memory bandwidth. A step takes --max-new-tokens
  decode steps (it waits for its longest answer); each reads every weight (the
  lm_head too) and the KV cache of the rank's answers so far. The prompts'
  prefill counts as FLOPs.
- train: the FLOPs of the teacher's forward, the student's forward, its
  recompute under gradient checkpointing and its backward (input gradients
  through the frozen weights: one forward's worth; attention's backward 2.5
  forwards). The LoRA runs in float32, which opsd.py keeps at full precision,
  so its FLOPs go at the float32 peak. The loss's float32 chunk tensors count
  as bytes, AdamW as bytes, the gradient all-reduce as bytes over the link.
  tests/test_gpu_check.py holds these FLOPs equal to what torch's
  FlopCounterMode counts in opsd.backward_step on a tiny Qwen3.
- push: bytes moved. Each merged weight is made twice (the push, and its
  read-back), loaded into the engine, read back through an identity GEMM (its
  FLOPs), and fingerprinted on both sides (`push_work`).

The lengths are assumptions, printed beside their figures: the mean answer
(--answer-tokens; by default every answer runs to --max-new-tokens), the
student's prompt (--prompt-tokens) and the teacher's (--teacher-prompt-tokens;
by default --max-prompt-length, since a micro-batch is padded to its longest
row). The run is --max-steps steps plus --startup-minutes. The expected step
stands beside the released recipe's ~9 s a step on 4 x H100.

With --eval, eval.py's protocol: problems x --n samples x a mean answer of
--answer-tokens (the model decides it; eval.py's summary reports mean_tokens).
Decoding is bound by memory bandwidth: each answer token reads its sample's KV
cache so far, and each decode step of an engine's batch reads the weights. The
batch is vLLM's 1,024 sequences at most, or as many as its KV cache holds.
eval.py runs one engine over --tensor-parallel-size GPUs (1 unless given):
the other --gpus idle, billed all the same; a --tensor-parallel-size over
--gpus, or one that does not divide the attention heads, is refused.
"""

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import opsd  # noqa: E402
from eval import AT_LEAST_1, NON_NEGATIVE, SHARE, checked  # noqa: E402

GIB = 2 ** 30
# CUDA context and allocator fragmentation: the room a budget must leave
UNCOUNTED_GIB = 2
# float32 (C, V) tensors alive at the loss's peak for one chunk: the student's
# logits in float32, scaled, their log-softmax; the teacher's log-softmax; p_T,
# the difference and the divergence; their gradients in the backward
LOSS_CHUNK_COPIES = 8

# NVIDIA's datasheet figures for the SXM and PCIe cards, dense (the sparse
# figures are twice these): bf16 and float32 FLOP/s (float32 without TF32, as
# opsd.py runs it), memory bandwidth and the link between GPUs (NVLink, or
# PCIe Gen5 for the PCIe card) in bytes/s one way; memory in GiB, as named
GPUS = {
    "h100": {"name": "H100 SXM 80 GB", "bf16": 989e12,
             "float32": 67e12, "bandwidth": 3.35e12,
             "link": 450e9, "gib": 80},
    "h200": {"name": "H200 SXM 141 GB", "bf16": 989e12,
             "float32": 67e12, "bandwidth": 4.8e12,
             "link": 450e9, "gib": 141},
    "h100-pcie": {"name": "H100 PCIe 80 GB", "bf16": 756e12,
                  "float32": 51e12, "bandwidth": 2.0e12,
                  "link": 64e9, "gib": 80},
}
# What the expected time assumes, each a flag: the share of peak FLOP/s a
# transformers training step reaches; the share of peak bandwidth vLLM's
# decode kernels reach; the time each decode step costs beside its bytes; the
# minutes a run spends loading, compiling and saving
FLOPS_UTILISATION = 0.35
BANDWIDTH_UTILISATION = 0.7
DECODE_STEP_MS = 1.5
STARTUP_MINUTES = 3
PROMPT_TOKENS = 256  # a problem, the instruction and the chat template
EVAL_ANSWER_TOKENS = 16_000  # an assumption, not measured here
# The released recipe, as reported: ~15 minutes for 100 steps of Qwen3-1.7B
# on 4 x H100
RECIPE_STEP_S = 9
ATTENTION_BACKWARD = 2.5  # five matmuls to the forward's two
# AdamW (read p, g, m, v; write p, m, v), the all-reduce's flat copy and its
# copy back, the clip's norm and scaling: float32 passes over the LoRA
UPDATE_PASSES = 7 + 4 + 3
# eval.py: the problems of each hub benchmark; vLLM 0.32's defaults for an
# engine made by LLM() on a card of 70 GiB or more
HUB_PROBLEMS = {"aime24": 30, "aime25": 30, "hmmt25": 30}
VLLM_MAX_SEQS = 1024
VLLM_MEMORY = 0.92


def refuse(message):
    """One sentence on stderr, exit status 2."""
    print(f"budget.py: error: {message}", file=sys.stderr)
    raise SystemExit(2)


# argparse types: eval.py's (imported above), and one of our own
POSITIVE = checked(float, lambda v: v > 0, "positive")


# -----------------------------------------------------------------------------
# Memory


def layer_bytes(config, dtype_bytes, lora_r):
    """Bytes one decoder layer keeps for its backward per token: each term a
    tensor saved by the op that reads it. H hidden, Q = query heads x head_dim,
    K = key/value heads x head_dim, I the MLP's width; b the model's dtype, c
    the float32 copy a norm or a LoRA input makes when the model is not float32
    (0 in float32)."""
    H, I, L, Q, K, V = shapes(config)
    b, c = dtype_bytes, (0 if dtype_bytes == 4 else 4)
    # grouped-query heads: SDPA gets keys and values repeated to every head
    repeated = 2 * b * Q if K < Q else 0
    # two norms: the float32 input, the output the projections read; LoRA
    # inputs. q's norm and RoPE, SDPA's query and output, o_proj's input.
    # k's norm and RoPE, v. gate, up, silu(gate), their product (down's
    # input), down's LoRA input. A x of each of the seven LoRA layers.
    return ((8 + 2 * b + 5 * c) * H
            + (4 + 5 * b + c) * Q + repeated
            + (4 + 4 * b) * K
            + (4 * b + c) * I
            + 7 * 4 * lora_r)


def count_parameters(config, args):
    """(the model's parameters, its LoRA's), counted on the meta device."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    lora = opsd.add_lora(model, args.lora_r, args.lora_alpha,
                         seed=args.seed)
    return total, sum(p.numel() for p in lora)


def trainer_bytes(config, args, parameters, lora_parameters):
    """{part: bytes} on one GPU for the trainer: weights, LoRA state,
    activations, one loss chunk."""
    b = 2 if args.dtype == "bfloat16" else 4
    H, L = config.hidden_size, config.num_hidden_layers
    V = config.vocab_size
    # the longest micro-batch; N the answer positions the loss scores
    B = args.micro_batch_size
    T = args.max_prompt_length + args.max_new_tokens
    N = B * args.max_new_tokens
    per_layer = B * T * layer_bytes(config, b, args.lora_r)
    kept = L * per_layer
    if args.gradient_checkpointing:
        kept = L * B * T * H * b + per_layer
    # gradients of one layer's largest tensors
    working = B * T * 2 * b * (config.intermediate_size + H)
    # mask; final hidden states; the loss's (N, H) copies
    around = B * T * T + 2 * B * T * H * b + 4 * N * H * b
    lora_copies = 5 + (args.teacher == "ema")
    chunk = LOSS_CHUNK_COPIES * 4 + 2 * b
    return {"weights": parameters * b,
            "lora": lora_parameters * 4 * lora_copies,
            "activations": kept + working + around,
            "loss_chunk": args.loss_chunk_size * V * chunk}


# -----------------------------------------------------------------------------
# Work: FLOPs and bytes of each phase, counted from the config


def shapes(config):
    """(H, I, L, Q, K, V): hidden size, the MLP's width, layers, the query's
    and the keys' widths (heads x head_dim), vocabulary."""
    H = config.hidden_size
    head_dim = getattr(config, "head_dim", None)
    if not head_dim:
        head_dim = H // config.num_attention_heads
    Q = config.num_attention_heads * head_dim
    K = config.num_key_value_heads * head_dim
    return (H, config.intermediate_size, config.num_hidden_layers, Q, K,
            config.vocab_size)


def projections(config):
    """Weights of the seven projections of every layer (q, o: H x Q; k, v:
    H x K; gate, up, down: H x I): what each token multiplies, what the
    LoRA wraps and what the push merges."""
    H, I, L, Q, K, V = shapes(config)
    return L * (2 * H * Q + 2 * H * K + 3 * H * I)


def decode_parameters(config, parameters):
    """The weights a decode step reads: all of them, less the input
    embedding when it is not the lm_head (a step gathers a few rows)."""
    H, I, L, Q, K, V = shapes(config)
    if getattr(config, "tie_word_embeddings", False):
        return parameters
    return parameters - V * H


def kv_bytes(config, b):
    """Bytes of one token's keys and values, all layers."""
    H, I, L, Q, K, V = shapes(config)
    return 2 * L * K * b


def attention_flops(config, tokens):
    """One row's attention forward, all layers: scores and values, 4 Q T^2.
    The padding mask makes SDPA compute the whole T x T square."""
    H, I, L, Q, K, V = shapes(config)
    return 4 * Q * tokens ** 2 * L


def cached_reads(prompt, answer):
    """KV cache entries one answer reads: its token t reads the prompt and
    the t tokens before it."""
    return answer * prompt + answer * (answer - 1) // 2


def work(flops=0, float32_flops=0, moved=0, link=0, decode_steps=0):
    """FLOPs in the model's dtype, float32 FLOPs (the LoRA's), bytes moved
    through memory, bytes over the link, decode steps."""
    return {"flops": flops, "float32_flops": float32_flops,
            "moved": moved, "link": link, "decode_steps": decode_steps}


def sample_work(config, parameters, b, rows, prompt, answer,
                decode_steps):
    """One rank's sampling: `rows` answers of `answer` tokens to prompts
    of `prompt`, in `decode_steps` decode steps."""
    read = decode_parameters(config, parameters)
    weights = decode_steps * read * b
    cache = rows * cached_reads(prompt, answer) * kv_bytes(config, b)
    prefill = 2 * read * rows * prompt
    return work(flops=prefill, moved=weights + cache,
                decode_steps=decode_steps)


def train_work(config, lora, b, rows, lengths, *, lora_r, teacher_lora,
               checkpointing, gpus):
    """{part: work} of one rank's optimizer step over `rows` rows.
    lengths: the student's prompt, the teacher's and the answer, each a
    micro-batch's padded mean. lora: the LoRA's parameters, of rank
    lora_r. teacher_lora: the teacher runs the LoRA (--teacher current or
    ema)."""
    student, teacher, answer = lengths
    H, I, L, Q, K, V = shapes(config)
    dense = 2 * projections(config)  # FLOPs a token
    adapter = 2 * lora  # float32 FLOPs a token
    scored = rows * answer  # positions the loss scores
    lm_head = scored * 2 * V * H
    Ts = student + answer
    Tt = teacher + answer
    student_flops = rows * (Ts * dense + attention_flops(config, Ts))
    teacher_flops = rows * (Tt * dense + attention_flops(config, Tt))
    # The backward: input gradients through the frozen weights (one
    # forward's worth), and the LoRA's gradients of A, B and its input
    # (two). Without checkpointing the first layer's q, k and v take no
    # input gradient, since the embedding needs none; with it, transformers
    # asks the embedding for one.
    first = 2 * H * (Q + 2 * K)
    first_lora = 3 * 2 * lora_r * H
    if checkpointing:
        first, first_lora = 0, 0
    backward = rows * (Ts * (dense - first)
                       + ATTENTION_BACKWARD * attention_flops(config, Ts))
    # torch's checkpoint stops recomputing a layer once it has every tensor
    # the backward keeps: the layer's last product, down_proj's B u, is not
    # run again
    last = L * 2 * lora_r * H
    loss = scored * V * 2 * (LOSS_CHUNK_COPIES * 4 + 2 * b)
    ring = 2 * (gpus - 1) / gpus * lora * 4
    return {
        "teacher forward": work(
            teacher_flops + lm_head, rows * Tt * adapter * teacher_lora),
        "student forward": work(
            student_flops + lm_head, rows * Ts * adapter),
        "recompute": work(student_flops * checkpointing,
                          rows * Ts * (adapter - last) * checkpointing),
        "backward": work(backward + lm_head,
                         rows * Ts * (2 * adapter - first_lora)),
        "loss": work(moved=loss),
        "update": work(moved=lora * 4 * UPDATE_PASSES, link=ring),
    }


def push_work(config, b, lora_r):
    """One push and its read-back on one rank (opsd.push_weights,
    opsd.check_push), a merged weight's bytes in the order they move:

    - a merge, twice (the push's, and the read-back's on the trainer's side):
      W.float() reads b, writes 4; B A writes 4; its scaling reads and writes
      4; the sum reads 8, writes 4; the cast reads 4, writes b;
    - the engine's load: reads b, writes b (vLLM's reload counted as this
      one copy);
    - the engine's read-back GEMM, I W^T: reads W, writes W^T (b each), and
      its identity (in x in) is written and read;
    - a fingerprint, twice: + 0.0 reads and writes b; to int64 reads b,
      writes 8; the positions write 8; three sums read 8; the two products
      read 8 and 16, write 8 each; on the engine's side the transposed
      weight is first copied (b and b).

    The GEMMs: I W^T on vLLM's stacked layers (qkv, o, gate_up, down) in the
    model's dtype, and the merges' B A in float32 (2 r FLOPs a weight)."""
    H, I, L, Q, K, V = shapes(config)
    merge = (b + 4) + 4 + 8 + 12 + (4 + b)
    load = 2 * b
    readback = 2 * b
    fingerprint = 2 * b + (b + 8) + 8 + 3 * 8 + (8 + 8) + (16 + 8)
    transposed = 2 * b
    per_weight = (2 * merge + load + readback + 2 * fingerprint
                  + transposed)
    # vLLM's stacked layers, (in, out)
    stacked = [(H, Q + 2 * K), (Q, H), (H, 2 * I), (I, H)]
    eye = L * sum(2 * b * n * n for n, out in stacked)
    gemm = L * sum(2 * n * n * out for n, out in stacked)
    n = projections(config)
    return work(flops=gemm, float32_flops=2 * 2 * lora_r * n,
                moved=n * per_weight + eye)


def eval_work(config, parameters, b, *, problems, samples, prompt, answer,
              gpus, tensor_parallel, memory):
    """(work on each GPU, answers an engine holds at once, the tokens its KV
    cache holds) for eval.py's samples split evenly over gpus /
    tensor_parallel engines. memory: the bytes vLLM takes of each GPU."""
    engines = gpus // tensor_parallel
    mine = math.ceil(samples / engines)
    read = decode_parameters(config, parameters)
    weights = read * b / tensor_parallel  # each GPU's share
    free = memory - weights - UNCOUNTED_GIB * GIB
    holds = int(tensor_parallel * free // kv_bytes(config, b))
    at_once = min(VLLM_MAX_SEQS, mine, holds // (prompt + answer // 2))
    steps = math.ceil(mine * answer / max(at_once, 1))
    cache = mine * cached_reads(prompt, answer) * kv_bytes(config, b)
    # the prompt is computed once for a problem's samples (prefix caching)
    prefill = 2 * read * math.ceil(problems / engines) * prompt
    done = work(flops=prefill / tensor_parallel,
                moved=steps * weights + cache / tensor_parallel,
                decode_steps=steps)
    return done, at_once, holds


def seconds(done, gpu, b, flops_share=1.0, bandwidth_share=1.0,
            step_s=0.0):
    """The time of `done` on `gpu`: each kernel at the shares of its peak,
    one after another (a lower bound at shares 1 and no step time)."""
    peak = gpu["bf16"]
    if b == 4:
        peak = gpu["float32"]
    return (done["flops"] / (peak * flops_share)
            + done["float32_flops"] / (gpu["float32"] * flops_share)
            + done["moved"] / (gpu["bandwidth"] * bandwidth_share)
            + done["link"] / (gpu["link"] * bandwidth_share)
            + done["decode_steps"] * step_s)


def both(done, gpu, b, own):
    """(lower bound, expected) seconds of `done`."""
    shares = (own.flops_utilisation, own.bandwidth_utilisation,
              own.decode_step_ms / 1000)
    return seconds(done, gpu, b), seconds(done, gpu, b, *shares)


def total(parts):
    """The work of several parts together."""
    return {k: sum(p[k] for p in parts) for k in work()}


def gpu_key(device_name):
    """The key in GPUS of a CUDA device's name, or None."""
    name = device_name.lower()
    if "h200" in name:
        return "h200"
    if "h100" in name and "pcie" in name:
        return "h100-pcie"
    if "h100" in name and "nvl" not in name:
        return "h100"
    return None


# -----------------------------------------------------------------------------
# Printing


def si(value, unit):
    """3.52e12, "B" -> "3.52 TB"."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9),
                          ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def row(name, what, lower, expected):
    return (f"  {name:16s} {what:50s} {lower:9.2f} s "
            f"{expected:8.2f} s")


def print_gpu(what, own, gpu):
    print(f"{what} on {own.gpus} x {gpu['name']}: estimates, not "
          f"measurements. NVIDIA's dense peaks:")
    print(f"  {si(gpu['bf16'], 'FLOP/s')} bf16, "
          f"{si(gpu['float32'], 'FLOP/s')} float32, "
          f"{si(gpu['bandwidth'], 'B/s')} memory, "
          f"{si(gpu['link'], 'B/s')} between GPUs one way")


def print_speed(own):
    print(f"  assumed: {own.flops_utilisation:.0%} of peak FLOP/s "
          f"(--flops-utilisation)")
    print(f"  assumed: {own.bandwidth_utilisation:.0%} of peak bandwidth "
          f"(--bandwidth-utilisation)")
    print(f"  assumed: {own.decode_step_ms:g} ms a decode step for vLLM's "
          f"scheduling, sampling, launches (--decode-step-ms)")


def print_hours(what, lower, expected, own):
    """A run's hours: the lower bound without its start, the expected
    with it, and the GPU-hours that are billed."""
    start = own.startup_minutes * 60
    full = (expected + start) / 3600
    print(f"  {what}: lower bound {lower / 3600:.2f} h (no start); "
          f"expected {full:.2f} h with {own.startup_minutes:g} min to start "
          f"(--startup-minutes), {own.gpus * full:.2f} GPU-hours billed on "
          f"--gpus {own.gpus}")


def describe(name, done, gpus):
    """What a part of the training step does, in FLOPs or bytes."""
    if name == "loss":
        return f"{si(done['moved'], 'B')} moved"
    if name == "update":
        what = f"{si(done['moved'], 'B')} moved"
        if gpus > 1:
            what += f", {si(done['link'], 'B')} all-reduced"
        return what
    what = si(done["flops"], "FLOP")
    if done["float32_flops"]:
        what += f" + {si(done['float32_flops'], 'FLOP')} float32 LoRA"
    return what


def print_training_time(config, args, own, gpu, parameters, lora):
    b = 2 if args.dtype == "bfloat16" else 4
    rows = args.prompts_per_step // own.gpus
    answer = own.answer_tokens or args.max_new_tokens
    teacher = own.teacher_prompt_tokens or args.max_prompt_length
    prompt = own.prompt_tokens
    steps = args.max_new_tokens
    sampled = sample_work(config, parameters, b, rows, prompt, answer,
                          steps)
    parts = train_work(config, lora, b, rows, (prompt, teacher, answer),
                       lora_r=args.lora_r,
                       teacher_lora=args.teacher != "base",
                       checkpointing=args.gradient_checkpointing,
                       gpus=own.gpus)
    pushed = push_work(config, b, args.lora_r)
    print_gpu("Time", own, gpu)
    print(f"  assumed: answers of {answer:,} tokens on average "
          f"(--answer-tokens; default --max-new-tokens)")
    print(f"  assumed: student prompts of {prompt:,} tokens "
          f"(--prompt-tokens), the teacher's {teacher:,}")
    print(f"           (--teacher-prompt-tokens; default "
          f"--max-prompt-length), a micro-batch's padded mean")
    print_speed(own)
    print(f"  {'one step':16s} {f'each rank: {rows} answers':50s} "
          f"{'lower bound':>11s} {'expected':>10s}")
    weights = steps * decode_parameters(config, parameters) * b
    cache = sampled["moved"] - weights
    lines = [("sample", f"{steps:,} decode steps: {si(weights, 'B')} "
              f"weights, {si(cache, 'B')} KV", sampled)]
    for name, done in parts.items():
        lines.append((name, describe(name, done, own.gpus), done))
    lines.append(("push", f"{si(pushed['moved'], 'B')} moved, "
                  f"{si(pushed['flops'], 'FLOP')} read-back", pushed))
    for name, what, done in lines:
        print(row(name, what, *both(done, gpu, b, own)))
    step = total([done for name, what, done in lines])
    lower, expected = both(step, gpu, b, own)
    print(row("step", "", lower, expected))
    print(f"  expected step / the released recipe's ~{RECIPE_STEP_S} s "
          f"(Qwen3-1.7B, 4 x H100, as reported): "
          f"{expected / RECIPE_STEP_S:.2f}")
    print_hours(f"run of {args.max_steps} steps", args.max_steps * lower,
                args.max_steps * expected, own)


# -----------------------------------------------------------------------------
# The command line


def read_config(source):
    from transformers import AutoConfig

    try:
        if Path(source).is_file():  # a config.json, or a copy of one
            fields = json.loads(Path(source).read_text())
            return AutoConfig.for_model(fields.pop("model_type"), **fields)
        return AutoConfig.from_pretrained(source)
    except (OSError, ValueError, KeyError) as e:
        refuse(f"cannot read the config of {source} "
               f"({str(e).splitlines()[0]}): pass --config PATH.")


def parse_own(argv):
    p = argparse.ArgumentParser(
        prog="budget.py",
        description="The per-GPU memory and the hours of an opsd.py run, "
                    "or of eval.py's protocol (no weights, no GPU).")
    p.error = refuse  # argparse's refusals in one sentence
    p.add_argument("--gpu", default="h100", choices=list(GPUS),
                   help="the GPU to time on (default: h100, the SXM card)")
    p.add_argument("--gpus", type=AT_LEAST_1, default=4,
                   help="GPUs of the run (default: 4)")
    p.add_argument("--gpu-gib", type=POSITIVE,
                   help="memory of one GPU, GiB (default: --gpu's)")
    p.add_argument("--config",
                   help="the model's config.json or its directory "
                        "(default: the flags' --model)")
    p.add_argument("--eval", action="store_true",
                   help="eval.py's protocol; the flags after -- are "
                        "eval.py's")
    p.add_argument("--answer-tokens", type=AT_LEAST_1,
                   help="mean answer length (default: --max-new-tokens; "
                        f"with --eval {EVAL_ANSWER_TOKENS:,})")
    p.add_argument("--prompt-tokens", type=AT_LEAST_1,
                   default=PROMPT_TOKENS,
                   help="mean prompt length, the student's or eval's")
    p.add_argument("--teacher-prompt-tokens", type=AT_LEAST_1,
                   help="mean teacher prompt (default: --max-prompt-length)")
    p.add_argument("--problems", type=AT_LEAST_1,
                   help="with --eval: problems (default: the benchmarks')")
    p.add_argument("--flops-utilisation", type=SHARE,
                   default=FLOPS_UTILISATION)
    p.add_argument("--bandwidth-utilisation", type=SHARE,
                   default=BANDWIDTH_UTILISATION)
    p.add_argument("--decode-step-ms", type=NON_NEGATIVE,
                   default=DECODE_STEP_MS)
    p.add_argument("--startup-minutes", type=NON_NEGATIVE,
                   default=STARTUP_MINUTES)
    own = p.parse_args(argv)
    if own.gpu_gib is None:
        own.gpu_gib = GPUS[own.gpu]["gib"]
    return own


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    ours, theirs = argv, []
    if "--" in argv:
        ours = argv[:argv.index("--")]
        theirs = argv[argv.index("--") + 1:]
    own = parse_own(ours)
    if own.eval:
        return main_eval(own, theirs)
    args = opsd.parse_args(theirs)
    if args.prompts_per_step % (own.gpus * args.micro_batch_size):
        refuse(f"--prompts-per-step {args.prompts_per_step} must be "
               f"divisible by --gpus x --micro-batch-size = {own.gpus} x "
               f"{args.micro_batch_size}.")
    if (own.answer_tokens or 0) > args.max_new_tokens:
        refuse(f"--answer-tokens {own.answer_tokens} cannot exceed "
               f"--max-new-tokens {args.max_new_tokens}.")
    source = own.config or args.model
    config = read_config(source)
    parameters, lora = count_parameters(config, args)
    parts = trainer_bytes(config, args, parameters, lora)
    parts["vllm"] = args.vllm_memory * own.gpu_gib * GIB
    used = sum(parts.values())
    checkpointing = "off"
    if args.gradient_checkpointing:
        checkpointing = "on"
    print(f"{source}: {parameters / 1e9:.2f}B parameters, LoRA "
          f"{lora / 1e6:.1f}M (r {args.lora_r}); micro-batch "
          f"{args.micro_batch_size} x "
          f"{args.max_prompt_length + args.max_new_tokens} tokens, "
          f"{args.dtype}, gradient checkpointing {checkpointing}")
    for name, value in parts.items():
        print(f"  {name:12s} {value / GIB:8.2f} GiB")
    print(f"  {'total':12s} {used / GIB:8.2f} GiB of {own.gpu_gib:g} GiB "
          f"per GPU (+ about {UNCOUNTED_GIB} GiB of CUDA context and "
          f"fragmentation)")
    print_training_time(config, args, own, GPUS[own.gpu], parameters, lora)
    if used + UNCOUNTED_GIB * GIB > own.gpu_gib * GIB:
        print(f"budget.py: does not fit: {used / GIB:.1f} GiB + "
              f"{UNCOUNTED_GIB} GiB on a {own.gpu_gib:g} GiB GPU; lower "
              "--micro-batch-size (activations), --vllm-memory or "
              "--loss-chunk-size, or turn gradient checkpointing on.",
              file=sys.stderr)
        return 1
    return 0


def count_problems(evaluation, args):
    """(problems, how they were counted) of eval.py's benchmarks: the hub
    benchmarks' known counts, a local file's rows; at most --limit each."""
    sources = evaluation.benchmark_sources(args.benchmarks, args.data)
    counts = {}
    for name, source in sources.items():
        if Path(source).is_file():
            counts[name] = len(evaluation.load_problems(
                name, source, args.problem_column, args.answer_column))
        elif name in HUB_PROBLEMS:
            counts[name] = HUB_PROBLEMS[name]
        else:
            refuse(f"the problems of {name} are not counted here: pass "
                   f"--problems N.")
        if args.limit:
            counts[name] = min(counts[name], args.limit)
    said = ", ".join(f"{name} {n}" for name, n in counts.items())
    return sum(counts.values()), said


def main_eval(own, theirs):
    import eval as evaluation

    default_model = opsd.parse_args([]).model
    args = evaluation.parse_args(["--model", default_model,
                                  "--output-dir", "-", *theirs])
    tp = args.tensor_parallel_size
    # eval.py runs one engine over --tensor-parallel-size GPUs; the rest
    # of the machine's --gpus are billed, idle
    if tp > own.gpus:
        refuse(f"eval.py --tensor-parallel-size {tp} needs {tp} GPUs, "
               f"but --gpus is {own.gpus}.")
    answer = own.answer_tokens or EVAL_ANSWER_TOKENS
    if answer > args.max_new_tokens:
        refuse(f"--answer-tokens {answer} cannot exceed eval.py's "
               f"--max-new-tokens {args.max_new_tokens}.")
    problems, said = own.problems, "--problems"
    if problems is None:
        problems, said = count_problems(evaluation, args)
    config = read_config(own.config or args.model)
    heads = config.num_attention_heads
    if heads % tp:
        refuse(f"eval.py cannot split {heads} attention heads over "
               f"--tensor-parallel-size {tp}: vLLM needs a divisor of "
               f"{heads}.")
    parameters, lora = count_parameters(config, opsd.parse_args([]))
    b = 2
    if args.dtype in ("float32", "float"):
        b = 4
    gpu = GPUS[own.gpu]
    share = args.gpu_memory_utilization or VLLM_MEMORY
    samples = problems * args.n
    kw = dict(problems=problems, samples=samples, prompt=own.prompt_tokens,
              gpus=tp, tensor_parallel=tp,
              memory=share * own.gpu_gib * GIB)
    done, at_once, holds = eval_work(config, parameters, b, answer=answer,
                                     **kw)
    if at_once < 1:
        refuse(f"an answer of {answer:,} tokens does not fit in the KV "
               f"cache ({max(holds, 0):,} tokens) of {share:g} x "
               f"{own.gpu_gib:g} GiB: raise --tensor-parallel-size or "
               f"--gpu-memory-utilization.")
    weights = done["decode_steps"] * decode_parameters(
        config, parameters) * b / tp
    cache = done["moved"] - weights
    print_gpu("eval.py", own, gpu)
    print(f"  {problems} problems ({said}) x {args.n} samples = "
          f"{samples:,} answers")
    print(f"  assumed: answers of {answer:,} tokens on average "
          f"(--answer-tokens; the model decides it:")
    print("           eval.py's summary reports mean_tokens), the KV "
          "cache read as if all were that long")
    print(f"  assumed: prompts of {own.prompt_tokens:,} tokens "
          f"(--prompt-tokens)")
    print(f"  one engine over {tp} GPU(s) (--tensor-parallel-size {tp}), "
          f"as eval.py runs; {own.gpus - tp} of --gpus {own.gpus} idle, "
          "and billed below")
    print(f"  an engine's KV cache: {holds:,} tokens of "
          f"{kv_bytes(config, b) / 1024:g} KiB ({share:g} x "
          f"{own.gpu_gib:g} GiB a GPU,")
    print(f"           less the weights and {UNCOUNTED_GIB} GiB), so "
          f"{at_once:,} answers at once (vLLM: {VLLM_MAX_SEQS:,} at most)")
    print_speed(own)
    print(f"  each GPU: {done['decode_steps']:,} decode steps reading "
          f"{si(weights, 'B')} of weights, {si(cache, 'B')} of KV cache")
    if args.adapter:
        print("  --adapter: its LoRA is left out (r 64: 4% of the weights "
              "a decode step reads)")
    print_hours("one checkpoint", *both(done, gpu, b, own), own)
    longest, at_once, _ = eval_work(config, parameters, b,
                                    answer=args.max_new_tokens, **kw)
    what = f"every answer at --max-new-tokens {args.max_new_tokens:,}"
    if at_once < 1:
        print(f"  {what}: one does not fit in the KV cache")
    else:
        print_hours(what, *both(longest, gpu, b, own), own)
    return 0


if __name__ == "__main__":
    sys.exit(main())
