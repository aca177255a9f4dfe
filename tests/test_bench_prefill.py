"""bench/prefill.py runs end to end (on the tiny tokenizer and a toy shape): a bench that no test runs broke
unnoticed when RolloutContext lost its stop ids. Its figures are not checked here (bench/ rule: no timings)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_bench_prefill_prints_its_table_and_ratios(tmp_path, monkeypatch, capsys):
    from memrl.tiny import build_tiny_tokenizer

    monkeypatch.syspath_prepend(str(BENCH))
    import prefill

    build_tiny_tokenizer().save_pretrained(str(tmp_path))
    # A toy seed shape: 1 question x n = 2, 2 chunks of 24 tokens; the warm-up derives from it too.
    monkeypatch.setitem(prefill.SHAPES, "seed", prefill.Shape("seed", 1, 2, 2, 24, 8, 4))
    monkeypatch.setattr(sys, "argv", ["prefill.py", "--quick", "--tokenizer", str(tmp_path)])
    asyncio.run(prefill.main_async(prefill.parse_args()))
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("seed ") and "computed/requested" not in line]
    assert {(row[1], row[2]) for row in rows} == {(layout, sharing) for layout in ("memagent", "chunk_first")
                                                  for sharing in ("on", "off")}
    assert out.count("computed/requested") == 2
