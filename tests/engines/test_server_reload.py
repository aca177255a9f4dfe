"""`POST /v1/reload_weights` of `memrl serve`: which folders it may load (--reload-root), and that a
reload keeps the served model's architecture and vocabulary. FakeEngine records the reloads; the
folders hold a real tiny model's config and tokenizer (no weights: FakeEngine never loads them)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from transformers import AutoConfig, AutoTokenizer
from typer.testing import CliRunner

from memrl.engines import server
from memrl.engines.base import EngineError
from memrl.engines.hf import HFEngine
from memrl.engines.reload_policy import RELOAD_DISABLED_MESSAGE, RELOAD_FORBIDDEN_MESSAGE, ReloadPolicy
from memrl.engines.server import create_app
from memrl.tiny import save_tiny_model

sys.path.insert(0, str(Path(__file__).parent))  # FakeEngine & co. live in the server's test file
from test_server import HOLD_TOKEN, FakeEngine, HeldEngine, post, serve_in_thread, wait_until  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def post_reload(url: str, path) -> httpx.Response:
    return httpx.post(url + "/v1/reload_weights", json={"path": str(path)}, timeout=30)


def loaded(engine: FakeEngine) -> list[tuple[str, dict[str, bytes]]]:
    """Each reload's folder as the engine saw it, name and files: a private copy of the checked folder, outside
    the roots and deleted once its reload is done, never the folder asked for (tests/engines/test_reload_races.py)."""
    assert not any(Path(path).exists() for path in engine.reloads)
    return [(Path(path).name, files) for path, files in zip(engine.reloads, engine.reload_files, strict=True)]


# ---------------------------------------------------------------------------------------- reload roots


def test_reloads_are_disabled_without_a_reload_root(tmp_path):
    engine = FakeEngine()
    with serve_in_thread(create_app(engine, "fake")) as url:
        r = post_reload(url, tmp_path)
    assert r.status_code == 403
    assert r.json()["error"]["message"] == RELOAD_DISABLED_MESSAGE
    assert "--reload-root" in RELOAD_DISABLED_MESSAGE
    assert engine.reloads == []


@pytest.fixture
def rooted(tmp_path):
    """A server allowed to reload from tmp_path/root, next to an existing folder it may not touch."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "step-1").mkdir(parents=True)
    outside.mkdir()
    (root / "link_out").symlink_to(outside)
    (root / "link_dangling").symlink_to(tmp_path / "nowhere")
    (root / "link_in").symlink_to(root / "step-1")
    engine = FakeEngine()
    with serve_in_thread(create_app(engine, "fake", reload_roots=[root])) as url:
        yield url, engine, root, outside


def test_paths_outside_the_roots_get_one_403_whether_or_not_they_exist(rooted, tmp_path):
    url, engine, root, outside = rooted
    paths = [
        outside,  # exists
        tmp_path / "missing",  # does not
        "/",
        root / ".." / "outside",  # `..` out of the root, existing
        root / ".." / "missing",  # `..` out of the root, missing
        f"{root}/step-1/../../outside",
        tmp_path / "missing" / ".." / "outside",  # a missing component must not change the answer
        root / "link_out",  # a symlink inside the root to a folder outside it
        root / "link_dangling",  # a symlink inside the root to nothing outside it
        str(root) + "-sibling",  # a name that merely starts like the root
    ]
    replies = [post_reload(url, p) for p in paths]
    assert [r.status_code for r in replies] == [403] * len(paths), [r.text for r in replies]
    # Byte-identical bodies: nothing tells a caller whether the path exists.
    assert {r.content for r in replies} == {replies[0].content}
    assert replies[0].json()["error"]["message"] == RELOAD_FORBIDDEN_MESSAGE
    assert engine.reloads == []


def test_folders_inside_a_root_reload_as_their_resolved_path(rooted):
    url, engine, root, _ = rooted
    (root / "step-1" / "marker").write_text("step-1")
    direct = post_reload(url, root / "step-1")
    via_link = post_reload(url, root / "link_in")
    via_dots = post_reload(url, root / "step-1" / ".." / "step-1")
    missing = post_reload(url, root / "step-2")
    assert [direct.status_code, via_link.status_code, via_dots.status_code] == [200] * 3
    assert loaded(engine) == [("step-1", {"marker": b"step-1"})] * 3  # the engine never sees the link or the dots
    assert missing.status_code == 400 and "not a folder" in missing.json()["error"]["message"]


