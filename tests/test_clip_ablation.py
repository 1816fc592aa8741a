"""The clip ablation's regime and statistics (tests/miniature/clip): the two writers' forms at their rates, the
starting model accepted with the teacher's preference in its weights, the step-1 profile recomputed two ways, the
exact binomial interval against known values, the analysis on hand-made results, the arms' command lines."""

import json
import math
import random
import sys

import pytest
import torch

import miniature

sys.path.insert(0, str(miniature.HERE / "clip"))
import ablation  # noqa: E402

import opsd  # noqa: E402

# A figure recomputed here through the float32 model, against the value committed from the machine that made it:
# another CPU's kernels (AVX512 or not, other thread counts) round the logits differently, which moves these figures
# by up to 3e-7 relative (measured); 1e-5 leaves 30x that, and a wrong temperature, tau, row or position moves them by
# more than 1e-3. The shares and means above tau stay continuous only while no position sits on tau: NEAR_TAU
# (checked on the rows; the closest position is 1.0e-3 of tau away at temperature 3.0, the closest entry 1.7e-3).
FLOAT32_REL = 1e-5
NEAR_TAU = 1e-4  # relative: 300x the drift; a position this close to tau could cross it on another CPU


@pytest.fixture(scope="module")
def task():
    return miniature.make_task()


COLUMN = r"([0-9])\+([0-9])(\+1)?=([0-9]{1,2})"


def parse(trace):
    """(columns as (first, second, carry in, written sum), separators, closing word, boxed answer) of a trace."""
    import re

    body, boxed = trace.split(" \\boxed{")
    closing = body.endswith(" so")
    body = body.removesuffix(" so")
    columns = [(int(m[1]), int(m[2]), bool(m[3]), int(m[4])) for m in re.finditer(COLUMN, body)]
    seps = re.findall(r"=[0-9]{1,2}(, | )", body)
    return columns, seps, closing, boxed.rstrip("}")


def test_without_forms_the_writer_draws_what_it_drew_before():
    # the reasoning miniature's committed models were pre-trained on these draws: the forms must not change them
    # (these strings are the previous write_trace's output for this seed)
    rng = random.Random(7)
    got = [miniature.writer_trace(a, b, rng) for a, b in [(457, 385), (999, 101), (189, 812), (555, 445), (123, 456)]]
    assert got == ["7+5=12 5+8=13 4+3+1=7 \\boxed{732}", "9+1=10 9+0=9 9+1=11 \\boxed{1190}",
                   "9+2=12 8+1=9 1+8=9 \\boxed{992}", "5+5=10 5+4=9 5+4=9 \\boxed{990}",
                   "3+6=9 2+5=7 1+4=4 \\boxed{479}"]
    assert rng.random() == 0.28960928633167626


def test_each_writer_takes_each_form_at_its_rate_and_stays_correct():
    rng = random.Random(0)
    for name, prefer, write in (("teacher", ablation.PREFER_TEACHER, ablation.teacher_trace),
                                ("writer", ablation.PREFER_WRITER, ablation.writer_trace)):
        first = {"order": [0, 0], "sep": [0, 0], "so": [0, 0]}  # [first form, draws]
        for _ in range(3000):
            a, b = rng.randint(100, 999), rng.randint(100, 999)
            trace = write(a, b, rng)
            columns, seps, closing, boxed = parse(trace)
            assert len(columns) == 3 and len(seps) == 2, trace
            for i, (p, q, _, _) in enumerate(columns):
                x, y = a // 10 ** i % 10, b // 10 ** i % 10
                assert {p, q} == {x, y}, trace
                if x != y:
                    first["order"][0] += (p, q) == (x, y)
                    first["order"][1] += 1
            first["sep"][0] += seps.count(", ")
            first["sep"][1] += 2
            first["so"][0] += closing
            first["so"][1] += 1
            if name == "teacher":  # correct in every column, carried in order, the box the sum
                carry = 0
                for i, (p, q, c, s) in enumerate(columns):
                    assert c == bool(carry) and s == p + q + carry, trace
                    carry = s // 10
                assert boxed == str(a + b), trace
        for form, (k, n) in first.items():
            assert abs(k / n - prefer) < 4 * math.sqrt(prefer * (1 - prefer) / n), (name, form, k, n)


