# python -m pytest tests/test_run_oracle.py -q
"""The run itself against an oracle: opsd.py under torchrun (2 ranks, 3 steps), gradient checkpointing on, with
every loss, teacher and batch flag off its default and unlike the others, in two settings (the token clip, a JSD,
the EMA teacher; the entry clip, the forward KL, the current student as teacher). A launcher wraps
opsd.backward_step to write down what each rank trained on, then calls it unchanged. From those rows and the
checkpoints this file recomputes every step in float64 with its own code (each row alone through the merged
weights, the divergence from its formulas, no opsd loss function): the loss, kl_mean, kl_frac_above_tau,
kl_first_token, the clipped teacher mass, both entropies, the share of negative loss terms, the gradient norm, and the adapter after the last step (its own AdamW).
It also checks that each rank trained on the prompts step_indices names for it, none shared, and that the answers
rollouts.jsonl logs (rank 0's, at steps 1 and 3 here) carry each token's KL as the oracle computes it."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import opsd

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "math_train.jsonl"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# every value distinguishable: two temperatures, tau, beta, the skip, the EMA decay all differ from their defaults
SETTINGS = {
    "token-jsd-ema": dict(clip="token", tau=0.06, beta=0.3, loss_temperature=1.7, temperature=0.9, top_p=0.9,
                          top_k=30, skip_first_tokens=2, teacher="ema", ema_decay=0.5, lora_r=8, lora_alpha=16,
                          lr=2e-3, warmup_steps=1, max_grad_norm=0.05, seed=7, micro_batch_size=1),
    "entry-kl-current": dict(clip="entry", tau=0.15, beta=0.0, loss_temperature=0.8, temperature=1.3, top_p=0.8,
                             top_k=50, skip_first_tokens=1, teacher="current", lora_r=4, lora_alpha=12, lr=3e-3,
                             warmup_steps=0, max_grad_norm=0.2, seed=11, micro_batch_size=2),
}
STEPS, PROMPTS, NEW_TOKENS = 3, 4, 24

LAUNCHER = """
import json, os, sys
from pathlib import Path
sys.path.insert(0, {root!r})
import opsd
seen, original = [], opsd.backward_step
def recording(model, lora_params, student_prompts, teacher_prompts, completions, **kw):
    seen.append(dict(student=student_prompts, teacher=teacher_prompts, completions=completions))
    Path({out!r}, f"rank{{os.environ['RANK']}}.json").write_text(json.dumps(seen))
    return original(model, lora_params, student_prompts, teacher_prompts, completions, **kw)
