# python -m pytest tests/test_verify_run.py -q
"""Check 4 (tests/verify/run_check.py) on a full fine-tune: a trainer written here from the method's description,
with no adapter (every weight of the miniature model trained, the teacher a frozen copy of the base), torch's AdamW,
left-padded batches, two simulated ranks. Its dump (the trained weights themselves before and after each step, the
optimizer's moments) matches every check; the same dump declared with another normalisation has its loss and
gradient norm named; without an optimizer stated (a sharded or 8-bit optimizer, whose step run_check does not
model) the update is not checked and everything else still is."""

import copy
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "verify"))
import run_check  # noqa: E402

FIXTURE = json.loads((ROOT / "tests" / "verify" / "fixture.json").read_text())
T, TAU, LR, MAX_NORM = 1.1, 0.05, 1e-3, 0.1
OPTIMIZER = {"betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}


def full_run(dump, steps=2, ranks=2, rows_per_rank=2, normalisation="answer", dtype=torch.float32):
    """Write check 4's dump of a full fine-tune: every parameter trained (the tied embedding once), float32; the
    teacher the base model (a frozen copy); each rank's rows in one left-padded batch, position ids counted over
    the real tokens; the forward KL at T 1.1 with the entry clip; the loss each rank's mean of its answers' token
    means, averaged over ranks; the gradient's norm clipped; torch's AdamW with weight decay. dtype: the weights'
    and the computation's (bfloat16: a bf16 trainer, its log-softmax in float32 as such trainers do)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    student = AutoModelForCausalLM.from_pretrained(ROOT / FIXTURE["model"], dtype=dtype)
    teacher = copy.deepcopy(student).eval().requires_grad_(False)
    params = dict(student.named_parameters())
    optimizer = torch.optim.AdamW(params.values(), lr=LR, betas=OPTIMIZER["betas"], eps=OPTIMIZER["eps"],
                                  weight_decay=OPTIMIZER["weight_decay"])

    def answer_logits(model, prompts, answers):
        seqs = [p + a for p, a in zip(prompts, answers)]
        width = max(map(len, seqs))
        mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs])
        ids = torch.tensor([[0] * (width - len(s)) + s for s in seqs])
        out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
        return [out[i, width - len(a) - 1:width - 1] for i, a in enumerate(answers)]

    def save(directory):
        directory.mkdir(parents=True)
        save_file({n: p.detach().clone() for n, p in params.items()}, str(directory / "model.safetensors"))

    dump.mkdir()
    (dump / "run.json").write_text(json.dumps({
        "model": str(ROOT / FIXTURE["model"]), "beta": 0.0, "loss_temperature": T, "clip": "entry", "tau": TAU,
        "normalisation": normalisation, "teacher": "base", "optimizer": OPTIMIZER, "max_grad_norm": MAX_NORM}))
    for step in range(1, steps + 1):
        here = dump / f"step-{step}"
        save(here / "before")
        loss, kl, positions = 0.0, 0.0, 0
        for rank in range(ranks):
            first = ((step - 1) * ranks + rank) * rows_per_rank
            rows = [{k: r[k] for k in ("student_prompt_ids", "teacher_prompt_ids", "completion_ids")}
                    for r in FIXTURE["rows"][first:first + rows_per_rank]]
            with open(dump / f"rank{rank}.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "rows": rows}) + "\n")
            answers = [r["completion_ids"] for r in rows]
            with torch.no_grad():
                t_logits = answer_logits(teacher, [r["teacher_prompt_ids"] for r in rows], answers)
            means = []
            for s, t in zip(answer_logits(student, [r["student_prompt_ids"] for r in rows], answers), t_logits):
                log_s, log_t = torch.log_softmax(s.float() / T, -1), torch.log_softmax(t.float() / T, -1)
                terms = log_t.exp() * (log_t - log_s)
                means.append(terms.clamp(max=TAU).sum(-1).mean())
                kl, positions = kl + terms.sum().item(), positions + len(terms)
            rank_loss = torch.stack(means).mean() / ranks
            rank_loss.backward()
            loss += rank_loss.item()
        if optimizer.state:
            state = optimizer.state
            run_check.write_moments(here / "optimizer.safetensors",
                                    {n: (state[p]["exp_avg"], state[p]["exp_avg_sq"]) for n, p in params.items()},
                                    steps_before=int(state[next(iter(params.values()))]["step"]))
        grad_norm = torch.nn.utils.clip_grad_norm_(params.values(), MAX_NORM).item()
        optimizer.step()
        optimizer.zero_grad()
        save(here / "after")
        with open(dump / "figures.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "loss": loss, "grad_norm": grad_norm, "lr": LR, "kl_mean": kl / positions,
                                "answer_tokens": positions}) + "\n")
    return dump


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    dump = run_check.read_dump(full_run(tmp_path_factory.mktemp("full") / "dump"))
    return dump, run_check.load_model(dump.run["model"])


def edited(dump, where, change):
    """A copy of the dump's directory with run.json changed."""
    import shutil

    shutil.copytree(dump.path, where)
    (where / "run.json").write_text(json.dumps(change(json.loads((where / "run.json").read_text()))))
    return run_check.read_dump(where)


def test_a_full_fine_tune_matches_every_check(full):
    dump, model = full
    checks, results = run_check.check(dump, model)
    report = run_check.report(checks, dump)
    assert {c.status for c in checks if c.status != "not checked"} == {"matches"}, report
    names = {c.name for c in checks}
    assert {"weights", "step 1 update", "step 2 update", "step 1 after", "step 2 loss", "step 2 grad_norm"} <= names
    assert results[1].grad_norms["answer"] > MAX_NORM  # the clip acted
    assert "a full fine-tune: " in report and f"of the model's {len(list(model.parameters()))} parameters" in report


def test_a_full_fine_tunes_normalisation_and_update_are_checked(full, tmp_path):
    """Declared with the step's token mean, the loss and gradient norm differ and are named per answer, and the
    update differs (its gradient is the per-answer one's)."""
    dump, model = full
    copy_ = edited(dump, tmp_path / "declared", lambda run: {**run, "normalisation": "step"})
    checks, _ = run_check.check(copy_, model, {1})
    assert [c.name for c in checks if c.status == "differs"] == ["step 1 loss", "step 1 grad_norm", "step 1 update"]
    assert run_check.report(checks, copy_).count("('answer'), not the declared 'step'") == 2


def test_an_optimizer_run_check_does_not_model_leaves_the_rest_checked(full, tmp_path):
    """A sharded or 8-bit optimizer: run.json states none, so no update is checked; the figures, the weights and
    the weights written twice still are, and match."""
    dump, model = full
    copy_ = edited(dump, tmp_path / "no-optimizer", lambda run: {k: v for k, v in run.items() if k != "optimizer"})
    checks, _ = run_check.check(copy_, model)
    status = {c.name: c.status for c in checks}
    assert status["step 1 update"] == status["step 2 update"] == "not checked"
    assert {s for n, s in status.items() if "update" not in n and s != "not checked"} == {"matches"}
    assert status["step 1 after"] == "matches" and status["step 2 loss"] == "matches"


def test_a_bf16_trainer_holds_the_identity_checks_only(tmp_path):
    """The same trainer in bfloat16 (weights and matmuls; the log-softmax in float32): at run_check's float32
    tolerances the rows, the weights' structure, the weights written twice and the token counts hold; the loss,
    kl_mean and gradient norm differ by what bf16 computes (README.md here states the bounds asserted here), and
    so does the update."""
    dump = run_check.read_dump(full_run(tmp_path / "bf16", dtype=torch.bfloat16))
    checks, results = run_check.check(dump, run_check.load_model(dump.run["model"]))
    status = {c.name: c.status for c in checks}
    assert [status[n] for n in ("rows", "weights", "step 1 after", "step 1 answer_tokens")] == ["matches"] * 4
    lines = (dump.path / "figures.jsonl").read_text().splitlines()
    got = {json.loads(line)["step"]: json.loads(line) for line in lines}
    for step in (1, 2):
        assert status[f"step {step} update"] == "differs"
        for name, bound in (("loss", 0.05), ("kl_mean", 0.01), ("grad_norm", 0.25)):
            want = results[step].figures[name]
            assert status[f"step {step} {name}"] == "differs"
            assert abs(got[step][name] - want) / want < bound, (step, name)
