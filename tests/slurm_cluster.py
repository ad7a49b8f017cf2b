"""A real single-node SLURM on 127.0.0.1 for the test suite (Debian 12's slurm 22.05 packages).

Everything lives under one temporary directory: a private munged (own key and socket), slurm.conf and
gres.conf, state, spool and logs. Nothing is written to /etc and the machine's own munge/slurm, if any, are
left alone; clients reach this cluster through SLURM_CONF (see `SlurmCluster.env`). The node declares 8 GPUs
as a generic resource so that `--gpus=N` requests are scheduled and can be read back on a CPU machine.

Slurm 22.05's gres/gpu plugin drops GPUs that have no `File=` ("Removing file-less GPU ... from final GRES
list", after which slurmctld drains the node), so gres.conf names placeholder files: symlinks to /dev/null,
a character device, one per GPU. No job touches them (TaskPlugin=task/none: no device cgroup).

    cluster = SlurmCluster.start(tmp_dir)   # raises SlurmUnavailable with the reason
    try:
        subprocess.run(["sbatch", ...], env={**os.environ, **cluster.env})
    finally:
        cluster.stop()                         # cancels its jobs, stops only the daemons it started
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
BINARIES = ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "sinfo", "munged")
NODE_NAME = "eagle3ci"
CLIENTS = ("sbatch", "srun", "squeue", "scontrol", "scancel", "sinfo", "sacct", "salloc")
GPUS_PER_NODE = 8
KEEP_FINISHED_JOBS_S = 7 * 24 * 3600  # MinJobAge: longer than any test session


class SlurmUnavailable(RuntimeError):
    """SLURM cannot be installed or started here; the message says why (tests skip with it)."""


def _which(binary: str) -> str | None:
    # the daemons live in /usr/sbin, which a non-login PATH may lack
    return shutil.which(binary) or shutil.which(binary, path="/usr/sbin:/usr/bin:/sbin:/bin")


def _missing_binaries() -> list[str]:
    return [b for b in BINARIES if _which(b) is None]


def ensure_installed(timeout_s: float = 900) -> None:
    """Install Debian's slurm + munge packages unless their binaries are already there (idempotent)."""
    if not _missing_binaries():
        return
    if os.geteuid() != 0:
        raise SlurmUnavailable(f"slurm/munge binaries missing ({_missing_binaries()}) and not root to apt-get them")
    if _which("apt-get") is None:
        raise SlurmUnavailable(f"slurm/munge binaries missing ({_missing_binaries()}) and no apt-get")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES]
    proc = subprocess.run(install, capture_output=True, text=True, env=env, timeout=timeout_s)
    if proc.returncode != 0:  # stale package lists: update once, then retry
        update = subprocess.run(
            ["apt-get", "update", "-qq"], capture_output=True, text=True, env=env, timeout=timeout_s
        )
        proc = subprocess.run(install, capture_output=True, text=True, env=env, timeout=timeout_s)
        if proc.returncode != 0:
            raise SlurmUnavailable(
                f"apt-get install {' '.join(PACKAGES)} failed (rc={proc.returncode}):\n{proc.stderr[-2000:]}\n"
                f"apt-get update said:\n{update.stderr[-1000:]}"
            )
    if _missing_binaries():
        raise SlurmUnavailable(f"installed {PACKAGES} but still missing {_missing_binaries()}")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError as e:
        return f"(cannot read {path}: {e!r})"


