"""Write tests/verify/fixture.json: 24 rollouts of the miniature model, their prompts in a peer's terms, and
per answer position the divergence at several settings, computed in float64 (verify.py's reference).

    python tests/verify/make_fixture.py            # samples with opsd.py's vLLM engine on the CPU (~1 minute)

The rows are problems of tests/miniature/train.jsonl, in forms chosen so that within every micro-batch of four
consecutive rows the prompts' lengths differ on both sides, and the rows shorter than their micro-batch's
longest are not the same on the two sides (a peer's padding defect shows on either, and says which).
"""

import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path[:0] = [str(ROOT), str(HERE)]

import opsd  # noqa: E402  (its prompt strings and chat rendering; its vLLM engine and sampler)
import verify  # noqa: E402  (the float64 reference)

MODEL = ROOT / "tests" / "miniature" / "model"
PROBLEMS = ROOT / "tests" / "miniature" / "train.jsonl"
SEED = 52
MICRO_BATCH_SIZE = 4
MAX_NEW_TOKENS = 48
TAU = 0.05

# The settings a peer can be checked at: opsd.py's flags, and the per-position figures each uses
SETTINGS = {
    "forward-T1.1": {"beta": 0.0, "temperature": 1.1, "tau": TAU, "skip_first_tokens": 0},
    "forward-T1.1-skip1": {"beta": 0.0, "temperature": 1.1, "tau": TAU, "skip_first_tokens": 1},
    "forward-T1.0": {"beta": 0.0, "temperature": 1.0, "tau": TAU, "skip_first_tokens": 0},
    "jsd0.5-T1.0": {"beta": 0.5, "temperature": 1.0, "tau": TAU, "skip_first_tokens": 0},
    "reverse-T1.0": {"beta": 1.0, "temperature": 1.0, "tau": TAU, "skip_first_tokens": 0},
}

# How each row's problem is written (from a training problem a+b) and what its teacher is shown
FORMS = {
    "plain": lambda a, b: (f"{a}+{b}", a, b),
    "two-digit": lambda a, b: (f"{a % 100}+{b}", a % 100, b),
    "four-digit": lambda a, b: (f"{a + 1000}+{b}", a + 1000, b),
    "spaced": lambda a, b: (f"{a} + {b}", a, b),
    "question": lambda a, b: (f"What is {a}+{b}?", a, b),
}
CONTEXTS = {
    "terse": lambda a, b: f"{a}+{b}={a + b}",  # the miniature's reference
    "answer": lambda a, b: f"\\boxed{{{a + b}}}",  # its final answer alone (opsd.py --teacher-context answer)
}
# (form, context, digits of the sum) of each row; each line one micro-batch. Student prompt lengths (tokens):
# two-digit 43, plain 44, four-digit 45, spaced 46, question 51; teacher prompts 145 to 158.
LAYOUT = [
    ("plain", "terse", 4), ("two-digit", "terse", 3), ("spaced", "answer", 3), ("plain", "terse", 3),
    ("question", "answer", 3), ("four-digit", "terse", 4), ("two-digit", "answer", 3), ("plain", "answer", 4),
    ("two-digit", "terse", 3), ("plain", "terse", 4), ("four-digit", "answer", 4), ("spaced", "terse", 3),
    ("plain", "answer", 3), ("question", "terse", 4), ("spaced", "answer", 4), ("two-digit", "terse", 3),
    ("four-digit", "terse", 4), ("plain", "terse", 3), ("question", "answer", 3), ("spaced", "terse", 4),
    ("spaced", "answer", 3), ("plain", "terse", 4), ("two-digit", "terse", 3), ("plain", "terse", 3),
]
STUDENT_TEMPLATE = {"add_generation_prompt": True, "enable_thinking": False}
TEACHER_TEMPLATE = {"add_generation_prompt": True, "enable_thinking": True}


def problems():
    """[(problem, reference, kind)] of LAYOUT: each slot takes the next training problem whose sum, in the
    slot's form, has the slot's number of digits (and, for the two-digit form, whose a % 100 has two)."""
    train = [json.loads(line) for line in PROBLEMS.read_text().splitlines()]
    pairs = iter([tuple(map(int, r["problem"].split("+"))) for r in train])
    out = []
    for form, context, digits in LAYOUT:
        for a, b in pairs:
            problem, x, y = FORMS[form](a, b)
            if len(str(x + y)) == digits and x >= 10:  # a two-digit a % 100 has two digits
                out.append((problem, CONTEXTS[context](x, y), f"{form}, {context}"))
                break
    return out


