"""One CPU vLLM server start as the workflow makes it, phase by phase: every server output line with the seconds since
the start, the seconds until the server answers (VLLMServer.wait_ready), one greedy completion, and the stop.

The extraction server (hidden-states spec) of the tiny preset's target (TP 1) or of the Kimi-K2.5 stand-in (TP 2),
built as the suite's fixtures build them (tests/conftest.py), into WORK (kept: a second run reuses the target).
--scripts runs another checkout's workflow/scripts (an old commit: `git archive <commit> workflow config | tar -x -C
DIR`), so that two versions alternate on one machine; its server command and environment are that checkout's.

usage: .venv/bin/python bench/suite/bench_vllm_start.py WORK [--preset tiny|kimi] [--scripts DIR/workflow/scripts]
       [--lines PATTERN]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# the phases' landmarks in vLLM 0.32's output (printed with --lines)
LANDMARKS = (r"api_server\.py:24: DeprecationWarning|Initializing a V1 LLM engine|Starting to load model|Loading weights "
             r"took|Loading drafter|auxiliary layers|init engine|Supported tasks|application startup|Application startup")  # fmt: skip


def built_target(args: argparse.Namespace) -> tuple[Path, Path]:
    """The preset's target, built under the work folder once, and the preset file."""
    import conftest

    from eagle3_workflow.settings.sections import KimiShape, TinyShape
    from eagle3_workflow.settings.views import view_of, with_schema_defaults

    if args.preset == "tiny":
        from eagle3_workflow.target_build.tiny import build_tiny_target as build_target

        build, shape_type, preset = {"kind": "tiny", "arch": "llama", "num_layers": 8}, TinyShape, conftest.TINY_PRESET
    else:
        from eagle3_workflow.target_build.kimi import build_kimi_k25_target as build_target

        build = {"kind": "kimi_k25", "quantization": "none", "num_layers": 8, "hidden_size": 128}
        shape_type, preset = KimiShape, REPO / "config" / "presets" / "kimi-k25-stand-in.yaml"
    target = args.work / f"target-{args.preset}"
    if not (target / "config.json").exists():
        shape = view_of(shape_type, with_schema_defaults(target={"build": build})["target"]["build"])
        build_target(target, [conftest.TINY_DATA, conftest.SEED_PROMPTS], shape)
    return target, preset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("work", type=Path)
    parser.add_argument("--preset", choices=("tiny", "kimi"), default="tiny")
    parser.add_argument("--scripts", type=Path, default=REPO / "workflow" / "scripts")
    parser.add_argument("--lines", default=LANDMARKS, help="regex of the output lines to print (default: landmarks)")
    args = parser.parse_args()
    sys.path[:0] = [str(args.scripts.resolve()), str(REPO / "tests")]
    import conftest
    import yaml

    from eagle3_workflow.serving import engine
    from eagle3_workflow.serving import server as vllm_server
    from eagle3_workflow.settings.stages import ExtractHiddenStatesStage
    from eagle3_workflow.settings.views import view_of

    assert vllm_server.__file__.startswith(str(args.scripts.resolve())), vllm_server.__file__
    args.work.mkdir(parents=True, exist_ok=True)
    target, preset = built_target(args)
    config = yaml.safe_load(preset.read_text())
    config["data"]["sources"] = [{"path": str(conftest.TINY_DATA), "format": "sharegpt"}]
    settings = view_of(ExtractHiddenStatesStage, conftest.validated(config))
    (args.work / "scratch").mkdir(exist_ok=True)
    spec = engine.hidden_states_server_spec(settings, model=str(target), layer_ids=[2, 4, 5, 8],
                                                 storage_dir=str(args.work / "scratch"), device="cpu",
                                                 enable_render_endpoint=False)  # fmt: skip

    started, lines = time.monotonic(), []
    watch = vllm_server.VLLMServer._watch_line

    def stamped(server, line: str) -> None:
        lines.append((time.monotonic() - started, line))
        watch(server, line)

    vllm_server.VLLMServer._watch_line = stamped
    server = vllm_server.VLLMServer(spec, args.work / f"server-{time.time():.0f}.log")
    with server:
        ready_s = time.monotonic() - started
        body = {"model": "target", "prompt": "Hello there, how", "max_tokens": 8, "temperature": 0, "logprobs": 1}
        request = urllib.request.Request(f"{server.base_url}/v1/completions", data=json.dumps(body).encode(),
                                         headers=server.headers())  # fmt: skip
        with urllib.request.urlopen(request, timeout=300) as response:  # noqa: S310 - our own server on 127.0.0.1
            tokens = json.loads(response.read())["choices"][0]["logprobs"]["tokens"]
        stopping = time.monotonic()
    stop_s = time.monotonic() - stopping
    pattern = re.compile(args.lines)
    for seconds, line in lines:
        if pattern.search(line):
            print(f"{seconds:7.2f} {line[:160]}")
    print(f"preset {args.preset}, tensor_parallel_size {spec.tensor_parallel_size}, scripts {args.scripts}")
    print(f"ready after {ready_s:.2f} s; greedy completion {tokens}; stopped in {stop_s:.2f} s")


if __name__ == "__main__":
    main()
