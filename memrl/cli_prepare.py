"""`memrl prepare-data ...`: the data commands (a sub-app of `memrl.cli`), thin wrappers over
memrl.data.prepare. The data modules imported here are light (no torch, transformers or numpy), so the
defaults they hold can show in `--help`."""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from memrl.data.hotpotqa import HOTPOTQA_REVISION
from memrl.data.manifest import output_file, output_folder
from memrl.data.prepare import DEFAULT_SEED
from memrl.data.ruler_hqa import RULER_LENGTHS, RULER_REPO, RULER_REVISION

prepare_data = typer.Typer(help="Download or convert data into a prepared folder with a SHA-256 manifest.",
                           no_args_is_help=True)

OutOption = typer.Option(..., "--out", envvar="DATA_DIR", help="Output data folder (default: $DATA_DIR).")
SetOption = Annotated[list[str] | None, typer.Option("--set", help="Override a config value: section.key=value.")]
_MULTI = {"allow_extra_args": True}


class RulerLayout(StrEnum):
    """`--layout` of build-ruler (memrl.data.ruler_hqa.RULER_LAYOUTS); an Enum, so every typer lists it."""

    memrl = "memrl"
    official = "official"


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


def _wrote(paths: dict[str, Path]) -> None:
    for path in paths.values():
        typer.echo(f"wrote {path}")


@prepare_data.command("synthetic")
def prepare_synthetic_cmd(
    out: Path = typer.Option(Path("data/synthetic"), help="Folder to write."),
    num_train: int = typer.Option(2000, help="Training questions."),
    num_heldout: int = typer.Option(200, help="Held-out questions (disjoint stream)."),
    max_chunks: int = typer.Option(3, help="Documents have 1..max_chunks chunks."),
    facts_per_chunk: int = typer.Option(3, help="Facts per chunk (chunk_tokens = 7 x this)."),
    seed: int = typer.Option(0, help="Seed of both streams."),
    filler: bool = typer.Option(False, help="Pad documents with unrelated facts (memrl demo-long's training task)."),
) -> None:
    """Synthetic memory task (the CPU demo's data): facts scattered among distractors."""
    from memrl.data.synthetic import prepare_synthetic

    output_folder(out, "--out")
    paths = prepare_synthetic(out, num_train=num_train, num_heldout=num_heldout, max_chunks=max_chunks,
                              facts_per_chunk=facts_per_chunk, seed=seed, filler=filler)
    for p in paths.values():
        typer.echo(str(p))


@prepare_data.command("hotpotqa")
def prepare_hotpotqa_cmd(
    out: Path = OutOption,
    from_file: Path | None = typer.Option(None, help="Local official HotpotQA JSON instead of the hub."),
    split: str = typer.Option("train", help="Hub split (ignored with --from-file)."),
    num_train: int = typer.Option(1000, min=0, help="Training questions (frozen order)."),
    num_heldout: int = typer.Option(500, min=0, help="Held-out questions, disjoint from training."),
    seed: int = typer.Option(DEFAULT_SEED, help="Base seed of id choice and per-question shuffles."),
    pass_counts: Path | None = typer.Option(None, help="JSON {id: passes} of a Pass@k run over candidates."),
    pass_k: int = typer.Option(8, help="k of the Pass@k run (keeps 0 < passes < k)."),
    drop_answerable_without_context: Path | None = typer.Option(
        None, help="Pass counts of `memrl pass-at-k --no-context`: training questions are only those it judged and "
                   "never solved without the document (MemAgent's filter2.py)."),
    revision: str = typer.Option(HOTPOTQA_REVISION, help="Hub revision of hotpotqa/hotpot_qa."),
    cache_dir: str | None = typer.Option(None, help="Hub cache folder."),
) -> None:
    """HotpotQA distractor → training and held-out questions, id lists, manifest."""
    from memrl.data.prepare import hotpotqa_command

    output_folder(out, "--out")
    _wrote(hotpotqa_command(out, from_file=from_file, split=split, num_train=num_train, num_heldout=num_heldout,
                            seed=seed, pass_counts=pass_counts, pass_k=pass_k, revision=revision, cache_dir=cache_dir,
                            drop_answerable_without_context=drop_answerable_without_context))


