"""GPU placement in one process on a fake GPU machine: real flock, fake device ids (machine_gpus override).

The plan (SLURM allocations, CUDA_VISIBLE_DEVICES, too few GPUs), release on failure, lock file names and the
busy message. Concurrent worker processes, a local Snakemake run and the real rules:
tests/integration/test_gpu_placement_processes.py.
"""

from __future__ import annotations

import logging

import pytest

from eagle3_workflow.runtime.gpu_placement import (
    PlacementSettings,
    count_machine_gpus,
    hold_gpus,
    lock_path,
    plan_placement,
)
from eagle3_workflow.settings.errors import StageError

LOG = logging.getLogger("test_gpu_placement")


def test_released_when_the_job_fails(tmp_path):
    settings = PlacementSettings(gpus=2, lock_dir=tmp_path, machine_gpus=2, wait_timeout_s=0, device="auto")
    with pytest.raises(RuntimeError, match="stage body failed"):
        with hold_gpus(settings, LOG, env={}):
            raise RuntimeError("stage body failed")
    with hold_gpus(settings, LOG, env={}) as devices:
        assert devices == ["0", "1"]


def test_under_slurm_nothing_is_reassigned(tmp_path):
    env = {"SLURM_JOB_ID": "4242", "CUDA_VISIBLE_DEVICES": "5", "SLURM_JOB_GPUS": "5"}
    settings = PlacementSettings(gpus=1, lock_dir=tmp_path / "locks", machine_gpus=8)
    with hold_gpus(settings, LOG, env=env) as devices:
        assert devices == ["5"]
        assert env["CUDA_VISIBLE_DEVICES"] == "5"
    assert env == {"SLURM_JOB_ID": "4242", "CUDA_VISIBLE_DEVICES": "5", "SLURM_JOB_GPUS": "5"}
    assert not (tmp_path / "locks").exists()


def test_jobs_sharing_one_slurm_allocation_split_it(tmp_path):
    env = {"SLURM_JOB_ID": "7", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    settings = PlacementSettings(gpus=2, lock_dir=tmp_path, wait_timeout_s=0, device="auto")
    first_env, second_env = dict(env), dict(env)
    with hold_gpus(settings, LOG, env=first_env) as first, hold_gpus(settings, LOG, env=second_env) as second:
        assert first == ["0", "1"]
        assert second == ["2", "3"]
        assert second_env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert {p.name.split("-", 1)[1] for p in tmp_path.iterdir()} >= {"slurm7-gpu0.lock", "slurm7-gpu3.lock"}


def test_too_few_gpus_fails_at_once(tmp_path):
    settings = PlacementSettings(gpus=4, lock_dir=tmp_path, machine_gpus=2, wait_timeout_s=3600, device="auto")
    with pytest.raises(StageError, match=r"needs 4 GPU\(s\) but this machine has 2"):
        with hold_gpus(settings, LOG, env={}):
            pass
    with pytest.raises(StageError, match=r"SLURM allocation 9 exposes 1"):
        plan_placement(PlacementSettings(gpus=2), {"SLURM_JOB_ID": "9", "CUDA_VISIBLE_DEVICES": "0"}, lambda: 8)


def test_no_gpu_job_and_no_gpu_machine_change_nothing(tmp_path):
    env = {"CUDA_VISIBLE_DEVICES": "3"}
    with hold_gpus(PlacementSettings(gpus=0, lock_dir=tmp_path / "a"), LOG, env=env):
        assert env == {"CUDA_VISIBLE_DEVICES": "3"}
    # vllm.device auto/cpu on a machine without GPUs: the stages fall back to CPU as before
    with hold_gpus(
        PlacementSettings(gpus=1, lock_dir=tmp_path / "b", machine_gpus=0, device="auto", wait_timeout_s=0), LOG, env={}
    ):
        pass
    assert not (tmp_path / "a").exists()
    assert not (tmp_path / "b").exists()
    with pytest.raises(StageError, match="this machine has 0"):
        plan_placement(PlacementSettings(gpus=1, machine_gpus=0, device="cuda", wait_timeout_s=0), {}, lambda: 0)


def test_user_cuda_visible_devices_restricts_the_pool():
    plan = plan_placement(
        PlacementSettings(gpus=1, wait_timeout_s=0, device="auto"), {"CUDA_VISIBLE_DEVICES": "2,3"}, lambda: 8
    )
    assert plan.pool == ("2", "3")
    assert plan.count == 1
    assert not plan.keep


def test_count_machine_gpus_from_nvidia_smi():
    out = (
        "GPU 0: NVIDIA H200 (UUID: GPU-aaaa)\n"
        "  MIG 3g.71gb     Device  0: (UUID: MIG-bbbb)\n"
        "GPU 1: NVIDIA H200 (UUID: GPU-cccc)\n"
    )
    assert count_machine_gpus(out) == 2
    assert count_machine_gpus("") == 0


def test_lock_files_are_per_host_and_device(tmp_path):
    assert lock_path(tmp_path, "", "3").name.endswith("-gpu3.lock")
    assert lock_path(tmp_path, "slurm1", "GPU-ab/cd").name.endswith("-slurm1-gpu" + "GPU-ab_cd.lock")


def test_the_busy_message_names_the_live_holder_only(tmp_path):
    def settings(gpus: int) -> PlacementSettings:
        return PlacementSettings(gpus=gpus, lock_dir=tmp_path, machine_gpus=2, wait_timeout_s=0, device="auto")

    with hold_gpus(settings(2), LOG, env={}, job="rule first"):
        pass  # released: its text stays in both lock files
    with hold_gpus(settings(1), LOG, env={}, job="rule holder"):  # GPU 0
        with pytest.raises(StageError) as failure:
            with hold_gpus(settings(2), LOG, env={}):
                pass
    message = str(failure.value)
    assert "GPU 0: pid" in message, message
    assert "rule holder" in message, message
    assert "GPU 1: free" in message, message
    assert "rule first" not in message, message


def test_a_local_gpu_job_without_the_placement_resource_is_refused():
    """The job's resources carry gpu_placement.wait_timeout_s and vllm.device (common.smk); without them only a
    CPU job or a job inside a SLURM allocation is planned."""
    bare = PlacementSettings.from_resources(type("Resources", (), {"gpu": 1})())
    assert plan_placement(bare, {"SLURM_JOB_ID": "7", "CUDA_VISIBLE_DEVICES": "3"}, lambda: 8).keep
    assert plan_placement(PlacementSettings.from_resources(type("Resources", (), {"gpu": 0})()), {}, lambda: 8).keep
    with pytest.raises(StageError, match="has no gpu_placement resource to place them by"):
        plan_placement(bare, {}, lambda: 8)
