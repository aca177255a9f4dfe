"""`memrl env`: one screen for a bug report, fast, and never failing on a missing or broken package."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memrl.apps import env as env_app
from memrl.apps.env import collect_env, extras, format_env
from memrl.cli import app

ROOT = Path(__file__).resolve().parents[2]
OPTIONAL = ("ray", "datasets", "fastapi", "uvicorn", "wandb", "liger-kernel", "vllm", "sglang")


def _run(*args: str, **env: str) -> str:
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, check=True,
                          env={**os.environ, **env})
    return done.stdout


def test_the_command_prints_versions_devices_extras_and_paths(tmp_path):
    import torch

    data = tmp_path / "data"
    (data / "ruler_hqa").mkdir(parents=True)
    for name in ("hotpotqa_train.jsonl", "hotpotqa_heldout.jsonl", "ruler_hqa/eval_200.json", "ruler_hqa/eval_50.json"):
        (data / name).write_text("")
    # A fresh process: the hub cache path is read from the environment when huggingface_hub is imported.
    out = _run("-m", "memrl.cli", "env", HF_HUB_CACHE=str(tmp_path / "hub"), DATA_DIR=str(data),
               HF_TOKEN="hf_do_not_print_me", CUDA_VISIBLE_DEVICES="0,1")
    lines = out.splitlines()
    assert len(lines) <= 40  # one screen
    assert re.search(rf"^memrl +{re.escape(metadata.version('memrl'))} at {re.escape(str(ROOT / 'memrl'))}", out, re.M)
    assert re.search(rf"^python +{re.escape(sys.version.split()[0])}", out, re.M)
    assert re.search(rf"^torch +{re.escape(torch.__version__)}", out, re.M)
    # The system lines are torch.utils.collect_env's
    from torch.utils.collect_env import get_env_info

    system = get_env_info()
    assert re.search(rf"^os +{re.escape(system.os)}, {re.escape(system.libc_version)}", out, re.M)
    assert re.search(r"^gpu ", out, re.M)  # a GPU line, or why there is none
    assert re.search(rf"^libraries .*transformers {re.escape(metadata.version('transformers'))}", out, re.M)
    for extra in ("serve", "ray", "hub", "dev"):
        assert re.search(rf"^memrl\[{extra}\] +(ok|partial|absent) ", out, re.M), extra
    assert f"hub cache     {tmp_path / 'hub'} (does not exist yet)" in out
    assert (f"data dir      {data} ($DATA_DIR): hotpotqa_train.jsonl, hotpotqa_heldout.jsonl, ruler_hqa/eval_50.json, "
            f"ruler_hqa/eval_200.json") in out
    assert "CUDA_VISIBLE_DEVICES=0,1" in out
    assert "secrets set   HF_TOKEN (values not shown)" in out and "hf_do_not_print_me" not in out


def test_json_output_is_the_collected_report_with_all_of_collect_env():
    from torch.utils.collect_env import SystemEnv

    result = CliRunner().invoke(app, ["env", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["memrl"]["version"] == metadata.version("memrl")
    assert set(report) >= {"torch", "packages", "extras", "paths", "secrets_set"}
    assert set(report["torch"]["collect_env"]) == set(SystemEnv._fields)


def test_a_collect_env_that_hangs_or_fails_is_a_line_of_the_report(monkeypatch):
    import threading
    from types import SimpleNamespace

    release = threading.Event()
    monkeypatch.setattr(env_app, "COLLECT_TIMEOUT_S", 0.05)
    try:  # a hung probe (nvidia-smi on a wedged driver): the report comes anyway, saying so
        hung = env_app._collect_env(SimpleNamespace(get_env_info=lambda: release.wait(600)))
        assert hung == {"error": "did not finish in 0.05 s (a hung nvidia-smi, pip or lscpu)"}
    finally:
        release.set()

    def broken():
        raise OSError("lscpu: not found")

    failed = env_app._collect_env(SimpleNamespace(get_env_info=broken))
    text = format_env({**collect_env(), "torch": {**env_app._torch_env(), "collect_env": failed}})
    assert re.search(r"^os +unknown: torch.utils.collect_env OSError: lscpu: not found$", text, re.M)
    assert re.search(r"^torch +\d", text, re.M)  # the rest of the report is intact


def test_absent_optional_packages_are_reported_not_fatal(monkeypatch):
    # As on a machine without them: no metadata, and an import would fail (None in sys.modules).
    real = env_app.package_version
    monkeypatch.setattr(env_app, "package_version", lambda name: None if name in OPTIONAL else real(name))
    for module in ("ray", "datasets", "fastapi", "uvicorn", "wandb", "liger_kernel"):
        monkeypatch.setitem(sys.modules, module, None)
    text = format_env(collect_env())
    assert re.search(r"^memrl\[ray\] +absent +ray absent \(install: pip install -e '\.\[ray\]'\)", text, re.M)
    assert re.search(r"^memrl\[hub\] +absent +datasets absent", text, re.M)
    assert re.search(r"^memrl\[serve\] +absent +fastapi absent, uvicorn absent", text, re.M)
    assert re.search(r"^memrl\[dev\] +partial ", text, re.M)  # pytest is here, fastapi is not
    assert "wandb absent" in text and "liger-kernel absent" in text


def test_a_broken_torch_is_a_line_of_the_report(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    text = format_env(collect_env())
    assert re.search(r"^torch +import torch failed: (ModuleNotFound|Import)Error", text, re.M)


def _with_torch(monkeypatch, torch_info, driver):
    system = {"os": "Ubuntu 24.04 LTS (x86_64)", "libc_version": "glibc-2.39", "gcc_version": "13.3.0",
              "cuda_runtime_version": "12.8.93" if torch_info["cuda_build"] else None, "nvidia_driver_version": driver,
              "cpu_info": "Architecture: x86_64\nModel name:   Intel(R) Xeon(R) Platinum 8480+\nCPU(s): 224"}
    monkeypatch.setattr(env_app, "_torch_env", lambda: {**torch_info, "collect_env": system})
    return format_env(collect_env())


def test_gpus_are_listed_with_memory_capability_and_driver(monkeypatch):
    text = _with_torch(monkeypatch, {"version": "2.13.0+cu128", "cuda_build": "12.8", "cudnn": 91002, "nccl": "2.27.3",
                                     "threads": 16, "bf16": True,
                                     "devices": [{"index": 0, "name": "NVIDIA H200", "memory_gib": 139.8,
                                                  "capability": "9.0"}]}, "570.124.06")
    assert "torch         2.13.0+cu128, CUDA 12.8, cuDNN 91002, NCCL 2.27.3, 16 CPU threads; nvcc 12.8.93" in text
    assert "os            Ubuntu 24.04 LTS (x86_64), glibc-2.39, gcc 13.3.0" in text
    assert re.search(r"^cpu +\d+ usable of \d+ cores, Intel\(R\) Xeon\(R\) Platinum 8480\+", text, re.M)
    assert "gpu 0         NVIDIA H200, 139.8 GiB, compute 9.0" in text
    assert "gpu support   bf16 yes; driver 570.124.06" in text


def test_a_cpu_torch_on_a_gpu_machine_says_what_to_install(monkeypatch):
    text = _with_torch(monkeypatch, {"version": "2.13.0+cpu", "cuda_build": None, "threads": 16, "devices": []},
                     "570.124.06")
    assert "torch is a CPU build, but a driver is present (570.124.06): install the CUDA build of torch first" in text


def test_extras_come_from_pyproject_when_memrl_is_not_installed(monkeypatch):
    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "requires", not_installed)
    declared = extras()
    assert declared["hub"]["packages"] == ["datasets"]
    assert set(declared["all"]["includes"]) == {"serve", "ray", "hub", "lora", "wandb"}


def test_the_all_extra_covers_every_optional_module_memrl_asks_for():
    # `require_module(name, purpose, extra)` is how a command asks for an optional package: the README's
    # GPU install (`.[all,dev]`) must include each of those extras, so the seed's entry points all run.
    import tomllib

    asked = set()
    for path in (ROOT / "memrl").rglob("*.py"):
        asked |= set(re.findall(r"require_module\([^)]*?,\s*[^)]*?,\s*\"(\w+)\"\s*[,)]", path.read_text()))
    assert "hub" in asked
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    included = set(re.match(r"memrl\[([^\]]*)\]", optional["all"][0]).group(1).split(","))
    assert asked <= included and {"serve", "ray"} <= included


@pytest.mark.parametrize("module", ["memrl.cli", "memrl.apps.env"])
def test_nothing_heavy_is_imported(module):
    # `memrl env` imports torch when it runs (its devices), and nothing optional; the CLI module nothing heavy.
    code = (f"import sys, {module}\n" + ("from memrl.apps.env import collect_env; collect_env()\n"
                                         if module == "memrl.apps.env" else "")
            + "print(sorted(m for m in ('transformers', 'ray', 'datasets', 'fastapi', 'wandb', 'torch') "
              "if m in sys.modules))")
    loaded = json.loads(_run("-c", code).replace("'", '"'))
    assert loaded == ([] if module == "memrl.cli" else ["torch"])


def test_the_cpus_bfloat16_support_is_said(monkeypatch):
    """CPU bf16 is emulated (~50x slower than float32) without AVX512-BF16 / AMX: the report says which."""
    base = {"version": "2.13.0+cpu", "cuda_build": None, "threads": 2, "devices": [], "cpu_capability": "AVX2"}
    slow = _with_torch(monkeypatch, {**base, "cpu_bf16": False}, None)
    assert "cpu bfloat16  emulated (slow): keep CPU training and generation float32 (AVX2 kernels)" in slow
    fast = _with_torch(monkeypatch, {**base, "cpu_bf16": True, "cpu_capability": "AVX512"}, None)
    assert "cpu bfloat16  native (AVX512 kernels)" in fast
    assert isinstance(env_app.cpu_bf16_native(), bool)
