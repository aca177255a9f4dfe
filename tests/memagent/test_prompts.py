from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import yaml
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from memrl.memagent import prompts
from memrl.memagent.chunking import tokenize_document
from memrl.memagent.prompts import (
    PromptBuilder,
    PromptError,
    chunk_first_template,
)
from memrl.memagent.settings import MemAgentSettings
from memrl.tiny import build_tiny_tokenizer

QWEN3_GENERATION_TAIL = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
QUESTION = "Which city is the capital of France?"
CHUNK_TEXT = "Document 3:\nThe Beatles were an English rock band formed in Liverpool in 1960. é ☃ 東京"
MEMORY_TEXT = "Paris is the capital of France."


def occurrences(haystack: list[int], needle: list[int]) -> int:
    n = len(needle)
    return sum(haystack[i : i + n] == needle for i in range(len(haystack) - n + 1))


def rendered(tokenizer, cfg: MemAgentSettings, template: str, question: str, memory: str, chunk: str = "") -> str:
    """What the prompt must decode to: the chat template over the user text with everything substituted."""
    user = template.replace("{chunk}", chunk).replace("{memory}", memory).replace("{question}", question)
    return tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                         add_generation_prompt=True, enable_thinking=cfg.enable_thinking)


@pytest.fixture(params=["tiny_tokenizer", "qwen3_tokenizer"])
def tokenizer(request):
    return request.getfixturevalue(request.param)


def test_memory_prompt_splices_ids_and_decodes_to_rendered_text(tokenizer):
    cfg = MemAgentSettings()
    builder = PromptBuilder(tokenizer, cfg)
    chunk = tokenize_document(tokenizer, CHUNK_TEXT)
    memory = tokenize_document(tokenizer, MEMORY_TEXT)
    ids = builder.memory_prompt_ids(QUESTION, memory, chunk)
    assert occurrences(ids, chunk) == 1 and occurrences(ids, memory) == 1
    assert ids.index(chunk[0]) > 0
    expected = rendered(tokenizer, cfg, cfg.memory_template, QUESTION, MEMORY_TEXT, CHUNK_TEXT)
    assert tokenizer.decode(ids, skip_special_tokens=False) == expected
    # The generation prompt (thinking off) is tokenized as it would be on its own.
    tail = tokenizer(QWEN3_GENERATION_TAIL, add_special_tokens=False)["input_ids"]
    assert ids[-len(tail):] == tail and expected.endswith(QWEN3_GENERATION_TAIL)


def test_final_prompt_decodes_to_rendered_text(tokenizer):
    cfg = MemAgentSettings()
    memory = tokenize_document(tokenizer, MEMORY_TEXT)
    ids = PromptBuilder(tokenizer, cfg).final_prompt_ids(QUESTION, memory)
    assert occurrences(ids, memory) == 1
    assert tokenizer.decode(ids, skip_special_tokens=False) == rendered(
        tokenizer, cfg, cfg.final_template, QUESTION, MEMORY_TEXT)


def test_special_tokens_are_single_ids(tokenizer):
    im_start, im_end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    builder = PromptBuilder(tokenizer, MemAgentSettings())
    for ids in (builder.memory_prompt_ids(QUESTION, None, [5, 6, 7]), builder.final_prompt_ids(QUESTION, None)):
        assert ids[0] == im_start
        assert ids.count(im_start) == 2 and ids.count(im_end) == 1  # user turn + generation prompt


def test_real_qwen3_template_ids(qwen3_tokenizer):
    ids = PromptBuilder(qwen3_tokenizer, MemAgentSettings()).memory_prompt_ids(QUESTION, None, [1, 2, 3])
    assert ids[0] == 151644 and ids.count(151644) == 2 and ids.count(151645) == 1
    assert qwen3_tokenizer.decode(ids).endswith("<|im_end|>\n" + QWEN3_GENERATION_TAIL)
    thinking = PromptBuilder(qwen3_tokenizer, MemAgentSettings(enable_thinking=True)).final_prompt_ids(QUESTION, None)
    assert qwen3_tokenizer.decode(thinking).endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_ids_are_never_retokenized(tokenizer):
    # "Paris" spelled one character per token is not how the tokenizer would encode the text, so a
    # decode/re-encode anywhere would change these ids; they must reach the prompt unchanged.
    odd = tokenizer.convert_tokens_to_ids(list("Paris"))
    assert odd != tokenize_document(tokenizer, "Paris")
    builder = PromptBuilder(tokenizer, MemAgentSettings())
    assert occurrences(builder.memory_prompt_ids(QUESTION, odd, odd[::-1]), odd) == 1
    assert occurrences(builder.memory_prompt_ids(QUESTION, odd[::-1], odd), odd) == 1
    assert occurrences(builder.final_prompt_ids(QUESTION, odd), odd) == 1


