"""The one process runtime with real processes: children die with their stage (even on SIGKILL; the report's nested
Snakemake too), a stop signal is one line and exit 143, a hung engine is a failure, a server that fails at start is
quoted and not waited for, a worker (runtime.worker) takes its typed spec and gives back its typed result or its
traceback, and a full disk (a tmpfs of the test's own) neither silences a child nor buries a stage's message.
The pure parts (log prefixes, first_traceback, the progress watch): tests/unit/test_runtime.py."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from conftest import REGENERATE_SETTINGS, REPO, fill_up, tiny_settings, wait_until

from eagle3_workflow.files.writing import write_text_atomic
from eagle3_workflow.runtime.child import BUSY_MARKER, PROGRESS_MARKER, ChildFailure, ChildProcess, ProgressWatch

SCRIPTS = REPO / "workflow" / "scripts"


# ---------------------------------------------------------------- helpers: process trees, read from /proc


def _serving(**vllm):
    """A serving stage's settings on the tiny preset (CPU), with `vllm` overrides."""
    from eagle3_workflow.settings.stages import ServingStage

    return tiny_settings(ServingStage, vllm=vllm)


def _stat(pid: int) -> tuple[str, int] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(errors="replace")
    except OSError:
        return None
    state, parent = stat.rsplit(")", 1)[1].split()[:2]
    return state, int(parent)


