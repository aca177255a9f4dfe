"""`memrl view` at the issue's size: 1,000 questions x 64 memory turns, two eval folders compared.

    python bench/viewer.py                       # ~2-4 min here; --questions 100 for a quick look
    python bench/viewer.py --tokenizer DIR       # e.g. a Qwen3 tokenizer folder: real token counts

Writes two eval folders with memrl's own writer (`memrl.eval.results.sample_line`, the lines `memrl eval`
writes) from synthetic trajectories: each question's document has `--turns` chunks of `--chunk-words`
words, its memory `--memory-words` words, of which ~10% change each turn (so diffs have work to do); the
gold sits in one chunk and stays in the memory from there on. Then it times, in one run:

- `build_s`: `view_data` + `render_html` (Python: gold positions in every memory, JSON);
- `html_mb`: the page's size;
- in headless Chromium (`--dump-dom`), `start_ms`: navigation start to the list rendered (JSON parse
  included), and `open_ms`: rendering one question's 2 x 65 turns with word diffs and gold marks;
- `chunk_golds_ms`: `chunk_gold_hits` on one document (decode + gold search of every chunk), the cost a
  rollout group and an eval question now pay.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from memrl.data.records import QuestionRecord  # noqa: E402
from memrl.eval.results import RESULTS_FILE, sample_line  # noqa: E402
from memrl.memagent.chunking import chunk_context, tokenize_document  # noqa: E402
from memrl.memagent.rollout import chunk_gold_hits  # noqa: E402
from memrl.memagent.task import MemAgentTask  # noqa: E402
from memrl.types import Trajectory, Turn  # noqa: E402
from memrl.viewer.build import render_html, view_data  # noqa: E402

WORDS = [f"w{k}" for k in range(2000)]


def trajectory(tokenizer, rng: random.Random, record: QuestionRecord, chunks, gold_hits, gold_turn: int,
               memory_words: int, right: bool) -> Trajectory:
    memory = [rng.choice(WORDS) for _ in range(memory_words)]
    turns = []
    for i in range(chunks.num_chunks):
        for k in rng.sample(range(memory_words), memory_words // 10):
            memory[k] = rng.choice(WORDS)
        if i == gold_turn:
            memory[0] = record.answers[0]
        ids = tokenizer.encode(" ".join(memory), add_special_tokens=False)
        turns.append(Turn(i, "memory", [0] * (len(ids) + 300), ids, [-0.1] * len(ids), [1] * len(ids), "stop", 10**6))
    answer = f"\\boxed{{{record.answers[0] if right else 'wrong'}}}"
    ids = tokenizer.encode(answer, add_special_tokens=False)
    turns.append(Turn(len(turns), "final", [0] * 300, ids, [-0.1] * len(ids), [1] * len(ids), "stop", 64))
    traj = Trajectory(f"eval:{record.id}:s0", f"eval:{record.id}", 0, turns, answer=answer,
                      metadata={"chunks": chunks.to_metadata(),
                                "memory_lengths": [t.response_length for t in turns[:-1]]})
    traj.metadata["chunk_golds"] = gold_hits
    return traj


def write_evals(tokenizer, root: Path, args) -> tuple[list[Path], float]:
    rng = random.Random(0)
    folders = [root / "base", root / "trained"]
    files = [open(f / RESULTS_FILE, "w", encoding="utf-8") for f in folders if f.mkdir(parents=True) is None]
    gold_ms = []
    for q in range(args.questions):
        gold_chunk = rng.randrange(args.turns)
        words = [rng.choice(WORDS) for _ in range(args.turns * args.chunk_words)]
        words[gold_chunk * args.chunk_words + args.chunk_words // 2] = f"gold{q}"
        record = QuestionRecord(f"q{q:04d}", f"What is the gold of question {q}?", [f"gold{q}"], " ".join(words))
        ids = tokenize_document(tokenizer, record.context)
        chunks = chunk_context(ids, -(-len(ids) // args.turns), args.turns, "head")
        t = time.perf_counter()
        gold_hits = chunk_gold_hits(tokenizer, chunks, record.answers)
        gold_ms.append(1000 * (time.perf_counter() - t))
        for k, f in enumerate(files):
            traj = trajectory(tokenizer, rng, record, chunks, gold_hits, gold_chunk, args.memory_words,
                              rng.random() < 0.3 + 0.3 * k)
            f.write(json.dumps(sample_line(record, traj, 0.0, task=MemAgentTask(), tokenizer=tokenizer),
                               ensure_ascii=False) + "\n")
    for f in files:
        f.close()
    return folders, sorted(gold_ms)[len(gold_ms) // 2]


def browser_times(browser: str, page: Path, question: str, profile: Path) -> tuple[float, float]:
    command = [browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
               f"--user-data-dir={profile}",
               "--dump-dom", f"{page.resolve().as_uri()}#q={question}"]
    dom = subprocess.run(command, capture_output=True, text=True, timeout=600, check=True).stdout
    body = dom[dom.index("<body"):dom.index(">", dom.index("<body"))]

    def attr(name: str) -> float:
        return float(body.split(f'{name}="', 1)[1].split('"', 1)[0])

    return attr("data-start-ms"), attr("data-open-ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--questions", type=int, default=1000)
    parser.add_argument("--turns", type=int, default=64)
    parser.add_argument("--chunk-words", type=int, default=300)
    parser.add_argument("--memory-words", type=int, default=150)
    parser.add_argument("--tokenizer", default=None, help="Tokenizer folder (default: memrl's tiny tokenizer).")
    parser.add_argument("--browser", default=shutil.which("chromium") or shutil.which("google-chrome"))
    args = parser.parse_args()
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    else:
        from memrl.tiny import build_tiny_tokenizer

        tokenizer = build_tiny_tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        t = time.perf_counter()
        (base, trained), gold_ms = write_evals(tokenizer, root, args)
        write_s = time.perf_counter() - t
        t = time.perf_counter()
        html = render_html(view_data(base, trained))
        build_s = time.perf_counter() - t
        page = root / "viewer.html"
        page.write_text(html, encoding="utf-8")
        print(f"{args.questions} questions x {args.turns} turns, 2 evals: "
              f"results.jsonl {(base / RESULTS_FILE).stat().st_size / 1e6:.1f} MB "
              f"each (written in {write_s:.0f} s)")
        print(f"build_s {build_s:.1f}  html_mb {len(html.encode()) / 1e6:.1f}  chunk_golds_ms {gold_ms:.1f} "
              f"(median per document of {args.turns} chunks)")
        if args.browser:
            for repeat in range(3):
                start_ms, open_ms = browser_times(args.browser, page, f"q{repeat:04d}", root / f"profile{repeat}")
                print(f"browser repeat {repeat}: start_ms {start_ms:.0f}  open_ms {open_ms:.0f}")
        else:
            print("no chromium on PATH: browser times not measured")


if __name__ == "__main__":
    main()
