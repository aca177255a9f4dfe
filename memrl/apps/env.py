"""`memrl env`: the machine as a bug report needs it, on one screen; `--json`: all of it as data.

`torch.utils.collect_env` (OS, libc, compiler, CPU, driver), plus what it leaves out: memrl's version and
commit, torch's cuDNN / NCCL, each GPU, the libraries and extras, the paths memrl reads, the environment
variables that change a run and which secrets are set (never their values). Never failing: versions come
from installed metadata, and a broken torch or a collect_env that fails or hangs becomes a line.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
from importlib import metadata
from pathlib import Path
from typing import Any

CORE_PACKAGES = ("torch", "transformers", "tokenizers", "safetensors", "huggingface_hub", "numpy", "pydantic",
                 "typer", "psutil")
# Not memrl dependencies, but often part of the same environment and of its problems.
OTHER_PACKAGES = ("accelerate", "flash-attn", "liger-kernel", "wandb", "deepspeed", "triton")
# The hub repositories the seed's recipe reads (model, RULER-HQA, HotpotQA), as hub cache folder names.
SEED_HUB_REPOS = {"models--Qwen--Qwen3-0.6B": "Qwen/Qwen3-0.6B",
                  "datasets--BytedTsinghua-SIA--hotpotqa": "BytedTsinghua-SIA/hotpotqa",
                  "datasets--hotpotqa--hotpot_qa": "hotpotqa/hotpot_qa"}
ENV_VARS = ("CUDA_VISIBLE_DEVICES", "HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_CACHE", "HF_HUB_OFFLINE",
            "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_ENDPOINT", "DATA_DIR", "RAY_ADDRESS",
            "OMP_NUM_THREADS", "PYTORCH_CUDA_ALLOC_CONF", "NCCL_DEBUG", "NCCL_SOCKET_IFNAME")
SECRET_VARS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "MEMRL_API_KEY", "WANDB_API_KEY", "OPENAI_API_KEY")

MEMRL_ROOT = Path(__file__).resolve().parents[1]  # the memrl package folder
COLLECT_TIMEOUT_S = 60.0  # torch's collect_env, measured ~2 s (pip list, nvidia-smi, lscpu)

_EXTRA_MARKER = re.compile(r"""extra\s*==\s*["']([^"']+)["']""")
_REQ_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?")


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _requirements() -> list[str]:
    """memrl's requirement strings: the installed metadata, else (a source tree) pyproject.toml."""
    try:
        return list(metadata.requires("memrl") or [])
    except metadata.PackageNotFoundError:
        pass
    import tomllib

    pyproject = MEMRL_ROOT.parent / "pyproject.toml"
    try:
        project = tomllib.loads(pyproject.read_text())["project"]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return []
    reqs = list(project.get("dependencies", []))
    for extra, items in project.get("optional-dependencies", {}).items():
        reqs += [f'{item}; extra == "{extra}"' for item in items]
    return reqs


def extras() -> dict[str, dict[str, list[str]]]:
    """{extra: {"packages": [distribution names], "includes": [other extras]}}, in declaration order."""
    out: dict[str, dict[str, list[str]]] = {}
    for req in _requirements():
        marker = _EXTRA_MARKER.search(req)
        name = _REQ_NAME.match(req)
        if marker is None or name is None:
            continue
        entry = out.setdefault(marker.group(1), {"packages": [], "includes": []})
        if name.group(1).lower() == "memrl":  # `all = ["memrl[serve,ray,hub]"]`
            entry["includes"] += [e.strip() for e in (name.group(2) or "").split(",") if e.strip()]
        elif name.group(1) not in entry["packages"]:
            entry["packages"].append(name.group(1))
    return out