def tree(root: int) -> set[int]:
    """root and every live descendant."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (found := _stat(int(entry))) and found[0] != "Z":
            parents[int(entry)] = found[1]
    found, frontier = {root}, {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier}
        found |= frontier
    return found


def alive(pids: set[int]) -> set[int]:
    return {pid for pid in pids if (found := _stat(pid)) and found[0] != "Z"}


class Stage:
    """A stage-like process started by the test, its output collected line by line."""

    def __init__(self, source: str, env: dict[str, str] | None = None):
        full_env = dict(os.environ if env is None else env)
        full_env["PYTHONPATH"] = os.pathsep.join([str(SCRIPTS), full_env.get("PYTHONPATH", "")])
        self.proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(source)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=full_env,
        )
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, text: str, timeout_s: float) -> None:
        wait_until(lambda: any(text in line for line in self.lines) or self.proc.poll() is not None, timeout_s, text)
        assert any(text in line for line in self.lines), "\n".join(self.lines[-60:])

    def kill_and_expect_no_orphans(self, at_least: int) -> None:
        pids = tree(self.proc.pid)
        assert len(pids) >= at_least, f"expected a tree of >= {at_least} processes, found {pids}"
        self.proc.kill()
        self.proc.wait()
        wait_until(lambda: not alive(pids), 60, f"the stage's tree {sorted(pids)} to end after SIGKILL")


# ---------------------------------------------------------------- ChildProcess, with plain processes (fast)

SPAWN_TREE = """
import os, subprocess, sys, time
plain = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
escaped = subprocess.Popen([sys.executable, "-c", "import os, time; os.setsid(); time.sleep(600)"])
print("tree up", plain.pid, escaped.pid, flush=True)
time.sleep(600)
"""


def test_a_sigkilled_stage_takes_its_whole_child_tree_with_it(tmp_path):
    """Grandchildren too, even one that left the process group (setsid): nothing is adopted by PID 1."""
    stage = Stage(f"""
        import sys, time
        from eagle3_workflow.runtime.child import ChildProcess
        child = ChildProcess([sys.executable, "-c", {SPAWN_TREE!r}], name="tree", log_path={str(tmp_path / "log")!r})
        child.start()
        while not any(line.startswith("tree up") for line in child.head):
            time.sleep(0.05)
        print("stage ready", flush=True)
        time.sleep(600)
    """)
    stage.wait_for("stage ready", 60)
    stage.kill_and_expect_no_orphans(at_least=5)  # stage, launcher, command, two grandchildren


def test_stragglers_die_when_the_command_exits_and_stop_does_not_wait(tmp_path, caplog):
    command = "import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); print(p.pid, flush=True)"  # noqa: E501
    child = ChildProcess([sys.executable, "-c", command], name="leaves a worker", log_path=tmp_path / "log")
    with child:
        assert child.wait() == 0
        worker = int(child.head[0])
        assert not alive({worker})  # the launcher killed the worker its command left behind
    assert "did not stop" not in caplog.text
    assert (tmp_path / "log").read_text().strip() == str(worker)


def test_a_killed_launcher_leaves_nothing_holding_the_output(tmp_path):
    """Someone SIGKILLs the launcher itself (a `pkill -f` matching the command line): the command's children
    in its group are killed when the stage reads the failure, not left holding the output pipe. (A process
    that also left the group, with its launcher killed, is out of reach: see launcher.py.)"""
    worker = "import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); print('tree up', p.pid, flush=True); time.sleep(600)"  # noqa: E501
    child = ChildProcess([sys.executable, "-c", worker], name="tree", stop_grace_s=30)
    with child:
        wait_until(lambda: any(line.startswith("tree up") for line in child.head), 60, "the tree")
        plain = int(child.head[0].split()[2])
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait() == -signal.SIGKILL
        assert child._reader is not None
        assert not child._reader.is_alive()  # the pipe closed: nothing holds it
        wait_until(lambda: not alive({plain}), 60, "the orphaned worker to be killed")


def test_a_child_killed_by_a_signal_reports_it_and_failures_quote_the_traceback(tmp_path):
    child = ChildProcess([sys.executable, "-c", "import os; os.kill(os.getpid(), 15)"], name="c")
    with child:
        assert child.wait() == -signal.SIGTERM
    source = "import sys; print('ERROR 12-01 04:38:56 [x.py:1] Traceback (most recent call last):'); 1/0"
    child = ChildProcess([sys.executable, "-c", source], name="c", prefix="[c] ", log_path=tmp_path / "log")
    with child:
        assert child.wait() == 1
    text = child.failure_text("it failed")
    assert text.startswith("it failed\n")
    assert "ZeroDivisionError: division by zero" in text
    assert "[c] Traceback" in (tmp_path / "log").read_text()


def test_no_progress_while_busy_fails_with_the_stall_message():
    """The child stops itself (SIGSTOP) after two finished items: alive, not answering."""
    source = (f"import os, signal; print({BUSY_MARKER!r}); print({PROGRESS_MARKER!r}); print({PROGRESS_MARKER!r}); "
              "print('last words', flush=True); os.kill(os.getpid(), signal.SIGSTOP)")  # fmt: skip
    child = ChildProcess([sys.executable, "-c", source], name="engine", progress=ProgressWatch(floor_s=2))
    with child, pytest.raises(ChildFailure) as failure:
        child.wait()
    message = str(failure.value)
    assert "no progress for" in message
    assert "engine alive but not answering" in message
    assert "last words" in message
    assert "@@eagle3" not in message  # markers stay out of logs and quotes


# ---------------------------------------------------------------- runtime.worker: spec in, typed result out (fast)

TOY_PROTOCOL = """
from eagle3_workflow.files.artefacts import Artefact

class Question(Artefact):
    numbers: list[int]
    stop_after: int | None = None  # SIGSTOP itself after that many numbers: alive, not answering

class Answer(Artefact):
    total: int
"""

TOY_WORKER = """
import os, signal
from toy_protocol import Answer, Question
from eagle3_workflow.settings.errors import StageError
from eagle3_workflow.runtime.worker import report_busy, report_progress, serve

def add(question):
    report_busy()
    for done, _ in enumerate(question.numbers):
        if done == question.stop_after:
            os.kill(os.getpid(), signal.SIGSTOP)
        report_progress()
    if not question.numbers:
        raise StageError("nothing to add: give numbers")
    print("added", len(question.numbers), "numbers", flush=True)
    return Answer(total=sum(question.numbers))

