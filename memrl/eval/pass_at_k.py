"""Pass@k over candidate questions, for choosing a training set that carries a GRPO signal (docs/design.md §5):
`memrl pass-at-k` writes `{k, pass_counts: {id: passes}, ...}`, read by `memrl prepare-data hotpotqa
--pass-counts FILE --pass-k K`. Samples use the training task itself (`Task.sample_group`, its reward),
so "pass" means what the training reward means (its `outcome` term, the answer's, scoring 1); a question
with a failed request gets no count.
`--no-context` counts what the model answers without the document, for `--drop-answerable-without-context`.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from memrl.config import OUTCOME, Config
from memrl.data.manifest import sha256_file
from memrl.data.records import QuestionRecord
from memrl.io import atomic_write_json
from memrl.rollout import GroupSlot, RolloutContext
from memrl.task import load_task, task_reward


async def count_passes(engine: Any, tokenizer: Any, cfg: Config, records: Sequence[QuestionRecord], k: int,
                       progress: bool = True) -> tuple[dict[str, int], list[str]]:
    """(passes per question id, ids with a failed sample). Questions run `cfg.eval.concurrency` at a time,
    each as one group of rollout 0 at its position in `records` (as a training step would sample it)."""
    task = load_task(cfg)
    ctx = RolloutContext(engine=engine, tokenizer=tokenizer, config=cfg, rollout_id=0,
                         reward_function=task_reward(cfg, task), progress=False)
    limit = asyncio.Semaphore(cfg.eval.concurrency)
    counts: dict[str, int] = {}
    failed: list[str] = []
    bar = tqdm(total=len(records), desc=f"pass@{k}", unit="q", disable=not progress)

    async def one(slot: GroupSlot) -> None:
        record = slot.record
        async with limit:
            group = await task.sample_group(ctx, slot, k)
        if any(t.status == "failed" for t in group):
            failed.append(record.id)
        else:
            # the answer's reward (the `outcome` term), whatever other terms (a length bonus) add to the sum
            counts[record.id] = sum(t.metadata.get("reward_terms", {}).get(OUTCOME, t.reward) == 1.0 for t in group)
        bar.update()
        bar.set_postfix(mixed=sum(0 < c < k for c in counts.values()), failed=len(failed))

    try:
        await asyncio.gather(*(one(slot) for slot in ctx.groups(records)))
    finally:
        bar.close()
    order = {r.id: i for i, r in enumerate(records)}
    return dict(sorted(counts.items(), key=lambda kv: order[kv[0]])), sorted(failed, key=order.__getitem__)


# What Pass@k reads of a config: a `--set` of any other key (training's) would be silently ignored, so it
# is refused. `eval.limit` is `--limit`; the task (and a reward replacing its own) samples and scores.
READ_KEYS = ("model.", "sampling.", "engine.", "task.", "eval.limit", "eval.concurrency", "data.verify_manifest",
             "plugins.task", "plugins.reward_function", "plugins.config_class")


def check_read_overrides(sets: Sequence[str]) -> None:
    """Refuse a `--set` key that `memrl pass-at-k` would not read (a `ConfigError` naming what it reads)."""
    from memrl.config import ConfigError, parse_override

    for text in sets:
        key = ".".join(parse_override(text)[0])
        # a key it reads, or a whole section it reads all of (`--set 'eval={limit: 16}'`)
        if any(key == r or (r.endswith(".") and key.startswith(r)) for r in READ_KEYS) or \
                key in ("model", "sampling", "engine", "task", "eval"):
            continue
        hint = "; the candidates are --data FILE" if key.startswith("data.") else ""
        raise ConfigError(f"memrl pass-at-k does not read '{key}' (--set {text}){hint}; it reads "
                          f"{', '.join(r + '*' if r.endswith('.') else r for r in READ_KEYS)} "
                          f"(--limit N is eval.limit)")


def pass_at_k_command(model: str | None, server_url: str | None, recipe: Path | None, data: Path, out: Path, k: int,
                      sets: list[str] | None = None, limit: int | None = None, tokenizer: str | None = None,
                      progress: bool = True, no_context: bool = False) -> dict[str, Any]:
    """Run Pass@k with the rollout recipe and write the pass-count file; overrides in order (as `memrl eval`):
    the recipe, `--set`, `--limit` (= `eval.limit`)."""
    from memrl.config import load_config
    from memrl.eval.runner import load_eval_data, open_engine, resolve_model_source

    check_read_overrides(list(sets or []))
    cfg = load_config(recipe, list(sets or []) + ([f"eval.limit={limit}"] if limit is not None else []))
    model, server_url, tokenizer_path = resolve_model_source(cfg, model, server_url, tokenizer)
    records = load_eval_data(data, verify=cfg.data.verify_manifest)[:cfg.eval.limit]
    if no_context:  # empty documents: no chunk is read, the first turn is the final one
        records = [dataclasses.replace(r, context="") for r in records]
    tok, engine, info = open_engine(cfg, model, server_url, tokenizer_path)

    async def run() -> tuple[dict[str, int], list[str]]:
        try:
            return await count_passes(engine, tok, cfg, records, k, progress)
        finally:
            await engine.close()

    counts, failed = asyncio.run(run())
    result = {"k": k, **({"no_context": True} if no_context else {}), "pass_counts": counts, "failed": failed,
              "model": str(model or server_url), "engine": info, "data": str(data), "data_sha256": sha256_file(data),
              "limit": cfg.eval.limit, "questions": len(records),
              "sampling": cfg.sampling.model_dump(mode="json"), "task": cfg.task.model_dump(mode="json"),
              "mixed": sum(0 < c < k for c in counts.values()), "never": sum(c == 0 for c in counts.values()),
              "always": sum(c == k for c in counts.values())}
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out, result)
    return result
