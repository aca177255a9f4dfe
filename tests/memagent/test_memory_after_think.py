"""`task.memory_after_think`: the official MemAgent memory update (the text after the last </think>,
stripped) as an option; the training default keeps the whole response, and the turn always trains on every
sampled id."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest
from scripted_engine import ScriptedEngine
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from memrl.config import Config, load_config
from memrl.eval.results import eval_format
from memrl.memagent.rollout import generate_group, memory_after_think
from memrl.rollout import GroupSlot, RolloutContext

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "memagent-official-eval.yaml"
REPLY = "<think>The section names a capital.</think>\n\nFacts: Paris."


def official_memory(content: str) -> str:
    """What the official evaluation passes on (taskutils/memory_eval/utils/__init__.py extract_solution)."""
    return content.split("</think>")[-1].strip() if "</think>" in content else content


def rollout_with(tokenizer, **task):
    cfg = Config.model_validate({"task": {"chunk_tokens": 16, "memory_tokens": 40, "final_tokens": 8, "max_chunks": 2,
                                          **task}, "sampling": {"n_samples": 1}})
    engine = ScriptedEngine(tokenizer, lambda p: REPLY if "Rewrite your memory" in p else "\\boxed{Paris}")
    ctx = RolloutContext(engine=engine, tokenizer=tokenizer, config=cfg, rollout_id=0,
                         reward_function=lambda traj, golds: 0.0, progress=False)
    record = SimpleNamespace(id="q", question="What is the capital?", answers=["Paris"],
                             context=" ".join(f"fact{k} is alpha{k}." for k in range(6)))
    (traj,) = asyncio.run(generate_group(ctx, GroupSlot(0, record, f"0:{record.id}"), cfg.sampling.n_samples))
    return traj, engine


@pytest.mark.parametrize("on", [True, False])
def test_memory_is_the_text_after_think_only_with_the_option(tiny_tokenizer, on):
    traj, engine = rollout_with(tiny_tokenizer, memory_after_think=on)
    memories = [p.split("Your memory so far:\n")[1].split("\n\nNext part")[0] for p in engine.prompt_texts()[1:-1]]
    final = engine.prompt_texts()[-1]
    expected = "Facts: Paris." if on else REPLY
    assert memories == [expected] and f"Your memory:\n{expected}\n\n" in final
    reply_ids = tiny_tokenizer(REPLY, add_special_tokens=False)["input_ids"] + [tiny_tokenizer.eos_token_id]
    for turn in traj.turns[:-1]:  # the memory turns train on every sampled id either way
        assert turn.response_ids == reply_ids and len(turn.rollout_log_probs) == len(reply_ids)
    assert traj.metadata["memory_lengths"] == [len(tiny_tokenizer(expected, add_special_tokens=False)["input_ids"])] * 2


CASES = [REPLY, "no think block at all ", "<think>a</think> Facts: Paris. \n", "<think>a</think>x</think>\n last ",
         "<think>only thinking</think>\n\n", "<think>a</think>\n\nÉté ☃ Paris.\n"]


@pytest.mark.parametrize("content", CASES)
def test_qwen3_splits_at_the_think_token_and_matches_the_official_text(qwen3_tokenizer, content):
    tokenizer = qwen3_tokenizer
    assert tokenizer.convert_tokens_to_ids("</think>") == 151668  # one token: the split is found in ids
    ids = tokenizer(content, add_special_tokens=False)["input_ids"]
    memory = memory_after_think(tokenizer, ids)
    assert tokenizer.decode(memory) == official_memory(content)
    if "</think>" not in content:
        assert memory == ids  # untouched, not re-encoded
    elif content == REPLY:  # whole whitespace tokens dropped: the sampled ids themselves, no re-encoding
        after = ids[ids.index(151668) + 1:]
        assert memory == after[1:] and tokenizer.decode(after[0]) == "\n\n"


def no_think_token_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE whose vocabulary has no </think> entry (as Qwen2.5's): the text path."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["Facts: Paris. think about it <think> </think>"], trainer=trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|im_end|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")


@pytest.mark.parametrize("content", CASES)
def test_without_a_think_token_the_split_is_made_in_text(content):
    tokenizer = no_think_token_tokenizer()
    assert tokenizer.convert_tokens_to_ids("</think>") is None
    ids = tokenizer(content, add_special_tokens=False)["input_ids"]
    assert len(tokenizer(REPLY, add_special_tokens=False)["input_ids"]) > 5  # </think> spans several tokens
    memory = memory_after_think(tokenizer, ids)
    assert tokenizer.decode(memory) == official_memory(content)
    if "</think>" not in content:
        assert memory == ids


def test_the_official_eval_recipe_sets_it_and_the_eval_format_records_it(tiny_tokenizer):
    assert load_config(RECIPE).task.memory_after_think is True
    assert Config().task.memory_after_think is False  # the training default keeps the whole response
    assert eval_format(load_config(RECIPE), tiny_tokenizer, [0])["memory_after_think"] is True
    assert "memory_after_think" not in eval_format(Config(), tiny_tokenizer, [0])  # old runs still resume


@pytest.mark.parametrize("tokenizer_name", ["tiny_tokenizer", "qwen3_tokenizer"])
def test_a_think_end_written_as_pieces_splits_as_the_official_text(request, tokenizer_name):
    """`</think>` is one token in both vocabularies, but a model may write it as ordinary pieces (`</`,
    `think`, `>`): the official code splits the text, so the memory is the text after it, still the sampled
    ids (never re-encoded)."""
    tokenizer = request.getfixturevalue(tokenizer_name)

    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    pieces = ids("</") + ids("think") + ids(">")
    assert tokenizer.convert_tokens_to_ids("</think>") not in pieces and len(pieces) >= 3
    for before, after in (("<think>The section names a capital.", "\n\nFacts: Paris."),
                          ("<think>a</think>b", "\n\nlast words\n")):
        sampled = ids(before) + pieces + ids(after)
        content = tokenizer.decode(sampled)
        memory = memory_after_think(tokenizer, sampled)
        assert tokenizer.decode(memory) == official_memory(content) == after.strip()
        tail = ids(after)  # the sampled ids after the pieces: the memory is a run of them, not re-encoded text
        assert any(tail[k:k + len(memory)] == memory for k in range(len(tail) - len(memory) + 1))
