"""Byte-compile the part of the CPU environment that the workflow's processes import, not all of it (issue #45).

    .venv/bin/python envs/compile_working_set.py            # run by envs/setup_cpu.sh after uv installed the lock

About a third of site-packages' 22,100 modules (the packages' test suites left out) is ever imported by a run:
7,800 after a tiny `make demo` and `make test-fast` (2026-12-06). Compiling every file took 32 of the 56 CPU-seconds
of `make setup` on the quiet VM, and creating its .pyc files much of the kernel's time on a slow day. The set is
found, not listed: two processes import what the workflow's processes import, each writing the .pyc of every
module it loads (whatever PYTHONDONTWRITEBYTECODE says: setup is the one time it is paid); then every file in a
directory they loaded a module from is compiled, on every core (an engine that starts loads more of vLLM's,
torch's and transformers' directories than their imports do). 9,165 files in all, 2026-12-06. A module outside the
set compiles on its first import, as Python always does, and its .pyc is written then; where
PYTHONDONTWRITEBYTECODE is set, it compiles again on every import (a tiny extraction server's start loads 47
such modules). The packages' own test suites (tests/ and test/ folders) are never compiled.

The two processes:
- the vLLM side: torch, vLLM, the modules an OpenAI server, its EngineCore and a CPU worker load, and vLLM's
  model-info cache. vLLM inspects each model class once per installed version and caches the answer in
  ~/.cache/vllm/modelinfos: the tiny run's first server and its first EAGLE-3 engine paid 24 s and 10 s of `make
  demo` for it (2026-12-02). It inspects in a subprocess of its own (to keep CUDA out of the server's process), one
  more import of vLLM per class; this process, which has nothing to keep CUDA out of, is that subprocess for all
  three. A failure of the cache only costs the first run that time again.
- the rest: Snakemake, pandas, matplotlib, pytest, speculators' trainer, and every module of the workflow's package
  (what its stages import at their top), those without torch first, so that the vLLM side has compiled torch by the
  time this one needs it. A workflow module that fails to import is reported and skipped (its stage will say why).
An entry point missing from a later version (a renamed vLLM module) is reported and skipped: it only costs the
first run the compiling of what it would have loaded. vLLM, torch, speculators and Snakemake must import: setup
fails otherwise.
"""

from __future__ import annotations

import compileall
import functools
import importlib
import importlib.metadata
import importlib.util
import json
import re
import subprocess
import sys
import sysconfig
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = ("torch", "vllm", "speculators", "snakemake")
VLLM_SIDE = (
    "torch",
    "vllm",
    # the OpenAI server: its routers (imported when the app is built), the HTTP and websocket protocols and the
    # lifespan uvicorn picks when it starts, the metrics middleware
    "vllm.entrypoints.openai.api_server",
    "vllm.entrypoints.launchers.api_server.entry",
    "vllm.entrypoints.serve",
    "vllm.entrypoints.openai.models.api_router",
    "vllm.entrypoints.generate.api_router",
    "vllm.entrypoints.generate.structured_decisions.api_router",
    "vllm.entrypoints.serve.sagemaker.api_router",
    "model_hosting_container_standards.sagemaker",
    "vllm.entrypoints.scale_out.factories",
    "uvicorn.protocols.http.httptools_impl",
    "uvicorn.protocols.websockets.websockets_sansio_impl",
    "uvicorn.lifespan.on",
    "prometheus_fastapi_instrumentator",
    # the engine: the offline one (evaluation, regeneration) and the server's EngineCore, its CPU worker and model
    # runner, attention, EAGLE proposer, model loader and the quantization configs it reads
    "vllm.entrypoints.llm",
    "vllm.v1.engine.core",
    "vllm.v1.engine.async_llm",
    "vllm.v1.executor.uniproc_executor",
    "vllm.v1.worker.cpu_worker",
    "vllm.v1.worker.cpu_model_runner",
    "vllm.v1.attention.backends.cpu_attn",
    "vllm.v1.spec_decode.eagle",
    "vllm.model_executor.model_loader",
    "compressed_tensors",
)
REST = (
    "snakemake",
    "snakemake.cli",
    "pandas",
    "matplotlib.pyplot",
    "datasets",
    "jsonschema",
    "pytest",
    "speculators",
    "speculators.train.cli",
    "eagle3_workflow",
)
MODEL_CLASSES = ("LlamaForCausalLM", "ExtractHiddenStatesModel", "Eagle3LlamaForCausalLM")


def is_test_suite(path: Path, site_packages: Path) -> bool:
    """A file of a package's own test suite (a tests/ or test/ folder below site-packages)."""
    return bool(re.search(r"(^|/)tests?/", path.relative_to(site_packages).parent.as_posix() + "/"))


