"""bench/train.py --share-prefixes runs end to end on a toy shape and prints its four result lines (its figures
are not checked here: bench/ rule, no timings)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.mark.slow  # ~12 s here: eight optimizer steps of a tiny model
def test_bench_train_share_prefixes_prints_a_line_per_shape_and_layout(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCH))
    import train
    import train_shared

    # toy shapes (quick divides the limits by 4 and 8): one question x n = 3 (seed), 2 (official)
    monkeypatch.setitem(train_shared.SHAPES, "seed", train_shared.Shape(1, 3, 2, 160, 16, 8))
    monkeypatch.setitem(train_shared.SHAPES, "official", train_shared.Shape(1, 2, 1, 160, 32, 32))
    monkeypatch.setattr(sys, "argv", ["train.py", "--share-prefixes", "--share-model", "tiny", "--quick"])
    train.main()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("train prefix sharing")]
    pattern = re.compile(r"train prefix sharing (memagent|chunk_first) (seed|official): computed/requested "
                         r"(\d\.\d\d), step \d+\.\d\dx, peak memory (\d+\.\d\d|nan)x")
    found = {(m[1], m[2]): float(m[3]) for m in map(pattern.fullmatch, lines) if m}
    assert len(lines) == 8 and len(found) == 4  # each printed after its table and again in the summary
    assert all(0 < ratio < 1 for ratio in found.values())  # every layout shares something
    assert found[("chunk_first", "seed")] < found[("memagent", "seed")]  # chunk_first shares the chunk too