def test_no_memory_text_and_empty_memory(tiny_tokenizer):
    cfg = MemAgentSettings()
    builder = PromptBuilder(tiny_tokenizer, cfg)
    first = tiny_tokenizer.decode(builder.memory_prompt_ids(QUESTION, None, [70, 71]))
    assert f"Your memory so far:\n{cfg.no_memory_text}\n\n" in first
    empty = tiny_tokenizer.decode(builder.memory_prompt_ids(QUESTION, [], [70, 71]))
    assert "Your memory so far:\n\n\nNext part" in empty and cfg.no_memory_text not in empty
    assert cfg.no_memory_text not in tiny_tokenizer.decode(builder.final_prompt_ids(QUESTION, []))


def test_question_is_literal_text(tiny_tokenizer):
    # Placeholders and braces inside a question stay text; they are not filled or formatted.
    question = "Is {memory} or {chunk} in \\boxed{x} {question}?"
    cfg = MemAgentSettings()
    builder = PromptBuilder(tiny_tokenizer, cfg)
    memory = tokenize_document(tiny_tokenizer, MEMORY_TEXT)
    ids = builder.memory_prompt_ids(question, memory, [70, 71, 72])
    assert occurrences(ids, memory) == 1 and occurrences(ids, [70, 71, 72]) == 1
    assert f"Question: {question}\n" in tiny_tokenizer.decode(ids)


def test_custom_template_with_literal_braces(tiny_tokenizer):
    cfg = MemAgentSettings(memory_template="Q={question} {} M=[{memory}] C=[{chunk}] {x}",
                        final_template="{memory}|{question}|\\boxed{}")
    builder = PromptBuilder(tiny_tokenizer, cfg)
    text = tiny_tokenizer.decode(builder.memory_prompt_ids("why", tokenize_document(tiny_tokenizer, "mm"),
                                                           tokenize_document(tiny_tokenizer, "cc")))
    assert "user\nQ=why {} M=[mm] C=[cc] {x}<|im_end|>" in text
    final = tiny_tokenizer.decode(builder.final_prompt_ids("why", tokenize_document(tiny_tokenizer, "mm")))
    assert "user\nmm|why|\\boxed{}<|im_end|>" in final


def test_cached_prompts_are_independent(tiny_tokenizer):
    builder = PromptBuilder(tiny_tokenizer, MemAgentSettings())
    first = builder.final_prompt_ids(QUESTION, [70])
    expected = list(first)
    first.append(999)
    first[0] = -1
    assert builder.final_prompt_ids(QUESTION, [70]) == expected


def test_final_prompt_has_no_chunk_parameter():
    params = inspect.signature(PromptBuilder.final_prompt_ids).parameters
    assert not any("chunk" in name for name in params), params
    assert "chunk_ids" in inspect.signature(PromptBuilder.memory_prompt_ids).parameters


# ---- no chunk can reach the final prompt ----------------------------------------------------------
# Chunk words use only characters that occur nowhere in the final prompt's text (template, question,
# memory), so any chunk token 4-gram found in the final prompt could only have come from the chunk.
CHUNK_ALPHABET = "ZJKXVGH0189"
MEMORY_WORDS = ["Paris", "is", "the", "capital", "of", "France", "Beatles", "Liverpool", "band", "yes", "no"]
chunk_texts = st.lists(st.text(alphabet=CHUNK_ALPHABET, min_size=1, max_size=8), min_size=3, max_size=40).map(" ".join)
memory_texts = st.lists(st.sampled_from(MEMORY_WORDS), min_size=0, max_size=20).map(" ".join)


def _assert_chunk_never_in_final(tokenizer, chunk_text: str, memory_text: str) -> None:
    cfg = MemAgentSettings()
    builder = PromptBuilder(tokenizer, cfg)
    static = rendered(tokenizer, cfg, cfg.final_template, QUESTION, memory_text)
    assert not set(CHUNK_ALPHABET) & set(static)  # the premise of this test
    chunk = tokenize_document(tokenizer, chunk_text)
    assume(len(chunk) >= 4)
    grams = {tuple(chunk[i : i + 4]) for i in range(len(chunk) - 3)}
    memory = tokenize_document(tokenizer, memory_text)

    memory_prompt = builder.memory_prompt_ids(QUESTION, memory, chunk)
    found = {tuple(memory_prompt[i : i + 4]) for i in range(len(memory_prompt) - 3)}
    assert grams <= found  # the detector sees the chunk where it belongs
    final = builder.final_prompt_ids(QUESTION, builder.cap_memory(memory)[0])
    final_grams = {tuple(final[i : i + 4]) for i in range(len(final) - 3)}
    assert not grams & final_grams


