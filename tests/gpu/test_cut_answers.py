"""bench/gpu/cut_answers.py: which regenerated answers reached the cap, and whether they are loops (issue #43)."""

from __future__ import annotations

import json
import lzma
import subprocess
import sys

import pytest
from conftest import REPO, load_script

SCRIPT = REPO / "bench" / "gpu" / "cut_answers.py"


@pytest.fixture(scope="module")
def cut():
    return load_script(SCRIPT)


def test_repeated_share_is_zero_for_text_that_never_repeats_and_near_one_for_a_loop(cut):
    assert cut.repeated_share("def add(a, b): return a + b  # adds two numbers and returns the sum") == 0.0
    loop = " ".join(["the answer is the answer"] * 40)
    assert cut.repeated_share(loop) > 0.9
    assert cut.repeated_share("too short") == 0.0


def rows():
    loop = " ".join(["x = x + 1"] * 20)  # 100 words
    prose = " ".join(f"w{i}" for i in range(100))
    return [
        {
            "origin": "magpie[python]:1",
            "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": loop}],
        },
        {
            "origin": "magpie[python]:2",
            "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": prose}],
        },
        {
            "origin": "magpie:7",
            "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "short answer"}],
        },
    ]


def test_answers_at_the_cap_less_the_slack_count_as_cut_grouped_by_origin(cut):
    summary = cut.summarize(rows(), lambda text: len(text.split()), cap=100, slack=4)
    python = summary["magpie[python]"]
    assert python["cut"]["answers"] == 2 and python["cut"]["repeated_over_0.5"] == 1
    assert summary["magpie"] == {"cut": {"answers": 0}, "finished": {"answers": 1, "median_repeated": 0.0,
                                 "repeated_over_0.2": 0, "repeated_over_0.5": 0}}  # fmt: skip
    assert summary["all"]["cut"]["answers"] == 2 and summary["all"]["finished"]["answers"] == 1
    # one token more than the slack below the cap: finished
    assert cut.summarize(rows(), lambda text: len(text.split()), cap=105, slack=4)["all"]["cut"]["answers"] == 0


def test_the_command_reads_a_bundle_and_a_tokenizer_json(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    words = sorted({w for row in rows() for w in row["conversations"][-1]["value"].split()})
    tokenizer = tokenizers.Tokenizer(WordLevel({w: i for i, w in enumerate(["[UNK]", *words])}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    bundle = tmp_path / "restore"
    bundle.mkdir()
    with lzma.open(bundle / "regenerated.jsonl.xz", "wt") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in rows())
    (bundle / "regenerated.stats.json").write_text(
        json.dumps({"settings": {"max_tokens": 100}, "truncated_answers": 2})
    )
    done = subprocess.run([sys.executable, str(SCRIPT), str(bundle), "--tokenizer", str(tmp_path / "tokenizer.json"),
                           "--out", str(tmp_path / "out.json")], capture_output=True, text=True, check=True)  # fmt: skip
    summary = json.loads((tmp_path / "out.json").read_text())
    assert json.loads(done.stdout) == summary
    assert summary["cap"] == 100 and summary["regeneration_counted_cut"] == 2
    assert summary["by_origin"]["all"]["cut"]["answers"] == 2
