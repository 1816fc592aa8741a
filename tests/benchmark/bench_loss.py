"""Peak extra memory and time of opsd_loss (chunked) against the released recipe's naive loss.

    python tests/benchmark/bench_loss.py [--repeats 3] [--chunk-size 32]

Not collected by pytest. Real sizes of the loss head (Qwen3 vocabulary 151,936, bf16 hidden
states and lm_head), a small hidden size (256) so it runs on a CPU, 2 x 512 completion tokens,
forward and backward. Each variant runs in its own process; its peak resident memory above the
inputs is read from the kernel (VmHWM after resetting it through /proc/self/clear_refs), so the
number counts every allocation torch makes (see main() for the allocator settings). Times are
taken in one process, the variants alternating, and the ratio is the median of the per-repeat
ratios, so load from other processes hits both alike. The chunked loss runs as in training: with
its diagnostics (unclipped KL, clipped mass, sampled-token log-prob) computed in the same pass, from
the loss's own log-softmaxes; a third variant, "recompute", has the diagnostics compute both again.
Prints the three measurements, `chunked/naive: memory ratio R1, time ratio R2` and, last,
`chunked/recompute: ...` (the same values to the bit, asserted).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import opsd  # noqa: E402
from opsd import opsd_loss  # noqa: E402

REUSED_STATS = opsd.divergence_stats


def recomputed_stats(student_logits, log_s, log_t, targets, terms, in_loss, *, tau):
    """The diagnostics computing both full-vocabulary log-softmaxes again, as opsd.py did before it passed the loss's
    own to them: the "recompute" variant's baseline (a log-softmax of a log-softmax is the same, at the same cost)."""
    return REUSED_STATS(student_logits, log_s.log_softmax(-1), log_t.log_softmax(-1), targets, terms, in_loss,
                        tau=tau)

V, H, B, T_LEN = 151_936, 256, 2, 512
TEMPERATURE, TAU = 1.1, 0.05


def rss_kib(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak():
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS


def naive_loss(hs, ht, W, mask):
    # The released recipe: full bf16 logits, float32 log-softmax, per-entry clip, mean over tokens.
    student_logits = hs @ W.T  # (B, T, V) bf16
    with torch.no_grad():
        teacher_logits = ht @ W.T  # (B, T, V) bf16
    log_s = torch.log_softmax(student_logits.float() / TEMPERATURE, -1)
    log_t = torch.log_softmax(teacher_logits.float() / TEMPERATURE, -1)
    d = (log_t.exp() * (log_t - log_s)).clamp(max=TAU)
    return d.sum(-1)[mask].sum() / mask.sum()


def make_inputs():
    torch.manual_seed(0)
    hs = torch.randn(B, T_LEN, H, dtype=torch.bfloat16, requires_grad=True)
    ht = torch.randn(B, T_LEN, H, dtype=torch.bfloat16)
    W = (torch.randn(V, H) * 0.05).bfloat16()
    mask = torch.ones(B, T_LEN, dtype=torch.bool)
    return hs, ht, W, mask


def step(variant, inputs, chunk_size):
    """One forward and backward; returns (loss, seconds)."""
    hs, ht, W, mask = inputs
    hs.grad = None
    t0 = time.perf_counter()
    opsd.divergence_stats = recomputed_stats if variant == "recompute" else REUSED_STATS
    if variant == "naive":
        loss = naive_loss(hs, ht, W, mask)
    else:
        targets = torch.zeros(int(mask.sum()), dtype=torch.long)  # the diagnostics run as in training
        loss, _ = opsd_loss(hs, mask, ht, mask, W, int(mask.sum()), targets, chunk_size=chunk_size,
                            temperature=TEMPERATURE, clip="entry", tau=TAU)
    loss.backward()
    return loss.item(), time.perf_counter() - t0


def alternating_times(repeats, chunk_size):
    inputs = make_inputs()
    times = {"naive": [], "chunked": [], "recompute": []}
    for _ in range(repeats + 1):  # the first round warms both up and is dropped
        for variant in times:
            times[variant].append(step(variant, inputs, chunk_size)[1])
    return {variant: t[1:] for variant, t in times.items()}


def peak_memory_child(variant, chunk_size):
    inputs = make_inputs()
    reset_peak()
    base = rss_kib("VmRSS")
    loss, _ = step(variant, inputs, chunk_size)
    return {"loss": loss, "peak_extra_mib": (rss_kib("VmHWM") - base) / 1024}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per variant (median reported)")
    parser.add_argument("--chunk-size", type=int, default=32, help="positions per chunk in opsd_loss")
    parser.add_argument("--child", choices=["naive", "chunked", "recompute", "time"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "time":
        print(json.dumps(alternating_times(args.repeats, args.chunk_size)))
        return
    if args.child:
        print(json.dumps(peak_memory_child(args.child, args.chunk_size)))
        return

    # A CPU has no caching allocator, and glibc's choices would otherwise decide the result: if it reuses
    # freed heap blocks, RSS keeps fragmentation (it grows past the live tensors); if it maps every large
    # block afresh, each one is page-faulted in again and the time measures the kernel. So both variants
    # are measured alike, each number under the policy that shows what it claims to: memory with every
    # block above 4 MiB mapped separately (RSS then follows the live tensors, as a GPU allocator's peak
    # does), time with freed blocks up to 32 MiB reused and never trimmed (as a caching allocator does).
    memory_env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(4 << 20))
    time_env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(32 << 20), MALLOC_TRIM_THRESHOLD_=str(1 << 30))

    def child(mode, env):
        cmd = [sys.executable, __file__, "--child", mode, "--repeats", str(args.repeats), "--chunk-size", str(args.chunk_size)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
        return json.loads(out.strip().splitlines()[-1])

    memory = {variant: child(variant, memory_env) for variant in ("naive", "chunked", "recompute")}
    times = child("time", time_env)
    for variant in ("naive", "chunked", "recompute"):
        print(f"{variant:8s} loss {memory[variant]['loss']:.6f}  peak extra memory "
              f"{memory[variant]['peak_extra_mib']:8.1f} MiB  time fwd+bwd {statistics.median(times[variant]):.3f} s")
    # both variants use the same bf16 matmul, so the values agree to float32 rounding
    print(f"loss difference {abs(memory['naive']['loss'] - memory['chunked']['loss']):.2e}")
    time_ratio = statistics.median(c / n for n, c in zip(times["naive"], times["chunked"]))
    print(f"chunked/naive: memory ratio {memory['chunked']['peak_extra_mib'] / memory['naive']['peak_extra_mib']:.3f}, "
          f"time ratio {time_ratio:.3f}")
    # the diagnostics reading the loss's log-softmaxes against computing them again: the same values, less time
    assert memory["chunked"]["loss"] == memory["recompute"]["loss"]
    reuse_ratio = statistics.median(c / r for r, c in zip(times["recompute"], times["chunked"]))
    memory_ratio = memory["chunked"]["peak_extra_mib"] / memory["recompute"]["peak_extra_mib"]
    print(f"chunked/recompute: memory ratio {memory_ratio:.3f}, time ratio {reuse_ratio:.3f}")


if __name__ == "__main__":
    main()
