"""opsd.py with one fault on rank 1 alone, for tests/test_ranks.py and tests/test_train.py (not collected by pytest):

    FAULT=oom|bug|kill|hang|data:PATH|output-dir:PATH|slow-final|stall:PHASE|signal:PHASE|freeze:PATH|flag:FLAGS|no-cuda|no-wandb \
        torchrun --nproc_per_node 2 tests/fault_launch.py ...

data:PATH and output-dir:PATH give rank 1 another --dataset or --output-dir (a file that is not there, a corrupt one,
a directory the other rank does not see; with output-dir every rank prints "loading the model" as it starts to); oom raises torch.OutOfMemoryError in rank 1's third step, bug a RuntimeError, kill sends
rank 1 SIGKILL there, hang SIGSTOP (a rank that neither answers nor ends); slow-final makes rank 0's final save take 5 s
longer (with no time limit on the start-up's phases). stall:PHASE makes rank 1 sleep where a real call would block: in the agreement at the start (start), in the
process group's connect (connect), in the input checks (checks), in the model's load (load) or in vLLM's start
(engine); signal:PHASE makes it SIGKILL itself there 2 s later (the host's OOM killer). freeze:PATH makes rank 1, once rank 0
waits in the start's agreement, wait at the end of the start's checks until PATH exists (the test stops node 0's agent meanwhile); flag:FLAGS gives rank 1
FLAGS more (a command line that differs on one node). no-cuda makes rank 1's torch
a CUDA build that sees no GPU; no-wandb hides wandb from rank 1: both refused before the process group exists. Rank 1
prints "fault at <unix time> in <pid>" to stderr just before its fault."""

import contextlib
import importlib.util
import os
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import opsd  # noqa: E402

kind, _, value = os.environ["FAULT"].partition(":")
if value in ("load", "engine") or kind == "hang":
    # imported before the run, so that its start-up phases stay well within the short --collective-timeout these
    # tests give (each phase's time limit); the run's own imports then find them loaded
    import transformers.models.auto.modeling_auto  # noqa: F401
if value == "engine" or kind == "hang":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    import vllm  # noqa: F401
if kind == "slow-final":  # its short --collective-timeout is for the waits after the last step, not the start-up's
    opsd.time_limit = lambda *args, **kwargs: contextlib.nullcontext()
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
    if kind in ("stall", "signal"):
        where = {"start": opsd, "connect": opsd.dist, "checks": opsd, "load": opsd, "engine": opsd}[value]
        name = {"start": "choose_device", "connect": "init_process_group", "checks": "check_model",
                "load": "load_model", "engine": "start_engine"}[value]

        def stall(*args, **kwargs):
            print(f"fault at {time.time()} in {os.getpid()}", file=sys.stderr, flush=True)
            if kind == "signal":  # the others are past their own checks by then
                time.sleep(2)
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(3600)
        setattr(where, name, stall)
    elif kind == "freeze":
        check = opsd.check_launch

        def frozen_check(args):
            # rank 0 waits in the start's agreement once its key is in the store: only then is node 0 stopped
            while not opsd.STORE.check([opsd.store_key("the start", 1, 0)]):
                time.sleep(0.1)
            print(f"fault at {time.time()} in {os.getpid()}", file=sys.stderr, flush=True)
            while not os.path.exists(value):  # the test stops node 0's agent, then makes the file
                time.sleep(0.1)
            return check(args)
        opsd.check_launch = frozen_check
    elif kind == "flag":
        print(f"fault at {time.time()} in {os.getpid()}", file=sys.stderr, flush=True)
        sys.argv += value.split()
    elif kind == "no-cuda":
        print(f"fault at {time.time()} in {os.getpid()}", file=sys.stderr, flush=True)
        torch.version.cuda = "13.0"  # a CUDA build, and no GPU visible: is_available() is False here
    elif kind == "no-wandb":
        print(f"fault at {time.time()} in {os.getpid()}", file=sys.stderr, flush=True)
        find_spec = importlib.util.find_spec
        importlib.util.find_spec = lambda name, *args: None if name == "wandb" else find_spec(name, *args)
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