def render(tok, message, template):
    chat = [{"role": "user", "content": message}]
    return tok.apply_chat_template(chat, tokenize=False, **template)


def sample(prompts):
    """Completions (token ids) of the student prompts: opsd.py's engine and sampler, its defaults (temperature
    1.1, top_p 0.95, top_k 20), one seed a row."""
    import os

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    args = opsd.parse_args(["--model", str(MODEL), "--dataset", "unused", "--device", "cpu", "--dtype", "float32",
                            "--max-new-tokens", str(MAX_NEW_TOKENS), "--max-prompt-length", "256",
                            "--prompts-per-step", str(len(prompts)), "--seed", str(SEED)])
    llm = opsd.start_engine(args, torch.device("cpu"))
    completions, _ = opsd.sample(llm, prompts, [SEED * 1000 + i for i in range(len(prompts))], args)
    opsd.stop_engine(llm)
    return completions


def expected_figures(ref, settings):
    """{setting: {clip: {loss, loss_per_micro_batch, loss_per_answer}, kl_mean, kl_first_token}} in float64."""
    out = {}
    for name, s in settings.items():
        figures = verify.setting_figures(ref, s)
        kl = ref.divergences(beta=0.0, temperature=s["temperature"], clip="none", tau=s["tau"])
        skip = s["skip_first_tokens"]
        out[name] = {c: {"loss": verify.normalised(figures[c], "step", MICRO_BATCH_SIZE, skip),
                         "loss_per_micro_batch": verify.normalised(figures[c], "micro-batch", MICRO_BATCH_SIZE, skip),
                         "loss_per_answer": verify.normalised(figures[c], "answer", MICRO_BATCH_SIZE, skip)}
                     for c in verify.CLIPS}
        out[name]["kl_mean"] = float(torch.cat(kl).mean())
        out[name]["kl_first_token"] = float(torch.stack([k[0] for k in kl]).mean())
    return out


ABOUT = {
    "what": "One optimizer step of OPSD on tests/miniature/model (student and teacher both the unchanged model: "
            "LoRA B = 0, teacher LoRA off), for checking another implementation: each row's problem, reference, "
            "prompts and sampled answer, and per answer position the divergence at each setting. Made by "
            "tests/verify/make_fixture.py; checked by tests/verify/verify.py (tests/verify/README.md).",
    "prompts": "The student sees eval.py's prompt (opsd.py --student-prompt eval, '{problem}\\n\\nPlease reason "
               "step by step, ...'), thinking off; the teacher sees opsd.py's teacher prompt (the problem, the "
               "reference between its markers, the transition, the instruction), thinking on. Each is the "
               "model's chat template applied to one user message with the row's *_template flags; the "
               "*_prompt_ids are the rendered string tokenized without special tokens added.",
    "positions": "Answer token j of a row (completion_ids[j]) is predicted by the output at the token before "
                 "it: the prompt's last token for j = 0. Position ids count each row's real tokens from 0. "
                 "figures[setting][clip][j] is that position's loss term.",
    "divergence": "At a setting's temperature T, log p_S and log p_T are the log-softmax of the student's and "
                  "the teacher's logits / T (T on both). Per vocabulary entry v: beta 0: d_v = p_T(v) (log "
                  "p_T(v) - log p_S(v)) (forward KL); beta 1: d_v = p_S(v) (log p_S(v) - log p_T(v)) (reverse "
                  "KL); else d_v = beta p_T(v) log(p_T(v)/m(v)) + (1 - beta) p_S(v) log(p_S(v)/m(v)), m = beta "
                  "p_T + (1 - beta) p_S.",
    "clips": {"none": "sum_v d_v, unclipped: a peer with no clip compares with this",
              "entry": "sum_v min(d_v, tau): each entry clipped before the sum (the released recipe's clip)",
              "token": "min(sum_v d_v, tau): the position's sum clipped (opsd.py --clip token)"},
    "loss": "loss = the sum of the per-position terms over every answer position of the step (less the first "
            "skip_first_tokens of each answer) / the number of those positions: one normalisation over the "
            "whole step, whatever the micro-batches. loss_per_micro_batch and loss_per_answer are what two "
            "other normalisations give (the mean of each micro-batch's token mean, micro-batches of 4 "
            "consecutive rows; the mean of each answer's token mean), for comparison; they are not opsd.py's.",
    "diagnostics": "kl_mean: the mean over every answer position of the unclipped forward KL at the setting's "
                   "temperature (figures of forward settings, clip none); kl_first_token: its mean over the "
                   "first answer positions.",
    "float64": "Every figure is computed in float64, each row alone (no padding), from the model's float32 "
               "weights; opsd.py's float32 functions reproduce them to 1e-5 relative on sums "
               "(tests/test_verify.py).",
}


