"""The README's GPU path, run as written: install order, then the seed's steps end to end on CPU.

The steps are read from the README's own code blocks (so the documented path cannot silently break)
and run through the real scripts (examples/memagent/*.sh) and the real `memrl` command, with what a CPU
machine without network needs standing in around them:
- the hub: `HF_HUB_OFFLINE=1` and a hub cache holding RULER-HQA `eval_{N}.json` at the pinned revision
  (built from real HotpotQA dev records), read by the real `huggingface_hub.hf_hub_download`; and a
  `datasets` stand-in on PYTHONPATH whose `load_dataset` checks it is asked for the pinned HotpotQA and
  returns real HotpotQA training records as hub rows (CI's install has no `datasets`);
- Qwen3-0.6B: a tiny random Qwen3 with the real Qwen3 tokenizer (`MODEL_PATH`, which the README leaves at
  its default), and smaller rollouts passed as extra arguments on top of the real recipes;
- fewer questions than the hub's 90,000 (`NUM_TRAIN`, `NUM_HELDOUT`).
Everything the README line sets itself is used as written.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SHARED = (ROOT / ".." / "shared").resolve()
HOTPOT_TRAIN = SHARED / "data" / "hotpotqa" / "hotpot_train_sample100.json"
HOTPOT_DEV = SHARED / "data" / "hotpotqa" / "hotpot_dev_distractor_first200.json"
QWEN3_TOKENIZER = SHARED / "assets" / "qwen3-tokenizer"
SEED_SCRIPTS = ["examples/memagent/prepare-data.sh", "examples/memagent/run-qwen3-0.6B-train.sh",
                "examples/memagent/convert-to-hf.sh", "examples/memagent/eval.sh"]

DATASETS_STAND_IN = '''\
"""Stand-in for `datasets` (tests/test_examples.py): the pinned HotpotQA from a local official JSON."""
import json
import os


def load_dataset(path, name=None, *, split=None, revision=None, cache_dir=None):
    asked = {"path": path, "name": name, "split": split, "revision": revision}
    expected = json.loads(os.environ["MEMRL_TEST_HUB_EXPECT"])
    if asked != expected:
        raise AssertionError(f"load_dataset asked for {asked}, expected {expected}")
    rows = []
    with open(os.environ["MEMRL_TEST_HOTPOT_FILE"], encoding="utf-8") as f:
        for r in json.load(f):  # official record -> hub row (dict-shaped context and facts)
            rows.append({"id": r["_id"], "question": r["question"], "answer": r["answer"], "type": r["type"],
                         "level": r["level"],
                         "supporting_facts": {"title": [t for t, _ in r["supporting_facts"]],
                                              "sent_id": [i for _, i in r["supporting_facts"]]},
                         "context": {"title": [t for t, _ in r["context"]],
                                     "sentences": [s for _, s in r["context"]]}})
    return rows
'''


def readme_gpu_blocks() -> list[list[tuple[dict[str, str], list[str]]]]:
    """The bash blocks of the README's GPU section, each line as (leading VAR=value assignments, words)."""
    text = README.read_text()
    assert "\n## On a GPU machine" in text, "README.md lost its GPU section"
    section = text.split("\n## On a GPU machine", 1)[1].split("\n## ", 1)[0]
    blocks = []
    for block in re.findall(r"```bash\n(.*?)```", section, re.S):
        lines = []
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            env = {}
            while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
                key, _, value = words.pop(0).partition("=")
                env[key] = value
            if words:
                lines.append((env, words))
        blocks.append(lines)
    return blocks


def test_readme_gpu_install_is_cuda_torch_first_then_every_extra():
    install = [" ".join(words) for _, words in readme_gpu_blocks()[0]]
    torch_at = next(i for i, line in enumerate(install) if re.search(r"pip install torch==\S+", line))
    memrl_at = next(i for i, line in enumerate(install) if "pip install -e" in line)
    assert torch_at < memrl_at
    extras = set(re.search(r"pip install -e \.\[([^\]]+)\]", install[memrl_at]).group(1).split(","))
    assert {"all", "dev"} <= extras  # all = serve + ray + hub (tests/apps/test_env.py checks it covers each)
    # The same torch as the CPU install (CI), which keeps pinning its CPU build first.
    readme_torch = re.search(r"torch==(\S+)", install[torch_at]).group(1)
    script = (ROOT / "scripts" / "install.sh").read_text()
    assert f'TORCH_SPEC="${{MEMRL_TORCH_SPEC:-torch=={readme_torch}}}"' in script
    assert script.index('pip install -q "$TORCH_SPEC"') < script.index("pip install -q -e")
    assert any(words == ["memrl", "env"] for _, words in readme_gpu_blocks()[0])


def test_readme_runs_the_seed_scripts_in_order():
    steps = [words[1] for block in readme_gpu_blocks() for _, words in block if words[0] == "bash"]
    assert steps == SEED_SCRIPTS