def prepare():
    print("prepared before the spec", flush=True)

if __name__ == "__main__":
    serve(Question, add, name="toy worker", prepare=prepare)
"""


@pytest.fixture(scope="module")
def toy_worker(tmp_path_factory):
    """A worker module and its protocol, importable here and in the child; the Job that runs it."""
    from eagle3_workflow.runtime import child_environment
    from eagle3_workflow.runtime.worker import Job

    folder = tmp_path_factory.mktemp("toy")
    (folder / "toy_protocol.py").write_text(TOY_PROTOCOL)
    (folder / "toy_worker.py").write_text(TOY_WORKER)
    env = child_environment()
    env["PYTHONPATH"] = os.pathsep.join([str(folder), env["PYTHONPATH"]])
    sys.path.insert(0, str(folder))
    import toy_protocol

    yield toy_protocol, Job(name="the toy worker", env=env, log_path=folder / "toy.log", prefix="[toy] ")
    sys.path.remove(str(folder))


def test_a_worker_reads_its_spec_and_returns_a_typed_result(toy_worker, tmp_path):
    from eagle3_workflow.runtime.worker import WorkerFiles, run_worker

    protocol, job = toy_worker
    files = WorkerFiles.in_folder(tmp_path, "sum")
    finished = run_worker("toy_worker", protocol.Question(numbers=[1, 2, 3]), protocol.Answer, files=files, job=job)
    assert finished.result == protocol.Answer(total=6)
    assert finished.wall_s > 0
    assert json.loads(files.spec.read_text()) == {"numbers": [1, 2, 3], "stop_after": None}
    log = Path(job.log_path).read_text()
    assert "[toy] added 3 numbers" in log
    assert "@@eagle3" not in log  # progress markers are for the watch only


def test_a_failing_worker_is_a_stage_error_quoting_its_traceback(toy_worker, tmp_path):
    from eagle3_workflow.runtime.worker import WorkerFiles, run_worker
    from eagle3_workflow.settings.errors import StageError

    protocol, job = toy_worker
    files = WorkerFiles.in_folder(tmp_path, "empty")
    files.result.write_text('{"total": 99}')  # an earlier attempt's: never read as this run's
    with pytest.raises(StageError) as failure:
        run_worker("toy_worker", protocol.Question(numbers=[]), protocol.Answer, files=files, job=job)
    message = str(failure.value)
    assert message.startswith("the toy worker exited with code 1\n")
    quoted = message.split("first traceback in the output of the toy worker:\n", 1)[1].split("\nlast ", 1)[0]
    assert quoted.splitlines()[-1] == "eagle3_workflow.settings.errors.StageError: nothing to add: give numbers", quoted
    assert not files.result.exists()


def test_a_worker_started_before_its_spec_prepares_waits_then_answers(toy_worker, tmp_path):
    """start_worker: the worker runs its prepare while the spec does not exist yet (an earlier attempt's spec is
    removed first, never taken), then answers the spec finish() gives it."""
    from eagle3_workflow.runtime.worker import WorkerFiles, start_worker

    protocol, job = toy_worker
    job = dataclasses.replace(job, log_path=tmp_path / "early.log")
    files = WorkerFiles.in_folder(tmp_path, "early")
    files.spec.write_text('{"numbers": []}')  # an earlier attempt's: it would fail
    with start_worker("toy_worker", files=files, job=job) as worker:
        wait_until(
            lambda: any("prepared before the spec" in line for line in worker.child.output()),
            300,
            "the worker's prepare",
        )
        assert not files.spec.exists() and worker.child.poll() is None, "it waits for its spec"
        finished = worker.finish(protocol.Question(numbers=[4, 5]), protocol.Answer)
    assert finished.result == protocol.Answer(total=9)
    log = job.log_path.read_text()
    assert log.index("prepared before the spec") < log.index("added 2 numbers")


def test_a_worker_started_before_its_spec_and_never_given_one_is_stopped(toy_worker, tmp_path):
    from eagle3_workflow.runtime.worker import WorkerFiles, start_worker

    protocol, job = toy_worker
    files = WorkerFiles.in_folder(tmp_path, "unused")
    with start_worker("toy_worker", files=files, job=job) as worker:
        wait_until(
            lambda: any("prepared before the spec" in line for line in worker.child.output()),
            300,
            "the worker's prepare",
        )
        processes = tree(worker.child.pid)
        assert len(processes) == 2, "the launcher and the worker"
    assert worker.child.poll() is not None
    assert not alive(processes)
    assert not files.result.exists()


def test_a_worker_that_stops_answering_fails_as_stalled(toy_worker, tmp_path):
    """The watch's keys are the Job's: stall_timeout_s (and its factor) with requests in flight."""
    from eagle3_workflow.runtime.child import ChildFailure
    from eagle3_workflow.runtime.worker import Watch, WorkerFiles, run_worker

    protocol, job = toy_worker
    stalling = dataclasses.replace(job, watch=Watch(stall_timeout_s=2))
    spec = protocol.Question(numbers=[1, 2, 3], stop_after=2)
    with pytest.raises(ChildFailure) as failure:
        run_worker("toy_worker", spec, protocol.Answer, files=WorkerFiles.in_folder(tmp_path, "s"), job=stalling)
    assert "the toy worker: no progress for" in str(failure.value)


STAGE_WITH_A_CHILD = """
import logging, sys
from eagle3_workflow.runtime.child import ChildProcess
from eagle3_workflow.runtime.stage import run_stage

