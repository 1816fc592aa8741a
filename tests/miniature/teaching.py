"""Where the teacher disagrees: the per-token KL that opsd.py logs with each answer in rollouts.jsonl, drawn.

    python tests/miniature/teaching.py --run runs/quickstart --output-dir tests/miniature/quickstart/teaching

From any opsd.py run on the miniature's addition task (the quickstart's, a clip ablation run, ...) with its
rollouts.jsonl and final/ adapter, it takes the first answer logged at step 1 that drops a carry (a column whose
carry-in it leaves out: `5+8=13` where `5+8+1=14` was due; its tokens are the `=` and the sum), each token with its
logged KL(p_T || p_S); answers the
same problem with the trained student (greedy, the run's own prompt) and computes each of its tokens' KL with
opsd.backward_step, the function the run trained with; and averages the logged KL by answer position over the
answers of step 1 and of the last logged step. It writes teaching.json (every number the figure draws) and
teaching.png. Before it uses the step-1 KL it recomputes it from the starting model the same way: the log is
checked, not trusted.
"""

import argparse
import json
import re
import sys
from argparse import Namespace
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent.parent)]

import opsd  # noqa: E402

COLUMN = re.compile(r"([0-9])\+([0-9])(\+1)?=([0-9]{1,2})")


def dropped_carries(text):
    """(start, end) character spans of each column that leaves out a carry-in the column before it made: its `=`,
    where `+1` was due, and the sum it writes, which the missing carry makes wrong."""
    columns = list(COLUMN.finditer(text.split("\\boxed")[0]))
    return [(col.start(4) - 1, col.end(4)) for before, col in zip(columns, columns[1:])
            if int(before.group(4)) >= 10 and not col.group(3)]


def token_texts(tokenizer, ids):
    """Each token's own text (the miniature's tokenizer writes every digit and sign as its own token)."""
    return [tokenizer.decode([i]) for i in ids]


def position_of(texts, offset):
    """The index of the token holding character `offset` of "".join(texts)."""
    end = 0
    for i, text in enumerate(texts):
        end += len(text)
        if offset < end:
            return i
    raise ValueError(f"offset {offset} beyond the answer's {end} characters")


def answer_kl(model, lora_params, prompts, completion, args, pad_id):
    """Each completion token's KL(p_T || p_S) at the loss temperature, computed as the run's loss step does."""
    loss_kw = dict(beta=args.beta, temperature=args.loss_temperature, clip=args.clip, tau=args.tau,
                   chunk_size=args.loss_chunk_size)
    _, stats = opsd.backward_step(model, lora_params, [prompts[0]], [prompts[1]], [completion], pad_id=pad_id,
                                  micro_batch_size=1, teacher=args.teacher, skip_first_tokens=args.skip_first_tokens,
                                  **loss_kw)
    model.zero_grad(set_to_none=True)
    return stats.kl.tolist()


def mean_by_position(rows):
    """[mean logged KL at answer position j over the answers at least j + 1 long, for each j]."""
    longest = max(len(r["kl"]) for r in rows)
    return [sum(r["kl"][j] for r in rows if len(r["kl"]) > j) / sum(len(r["kl"]) > j for r in rows)
            for j in range(longest)]


