"""Write a tiny random Qwen3ForCausalLM and a small byte-level BPE tokenizer to a directory.

    python tests/make_tiny_model.py /tmp/tiny-qwen3

The model is the test double of Qwen3-1.7B for every CPU test and for the README's quickstart:
same architecture class (vLLM and transformers both load it), tied embeddings like the real
1.7B, a Qwen3-style chat template that honours `enable_thinking`, and <|im_end|> as EOS.
head_dim is 64 because vLLM's CPU attention kernel rejects 16. Everything is seeded, so two
builds write identical files.
"""

import json
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

HERE = Path(__file__).resolve().parent
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
VOCAB_SIZE = 512

# Qwen3's template, reduced to what OPSD uses: user/assistant turns, a generation prompt, and
# enable_thinking=False appending an empty think block after "<|im_start|>assistant\n".
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)


def corpus():
    """Text the BPE merges are learnt from: the shipped math problems and the prompt wording."""
    lines = [
        "Problem: Please reason step by step, and put your final answer within \\boxed{}.",
        "Here is a reference solution to this problem:",
        "=== Reference Solution Begin === === Reference Solution End ===",
        "After reading the reference solution above, make sure you truly understand the reasoning "
        "behind each step \u2014 do not copy or paraphrase it. Now, using your own words and independent "
        "reasoning, derive the same final answer to the problem above. Think step by step, explore "
        "different approaches, and don't be afraid to backtrack or reconsider if something doesn't work out:",
    ]
    for row in (HERE / "data" / "math_train.jsonl").read_text().splitlines():
        row = json.loads(row)
        lines += [row["problem"], row["solution"]]
    return lines * 4


def build_tokenizer():
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus(), trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>", padding_side="left"
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_model(tok):
    config = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        # 0.1 instead of 0.02 so next-token distributions are far from uniform: KL values and
        # logit differences in the tests are then well above float32 noise.
        initializer_range=0.1,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).to(torch.float32)


def main(out_dir):
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    model = build_model(tok)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    print(f"tiny Qwen3 ({sum(p.numel() for p in model.parameters()):,} parameters, vocab {len(tok)}) -> {out}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/make_tiny_model.py OUTPUT_DIR")
    main(sys.argv[1])