def body(log):
    with ChildProcess([sys.executable, "-c", {tree!r}], name="tree", on_line=lambda line: log.info("| %s", line)) as c:
        c.wait()

run_stage("demo", {log!r}, body)
"""


def test_sigterm_to_a_stage_is_one_line_exit_143_and_stops_its_children(tmp_path):
    log_path = tmp_path / "stage.log"
    stage = Stage(STAGE_WITH_A_CHILD.format(tree=SPAWN_TREE, log=str(log_path)))
    stage.wait_for("tree up", 60)
    pids = tree(stage.proc.pid)
    stage.proc.send_signal(signal.SIGTERM)
    assert stage.proc.wait(timeout=60) == 143
    log = log_path.read_text()
    assert "stage demo stopped by SIGTERM; the rerun resumes" in log
    assert "Traceback" not in log
    assert "FAILED" not in log
    assert "SystemExit" not in log
    assert len([line for line in log.splitlines() if "SIGTERM" in line]) == 1
    wait_until(lambda: not alive(pids), 60, "the stage's children to end")


# a stage whose SIGTERM lands inside an asyncio callback (the extraction client's socket writes): asyncio logs and
# drops any BaseException raised there except SystemExit and KeyboardInterrupt
SIGTERM_IN_A_CALLBACK = """
import asyncio, os, signal
from eagle3_workflow.runtime.stage import run_stage
async def main():
    asyncio.get_running_loop().call_soon(os.kill, os.getpid(), signal.SIGTERM)
    await asyncio.sleep(2)
    print("the body ran on after the signal", flush=True)
run_stage("demo", {log!r}, lambda log: asyncio.run(main()))
"""

# a body whose catch-all swallows the stop: the stage still exits as stopped
SIGTERM_SWALLOWED = """
import os, signal, time
from eagle3_workflow.runtime.stage import run_stage
def body(log):
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    except BaseException:
        log.info("swallowed")
