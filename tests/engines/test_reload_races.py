"""Reloads raced against file swaps: a writer inside a reload root flips a weights file (or the reload
folder itself) between the real thing and a symlink to weights outside every root while reloads are sent.
Whatever moment a reload's checks and its load fall on, the served weights must never become the outside
ones (found by trying: 490 of 1,761 accepted reloads served them when the engine reopened checked paths).
The race runs for a bounded few seconds and nothing is timed: what is asserted is that no reload let the
outside weights in, that some reloads got through, and that none failed (500)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from memrl.engines.hf import HFEngine
from memrl.engines.server import create_app
from memrl.tiny import save_tiny_model

sys.path.insert(0, str(Path(__file__).parent))
from test_server import serve_in_thread  # noqa: E402

RACE_S = 3.0  # how long the swaps run; reloads continue past it (up to RACE_CAP_S) until MIN_ACCEPTED got in
RACE_CAP_S = 30.0
MIN_ACCEPTED = 3
WEIGHTS = "model.safetensors"

# The swapper runs in a process of its own, so it swaps while the server holds the GIL too (a thread swapped
# only between the server's bytecodes). Each swap is a rename, so the name always exists; it stops at a
# whole cycle (the real file or folder back) once the stop file exists.
SWAPPER = """
import os, random, sys, time
kind, step, inside_copy, outside, stop = sys.argv[1:]
real = step + ".real"
while not os.path.exists(stop):
    # Each state held a few ms (random, so no rhythm of the server's locks out one of them): long enough
    # for a reload's checks to fall on the one and its load on the other.
    if kind == "weights file":  # model.safetensors: a link out, then the real file again
        os.symlink(os.path.join(outside, "model.safetensors"), step + "/.link")
        os.replace(step + "/.link", step + "/model.safetensors")
        time.sleep(random.uniform(0, 0.01))
        os.link(inside_copy, step + "/.file")
        os.replace(step + "/.file", step + "/model.safetensors")
        time.sleep(random.uniform(0, 0.01))
    else:  # the folder: a link to a whole model outside, then the real folder
        os.rename(step, real)
        os.symlink(outside, step)
        time.sleep(random.uniform(0, 0.04))
        os.unlink(step)
        os.rename(real, step)
        time.sleep(random.uniform(0, 0.04))
"""


def tiny(folder: Path, seed: int) -> Path:
    return save_tiny_model(folder, layers=1, hidden=32, heads=4, kv_heads=2, intermediate=64, seed=seed)


@pytest.mark.parametrize("swapped", ["weights file", "folder"])
def test_no_reload_serves_weights_from_outside_the_roots_while_files_are_swapped(tmp_path, one_torch_thread,
                                                                                  swapped):
    root, outside = tmp_path / "root", tmp_path / "outside"
    step = tiny(root / "step", seed=1)
    tiny(outside, seed=2)
    inside_copy = shutil.copy(step / WEIGHTS, root / "weights.copy")  # what the swapper links back in
    engine = HFEngine.from_pretrained(step, device="cpu")
    served = engine.model.get_input_embeddings().weight.detach().clone()
    outside_weights = HFEngine.from_pretrained(outside, device="cpu").model.get_input_embeddings().weight.detach()
    assert not torch.equal(served, outside_weights)
    app = create_app(engine, "tiny", reload_roots=[root], tokenizer=AutoTokenizer.from_pretrained(step),
                     model_config=AutoConfig.from_pretrained(step).to_dict())
    stop = tmp_path / "stop"
    swapper = subprocess.Popen([sys.executable, "-c", SWAPPER, swapped, str(step), str(inside_copy), str(outside),
                                str(stop)])
    replies: dict[int, int] = {}
    escapes = 0
    try:
        with serve_in_thread(app) as url, httpx.Client(timeout=60) as client:
            start = time.monotonic()
            while (time.monotonic() - start < RACE_S
                   or replies.get(200, 0) < MIN_ACCEPTED and time.monotonic() - start < RACE_CAP_S):
                status = client.post(url + "/v1/reload_weights", json={"path": str(step)}).status_code
                replies[status] = replies.get(status, 0) + 1
                escapes += torch.equal(engine.model.get_input_embeddings().weight.detach(), outside_weights)
    finally:
        stop.touch()
        swapper.wait(timeout=30)
    assert swapper.returncode == 0
    assert escapes == 0, f"after {escapes} reloads the server served the weights outside the roots ({replies})"
    assert replies.get(200, 0) >= 1, replies  # reloads did get through during the race
    assert set(replies) <= {200, 400, 403, 409}, replies  # the others refused (a swap seen), never a 500
    assert torch.equal(engine.model.get_input_embeddings().weight.detach(), served)
