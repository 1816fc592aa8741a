# python -m pytest tests/test_run_oracle.py -q
"""The run itself against an oracle: opsd.py under torchrun (2 ranks, 3 steps), gradient checkpointing on, with
every loss, teacher and batch flag off its default and unlike the others, in two settings (the token clip, a JSD,
the EMA teacher; the entry clip, the forward KL, the current student as teacher). A launcher wraps
opsd.backward_step to write down what each rank trained on, the LoRA each step began from and the EMA teacher's,
then calls it unchanged. From those records and the run's directory, opsd_dump() writes check 4's dump, the one any
trainer can write (tests/verify/README.md), and tests/verify/run_check.py checks it as it checks a peer's: every
step recomputed in float64 with its own code (each row alone through the merged weights, the divergence from its
formulas, no opsd loss function): the loss, kl_mean, kl_frac_above_tau, kl_first_token, the clipped teacher mass,
both entropies, the share of negative loss terms, the gradient norm, and the adapter after each of the three steps
(its own AdamW), the EMA teacher's update. This file adds what is opsd.py's alone: the learning rate's schedule, the
EMA's start, that each rank trained on the prompts step_indices names for it, none shared, and that the answers
rollouts.jsonl logs (rank 0's, at steps 1 and 3 here) carry each token's KL as the oracle computes it, and what the
run shows its user (--overwrite replacing an older run, the figures each step logs, the sampler's log-probs equal to
the trainer's, the command that resumes, the step lines, the final adapter loading back). A dump of
the same run with one wrong wiring (the teacher shown the student's prompt, the loss normalised otherwise, the
learning rate logged a step late, the EMA at another decay) is reported as differing. And a port written here,
unlike opsd.py (port_run: its own LoRA, batches, normalisation and optimizer settings), is checked the same way."""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import opsd

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "verify"))
import run_check  # noqa: E402

DATA = ROOT / "tests" / "data" / "math_train.jsonl"
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
# the wrong normalisation of the loss each run's dump is given (test_a_wrong_wiring_is_caught_through_the_dump)
LOSS_WIRING = {"token": "answer", "entry": "skip counted"}

# records/rank<r>.json: what backward_step received at each step; rank 0 also writes names.json (the LoRA
# matrices' PEFT names, in the order of lora_params and of the optimizer's state) and, per step, the student's
# LoRA it began from (before-<s>.safetensors) and the EMA teacher's when there is one (teacher-<s>.safetensors)
LAUNCHER = """
import json, os, sys
from pathlib import Path
sys.path.insert(0, {root!r})
from safetensors.torch import save_file
import opsd
out = Path({out!r})
seen, original = [], opsd.backward_step
def recording(model, lora_params, student_prompts, teacher_prompts, completions, **kw):
    seen.append(dict(student=student_prompts, teacher=teacher_prompts, completions=completions))
    (out / f"rank{{os.environ['RANK']}}.json").write_text(json.dumps(seen))
    if os.environ["RANK"] == "0":
        named = opsd.adapter_parameters(model)
        assert all(a is b for a, b in zip(named.values(), lora_params, strict=True))
        (out / "names.json").write_text(json.dumps(list(named)))
        step = len(seen)
        save_file({{n: p.detach().clone() for n, p in named.items()}}, str(out / f"before-{{step}}.safetensors"))
        if kw.get("ema") is not None:
            save_file({{n: e.clone() for n, e in zip(named, kw["ema"])}}, str(out / f"teacher-{{step}}.safetensors"))
    return original(model, lora_params, student_prompts, teacher_prompts, completions, **kw)
opsd.backward_step = recording
opsd.main()
"""


@pytest.fixture(scope="module", params=list(SETTINGS))
def oracle_run(request, tiny_model_dir, tmp_path_factory):
    flags = SETTINGS[request.param]
    tmp = tmp_path_factory.mktemp("oracle")
    (tmp / "records").mkdir()
    launcher = tmp / "launch.py"
    launcher.write_text(LAUNCHER.format(root=str(ROOT), out=str(tmp / "records")))
    older = tmp / "run"  # holds an older finished run, which --overwrite replaces
    (older / "final").mkdir(parents=True)
    (older / "checkpoint-7").mkdir()
    (older / "metrics.jsonl").write_text(json.dumps({"step": 99}) + "\n")
    argv = [f"--{k.replace('_', '-')}={v}" for k, v in flags.items()]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(launcher),
           "--model", tiny_model_dir, "--dataset", str(DATA), "--device", "cpu", "--dtype", "float32",
           "--prompts-per-step", str(PROMPTS), "--max-new-tokens", str(NEW_TOKENS),
           "--max-steps", str(STEPS), "--save-every", "1", "--kl-window", "1", "--gradient-checkpointing",
           "--output-dir", str(tmp / "run"), "--overwrite", *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    ranks = [json.loads((tmp / "records" / f"rank{r}.json").read_text()) for r in range(2)]
    return tmp / "run", records, ranks, flags, proc.stdout