run_stage("demo", {log!r}, body)
"""


@pytest.mark.parametrize("script", [SIGTERM_IN_A_CALLBACK, SIGTERM_SWALLOWED], ids=["asyncio-callback", "swallowed"])
def test_a_stop_signal_cannot_be_swallowed_on_its_way_up(tmp_path, script):
    log_path = tmp_path / "stage.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SCRIPTS), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", script.format(log=str(log_path))], capture_output=True, text=True,
                          timeout=60, env=env)  # fmt: skip
    assert proc.returncode == 143, proc.stdout + proc.stderr
    assert "the body ran on" not in proc.stdout
    assert "stage demo stopped by SIGTERM; the rerun resumes" in log_path.read_text()


# ---------------------------------------------------------------- the report's nested Snakemake

# a Snakefile that never finishes parsing: the nested `snakemake --report` stays up until it is killed
HANGING_SNAKEFILE = """
import pathlib, time
pathlib.Path({parsed!r}).touch()
time.sleep(600)
"""


def _command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_a_sigkilled_report_stage_leaves_no_nested_snakemake(tmp_path):
    """Rule `report` runs `snakemake --report` on the workflow: SIGKILL of the stage (a cancelled job, a lost node)
    must take the nested Snakemake with it, as it takes a vLLM server."""
    snakefile, parsed = tmp_path / "Snakefile", tmp_path / "parsed"
    snakefile.write_text(HANGING_SNAKEFILE.format(parsed=str(parsed)))
    stage = Stage(f"""
        from pathlib import Path
        from eagle3_workflow.report.stage import build_report
        from eagle3_workflow.runtime.stage import run_stage
        log_path = {str(tmp_path / "report.log")!r}
        run_stage("report", log_path, lambda log: build_report({str(snakefile)!r}, {{"run": "t"}},
                  Path({str(tmp_path / "report.html")!r}), Path({str(tmp_path / "work")!r}), log_path))
    """)
    pids: set[int] = set()
    try:
        wait_until(parsed.exists, 120, "the nested snakemake to parse its Snakefile")
        pids = tree(stage.proc.pid)
        assert any(" -m snakemake -s " in _command_line(pid) for pid in pids), [_command_line(p) for p in pids]
        stage.kill_and_expect_no_orphans(at_least=3)  # stage, launcher, nested snakemake
    finally:  # before the fix the nested Snakemake outlived the stage: leave nothing running
        stage.proc.kill()
        for pid in alive(pids):
            os.kill(pid, signal.SIGKILL)


# ---------------------------------------------------------------- a full disk (a tmpfs of the test's own)


def test_a_child_whose_log_is_on_a_full_disk_is_still_read_to_its_end(small_disk, caplog):
    """The rule's log cannot be written: the output is still read (a child blocked on a full pipe looks hung; the
    reader thread once died at the first failed write), watched, kept for failure messages, and said once."""
    fill_up(small_disk / "another_jobs_file")
    lines = "for i in range(5000): print('line', i, 'x' * 80)\nprint('last line', flush=True)"
    child = ChildProcess([sys.executable, "-c", lines], name="talker", log_path=small_disk / "rule.log", timeout_s=300)
    with child:
        assert child.wait() == 0  # before the fix: blocked on its pipe until the hang guard (timeout_s)
    assert child.tail[-1] == "last line"
    assert child.line_count == 5001
    assert len([r for r in caplog.records if "cannot write the output of talker" in r.getMessage()]) == 1


FAILING_STAGE = """
from eagle3_workflow.settings.errors import StageError
from eagle3_workflow.runtime.stage import run_stage
def body(log):
    for i in range(50):
        log.info("working %d", i)
    raise StageError("the cause, and the fix")
