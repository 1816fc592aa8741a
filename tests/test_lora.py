# python -m pytest tests/test_lora.py -q
"""The hand-rolled LoRA on the tiny Qwen3: exactness invariants, out-of-place merge, PEFT-layout files."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from opsd import LORA_TARGETS, LoRALinear, add_lora, load_adapter, lora_disabled, merged_weights, save_adapter

IDS = torch.tensor([[5, 17, 230, 41, 99, 3, 250, 12, 7, 400, 64, 2]])


def load(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def randomize_b(model, seed, std=0.3):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * std)


@torch.no_grad()
def logits(model):
    return model(IDS).logits


def test_wraps_all_seven_projections_and_trains_only_lora(tiny_model_dir):
    model = load(tiny_model_dir)
    names_before = [n for n, _ in model.named_parameters()]
    params = add_lora(model, r=8, alpha=16)
    wrapped = [n for n, m in model.named_modules() if isinstance(m, LoRALinear)]
    assert len(wrapped) == 7 * model.config.num_hidden_layers
    assert {n.rsplit(".", 1)[-1] for n in wrapped} == set(LORA_TARGETS)
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert trainable == {id(p) for p in params} and len(params) == 2 * len(wrapped)
    # the base parameter names are unchanged, so merged weights go to vLLM under HF names
    base_names = [n for n, _ in model.named_parameters() if "lora_" not in n]
    assert base_names == names_before


def test_init_is_kaiming_uniform_a_sqrt5_and_b_zero(tiny_model_dir):
    model = load(tiny_model_dir)
    torch.manual_seed(0)
    add_lora(model, r=64, alpha=128)
    m = model.model.layers[0].mlp.down_proj
    bound = 1 / math.sqrt(m.lora_A.shape[1])  # gain sqrt(2 / (1 + 5)) * sqrt(3 / fan_in)
    assert m.lora_A.abs().max() <= bound and m.lora_A.abs().max() > 0.95 * bound
    assert m.lora_A.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.05)
    assert torch.equal(m.lora_B, torch.zeros_like(m.lora_B)) and m.scale == 2.0


def test_init_comes_from_a_cpu_generator_seeded_by_seed(tiny_model_dir):
    # oracle: kaiming_uniform_(a=sqrt(5)) is uniform(-1/sqrt(in), 1/sqrt(in)); one CPU generator, module order
    g = torch.Generator().manual_seed(7)
    expected = {}
    for name, m in load(tiny_model_dir).named_modules():
        if name.rsplit(".", 1)[-1] in LORA_TARGETS:
            expected[name] = torch.empty(8, m.in_features).uniform_(-1 / math.sqrt(m.in_features),
                                                                     1 / math.sqrt(m.in_features), generator=g)
    torch.manual_seed(123)  # the global RNG plays no part, and is left alone
    state = torch.get_rng_state()
    model = load(tiny_model_dir)
    add_lora(model, r=8, alpha=16, seed=7)
    assert torch.equal(torch.get_rng_state(), state)
    got = {name: m.lora_A for name, m in model.named_modules() if isinstance(m, LoRALinear)}
    assert list(got) == list(expected) and all(torch.equal(got[n], expected[n]) for n in expected)
    other = load(tiny_model_dir)
    add_lora(other, r=8, alpha=16, seed=8)
    assert not torch.equal(other.model.layers[0].self_attn.q_proj.lora_A, got["model.layers.0.self_attn.q_proj"])


def test_b_zero_gives_base_logits_exactly(tiny_model_dir):
    base = logits(load(tiny_model_dir))
    model = load(tiny_model_dir)
    add_lora(model, r=8, alpha=16)
    assert torch.equal(logits(model), base)


def test_merged_weights_reproduce_the_lora_model(tiny_model_dir):
    model = load(tiny_model_dir)
    add_lora(model, r=8, alpha=16)
    randomize_b(model, seed=1)
    lora_out = logits(model)
    plain = load(tiny_model_dir)
    assert (plain(IDS).logits - lora_out).abs().max() > 1e-2, "B must change the model for this test to mean anything"
    merged = dict(merged_weights(model))
    assert len(merged) == 7 * plain.config.num_hidden_layers and all(n in plain.state_dict() for n in merged)
    plain.load_state_dict(merged, strict=False)
    torch.testing.assert_close(logits(plain), lora_out, atol=1e-5, rtol=0)


def test_switching_lora_off_gives_base_logits_and_leaves_base_untouched(tiny_model_dir):
    base_model = load(tiny_model_dir)
    base = logits(base_model)
    model = load(tiny_model_dir)
    add_lora(model, r=8, alpha=16)
    before = {n: p.clone() for n, p in model.named_parameters() if "lora_" not in n}
    randomize_b(model, seed=2)
    # one optimizer step, then merges: none of it may write to the base weights
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model(IDS).logits.square().mean().backward()
    opt.step()
    list(merged_weights(model))
    with lora_disabled(model):
        assert torch.equal(logits(model), base)
    assert not torch.equal(logits(model), base)  # switched back on afterwards
    for n, p in model.named_parameters():
        if "lora_" not in n:
            assert torch.equal(p, before[n]), n


def test_save_load_round_trip_in_peft_layout(tiny_model_dir, tmp_path):
    model = load(tiny_model_dir)
    add_lora(model, r=8, alpha=16)
    randomize_b(model, seed=3)
    save_adapter(model, tmp_path, base_model_name_or_path=tiny_model_dir)

    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16 and config["peft_type"] == "LORA"
    assert sorted(config["target_modules"]) == sorted(LORA_TARGETS)
    assert config["base_model_name_or_path"] == tiny_model_dir
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    a = tensors["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"]
    b = tensors["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"]
    q = model.model.layers[1].self_attn.q_proj
    assert torch.equal(a, q.lora_A) and torch.equal(b, q.lora_B)
    assert len(tensors) == 2 * 7 * model.config.num_hidden_layers

    fresh = load(tiny_model_dir)
    add_lora(fresh, r=8, alpha=16)  # different random A, zero B
    load_adapter(fresh, tmp_path)
    assert torch.equal(logits(fresh), logits(model))

    wrong = load(tiny_model_dir)
    add_lora(wrong, r=4, alpha=16)
    with pytest.raises(RuntimeError, match="size"):  # an adapter of other shapes never loads silently
        load_adapter(wrong, tmp_path)


def test_vllm_lora_loader_reads_our_adapter(tiny_model_dir, tmp_path, vllm_lora_engine):
    """vLLM's own LoRA loader is the oracle for the on-disk layout: same log-probs as our LoRA model."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    model = load(tiny_model_dir)
    add_lora(model, r=8, alpha=16)
    randomize_b(model, seed=4)
    save_adapter(model, tmp_path, base_model_name_or_path=tiny_model_dir)
    ids = IDS[0].tolist()
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    out = vllm_lora_engine.generate([TokensPrompt(prompt_token_ids=ids)], params,
                                    lora_request=LoRARequest("ours", 1, str(tmp_path)), use_tqdm=False)
    vllm_lp = torch.tensor([out[0].prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])
    ours = torch.log_softmax(logits(model)[0, :-1], -1).gather(-1, IDS[0, 1:, None])[:, 0]
    with lora_disabled(model):
        base = torch.log_softmax(logits(model)[0, :-1], -1).gather(-1, IDS[0, 1:, None])[:, 0]
    assert (ours - base).abs().max() > 1e-2
    torch.testing.assert_close(vllm_lp, ours, atol=1e-4, rtol=0)