def opsd_dump(run_dir, records, out):
    """opsd.py's run as check 4's dump (tests/verify/README.md) in `out`: its settings from args.json and the
    optimizer's own param_groups; what each rank trained on and, per step, the student's LoRA it began from and
    the EMA teacher's (the launcher's records); its logged figures (metrics.jsonl, at --kl-window 1 the step's
    own); the LoRA after each step (checkpoint-<s>, final/) and AdamW's moments before it (the checkpoint before;
    step 1 has none: the moments start at 0)."""
    args = json.loads((run_dir / "args.json").read_text())
    state = lambda s: torch.load(run_dir / f"checkpoint-{s}" / "trainer_state.pt",  # noqa: E731
                                 weights_only=True)["optimizer"]
    group = state(1)["param_groups"][0]
    run = {"model": args["model"], "beta": args["beta"], "loss_temperature": args["loss_temperature"],
           "clip": args["clip"], "tau": args["tau"], "skip_first_tokens": args["skip_first_tokens"],
           "normalisation": "step", "micro_batch_size": args["micro_batch_size"], "teacher": args["teacher"],
           "lora": {"r": args["lora_r"], "alpha": args["lora_alpha"], "target_modules": list(opsd.LORA_TARGETS)},
           "optimizer": {k: group[k] for k in ("betas", "eps", "weight_decay")},
           "max_grad_norm": args["max_grad_norm"]}
    if args["teacher"] == "ema":
        run["ema_decay"] = args["ema_decay"]
    out.mkdir()
    (out / "run.json").write_text(json.dumps(run, indent=2))
    for rank in range(2):
        seen = json.loads((records / f"rank{rank}.json").read_text())
        (out / f"rank{rank}.jsonl").write_text("".join(
            json.dumps({"step": s, "rows": [{"student_prompt_ids": sp, "teacher_prompt_ids": tp, "completion_ids": c}
                                            for sp, tp, c in zip(rows["student"], rows["teacher"],
                                                                 rows["completions"])]}) + "\n"
            for s, rows in enumerate(seen, 1)))
    figures = [{**{k: r[k] for k in ("step", "loss", "grad_norm", "lr", "kl_mean", "kl_frac_above_tau",
                                      "kl_first_token", "kl_clipped_teacher_mass", "entropy_student",
                                      "entropy_teacher", "loss_frac_negative")},
                "answer_tokens": r["kl_window_tokens"]}
               for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]
    (out / "figures.jsonl").write_text("".join(json.dumps(f) + "\n" for f in figures))
    names = json.loads((records / "names.json").read_text())
    for s in range(1, STEPS + 1):
        step = out / f"step-{s}"
        for kind in ("before", "teacher"):
            if (records / f"{kind}-{s}.safetensors").exists():
                (step / kind).mkdir(parents=True)
                shutil.copy(records / f"{kind}-{s}.safetensors", step / kind / "adapter_model.safetensors")
        (step / "after").mkdir()
        after = run_dir / (f"checkpoint-{s}" if s < STEPS else "final") / "adapter_model.safetensors"
        shutil.copy(after, step / "after" / "adapter_model.safetensors")
        if s > 1:  # the optimizer's state lists the moments in lora_params' order: names.json's
            moments = state(s - 1)["state"]
            run_check.write_moments(step / "optimizer.safetensors", {
                n: (moments[i]["exp_avg"], moments[i]["exp_avg_sq"]) for i, n in enumerate(names)},
                steps_before=int(moments[0]["step"]))
    return out


@pytest.fixture(scope="module")
def checked(oracle_run, tiny_model_dir):
    """(the dump's directory, the float64 model, run_check's checks and its recomputed steps)."""
    out, _, _, _, _ = oracle_run
    dump = opsd_dump(out, out.parent / "records", out.parent / "dump")
    model = run_check.load_model(tiny_model_dir)
    checks, results = run_check.check(run_check.read_dump(dump), model)
    return dump, model, checks, results