@pytest.mark.parametrize("drift", [False, True], ids=["model", "model-drift"])
def test_the_model_was_accepted_and_its_teacher_prefers_its_forms(task, drift):
    train, dev, _ = task
    model_dir = ablation.DRIFT_MODEL if drift else ablation.MODEL
    info = json.loads((model_dir / miniature.TASK_FILE).read_text())
    assert info["accepted"] and info["train_digest"] == miniature.split_digest(train)
    assert info["writer"]["prefer_teacher"] == ablation.PREFER_TEACHER
    assert info["writer"]["prefer_writer"] == ablation.PREFER_WRITER
    assert info["writer"].get("jump", 0.0) == (ablation.JUMP if drift else 0.0)  # the first model predates it
    # from the weights: the probability of writing the top operand first at the first column, where the digits differ
    # (and, for the drift model, of opening with the box instead of a column)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    box = [tok.convert_tokens_to_ids(t) for t in ("\\", "\u0120\\")]
    first, opens_with_box = {"student": [], "teacher": []}, {"student": [], "teacher": []}
    for r in dev[:60]:
        a, b = miniature.operands(r["problem"])
        x, y = a % 10, b % 10
        if x == y:
            continue
        prompts = {"student": miniature.student_prompt(tok, r["problem"]),
                   "teacher": miniature.teacher_prompt(tok, r["problem"], f"{r['problem']}={r['answer']}")}
        for side, ids in prompts.items():
            with torch.no_grad():
                p = model(input_ids=torch.tensor([ids])).logits[0, -1].softmax(-1)
            dx, dy = tok.convert_tokens_to_ids(str(x)), tok.convert_tokens_to_ids(str(y))
            first[side].append((p[dx] / (p[dx] + p[dy])).item())
            opens_with_box[side].append(p[box].sum().item())
    mean = {side: sum(v) / len(v) for side, v in first.items()}
    assert abs(mean["student"] - ablation.PREFER_WRITER) < 0.1, mean
    assert abs(mean["teacher"] - ablation.PREFER_TEACHER) < 0.1, mean
    jump = {side: sum(v) / len(v) for side, v in opens_with_box.items()}
    assert jump["student"] < 0.02 and abs(jump["teacher"] - (ablation.JUMP if drift else 0.0)) < 0.05, jump


