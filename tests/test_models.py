# python -m pytest tests/test_models.py -q
"""Which models opsd.py can train. The loss takes logits as final_hidden @ lm_head.weight^T and LoRA wraps the
seven projections by name: models whose forward or names differ are refused up front in one sentence, and a
Llama (not only Qwen3) trains through a real step with the real vLLM."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import (AutoModelForCausalLM, CohereConfig, Gemma2Config, Gemma2ForCausalLM, GPT2Config, GPT2LMHeadModel,
                          GraniteConfig, GraniteForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Phi3Config, Phi3ForCausalLM, PhiConfig, PhiForCausalLM)

import opsd

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "math_train.jsonl"
SIZE = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=4096, initializer_range=0.1)


def build(model_class, config):
    torch.manual_seed(0)
    return model_class(config).float()


def test_models_whose_logits_are_hidden_times_lm_head_pass(tiny_model_dir):
    qwen3 = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    llama = build(LlamaForCausalLM, LlamaConfig(head_dim=64, **SIZE))
    mistral = build(MistralForCausalLM, MistralConfig(head_dim=64, **SIZE))
    for model in (qwen3, llama, mistral):
        assert opsd.check_logits_path(model) is None, model.config.model_type


def test_models_whose_forward_does_more_are_refused():
    # the oracle is each model's own forward: with these settings its logits differ from hidden @ W^T
    gemma2 = build(Gemma2ForCausalLM, Gemma2Config(head_dim=64, final_logit_softcapping=0.5, **SIZE))
    granite = build(GraniteForCausalLM, GraniteConfig(logits_scaling=4.0, **SIZE))
    phi = build(PhiForCausalLM, PhiConfig(**{**SIZE, "num_key_value_heads": 2}))
    with torch.no_grad():
        phi.lm_head.bias.normal_()  # a trained Phi's lm_head bias is not zero
    for model in (gemma2, granite):
        reason = opsd.check_logits_path(model)
        assert reason and "not final_hidden @ lm_head.weight^T" in reason, model.config.model_type
    assert opsd.check_logits_path(phi) == "its lm_head has a bias"
    with torch.no_grad():
        phi.lm_head.bias.zero_()  # a zero bias changes no logit, so the probe alone would pass it
    assert opsd.check_logits_path(phi) == "its lm_head has a bias"
    gpt2 = build(GPT2LMHeadModel, GPT2Config(vocab_size=512, n_embd=128, n_layer=2, n_head=2))
    assert opsd.check_logits_path(gpt2) is None  # no .model attribute, but base_model finds its transformer
    # its projections are Conv1D layers named c_attn, c_proj, c_fc
    assert opsd.missing_lora_targets(gpt2) == "its decoder layers hold no nn.Linear"


def test_fused_projections_are_refused_naming_what_is_missing():
    phi3 = build(Phi3ForCausalLM, Phi3Config(**SIZE, pad_token_id=0))
    assert opsd.missing_lora_targets(phi3) == "layers 0, 1 lack q_proj, k_proj, v_proj, gate_proj, up_proj"
    assert opsd.missing_lora_targets(build(LlamaForCausalLM, LlamaConfig(head_dim=64, **SIZE))) is None


def test_a_hybrid_model_is_refused_before_its_weights_load_naming_the_layers(tmp_path, capsys):
    """Qwen3.5's text model: three of every four decoder layers are linear attention (in_proj_qkv, out_proj ...),
    only every fourth has q/k/v/o_proj. LoRA on it would train attention in one layer of four, silently."""
    from transformers import Qwen3_5TextConfig
    config = Qwen3_5TextConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=8,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    kinds = config.layer_types  # the config's own record of each layer's attention
    assert kinds.count("full_attention") == 2 and len(kinds) == 8
    lacking = ", ".join(str(i) for i, kind in enumerate(kinds) if kind != "full_attention")
    config.save_pretrained(tmp_path / "qwen3_5")  # a config and no weights: loading them would fail
    with pytest.raises(SystemExit):
        opsd.main(["--model", str(tmp_path / "qwen3_5"), "--dataset", str(DATA), "--device", "cpu",
                   "--output-dir", str(tmp_path / "out")])
    assert capsys.readouterr().err == (
        f"opsd.py: error: --model {tmp_path / 'qwen3_5'} (qwen3_5_text): LoRA needs q_proj, k_proj, v_proj, o_proj, "
        f"gate_proj, up_proj, down_proj in every decoder layer, but layers {lacking} lack q_proj, k_proj, v_proj, "
        "o_proj.\n")


def test_dropout_is_off_in_train_mode():
    config = LlamaConfig(head_dim=64, attention_dropout=0.5, **SIZE)
    llama = build(LlamaForCausalLM, config)
    gpt2 = build(GPT2LMHeadModel, GPT2Config(vocab_size=512, n_embd=128, n_layer=2, n_head=2, resid_pdrop=0.5))
    ids = torch.arange(20, 40)[None]
    for model in (llama, gpt2):
        model.train()
        assert not torch.equal(model(ids).logits, model(ids).logits)  # the oracle: dropout really is on
        opsd.disable_dropout(model)
        with torch.no_grad():
            train_mode = model(ids).logits
            torch.testing.assert_close(train_mode, model.eval()(ids).logits, rtol=0, atol=1e-6)


def test_a_tiny_llama_trains_one_real_step(tiny_model_dir, tmp_path):
    llama_dir = tmp_path / "tiny-llama"
    llama_dir.mkdir()
    for f in Path(tiny_model_dir).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, llama_dir / f.name)
    qwen3 = json.loads((Path(tiny_model_dir) / "config.json").read_text())
    llama = build(LlamaForCausalLM, LlamaConfig(head_dim=64, **{**SIZE, "vocab_size": qwen3["vocab_size"]},
                                                tie_word_embeddings=True, eos_token_id=qwen3["eos_token_id"],
                                                pad_token_id=qwen3["pad_token_id"]))
    llama.save_pretrained(llama_dir)
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "opsd.py"), "--model", str(llama_dir), "--dataset", str(DATA), "--device", "cpu",
           "--dtype", "float32", "--max-steps", "1", "--prompts-per-step", "2", "--micro-batch-size", "2",
           "--max-new-tokens", "16", "--output-dir", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((out / "metrics.jsonl").read_text())
    assert record["logprob_gap_max"] < 1e-3 and record["kl_mean"] > 0  # vLLM and the trainer agree on a Llama
    assert (out / "final" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("config, field", [
    (Gemma2Config(head_dim=64, final_logit_softcapping=30.0, **SIZE), "final_logit_softcapping = 30.0"),
    (GraniteConfig(logits_scaling=1.01, **SIZE), "logits_scaling = 1.01"),
    (CohereConfig(logit_scale=0.995, **SIZE), "logit_scale = 0.995"),
])
def test_configs_that_change_logits_are_refused_before_the_model_loads(config, field, tmp_path, capsys):
    # at the real soft-cap of 30, or a scale within 1% of 1, a tiny random model's logits move less than the
    # probe's tolerance: the config alone decides. No weights are saved, so loading the model would fail.
    config.save_pretrained(tmp_path / "model")
    with pytest.raises(SystemExit):
        opsd.main(["--model", str(tmp_path / "model"), "--dataset", str(DATA), "--device", "cpu",
                   "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert f"its config sets {field}, but the loss needs logits = final_hidden @ lm_head.weight^T." in err, err