def test_every_step_of_the_run_matches_the_float64_oracle(oracle_run, checked):
    out, records, ranks, flags, _ = oracle_run
    dump, _, checks, results = checked
    differing = [c for c in checks if c.status != "matches"]
    assert differing == [], run_check.report(checks, run_check.read_dump(dump))
    # every figure of every step, each step's update, the adapters written twice, the EMA's rule: all were checked
    names = {c.name for c in checks}
    wanted = {"rows", "adapter", *(f"step {s} after" for s in range(1, STEPS)),
              *(f"step {s} {f}" for s in range(1, STEPS + 1) for f in (*run_check.FIGURES, "update"))}
    if flags["teacher"] == "ema":
        wanted.add("step 3 teacher")
    assert names == wanted, names ^ wanted
    for step, result in results.items():
        assert 0.1 < result.clipped_share < 0.9, result.clipped_share  # the clip cuts some positions, not all
        if flags["clip"] == "token":
            assert 0 < result.figures["loss"] < flags["tau"]
        check_logged_answers(out, step, records[step - 1], result, ranks, flags)
    # the tiny random model's KL (about 1) is far above tau: no clipped sum falls below 0 here (tests/test_loss.py
    # shows the entry clip's negative terms counted where teacher and student are close)
    assert sum(r.negative_terms for r in results.values()) == 0
    # the dump's learning rates (run_check's AdamW takes them as logged) are opsd.py's schedule: linear warmup, then
    # a cosine towards 0, which only a step past the last would reach
    for step, record in enumerate(records):
        w = flags["warmup_steps"]
        lr = flags["lr"] * ((step + 1) / w if step < w else 0.5 * (1 + math.cos(math.pi * (step - w) / (STEPS - w))))
        assert record["lr"] == pytest.approx(lr, rel=1e-12)
    first, before, after = (run_check.read_adapter(dump / f"step-{s}" / kind)
                            for s, kind in ((1, "before"), (STEPS, "before"), (STEPS, "after")))
    lr = records[-1]["lr"]  # the last step moved the adapter (its change is checked to a thousandth of lr)
    assert max((after[n][1] - before[n][1]).abs().max() for n in after) > 0.1 * lr
    assert all(B.abs().max() == 0 for _, B in first.values())  # the run starts at the base model
    if flags["teacher"] == "ema":  # opsd.py's EMA: none at step 1 (the student teaches), then a copy of the student
        assert not (dump / "step-1" / "teacher").exists()
        teacher, student = (run_check.read_adapter(dump / "step-2" / kind) for kind in ("teacher", "before"))
        assert all(torch.equal(t, s) for n in student for t, s in zip(teacher[n], student[n], strict=True))


KEYS = {"step", "loss", "lr", "grad_norm", "kl_mean", "kl_frac_above_tau", "logprob_gap_mean", "logprob_gap_max",
        "completion_len_mean", "time_sample", "time_train", "time_push"}