run_stage("demo", {log!r}, body)
"""


def test_a_stage_log_on_a_full_disk_is_said_once_and_the_failure_stays_last(small_disk):
    fill_up(small_disk / "another_jobs_file")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SCRIPTS), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", FAILING_STAGE.format(log=str(small_disk / "stage.log"))],
                          capture_output=True, text=True, timeout=60, env=env)  # fmt: skip
    assert proc.returncode == 1
    assert "Logging error" not in proc.stderr  # one traceback per record buried the message
    assert proc.stderr.count("cannot write the log file") == 1
    assert proc.stderr.rstrip().endswith("stage demo FAILED:\nthe cause, and the fix"), proc.stderr[-2000:]
    assert "working 49" in proc.stderr


def test_a_status_file_gets_its_last_word_on_a_full_disk(small_disk):
    """A full disk refuses the atomic write's temporary file (naming the file it was for); in place, the text
    goes into the blocks the file already holds, and one that would need more is refused, the old text intact."""
    status = small_disk / "progress.json"
    write_text_atomic(status, '{"state": "running"}\n')
    fill_up(small_disk / "another_jobs_file")
    with pytest.raises(OSError) as refused:
        write_text_atomic(status, '{"state": "failed"}\n')
    assert (refused.value.errno, refused.value.filename) == (errno.ENOSPC, str(status))
    write_text_atomic(status, '{"state": "failed", "message": "disk full"}\n', in_place_when_full=True)
    assert status.read_text() == '{"state": "failed", "message": "disk full"}\n'
    with pytest.raises(OSError):
        write_text_atomic(status, "x" * 100_000, in_place_when_full=True)
    assert status.read_text() == '{"state": "failed", "message": "disk full"}\n'


# ---------------------------------------------------------------- real vLLM trees (slow)


@pytest.mark.slow
def test_a_port_taken_before_vllm_binds_it_is_retried_then_a_sigkilled_stage_leaves_no_server_behind(
    tiny_targets, tmp_path
):
    """One server start for two proofs, in a stage-like process that starts its server exactly as canary and
    extract_hidden_states do (VLLMServer with hidden_states_server_spec):

    1. free_port() can only say a port is free now: another job's server may bind it before this one does (a
       clean-clone suite failed so: '[Errno 98] Address already in use' from vLLM's launcher). With its first port
       held by a listening socket, the server is started again on a fresh port, the log says why, and the server
       that answers is this one (its API key works).
    2. SIGKILL of the stage: API server + EngineCore under the launcher, all gone after it."""
    stage = Stage(f"""
        import logging, socket, sys, time, urllib.request
        logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(name)s: %(message)s")
        import eagle3_workflow.serving.server as vllm_server
        from eagle3_workflow.serving.engine import hidden_states_server_spec
        from eagle3_workflow.settings.stages import ServingStage
        taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        taken.bind(("127.0.0.1", 0))
        taken.listen()  # another process's listening socket: connections hang, vLLM's bind fails
        taken_port = taken.getsockname()[1]
        ports = iter([taken_port])
        really_free_port = vllm_server.free_port
        vllm_server.free_port = lambda: next(ports, None) or really_free_port()
        settings = ServingStage.model_validate_json({_serving().model_dump_json()!r})
        spec = hidden_states_server_spec(settings, model={str(tiny_targets("llama"))!r},
            layer_ids=[2, 4, 5, 8], storage_dir={str(tmp_path / "hs")!r}, device="cpu", enable_render_endpoint=True)
        with vllm_server.VLLMServer(spec, {str(tmp_path / "server.log")!r}) as server:
            request = urllib.request.Request(f"{{server.base_url}}/v1/models", headers=server.headers())
            with urllib.request.urlopen(request, timeout=30) as response:
                print("server ready on", server.port, "taken", taken_port, "status", response.status, flush=True)
            time.sleep(600)
    """)
    stage.wait_for("server ready on", 300)
    ready = next(line for line in stage.lines if line.startswith("server ready on")).split()
    port, taken_port, status = int(ready[3]), int(ready[5]), int(ready[7])
    assert port != taken_port and status == 200, ready
    assert "Address already in use" in (tmp_path / "server.log").read_text()
    retried = (f"port {taken_port} (or another port the server binds) was taken before vLLM bound it; starting the "
               "server again on a fresh port (attempt 2 of 3)")  # fmt: skip
    assert any(retried in line for line in stage.lines), "\n".join(stage.lines[-60:])
    stage.kill_and_expect_no_orphans(at_least=4)  # stage, launcher, API server, EngineCore


REGENERATE_STAGE = """
import json
from pathlib import Path
from eagle3_workflow.regenerate.stage import run_subprocess
from eagle3_workflow.runtime.stage import run_stage
from eagle3_workflow.settings.stages import RegenerateResponsesStage
config = RegenerateResponsesStage.model_validate(json.loads({config!r}))
run_stage("regenerate_responses", None,
          lambda log: run_subprocess(Path({target!r}), [Path({prompts!r})], config, log, output=Path({out!r}),
                                     stats_path=Path({stats!r})))