def main():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    rows = []
    for i, (problem, reference, kind) in enumerate(problems()):
        student_message, teacher_message = opsd.student_message(problem, "eval"), opsd.teacher_message(problem, reference)
        student_prompt = render(tok, student_message, STUDENT_TEMPLATE)
        teacher_prompt = render(tok, teacher_message, TEACHER_TEMPLATE)
        rows.append({
            "row": i, "micro_batch": i // MICRO_BATCH_SIZE, "kind": kind, "problem": problem,
            "reference": reference, "student_message": student_message, "teacher_message": teacher_message,
            "student_template": STUDENT_TEMPLATE, "teacher_template": TEACHER_TEMPLATE,
            "student_prompt": student_prompt, "teacher_prompt": teacher_prompt,
            "student_prompt_ids": tok.encode(student_prompt, add_special_tokens=False),
            "teacher_prompt_ids": tok.encode(teacher_prompt, add_special_tokens=False)})
    completions = sample([r["student_prompt_ids"] for r in rows])
    for r, c in zip(rows, completions):
        r["completion"], r["completion_ids"] = tok.decode(c), c
    ref = verify.Reference(rows, MODEL, MICRO_BATCH_SIZE)
    for name, s in SETTINGS.items():
        if s["skip_first_tokens"]:
            continue  # its per-position terms are those of the same setting without the skip
        figures = verify.setting_figures(ref, s)
        for i, r in enumerate(rows):
            r.setdefault("figures", {})[name] = {c: figures[c][i].tolist() for c in verify.CLIPS}
    settings = {name: {**s, "figures": name.removesuffix("-skip1")} for name, s in SETTINGS.items()}
    lengths = {side: [[len(r[f"{side}_prompt_ids"]) for r in rows[k:k + MICRO_BATCH_SIZE]]
                      for k in range(0, len(rows), MICRO_BATCH_SIZE)] for side in verify.SIDES}
    header = {
        "about": ABOUT, "model": "tests/miniature/model",
        "model_sha256_16": verify.sha16(MODEL / "model.safetensors"),
        "sampling": f"opsd.py's vLLM engine and sampler (tests/verify/make_fixture.py): temperature 1.1, top_p "
                    f"0.95, top_k 20, at most {MAX_NEW_TOKENS} new tokens, seed {SEED} * 1000 + row",
        "micro_batch_size": MICRO_BATCH_SIZE,
        "micro_batches": f"consecutive rows in {MICRO_BATCH_SIZE}s: rows 0-3, 4-7, ...; the prompt lengths "
                         "differ within each on both sides",
        "prompt_lengths": lengths,
        "shorter_than_longest": {side: sorted(ref.shorter(side, MICRO_BATCH_SIZE)) for side in verify.SIDES},
        "positions": sum(ref.lengths), "settings": settings,
        "expected": expected_figures(ref, SETTINGS)}
    # one row per line: the file stays readable and its diffs small
    text = json.dumps(header, indent=1)[:-2] + ',\n "rows": [\n' + ",\n".join(json.dumps(r) for r in rows)
    (HERE / "fixture.json").write_text(text + "\n ]\n}\n")
    print(json.dumps(header["expected"]["forward-T1.1"], indent=1))
    print(f"{len(rows)} rows, {header['positions']} positions -> {HERE / 'fixture.json'}")


if __name__ == "__main__":
    main()