def test_a_root_reached_through_a_symlink_and_several_roots(tmp_path):
    real, other = tmp_path / "real", tmp_path / "other"
    (real / "step").mkdir(parents=True)
    (other / "step").mkdir(parents=True)
    (real / "step" / "marker").write_text("real")
    (other / "step" / "marker").write_text("other")
    (tmp_path / "alias").symlink_to(real)
    engine = FakeEngine()
    with serve_in_thread(create_app(engine, "fake", reload_roots=[tmp_path / "alias", other])) as url:
        replies = [post_reload(url, p) for p in (tmp_path / "alias" / "step", real / "step", other / "step")]
    assert [r.status_code for r in replies] == [200] * 3, [r.text for r in replies]
    assert loaded(engine) == [("step", {"marker": b"real"})] * 2 + [("step", {"marker": b"other"})]


def test_a_root_may_not_exist_yet_but_may_not_be_a_file(tmp_path):
    # The training run root is often created after the server starts.
    engine = FakeEngine()
    with serve_in_thread(create_app(engine, "fake", reload_roots=[tmp_path / "later"])) as url:
        (tmp_path / "later" / "weights_sync").mkdir(parents=True)
        assert post_reload(url, tmp_path / "later" / "weights_sync").status_code == 200
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="reload root .* is not a folder"):
        create_app(FakeEngine(), "fake", reload_roots=[tmp_path / "file"])


def test_a_nul_in_the_path_is_a_400_not_a_500(tmp_path):
    with serve_in_thread(create_app(FakeEngine(), "fake", reload_roots=[tmp_path])) as url:
        r = post_reload(url, f"{tmp_path}/a\x00b")
    assert r.status_code == 400 and "NUL" in r.json()["error"]["message"]


def test_a_link_out_of_the_roots_anywhere_in_the_folder_is_a_403(rooted, tmp_path):
    # The engine follows links: a folder inside a root whose weights file links elsewhere would load
    # that file, so every entry (at any depth, through linked folders too) must resolve inside a root.
    url, engine, root, outside = rooted
    (outside / "model.safetensors").write_bytes(b"not the served weights")
    file_link = root / "file_link"
    file_link.mkdir()
    (file_link / "config.json").write_text("{}")
    (file_link / "model.safetensors").symlink_to(outside / "model.safetensors")
    nested = root / "nested"
    (nested / "sub").mkdir(parents=True)
    (nested / "sub" / "weights.bin").symlink_to(outside / "model.safetensors")
    through_inner_link = root / "through_inner_link"
    through_inner_link.mkdir()
    (through_inner_link / "shards").symlink_to(nested)  # a link inside the root, to a folder with a link out
    replies = {p.name: post_reload(url, p) for p in (file_link, nested, through_inner_link)}
    assert {name: r.status_code for name, r in replies.items()} == dict.fromkeys(replies, 403)
    messages = {name: r.json()["error"]["message"] for name, r in replies.items()}
    assert "'model.safetensors', a link that leads outside" in messages["file_link"]
    assert "'sub/weights.bin'" in messages["nested"] and "'shards/sub/weights.bin'" in messages["through_inner_link"]
    assert engine.reloads == []


def test_links_inside_the_roots_and_link_loops_are_fine(rooted):
    url, engine, root, _ = rooted
    step = root / "step-1"
    (root / "blob").write_text("weights")
    (step / "model.safetensors").symlink_to(root / "blob")  # a Hugging Face cache snapshot looks like this
    (step / "loop").symlink_to(step)  # walked once, not forever
    r = post_reload(url, step)
    assert r.status_code == 200, r.text
    assert loaded(engine) == [("step-1", {"model.safetensors": b"weights"})]  # the loop walked once


def test_a_fifo_and_a_dangling_link_in_the_folder_are_skipped_not_waited_on(rooted):
    # The folder is copied from files it opens: opening a FIFO for reading would wait for a writer for ever.
    url, engine, root, _ = rooted
    step = root / "step-1"
    os.mkfifo(step / "pipe")
    (step / "dangling").symlink_to(root / "nowhere")
    (step / "config.json").write_text("{}")
    r = post_reload(url, step)
    assert r.status_code == 200, r.text
    assert loaded(engine) == [("step-1", {"config.json": b"{}"})]


def test_a_path_the_os_refuses_is_a_400_with_a_json_error(rooted):
    # ENAMETOOLONG used to escape as a plain-text 500 and a reset connection.
    url, engine, root, _ = rooted
    too_long = root / ("a" * 300)
    inside = post_reload(url, too_long)
    below = post_reload(url, too_long / "step")
    outside = post_reload(url, Path("/") / ("a" * 300))
    for r in (inside, below):
        assert r.status_code == 400, r.text
        assert "cannot be read on the server's machine: File name too long" in r.json()["error"]["message"]
    assert outside.status_code == 403  # outside the roots nothing is looked at, as for any other path
    assert engine.reloads == []