"""


def _regenerate_stage(tiny_targets, tmp_path, stall_timeout_s: float) -> Stage:
    import json

    from conftest import tiny_settings

    from eagle3_workflow.settings.stages import RegenerateResponsesStage
    from eagle3_workflow.settings.views import as_config

    prompts = tmp_path / "prompts.txt"
    # 2,048 requests x 256 tokens: minutes of work for the tiny target on 2 cores, so the SIGSTOP below lands while
    # requests are in flight however slowly the test reacts (64 requests once finished first on a loaded machine)
    prompts.write_text("".join(f"Write a long story about ship number {i} and its crew.\n" for i in range(2048)))
    settings = tiny_settings(
        RegenerateResponsesStage,
        vllm={"stall_timeout_s": stall_timeout_s},
        regenerate=REGENERATE_SETTINGS | {"max_tokens": 256},
    )
    return Stage(REGENERATE_STAGE.format(config=json.dumps(as_config(settings)), target=str(tiny_targets("llama")),
                                         prompts=str(prompts), out=str(tmp_path / "o.jsonl"),
                                         stats=str(tmp_path / "s.json")))  # fmt: skip


@pytest.mark.slow
def test_a_sigkilled_regenerate_stage_leaves_no_engine_behind(tiny_targets, tmp_path):
    stage = _regenerate_stage(tiny_targets, tmp_path, stall_timeout_s=600)
    stage.wait_for("vLLM ready", 300)
    stage.kill_and_expect_no_orphans(at_least=3)  # stage, launcher, regeneration process (the engine runs in it)


@pytest.mark.slow
def test_a_stopped_engine_fails_regenerate_as_stalled(tiny_targets, tmp_path):
    """SIGSTOP of the engine (a wedged GPU or a hung collective looks the same): the stage fails in bounded
    time with the stall message, and its tree is gone. The stage's 2,048 requests keep the engine busy for minutes,
    far longer than the moment between the 'vLLM ready' line and the SIGSTOP."""
    stage = _regenerate_stage(tiny_targets, tmp_path, stall_timeout_s=5)
    stage.wait_for("vLLM ready", 300)
    launcher = next(pid for pid in tree(stage.proc.pid) if _stat(pid)[1] == stage.proc.pid)
    command = next(pid for pid in tree(launcher) if _stat(pid)[1] == launcher)
    assert tree(command) == {command}, "on CPU the engine runs in the regeneration process (executor uni)"
    os.kill(command, signal.SIGSTOP)
    pids = tree(stage.proc.pid)
    assert stage.proc.wait(timeout=120) == 1
    output = "\n".join(stage.lines)
    assert "no progress for" in output
    assert "engine alive but not answering" in output
    wait_until(lambda: not alive(pids), 60, "the stalled stage's tree to end")


@pytest.mark.slow
def test_a_sigkilled_evaluate_stage_leaves_no_engine_behind(tiny_targets, tmp_path):
    from eagle3_workflow.evaluation.launch import measurement_engine_kwargs

    engine = measurement_engine_kwargs(_serving().vllm, target=str(tiny_targets("llama")), dtype="bfloat16",
                           trust_remote_code=False, seed=0, device="cpu", tensor_parallel_size=1, in_process=False)  # fmt: skip
    log_path = tmp_path / "eval.log"
    stage = Stage(f"""
        from pathlib import Path
        from eagle3_workflow.evaluation.launch import measurement_environment, run_measurement_process
        from eagle3_workflow.evaluation.protocol import MeasurementRun, MeasurementSpec
        spec = MeasurementSpec(engine={engine!r}, prompts=[[1, 2, 3]] * 64, max_tokens=256, timing_repeats=3,
                               runs=[MeasurementRun(label="no_speculation", speculative_config=None)])
        env = measurement_environment(device="cpu", cpu_threads=None, in_process=False)
        run_measurement_process(spec, Path({str(tmp_path)!r}), "m", env=env, log_path={str(log_path)!r},
                                timeout_s=600, stall_timeout_s=600)
    """)
    wait_until(lambda: log_path.exists() and "Starting to load model" in log_path.read_text(), 300,
               "the measurement engine to load")  # fmt: skip
    stage.kill_and_expect_no_orphans(at_least=4)  # stage, launcher, measurement process, EngineCore


@pytest.mark.slow
def test_a_server_that_fails_at_start_quotes_the_root_cause_and_is_not_waited_for(tiny_targets, tmp_path, caplog):
    """A connector module that cannot be imported (a plugin's import error) kills the EngineCore at start: the
    failure quotes the traceback down to its exception line, and the broken server is killed at once (it used
    to cost 'vLLM did not stop within 30 s')."""
    from eagle3_workflow.serving.engine import hidden_states_server_spec
    from eagle3_workflow.serving.server import ServerFailure, VLLMServer

    spec = hidden_states_server_spec(_serving(), model=str(tiny_targets("llama")), layer_ids=[2, 4, 5, 8],
                                     storage_dir=str(tmp_path / "hs"), device="cpu", enable_render_endpoint=True)  # fmt: skip
    spec.kv_transfer_config["kv_connector_module_path"] = "eagle3_missing_connector"
    server = VLLMServer(spec, tmp_path / "server.log")
    with pytest.raises(ServerFailure) as failure:
        server.__enter__()
    message = str(failure.value)
    quoted = message.split("first traceback in the output of the vLLM server:\n", 1)[1].split("\nlast ", 1)[0]
    assert quoted.splitlines()[-1] == "ModuleNotFoundError: No module named 'eagle3_missing_connector'", quoted
    assert "did not stop" not in caplog.text
    assert server.child is not None
    assert not alive(tree(server.child.pid))


# ---------------------------------------------------------------- an eager CPU engine compiles nothing


def test_an_eager_cpu_engine_builds_no_inductor_kernel_for_vllms_logprob_rank(tmp_path):
    """vLLM's logprob rank (every request with logprobs: the extraction's greedy probe, the lossless pass) is a
    torch.compile function; in the environment of an eager CPU engine it runs as written: the same counts, and
    nothing in inductor's cache (without it: a gcc build, 15 s of the first extraction after `make setup`)."""
    from eagle3_workflow.runtime import child_environment

    env = child_environment(vllm_on_cpu=True, eager=True) | {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    code = textwrap.dedent("""
        import torch
        from vllm.v1.sample.ops.logprobs import batched_count_greater_than
        logits = torch.randn(3, 1000)
        chosen = logits[:, 7:8]
        assert torch.equal(batched_count_greater_than(logits, chosen), (logits >= chosen).sum(-1))
        print("counted")
    """)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 0 and "counted" in proc.stdout, proc.stderr[-3000:]
    built = [p for p in (tmp_path / "inductor").rglob("*") if p.is_file()] if (tmp_path / "inductor").exists() else []
    assert built == [], f"inductor built {len(built)} file(s): {built[:5]}"
