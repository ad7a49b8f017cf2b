# Front door. `make demo` and `make test` set the environment up themselves (idempotent, seconds when done).
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
SNAKEMAKE := $(VENV)/bin/snakemake
PRESET ?= config/presets/tiny.yaml
CORES ?= 2
PYTEST_ARGS ?=
# test processes (pytest-xdist, --dist loadgroup): tests sharing an expensive fixture run on one worker
# (tests/conftest.py, shared_fixture_group); three on the 2-core CI machine, where much of a vLLM or Snakemake
# test is waiting
TEST_WORKERS ?= 3

PLAN_ARGS ?=
.PHONY: plan setup demo test test-fast test-integration test-e2e lint format dryrun install-profile clean-demo gpu-local config-docs

setup:
	bash envs/setup_cpu.sh

demo: setup
	$(SNAKEMAKE) --cores $(CORES) --configfile $(PRESET) --printshellcmds
	@echo "report: results/$$($(PY) -c 'import yaml,sys; print(yaml.safe_load(open(sys.argv[1]))["run"])' $(PRESET))/report.html"

# One GPU machine, no scheduler: Snakemake runs at most GPUS GPUs' worth of jobs at a time, and each job locks
# its own devices (docs/gpu-local.md, "GPU placement in local runs"). GPUS defaults to the machine's count. It runs
# the `snakemake` of the active GPU environment (envs/gpu.yaml), not the CPU .venv that `setup` builds.
GPUS ?= $(shell nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
GPU_SNAKEMAKE ?= snakemake
gpu-local:
	@test "$(GPUS)" -gt 0 || { echo "no GPU found (nvidia-smi -L); set GPUS=<count>"; exit 1; }
	$(GPU_SNAKEMAKE) --cores $(CORES) --resources gpu=$(GPUS) --configfile $(PRESET) $(EXTRA_CONFIG) --printshellcmds

dryrun: setup
	$(SNAKEMAKE) -n --configfile $(PRESET)

# the forecast of a GPU run before it starts (issue #42): per stage GPU-hours, wall and disk from measured costs
# (config/costs/), e.g. make plan PRESET=config/presets/llama-3.1-8b.yaml PLAN_ARGS="--samples 500000 --mean-tokens 1024"
plan: setup
	PYTHONPATH=workflow/scripts $(PY) -m eagle3_workflow.forecast --configfile $(PRESET) $(EXTRA_CONFIG) $(PLAN_ARGS)

lint: setup
	$(VENV)/bin/ruff check workflow tests bench
	$(VENV)/bin/ruff format --check workflow tests bench
	$(VENV)/bin/snakefmt --check Snakefile workflow/rules
	$(SNAKEMAKE) --lint --configfile config/presets/tiny.yaml

format: setup
	$(VENV)/bin/ruff format workflow tests bench
	$(VENV)/bin/ruff check --fix workflow tests bench
	$(VENV)/bin/snakefmt Snakefile workflow/rules

# The suite by folder (README.md, "Tests"): `test` runs all of it after lint, as CI does (.ci/run); `test-fast` is
# the edit loop, tests/unit only (pure functions in-process: no vLLM server, no Snakemake run; about 1 min here).
test: setup lint
	$(VENV)/bin/pytest -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

test-fast: setup
	$(VENV)/bin/pytest tests/unit $(PYTEST_ARGS)

test-integration: setup
	$(VENV)/bin/pytest -n $(TEST_WORKERS) --dist loadgroup tests/integration $(PYTEST_ARGS)

test-e2e: setup
	$(VENV)/bin/pytest -n $(TEST_WORKERS) --dist loadgroup tests/e2e $(PYTEST_ARGS)

# config/README.md's table of keys, written from the schema's descriptions (tests/unit/test_config_docs.py checks it)
config-docs: setup
	PYTHONPATH=workflow/scripts $(PY) -m eagle3_workflow.settings.docs

install-profile:
	mkdir -p "$${XDG_CONFIG_HOME:-$$HOME/.config}/snakemake"
	ln -sfn "$(CURDIR)/profiles/slurm" "$${XDG_CONFIG_HOME:-$$HOME/.config}/snakemake/slurm"
	@echo "linked $${XDG_CONFIG_HOME:-$$HOME/.config}/snakemake/slurm -> $(CURDIR)/profiles/slurm"

# The real single-node SLURM tests (apt-get installs slurm/munge when missing; root) and the planning benchmark.
.PHONY: test-slurm bench-dryrun
test-slurm: setup
	$(VENV)/bin/pytest -m slurm $(PYTEST_ARGS)

bench-dryrun: setup
	$(PY) bench/dryrun/bench_dryrun.py
