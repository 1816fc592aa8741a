# python -m pytest tests/test_preflight.py -q
"""tests/gpu_check/preflight.py, the check before renting GPUs, on the tiny Qwen3 and tests/data/math_train.jsonl:
its figures against lengths counted here from the tokenizer itself (percentiles by numpy's nearest-rank method, the
expected padded length by enumerating every micro-batch), and its refusals: a hybrid model's layers without
attention projections, flags the GPU count breaks, prompts too long; a chat template that ignores enable_thinking
is named."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

import opsd
import preflight

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "math_train.jsonl"
TARGETS = "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"


def run(argv, capsys):
    """(exit status, stdout, preflight's own stderr lines)."""
    code = preflight.main(argv)
    out, err = capsys.readouterr()
    return code, out, [line for line in err.splitlines() if line.startswith("preflight.py: ")]


def chat_ids(tokenizer, message, thinking):
    return tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True,
                                         tokenize=True, enable_thinking=thinking, return_dict=False)


def table(out, side):
    """The four figures of `side`'s line in the prompt-length table."""
    line = next(line for line in out.splitlines() if line.split()[:1] == [side] and line.startswith("  "))
    return [int(x) for x in line.split()[1:]]


@pytest.mark.parametrize("shown", ["reference", "none"])  # none: the student's prompt is the longer one
def test_the_tiny_model_passes_and_its_figures_are_the_tokenizers(tiny_model_dir, capsys, shown):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = [json.loads(line) for line in DATA.read_text().splitlines()]
    # the recipe's defaults: the student without thinking, the teacher with it, shown the row's solution or nothing
    student = [chat_ids(tokenizer, f"Problem: {r['problem']}\n\nPlease reason step by step, and put your final "
                                   "answer within \\boxed{}.", False) for r in rows]
    teacher = [chat_ids(tokenizer, opsd.teacher_message(r["problem"], r["solution"] if shown == "reference" else None),
                        True) for r in rows]
    longest = sorted(max(len(s), len(t)) for s, t in zip(student, teacher))
    limit = longest[len(longest) * 3 // 4]  # about a quarter of the rows longer
    kept = [i for i in range(len(rows)) if max(len(student[i]), len(teacher[i])) <= limit]
    assert 0 < len(kept) < len(rows)
    world_size = opsd.WORLD_SIZE
    code, out, err = run(["--gpus", "2", "--", "--model", tiny_model_dir, "--dataset", str(DATA),
                          "--max-prompt-length", str(limit), "--micro-batch-size", "2", "--prompts-per-step", "8",
                          "--teacher-context", shown],
                         capsys)
    assert (code, err) == (0, []), out
    assert (f"data: --dataset {DATA}: {len(rows)} rows read, {len(kept)} kept, {len(rows) - len(kept)} dropped as "
            f"longer than --max-prompt-length {limit}") in out
    for side, ids in (("student", student), ("teacher", teacher)):
        lengths = [len(x) for x in ids]
        expected = [int(v) for v in np.percentile(lengths, [50, 90, 99], method="inverted_cdf")] + [max(lengths)]
        assert table(out, side) == expected
    # whole, as decoded: the first row's two prompts
    assert tokenizer.decode(student[0]) in out and tokenizer.decode(teacher[0]) in out
    assert tokenizer.decode(student[0]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert f"LoRA targets: all 2 decoder layers hold {TARGETS} as linear layers" in out
    assert "ignores enable_thinking" not in out
    assert "flags: opsd.py's checks pass on 2 ranks: --prompts-per-step 8 = 2 ranks x 2 micro-batches" in out
    # budget.py's prompt lengths: each side's longest kept prompt of a micro-batch of 2, over every ordered pair
    padded = [round(sum(max(len(ids[a]), len(ids[b])) for a in kept for b in kept) / len(kept) ** 2)
              for ids in (student, teacher)]
    assert f"--gpu h100 --gpus 2 --prompt-tokens {padded[0]} --teacher-prompt-tokens {padded[1]} -- " in out
    assert f"student prompts of {padded[0]} tokens (--prompt-tokens), the teacher's {padded[1]}" in out
    assert "GiB of 80 GiB per GPU" in out and "run of 100 steps: lower bound" in out
    assert out.rstrip().endswith("preflight: the run can start on 2 x H100 SXM 80 GB.")
    assert opsd.WORLD_SIZE == world_size  # the rank count it set for opsd.parse_args is put back
    # 100 steps (the default) x 8 prompts over the kept rows: warned past 3 passes
    passes = 100 * 8 / len(kept)
    assert f"100 steps x 8 prompts = {passes:.2f} passes over the kept rows" in out
    assert ("warning: the run trains on each kept row about" in out) == (passes > 3)
    if passes > 3:
        assert f"about {passes:.0f} times (more than 3)" in out
    assert "hub:" not in out  # a local model and file: no hub needed


def test_a_hub_id_is_said_to_need_the_hub_and_the_offline_way(tmp_path, monkeypatch, capsys):
    import huggingface_hub

    # offline, as a user without network says: the library reads the variable once, when imported
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, out, err = run(["--", "--model", "nobody/no-such-model", "--dataset", str(DATA)], capsys)
    assert ("hub: --model nobody/no-such-model read from the Hugging Face hub, or its cache; offline, pass a "
            "local model directory (--model DIR) and data file (--dataset FILE)") in out
    assert code == 2 and len(err) == 1


@pytest.mark.parametrize("flags, sentence", [
    (["--gpus", "3", "--"], "--prompts-per-step 32 must be divisible by ranks x --micro-batch-size = 3 x 4."),
    (["--", "--max-prompt-length", "4000", "--max-new-tokens", "100"],
     "--max-prompt-length 4000 + --max-new-tokens 100 exceeds the model's context of 4096 tokens: lower one of them."),
    (["--", "--max-prompt-length", "40"], "No row fits --max-prompt-length 40: raise it."),
])
def test_what_opsd_py_would_refuse_is_refused(tiny_model_dir, capsys, flags, sentence):
    world_size = opsd.WORLD_SIZE
    code, out, err = run([*flags, "--model", tiny_model_dir, "--dataset", str(DATA)], capsys)
    assert (code, err) == (2, [f"preflight.py: error: {sentence}"])
    assert "budget: not estimated" in out or "flags:" not in out
    assert opsd.WORLD_SIZE == world_size  # the rank count it set for opsd.parse_args is put back


def tokenizer_only(tiny_model_dir, folder, chat_template=None):
    """The tiny tokenizer saved to `folder`, its chat template replaced if given."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(folder)
    return tokenizer


def test_a_hybrid_models_linear_attention_layers_are_refused(tiny_model_dir, tmp_path, capsys):
    from transformers import Qwen3_5Config

    hybrid = tmp_path / "tiny-qwen3.5"  # a config and a tokenizer, no weights: all the preflight reads
    text = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
                num_key_value_heads=1, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=2,
                linear_key_head_dim=16, linear_value_head_dim=16,
                layer_types=["linear_attention"] * 3 + ["full_attention"])  # Qwen3.5's pattern: 3 linear, 1 full
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    Qwen3_5Config(text_config=text, vision_config=vision).save_pretrained(hybrid)
    tokenizer_only(tiny_model_dir, hybrid)
    assert not list(hybrid.glob("*.safetensors"))
    code, out, err = run(["--gpus", "1", "--", "--model", str(hybrid), "--dataset", str(DATA)], capsys)
    assert (code, err) == (2, [f"preflight.py: error: --model {hybrid} (qwen3_5): LoRA needs {TARGETS} in every "
                               "decoder layer, but layers 0, 1, 2 lack q_proj, k_proj, v_proj, o_proj."])
    assert "LoRA targets: layers 0, 1, 2 lack q_proj, k_proj, v_proj, o_proj" in out
    assert "data: --dataset" in out and "budget: not estimated for a run that is refused" in out


def test_a_chat_template_that_ignores_enable_thinking_is_named(tiny_model_dir, tmp_path, capsys):
    plain = tmp_path / "no-thinking-switch"
    plain.mkdir()
    shutil.copy(Path(tiny_model_dir) / "config.json", plain)
    template = ("{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] "
                "+ '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
                "{%- endif %}")  # the tiny template less its enable_thinking clause
    tokenizer = tokenizer_only(tiny_model_dir, plain, template)
    assert chat_ids(tokenizer, "1+1?", True) == chat_ids(tokenizer, "1+1?", False)  # the premise
    code, out, err = run(["--gpus", "1", "--", "--model", str(plain), "--dataset", str(DATA)], capsys)
    assert (code, err) == (0, [])  # a warning: the run starts
    assert (f"warning: the chat template of --model {plain} ignores enable_thinking (its prompts render the same "
            "with it on and off), so --student-thinking and --teacher-thinking change nothing") in out
    assert "student (--no-student-thinking): the same prompt with enable_thinking True" in out


def test_its_own_flags_are_refused_in_one_sentence(capsys):
    with pytest.raises(SystemExit) as stop:
        preflight.main(["--gpu", "a100", "--"])
    assert stop.value.code == 2
    assert capsys.readouterr().err == ("preflight.py: error: argument --gpu: invalid choice: 'a100' (choose from "
                                       "'h100', 'h200', 'h100-pcie')\n")
