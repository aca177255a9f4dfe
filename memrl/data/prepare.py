"""`memrl prepare-data`: write the prepared data folder (questions, id lists, RULER files, manifests).

Layout of OUT (`--out`, default $DATA_DIR):
    hotpotqa_train.jsonl  hotpotqa_heldout.jsonl  train_ids.txt  heldout_ids.txt
    [train_pass_counts.json]  manifest.json
    ruler_hqa/eval_{N}.json + manifest.json     (published RULER-HQA, normalized)
    ruler_built/eval_{N}.json + manifest.json   (RULER-style sets built offline from HotpotQA)

Same inputs and seed → byte-identical files (the manifest records the arguments, not the output path).
Pass@k workflow: prepare with `--num-train 4000` (candidates), run Pass@k over hotpotqa_train.jsonl,
then prepare again with the same seed and `--pass-counts`: the held-out set does not change, because
it is drawn first, by seed, from all ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from importlib import metadata
from pathlib import Path
from typing import Any

import typer
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
from memrl.data.manifest import (
    atomic_write_json,
    atomic_write_text,
    sha256_file,
    write_manifest,
)
from memrl.data.records import write_jsonl
from memrl.data.ruler_hqa import (
    RULER_LENGTHS,
    RULER_REPO,
    RULER_REVISION,
    build_ruler_set,
    download_ruler_file,
    read_ruler_file,
    ruler_filename,
    write_ruler_file,
)

DEFAULT_SEED = 42
TRAIN_FILE, HELDOUT_FILE = "hotpotqa_train.jsonl", "hotpotqa_heldout.jsonl"
TRAIN_IDS, HELDOUT_IDS, PASS_COUNTS_FILE = "train_ids.txt", "heldout_ids.txt", "train_pass_counts.json"
RULER_DIR, BUILT_RULER_DIR = "ruler_hqa", "ruler_built"


class RulerLayout(StrEnum):
    """`--layout` of build-ruler (memrl.data.ruler_hqa.RULER_LAYOUTS); an Enum, so every typer lists it."""

    memrl = "memrl"
    official = "official"


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


def prepare_hotpotqa(examples: Sequence[HotpotExample], out: str | Path, *, num_train: int = 1000,
                     num_heldout: int = 500, seed: int = DEFAULT_SEED,
                     pass_counts: dict[str, int] | None = None, pass_k: int = 8,
                     args: dict[str, Any] | None = None) -> dict[str, Path]:
    """Choose held-out ids (by seed, from all ids), then training ids from the rest (by seed, or by
    Pass@k counts: 0 < passes < k), and write the questions, id lists and manifest into `out`."""
    out = Path(out)
    all_ids = [e.id for e in examples]
    heldout = select_heldout(all_ids, num_heldout, seed)
    heldout_set = set(heldout)
    if pass_counts is None:
        train = select_by_seed([i for i in all_ids if i not in heldout_set], num_train, seed)
    else:
        unknown = [qid for qid in pass_counts if qid not in set(all_ids)]
        if unknown:
            raise SelectionError(f"{len(unknown)} ids of the pass counts are not in the data (e.g. {unknown[0]!r}); "
                                 f"use the same HotpotQA source the candidates came from")
        candidates = {qid: c for qid, c in pass_counts.items() if qid not in heldout_set}
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
    write_manifest(out, written, _created_by("hotpotqa"), args or {})
    return {name: out / name for name in written}


def prepare_ruler_hqa(out: str | Path, lengths: Sequence[int], *, from_dir: str | Path | None = None,
                      pool: str | Path | None = None, revision: str = RULER_REVISION,
                      cache_dir: str | None = None, args: dict[str, Any] | None = None) -> dict[str, Path]:
    """Read `eval_{N}.json` from `from_dir` (or the hub), validate/normalize, write `out/ruler_hqa/`."""
    folder = Path(out) / RULER_DIR
    written: dict[str, int | None] = {}
    sources: dict[str, str] = {}
    for n in tqdm(lengths, desc="ruler-hqa files", unit="file", leave=False):
        src = Path(from_dir) / ruler_filename(n) if from_dir is not None else download_ruler_file(n, revision, cache_dir)
        records = read_ruler_file(src, pool=pool)
        written[ruler_filename(n)] = write_ruler_file(folder / ruler_filename(n), records)
        sources[ruler_filename(n)] = sha256_file(src)
    write_manifest(folder, written, _created_by("ruler-hqa"), {**(args or {}), "source_sha256": sources})
    return {name: folder / name for name in written}


def build_ruler_files(examples: Sequence[HotpotExample], out: str | Path, num_docs: Sequence[int], *,
                      seed: int = DEFAULT_SEED, limit: int | None = None, layout: str = "memrl",
                      args: dict[str, Any] | None = None) -> dict[str, Path]:
    """RULER-style `eval_{N}.json` for each N, built offline from a HotpotQA pool, into `out/ruler_built/`.

    With `limit`, only the first `limit` questions get records; fillers still come from all of them.
    `layout` is `build_ruler_set`'s (memrl's, or the official builder's); the manifest records it."""
    folder = Path(out) / BUILT_RULER_DIR
    questions = examples[:limit] if limit is not None else examples
    written: dict[str, int | None] = {
        ruler_filename(n): write_ruler_file(folder / ruler_filename(n),
                                            build_ruler_set(questions, n, seed, pool=examples, layout=layout))
        for n in num_docs}
    # The layout decides every document position, so the files' manifest must say which one made them.
    write_manifest(folder, written, _created_by("build-ruler"), {**(args or {}), "layout": layout})
    return {name: folder / name for name in written}


