"""profiles/slurm: its settings as Snakemake reads them, where site settings come from, and
`make install-profile` (`--profile slurm` as typed). The tiny preset through the profile on a real SLURM:
tests/e2e/test_slurm.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import NO_SITE_SETTINGS, REPO, TINY_PRESET, run_workflow

PROFILE = REPO / "profiles" / "slurm"
PRINT_PROFILE = (
    "import json, sys\n"
    "from snakemake.profiles import ProfileConfigFileParser\n"
    "with open(sys.argv[1]) as f:\n"
    "    print(json.dumps(dict(ProfileConfigFileParser().parse(f))))\n"
)


def render_profile(env: dict[str, str]) -> subprocess.CompletedProcess:
    """profiles/slurm/config.yaml as Snakemake reads it (YTE rendered) and printed as JSON, in a subprocess:
    rendering exports site settings to the environment, which must not leak into the test process."""
    return subprocess.run(
        [sys.executable, "-c", PRINT_PROFILE, str(PROFILE / "config.yaml")],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=60,
    )


def parse_profile(env: dict[str, str]) -> dict:
    proc = render_profile(env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def default_resources(profile: dict) -> dict[str, str]:
    return dict(item.split("=", 1) for item in profile.get("default-resources", []))


def test_profile_settings():
    profile = parse_profile(NO_SITE_SETTINGS)
    assert profile["executor"] == "slurm"
    assert int(profile["retries"]) >= 1
    assert profile["slurm-requeue"] == "True"
    assert profile["slurm-logdir"].startswith("results/")
    assert profile["slurm-keep-successful-logs"] == "True"
    resources = default_resources(profile)
    assert "cpus_per_task" not in resources, "cpus_per_task in default-resources overrides every rule's threads"
    assert "attempt" in resources["runtime"], "runtime must grow with the retry attempt"
    assert resources["nodes"] == "1"
    # nothing site-specific unless the site says so
    assert "slurm_account" not in resources
    assert "slurm_partition" not in resources
    assert "slurm-status-command" not in profile
    assert "slurm-no-account" not in profile


def test_profile_site_settings_from_file_and_environment(tmp_path):
    overrides = tmp_path / "local-overrides.yaml"
    overrides.write_text("account: proj-file\ncpu_partition: cpu-file\nstatus_command: squeue\nqos: high\n")
    env = {**NO_SITE_SETTINGS, "SNAKEMAKE_SLURM_OVERRIDES": str(overrides)}
    profile = parse_profile(env)
    resources = default_resources(profile)
    assert resources["slurm_account"] == "'proj-file'"
    assert resources["slurm_partition"] == "'cpu-file'"
    assert profile["slurm-status-command"] == "squeue"
    assert profile["slurm-qos"] == "high"
    # the environment wins over the file
    profile = parse_profile({**env, "SNAKEMAKE_SLURM_ACCOUNT": "proj-env"})
    assert default_resources(profile)["slurm_account"] == "'proj-env'"
    # clusters without accounts
    profile = parse_profile({**env, "SNAKEMAKE_SLURM_NO_ACCOUNT": "true"})
    assert profile["slurm-no-account"] == "True"
    assert "slurm_account" not in default_resources(profile)


def test_profile_rejects_unknown_override_keys(tmp_path):
    overrides = tmp_path / "local-overrides.yaml"
    overrides.write_text("acount: typo\n")
    proc = render_profile({**NO_SITE_SETTINGS, "SNAKEMAKE_SLURM_OVERRIDES": str(overrides)})
    assert proc.returncode != 0
    assert "unknown keys ['acount']" in proc.stderr


def test_install_profile_makes_profile_slurm_work_as_typed(tmp_path):
    """`make install-profile` links $XDG_CONFIG_HOME/snakemake/slurm, where `--profile slurm` looks."""
    config_home = tmp_path / "config-home"
    env = {**NO_SITE_SETTINGS, "XDG_CONFIG_HOME": str(config_home)}
    subprocess.run(
        ["make", "-C", str(REPO), "install-profile"], check=True, env={**os.environ, **env}, capture_output=True
    )
    link = config_home / "snakemake" / "slurm"
    assert link.is_symlink()
    assert link.resolve() == PROFILE.resolve()
    proc = run_workflow(
        tmp_path / "work",
        [TINY_PRESET],
        extra=["-n", "--profile", "slurm"],  # the name, as typed after `make install-profile`
        cores=None,
        check=False,
        timeout=300,
        env={**env, "SNAKEMAKE_SLURM_CPU_PARTITION": "from-env"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    # the profile was read: its default-resources (nodes=1, the site partition) are in the plan
    assert "nodes=1" in proc.stdout + proc.stderr
    assert "slurm_partition=from-env" in proc.stdout + proc.stderr
