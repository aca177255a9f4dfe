"""HotpotQA questions answerable from the chunks read, and their demonstrations
(memrl/memagent/hotpot_demonstrations.py; commands `memrl prepare-data answerable` / `demonstrations`)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from memrl.cli import app
from memrl.data.records import QuestionRecord, write_jsonl
from memrl.memagent.hotpot_demonstrations import NOTHING_YET, answerable, demonstration
from memrl.memagent.settings import MemAgentSettings

FILLER = "Nothing here matters. " * 30


def _record(answer: str, context: str) -> QuestionRecord:
    return QuestionRecord(id="q", question="Where was the author born?", answers=[answer], context=context)


def _cfg(**kw) -> MemAgentSettings:
    return MemAgentSettings(**{"chunk_tokens": 64, "memory_tokens": 24, "final_tokens": 16, "max_chunks": 2, **kw})


def test_an_answer_cut_away_by_the_truncation_is_not_answerable(tiny_tokenizer):
    # The answer sits in the middle of a long document: center truncation to 2 x 64 tokens drops it.
    cut = _record("Lisbon", FILLER * 3 + "The author was born in Lisbon. " + FILLER * 3)
    kept = _record("Lisbon", "The author was born in Lisbon. " + FILLER * 6)
    assert not answerable(cut, tiny_tokenizer, _cfg())
    assert answerable(kept, tiny_tokenizer, _cfg())


def test_answers_match_whole_words_and_yes_no_never_counts(tiny_tokenizer):
    # "no" inside "now" (and the word "no" itself) does not answer a yes/no comparison.
    assert not answerable(_record("no", "It is now here. There is no answer. " + FILLER), tiny_tokenizer, _cfg())
    assert not answerable(_record("Lis", "The author was born in Lisbon. " + FILLER), tiny_tokenizer, _cfg())


def test_the_demonstration_keeps_the_answer_sentence_and_boxes_the_gold(tiny_tokenizer):
    record = _record("Lisbon", "Some intro text without it. " * 2 + "The author was born in Lisbon. " + FILLER * 6)
    turns = demonstration(record, tiny_tokenizer, _cfg())["turns"]
    assert len(turns) == 3  # 2 memory turns + the final turn
    assert turns[0]["response"] == "The author was born in Lisbon."
    assert turns[1]["response"] == turns[0]["response"]  # the second chunk has no answer: the memory stays
    assert "Your memory so far:\nThe author was born in Lisbon." in turns[1]["prompt"]
    assert turns[2]["response"] == "\\boxed{Lisbon}" and "{memory}" not in turns[2]["prompt"]
    assert "Your memory:\nThe author was born in Lisbon." in turns[2]["prompt"]


def test_the_demonstration_prompt_follows_the_layout_and_keeps_inserted_text_literal(tiny_tokenizer):
    """The prompt is the one the rollout builds: `task.prompt_layout` orders chunk and memory, and a question
    holding "{memory}" stays literal text (as PromptBuilder keeps it)."""
    record = QuestionRecord(id="q", question="Where is {memory} kept?", answers=["Lisbon"],
                            context="The author was born in Lisbon. " + FILLER * 6)
    for layout, chunk_first in (("memagent", False), ("chunk_first", True)):
        prompt = demonstration(record, tiny_tokenizer, _cfg(prompt_layout=layout))["turns"][1]["prompt"]
        assert "Question: Where is {memory} kept?" in prompt
        assert (prompt.index("Next part of the document:") < prompt.index("Your memory so far:")) == chunk_first


def test_memory_before_the_answer_and_a_long_sentence_cut_around_it(tiny_tokenizer):
    long_sentence = "The author, " + "who wrote many long books, " * 8 + "was born in Lisbon."
    record = _record("Lisbon", long_sentence + " " + FILLER * 4)
    cfg = _cfg(chunk_tokens=512, truncation="head")
    turns = demonstration(record, tiny_tokenizer, cfg)["turns"]
    memory = turns[0]["response"]
    assert memory.endswith("Lisbon.") and len(tiny_tokenizer(memory)["input_ids"]) <= cfg.memory_tokens - 1
    record = _record("Lisbon", FILLER * 2 + "The author was born in Lisbon. " + FILLER)
    assert demonstration(record, tiny_tokenizer, _cfg(truncation="head"))["turns"][0]["response"] == NOTHING_YET


def test_the_command_writes_answerable_records_and_final_only_demos(tmp_path, tiny_tokenizer):
    model = tmp_path / "tok"
    tiny_tokenizer.save_pretrained(model)
    data = tmp_path / "q.jsonl"
    write_jsonl(data, [_record("Lisbon", "The author was born in Lisbon. " + FILLER),
                       QuestionRecord(id="r", question="Q?", answers=["Oslo"], context=FILLER * 8)])
    sets = ["--set", "task.chunk_tokens=64", "--set", "task.max_chunks=2", "--set", "task.memory_tokens=24"]
    run = CliRunner().invoke
    assert run(app, ["prepare-data", "answerable", str(data), str(model), str(tmp_path / "a.jsonl"),
                     *sets]).exit_code == 0
    assert [json.loads(line)["id"] for line in (tmp_path / "a.jsonl").read_text().splitlines()] == ["q"]
    result = run(app, ["prepare-data", "demonstrations", str(data), str(model), str(tmp_path / "d.jsonl"),
                       "--final-only", *sets])
    assert result.exit_code == 0, result.output
    demos = [json.loads(line) for line in (tmp_path / "d.jsonl").read_text().splitlines()]
    assert [[t["response"] for t in d["turns"]] for d in demos] == [["\\boxed{Lisbon}"]]
    assert "1 of 2 questions answerable" in result.output


def test_a_missing_data_file_is_one_line(tmp_path, tiny_tokenizer):
    tiny_tokenizer.save_pretrained(tmp_path / "tok")
    result = CliRunner().invoke(app, ["prepare-data", "answerable", str(tmp_path / "none.jsonl"), str(tmp_path / "tok"),
                                      str(tmp_path / "a.jsonl")])
    assert result.exit_code == 2 and "none.jsonl" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "a.jsonl").exists()


@pytest.mark.parametrize("command", ["answerable", "demonstrations"])
def test_out_may_be_neither_a_folder_nor_the_data_file(tmp_path, tiny_tokenizer, monkeypatch, command):
    """OUT the same file as DATA (another spelling, a symlink) would silently replace the questions with
    their answerable subset; OUT a folder was a traceback. Both are one line, exit 2, nothing written."""
    tiny_tokenizer.save_pretrained(tmp_path / "tok")
    data = tmp_path / "q.jsonl"
    write_jsonl(data, [_record("Lisbon", "The author was born in Lisbon. " + FILLER),
                       QuestionRecord(id="r", question="Q?", answers=["Oslo"], context=FILLER * 8)])
    (tmp_path / "link.jsonl").symlink_to(data)
    monkeypatch.chdir(tmp_path)
    before = data.read_bytes()
    for source, out, says in ((data, tmp_path, "is a folder"), (data, data, "would be overwritten"),
                              (data, "./sub/../q.jsonl", "would be overwritten"),  # the writer makes sub/
                              ("link.jsonl", data, "would be overwritten")):
        result = CliRunner().invoke(app, ["prepare-data", command, str(source), str(tmp_path / "tok"), str(out)])
        assert result.exit_code == 2 and says in result.output and "Traceback" not in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1 and data.read_bytes() == before


@pytest.mark.parametrize("memory_tokens", [1, 2, 3, 5, 8])
def test_every_demonstrated_memory_is_one_the_rollout_takes_whole(tiny_tokenizer, memory_tokens):
    """The filler and the answer sentence alike: as `memrl sft` trains it (its ids + the stop token) a
    memory turn stops within task.memory_tokens, and the rollout passes it on uncut; at a limit of 1 every
    memory is empty (a limit of 0 kept the whole text) and the final prompt shows it empty, as the rollout."""
    from memrl.memagent.prompts import PromptBuilder, encode_text

    cfg = _cfg(memory_tokens=memory_tokens, truncation="head")
    record = _record("Lisbon", FILLER * 2 + "The author was born in Lisbon. " + FILLER)
    turns = demonstration(record, tiny_tokenizer, cfg)["turns"]
    builder, eos = PromptBuilder(tiny_tokenizer, cfg), tiny_tokenizer.eos_token_id
    memories = [t["response"] for t in turns[:-1]]
    assert len(memories) == 2
    for memory in memories:
        ids = encode_text(tiny_tokenizer, memory)
        assert len(ids) + 1 <= memory_tokens and builder.cap_memory([*ids, eos]) == (ids, False)
    assert f"Your memory so far:\n{memories[0]}\n" in turns[1]["prompt"]
    assert f"Your memory:\n{memories[1]}\n" in turns[-1]["prompt"]
    if memory_tokens == 1:
        assert memories == ["", ""] and "Your memory:\n\n" in turns[-1]["prompt"]