opsd.backward_step = recording
opsd.main()
"""


@pytest.fixture(scope="module", params=list(SETTINGS))
def oracle_run(request, tiny_model_dir, tmp_path_factory):
    flags = SETTINGS[request.param]
    tmp = tmp_path_factory.mktemp("oracle")
    launcher = tmp / "launch.py"
    launcher.write_text(LAUNCHER.format(root=str(ROOT), out=str(tmp)))
    argv = [f"--{k.replace('_', '-')}={v}" for k, v in flags.items()]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(launcher),
           "--model", tiny_model_dir, "--dataset", str(DATA), "--device", "cpu", "--dtype", "float32",
           "--prompts-per-step", str(PROMPTS), "--max-new-tokens", str(NEW_TOKENS),
           "--max-steps", str(STEPS), "--save-every", "1", "--kl-window", "1", "--gradient-checkpointing",
           "--output-dir", str(tmp / "run"), *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    ranks = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]
    return tmp / "run", records, ranks, flags


# ---- the oracle: float64, its own LoRA merge, its own divergence -------------------------------------------------


def linear_names(model):
    """The seven projections' module names, in the order the model registers them (the order of opsd's LoRA)."""
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in TARGETS]


def adapter(path, names):
    """{module name: (A, B)} in float64 from a PEFT-layout adapter directory."""
    t = load_file(str(path / "adapter_model.safetensors"))
    return {n: (t[f"base_model.model.{n}.lora_A.weight"].double(), t[f"base_model.model.{n}.lora_B.weight"].double())
            for n in names}


def logits(model, lora, prompt, completion, flags):
    """(len(completion), V) float64 logits predicting each completion token, the row alone, W + (alpha/r) B A."""
    scale = flags["lora_alpha"] / flags["lora_r"]
    weights = {f"{n}.weight": model.get_submodule(n).weight + scale * B @ A for n, (A, B) in lora.items()}
    ids = torch.tensor([prompt + completion])
    out = torch.func.functional_call(model, weights, (ids,), {"use_cache": False}).logits[0]
    return out[len(prompt) - 1:len(prompt) - 1 + len(completion)]


def divergences(s, t, flags):
    """Per position: the loss's k, the unclipped forward KL, the teacher mass on entries whose forward-KL term exceeds
    tau, and whether the clip cut this position. beta 0: the forward KL; else the JSD with m = beta p_T + (1-beta) p_S;
    the entry clip bounds each vocabulary entry's term by tau before the sum, the token clip the sum's value."""
    T, beta, tau = flags["loss_temperature"], flags["beta"], flags["tau"]
    log_s, log_t = torch.log_softmax(s / T, -1), torch.log_softmax(t / T, -1)
    p_s, p_t = log_s.exp(), log_t.exp()
    if beta == 0:
        entries = p_t * (log_t - log_s)
    else:
        m = beta * p_t + (1 - beta) * p_s
        entries = beta * p_t * (log_t - m.log()) + (1 - beta) * p_s * (log_s - m.log())
    if flags["clip"] == "entry":
        k, cut = torch.minimum(entries, torch.tensor(tau, dtype=entries.dtype)).sum(-1), (entries > tau).any(-1)
    else:
        raw = entries.sum(-1)
        k, cut = torch.where(raw > tau, raw * (tau / raw).detach(), raw), raw > tau  # value min(k, tau)
    term = p_t * (log_t - log_s)
    entropies = (-(p_s * log_s).sum(-1).detach(), -(p_t * log_t).sum(-1).detach())
    return k, term.sum(-1).detach(), (p_t * (term > tau)).sum(-1).detach(), cut, entropies


def step_oracle(model, student, teacher, ranks, step, flags):
    """What step `step` (1-based) computes over both ranks' rows: figures and the gradient w.r.t. the student's LoRA."""
    ks, kls, masses, firsts, clipped, h_s, h_t = [], [], [], [], [], [], []
    for seen in ranks:
        rows = seen[step - 1]  # what backward_step received on this rank at this step
        for sp, tp, c in zip(rows["student"], rows["teacher"], rows["completions"]):
            with torch.no_grad():
                t = logits(model, teacher, tp, c, flags)
            k, kl, mass, cut, (h_student, h_teacher) = divergences(logits(model, student, sp, c, flags), t, flags)
            ks.append(k[flags["skip_first_tokens"]:])
            clipped.append(cut[flags["skip_first_tokens"]:])
            kls.append(kl.detach())
            masses.append(mass)
            firsts.append(kl[0])
            h_s.append(h_student)
            h_t.append(h_teacher)
    kept, kl = torch.cat(ks), torch.cat(kls)
    # a loss term below -1e-6 is negative; the skipped positions' terms are 0
    negative = (kept.detach() < -1e-6).sum().item()
    loss = kept.sum() / len(kept)
    loss.backward()
    return {"loss": loss.item(), "kl_mean": kl.mean().item(), "kl_frac_above_tau": (kl > flags["tau"]).double().mean()
            .item(), "kl_first_token": torch.stack(firsts).mean().item(), "kl_clipped_teacher_mass":
            torch.cat(masses).mean().item(), "kl_window_tokens": len(kl),
            "clipped_share": torch.cat(clipped).double().mean().item(), "rows_kl": kls,  # rank 0's rows first
            "entropy_student": torch.cat(h_s).mean().item(), "entropy_teacher": torch.cat(h_t).mean().item(),
            "loss_frac_negative": negative / len(kl), "negative_terms": negative}


def leaves(lora):
    return {n: (A.clone().requires_grad_(), B.clone().requires_grad_()) for n, (A, B) in lora.items()}


def test_every_step_of_the_run_matches_the_float64_oracle(oracle_run, tiny_model_dir):
    out, records, ranks, flags = oracle_run
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64).eval()
    names = linear_names(model)
    zero_b = {n: (A, torch.zeros_like(B)) for n, (A, B) in adapter(out / "checkpoint-1", names).items()}
    s1, s2 = adapter(out / "checkpoint-1", names), adapter(out / "checkpoint-2", names)
    plan = [(zero_b, zero_b), (s1, s1), (s2, s2)]  # the students of steps 1-3, each its own teacher (current)
    if flags["teacher"] == "ema":  # the EMA is the student until the first step makes a copy of it, then
        d = flags["ema_decay"]     # decay * ema + (1 - decay) * student after each step, for A and for B
        plan[2] = (s2, {n: (d * s1[n][0] + (1 - d) * s2[n][0], d * s1[n][1] + (1 - d) * s2[n][1]) for n in names})
    negatives = []
    for step, (student, teacher) in enumerate(plan, 1):
        student = leaves(student)
        want = step_oracle(model, student, teacher, ranks, step, flags)
        got = records[step - 1]
        for key in ("loss", "kl_mean", "kl_first_token", "kl_clipped_teacher_mass", "entropy_student",
                    "entropy_teacher"):
            assert got[key] == pytest.approx(want[key], rel=2e-4, abs=1e-7), (step, key, got[key], want[key])
        # a position within float32 rounding of tau may fall either side: at most one of them
        assert abs(got["kl_frac_above_tau"] - want["kl_frac_above_tau"]) <= 1 / want["kl_window_tokens"] + 1e-12
        assert abs(got["loss_frac_negative"] - want["loss_frac_negative"]) <= 1 / want["kl_window_tokens"] + 1e-12
        assert got["kl_window_tokens"] == want["kl_window_tokens"]
        negatives.append(want["negative_terms"])
        grads = [g for n in names for g in (student[n][0].grad, student[n][1].grad)]
        norm = torch.sqrt(sum((g ** 2).sum() for g in grads)).item()
        assert got["grad_norm"] == pytest.approx(norm, rel=2e-4), (step, got["grad_norm"], norm)
        assert 0.1 < want["clipped_share"] < 0.9, want["clipped_share"]  # the clip cuts some positions, not all
        if flags["clip"] == "token":
            assert 0 < want["loss"] < flags["tau"]
        check_logged_answers(out, step, got, want, ranks, flags)
    # the tiny random model's KL (about 1) is far above tau: no clipped sum falls below 0 here (tests/test_loss.py
    # shows the entry clip's negative terms counted where teacher and student are close)
    assert sum(negatives) == 0, negatives
    # the adapter after step 3: AdamW from checkpoint-2's moments, with the clipped step-3 gradient, written out
    state = torch.load(out / "checkpoint-2" / "trainer_state.pt", weights_only=True)["optimizer"]["state"]
    final = adapter(out / "final", names)
    clip = min(1.0, flags["max_grad_norm"] / (norm + 1e-6))
    progress = (2 - flags["warmup_steps"]) / (STEPS - flags["warmup_steps"])  # cosine after warmup, to 0
    lr = 0.5 * flags["lr"] * (1 + math.cos(math.pi * progress))  # at step index 2 of 3
    for i, (param, g) in enumerate(zip([p for n in names for p in s2[n]], grads)):
        m = 0.9 * state[i]["exp_avg"].double() + 0.1 * clip * g
        v = 0.999 * state[i]["exp_avg_sq"].double() + 0.001 * (clip * g) ** 2
        new = param - lr * (m / (1 - 0.9 ** 3)) / ((v / (1 - 0.999 ** 3)).sqrt() + 1e-8)
        name, ab = names[i // 2], i % 2  # the step itself, element by element, to a thousandth of the learning rate
        torch.testing.assert_close(final[name][ab] - param, new - param, rtol=1e-3, atol=1e-3 * lr)
    assert max((final[n][1] - s2[n][1]).abs().max() for n in names) > 0.1 * lr  # the step moved the adapter


def check_logged_answers(out, step, got, want, ranks, flags):
    """rollouts.jsonl at `step`: rank 0's answers, each with its tokens, each token's KL(p_T || p_S) at the loss
    temperature (the oracle's, row by row), and the positions the loss skipped; steps not due log nothing."""
    logged = [r for r in map(json.loads, (out / "rollouts.jsonl").read_text().splitlines()) if r["step"] == step]
    if step == 2:  # --log-rollouts-every 10 (the default) of 3 steps: the first step and the last
        assert logged == []
        return
    mine = ranks[0][step - 1]["completions"]
    assert [r["token_ids"] for r in logged] == mine and [r["tokens"] for r in logged] == [len(c) for c in mine]
    for r, kl in zip(logged, want["rows_kl"]):
        assert len(r["kl"]) == len(kl) and r["skipped_by_loss"] == min(flags["skip_first_tokens"], len(kl))
        torch.testing.assert_close(torch.tensor(r["kl"], dtype=torch.float64), kl, rtol=2e-4, atol=1e-6)
    # what the step's record implies for rank 0's answers: its KL sum over both ranks less rank 1's (the oracle's)
    implied = got["kl_mean"] * got["kl_window_tokens"] - sum(kl.sum() for kl in want["rows_kl"][len(mine):]).item()
    assert sum(map(sum, (r["kl"] for r in logged))) == pytest.approx(implied, rel=2e-4, abs=1e-6)


def test_each_rank_trained_on_its_own_shard_of_the_step(oracle_run, tiny_model_dir):
    _, _, ranks, flags = oracle_run
    rows = [json.loads(line) for line in DATA.read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    render = lambda text, thinking: tok.apply_chat_template([{"role": "user", "content": text}],  # noqa: E731
                                                            add_generation_prompt=True, enable_thinking=thinking,
                                                            tokenize=True, return_dict=False)
    per_rank = PROMPTS // 2
    for step in range(STEPS):
        indices = opsd.step_indices(step, PROMPTS, len(rows), flags["seed"])
        taken = []
        for rank, seen in enumerate(ranks):
            mine = indices[rank * per_rank:(rank + 1) * per_rank]  # rank r: the r-th slice of the step's indices
            assert seen[step]["student"] == [render(opsd.student_message(rows[i]["problem"]), False) for i in mine]
            assert seen[step]["teacher"] == [render(opsd.teacher_message(rows[i]["problem"], rows[i]["solution"]),
                                                    True) for i in mine]
            taken += mine
        assert len(ranks[0]) == len(ranks[1]) == STEPS
        assert len(set(taken)) == PROMPTS  # no prompt on two ranks