@settings(max_examples=60, deadline=None)
@given(chunk_text=chunk_texts, memory_text=memory_texts)
def test_no_chunk_in_final_prompt_tiny(tiny_tokenizer, chunk_text, memory_text):
    _assert_chunk_never_in_final(tiny_tokenizer, chunk_text, memory_text)


@settings(max_examples=40, deadline=None)
@given(chunk_text=chunk_texts, memory_text=memory_texts)
def test_no_chunk_in_final_prompt_qwen3(qwen3_tokenizer, chunk_text, memory_text):
    _assert_chunk_never_in_final(qwen3_tokenizer, chunk_text, memory_text)


# ---- memory cap ------------------------------------------------------------------------------------


def test_stop_token_ids(tokenizer):
    ids = PromptBuilder(tokenizer, MemAgentSettings()).stop_token_ids
    expected = set(tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]))
    assert set(ids) == expected | {tokenizer.eos_token_id}
    assert len(ids) == len(set(ids))


def test_stop_token_ids_of_real_qwen3(qwen3_tokenizer):
    assert set(PromptBuilder(qwen3_tokenizer, MemAgentSettings()).stop_token_ids) == {151645, 151643}


def test_cap_memory(tiny_tokenizer):
    builder = PromptBuilder(tiny_tokenizer, MemAgentSettings(memory_tokens=4))
    im_end, eot = tiny_tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert builder.cap_memory([70, 71, im_end]) == ([70, 71], False)
    assert builder.cap_memory([70, 71, im_end, eot, im_end]) == ([70, 71], False)
    assert builder.cap_memory([70, im_end, 71]) == ([70, im_end, 71], False)  # only trailing stops go
    assert builder.cap_memory([70, 71, 72, 73, im_end]) == ([70, 71, 72, 73], False)
    assert builder.cap_memory([70, 71, 72, 73, 74]) == ([70, 71, 72, 73], True)
    assert builder.cap_memory([70, 71, 72, 73, 74, 75, im_end]) == ([70, 71, 72, 73], True)
    assert builder.cap_memory([]) == ([], False)
    assert builder.cap_memory([im_end]) == ([], False)


# ---- errors ---------------------------------------------------------------------------------------


def test_config_rejects_templates_without_placeholders():
    with pytest.raises(ValidationError, match="chunk"):
        MemAgentSettings(memory_template="Question: {question}\nMemory: {memory}")
    with pytest.raises(ValidationError, match="memory"):
        MemAgentSettings(final_template="Question: {question}")
    with pytest.raises(ValidationError, match="must not contain"):
        MemAgentSettings(final_template="{question} {memory} {chunk}")


def test_chat_template_that_drops_content_is_rejected():
    tok = build_tiny_tokenizer()
    tok.chat_template = "{{- '<|im_start|>assistant\\n' }}"
    with pytest.raises(PromptError, match="memory"):
        PromptBuilder(tok, MemAgentSettings()).final_prompt_ids(QUESTION, None)


def test_tokenizer_without_chat_template_is_rejected():
    tok = build_tiny_tokenizer()
    tok.chat_template = None
    with pytest.raises(PromptError, match="chat template"):
        PromptBuilder(tok, MemAgentSettings())


def test_reserved_sentinel_in_question_is_rejected(tiny_tokenizer):
    with pytest.raises(PromptError, match="reserved"):
        PromptBuilder(tiny_tokenizer, MemAgentSettings()).final_prompt_ids(f"x {prompts.CHUNK_SENTINEL}", None)


# --- task.strip_inputs ----------------------------------------------------------------------------
def test_strip_inputs_strips_the_question_of_every_prompt(tokenizer):
    padded = "  \n" + QUESTION + " "  # 13 of the first 200 HotpotQA dev questions end in a space
    memory = tokenize_document(tokenizer, MEMORY_TEXT)
    on = PromptBuilder(tokenizer, MemAgentSettings(strip_inputs=True))
    off = PromptBuilder(tokenizer, MemAgentSettings())
    assert on.memory_prompt_ids(padded, memory, [70, 71]) == off.memory_prompt_ids(QUESTION, memory, [70, 71])
    assert on.final_prompt_ids(padded, memory) == off.final_prompt_ids(QUESTION, memory)
    # Off (the default) the question is sent as it is, trailing space included.
    assert f"Question: {padded}\n" in tokenizer.decode(off.final_prompt_ids(padded, memory))


