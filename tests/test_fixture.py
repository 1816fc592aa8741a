# python -m pytest tests/test_fixture.py -q
"""The tiny-model fixture is real: vLLM and transformers agree on it, and its template honours enable_thinking."""

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

MESSAGES = [{"role": "user", "content": "What is 17 + 25?"}]


def test_chat_template_honours_enable_thinking(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    off = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    on = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, enable_thinking=True)
    assert on == "<|im_start|>user\nWhat is 17 + 25?<|im_end|>\n<|im_start|>assistant\n"
    assert off == on + "<think>\n\n</think>\n\n"
    assert tok.convert_ids_to_tokens(tok.eos_token_id) == "<|im_end|>"
    # the think markers are single tokens, as in Qwen3
    assert len(tok("<think>", add_special_tokens=False)["input_ids"]) == 1


def test_vllm_prompt_logprobs_match_transformers(tiny_model_dir, vllm_lora_engine):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    ids = tok(text + "17 + 25 = 42, so the answer is \\boxed{42}.", add_special_tokens=False)["input_ids"]
    out = vllm_lora_engine.generate([TokensPrompt(prompt_token_ids=ids)],
                                    SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    vllm_lp = torch.tensor([out[0].prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1]
    hf_lp = torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert len(ids) > 30
    assert (vllm_lp.double() - hf_lp).abs().max() <= 1e-4
    # the distributions are far from uniform, so agreement is not trivial
    assert hf_lp.std() > 0.5
