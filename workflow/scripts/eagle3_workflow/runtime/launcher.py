"""The direct child of every ChildProcess: runs one command and makes its whole tree die with the stage.

Usage (built by ChildProcess, never by hand): ``python launcher.py WATCH_FD -- COMMAND...``

Why a launcher: PR_SET_PDEATHSIG only reaches a process's direct child, and vLLM (API server -> EngineCore ->
workers), torchrun (-> ranks) and DataLoader workers are grandchildren or further. So this process
- is a child subreaper: any descendant whose parent dies is re-parented here, not to PID 1, so the whole tree
  stays reachable through /proc;
- holds the read end of a pipe whose only write end the stage holds: the stage dying for any reason (SIGKILL,
  OOM kill) closes it, the read returns EOF, and this process SIGKILLs every descendant, then exits;
- sets PR_SET_PDEATHSIG(SIGKILL) in the command, so the command dies with this process as well;
- passes SIGTERM/SIGINT/SIGHUP on to the command alone (it stops its own children), kills stragglers (workers
  that outlived the command) when the command exits, and reports the command's exit status as its own (a
  command killed by signal N kills this process with N).
If the launcher itself is SIGKILLed, ChildProcess kills what is left of its process group; a descendant that
also left the group (setsid) is then out of reach. The launcher itself gets no PDEATHSIG: that fires when the *thread* that started it ends, which would kill a
tree started from a short-lived thread; the pipe has no such trap. Stdlib only, no package imports: it starts
in milliseconds.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}, {value}) failed")


def parent_ids() -> dict[int, int]:
    """pid -> parent pid of every live (not zombie) process now visible in /proc."""
    parents = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as handle:
                stat = handle.read()
        except OSError:
            continue  # exited meanwhile
        # the command name (field 2) may hold spaces and parentheses: parse after its last ')'
        state, parent = stat.rsplit(")", 1)[1].split()[:2]
        if state != "Z":
            parents[int(entry)] = int(parent)
    return parents


def descendants(root: int) -> list[int]:
    parents = parent_ids()
    found, frontier = [], [root]
    while frontier:
        children = [pid for pid, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def kill_descendants() -> None:
    """SIGKILL every descendant, repeatedly: a process may fork while its siblings are being killed."""
    for _ in range(20):
        pids = descendants(os.getpid())
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def reap() -> None:
    """Collect exited descendants (re-parented orphans become this subreaper's zombies)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def watch_parent(watch_fd: int) -> None:
    """Block until the stage's end of the pipe closes (the stage exited or was killed), then end the tree."""
    while os.read(watch_fd, 1):
        pass
    kill_descendants()
    os._exit(137)


def start(command: list[str], watch_fd: int) -> int:
    launcher = os.getpid()
    pid = os.fork()
    if pid == 0:  # the command: dies with the launcher, never sees the watch pipe
        try:
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            if os.getppid() != launcher:  # the launcher died before prctl took effect
                os._exit(137)
            os.close(watch_fd)
            for signum in STOP_SIGNALS:
                signal.signal(signum, signal.SIG_DFL)
            os.execvp(command[0], command)
        except BaseException as exc:  # noqa: BLE001 - report and leave the forked copy of the launcher
            os.write(2, f"launcher: cannot run {command[0]!r}: {exc!r}\n".encode())
        os._exit(127)
    return pid


def main(argv: list[str]) -> None:
    watch_fd, separator, command = int(argv[1]), argv[2], argv[3:]
    if separator != "--" or not command:
        sys.exit("usage: launcher.py WATCH_FD -- COMMAND...")
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    command_pid = 0

    def forward(signum: int, _frame: object) -> None:
        # a stop request goes to the command alone, which stops its own children its way (vLLM's API server its
        # engine, torchrun its ranks, a trainer its DataLoader workers: signalled directly, those die with a
        # traceback that hides the cause); whatever outlives the command is killed after it
        if command_pid:
            try:
                os.kill(command_pid, signum)
            except ProcessLookupError:
                pass

    for signum in STOP_SIGNALS:
        signal.signal(signum, forward)
    pid = command_pid = start(command, watch_fd)
    threading.Thread(target=watch_parent, args=(watch_fd,), daemon=True).start()
    _, status = os.waitpid(pid, 0)
    command_pid = 0  # reaped: its pid may be reused
    kill_descendants()  # stragglers: workers that outlived the command
    reap()
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    sys.exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main(sys.argv)