def loaded_files(modules: Iterable[object], site_packages: Path) -> set[Path]:
    """The source files, below site-packages, of the modules given (sys.modules' values)."""
    files = set()
    for module in modules:
        name = getattr(module, "__file__", None)
        if name and name.endswith(".py"):
            path = Path(name).resolve()
            if path.is_relative_to(site_packages):
                files.add(path)
    return files


def beside(loaded: Iterable[Path], site_packages: Path) -> list[Path]:
    """Every .py file in the directories the loaded files are in (not below them), the test suites left out."""
    folders = {path.parent for path in loaded}
    return sorted(path for folder in folders for path in folder.glob("*.py") if not is_test_suite(path, site_packages))


def import_all(names: Iterable[str], required: Iterable[str]) -> None:
    """Import each module; a required one that fails ends the process, another is reported and skipped."""
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as e:
            if name in required:
                raise
            print(f"setup: {name} not imported ({e!r}): its modules compile on first use", flush=True)


def import_walk(package: str) -> None:
    """Import every module of a package (the workflow's: what its stages import at their top)."""
    import pkgutil

    import_all([package], ())
    if package in sys.modules:
        names = pkgutil.walk_packages(sys.modules[package].__path__, f"{package}.")
        import_all((info.name for info in names), ())


def cache_model_info() -> None:
    """vLLM's model-info cache for the classes the workflow runs, inspected in this process (module docstring)."""
    import logging

    try:
        from vllm.model_executor.models import registry

        registry._run_in_subprocess = lambda inspect: inspect()
        logging.disable(logging.WARNING)  # what the inspection notes of each class, vLLM's subprocess kept to itself
        found = [registry.ModelRegistry._try_inspect_model_cls(arch) for arch in MODEL_CLASSES]
        logging.disable(logging.NOTSET)
        print(
            "setup: vLLM model info cached for",
            ", ".join(a for a, i in zip(MODEL_CLASSES, found, strict=True) if i is not None),
        )
    except Exception as e:  # noqa: BLE001 - whatever failed, it only costs the first run the inspection
        print("setup: vLLM's model-info cache not prepared (the first run pays it):", repr(e))


def run_side(side: str, out: Path) -> None:
    """One importing process: import its side, write the list of site-packages files it loaded to `out`."""
    sys.dont_write_bytecode = False  # this process writes the .pyc of what it imports, whatever the environment says
    site_packages = Path(sysconfig.get_paths()["purelib"]).resolve()
    if side == "vllm":
        import_all(VLLM_SIDE, REQUIRED)
        import torch
        import vllm

        print("setup: torch", torch.__version__, "vllm", vllm.__version__, flush=True)
        cache_model_info()
    else:
        sys.path.insert(0, str(ROOT / "workflow" / "scripts"))
        import_all((name for name in REST if name != "eagle3_workflow"), REQUIRED)
        import_walk("eagle3_workflow")
        print("setup: speculators", importlib.metadata.version("speculators"), flush=True)
    out.write_text(json.dumps(sorted(str(p) for p in loaded_files(list(sys.modules.values()), site_packages))))


def compile_beside(loaded: Iterable[Path], site_packages: Path) -> int:
    """Compile, on every core, the files beside the loaded ones that have no .pyc yet; how many there were."""
    todo = [str(p) for p in beside(loaded, site_packages) if not Path(importlib.util.cache_from_source(p)).exists()]
    if todo:
        # quiet=2: a file that does not compile (a package's Python 2 example) is skipped, as pip would; its import,
        # if any, reports it
        with ProcessPoolExecutor() as pool:
            list(pool.map(functools.partial(compileall.compile_file, quiet=2), todo, chunksize=32))
    return len(todo)


def main() -> int:
    if len(sys.argv) == 3:  # one importing process (below)
        run_side(sys.argv[1], Path(sys.argv[2]))
        return 0
    import tempfile

    site_packages = Path(sysconfig.get_paths()["purelib"]).resolve()
    with tempfile.TemporaryDirectory() as folder:
        outs = {side: Path(folder) / f"{side}.json" for side in ("vllm", "rest")}
        sides = {side: subprocess.Popen([sys.executable, __file__, side, str(out)]) for side, out in outs.items()}
        failed = [side for side, proc in sides.items() if proc.wait() != 0]
        if failed:
            print(
                f"setup: the {' and '.join(failed)} side's imports failed (the traceback above names the module): "
                "the environment does not import; rebuild it (rm -rf .venv && make setup), or, after a change to "
                "envs/requirements-cpu.txt, re-lock (rm envs/constraints-cpu.txt && make setup)",
                file=sys.stderr,
            )
            return 1
        loaded = {Path(p) for out in outs.values() for p in json.loads(out.read_text())}
    compiled = compile_beside(loaded, site_packages)
    print(f"setup: byte-compiled {len(loaded)} modules imported and {compiled} beside them")
    return 0


if __name__ == "__main__":
    sys.exit(main())
