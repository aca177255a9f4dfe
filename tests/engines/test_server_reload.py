"""`POST /v1/reload_weights` of `memrl serve`: which folders it may load (--reload-root), and that a
reload keeps the served model's architecture and vocabulary. FakeEngine records the reloads; the
folders hold a real tiny model's config and tokenizer (no weights: FakeEngine never loads them)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from transformers import AutoConfig, AutoTokenizer
from typer.testing import CliRunner

from memrl.engines import server
from memrl.engines.reload_policy import RELOAD_DISABLED_MESSAGE, RELOAD_FORBIDDEN_MESSAGE
from memrl.engines.server import create_app
from memrl.tiny import save_tiny_model

sys.path.insert(0, str(Path(__file__).parent))  # FakeEngine & co. live in the server's test file
from test_server import FakeEngine, serve_in_thread  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def post_reload(url: str, path) -> httpx.Response:
    return httpx.post(url + "/v1/reload_weights", json={"path": str(path)}, timeout=30)


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
    direct = post_reload(url, root / "step-1")
    via_link = post_reload(url, root / "link_in")
    via_dots = post_reload(url, root / "step-1" / ".." / "step-1")
    missing = post_reload(url, root / "step-2")
    assert [direct.status_code, via_link.status_code, via_dots.status_code] == [200] * 3
    assert engine.reloads == [str(root / "step-1")] * 3  # the engine never sees the link or the dots
    assert missing.status_code == 400 and "not a folder" in missing.json()["error"]["message"]


def test_a_root_reached_through_a_symlink_and_several_roots(tmp_path):
    real, other = tmp_path / "real", tmp_path / "other"
    (real / "step").mkdir(parents=True)
    (other / "step").mkdir(parents=True)
    (tmp_path / "alias").symlink_to(real)
    engine = FakeEngine()
    with serve_in_thread(create_app(engine, "fake", reload_roots=[tmp_path / "alias", other])) as url:
        replies = [post_reload(url, p) for p in (tmp_path / "alias" / "step", real / "step", other / "step")]
    assert [r.status_code for r in replies] == [200] * 3, [r.text for r in replies]
    assert engine.reloads == [str(real / "step"), str(real / "step"), str(other / "step")]


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
    assert engine.reloads == [str(step_1), str(step_2), str(no_tokenizer)]
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