def test_a_folder_changed_while_the_reload_waits_is_checked_again_before_loading(tiny, tmp_path, monkeypatch):
    # A reload first waits for in-flight generations (minutes, behind long ones); files swapped in the
    # meantime must be checked, not loaded because the folder looked fine when the request came in.
    first_check_done = threading.Event()
    check = ReloadPolicy.check

    def check_and_signal(self, path):
        folder = check(self, path)
        first_check_done.set()
        return folder

    monkeypatch.setattr(ReloadPolicy, "check", check_and_signal)
    engine = HeldEngine()
    app = create_app(
        engine, "tiny", reload_roots=[tmp_path], model_config=AutoConfig.from_pretrained(tiny).to_dict()
    )
    folder = checkpoint(tiny, tmp_path / "step-1", tokenizer=False)
    with serve_in_thread(app) as url, ThreadPoolExecutor(2) as pool:
        try:
            held = pool.submit(post, url, {"prompt": [HOLD_TOKEN], "max_tokens": 1})
            wait_until(lambda: "held_generate_start" in engine.events)
            reload = pool.submit(post_reload, url, folder)
            assert first_check_done.wait(timeout=10)  # checked, now waiting for the held generation
            wider = {**json.loads((folder / "config.json").read_text()), "hidden_size": 64}
            (folder / "config.json").write_text(json.dumps(wider))
        finally:
            engine.release.set()
        r = reload.result(timeout=30)
        assert held.result(timeout=30).status_code == 200
    assert r.status_code == 409, r.text
    assert "hidden_size: 64 (served: 32)" in r.json()["error"]["message"]
    assert "reload_start" not in engine.events and engine.reloads == []


def test_hf_engine_refuses_to_load_another_architecture_and_keeps_serving(tiny, tmp_path, one_torch_thread):
    # The engine's own check of what it read: whatever a caller checked before, another architecture
    # (here: wider layers) never replaces the served model.
    engine = HFEngine.from_pretrained(tiny, device="cpu")
    served = engine.model
    wider = save_tiny_model(tmp_path / "wider", layers=1, hidden=64, heads=4, kv_heads=2, intermediate=64)
    with pytest.raises(EngineError, match="other weight names or shapes than the served one"):
        engine.reload_from_path(wider)
    assert engine.model is served
    same = save_tiny_model(tmp_path / "same", layers=1, hidden=32, heads=4, kv_heads=2, intermediate=64, seed=5)
    engine.reload_from_path(same)
    assert engine.model is not served


# ------------------------------------------------------------------------- architecture and vocabulary


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return save_tiny_model(
        tmp_path_factory.mktemp("tiny") / "model", layers=1, hidden=32, heads=4, kv_heads=2, intermediate=64
    )


def checkpoint(tiny: Path, folder: Path, tokenizer: bool = True, **config_changes) -> Path:
    """A reload folder: the tiny model's config.json (with changes) and, optionally, its tokenizer."""
    folder.mkdir(parents=True)
    config = {**json.loads((tiny / "config.json").read_text()), **config_changes}
    (folder / "config.json").write_text(json.dumps(config))
    for name in TOKENIZER_FILES if tokenizer else ():
        shutil.copy(tiny / name, folder / name)
    return folder


@pytest.fixture
def checked(tiny, tmp_path):
    """A server of the tiny model's config and tokenizer (over FakeEngine), reloading from tmp_path."""
    engine = FakeEngine()
    app = create_app(
        engine,
        "tiny",
        reload_roots=[tmp_path],
        tokenizer=AutoTokenizer.from_pretrained(tiny),
        model_config=AutoConfig.from_pretrained(tiny).to_dict(),
    )
    with serve_in_thread(app) as url:
        yield url, engine


def test_a_checkpoint_of_the_served_model_reloads(checked, tiny, tmp_path, monkeypatch):
    url, engine = checked
    loads = []
    load = AutoTokenizer.from_pretrained
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, **k: loads.append(a) or load(*a, **k))
    step_1, step_2 = checkpoint(tiny, tmp_path / "step-1"), checkpoint(tiny, tmp_path / "step-2")
    no_tokenizer = checkpoint(tiny, tmp_path / "weights_only", tokenizer=False)
    replies = [post_reload(url, p) for p in (step_1, step_2, no_tokenizer)]
    assert [r.status_code for r in replies] == [200] * 3, [r.text for r in replies]
    assert [name for name, _ in loaded(engine)] == [step_1.name, step_2.name, no_tokenizer.name]
    # Every training step writes the same tokenizer files: they are loaded and compared only once.
    assert len(loads) == 1


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"vocab_size": 1024}, "vocab_size: 1024 (served: 512)"),
        ({"hidden_size": 64}, "hidden_size: 64 (served: 32)"),
        ({"num_hidden_layers": 2, "layer_types": ["full_attention"] * 2}, "num_hidden_layers: 2 (served: 1)"),
        ({"num_attention_heads": 8}, "num_attention_heads: 8"),
        ({"num_key_value_heads": 4}, "num_key_value_heads: 4"),
        ({"intermediate_size": 128}, "intermediate_size: 128"),
        ({"head_dim": 16}, "head_dim: 16 (served: 8)"),
        ({"tie_word_embeddings": False}, "tie_word_embeddings: False (served: True)"),
        (
            {"model_type": "llama", "architectures": ["LlamaForCausalLM"]},
            "model_type: 'llama' (served: 'qwen3')",
        ),
        ({"architectures": ["Qwen3ForSequenceClassification"]}, "architectures"),
        ({"model_type": "no_such_model"}, "does not load as the served model's config"),
    ],
)
def test_a_folder_of_another_architecture_is_a_409(checked, tiny, tmp_path, changes, words):
    url, engine = checked
    r = post_reload(url, checkpoint(tiny, tmp_path / "other", **changes))
    assert r.status_code == 409, r.text
    message = r.json()["error"]["message"]
    assert words in message and "restart memrl serve on the new model" in message
    assert engine.reloads == []