# ---------------------------------------------------------------------------------------------- CLI

OutOption = typer.Option(..., "--out", envvar="DATA_DIR", help="Output data folder (default: $DATA_DIR).")
_MULTI = {"allow_extra_args": True}


def _int_list(values: list[str] | None, extra: list[str], name: str, default: Sequence[int]) -> list[int]:
    """`--lengths 50 200 800`, `--lengths 50,200` or repeated `--lengths`: click sees the trailing
    numbers as extra arguments, so they are collected here."""
    if not values:
        if extra:
            raise typer.BadParameter(f"unexpected arguments {' '.join(extra)}", param_hint=name)
        return list(default)
    items = [p for v in [*values, *extra] for p in v.replace(",", " ").split()]
    try:
        numbers = [int(p) for p in items]
    except ValueError:
        raise typer.BadParameter(f"expected whole numbers, got {' '.join(items)}", param_hint=name) from None
    if any(n <= 0 for n in numbers):
        raise typer.BadParameter("must be positive", param_hint=name)
    return list(dict.fromkeys(numbers))


def _report(paths: dict[str, Path]) -> None:
    for path in paths.values():
        typer.echo(f"wrote {path}")


def register(app: typer.Typer) -> None:
    """Add the `prepare-data` command group (hotpotqa, ruler-hqa, build-ruler) to `app`."""
    group = typer.Typer(help="Download or convert data into a prepared folder with a SHA-256 manifest.",
                        no_args_is_help=True)
    app.add_typer(group, name="prepare-data")
    from memrl.data.synthetic import register_synthetic

    register_synthetic(group)

    @group.command("hotpotqa")
    def hotpotqa_cmd(
        out: Path = OutOption,
        from_file: Path | None = typer.Option(None, help="Local official HotpotQA JSON instead of the hub."),
        split: str = typer.Option("train", help="Hub split (ignored with --from-file)."),
        num_train: int = typer.Option(1000, min=0, help="Training questions (frozen order)."),
        num_heldout: int = typer.Option(500, min=0, help="Held-out questions, disjoint from training."),
        seed: int = typer.Option(DEFAULT_SEED, help="Base seed of id choice and per-question shuffles."),
        pass_counts: Path | None = typer.Option(None, help="JSON {id: passes} of a Pass@k run over candidates."),
        pass_k: int = typer.Option(8, help="k of the Pass@k run (keeps 0 < passes < k)."),
        revision: str = typer.Option(HOTPOTQA_REVISION, help="Hub revision of hotpotqa/hotpot_qa."),
        cache_dir: str | None = typer.Option(None, help="Hub cache folder."),
    ) -> None:
        """HotpotQA distractor → training and held-out questions, id lists, manifest."""
        if from_file is not None:
            examples = load_hotpotqa_file(from_file)
            source = {"file": str(from_file), "sha256": sha256_file(from_file)}
        else:
            examples = load_hotpotqa_hub(split, revision, cache_dir)
            source = {"hub": HOTPOTQA_REPO, "config": "distractor", "revision": revision, "split": split}
        counts = None
        if pass_counts is not None:
            counts, _ = read_pass_counts(pass_counts, pass_k)
            source["pass_counts_sha256"] = sha256_file(pass_counts)
        args = {"source": source, "num_train": num_train, "num_heldout": num_heldout, "seed": seed,
                "pass_counts": str(pass_counts) if pass_counts else None, "pass_k": pass_k}
        _report(prepare_hotpotqa(examples, out, num_train=num_train, num_heldout=num_heldout, seed=seed,
                     pass_counts=counts, pass_k=pass_k, args=args))

    @group.command("ruler-hqa", context_settings=_MULTI)
    def ruler_hqa_cmd(
        ctx: typer.Context,
        out: Path = OutOption,
        from_dir: Path | None = typer.Option(None, help="Local folder with eval_{N}.json instead of the hub."),
        lengths: list[str] | None = typer.Option(None, help="Document counts, e.g. --lengths 50 200 800."),
        pool: Path | None = typer.Option(None, help="JSON list of documents for index-list contexts."),
        revision: str = typer.Option(RULER_REVISION, help=f"Hub revision of {RULER_REPO}."),
        cache_dir: str | None = typer.Option(None, help="Hub cache folder."),
    ) -> None:
        """RULER-HQA eval_{N}.json (hub or local) → OUT/ruler_hqa/, validated, with a manifest."""
        ns = _int_list(lengths, ctx.args, "--lengths", RULER_LENGTHS)
        args = {"source": str(from_dir) if from_dir else {"hub": RULER_REPO, "revision": revision},
                "lengths": ns, "pool": str(pool) if pool else None}
        _report(prepare_ruler_hqa(out, ns, from_dir=from_dir, pool=pool, revision=revision,
                     cache_dir=cache_dir, args=args))

    @group.command("build-ruler", context_settings=_MULTI)
    def build_ruler_cmd(
        ctx: typer.Context,
        from_file: Path = typer.Option(..., help="Official HotpotQA JSON used as the question and paragraph pool."),
        out: Path = OutOption,
        num_docs: list[str] | None = typer.Option(None, help="Documents per question, e.g. --num-docs 50 200."),
        seed: int = typer.Option(DEFAULT_SEED, help="Base seed of the per-question draws and shuffles."),
        limit: int | None = typer.Option(None, min=1, help="Build only for the first N questions (all stay in the pool)."),
        layout: RulerLayout = typer.Option(
            RulerLayout.memrl,
            help="`memrl`: per-question shuffles, paragraphs distinct by title. `official`: the official MemAgent "
                 "builder's layout: one fixed random.Random(4) shuffle for every question (own paragraphs at the "
                 "same slots), paragraphs distinct by text.",
        ),
    ) -> None:
        """RULER-style sets of N documents per question from a local HotpotQA pool → OUT/ruler_built/."""
        ns = _int_list(num_docs, ctx.args, "--num-docs", RULER_LENGTHS)
        examples = load_hotpotqa_file(from_file)
        args = {"source": {"file": str(from_file), "sha256": sha256_file(from_file)}, "num_docs": ns,
                "seed": seed, "limit": limit}
        _report(build_ruler_files(examples, out, ns, seed=seed, limit=limit, layout=layout.value,
                     args=args))