@dataclasses.dataclass
class SlurmCluster:
    root: Path
    cpus: int
    real_memory_mb: int
    partitions: tuple[str, ...]
    processes: dict[str, subprocess.Popen] = dataclasses.field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """Environment for clients (sbatch, squeue, snakemake's slurm plugin) to reach this cluster. PATH starts
        with wrappers that set SLURM_CONF themselves: inside a job, snakemake's jobstep strips SLURM_* from
        the environment of its `srun`, and a real cluster's nodes find /etc/slurm/slurm.conf instead."""
        path = os.environ.get("PATH", "")
        return {"SLURM_CONF": str(self.conf), "PATH": f"{self.root / 'bin'}:{path}:/usr/sbin:/sbin"}

    @property
    def slurmctld_log(self) -> Path:
        return self.root / "log" / "slurmctld.log"

    # ---- lifecycle -------------------------------------------------------------------------------------
    @classmethod
    def start(
        cls,
        root: Path,
        partitions: tuple[str, ...] = ("cpu", "gpu"),
        real_memory_mb: int = 65536,
        ready_timeout_s: float = 60,
    ) -> SlurmCluster:
        """Install if needed, write the config under `root` and start munged, slurmctld and slurmd."""
        if os.name != "posix" or not Path("/proc").exists():
            raise SlurmUnavailable("needs Linux")
        if os.geteuid() != 0:
            raise SlurmUnavailable("slurmd must run as root to launch jobs; not root")
        ensure_installed()
        root.mkdir(parents=True, exist_ok=True)
        root.chmod(0o755)
        # threads: 2 rules must fit; the node may declare more CPUs/memory than it has (config_overrides)
        cluster = cls(root=root, cpus=max(2, os.cpu_count() or 1), real_memory_mb=real_memory_mb, partitions=partitions)
        try:
            cluster._write_config()
            cluster._start_munged()
            cluster._start_daemon("slurmctld", ["-D", "-f", str(cluster.conf)])
            cluster._start_daemon("slurmd", ["-D", "-f", str(cluster.conf), "-N", NODE_NAME])
            cluster._wait_idle(ready_timeout_s)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _write_config(self) -> None:
        for sub in ("munge", "state", "spool", "log", "gpu_placeholders", "bin"):
            (self.root / sub).mkdir(exist_ok=True)
        for client in CLIENTS:
            binary = _which(client)
            if binary is None:
                continue
            wrapper = self.root / "bin" / client
            wrapper.write_text(f'#!/bin/sh\nSLURM_CONF={self.conf} exec {binary} "$@"\n')
            wrapper.chmod(0o755)
        (self.root / "munge").chmod(0o755)
        for i in range(GPUS_PER_NODE):
            link = self.root / "gpu_placeholders" / f"gpu{i}"
            if not link.is_symlink():
                link.symlink_to("/dev/null")
        first, *others = self.partitions
        partition_lines = [f"PartitionName={first} Nodes={NODE_NAME} Default=YES MaxTime=INFINITE State=UP"]
        partition_lines += [f"PartitionName={p} Nodes={NODE_NAME} MaxTime=INFINITE State=UP" for p in others]
        r = self.root
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=eagle3ci",
                    f"SlurmctldHost={socket.gethostname().split('.')[0]}(127.0.0.1)",
                    f"SlurmctldPort={_free_port()}",
                    f"SlurmdPort={_free_port()}",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    "AuthType=auth/munge",
                    "CredType=cred/munge",
                    f"AuthInfo=socket={r}/munge/munge.socket",
                    f"StateSaveLocation={r}/state",
                    f"SlurmdSpoolDir={r}/spool",
                    f"SlurmctldPidFile={r}/slurmctld.pid",
                    f"SlurmdPidFile={r}/slurmd.pid",
                    f"SlurmctldLogFile={r}/log/slurmctld.log",
                    f"SlurmdLogFile={r}/log/slurmd.log",
                    "SlurmctldDebug=info",
                    "SlurmdDebug=info",
                    "MpiDefault=none",
                    "MailProg=/bin/true",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_Core",
                    "SlurmdParameters=config_overrides",
                    "ReturnToService=2",
                    # finished jobs stay known to squeue/scontrol for the cluster's lifetime, however slow the
                    # machine: the tests read a run's jobs back after it (a run that took 876 s on a loaded 2-core
                    # machine had lost its first jobs with MinJobAge=600), and snakemake's squeue status queries
                    # need MinJobAge >= 3 x the first status check delay. Not 0 ("never purge"): the slurm plugin
                    # reads 0 as too low for squeue and falls back to sacct, which has no database here.
                    f"MinJobAge={KEEP_FINISHED_JOBS_S}",
                    "JobAcctGatherType=jobacct_gather/none",
                    "AccountingStorageType=accounting_storage/none",
                    "GresTypes=gpu",
                    f"NodeName={NODE_NAME} NodeHostname={socket.gethostname().split('.')[0]} NodeAddr=127.0.0.1 "
                    f"CPUs={self.cpus} RealMemory={self.real_memory_mb} Gres=gpu:{GPUS_PER_NODE} State=UNKNOWN",
                    *partition_lines,
                    "",
                ]
            )
        )
        # gres.conf beside slurm.conf: Count=8 plus the placeholder files 22.05 insists on (module docstring)
        (r / "gres.conf").write_text(
            f"Name=gpu Count={GPUS_PER_NODE} File={r}/gpu_placeholders/gpu[0-{GPUS_PER_NODE - 1}]\n"
        )

    def _start_munged(self) -> None:
        munge = self.root / "munge"
        key = munge / "munge.key"
        if not key.exists():
            if _which("mungekey"):
                subprocess.run([_which("mungekey"), "--create", f"--keyfile={key}"], check=True, capture_output=True)
            else:
                key.write_bytes(os.urandom(1024))
            key.chmod(0o600)
        self._start_daemon(
            "munged",
            [
                "--force",
                "--foreground",
                f"--socket={munge}/munge.socket",
                f"--key-file={key}",
                f"--log-file={self.root}/log/munged.log",
                f"--pid-file={munge}/munged.pid",
                f"--seed-file={munge}/munged.seed",
            ],
        )
        deadline = time.monotonic() + 15
        while not (munge / "munge.socket").exists():
            self._check_alive("munged")
            if time.monotonic() > deadline:
                raise SlurmUnavailable(f"munged made no socket in 15 s:\n{_tail(self.root / 'log' / 'munged.out')}")
            time.sleep(0.1)

    def _start_daemon(self, name: str, args: list[str]) -> None:
        binary = _which(name)
        if binary is None:
            raise SlurmUnavailable(f"{name} not found")
        out = open(self.root / "log" / f"{name}.out", "ab")  # noqa: SIM115 - the daemon owns it until stop()
        self.processes[name] = subprocess.Popen(
            [binary, *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **self.env},
            start_new_session=True,
        )
        out.close()

    def _check_alive(self, name: str) -> None:
        proc = self.processes[name]
        if proc.poll() is not None:
            logs = _tail(self.root / "log" / f"{name}.out")
            if name != "munged":
                logs += "\n" + _tail(self.root / "log" / f"{name}.log")
            raise SlurmUnavailable(f"{name} exited with {proc.returncode}:\n{logs}")

    def _wait_idle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        state = ""
        while time.monotonic() < deadline:
            for name in self.processes:
                self._check_alive(name)
            proc = self.run(["sinfo", "-h", "-n", NODE_NAME, "-o", "%T"], check=False)
            state = proc.stdout.strip()
            if proc.returncode == 0 and state.startswith("idle"):
                return
            time.sleep(0.5)
        node = self.run(["scontrol", "show", "node", NODE_NAME], check=False)
        raise SlurmUnavailable(
            f"node {NODE_NAME} not idle after {timeout_s:.0f} s (state {state!r}):\n{node.stdout}{node.stderr}\n"
            f"slurmctld.log:\n{_tail(self.slurmctld_log)}\nslurmd.log:\n{_tail(self.root / 'log' / 'slurmd.log')}"
        )

    def stop(self, timeout_s: float = 30) -> None:
        """Cancel every job of this cluster, then stop the daemons this object started (by their pids)."""
        if "slurmctld" in self.processes and self.processes["slurmctld"].poll() is None:
            self.run(["scancel", "--full", "-u", str(os.geteuid())], check=False)
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                active = self.run(["squeue", "-h", "-t", "PD,R,CG,CF,S", "-o", "%i"], check=False)
                if active.returncode != 0 or not active.stdout.strip():
                    break
                time.sleep(0.5)
        for name in ("slurmd", "slurmctld", "munged"):  # reverse start order
            proc = self.processes.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)

    # ---- queries -----------------------------------------------------------------------------------------
    def run(self, cmd: list[str], check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **self.env})
        if check and proc.returncode != 0:
            raise RuntimeError(f"{cmd} failed ({proc.returncode}): {proc.stderr}")
        return proc

    def jobs(self) -> list[dict[str, str]]:
        """Every job slurmctld knows (MinJobAge keeps finished ones for a week), as `scontrol show job -o` fields."""
        proc = self.run(["scontrol", "show", "job", "-o"], check=False)
        if "No jobs in the system" in proc.stdout + proc.stderr:
            return []
        if proc.returncode != 0:
            raise RuntimeError(f"scontrol show job failed: {proc.stderr}")
        return [parse_scontrol_record(line) for line in proc.stdout.splitlines() if line.strip()]


def parse_scontrol_record(line: str) -> dict[str, str]:
    """One line of `scontrol show job -o` (`Key=Value Key=Value ...`) -> dict. A token without a `Key=`
    prefix continues the previous value (values such as Command=... may contain spaces)."""
    record: dict[str, str] = {}
    key = None
    for token in line.split():
        name, sep, value = token.partition("=")
        if sep and re.fullmatch(r"[A-Za-z][A-Za-z0-9_:/]*", name):
            key = name
            record[key] = value
        elif key is not None:
            record[key] += " " + token
    return record