def _hub_stand_ins(tmp_path: Path) -> dict[str, str]:
    from memrl.data.hotpotqa import HOTPOTQA_CONFIG, HOTPOTQA_REPO, HOTPOTQA_REVISION, load_hotpotqa_file
    from memrl.data.ruler_hqa import (
        RULER_LENGTHS,
        RULER_REPO,
        RULER_REVISION,
        build_ruler_set,
        write_ruler_file,
    )

    package = tmp_path / "stand_in" / "datasets"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(DATASETS_STAND_IN)
    # The hub cache layout huggingface_hub reads offline for a pinned commit: snapshots/<revision>/<file>.
    snapshot = tmp_path / "hub" / f"datasets--{RULER_REPO.replace('/', '--')}" / "snapshots" / RULER_REVISION
    snapshot.mkdir(parents=True)
    dev = load_hotpotqa_file(HOTPOT_DEV)
    for n in RULER_LENGTHS:  # the published fields only, 3 questions per file
        records = build_ruler_set(dev[:3], n, seed=0, pool=dev)
        write_ruler_file(snapshot / f"eval_{n}.json",
                         [{k: r[k] for k in ("context", "input", "answers", "num_docs", "index")} for r in records])
    return {"PYTHONPATH": str(package.parent), "HF_HOME": str(tmp_path / "hf_home"),
            "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "MEMRL_TEST_HOTPOT_FILE": str(HOTPOT_TRAIN),
            "MEMRL_TEST_HUB_EXPECT": json.dumps({"path": HOTPOTQA_REPO, "name": HOTPOTQA_CONFIG, "split": "train",
                                                 "revision": HOTPOTQA_REVISION})}


SMALL_ROLLOUT = ["--set", "task.chunk_tokens=256", "--set", "task.memory_tokens=16",
                 "--set", "task.final_tokens=8", "--set", "task.max_chunks=2"]


@pytest.mark.slow
def test_the_readme_gpu_steps_run_end_to_end_on_cpu(tmp_path):
    for path in (HOTPOT_TRAIN, HOTPOT_DEV, QWEN3_TOKENIZER / "tokenizer.json"):
        if not path.is_file():
            pytest.skip(f"real data for the stand-ins not found at {path}")
    from memrl.tiny import make_tiny_model_command

    tiny = tmp_path / "tiny-qwen3"
    make_tiny_model_command(tiny, QWEN3_TOKENIZER)
    base_env = {**os.environ, **_hub_stand_ins(tmp_path),
                "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    base_env.pop("DATA_DIR", None)
    # What CPU needs on top of each README line (never a variable the line sets itself).
    cpu_env = {"prepare-data.sh": {"NUM_TRAIN": "8", "NUM_HELDOUT": "4"},
               "run-qwen3-0.6B-train.sh": {"MODEL_PATH": str(tiny)}}
    cpu_args = {"run-qwen3-0.6B-train.sh": ["--no-progress", "--set", "train.rollout_batch_size=2",
                                            "--set", "sampling.n_samples=2", *SMALL_ROLLOUT]}
    cpu_extra_args = {"eval.sh": " ".join(["--no-progress", *SMALL_ROLLOUT])}  # appended to its EXTRA_ARGS

    ran = []
    for block in readme_gpu_blocks():
        for env, words in block:
            if words[0] == "bash":
                name = Path(words[1]).name
                extra_env = cpu_env.get(name, {})
                assert not set(extra_env) & set(env), f"the test would override what the README sets: {name}"
                env = {**extra_env, **env}
                if name in cpu_extra_args:
                    env["EXTRA_ARGS"] = f"{env.get('EXTRA_ARGS', '')} {cpu_extra_args[name]}".strip()
                command = ["bash", str(ROOT / words[1]), *words[2:], *cpu_args.get(name, [])]
            elif words == ["memrl", "env"]:
                name, command = "memrl env", words
            else:
                continue  # the install lines (tested above) and anything else not runnable here
            done = subprocess.run(command, cwd=tmp_path, env={**base_env, **env}, capture_output=True, text=True,
                                  timeout=300)
            assert done.returncode == 0, f"{name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            ran.append((name, done.stdout))
    assert [name for name, _ in ran] == ["memrl env", *(Path(s).name for s in SEED_SCRIPTS)]

    # prepare-data.sh from the hub: questions and every RULER length, the pinned hub source recorded
    data = tmp_path / "data"
    manifest = json.loads((data / "manifest.json").read_text())
    assert manifest["args"]["source"]["hub"] == "hotpotqa/hotpot_qa"
    assert len((data / "train_ids.txt").read_text().split()) == 8
    assert sorted(p.name for p in (data / "ruler_hqa").glob("eval_*.json")) == ["eval_200.json", "eval_50.json",
                                                                              "eval_800.json"]
    # the smoke run: 2 steps, each with the exact row accounting, and a complete final checkpoint
    metrics = [json.loads(line) for line in (tmp_path / "runs/smoke/logs/metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "rows/consumed" in m]
    assert len(steps) == 2 and all(m["rows/saved"] == m["rows/consumed"] > 0 for m in steps)
    assert (tmp_path / "runs/smoke/checkpoints/iter_0000001/COMPLETE").is_file()
    assert (tmp_path / "runs/smoke-hf/config.json").is_file()
    # the evaluation of the smoke model: the 3 stand-in eval_50 questions (under --limit 16), none failed
    summary = json.loads((tmp_path / "results/smoke/ruler_hqa_50/summary.json").read_text())
    assert summary["total"] == 3 and summary["failed"] == 0
    assert "memrl env: paste this into a bug report" in ran[0][1]
