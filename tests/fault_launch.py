"""opsd.py with one fault on rank 1 alone, for tests/test_ranks.py and tests/test_train.py (not collected by pytest):

    FAULT=oom|bug|kill|hang|early|data:PATH|output-dir:PATH|slow-final torchrun --nproc_per_node 2 tests/fault_launch.py ...

data:PATH and output-dir:PATH give rank 1 another --dataset or --output-dir (a file that is not there, a corrupt one,
a directory the other rank does not see; with output-dir every rank prints "loading the model" as it starts to); oom raises torch.OutOfMemoryError in rank 1's third step, bug a RuntimeError, kill sends
rank 1 SIGKILL there, hang SIGSTOP (a rank that neither answers nor ends); early makes rank 1 refuse before the process
group exists (as on a node whose torch is a CPU build); slow-final makes rank 0's final save take 5 s longer. Rank 1
prints "fault at <unix time> in <pid>" to stderr just before its fault."""

import os
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import opsd  # noqa: E402

kind, _, value = os.environ["FAULT"].partition(":")
if kind == "output-dir":  # every rank says when it starts loading the model: a refusal on resume comes before
    load = opsd.load_model

    def announced_load(*args, **kwargs):
        print("loading the model", file=sys.stderr, flush=True)
        return load(*args, **kwargs)
    opsd.load_model = announced_load
if kind == "slow-final" and os.environ["RANK"] == "0":
    save = opsd.save_run_state

    def slow_final_save(*args, **kwargs):
        if len(args) < 6 and "state" not in kwargs:  # final/, after the last step
            print("slow final save", file=sys.stderr, flush=True)
            time.sleep(5)
        return save(*args, **kwargs)
    opsd.save_run_state = slow_final_save
elif kind == "slow-final":
    pass
elif os.environ["RANK"] == "1":
    if kind == "early":
        def refuse_before_the_group(args):
            print(f"fault at {time.time()} in {os.getpid()}", file=sys.stderr, flush=True)
            opsd.fail("a test's refusal before the process group exists")
        opsd.init_distributed = refuse_before_the_group
    elif kind in ("data", "output-dir"):
        flag = "--dataset" if kind == "data" else "--output-dir"
        sys.argv[sys.argv.index(flag) + 1] = value
    else:
        step, calls = opsd.backward_step, []

        def faulty_step(*args, **kwargs):
            calls.append(None)
            if len(calls) == 3:
                print(f"fault at {time.time()} in {os.getpid()}", file=sys.stderr, flush=True)
                if kind == "oom":
                    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (a test's fault)")
                if kind == "bug":
                    raise RuntimeError("a test's bug")
                os.kill(os.getpid(), signal.SIGSTOP if kind == "hang" else signal.SIGKILL)
            return step(*args, **kwargs)
        opsd.backward_step = faulty_step
opsd.main()