def test_a_folder_with_another_vocabulary_is_a_409(checked, tiny, tmp_path):
    url, engine = checked
    folder = checkpoint(tiny, tmp_path / "other_vocab", tokenizer=False)
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    tokenizer.add_tokens(["<not_served>"])
    tokenizer.save_pretrained(folder)
    r = post_reload(url, folder)
    assert r.status_code == 409, r.text
    message = r.json()["error"]["message"]
    assert "different vocabulary" in message and "'<not_served>'" in message
    assert engine.reloads == []


def test_a_folder_without_config_is_a_400(checked, tmp_path):
    url, engine = checked
    (tmp_path / "empty").mkdir()
    r = post_reload(url, tmp_path / "empty")
    assert r.status_code == 400 and "has no config.json" in r.json()["error"]["message"]
    assert engine.reloads == []


def test_the_served_config_defaults_to_the_engines_own(tiny, tmp_path):
    # HFEngine carries model.config: create_app checks against it without being handed a config.
    engine = FakeEngine()
    engine.model = SimpleNamespace(config=AutoConfig.from_pretrained(tiny))
    with serve_in_thread(create_app(engine, "tiny", reload_roots=[tmp_path])) as url:
        same = post_reload(url, checkpoint(tiny, tmp_path / "same"))
        wider = post_reload(url, checkpoint(tiny, tmp_path / "wider", hidden_size=64))
    assert same.status_code == 200, same.text
    assert wider.status_code == 409 and "hidden_size" in wider.text


# ---------------------------------------------------------------------------------------- command line


def test_reload_roots_reach_serve_from_memrl_serve(monkeypatch, tiny):
    from memrl.cli import app

    seen: list[dict] = []
    monkeypatch.setattr(server, "serve", lambda model, **options: seen.append(options))
    runner = CliRunner()
    args = ["serve", "--model", str(tiny), "--reload-root", "/runs/a", "--reload-root", "/runs/b"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert seen[0]["reload_roots"] == [Path("/runs/a"), Path("/runs/b")]
    help_text = runner.invoke(app, ["serve", "--help"], terminal_width=200).output
    assert "--reload-root" in help_text and "reloads disabled" in help_text


def one_line_exit_2(output: str) -> str:
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), output
    return lines[0]


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--port", "99999"], "--port 99999 is not a TCP port"),
        (["--port", "-1"], "--port -1 is not a TCP port"),
        (["--reload-root", "{file}"], "is not a folder; pass the folder that holds the weights"),
        (["--log-level", "loud"], "--log-level 'loud' is not one of"),
        (["--shutdown-timeout-s", "-1"], "--shutdown-timeout-s must be >= 0"),
    ],
)
def test_bad_serve_options_are_one_line_and_exit_2_before_the_model_loads(monkeypatch, tiny, tmp_path, args, words):
    from memrl.cli import app

    loads = []
    monkeypatch.setattr(server, "_load_engine", lambda *a: loads.append(a) or FakeEngine())
    (tmp_path / "file").write_text("x")
    args = [a.replace("{file}", str(tmp_path / "file")) for a in args]
    result = CliRunner().invoke(app, ["serve", "--model", str(tiny), *args])
    assert result.exit_code == 2, result.output
    assert words in one_line_exit_2(result.output)
    assert loads == []  # refused before the model loads (minutes for a large one), not after


def test_an_engine_factory_that_is_not_an_import_path_is_one_line(tiny):
    from memrl.cli import app

    result = CliRunner().invoke(app, ["serve", "--model", str(tiny), "--engine", "nomodule"])
    assert result.exit_code == 2
    assert "'nomodule' is not an import path" in one_line_exit_2(result.output)

