"""The one process runtime's pure parts: a failure quotes the root cause from vLLM's prefixed logs, the progress
watch adapts to the pace, the engine's progress bar prints markers. Real process trees, signals and stalls:
tests/integration/test_runtime_processes.py."""

from __future__ import annotations

import pytest
from conftest import VLLM_LOGS

from eagle3_workflow.runtime.child import (
    BUSY_MARKER,
    PROGRESS_MARKER,
    ProgressWatch,
    first_traceback,
    strip_log_prefixes,
)

# ---------------------------------------------------------------- first_traceback on vLLM's log shapes


def test_prefixes_vllm_and_torchrun_put_before_lines_are_stripped():
    assert strip_log_prefixes("(EngineCore_DP0 pid=123) ERROR 12-01 04:38:56 [core.py:708] Traceback (most") == (
        "Traceback (most"
    )
    assert strip_log_prefixes('(Worker_TP0 pid=7)   File "x.py", line 1') == '  File "x.py", line 1'
    assert strip_log_prefixes("ERROR 12-01 04:38:56.123 [core.py:7]     raise X") == "    raise X"
    assert strip_log_prefixes("WARNING [utils.py:1] hello") == "hello"
    assert strip_log_prefixes("[rank0]: ValueError: bad") == "ValueError: bad"
    assert strip_log_prefixes("(APIServer pid=1) INFO 12-01 04:38:56 [api_server.py:1] up\r") == "up"
    assert strip_log_prefixes('  File "(x)", line 2') == '  File "(x)", line 2'  # indentation is content


@pytest.mark.parametrize(
    ("log_name", "exception_line"),
    [
        ("engine_core_no_eagle3.log", "RuntimeError: Model does not support EAGLE3 interface but "
                                      "aux_hidden_state_outputs was requested"),
        ("connector_import_error.log", "ModuleNotFoundError: No module named 'eagle3_missing_connector'"),
        ("worker_exception.log", "TypeError: 'NoneType' object is not subscriptable"),
        ("out_of_memory.log", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"),
    ],
)  # fmt: skip
def test_first_traceback_quotes_the_exception_line_of_real_vllm_failures(log_name, exception_line):
    lines = (VLLM_LOGS / log_name).read_text().splitlines()
    quoted = first_traceback(lines)
    assert quoted.splitlines()[0] == "Traceback (most recent call last):"
    assert quoted.splitlines()[-1].startswith(exception_line), quoted
    assert "pid=" not in quoted
    assert "[core.py" not in quoted


def test_first_traceback_of_torchrun_ranks_and_no_traceback():
    lines = ["noise", "[rank0]: Traceback (most recent call last):", '[rank0]:   File "x.py", line 1, in <module>',
             "[rank0]:     main()", "[rank0]: ValueError: bad ids", "Traceback (most recent call last):", "KeyError: 2"]  # fmt: skip
    assert first_traceback(lines).splitlines()[-1] == "ValueError: bad ids"
    assert first_traceback(["all", "fine"]) == ""


# ---------------------------------------------------------------- the progress watch (pure)


def test_progress_watch_adapts_to_the_pace_with_a_floor():
    watch = ProgressWatch(floor_s=10, factor=20)
    assert watch.stalled_for(1000.0) is None  # not armed: an engine loading is not watched
    watch.observe(BUSY_MARKER, 0.0)
    assert watch.stalled_for(9.0) is None
    assert watch.stalled_for(11.0) == 11.0  # the floor bounds the first item
    watch.observe(PROGRESS_MARKER, 5.0)
    watch.observe(PROGRESS_MARKER, 7.0)  # slowest interval so far: 5 s -> limit 100 s
    assert watch.limit_s() == 100.0
    assert watch.stalled_for(100.0) is None
    assert watch.stalled_for(108.0) == 101.0
    watch.observe("@@eagle3 idle", 200.0)
    assert watch.stalled_for(10_000.0) is None


def test_the_engine_progress_bar_prints_one_marker_per_finished_request(capsys):
    """Used the way vllm.LLM drives use_tqdm: created with total/desc/postfix, updated per finished request."""
    from eagle3_workflow.runtime.worker import engine_progress_bar

    bar = engine_progress_bar()(total=3, desc="Processed prompts", dynamic_ncols=True, postfix="est. speed")
    for _ in range(3):
        bar.update(1)
    bar.postfix = "est. speed input: 1.00 toks/s"
    assert bar.format_dict["elapsed"] >= 0
    bar.close()
    for _ in engine_progress_bar()(range(2), desc="Adding requests"):  # vLLM also wraps iterables with it
        pass
    assert capsys.readouterr().out.splitlines() == [PROGRESS_MARKER] * 3


# ---------------------------------------------------------------- the stop line's sentence


def test_the_stop_line_says_a_fixed_sentence_or_what_a_function_reads_at_stop_time():
    from eagle3_workflow.runtime.stage import rerun_sentence

    assert rerun_sentence("the rerun resumes") == "the rerun resumes"
    assert rerun_sentence(lambda: "the rerun resumes from epoch 0 step 3") == "the rerun resumes from epoch 0 step 3"

    def unreadable() -> str:
        raise PermissionError(13, "Permission denied")

    # a stop still ends in its one line, never in a traceback
    assert rerun_sentence(unreadable) == (
        "what the rerun will do could not be worked out (PermissionError(13, 'Permission denied'))"
    )
