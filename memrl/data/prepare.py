"""`memrl prepare-data`: write the prepared data folder (questions, id lists, RULER files, manifests).

Layout of OUT (`--out`, default $DATA_DIR):
    hotpotqa_train.jsonl  hotpotqa_heldout.jsonl  train_ids.txt  heldout_ids.txt
    [train_pass_counts.json]  [answerable_without_context_ids.txt]  manifest.json
    ruler_hqa/eval_{N}.json + manifest.json     (published RULER-HQA, normalized)
    ruler_built/eval_{N}.json + manifest.json   (RULER-style sets built offline from HotpotQA)

Same inputs and seed give byte-identical files (the manifest records the arguments, not the output path).
Pass@k: prepare candidates (`--num-train 4000`), run `memrl pass-at-k` over them, prepare again with the
same seed and `--pass-counts`; the held-out set does not change (drawn first, from all ids). With
`--drop-answerable-without-context` (MemAgent's filter2.py), training draws only candidates that a
`pass-at-k --no-context` run judged and never solved.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from tqdm import tqdm

from memrl.data.hotpotqa import (
    HOTPOTQA_REPO,
    HOTPOTQA_REVISION,
    HotpotExample,
    SelectionError,
    load_hotpotqa_file,
    load_hotpotqa_hub,
    read_pass_counts,
    select_by_pass_counts,
    select_by_seed,
    select_heldout,
    to_question_record,
)
from memrl.data.manifest import MANIFEST_NAME, refuse_inputs_as_outputs, sha256_file, write_manifest
from memrl.data.records import write_jsonl
from memrl.data.ruler_hqa import (
    RULER_REPO,
    RULER_REVISION,
    build_ruler_set,
    download_ruler_file,
    read_ruler_file,
    ruler_filename,
    write_ruler_file,
)
from memrl.io import atomic_write_json, atomic_write_text

DEFAULT_SEED = 42
TRAIN_FILE, HELDOUT_FILE = "hotpotqa_train.jsonl", "hotpotqa_heldout.jsonl"
TRAIN_IDS, HELDOUT_IDS, PASS_COUNTS_FILE = "train_ids.txt", "heldout_ids.txt", "train_pass_counts.json"
ANSWERABLE_IDS = "answerable_without_context_ids.txt"
RULER_DIR, BUILT_RULER_DIR = "ruler_hqa", "ruler_built"


def _created_by(command: str) -> str:
    try:
        version = metadata.version("memrl")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return f"memrl {version} prepare-data {command}"


def _records(examples: Sequence[HotpotExample], ids: Sequence[str], seed: int, desc: str):
    by_id = {e.id: e for e in examples}
    return [to_question_record(by_id[qid], seed) for qid in tqdm(ids, desc=desc, unit="q", leave=False,
                                                                 disable=len(ids) < 2000)]


def _check_known(counts: dict[str, int], all_ids: set[str], what: str) -> None:
    unknown = [qid for qid in counts if qid not in all_ids]
    if unknown:
        raise SelectionError(f"{len(unknown)} ids of the {what} are not in the data (e.g. {unknown[0]!r}); "
                             f"use the same HotpotQA source the candidates came from")


def prepare_hotpotqa(examples: Sequence[HotpotExample], out: str | Path, *, num_train: int = 1000,
                     num_heldout: int = 500, seed: int = DEFAULT_SEED,
                     pass_counts: dict[str, int] | None = None, pass_k: int = 8,
                     no_context_counts: dict[str, int] | None = None,
                     args: dict[str, Any] | None = None) -> dict[str, Path]:
    """Choose held-out ids (by seed, from all ids), then training ids from the rest (by seed, or by
    Pass@k counts: 0 < passes < k), only among the ids `no_context_counts` holds with 0 passes if given;
    write the questions, id lists and manifest into `out`."""
    out = Path(out)
    all_ids = [e.id for e in examples]
    heldout = select_heldout(all_ids, num_heldout, seed)
    heldout_set = set(heldout)
    usable = set(all_ids) - heldout_set  # the ids training may draw from
    allowed = None
    if no_context_counts is not None:
        _check_known(no_context_counts, set(all_ids), "no-context pass counts")
        allowed = {qid for qid, c in no_context_counts.items() if c == 0}
        usable &= allowed
    if pass_counts is None:
        train = select_by_seed(usable, num_train, seed)
    else:
        _check_known(pass_counts, set(all_ids), "pass counts")
        candidates = {qid: c for qid, c in pass_counts.items() if qid in usable}
        train = select_by_pass_counts(candidates, pass_k, num_train, seed=seed)
    written: dict[str, int | None] = {
        TRAIN_FILE: write_jsonl(out / TRAIN_FILE, _records(examples, train, seed, "train questions")),
        HELDOUT_FILE: write_jsonl(out / HELDOUT_FILE, _records(examples, heldout, seed, "held-out questions")),
    }
    atomic_write_text(out / TRAIN_IDS, "".join(i + "\n" for i in train))
    atomic_write_text(out / HELDOUT_IDS, "".join(i + "\n" for i in heldout))
    written.update({TRAIN_IDS: len(train), HELDOUT_IDS: len(heldout)})
    if pass_counts is not None:
        atomic_write_json(out / PASS_COUNTS_FILE, {
            "k": pass_k, "rule": f"0 < passes < {pass_k}", "num_candidates": len(pass_counts),
            "excluded_as_heldout": len(pass_counts) - len(candidates), "selected": len(train),
            "train_pass_counts": {qid: pass_counts[qid] for qid in train}, "pass_counts": pass_counts})
        written[PASS_COUNTS_FILE] = len(train)
    if no_context_counts is not None:
        candidates_seen = [i for i in all_ids if i not in heldout_set]
        answerable = [i for i in candidates_seen if no_context_counts.get(i, 0) > 0]
        atomic_write_text(out / ANSWERABLE_IDS, "".join(i + "\n" for i in answerable))
        written[ANSWERABLE_IDS] = len(answerable)
        args = {**(args or {}), "no_context_filter": {
            "rule": "train only on candidates judged without the document and never solved (passes = 0)",
            "judged": sum(i in no_context_counts for i in candidates_seen), "answerable_dropped": len(answerable),
            "unjudged_dropped": sum(i not in no_context_counts for i in candidates_seen), "kept": len(allowed or ())}}
    write_manifest(out, written, _created_by("hotpotqa"), args or {})
    return {name: out / name for name in written}


def build_ruler_files(examples: Sequence[HotpotExample], out: str | Path, num_docs: Sequence[int], *,
                      seed: int = DEFAULT_SEED, limit: int | None = None, layout: str = "memrl",
                      args: dict[str, Any] | None = None) -> dict[str, Path]:
    """RULER-style `eval_{N}.json` for each N, built offline from a HotpotQA pool, into `out/ruler_built/`;
    with `limit`, only the first `limit` questions get records (fillers still come from all of them)."""
    folder = Path(out) / BUILT_RULER_DIR
    questions = examples[:limit] if limit is not None else examples
    written: dict[str, int | None] = {
        ruler_filename(n): write_ruler_file(folder / ruler_filename(n),
                                            build_ruler_set(questions, n, seed, pool=examples, layout=layout))
        for n in num_docs}
    # The layout decides every document position, so the files' manifest must say which one made them.
    write_manifest(folder, written, _created_by("build-ruler"), {**(args or {}), "layout": layout})
    return {name: folder / name for name in written}


# ---------------------------------------------------------------------------------------------- commands
# `memrl prepare-data ...` (memrl.cli): load the sources, record where they came from, write the folder.

def read_no_context_counts(path: str | Path) -> tuple[dict[str, int], int | None]:
    """The counts of a `memrl pass-at-k --no-context` file (refusing one made with the documents)."""
    counts = read_pass_counts(path)  # unreadable or malformed files fail here, with its message
    raw = json.loads(Path(path).read_text(encoding="utf-8"))
    if not (isinstance(raw, dict) and raw.get("no_context") is True):
        raise SelectionError(f"{path} was not written by `memrl pass-at-k --no-context` "
                             f"(it has no \"no_context\": true); "
                             f"pass-counts with the documents cannot tell which questions need them")
    return counts


def hotpotqa_command(out: str | Path, *, from_file: str | Path | None = None, split: str = "train",
                     num_train: int = 1000, num_heldout: int = 500, seed: int = DEFAULT_SEED,
                     pass_counts: str | Path | None = None, pass_k: int = 8, revision: str = HOTPOTQA_REVISION,
                     cache_dir: str | None = None,
                     drop_answerable_without_context: str | Path | None = None) -> dict[str, Path]:
    """`prepare-data hotpotqa`: HotpotQA distractor (a local official JSON, else the hub) through
    `prepare_hotpotqa`; the manifest records the source (its SHA-256 or hub revision) and the arguments."""
    refuse_inputs_as_outputs([Path(out) / name for name in (TRAIN_FILE, HELDOUT_FILE, TRAIN_IDS, HELDOUT_IDS,
                                                            PASS_COUNTS_FILE, ANSWERABLE_IDS, MANIFEST_NAME)],
                             [("--from-file", from_file), ("--pass-counts", pass_counts),
                              ("--drop-answerable-without-context", drop_answerable_without_context)])
    if from_file is not None:
        examples = load_hotpotqa_file(from_file)
        source: dict[str, Any] = {"file": str(from_file), "sha256": sha256_file(from_file)}
    else:
        examples = load_hotpotqa_hub(split, revision, cache_dir)
        source = {"hub": HOTPOTQA_REPO, "config": "distractor", "revision": revision, "split": split}
    counts = None
    if pass_counts is not None:
        counts, _ = read_pass_counts(pass_counts, pass_k)
        source["pass_counts_sha256"] = sha256_file(pass_counts)
    no_context = None
    args = {"source": source, "num_train": num_train, "num_heldout": num_heldout, "seed": seed,
            "pass_counts": str(pass_counts) if pass_counts else None, "pass_k": pass_k}
    if drop_answerable_without_context is not None:
        no_context, no_context_k = read_no_context_counts(drop_answerable_without_context)
        args["drop_answerable_without_context"] = {"file": str(drop_answerable_without_context), "k": no_context_k,
                                                   "sha256": sha256_file(drop_answerable_without_context)}
    return prepare_hotpotqa(examples, out, num_train=num_train, num_heldout=num_heldout, seed=seed,
                            pass_counts=counts, pass_k=pass_k, no_context_counts=no_context, args=args)


def ruler_hqa_command(out: str | Path, lengths: Sequence[int], *, from_dir: str | Path | None = None,
                      pool: str | Path | None = None, revision: str = RULER_REVISION,
                      cache_dir: str | None = None) -> dict[str, Path]:
    """`prepare-data ruler-hqa`: `eval_{N}.json` from `from_dir` (or the hub), validated and normalized, into
    `out/ruler_hqa/`; the manifest records the source, its files' SHA-256 and the arguments."""
    folder = Path(out) / RULER_DIR
    refuse_inputs_as_outputs([folder / name for name in (*map(ruler_filename, lengths), MANIFEST_NAME)],
                             [("--pool", pool), *(("--from-dir", Path(from_dir) / ruler_filename(n)) for n in lengths
                                                  if from_dir is not None)])
    written: dict[str, int | None] = {}
    sources: dict[str, str] = {}
    for n in tqdm(lengths, desc="ruler-hqa files", unit="file", leave=False):
        src = (Path(from_dir) / ruler_filename(n) if from_dir is not None
               else download_ruler_file(n, revision, cache_dir))
        records = read_ruler_file(src, pool=pool)
        written[ruler_filename(n)] = write_ruler_file(folder / ruler_filename(n), records)
        sources[ruler_filename(n)] = sha256_file(src)
    args = {"source": str(from_dir) if from_dir else {"hub": RULER_REPO, "revision": revision},
            "lengths": list(lengths), "pool": str(pool) if pool else None, "source_sha256": sources}
    write_manifest(folder, written, _created_by("ruler-hqa"), args)
    return {name: folder / name for name in written}


def build_ruler_command(from_file: str | Path, out: str | Path, num_docs: Sequence[int], *, seed: int = DEFAULT_SEED,
                        limit: int | None = None, layout: str = "memrl") -> dict[str, Path]:
    """`prepare-data build-ruler`: `build_ruler_files` over a local HotpotQA pool, its SHA-256 recorded."""
    refuse_inputs_as_outputs([Path(out) / BUILT_RULER_DIR / name for name in (*map(ruler_filename, num_docs),
                                                                              MANIFEST_NAME)],
                             [("--from-file", from_file)])
    examples = load_hotpotqa_file(from_file)
    args = {"source": {"file": str(from_file), "sha256": sha256_file(from_file)}, "num_docs": list(num_docs),
            "seed": seed, "limit": limit}
    return build_ruler_files(examples, out, num_docs, seed=seed, limit=limit, layout=layout, args=args)