@pytest.mark.parametrize("drift", [False, True], ids=["model", "model-drift"])
def test_the_step1_profile_recomputes_two_ways(drift):
    """The committed step-1 figures against two computations of this test's own (ablation.py's writer not called):
    float64 through torch's kl_div from the float32 logits, and opsd.py's diagnostics (float32, chunked)."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir, folder = (ablation.DRIFT_MODEL, ablation.HERE / "drift") if drift else (ablation.MODEL, ablation.HERE)
    ref = json.loads((folder / "reference_step.json").read_text())
    committed = json.loads((folder / "step1_profile.json").read_text())
    assert ref["model_sha256_16"] == miniature.model_digest(model_dir)
    assert ref["settings"] == {"temperature": 1.1, "tau": 0.05, "beta": 0.0}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    kl64, clipped64, top64, kl, clipped = [], [], [], [], []
    for r in ref["rows"]:
        n = len(r["completion_ids"])
        with torch.no_grad():
            s = model(input_ids=torch.tensor([r["student_prompt_ids"] + r["completion_ids"]])).logits[0, -n - 1:-1]
            t = model(input_ids=torch.tensor([r["teacher_prompt_ids"] + r["completion_ids"]])).logits[0, -n - 1:-1]
        log_s, log_t = (torch.log_softmax(x.double() / 1.1, -1) for x in (s, t))
        entries = F.kl_div(log_s, log_t, log_target=True, reduction="none")  # p_T (log p_T - log p_S), per entry
        kl64.append(entries.sum(-1))
        clipped64.append((log_t.exp() * (entries > 0.05)).sum(-1))
        top64.append(log_t.exp().max(-1).values)
        log_s32, log_t32 = opsd.log_probs(s, t, 1.1)
        terms = opsd.clipped_divergence(log_s32, log_t32, beta=0.0, clip="entry", tau=0.05)
        stats = opsd.divergence_stats(s, log_s32, log_t32, torch.tensor(r["completion_ids"]), terms, torch.ones(n),
                                      tau=0.05)
        kl.append(stats.kl)
        clipped.append(stats.clipped_mass)
    kl64, clipped64, top64 = torch.cat(kl64), torch.cat(clipped64), torch.cat(top64)
    assert ((kl64 - 0.05).abs() > NEAR_TAU * 0.05).all()  # the exact share above tau holds on any CPU's kernels
    above = kl64 > 0.05
    assert committed["positions"] == len(kl64)  # a count: exact
    assert committed["frac_above_tau"] == above.double().mean().item()  # a share of counts: exact
    for key, value in (("kl_mean", kl64.mean()), ("clipped_mass_above_tau", clipped64[above].mean()),
                       ("teacher_top_prob_above_tau", top64[above].mean())):
        assert committed[key] == pytest.approx(value.item(), rel=FLOAT32_REL), key
    kl, clipped = torch.cat(kl).double(), torch.cat(clipped).double()  # opsd.py's, float32
    assert kl.mean().item() == pytest.approx(committed["kl_mean"], rel=1e-4)
    assert abs((kl > 0.05).double().mean().item() - committed["frac_above_tau"]) <= 2 / len(kl)
    assert clipped[above].mean().item() == pytest.approx(committed["clipped_mass_above_tau"], abs=2e-3)
    if drift:  # reported, not matched: the jumps put a large KL at the column starts
        tok = AutoTokenizer.from_pretrained(model_dir)
        at = torch.tensor([i in ablation.jump_positions(tok, r["completion_ids"]) for r in ref["rows"]
                           for i in range(len(r["completion_ids"]))])
        want = committed["at_jump_positions"]
        assert want["jump_positions"] == int(at.sum()) == 3 * len(ref["rows"])  # every rollout: 3 places, exact
        assert want["kl_mean_at_jump_positions"] == pytest.approx(kl64[at].mean().item(), rel=FLOAT32_REL)
        assert want["kl_mean_elsewhere"] == pytest.approx(kl64[~at].mean().item(), rel=FLOAT32_REL)
        assert want["kl_mean_at_jump_positions"] > 3 * want["kl_mean_elsewhere"]
        return
    # the profile is in the window the protocol asks for, by hand (the mass's upper end, 0.8 x 1.5, exceeds any
    # mass: only its lower end can fail, so only it is checked)
    assert 0.10 / 1.5 <= committed["kl_mean"] <= 0.10 * 1.5
    assert 0.35 / 1.5 <= committed["frac_above_tau"] <= 0.35 * 1.5
    assert 0.50 / 1.5 <= committed["clipped_mass_above_tau"]
    assert committed["matched"]


def test_clopper_pearson_against_known_values():
    # closed forms at the edges: (alpha/2)^(1/n) and 1 - (alpha/2)^(1/n); the middle value from the beta quantiles
    assert ablation.clopper_pearson(0, 10) == pytest.approx((0.0, 1 - 0.025 ** 0.1), abs=1e-9)
    assert ablation.clopper_pearson(10, 10) == pytest.approx((0.025 ** 0.1, 1.0), abs=1e-9)
    assert ablation.clopper_pearson(5, 10) == pytest.approx((0.187086, 0.812914), abs=1e-6)
    low, high = ablation.clopper_pearson(3990, 4000)
    assert low < 3990 / 4000 < high and high - low < 0.01


def hand_results(final_a, final_b, curve_a, curve_b):
    runs = {}
    for arm, finals, curve in (("token", final_a, curve_a), ("none", final_b, curve_b)):
        for seed, (final, acc) in enumerate(zip(finals, curve), start=1):
            points = [[0, 0, 0.5, 400, 0.0, 30.0]] + [[s, 500 * s, a, 0, 0.0, 30.0] for s, a in zip((10, 20), acc)]
            kl = [[step, 0.1 * step, 0.3, 0.8, 0.0, 0.0, 30.0] for step in range(1, ablation.STEPS + 1)]
            runs[f"{arm}/s{seed}"] = {"arm": arm, "seed": seed, "heldout_avg": final, "curve": points, "kl": kl}
    return {"runs": runs, "base": {"1": [0.5, 400, 0.0, 30.0], "2": [0.6, 480, 0.0, 30.0]}}


def test_the_analysis_on_hand_made_results():
    results = hand_results([0.80, 0.70], [0.60, 0.66], [[0.5, 0.80], [0.4, 0.70]], [[0.7, 0.60], [0.6, 0.66]])
    table = ablation.analyze(results, problems=400)
    assert table["primary"] == "heldout_avg"  # the best final, 0.75, is below the ceiling
    assert table["stats"]["token"]["mean"] == pytest.approx(0.75)
    assert table["heldout_area"]["none"] == pytest.approx([0.65, 0.63])
    assert table["best_opsd_arm"] == "token"
    diff = table["paired_vs_best"]["heldout_avg"]["none"]
    assert diff["differences"] == pytest.approx([0.20, 0.04])
    assert diff["mean"] == pytest.approx(0.12) and diff["ci95"] == pytest.approx(12.706 * 0.08, rel=1e-3)
    assert table["stats"]["token"]["pooled_correct"] == 640 + 560
    assert table["base_heldout"]["mean"] == pytest.approx(0.55)
    assert table["kl"]["token"]["kl_mean"]["first10"] == pytest.approx(0.55)  # 0.1 x mean of 1..10
    # at a ceiling the area decides: none gets there first
    results = hand_results([0.99, 0.98], [0.99, 0.99], [[0.5, 0.99], [0.4, 0.98]], [[0.9, 0.99], [0.8, 0.99]])
    table = ablation.analyze(results, problems=400)
    assert table["primary"] == "heldout_area" and table["best_opsd_arm"] == "none"


def test_the_arms_command_lines(tmp_path):
    cmd = ablation.opsd_command("M", "T", "token-skip1", 3, 5e-3, tmp_path)
    flag = lambda name: cmd[cmd.index(name) + 1]  # noqa: E731
    assert (flag("--clip"), flag("--tau"), flag("--skip-first-tokens")) == ("token", "0.05", "1")
    assert (flag("--prompts-per-step"), flag("--max-steps"), flag("--save-every"), flag("--seed")) == \
        ("16", "100", "10", "3")
    assert (flag("--student-prompt"), flag("--context-column"), flag("--kl-window")) == ("eval", "solution", "1")
    assert "--no-student-thinking" in cmd
    cmd = ablation.opsd_command("M", "T", "entry@0.2", 1, 1e-3, tmp_path)
    assert (cmd[cmd.index("--clip") + 1], cmd[cmd.index("--tau") + 1], cmd[cmd.index("--skip-first-tokens") + 1]) \
        == ("entry", "0.2", "0")
    assert ablation.family("none-skip1") == "none" and ablation.family("token@0.2-skip1") == "token"
    assert ablation.family("grpo") == "grpo"
    args = opsd.parse_args(["--model", "M", "--dataset", "T", *cmd[cmd.index("--clip"):]])
    assert (args.clip, args.tau, args.prompts_per_step) == ("entry", 0.2, 16)


@pytest.mark.parametrize("arms", ["tokn", "token@x", "clip@0.2"])
def test_a_bad_arm_is_refused_in_one_sentence(arms, tmp_path, capsys):
    with pytest.raises(SystemExit):
        ablation.parse_args(["--output-dir", str(tmp_path), "--arms", arms])
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("ablation.py: error: --arms: ") and sum("error" in line for line in err) == 1, err


def test_the_drift_teacher_cuts_at_each_column_at_its_rate():
    rng, q, n = random.Random(5), ablation.JUMP, 4000
    counts = [0, 0, 0, 0]
    for _ in range(n):
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        text = ablation.teacher_trace(a, b, rng, jump=q)
        k = ablation.answer_shape(text)
        counts[k] += 1
        assert text.endswith(f"\\boxed{{{a + b}}}"), text
        if k < 3:  # cut short: the columns it wrote are the whole trace's first ones, then the box
            assert "so" not in text and text.count("=") == k, text
    expected = [q, (1 - q) * q, (1 - q) ** 2 * q, (1 - q) ** 3]
    for k, p in enumerate(expected):
        assert abs(counts[k] / n - p) < 4 * math.sqrt(p * (1 - p) / n), (k, counts, expected)
    # without drift the stream is the plain teacher's: its forms, drawn as the docstring says, written again here
    def plain_teacher(a, b, rng, prefer):
        columns, carry = [], 0
        for i in range(3):
            x, y = a // 10 ** i % 10, b // 10 ** i % 10
            first, second = (x, y) if rng.random() < prefer else (y, x)
            columns.append(f"{first}+{second}" + ("+1" if carry else "") + f"={x + y + carry}")
            carry = (x + y + carry) // 10
        seps = [", " if rng.random() < prefer else " " for _ in range(2)]
        return (columns[0] + seps[0] + columns[1] + seps[1] + columns[2] + (" so" if rng.random() < prefer else "")
                + f" \\boxed{{{a + b}}}")

    r1, r2, sums = random.Random(9), random.Random(9), random.Random(3)
    drawn = [(sums.randint(100, 999), sums.randint(100, 999)) for _ in range(50)]
    for a, b in [(457, 385), (999, 999), (100, 100)] + drawn:
        assert ablation.teacher_trace(a, b, r1) == plain_teacher(a, b, r2, ablation.PREFER_TEACHER), (a, b)
    texts = ("\\boxed{5}", "7+5=12, 1+2+1=4 so \\boxed{1}", "457+385=842 \\boxed{842}")
    assert [ablation.answer_shape(t) for t in texts] == [0, 2, 0]


def test_the_second_tau_goes_to_the_favoured_clip():
    table = {"primary": "heldout_avg", "best_opsd_arm": "token-skip1", "heldout_avg": {}}
    assert ablation.second_tau_arm(table) == "token@0.2-skip1"
    table = {"primary": "heldout_area", "best_opsd_arm": "none",
             "heldout_area": {"entry": [0.2, 0.4], "token": [0.5, 0.5], "entry-skip1": [0.9, 0.9]}}
    assert ablation.second_tau_arm(table) == "token@0.2"  # none is best: the better clip at none's skip (none)
    table["heldout_area"]["token"] = [0.1, 0.1]
    assert ablation.second_tau_arm(table) == "entry@0.2"


def test_the_chosen_lrs_are_the_rules_verdict_on_the_committed_selection():
    selection = json.loads((ablation.HERE / "selection" / "selection.json").read_text())
    chosen = miniature.choose_lrs(selection)
    assert {family: c["lr"] for family, c in chosen.items()} == ablation.CHOSEN_LR
    assert not any(c["extend"] for c in chosen.values())
    assert (ablation.HERE / "selection" / "selection.txt").read_text() == \
        ablation.format_selection({**selection, "chosen": chosen}) + "\n"
    for name, run in selection["runs"].items():  # each run's KL figures are its own metrics.jsonl's
        metrics = miniature.read_metrics(ablation.HERE / "selection" / "runs" / name)
        assert run["kl"] == [[m["step"], *(m.get(k) for k in ablation.KL_FIELDS)] for m in metrics], name
        assert run["curve"][-1][0] == ablation.STEPS and len(run["curve"]) == ablation.STEPS // ablation.EVERY + 1


def test_each_taus_lr_is_the_rules_verdict_on_the_committed_cross_selection():
    folder = ablation.CROSS / "selection"
    selection = json.loads((folder / "selection.json").read_text())
    cells = {}
    for name, run in selection["runs"].items():
        metrics = miniature.read_metrics(folder / "runs" / name)
        assert run["kl"] == [[m["step"], *(m.get(k) for k in ablation.KL_FIELDS)] for m in metrics], name
        dev = [p[3] for p in run["curve"]]  # dev avg@2 at steps 0, 10, ..., 100 (checked for consistency only)
        assert len(dev) == ablation.STEPS // ablation.EVERY + 1 and run["seed"] == 1
        cells.setdefault(run["arm"], {})[run["lr"]] = (dev[-1], sum(dev[1:]) / (len(dev) - 1))
    assert {arm: sorted(lrs) for arm, lrs in cells.items()} == {"token-skip1": [8e-4, 2e-3, 5e-3],
                                                                 "token@0.2-skip1": [8e-4, 2e-3, 5e-3, 1.25e-2]}
    for arm, by_lr in cells.items():  # the rule, written again: within a point of the best final, the largest area
        best = max(final for final, _ in by_lr.values())
        tied = [lr for lr, (final, _) in by_lr.items() if final >= best - 0.01 - 1e-9]
        assert max(tied, key=lambda lr: (by_lr[lr][1], -lr)) == ablation.CROSS_LR[arm], arm
    # tau 0.2's 5e-3 won at the edge of the three lrs first run, so the next grid point (x2.5) ran, and lost
    assert cells["token@0.2-skip1"][1.25e-2][0] < cells["token@0.2-skip1"][5e-3][0] - 0.01
    invocations = json.loads((folder / "invocations.json").read_text())
    assert all(i["cross_lr"] == {arm: None for arm in ablation.CROSS_ARMS} for i in invocations)  # chosen after


def test_a_loss_temperature_alone_does_not_reach_the_profile():
    sweep = json.loads((ablation.HERE / "reasoning_miniature_temperatures.json").read_text())
    ref = json.loads((miniature.DATA / "reference_step.json").read_text())
    kl, clipped, _ = ablation.position_figures(miniature.SHIPPED_MODEL, ref["rows"], 3.0, 0.05)
    assert sweep[-1]["temperature"] == 3.0 and ((kl - 0.05).abs() > NEAR_TAU * 0.05).all()
    assert sweep[-1]["clipped_mass_above_tau"] == pytest.approx(clipped[kl > 0.05].mean().item(), rel=FLOAT32_REL)
    assert sweep[-1]["frac_above_tau"] == (kl > 0.05).double().mean().item()  # a share of counts: exact
    assert all(s["frac_above_tau"] < 0.35 / 1.5 for s in sweep)  # never inside the window's share above tau
    assert sweep[0]["clipped_mass_above_tau"] > 0.95 and sweep[-1]["clipped_mass_above_tau"] < 0.5


def test_token_efficiency_interpolates_per_seed_and_threshold():
    curve = lambda accs: [[10 * k, 1000 * k, a] for k, a in enumerate(accs)]  # noqa: E731
    assert ablation.tokens_to_reach(curve([0.5, 0.6, 0.9]), 0.8) == pytest.approx(1000 + 2000 / 3)
    assert ablation.tokens_to_reach(curve([0.5, 0.6, 0.9]), 0.95) is None
    assert ablation.tokens_to_reach(curve([0.8, 0.9]), 0.7) == 0  # the base model is there already
    results = {"runs": {
        "token/s1": {"arm": "token", "seed": 1, "curve": curve([0.5, 0.9, 1.0])},
        "grpo/s1": {"arm": "grpo", "seed": 1, "curve": curve([0.5, 0.7, 0.8, 0.96])},
        "token/s2": {"arm": "token", "seed": 2, "curve": curve([0.5, 1.0])}}}
    eff = ablation.token_efficiency(results, "token")
    assert eff["seeds"] == [1]  # seed 2 has no GRPO run to pair with
    row = eff["by_threshold"]["0.8"][0]
    assert row["token"] == pytest.approx(750) and row["grpo"] == pytest.approx(2000) and row["ratio"] == \
        pytest.approx(2000 / 750)
    assert eff["by_threshold"]["0.95"][0]["grpo"] == pytest.approx(2000 + 1000 * 0.15 / 0.16)


def test_the_jump_positions_are_the_first_and_those_after_the_first_two_columns():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ablation.MODEL)
    for text, after in (("7+5=12, 5+8+1=14 4+3+1=8 so \\boxed{842}", [",", " "]),
                        ("5+7=12 8+5+1=14, 3+4+1=8 \\boxed{842}", [" ", ","])):
        ids = tok.encode(text, add_special_tokens=False)
        positions = ablation.jump_positions(tok, ids)
        assert positions[0] == 0 and len(positions) == 3
        assert [tok.decode([ids[i]]) for i in positions[1:]] == after
        assert tok.decode(ids[:positions[1]]) in ("7+5=12", "5+7=12")  # right after the first column
    profile = json.loads((ablation.HERE / "step1_profile.json").read_text())["at_jump_positions"]
    assert profile["jump_positions"] == 3 * 64  # every step-1 rollout writes its three columns


def check_recorded(folder, model_dir):
    """A committed results folder is the scorings beside it: each run's final score is its eval.py summary, regraded
    here from the samples with a plain regex, and each arm's mean final score in the table is the mean of the
    regraded scores; its eval seed, decoding and starting model are the protocol's; its KL figures are its
    metrics.jsonl; its lr is the one chosen on dev or its name's (`-lrLR`). The curves' scores at steps 10-90
    have no committed samples (ten times the size): they are checked for consistency only (the last point is the
    regraded final; the areas and the table recompute from the curves)."""
    import gzip
    import re

    results = json.loads((folder / "results.json").read_text())
    answers = [row["answer"] for row in miniature.make_task()[2]]
    fingerprint = opsd.model_fingerprint(str(model_dir))
    regraded = {}
    for key, run in results["runs"].items():
        name = ablation.run_dir(folder / "runs", run["arm"], run["seed"]).name
        scoring = folder / "runs" / f"{name}-eval"
        summary = json.loads((scoring / "summary.json").read_text())
        assert run["heldout_avg"] == summary["metrics"]["heldout"][f"avg@{ablation.EVAL_N}"], key
        config = json.loads((scoring / "config.json").read_text())
        assert config["seed"] == ablation.EVAL_SEED + run["seed"], key
        assert (config["temperature"], config["top_p"], config["max_new_tokens"], config["thinking"]) == \
            (1.0, 0.95, miniature.MAX_NEW_TOKENS, False), key
        assert config["model_fingerprint"] == fingerprint, key
        samples = [json.loads(line) for line in gzip.decompress((scoring / "samples.jsonl.gz").read_bytes())
                   .decode().splitlines()]
        assert sorted((s["problem"], s["sample"]) for s in samples) == \
            [(p, k) for p in range(len(answers)) for k in range(ablation.EVAL_N)], key
        right = 0
        for s in samples:  # the last \boxed{...} holds the answer; a \boxed that never closes holds none
            last = s["completion"].rfind("\\boxed")
            boxed = re.match(r"\\boxed\{([^{}]*)\}", s["completion"][last:]) if last >= 0 else None
            right += bool(boxed) and boxed[1].strip() == answers[s["problem"]]
        assert right == round(len(samples) * run["heldout_avg"]) == run["curve"][-1][3], key
        regraded.setdefault(run["arm"], []).append(right / len(samples))
        assert run["curve"][-1][0] == ablation.STEPS and len(run["curve"]) == ablation.STEPS // ablation.EVERY + 1
        assert run["shape"] == ablation.shapes(samples), key
        metrics = miniature.read_metrics(folder / "runs" / name)
        assert run["kl"] == [[m["step"], *(m.get(k) for k in ablation.KL_FIELDS)] for m in metrics], key
        assert len(metrics) == ablation.STEPS and run["lr"] == ablation.lr_of(run["arm"]), key
    table = ablation.analyze({"runs": results["runs"], "base": results["base"]}, len(answers))
    for arm, scores in regraded.items():
        assert table["stats"][arm]["mean"] == pytest.approx(sum(scores) / len(scores), abs=1e-12), arm
    assert json.loads(json.dumps(table)) == {k: v for k, v in results.items() if k not in ("runs", "base")}
    assert (folder / "table.txt").read_text() == ablation.format_results(table) + "\n"
    return results, table


def test_the_committed_results_are_the_scorings_beside_them():
    results, table = check_recorded(ablation.HERE / "results", ablation.MODEL)
    arms = list(ablation.ARMS)
    assert set(table["arms"]) >= set(arms)  # every protocol arm, at its seeds
    for arm in arms:
        assert table["seeds"][arm] == list(ablation.GRPO_SEEDS if arm == "grpo" else ablation.SEEDS), arm


def test_the_committed_drift_results_are_the_scorings_beside_them():
    results, table = check_recorded(ablation.HERE / "drift", ablation.DRIFT_MODEL)
    arms = [a for a in ablation.ARMS if a != "grpo"] + ["token-skip8", "token-skip16"]  # Part 3's, the clip favoured
    assert sorted(table["arms"]) == sorted(arms)
    for arm in arms:
        assert table["seeds"][arm] == [1, 2, 3], arm


def test_the_committed_cross_is_the_scorings_beside_it():
    """Part 5: every new cell's runs are the scorings beside them; cross.json and cross.txt recompute from the
    committed records (Part 2's and 4's at 2e-3, cross/'s at the other lrs); D and the verdict, by hand."""
    for folder, model_dir in (("heldout", ablation.MODEL), ("drift", ablation.DRIFT_MODEL)):
        if (ablation.CROSS / folder / "results.json").is_file():
            check_recorded(ablation.CROSS / folder, model_dir)
    result = ablation.cross_result(ablation.CROSS)
    assert json.loads(json.dumps(result)) == json.loads((ablation.CROSS / "cross.json").read_text())
    assert (ablation.CROSS / "cross.txt").read_text() == ablation.format_cross(result) + "\n"
    verdicts = []
    for part, seeds in (("held_out", [1, 2, 3, 4, 5]), ("drift", [1, 2, 3])):
        cells, primary = result[part]["cells"], result[part]["primary"]
        low = cells[f"token-skip1 lr {ablation.CROSS_LR['token-skip1']:g}"]
        high = cells[f"token@0.2-skip1 lr {ablation.CROSS_LR['token@0.2-skip1']:g}"]
        assert low["seeds"] == high["seeds"] == seeds, part
        best = max(sum(c["heldout_avg"]) / len(c["heldout_avg"]) for c in cells.values())
        assert primary == ("heldout_area" if best >= 0.95 else "heldout_avg"), part
        diffs = [h - lo for h, lo in zip(high[primary], low[primary])]
        mean = sum(diffs) / len(diffs)
        half = {5: 2.776, 3: 4.303}[len(diffs)] * math.sqrt(sum((x - mean) ** 2 for x in diffs) / (len(diffs) - 1)
                                                             / len(diffs))
        assert result[part]["D"][primary]["mean"] == pytest.approx(mean, abs=1e-12), part
        assert result[part]["D"][primary]["ci95"] == pytest.approx(half, abs=1e-12), part
        verdicts.append((mean - half > 0, mean + half < 0))
    (favours, against), (_, drift_worse) = verdicts
    want = ("tau 0.2 stays recommended" if favours and not drift_worse else
            "tau 0.05: tau 0.2 leads on held-out but is worse on the drift model" if favours else
            "tau 0.05: better here" if against else "tau 0.05: the two tie here")
    assert result["verdict"] == want
