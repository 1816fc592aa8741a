"""The per-GPU memory of an opsd.py run, before renting one: no weights loaded, no GPU needed.

    python tests/gpu_check/budget.py --gpu-gib 80 -- --clip token --skip-first-tokens 1
    python tests/gpu_check/budget.py --gpu-gib 80 --config DIR_OR_CONFIG_JSON -- --model Qwen/Qwen3-8B ...

Everything after `--` is opsd.py's own flags, read by opsd.parse_args (its defaults, its checks). The model's
config comes from --config, else from opsd's --model (a local directory, or a hub id: network or the hub's cache).
The model is built on torch's meta device (shapes, no memory) to count its parameters, and opsd.add_lora on it
counts the LoRA's. Every rank holds all of what follows on its own GPU:

- weights: every parameter in --dtype;
- LoRA: its A and B in float32, their gradients, AdamW's two moments and the flat copy the gradient all-reduce
  makes (5 x 4 bytes a parameter), and the EMA teacher's copy with --teacher ema;
- activations: what the student's forward keeps for its backward at the longest micro-batch (--micro-batch-size
  rows of --max-prompt-length + --max-new-tokens tokens), counted tensor by tensor for a Qwen3-style layer (norms,
  projections and their LoRA, RoPE, SDPA's inputs and output, the MLP) in `layer_bytes`; with gradient
  checkpointing each layer's input plus one layer recomputed in the backward, without it every layer's; plus the
  backward's working set, the padding mask, and the final hidden states of student and teacher;
- one loss chunk: --loss-chunk-size positions of full-vocabulary logits and the float32 tensors alive at once in
  the loss, its gradient and its diagnostics (`LOSS_CHUNK_COPIES`);
- vLLM: --vllm-memory of the GPU (vLLM takes that share whatever it needs; GPU runs only).

Not counted: the CUDA context and the caching allocator's fragmentation (together about 1-2 GiB on a recent GPU),
which is why a budget within 2 GiB of the card is said not to fit. tests/test_gpu_check.py checks the trainer-side
formula against the peak memory a CPU run of opsd.backward_step and AdamW takes at several tiny sizes;
gpu_check.py prints the same estimate beside each peak it measures on CUDA.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import opsd  # noqa: E402

GIB = 2 ** 30
UNCOUNTED_GIB = 2  # CUDA context and allocator fragmentation: the room a budget must leave on the card
# float32 (C, V) tensors alive at the loss's peak for one chunk: the student's logits in float32, scaled, their
# log-softmax; the teacher's log-softmax; p_T, the difference and the divergence; their gradients in the backward
LOSS_CHUNK_COPIES = 8


def layer_bytes(config, dtype_bytes, lora_r):
    """Bytes one decoder layer keeps for its backward per token: each term a tensor saved by the op that reads it.
    H hidden, Q = query heads x head_dim, K = key/value heads x head_dim, I the MLP's width; b the model's dtype,
    c the float32 copy a norm or a LoRA input makes when the model is not float32 (0 in float32)."""
    H, I = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or H // config.num_attention_heads
    Q, K = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    b, c = dtype_bytes, (0 if dtype_bytes == 4 else 4)
    repeated = 2 * b * Q if K < Q else 0  # grouped-query heads: SDPA gets keys and values repeated to every head
    return ((8 + 2 * b + 5 * c) * H  # two norms: the float32 input, the output the projections read; LoRA inputs
            + (4 + 5 * b + c) * Q + repeated  # q's norm and RoPE, SDPA's query and output, o_proj's input
            + (4 + 4 * b) * K  # k's norm and RoPE, v
            + (4 * b + c) * I  # gate, up, silu(gate), their product (down's input), down's LoRA input
            + 7 * 4 * lora_r)  # A x of each of the seven LoRA layers, in float32


def count_parameters(config, args):
    """(the model's parameters, its LoRA's), counted on a model built on the meta device."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    lora = opsd.add_lora(model, args.lora_r, args.lora_alpha, seed=args.seed)
    return total, sum(p.numel() for p in lora)


def trainer_bytes(config, args, parameters, lora_parameters):
    """{part: bytes} on one GPU for the trainer: weights, LoRA state, activations, one loss chunk."""
    b = 2 if args.dtype == "bfloat16" else 4
    H, L, V = config.hidden_size, config.num_hidden_layers, config.vocab_size
    B, T = args.micro_batch_size, args.max_prompt_length + args.max_new_tokens  # the longest micro-batch
    N = B * args.max_new_tokens  # answer positions the loss scores
    per_layer = B * T * layer_bytes(config, b, args.lora_r)
    kept = L * B * T * H * b + per_layer if args.gradient_checkpointing else L * per_layer
    working = B * T * 2 * b * (config.intermediate_size + H)  # gradients of one layer's largest tensors
    around = B * T * T + 2 * B * T * H * b + 4 * N * H * b  # mask; final hidden states; the loss's (N, H) copies
    return {"weights": parameters * b, "lora": lora_parameters * 4 * (5 + (args.teacher == "ema")),
            "activations": kept + working + around,
            "loss_chunk": args.loss_chunk_size * V * (LOSS_CHUNK_COPIES * 4 + 2 * b)}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    ours, theirs = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description="The per-GPU memory budget of an opsd.py run (no weights, no GPU).")
    p.add_argument("--gpu-gib", type=float, default=80.0, help="memory of one GPU, GiB")
    p.add_argument("--config", help="the model's config.json or its directory (default: opsd's --model)")
    own = p.parse_args(ours)
    args = opsd.parse_args(theirs)
    from transformers import AutoConfig

    source = own.config or args.model
    try:
        if Path(source).is_file():  # a config.json (or a copy of one under another name)
            fields = json.loads(Path(source).read_text())
            config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        else:
            config = AutoConfig.from_pretrained(source)
    except (OSError, ValueError, KeyError) as e:
        print(f"budget.py: error: cannot read the config of {source} ({str(e).splitlines()[0]}): pass "
              "--config PATH.", file=sys.stderr)
        raise SystemExit(2)
    parameters, lora_parameters = count_parameters(config, args)
    parts = trainer_bytes(config, args, parameters, lora_parameters)
    parts["vllm"] = args.vllm_memory * own.gpu_gib * GIB
    total = sum(parts.values())
    print(f"{source}: {parameters / 1e9:.2f}B parameters, LoRA {lora_parameters / 1e6:.1f}M (r {args.lora_r}); "
          f"micro-batch {args.micro_batch_size} x {args.max_prompt_length + args.max_new_tokens} tokens, "
          f"{args.dtype}, gradient checkpointing {'on' if args.gradient_checkpointing else 'off'}")
    for name, value in parts.items():
        print(f"  {name:12s} {value / GIB:8.2f} GiB")
    print(f"  {'total':12s} {total / GIB:8.2f} GiB of {own.gpu_gib:g} GiB per GPU "
          f"(+ about {UNCOUNTED_GIB} GiB of CUDA context and fragmentation)")
    if total + UNCOUNTED_GIB * GIB > own.gpu_gib * GIB:
        print(f"budget.py: does not fit: {total / GIB:.1f} GiB + {UNCOUNTED_GIB} GiB on a {own.gpu_gib:g} GiB GPU; "
              "lower --micro-batch-size (activations), --vllm-memory or --loss-chunk-size, or turn gradient "
              "checkpointing on.", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