def test_the_run_as_its_user_sees_it(oracle_run, tiny_model_dir):
    """What the oracle does not recompute: --overwrite replaced the older run the directory held; each step's record
    holds every figure, finite, and vLLM's log-prob of each sampled token is the trainer's; the command that resumes
    is printed at the start, before any step, and on each checkpoint's line; a line per step; the final adapter
    loads back into the model at the run's LoRA rank."""
    out, records, _, flags, stdout = oracle_run
    assert not (out / "checkpoint-7").exists() and [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:
        assert KEYS <= set(r) and all(math.isfinite(r[k]) for k in KEYS), r
        # sampler and trainer agree on every sampled token: padding, positions and pushes are right
        assert r["logprob_gap_mean"] <= 1e-5 and r["logprob_gap_max"] <= 1e-4  # the float32 floor (~1e-6), x10
        assert r["lr"] > 0 and r["completion_len_mean"] > 0
        # at --kl-window 1 the window is the step's own tokens (answer_tokens, which the oracle counts in the rows)
        assert r["kl_window_tokens"] == r["completion_len_mean"] * PROMPTS
    resume = "to resume: torchrun --nproc_per_node 2 opsd.py "
    assert stdout.index(resume) < stdout.index("step ")
    # once at the start, then on checkpoint-1's and checkpoint-2's lines (the last step writes final/ instead)
    assert stdout.count(resume) == 1 + len(opsd.checkpoints(out)) == STEPS
    commands = [line.split("to resume: ", 1)[1] for line in stdout.splitlines() if "to resume: " in line]
    assert all(c.endswith(" --resume") and "--overwrite" not in c for c in commands), commands
    step_lines = [line for line in stdout.splitlines() if line.startswith("step ")]
    assert len(step_lines) == STEPS and "kl" in step_lines[0] and "push" in step_lines[0]
    # the final adapter loads back into the model (and vLLM's loader reads it: see test_lora.py)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    opsd.add_lora(model, r=flags["lora_r"], alpha=flags["lora_alpha"])
    opsd.load_adapter(model, out / "final")
    assert any(m.lora_B.abs().max() > 0 for m in opsd.lora_layers(model).values())


def copy_with(dump, where, edit):
    """A copy of the dump at `where`, edit(its path) applied, read back."""
    shutil.copytree(dump, where)
    edit(where)
    return run_check.read_dump(where)


def rewrite(path, change):
    """Each record of a JSON-lines file through change(record)."""
    path.write_text("".join(json.dumps(change(r)) + "\n" for r in run_check.read_jsonl(path)))


def statuses(checks):
    return {c.name: c.status for c in checks}


def test_a_wrong_wiring_is_caught_through_the_dump(oracle_run, checked, tmp_path, capsys):
    """The same run's dump, each time with one wiring wrong, checked at the steps it touches (0.1 s a step): the
    checks it should break differ, the others still match."""
    _, records, _, flags, _ = oracle_run
    dump, model, _, results = checked

    # a trainer that showed the teacher the student's prompt at step 1, its logged figures the run's
    def teacher_sees_student(path):
        def change(r):
            rows = [{**row, "teacher_prompt_ids": row["student_prompt_ids"]} for row in r["rows"]]
            return {**r, "rows": rows} if r["step"] == 1 else r
        for rank in range(2):
            rewrite(path / f"rank{rank}.jsonl", change)
    checks, _ = run_check.check(copy_with(dump, tmp_path / "prompts", teacher_sees_student), model, {1})
    differ = {name for name, status in statuses(checks).items() if status == "differs"}
    assert {"rows", "step 1 loss", "step 1 grad_norm", "step 1 kl_mean", "step 1 update"} <= differ, differ
    assert any("give the teacher the student's prompt" in line for c in checks for line in c.lines)

    # a trainer whose loss is normalised otherwise: in the first run each answer's token mean, averaged (its
    # step 1 has answers of 11 and 24 tokens); in the second every answer has 24, where that mean is the step's,
    # so there the skipped first position is counted in the denominator
    wrong = LOSS_WIRING[flags["clip"]]
    value = results[1].losses[wrong]
    assert abs(value / results[1].losses["step"] - 1) > 10 * run_check.TOL_FIGURE[0]
    loss_edit = lambda path: rewrite(path / "figures.jsonl",  # noqa: E731
                                     lambda r: {**r, "loss": value} if r["step"] == 1 else r)
    copy = copy_with(dump, tmp_path / "loss", loss_edit)
    checks, _ = run_check.check(copy, model, {1})
    assert [name for name, status in statuses(checks).items() if status != "matches"] == ["step 1 loss"]
    assert f"yours is {run_check.LOSS_NAMES[wrong]} ('{wrong}')" in run_check.report(checks, copy)

    # the learning rate logged one step late (its update at step 3 then has step 2's)
    lr_edit = lambda path: rewrite(path / "figures.jsonl",  # noqa: E731
                                   lambda r: {**r, "lr": records[1]["lr"]} if r["step"] == 3 else r)
    checks, _ = run_check.check(copy_with(dump, tmp_path / "lr", lr_edit), model, {3})
    assert [name for name, status in statuses(checks).items() if status != "matches"] == ["step 3 update"]

    if flags["teacher"] == "ema":  # the EMA's decay stated otherwise than the run's
        decay = lambda path: (path / "run.json").write_text(json.dumps(  # noqa: E731
            {**json.loads((path / "run.json").read_text()), "ema_decay": 0.9}))
        checks, _ = run_check.check(copy_with(dump, tmp_path / "decay", decay), model, {2, 3})
        assert [name for name, status in statuses(checks).items() if status != "matches"] == ["step 3 teacher"]

    # the command's main(), on the wrong loss: exit 1, the difference and its cause said
    assert run_check.main([str(copy.path), "--steps", "1"]) == 1
    out = capsys.readouterr().out
    assert "[differs] step 1 loss" in out and f"('{wrong}')" in out and "1 of " in out.splitlines()[-1], out


# ---- a port: the same dump from another trainer -------------------------------------------------------------------


class PortLoRA(torch.nn.Module):
    """The port's own LoRA: y = W x + (alpha / r) B A x, switched off for the teacher."""

    def __init__(self, base, r, alpha, generator):
        super().__init__()
        self.base, self.scale, self.on = base, alpha / r, True
        self.A = torch.nn.Parameter(0.1 * torch.randn(r, base.in_features, generator=generator))
        self.B = torch.nn.Parameter(torch.zeros(base.out_features, r))

    def forward(self, x):
        return self.base(x) + (self.scale * (x @ self.A.T) @ self.B.T if self.on else 0)


def port_run(dump, steps=3, ranks=2, rows_per_rank=3):
    """A trainer written here from the method's description, unlike opsd.py wherever it may be: LoRA on q_proj and
    v_proj only, the teacher the base model, each rank's rows in one left-padded batch, the loss each answer's
    token mean averaged over answers and then over ranks (as data parallelism averages), torch's AdamW with weight
    decay, the gradient's norm clipped. Float32, on the miniature model, with the fixture's rows (answers of 25 to
    33 tokens), 2 simulated ranks. It writes check 4's dump as README.md's sketch does."""
    from safetensors.torch import save_file

    fixture = json.loads((ROOT / "tests" / "verify" / "fixture.json").read_text())
    T, tau, lr, max_norm = 1.1, 0.05, 5e-3, 0.02
    model = AutoModelForCausalLM.from_pretrained(ROOT / fixture["model"], dtype=torch.float32).requires_grad_(False)
    generator, loras = torch.Generator().manual_seed(0), {}
    for name, module in list(model.named_modules()):
        for child in ("q_proj", "v_proj"):
            if hasattr(module, child):
                setattr(module, child, PortLoRA(getattr(module, child), 4, 8, generator))
                loras[f"{name}.{child}"] = getattr(module, child)
    names = {m: f"base_model.model.{n}.lora_{ab}.weight" for n, lora in loras.items()
             for ab, m in (("A", lora.A), ("B", lora.B))}
    optimizer = torch.optim.AdamW(list(names), lr=lr, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)

    def answer_logits(prompts, answers):  # left padding; position ids count the real tokens
        seqs = [p + a for p, a in zip(prompts, answers)]
        width = max(map(len, seqs))
        mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs])
        ids = torch.tensor([[0] * (width - len(s)) + s for s in seqs])
        out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
        return [out[i, width - len(a) - 1:width - 1] for i, a in enumerate(answers)]

    dump.mkdir()
    (dump / "run.json").write_text(json.dumps({
        "model": str(ROOT / fixture["model"]), "beta": 0.0, "loss_temperature": T, "clip": "entry", "tau": tau,
        "normalisation": "answer", "teacher": "base",
        "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
        "optimizer": {"betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.01}, "max_grad_norm": max_norm}))
    for step in range(1, steps + 1):
        here = dump / f"step-{step}"
        (here / "before").mkdir(parents=True)
        save_file({n: m.detach().clone() for m, n in names.items()}, str(here / "before" / "adapter_model.safetensors"))
        losses, kl, positions = [], 0.0, 0
        for rank in range(ranks):
            first = ((step - 1) * ranks + rank) * rows_per_rank
            rows = [{k: r[k] for k in ("student_prompt_ids", "teacher_prompt_ids", "completion_ids")}
                    for r in fixture["rows"][first:first + rows_per_rank]]
            with open(dump / f"rank{rank}.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "rows": rows}) + "\n")
            answers = [r["completion_ids"] for r in rows]
            with torch.no_grad():
                for lora in loras.values():
                    lora.on = False
                teacher = answer_logits([r["teacher_prompt_ids"] for r in rows], answers)
                for lora in loras.values():
                    lora.on = True
            means = []
            for s, t in zip(answer_logits([r["student_prompt_ids"] for r in rows], answers), teacher):
                log_s, log_t = torch.log_softmax(s / T, -1), torch.log_softmax(t / T, -1)
                terms = log_t.exp() * (log_t - log_s)
                means.append(terms.clamp(max=tau).sum(-1).mean())
                kl, positions = kl + terms.sum().item(), positions + len(terms)
            loss = torch.stack(means).mean()
            (loss / ranks).backward()
            losses.append(loss.item())
        if optimizer.state:
            state = optimizer.state
            run_check.write_moments(here / "optimizer.safetensors",
                                    {n: (state[m]["exp_avg"], state[m]["exp_avg_sq"]) for m, n in names.items()},
                                    steps_before=int(state[next(iter(names))]["step"]))
        grad_norm = torch.nn.utils.clip_grad_norm_(list(names), max_norm).item()
        optimizer.step()
        optimizer.zero_grad()
        (here / "after").mkdir()
        save_file({n: m.detach().clone() for m, n in names.items()}, str(here / "after" / "adapter_model.safetensors"))
        with open(dump / "figures.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "loss": sum(losses) / ranks, "grad_norm": grad_norm, "lr": lr,
                                "kl_mean": kl / positions, "answer_tokens": positions}) + "\n")
    return dump


def test_a_port_is_checked_the_same_way(tmp_path):
    """Another trainer's dump (port_run) goes through the same check: every figure it logged, each update and the
    adapters written twice match; the figures it did not log are not checked. Declared with opsd.py's
    normalisation, its loss and gradient norm differ, and the per-answer one is named."""
    dump = run_check.read_dump(port_run(tmp_path / "port"))
    model = run_check.load_model(dump.run["model"])
    checks, results = run_check.check(dump, model)
    assert {c.status for c in checks if c.status != "not checked"} == {"matches"}, run_check.report(checks, dump)
    assert {c.name for c in checks if c.status == "not checked"} == {f"step {s} figures" for s in (1, 2, 3)}
    assert {f"step {s} update" for s in (1, 2, 3)} <= {c.name for c in checks}
    assert results[1].grad_norms["answer"] > 0.02  # the clip acted at step 1
    declared = lambda path: (path / "run.json").write_text(json.dumps(  # noqa: E731
        {**json.loads((path / "run.json").read_text()), "normalisation": "step"}))
    copy = copy_with(dump.path, tmp_path / "declared", declared)
    checks, _ = run_check.check(copy, model, {1})
    assert [c.name for c in checks if c.status == "differs"] == ["step 1 loss", "step 1 grad_norm", "step 1 update"]
    assert run_check.report(checks, copy).count("('answer'), not the declared 'step'") == 2
    # the command itself, on a dump whose figures lack a grad_norm: one sentence saying so, before any model loads
    broken = tmp_path / "broken"
    shutil.copytree(dump.path, broken)
    rewrite(broken / "figures.jsonl", lambda r: {k: v for k, v in r.items() if k != "grad_norm"})
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "verify" / "run_check.py"), str(broken)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.strip().endswith("step 1 has no loss or no grad_norm (tests/verify/README.md, "
                                        '"Check 4: the run").'), proc.stderr


def check_logged_answers(out, step, got, result, ranks, flags):
    """rollouts.jsonl at `step`: rank 0's answers, each with its tokens, each token's KL(p_T || p_S) at the loss
    temperature (the oracle's, row by row), and the positions the loss skipped; steps not due log nothing."""
    logged = [r for r in map(json.loads, (out / "rollouts.jsonl").read_text().splitlines()) if r["step"] == step]
    if step == 2:  # --log-rollouts-every 10 (the default) of 3 steps: the first step and the last
        assert logged == []
        return
    mine = ranks[0][step - 1]["completions"]
    assert [r["token_ids"] for r in logged] == mine and [r["tokens"] for r in logged] == [len(c) for c in mine]
    for r, kl in zip(logged, result.rows_kl):
        assert len(r["kl"]) == len(kl) and r["skipped_by_loss"] == min(flags["skip_first_tokens"], len(kl))
        torch.testing.assert_close(torch.tensor(r["kl"], dtype=torch.float64), kl, rtol=2e-4, atol=1e-6)
    # what the step's record implies for rank 0's answers: its KL sum over both ranks less rank 1's (the oracle's)
    implied = got["kl_mean"] * got["kl_window_tokens"] - sum(kl.sum() for kl in result.rows_kl[len(mine):]).item()
    assert sum(map(sum, (r["kl"] for r in logged))) == pytest.approx(implied, rel=2e-4, abs=1e-6)


def test_each_rank_trained_on_its_own_shard_of_the_step(oracle_run, tiny_model_dir):
    _, _, ranks, flags, _ = oracle_run
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