def test_strip_inputs_strips_the_document_before_it_is_chunked(tiny_tokenizer):
    from memrl.memagent.rollout import document_chunks

    cfg = MemAgentSettings(chunk_tokens=4, strip_inputs=True)
    padded = "\n\n " + CHUNK_TEXT + " \n"
    stripped = document_chunks(tiny_tokenizer, cfg, padded)
    assert stripped.chunks == document_chunks(tiny_tokenizer, MemAgentSettings(chunk_tokens=4), CHUNK_TEXT).chunks
    # Off, leading whitespace shifts every chunk boundary: the chunks differ.
    assert document_chunks(tiny_tokenizer, MemAgentSettings(chunk_tokens=4), padded).chunks != stripped.chunks
    assert prompts.input_text(cfg, padded) == CHUNK_TEXT
    assert prompts.input_text(MemAgentSettings(), padded) == padded


# --- task.prompt_layout ---------------------------------------------------------------------------
RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def recipe_template(name: str) -> str:
    return yaml.safe_load((RECIPES / name).read_text())["task"]["memory_template"]


def test_chunk_first_moves_the_memory_block_after_the_chunk_block():
    assert chunk_first_template(MemAgentSettings().memory_template) == (
        "You are reading a long document one part at a time to answer a question. You keep a short memory of "
        "what matters.\n\nQuestion: {question}\n\nNext part of the document:\n{chunk}\n\nYour memory so far:\n"
        "{memory}\n\nRewrite your memory: keep what helps answer the question, add what this part contributes, "
        "drop the rest. Reply with the updated memory only.")
    official = recipe_template("memagent-official-eval.yaml")
    memory_block, chunk_block = "<memory>\n{memory}\n</memory>", "<section>\n{chunk}\n</section>"
    assert f"{memory_block}\n\n{chunk_block}" in official
    assert chunk_first_template(official) == official.replace(f"{memory_block}\n\n{chunk_block}",
                                                              f"{chunk_block}\n\n{memory_block}")
    assert chunk_first_template(recipe_template("toy.yaml")) == "{question} text : {chunk} memory : {memory}"
    # Already chunk first: unchanged; blocks run to the template's ends.
    assert chunk_first_template("{chunk}\n\n{memory} {question}") == "{chunk}\n\n{memory} {question}"
    assert chunk_first_template("M: {memory}\n\nC: {chunk}\nQ: {question}\nend") == \
        "C: {chunk}\n\nM: {memory}\nQ: {question}\nend"
    assert chunk_first_template("M: {memory}\n\n{question}\n\nC: {chunk}\nend") == \
        "C: {chunk}\nend\n\n{question}\n\nM: {memory}"


def test_chunk_first_needs_one_memory_and_one_chunk(tiny_tokenizer):
    cfg = MemAgentSettings(memory_template="{question} {memory} {chunk} again {memory}", prompt_layout="chunk_first")
    with pytest.raises(PromptError, match="prompt_layout = memagent"):
        PromptBuilder(tiny_tokenizer, cfg)
    PromptBuilder(tiny_tokenizer, cfg.model_copy(update={"prompt_layout": "memagent"}))  # as written: fine


@pytest.mark.parametrize("layout", ["memagent", "chunk_first"])
def test_layouts_render_their_template_and_a_group_shares_all_before_the_memory(tokenizer, layout):
    cfg = MemAgentSettings(prompt_layout=layout)
    builder = PromptBuilder(tokenizer, cfg)
    chunk = tokenize_document(tokenizer, CHUNK_TEXT)
    memories = [tokenize_document(tokenizer, text) for text in (MEMORY_TEXT, "Liverpool 1960.")]
    template = cfg.memory_template if layout == "memagent" else chunk_first_template(cfg.memory_template)
    assert builder.memory_template == template
    ids = [builder.memory_prompt_ids(QUESTION, memory, chunk) for memory in memories]
    assert tokenizer.decode(ids[0], skip_special_tokens=False) == rendered(
        tokenizer, cfg, template, QUESTION, MEMORY_TEXT, CHUNK_TEXT)
    start = next(i for i in range(len(ids[0])) if ids[0][i:i + len(memories[0])] == memories[0])
    assert ids[0][:start] == ids[1][:start]  # two samples of a group: the same tokens up to the memory
    chunk_at = next(i for i in range(len(ids[0])) if ids[0][i:i + len(chunk)] == chunk)
    assert (chunk_at < start) == (layout == "chunk_first")  # the chunk is in the shared part only then
    plain = PromptBuilder(tokenizer, MemAgentSettings())
    assert builder.final_prompt_ids(QUESTION, memories[0]) == plain.final_prompt_ids(
        QUESTION, memories[0])  # the final turn is the same in both layouts