@prepare_data.command("ruler-hqa", context_settings=_MULTI)
def prepare_ruler_hqa_cmd(
    ctx: typer.Context,
    out: Path = OutOption,
    from_dir: Path | None = typer.Option(None, help="Local folder with eval_{N}.json instead of the hub."),
    lengths: list[str] | None = typer.Option(None, help="Document counts, e.g. --lengths 50 200 800."),
    pool: Path | None = typer.Option(None, help="JSON list of documents for index-list contexts."),
    revision: str = typer.Option(RULER_REVISION, help=f"Hub revision of {RULER_REPO}."),
    cache_dir: str | None = typer.Option(None, help="Hub cache folder."),
) -> None:
    """RULER-HQA eval_{N}.json (hub or local) → OUT/ruler_hqa/, validated, with a manifest."""
    from memrl.data.prepare import ruler_hqa_command

    ns = _int_list(lengths, ctx.args, "--lengths", RULER_LENGTHS)
    output_folder(out, "--out")
    _wrote(ruler_hqa_command(out, ns, from_dir=from_dir, pool=pool, revision=revision, cache_dir=cache_dir))


@prepare_data.command("build-ruler", context_settings=_MULTI)
def prepare_build_ruler_cmd(
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
    from memrl.data.prepare import build_ruler_command

    ns = _int_list(num_docs, ctx.args, "--num-docs", RULER_LENGTHS)
    output_folder(out, "--out")
    _wrote(build_ruler_command(from_file, out, ns, seed=seed, limit=limit, layout=layout.value))


def _answerable_records(data: Path, model: str, recipe: Path | None, sets: list[str] | None):
    """The task settings, the model's tokenizer, and `data`'s questions whose answer the rollout reads."""
    from transformers import AutoTokenizer

    from memrl.config import load_config, load_pretrained
    from memrl.data.records import load_questions
    from memrl.memagent.hotpot_demonstrations import answerable

    cfg = load_config(recipe, list(sets or [])).task
    tokenizer = load_pretrained(AutoTokenizer, model, "model")
    records = load_questions(data)
    kept = [r for r in records if answerable(r, tokenizer, cfg)]
    typer.echo(f"{len(kept)} of {len(records)} questions answerable from the chunks read")
    return cfg, tokenizer, kept


_DataArg = typer.Argument(..., help="Prepared questions (JSONL, from `memrl prepare-data hotpotqa`).")
_ModelArg = typer.Argument(..., help="Model folder: its tokenizer cuts the chunks.")
_RecipeOption = typer.Option(None, help="Recipe whose task section (chunk sizes, templates) the rollout uses.")


@prepare_data.command("answerable")
def prepare_answerable_cmd(data: Path = _DataArg, model: str = _ModelArg,
                           out: Path = typer.Argument(..., help="JSONL of the answerable questions."),
                           recipe: Path | None = _RecipeOption, set_: SetOption = None) -> None:
    """HotpotQA questions whose gold answer lies in a sentence of the chunks the rollout reads (yes/no never)."""
    from memrl.data.records import write_jsonl

    output_file(out, "OUT", [("DATA", data), ("--recipe", recipe)])
    _, _, kept = _answerable_records(data, model, recipe, set_)
    write_jsonl(out, kept)
    typer.echo(f"wrote {out}")


@prepare_data.command("demonstrations")
def prepare_demonstrations_cmd(
    data: Path = _DataArg, model: str = _ModelArg,
    out: Path = typer.Argument(..., help="JSONL of demonstrations, what `memrl sft --data` reads."),
    final_only: bool = typer.Option(False, help="Only the final turn (a third of the tokens: teaches the box)."),
    recipe: Path | None = _RecipeOption, set_: SetOption = None,
) -> None:
    """Demonstrated MemAgent readings of the answerable questions, for a `memrl sft` warm start."""
    from memrl.data.records import write_jsonl
    from memrl.memagent.hotpot_demonstrations import demonstration

    output_file(out, "OUT", [("DATA", data), ("--recipe", recipe)])
    cfg, tokenizer, kept = _answerable_records(data, model, recipe, set_)
    demos = [demonstration(r, tokenizer, cfg) for r in kept]
    write_jsonl(out, [{"turns": d["turns"][-1:]} for d in demos] if final_only else demos)
    typer.echo(f"wrote {out}")
