"""A bad config through Snakemake: refused before planning, the misspelled key named in a few lines."""

from __future__ import annotations

from pathlib import Path

from conftest import run_workflow, tiny_config


def test_snakemake_refuses_a_bad_config_before_planning(tmp_path: Path):
    config = tiny_config()
    config["extraction"]["replicas"] = 0
    proc = run_workflow(tmp_path, config, extra=["-n"], check=False)
    assert proc.returncode != 0
    assert "replicas" in proc.stderr + proc.stdout


def test_snakemake_names_a_misspelled_key_in_a_few_lines(tmp_path: Path):
    config = tiny_config()
    config["extration"] = {"replicas": 2}
    config["extraction"]["concurency"] = 3
    proc = run_workflow(tmp_path, config, extra=["-n"], check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "unknown key extration" in output
    assert "unknown key extraction.concurency" in output
    assert "allowed keys: " in output
    assert "concurrency" in output  # the allowed keys, so the fix is visible
    assert "$schema" not in output
    assert "description" not in output  # neither the schema nor the config dump
    assert len(output.splitlines()) < 20, output
