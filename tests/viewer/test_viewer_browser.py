"""`memrl view` pages opened in a real headless Chromium (Debian's `chromium`, installed by .ci/run): the DOM
after the page's script ran, read with `--dump-dom`, and a screenshot. Nothing is downloaded at run time.

Without Chromium these tests fail under CI (CI=true) and skip, saying why, elsewhere.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import quote

import pytest
from viewer_fixtures import INJECTED, N_QUESTIONS, eval_pair, single_turn_eval, train_run

from memrl.eval.compare import compare_results
from memrl.eval.results import RESULTS_FILE, read_results
from memrl.viewer.build import write_viewer

pytestmark = pytest.mark.slow  # a browser start per check (~3-10 s each here); CI runs them
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
BROWSER_TIMEOUT_S = 120
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


@pytest.fixture(scope="module")
def browser() -> str:
    found = next((path for name in BROWSERS if (path := shutil.which(name))), None)
    if found is None:
        message = (f"no headless browser ({', '.join(BROWSERS)}) on PATH; install Debian's: "
                   f"apt-get install -y --no-install-recommends chromium (.ci/run does)")
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)
    return found


def run_browser(browser: str, page: Path, fragment: str, tmp_path: Path, *args: str) -> str:
    profile = tmp_path / f"profile-{len(list(tmp_path.glob('profile-*')))}"  # one per call: no shared lock
    command = [browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
               f"--user-data-dir={profile}", "--window-size=1400,900", *args, f"{page.resolve().as_uri()}#{fragment}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=BROWSER_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


class Dom(HTMLParser):
    """The dumped DOM: every element (tag, attributes, text inside), by id, and the rows of the question list."""

    def __init__(self, html: str) -> None:
        super().__init__(convert_charrefs=True)
        self.by_id: dict[str, dict] = {}
        self.rows: list[dict] = []  # the id cell of each row of the question list
        self.tags: list[tuple[str, dict]] = []
        self._open: list[dict] = []
        self._nodes: list[dict] = []
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append((tag, attrs))
        node = {"tag": tag, "attrs": attrs, "text": ""}
        self._nodes.append(node)
        if "id" in attrs:
            self.by_id[attrs["id"]] = node
        if tag in VOID:  # no end tag follows
            return
        if tag == "span" and attrs.get("class") == "id":
            self.rows.append(node)
        self._open.append(node)

    def handle_endtag(self, tag):
        while self._open and self._open.pop()["tag"] != tag:
            pass

    def handle_data(self, data):
        for node in self._open:
            node["text"] += data

    @property
    def title(self) -> str:
        return next(node["text"] for node in self._nodes if node["tag"] == "title")

    def text(self, element_id: str) -> str:
        return self.by_id[element_id]["text"]

    def count(self, outcome: str) -> int:
        return int(self.by_id[f"opt-f-outcome-{outcome}"]["attrs"]["data-count"])


@pytest.fixture(scope="module")
def pages(tiny_tokenizer, tmp_path_factory):
    root = tmp_path_factory.mktemp("view")
    base, trained = eval_pair(tiny_tokenizer, root)
    page, _ = write_viewer(base, trained, root / "compare.html")
    return base, trained, page


def test_question_count_and_flip_counts_equal_compare(browser, pages, tmp_path):
    base, trained, page = pages
    (pair,) = compare_results([base, trained], names=["base", "trained"]).pairs
    dom = Dom(run_browser(browser, page, "", tmp_path, "--dump-dom"))
    assert dom.by_id["memrl-data"] and dom.tags[0][0] == "html"
    assert int(dom.text("n-total")) == int(dom.text("n-match")) == len(dom.rows) == N_QUESTIONS
    assert dom.count("wr") == len(pair.wrong_to_right) == 4 and dom.count("rw") == len(pair.right_to_wrong) == 2
    assert dom.count("rr") == pair.both_right and dom.count("ww") == pair.both_wrong
    for outcome, ids in (("wr", pair.wrong_to_right), ("rw", pair.right_to_wrong)):
        filtered = Dom(run_browser(browser, page, f"outcome={outcome}", tmp_path, "--dump-dom"))
        assert int(filtered.text("n-match")) == len(ids)
        assert [row["text"] for row in filtered.rows] == ids  # the same questions, in the same order


def test_html_in_model_outputs_is_shown_as_text_and_never_run(browser, pages, tmp_path):
    *_, page = pages
    for question in ("q3", "q2"):  # q3: the final answer; q2: a memory
        html = run_browser(browser, page, f"q={question}", tmp_path, "--dump-dom")
        dom = Dom(html)
        # Had the injected script or onerror run, the title or the body's attributes would show it.
        assert dom.title.startswith("memrl view:") and "PWNED" not in dom.title
        body = next(attrs for tag, attrs in dom.tags if tag == "body")
        assert body.get("data-ready") == "1" and "data-pwned" not in body
        assert not any(tag == "img" for tag, _ in dom.tags)
        assert [attrs.get("type") for tag, attrs in dom.tags if tag == "script"] == ["application/json", None]
        assert INJECTED in dom.text("detail")  # the whole text, verbatim, as text
        assert "&lt;script&gt;document.title='PWNED'&lt;/script&gt;" in html  # serialized as escaped text
    # q2's memories note the gold: highlighted, and the first memory is all new words.
    marked = [n for n in dom._nodes if n["tag"] == "span" and "gold" in n["attrs"].get("class", "").split()]
    assert any(n["text"] == "alpha2" and "add" in n["attrs"]["class"] for n in marked)


def test_filters_by_search_chunks_and_truncation(browser, pages, tmp_path):
    base, trained, page = pages
    lines = read_results(trained / RESULTS_FILE)
    dom = Dom(run_browser(browser, page, "search=" + quote("what is item 1?"), tmp_path, "--dump-dom"))
    assert [row["text"] for row in dom.rows] == ["q1"]
    dom = Dom(run_browser(browser, page, "cmin=3&trunc=none", tmp_path, "--dump-dom"))
    untruncated = [line["id"] for line in lines if line["num_chunks"] >= 3 and not line["document_truncated"]
                   and not line["memory_truncations"] and line["status"] != "truncated"]
    assert 0 < len(untruncated) < len(lines) and [row["text"] for row in dom.rows] == untruncated


def test_a_single_turn_run_shows_its_turn_and_no_chunk_fields(browser, tiny_tokenizer, tmp_path):
    """The second task keeps `Task.view_fields`' default: its page lists every question and shows the answer
    turn, with no chunk count, chunk filter or chunk row (MemAgent's fields)."""
    page, _ = write_viewer(single_turn_eval(tiny_tokenizer, tmp_path))
    dom = Dom(run_browser(browser, page, "q=q2", tmp_path, "--dump-dom"))
    body = next(attrs for tag, attrs in dom.tags if tag == "body")
    assert body.get("data-ready") == "1" and int(dom.text("n-total")) == len(dom.rows) == N_QUESTIONS
    assert dom.count("right") == N_QUESTIONS // 2
    assert "f-cmin" not in dom.by_id and "\\boxed{alpha2}" in dom.text("detail")
    assert not any(n["tag"] == "td" and n["text"] == "chunks" for n in dom._nodes)
    assert "ch" not in next(n["text"] for n in dom._nodes if "num" in n["attrs"].get("class", "").split())


@pytest.fixture(scope="module")
def train_page(tiny_tokenizer, tmp_path_factory):
    return write_viewer(train_run(tiny_tokenizer, tmp_path_factory.mktemp("train")))


def test_screenshot_and_training_steps(browser, pages, train_page, tmp_path):
    *_, page = pages
    shot = tmp_path / "viewer.png"
    run_browser(browser, page, "outcome=wr&q=q4", tmp_path, f"--screenshot={shot}")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    train_page, data = train_page
    dom = Dom(run_browser(browser, train_page, "step=0", tmp_path, "--dump-dom"))
    assert int(dom.text("n-total")) == 8
    steps = dom.text("steps")
    assert "rollout step 0: 1 GRPO groups" in steps
    for item in data["items"]:  # every sample's advantage is in the group's table
        assert f"{item['r'][0]['adv']:.4f}".rstrip("0").rstrip(".") in steps


@pytest.mark.parametrize("fragment", ["outcome=constructor", "trunc=__proto__", "outcome=toString&trunc=hasOwnProperty",
                                      "rmin=abc&cmin=%20&cmax=1e", "step=999", "step=abc&q=nope"])
def test_fragments_the_page_does_not_know_are_ignored(browser, pages, train_page, tmp_path, fragment):
    """An address typed or cut by hand: the page still starts and lists everything (before: a TypeError from
    Object.prototype's keys or a step that does not exist, and an empty list)."""
    for page, total in ((pages[2], N_QUESTIONS), (train_page[0], 8)):
        dom = Dom(run_browser(browser, page, fragment, tmp_path, "--dump-dom"))
        body = next(attrs for tag, attrs in dom.tags if tag == "body")
        assert body.get("data-ready") == "1", fragment
        assert int(dom.text("n-total")) == int(dom.text("n-match")) == total, fragment