def build_record(run):
    run = Path(run)
    needed = [run / "args.json", run / "rollouts.jsonl", run / "final" / opsd.ADAPTER_WEIGHTS]
    if not all(path.is_file() for path in needed):
        raise SystemExit(f"--run {run}: needs {', '.join(str(p.relative_to(run)) for p in needed)}, as a finished "
                         "opsd.py run leaves them (with --log-rollouts-every above 0).")
    args = Namespace(**{k: v for k, v in json.loads((run / "args.json").read_text()).items() if k != "fingerprint"})
    logged = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    if not logged or "kl" not in logged[0]:
        raise SystemExit(f"{run}/rollouts.jsonl holds no per-token KL: it was written before opsd.py logged it.")
    first = [r for r in logged if r["step"] == 1]
    last_step = max(r["step"] for r in logged)
    tokenizer, prompts = opsd.load_prompts(args)
    rows = opsd.load_rows(args.dataset, args.dataset_split, args.problem_column, args.context_column, args.data_select)
    if len(rows) != len(prompts):
        raise SystemExit(f"{run}: some prompts were longer than --max-prompt-length: prompt_index is not a row number.")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    chosen = next((r for r in first if dropped_carries(r["completion"])), None)
    if chosen is None:
        raise SystemExit(f"{run}: no answer logged at step 1 drops a carry.")
    model, lora_params = opsd.load_model(args, torch.device("cpu"))  # LoRA B = 0: the student of step 1
    prompt = prompts[chosen["prompt_index"]]
    again = answer_kl(model, lora_params, prompt, chosen["token_ids"], args, pad_id)
    if max(abs(a - b) for a, b in zip(again, chosen["kl"])) > 1e-4 + 1e-3 * max(chosen["kl"]):
        raise SystemExit(f"{run}: the logged step-1 KL does not match its recomputation from the starting model.")
    opsd.load_adapter(model, run / "final")
    model.eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt[0]]), max_new_tokens=args.max_new_tokens, do_sample=False,
                             pad_token_id=pad_id)
    trained_ids = out[0, len(prompt[0]):].tolist()
    if tokenizer.eos_token_id in trained_ids:
        trained_ids = trained_ids[:trained_ids.index(tokenizer.eos_token_id) + 1]
    model.train()
    trained_kl = answer_kl(model, lora_params, prompt, trained_ids, args, pad_id)
    texts = token_texts(tokenizer, chosen["token_ids"])
    drops = sorted({position_of(texts, k) for start, end in dropped_carries(chosen["completion"])
                    for k in range(start, end)})
    peak = max(range(len(chosen["kl"])), key=chosen["kl"].__getitem__)
    return {
        "run": str(run), "step": 1, "prompt_index": chosen["prompt_index"],
        "problem": rows[chosen["prompt_index"]][0], "reference": rows[chosen["prompt_index"]][1],
        "answer": {"tokens": texts, "token_ids": chosen["token_ids"], "kl": chosen["kl"],
                   "skipped_by_loss": chosen["skipped_by_loss"], "dropped_carry_tokens": drops, "peak_token": peak,
                   "recomputed_max_abs_difference": max(abs(a - b) for a, b in zip(again, chosen["kl"]))},
        "trained": {"adapter": str(run / "final"), "decoding": "greedy", "tokens": token_texts(tokenizer, trained_ids),
                    "token_ids": trained_ids, "kl": trained_kl, "max_kl": max(trained_kl)},
        "mean_kl_by_position": {str(step): mean_by_position([r for r in logged if r["step"] == step])
                                for step in (1, last_step)},
        "answers": {str(step): sum(r["step"] == step for r in logged) for step in (1, last_step)},
        "dropping_a_carry_at_step_1": sum(bool(dropped_carries(r["completion"])) for r in first),
    }


def label(token):
    """A token as the figure writes it: a space as "_", the end of the answer as "end"."""
    return "end" if token.startswith("<|") else token if token.strip() else "_"


def draw(record, path=None):
    """The figure, from the record alone; returns it (tests read back what it drew)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    fig, axes = plt.subplots(3, 1, figsize=(10, 5.6), gridspec_kw={"height_ratios": [1, 1, 2.4]})
    norm = LogNorm(vmin=1e-4, vmax=max(max(record["answer"]["kl"]), 1e-3))
    strips = (("step 1, the starting student", record["answer"]),
              (f"the same problem after training ({record['trained']['decoding']})", record["trained"]))
    for ax, (title, answer) in zip(axes[:2], strips):
        kl = [max(v, 1e-4) for v in answer["kl"]]
        image = ax.imshow([kl], cmap="Reds", norm=norm, aspect="auto")
        for j, (text, value) in enumerate(zip(answer["tokens"], kl)):  # white on the darkest cells; "_" a space
            ax.text(j, 0, label(text), ha="center", va="center", fontsize=8, color="white" if value > 0.3 else "black")
        for j in answer.get("dropped_carry_tokens", []):
            ax.add_patch(plt.Rectangle((j - 0.5, -0.5), 1, 1, fill=False, edgecolor="black", linewidth=1.5))
        ax.set_yticks([])
        ax.set_xticks([])
        ax.set_title(f"{title}: {record['problem']}, max KL {max(answer['kl']):.3g}", fontsize=9, loc="left")
    fig.colorbar(image, ax=axes[:2], label="KL(p_T || p_S) per token", pad=0.01)
    for step, means in record["mean_kl_by_position"].items():
        axes[2].plot(range(len(means)), means, marker=".", label=f"step {step} ({record['answers'][step]} answers)")
    axes[2].set_yscale("log")
    axes[2].set_xlabel("answer position (token)")
    axes[2].set_ylabel("mean KL at the position\n(answers at least that long)")
    axes[2].legend(fontsize=8)
    fig.suptitle("where the teacher, shown the sum, disagrees with the student (boxed: a dropped carry)", fontsize=10)
    if path:
        fig.savefig(path, dpi=100)
    return fig


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="an opsd.py run directory (rollouts.jsonl, args.json, final/)")
    p.add_argument("--output-dir", required=True)
    a = p.parse_args(argv)
    out = Path(a.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    record = build_record(a.run)
    (out / "teaching.json").write_text(json.dumps(record, indent=1) + "\n")
    draw(record, out / "teaching.png")
    answer = record["answer"]
    print(f"{record['problem']}: step-1 peak KL {max(answer['kl']):.3f} at token {answer['peak_token']} "
          f"(dropped carry at {answer['dropped_carry_tokens']}); after training max KL {record['trained']['max_kl']:.2g}"
          f" -> {out / 'teaching.json'}")


if __name__ == "__main__":
    main()
