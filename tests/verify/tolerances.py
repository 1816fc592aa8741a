"""Where verify.py's tolerances come from: a peer with left padding and no position ids, against the float64 reference.

    python tests/verify/tolerances.py               # the float32 peer (the tolerances' basis), about 15 s
    python tests/verify/tolerances.py --bf16        # the same peer in bfloat16 (what a bf16 trainer can expect)

The peer batches fixture.json's rows in its micro-batches of 4, each row's prompt and answer padded on the left to
the micro-batch's longest, and passes the model no position ids: the model then counts 0, 1, ... over the pads, so
every real token sits at a position id shifted by its row's pad count. Rotary encodings are relative, so the shift
changes nothing but rounding; that rounding is the largest a correct float32 peer shows here (the model computes its
rotary angles in float32 even when its weights are float64). It prints, over every setting and clip, the largest
error of each quantity verify.py compares, the tolerance verify.py allows it, and the margin between them.
"""

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import verify  # noqa: E402


@torch.no_grad()
def left_padded_logits(model, fixture):
    """{side: [(L_i, V) float64 logits predicting answer token j of row i]} of the peer: each micro-batch's rows
    padded on the left, the attention mask on the real tokens, no position ids."""
    rows, size, pad = fixture["rows"], fixture["micro_batch_size"], model.config.pad_token_id
    out = {side: [] for side in verify.SIDES}
    for first in range(0, len(rows), size):
        group = rows[first:first + size]
        for side in verify.SIDES:
            seqs = [r[f"{side}_prompt_ids"] + r["completion_ids"] for r in group]
            width = max(map(len, seqs))
            ids = torch.tensor([[pad] * (width - len(s)) + s for s in seqs])
            mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs])
            logits = model(input_ids=ids, attention_mask=mask).logits
            for i, r in enumerate(group):
                L = len(r["completion_ids"])
                out[side].append(logits[i, width - L - 1:width - 1].double())
    return out


def measure(ref, logits):
    """{quantity: its largest error over every setting and clip}, the peer's against the reference's."""
    worst = dict.fromkeys(("logprob", "divergence_small", "divergence_large", "loss"), 0.0)
    for name, s in ref.fixture["settings"].items():
        T = s["temperature"]
        log_p = {side: [torch.log_softmax(x / T, -1) for x in logits[side]] for side in verify.SIDES}
        for side in verify.SIDES:
            for row, lp in enumerate(log_p[side]):
                worst["logprob"] = max(worst["logprob"], float((lp - ref.log_probs(side, row, T)).abs().max()))
        for clip in verify.CLIPS:
            ours = [verify.divergence(a, b, beta=s["beta"], clip=clip, tau=s["tau"])
                    for a, b in zip(log_p["student"], log_p["teacher"])]
            theirs = [torch.tensor(r["figures"][s["figures"]][clip], dtype=torch.float64) for r in ref.rows]
            for a, b in zip(ours, theirs):
                small = b.abs() < 0.1
                if small.any():
                    worst["divergence_small"] = max(worst["divergence_small"], float((a - b)[small].abs().max()))
                if (~small).any():
                    worst["divergence_large"] = max(worst["divergence_large"],
                                                    float(((a - b) / b)[~small].abs().max()))
            loss = verify.normalised(ours, "step", ref.micro_batch_size, s["skip_first_tokens"])
            want = ref.fixture["expected"][name][clip]["loss"]
            worst["loss"] = max(worst["loss"], abs(loss - want) / abs(want))
    return worst


def main(argv=None):
    p = argparse.ArgumentParser(prog="tolerances.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--bf16", action="store_true", help="run the peer in bfloat16 (default float32)")
    args = p.parse_args(argv)
    from transformers import AutoModelForCausalLM

    ref = verify.Reference.from_fixture()
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    model = AutoModelForCausalLM.from_pretrained(verify.ROOT / ref.fixture["model"], dtype=dtype).eval()
    worst = measure(ref, left_padded_logits(model, ref.fixture))
    allowed = {"logprob": verify.TOL_LOGPROB, "divergence_small": verify.TOL_DIVERGENCE[0],
               "divergence_large": verify.TOL_DIVERGENCE[1], "loss": verify.TOL_LOSS}
    what = {"logprob": "|delta log p|, any entry at any position",
            "divergence_small": "divergence, |delta| where the value is below 0.1",
            "divergence_large": "divergence, relative delta where it is 0.1 or more",
            "loss": "loss, relative delta"}
    print(f"tolerances.py: a {dtype} peer, left padding, no position ids; fixture.json's 24 rows, every setting "
          "and clip")
    for key in worst:
        print(f"  {what[key]:<52} largest {worst[key]:.2e}  tolerance {allowed[key]:.1e}  "
              f"margin {allowed[key] / max(worst[key], 1e-300):.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
