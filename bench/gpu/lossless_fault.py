"""On the GPU machine, after evaluate_draft ran: does the lossless check still catch a wrong acceptance there?

Takes the stage's own lossless process spec (<run>/eval/work/measure_<i>.spec.json, the batch-invariant one on
CUDA), keeps the trained-draft engine only, and runs it again with the fault plugin EAGLE3_FAULT=accept_any_draft
(tests/fault_plugins: vLLM's verification accepts every draft token). The output is judged with the stage's own
functions against the reference the stage measured (eval/work/runs/no_speculation.lossless.json). Exit 0 when
the check FAILS the faulty run, as it must; 1 when the fault went unnoticed; 2 when it could not run.

    python3 bench/gpu/lossless_fault.py results/<run> --out fault.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "workflow" / "scripts"))

from eagle3_workflow.evaluation.launch import measurement_environment, run_measurement_process  # noqa: E402
from eagle3_workflow.evaluation.lossless import compare_greedy, non_argmax_gaps, non_argmax_steps  # noqa: E402
from eagle3_workflow.evaluation.protocol import MeasurementSpec, RunResult  # noqa: E402
from eagle3_workflow.files.artefacts import load  # noqa: E402
from eagle3_workflow.serving.engine import cpu_engine_environment  # noqa: E402


def lossless_spec(work: Path) -> MeasurementSpec:
    """The stage's spec whose runs ran the lossless pass (the batch-invariant process on CUDA)."""
    for path in sorted(work.glob("measure_*.spec.json")):
        spec = load(MeasurementSpec, path)
        if any(r.lossless_pass and r.label == "trained" for r in spec.runs):
            return spec
    raise SystemExit(f"no lossless measurement spec with the trained draft under {work}")


def absolute_paths(spec: MeasurementSpec, *, workdir: Path) -> MeasurementSpec:
    """The spec with its model paths absolute. evaluate_draft writes them so (MeasurementSpec); a spec of an older
    run may name them relative to the workflow's working directory (results/<run>/.. /..), which vLLM read as a
    hub repo id from anywhere else (HFValidationError)."""

    def absolute(path: str) -> str:
        return path if Path(path).is_absolute() else str(workdir / path)

    engine = spec.engine | {"model": absolute(spec.engine["model"])}
    runs = [
        run.model_copy(
            update={"speculative_config": run.speculative_config | {"model": absolute(run.speculative_config["model"])}}
        )
        if run.speculative_config and "model" in run.speculative_config
        else run
        for run in spec.runs
    ]
    return spec.model_copy(update={"engine": engine, "runs": runs})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="results/<run> of a finished evaluate_draft")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    run_dir = args.run_dir.resolve()
    work = run_dir / "eval" / "work"
    spec = absolute_paths(lossless_spec(work), workdir=run_dir.parents[1])
    fault_dir = work / "fault"
    trained = next(r for r in spec.runs if r.label == "trained" and r.lossless_pass)
    run = trained.model_copy(update={"result_path": str(fault_dir / "trained.accept_any_draft.json"), "key": "",
                                     "timing_pass": False})  # fmt: skip
    # the lossless kernels of the stage's own run on CUDA (the spec of an older run may lack the field)
    spec = spec.model_copy(update={"runs": [run], "batch_invariant": args.device == "cuda"})
    plugins = str(REPO / "tests" / "fault_plugins")
    os.environ["EAGLE3_FAULT"] = "accept_any_draft"
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [plugins, os.environ.get("PYTHONPATH")]))
    tensor_parallel = int(spec.engine["tensor_parallel_size"])  # every engine spec holds it (offline_engine_kwargs)
    env = measurement_environment(device=args.device, cpu_threads=None, in_process=tensor_parallel == 1)
    if args.device == "cpu":  # as the stage's CPU lossless pass runs (evaluation.plan.plan_environment)
        env |= cpu_engine_environment("cpu", tensor_parallel, None) | {"VLLM_CPU_ATTN_SPLIT_KV": "0"}
    result, wall_s = run_measurement_process(spec, fault_dir, "fault", env=env, log_path=fault_dir / "fault.log",
                                             timeout_s=900)  # fmt: skip
    faulty = result.runs[0]
    runs = work / "runs"
    reference_path = next(p for p in (runs / "no_speculation.lossless.json", runs / "no_speculation.both.json")
                          if p.exists())  # fmt: skip
    reference = load(RunResult, reference_path)
    mismatches = compare_greedy((reference.outputs, reference.top_logits), (faulty.outputs, faulty.top_logits),
                                origins=[str(i) for i in range(len(reference.outputs))], dtype="bfloat16",
                                tie_steps=0)  # fmt: skip
    wrong = non_argmax_steps(faulty.outputs, faulty.top_logits, "bfloat16")
    # the margin: how far below its step's argmax the worst-placed wrongly accepted token lies, in bf16 steps
    gaps = [gap[-1] for gap in non_argmax_gaps(faulty.outputs, faulty.top_logits, "bfloat16")]
    # the stage's reference on CPU: the untrained draft's run (both one prompt at a time), where it exists
    untrained_path = next((p for p in (runs / "untrained.lossless.json", runs / "untrained.both.json") if p.exists()),
                          None)  # fmt: skip
    from_untrained = None
    if untrained_path is not None:
        untrained = load(RunResult, untrained_path)
        from_untrained = len(compare_greedy((untrained.outputs, untrained.top_logits),
                                            (faulty.outputs, faulty.top_logits),
                                            origins=[str(i) for i in range(len(untrained.outputs))], dtype="bfloat16",
                                            tie_steps=0))  # fmt: skip
    caught = bool(wrong) or bool(mismatches)
    summary = {
        "fault": "accept_any_draft",
        "kernels": faulty.numerics,
        "prompts": len(reference.outputs),
        "prompts_diverging": len(mismatches),
        "prompts_diverging_from_untrained": from_untrained,
        "non_argmax_tokens": len(wrong),
        "non_argmax_min_gap_steps": min(gaps, default=None),
        "non_argmax_examples": wrong[:5],
        "caught": caught,
        "wall_s": round(wall_s, 1),
    }
    args.out.write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return 0 if caught else 1


if __name__ == "__main__":
    sys.exit(main())