def cpu_bf16_native() -> bool:
    """Whether this CPU multiplies bfloat16 natively (oneDNN sees AVX512-BF16 or AMX). Without it torch
    emulates bf16 matrix products: ~50x slower than float32 on an AVX2 EPYC (1.2 vs 62 GFLOP/s at SmolLM2's
    MLP shape, bench/cpu_precision.py), so CPU training and generation stay float32 there."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch build without oneDNN
        return False


def _torch_env() -> dict[str, Any]:
    """`torch.utils.collect_env`'s fields ("collect_env") and what torch itself says beyond them (its cuDNN
    and NCCL, CPU threads, each GPU's memory, compute capability and bf16)."""
    try:
        import torch
        from torch.utils import collect_env
    except Exception as error:  # a broken torch install is exactly what a report must show
        return {"error": f"import torch failed: {type(error).__name__}: {error}"}
    info: dict[str, Any] = {"version": torch.__version__, "cuda_build": torch.version.cuda,
                            "threads": torch.get_num_threads(), "devices": [], "cpu_bf16": cpu_bf16_native(),
                            "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    try:
        info["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        if torch.cuda.is_available():
            try:
                info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
            except Exception:  # a CUDA build without NCCL
                info["nccl"] = None
            for i in range(torch.cuda.device_count()):
                p = torch.cuda.get_device_properties(i)
                info["devices"].append({"index": i, "name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                                        "capability": f"{p.major}.{p.minor}"})
            info["bf16"] = torch.cuda.is_bf16_supported()
    except Exception as error:
        info["error"] = f"CUDA query failed: {type(error).__name__}: {error}"
    info["collect_env"] = _collect_env(collect_env)
    return info


def _collect_env(collect_env: Any) -> dict[str, Any]:
    """`collect_env.get_env_info()` as a dict, in a daemon thread given COLLECT_TIMEOUT_S: it runs pip,
    nvidia-smi and lscpu with no timeout of its own, and a hung nvidia-smi must be a line, not a hung command."""
    done: dict[str, dict[str, Any]] = {}

    def run() -> None:
        try:
            done["info"] = collect_env.get_env_info()._asdict()
        except Exception as error:  # a failing probe is part of the report, never its end
            done["info"] = {"error": f"{type(error).__name__}: {error}"}

    thread = threading.Thread(target=run, name="memrl-collect-env", daemon=True)
    thread.start()
    thread.join(COLLECT_TIMEOUT_S)
    return done.get("info", {"error": f"did not finish in {COLLECT_TIMEOUT_S:g} s (a hung nvidia-smi, pip or lscpu)"})


def _memrl_source() -> dict[str, Any]:
    out: dict[str, Any] = {"version": package_version("memrl"), "location": str(MEMRL_ROOT)}
    git = shutil.which("git")
    if git is not None and (MEMRL_ROOT.parent / ".git").exists():
        try:  # the short hash (tags excluded), marked when tracked files have changes
            head = subprocess.run([git, "--no-optional-locks", "-C", str(MEMRL_ROOT.parent), "describe",
                                   "--always", "--exclude=*", "--dirty= (local changes)"],
                                  capture_output=True, text=True, timeout=10, check=False)
            if head.returncode == 0:
                out["commit"] = head.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return out


def _hub_paths() -> dict[str, Any]:
    try:  # huggingface_hub's own resolution of HF_HOME / HF_HUB_CACHE / XDG_CACHE_HOME
        from huggingface_hub import constants

        home, hub_cache = str(constants.HF_HOME), str(constants.HF_HUB_CACHE)
    except Exception as error:
        home = hub_cache = f"unknown (huggingface_hub failed: {type(error).__name__})"
    cached = [repo for folder, repo in SEED_HUB_REPOS.items() if os.path.isdir(os.path.join(hub_cache, folder))]
    return {"hf_home": home, "hub_cache": hub_cache, "hub_cache_exists": os.path.isdir(hub_cache),
            "seed_repos_cached": cached,
            "datasets_cache": os.environ.get("HF_DATASETS_CACHE") or os.path.join(home, "datasets")}


def _data_dir() -> dict[str, Any]:
    from memrl.data.prepare import HELDOUT_FILE, RULER_DIR, TRAIN_FILE

    given = os.environ.get("DATA_DIR")
    path = Path(given or "data")
    found = [name for name in (TRAIN_FILE, HELDOUT_FILE) if (path / name).is_file()]
    ruler = sorted((path / RULER_DIR).glob("eval_*.json"), key=lambda p: (len(p.name), p.name))
    found += [f"{RULER_DIR}/{p.name}" for p in ruler]
    return {"path": str(path), "resolved": str(path.resolve()), "from_env": given is not None,
            "exists": path.is_dir(), "prepared": found}


def collect_env() -> dict[str, Any]:
    """Everything `memrl env` prints, as plain data (`memrl env --json`)."""
    try:
        import psutil

        mem = psutil.virtual_memory()
        memory = {"total_gib": round(mem.total / 2**30, 1), "available_gib": round(mem.available / 2**30, 1)}
    except Exception:
        memory = {}
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    declared = extras()
    return {
        "memrl": _memrl_source(),
        "python": {"version": sys.version.split()[0], "implementation": sys.implementation.name,
                   "executable": sys.executable},
        "cpu": {"count": os.cpu_count(), "usable": usable, **memory},
        "torch": _torch_env(),
        "packages": {name: package_version(name) for name in CORE_PACKAGES},
        "extras": {extra: {"packages": {p: package_version(p) for p in spec["packages"]},
                           "includes": spec["includes"]} for extra, spec in declared.items()},
        "other_packages": {name: package_version(name) for name in OTHER_PACKAGES},
        "paths": {**_hub_paths(), "data_dir": _data_dir()},
        "env": {name: os.environ[name] for name in ENV_VARS if name in os.environ},
        "secrets_set": [name for name in SECRET_VARS if os.environ.get(name)],
    }


def _versions(packages: dict[str, str | None]) -> str:
    return ", ".join(f"{name} {version}" if version else f"{name} absent" for name, version in packages.items())


def _extra_state(name: str, all_extras: dict[str, Any], seen: tuple[str, ...] = ()) -> tuple[str, list[str]]:
    """("ok" | "partial" | "absent", the parts of its line): an extra's packages, then the extras it includes."""
    spec = all_extras[name]
    present = [v is not None for v in spec["packages"].values()]
    parts = [_versions(spec["packages"])] if spec["packages"] else []
    for inc in spec["includes"]:
        if inc in all_extras and inc not in seen:
            state, _ = _extra_state(inc, all_extras, (*seen, name))
            parts.append(f"{inc} {state}")
            present += [state == "ok"] if state != "partial" else [True, False]
    return ("ok" if all(present) else "absent" if not any(present) else "partial"), parts


def _install_hint(extra: str, location: str) -> str:
    checkout = (Path(location).parent / "pyproject.toml").is_file()
    return f"pip install -e '.[{extra}]'" if checkout else f"pip install 'memrl[{extra}]'"


def _system_lines(env: dict[str, Any], cpu: dict[str, Any]) -> list[str]:
    model = re.search(r"^Model name:\s*(.+)$", env.get("cpu_info") or "", re.M)
    gcc = f", gcc {env['gcc_version']}" if env.get("gcc_version") else ""
    system = (f"os            {env['os']}, {env['libc_version']}{gcc}" if "error" not in env
              else f"os            unknown: torch.utils.collect_env {env['error']}")
    return [system, f"cpu           {cpu['usable']} usable of {cpu['count']} cores"
            + (f", {model.group(1).strip()}" if model else "")
            + (f", memory {cpu['total_gib']} GiB ({cpu['available_gib']} GiB free)" if "total_gib" in cpu else "")]


def _torch_lines(t: dict[str, Any], env: dict[str, Any]) -> list[str]:
    if "version" not in t:
        return [f"torch         {t['error']}"]
    build = f"CUDA {t['cuda_build']}" if t["cuda_build"] else "CPU build, no CUDA"
    cudnn = f", cuDNN {t['cudnn']}" if t.get("cudnn") else ""
    nccl = f", NCCL {t['nccl']}" if t.get("nccl") else ""
    nvcc = f"; nvcc {env['cuda_runtime_version']}" if env.get("cuda_runtime_version") else ""
    driver = env.get("nvidia_driver_version")
    bf16 = "native" if t.get("cpu_bf16") else "emulated (slow): keep CPU training and generation float32"
    lines = [f"torch         {t['version']}, {build}{cudnn}{nccl}, {t['threads']} CPU threads{nvcc}",
             f"cpu bfloat16  {bf16} ({t.get('cpu_capability', 'unknown')} kernels)"]
    if t["devices"]:
        lines += [f"gpu {d['index']:<9} {d['name']}, {d['memory_gib']} GiB, compute {d['capability']}"
                  for d in t["devices"]]
        lines.append(f"gpu support   bf16 {'yes' if t.get('bf16') else 'no'}; driver {driver or 'unknown'}")
    elif t["cuda_build"]:
        lines.append(f"gpu           none visible to this CUDA build of torch "
                     f"(driver: {driver or 'nvidia-smi not found'}; "
                     f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
    else:
        lines.append("gpu           none: torch is a CPU build" + (
            f", but a driver is present ({driver}): install the CUDA build of torch first (README)" if driver else ""))
    if t.get("error"):
        lines.append(f"torch error   {t['error']}")
    return lines


def format_env(report: dict[str, Any]) -> str:
    m, py, cpu, paths = report["memrl"], report["python"], report["cpu"], report["paths"]
    env = report["torch"].get("collect_env", {"error": "needs an importable torch"})
    lines = ["memrl env: paste this into a bug report", "",
             f"memrl         {m['version'] or 'not installed (run from source)'} at {m['location']}"
             + (f", commit {m['commit']}" if m.get("commit") else ""),
             f"python        {py['version']} ({py['implementation']}) {py['executable']}",
             *_system_lines(env, cpu), *_torch_lines(report["torch"], env),
             f"libraries     {_versions({k: v for k, v in report['packages'].items() if k != 'torch'})}"]
    for name in report["extras"]:
        state, parts = _extra_state(name, report["extras"])
        hint = f" (install: {_install_hint(name, m['location'])})" if state != "ok" else ""
        lines.append(f"{'memrl[' + name + ']':<13} {state:<7} {'; '.join(parts)}{hint}")
    lines.append(f"other         {_versions(report['other_packages'])}")
    d = paths["data_dir"]
    data = ", ".join(d["prepared"]) if d["prepared"] else ("no prepared files" if d["exists"] else "does not exist")
    cached = ", ".join(paths["seed_repos_cached"]) or "none of the seed's repos"
    lines += [f"hub cache     {paths['hub_cache']} "
              f"({'cached: ' + cached if paths['hub_cache_exists'] else 'does not exist yet'})",
              f"datasets      {paths['datasets_cache']}",
              f"data dir      {d['resolved']} "
              f"({'$DATA_DIR' if d['from_env'] else '$DATA_DIR unset, default data'}): {data}"]
    if report["env"]:
        lines.append("environment   " + " ".join(f"{k}={v}" for k, v in report["env"].items()))
    lines.append("secrets set   " + (", ".join(report["secrets_set"]) or "none") + " (values not shown)")
    return "\n".join(lines) + "\n"
