"""One tiny CPU training as the suite runs it (tests/integration/test_training_trainer.py's inputs, the train_draft
stage in this process), phase by phase: each trainer process's seconds since the stage started at its landmarks
(interpreter up, the imports of torch, transformers and speculators' trainer, the distributed set-up, the draft's
build, the data loaders, each epoch, each checkpoint save, the collection and the tear-down after training, exit),
the full garbage collections each process made and their seconds, and under torchrun (--processes 2) the agent's
own start and exit. The stage's wall time last.

The landmarks come from a sitecustomize.py put on the trainer's PYTHONPATH (it wraps speculators' functions with
functools.wraps, so the entry's API checks still see their signatures): the trainer's command and environment are
the stage's own. --scripts runs another checkout's workflow/scripts (`git archive <commit> workflow | tar -x -C
DIR`), so that two versions alternate on one machine. WORK keeps the target and the inputs for the next run.

usage: .venv/bin/python bench/suite/bench_trainer_start.py WORK [--processes 1|2] [--repeats 1]
       [--scripts DIR/workflow/scripts]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROBE = r"""
import atexit, gc, os, time
_cmd = open("/proc/self/cmdline", "rb").read().split(b"\0")
_T0, _OUT = os.environ.get("BENCH_TRAINER_T0"), os.environ.get("BENCH_TRAINER_OUT")
_agent = b"torch.distributed.run" in _cmd
if _T0 and _OUT and (_agent or b"eagle3_workflow.trainer.entry" in _cmd):
    _who = "agent" if _agent else "rank " + os.environ.get("RANK", "-")

    def mark(what):
        with open(_OUT, "a") as out:
            out.write(f"{time.time() - float(_T0):8.3f}  {_who:7}  {what}\n")

    mark("interpreter up")
    _gc = {"n": 0, "s": 0.0}

    def _collected(phase, info):
        if info["generation"] == 2:
            if phase == "start":
                _gc["t"] = time.perf_counter()
            else:
                _gc["n"] += 1
                _gc["s"] += time.perf_counter() - _gc["t"]

    gc.callbacks.append(_collected)
    atexit.register(lambda: mark(f"atexit ({_gc['n']} full collections, {_gc['s']:.3f} s)"))
    if not _agent:
        import functools
        import torch
        mark("import torch")
        import transformers
        mark("import transformers")
        import speculators.train.cli as cli
        mark("import speculators.train.cli")
        import speculators.train.trainer as trainer

        def wrap(owner, name):
            original = getattr(owner, name)

            @functools.wraps(original)
            def timed(*args, **kwargs):
                mark(f"{name} start")
                result = original(*args, **kwargs)
                mark(f"{name} end")
                return result

            setattr(owner, name, timed)

        for name in ("set_seed", "build_draft_model", "create_train_val_loaders", "maybe_destroy_distributed"):
            wrap(cli, name)
        for name in ("__init__", "run_training", "train_epoch", "val_epoch", "maybe_save_checkpoint"):
            wrap(trainer.Trainer, name)
        import eagle3_workflow.trainer.cpu_shim as shim
        _on_cpu = shim.distributed_on_cpu
        shim.distributed_on_cpu = lambda setup: (lambda *a, **k: (mark("maybe_setup_distributed start"),
                                                  _on_cpu(setup)(*a, **k), mark("maybe_setup_distributed end")))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("work", type=Path)
    parser.add_argument("--processes", type=int, default=1, help="train.cpu_processes (2: torchrun, gloo)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--scripts", type=Path, default=REPO / "workflow" / "scripts")
    args = parser.parse_args()
    sys.path[:0] = [str(args.scripts.resolve()), str(REPO / "tests"), str(REPO / "tests" / "integration")]
    import conftest
    from test_training_trainer import make_train_inputs
    from tiny_training import TRAIN

    import eagle3_workflow.training.stage as stage
    from eagle3_workflow.settings.sections import TinyShape
    from eagle3_workflow.settings.views import view_of, with_schema_defaults
    from eagle3_workflow.target_build.tiny import build_tiny_target

    assert stage.__file__.startswith(str(args.scripts.resolve())), stage.__file__
    work = args.work.resolve()
    target = work / "target"
    if not (target / "config.json").exists():
        build = {"kind": "tiny", "arch": "llama", "num_layers": 8}
        shape = view_of(TinyShape, with_schema_defaults(target={"build": build})["target"]["build"])
        build_tiny_target(target, [conftest.TINY_DATA, conftest.SEED_PROMPTS], shape)
    inputs_dir = work / "inputs"
    if not (inputs_dir / "validation.json").exists():
        inputs = make_train_inputs(lambda arch="llama", num_layers=8: target, inputs_dir)
    else:
        inputs = {"target": target} | {k: inputs_dir / v for k, v in (
            ("prepared", "prepared"), ("token_freq", "token_freq.pt"), ("files_dir", "files"),
            ("api_compat", "api_compat.json"), ("validation", "validation.json"))}  # fmt: skip
    probe = work / "probe"
    probe.mkdir(exist_ok=True)
    (probe / "sitecustomize.py").write_text(PROBE)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(probe), os.environ.get("PYTHONPATH", "")) if p)
    settings = conftest.train_settings({**TRAIN, "cpu_processes": args.processes})
    for repeat in range(args.repeats):
        run = work / f"run-{repeat}"
        shutil.rmtree(run, ignore_errors=True)
        run.mkdir()
        marks = run / "marks.txt"
        os.environ["BENCH_TRAINER_OUT"] = str(marks)
        started = time.time()
        os.environ["BENCH_TRAINER_T0"] = repr(started)
        stage.train_draft(settings, **inputs, work_dir=run / "train_work", out_dir=run / "draft",
                          trust_remote_code=False, cpu_threads=2)  # fmt: skip
        wall = time.time() - started
        lines = sorted(marks.read_text().splitlines(), key=lambda line: float(line.split()[0]))
        print(f"--- run {repeat + 1}/{args.repeats}, {args.processes} trainer process(es), {args.scripts}")
        print("\n".join(lines))
        print(f"{wall:8.3f}  stage    train_draft returned")


if __name__ == "__main__":
    main()
