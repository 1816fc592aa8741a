"""The released OPSD code's batch layout, rebuilt from its description on fixture.json, dumped and verified.

    python tests/verify/released_layout.py [--dump PATH]      # about 10 s on the CPU

The released code, as its departures are described (README.md, "Departures from the released recipe"), batches a
micro-batch of 4 rows on each side so: each prompt padded on the RIGHT to the micro-batch's longest prompt, the
answer after the pads (answers padded on the right to the longest answer), the attention mask on the real tokens,
no position ids (the model counts 0, 1, ... over every token, pads included), and the answers' logits sliced from
the micro-batch's longest prompt on, so that the output at index P_max - 1 + j scores answer token j. A row whose
prompt is g tokens shorter than the longest therefore has (i) its first answer position predicted at a pad, and
(ii) every answer token at a position id g higher than it was sampled at. Its loss at the recipe's setting (T 1.1
on both sides, the forward KL, each entry clipped at tau 0.05) is the mean over micro-batches of each one's
token mean. This script runs that layout through the miniature model in float32, writes it as a dump (every
tensor verify.py reads, the batches included), runs the verifier on it, and prints what each defect costs: the
first positions, the shifted positions and the loss, each against the float64 reference (fixture.json).
"""

import argparse
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import verify  # noqa: E402

SETTING, CLIP = "forward-T1.1", "entry"


def released_batch(prompts, completions, pad):
    """(B, P_max + A_max) input ids, attention mask, the position ids the model counts, the answer mask and the
    scored mask (the outputs whose logits the slice takes, one per answer token) of one side of a micro-batch."""
    width = max(map(len, prompts))
    total = width + max(map(len, completions))
    ids = torch.full((len(prompts), total), pad)
    mask = torch.zeros_like(ids)
    answer = torch.zeros_like(ids, dtype=torch.bool)
    scored = torch.zeros_like(answer)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        ids[i, :len(p)], ids[i, width:width + len(c)] = torch.tensor(p), torch.tensor(c)
        mask[i, :len(p)], mask[i, width:width + len(c)] = 1, 1
        answer[i, width:width + len(c)] = True
        scored[i, width - 1:width - 1 + len(c)] = True  # the slice from the longest prompt's last index
    positions = torch.arange(total).expand(len(prompts), total)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": positions, "answer_mask": answer,
            "scored_mask": scored}


@torch.no_grad()
def released_run(model, fixture):
    """(per-row dump tensors, the loss, the batches) of the released layout at SETTING with CLIP."""
    s = fixture["settings"][SETTING]
    rows, batches, size = fixture["rows"], {}, fixture["micro_batch_size"]
    out = {}
    for k, first in enumerate(range(0, len(rows), size)):
        group = rows[first:first + size]
        for side in verify.SIDES:
            b = released_batch([r[f"{side}_prompt_ids"] for r in group], [r["completion_ids"] for r in group],
                               model.config.pad_token_id)
            batches[(k, side)] = b
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits  # no position ids
            for i, r in enumerate(group):
                out.setdefault(first + i, {})[f"{side}_logprobs"] = torch.log_softmax(
                    logits[i][b["scored_mask"][i]] / s["temperature"], -1)
                out[first + i][f"{side}_prompt_ids"] = torch.tensor(r[f"{side}_prompt_ids"])
    for t in out.values():
        t["divergence"] = verify.divergence(t["student_logprobs"], t["teacher_logprobs"], beta=s["beta"],
                                            clip=CLIP, tau=s["tau"])
    values = [out[i]["divergence"] for i in range(len(rows))]
    return out, verify.normalised(values, "micro-batch", size), batches


def figures(ref, rows):
    """What each defect costs, against the reference: per side, the largest |delta log p| at the first answer
    position of the rows shorter than their micro-batch's longest prompt, and at their other positions; the
    loss, and the loss with one defect at a time (the reference's values elsewhere), under each normalisation."""
    T, size = ref.fixture["settings"][SETTING]["temperature"], ref.micro_batch_size
    out = {}
    for side in verify.SIDES:
        shorter = sorted(ref.shorter(side, size))
        errors = [(rows[r][f"{side}_logprobs"].double() - ref.log_probs(side, r, T)).abs().amax(-1) for r in shorter]
        others = [float(e[1:].max()) for e in errors]
        out[side] = {"rows": len(shorter), "first": max(float(e[0]) for e in errors), "others": max(others),
                     "others_smallest_row": min(others)}
    asked = verify.setting_figures(ref, ref.fixture["settings"][SETTING])[CLIP]
    ours = [rows[i]["divergence"].double() for i in range(len(ref.rows))]
    first_only = [torch.cat([o[:1], a[1:]]) for o, a in zip(ours, asked)]
    shifted_only = [torch.cat([a[:1], o[1:]]) for o, a in zip(ours, asked)]
    for name, values in (("reference", asked), ("first only", first_only), ("shifted only", shifted_only),
                         ("released", ours)):
        out[name] = {how: verify.normalised(values, how, size) for how in ("step", "micro-batch")}
    return out


def main(argv=None):
    p = argparse.ArgumentParser(prog="released_layout.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--dump", help="where to write the dump (default: a temporary file)")
    args = p.parse_args(argv)
    from transformers import AutoModelForCausalLM

    ref = verify.Reference.from_fixture()
    model = AutoModelForCausalLM.from_pretrained(verify.ROOT / ref.fixture["model"], dtype=torch.float32).eval()
    rows, loss, batches = released_run(model, ref.fixture)
    path = Path(args.dump or Path(tempfile.mkdtemp()) / "released.safetensors")
    verify.write_dump(path, setting=SETTING, clip=CLIP, rows=rows, loss=loss, normalisation="per micro-batch",
                      batches=batches)
    dump = verify.read_dump(path)
    checks = verify.verify(dump, ref)
    print(verify.report(checks, dump, path))
    f = figures(ref, rows)
    print(f"\nWhat each defect costs ({SETTING}, clip {CLIP}; each figure against the float64 reference):")
    for side in verify.SIDES:
        s = f[side]
        print(f"  {side}: the {s['rows']} rows with a shorter prompt than their micro-batch's longest: |delta log p| "
              f"up to {s['first']:.1f} at the first answer position (predicted at a pad), up to {s['others']:.1f} at "
              f"the other positions (shifted position ids; in the least shifted row, up to "
              f"{s['others_smallest_row']:.2g})")
    base = f["reference"]["step"]
    for name in ("first only", "shifted only", "released"):
        for how in ("step", "micro-batch"):
            print(f"  loss, {name:<12} ({how:<11} mean): {f[name][how]:.6f} ({f[name][how] / base - 1:+.1%} against "
                  f"the fixture's {base:.6f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
