"""recipes/memagent-official-eval.yaml: memrl sends what the official MemAgent evaluation sends.

The official pipeline (BytedTsinghua-SIA/MemAgent at 76b7a65, taskutils/memory_eval/utils/recurrent_boxed.py
and recurrent.py) is re-enacted here from its source: strip question and context, tokenize the context,
cut 5000-token chunks, decode each, `TEMPLATE.format(...)`, and send one user message to a chat
server, which renders it with the chat template (generation prompt on; Qwen3: thinking off). memrl's
prompts (token-spliced ids, decoded) must equal those texts character for character.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from scripted_engine import ScriptedEngine

from memrl.config import load_config
from memrl.data.hotpotqa import format_documents, paragraph_document
from memrl.data.records import QuestionRecord
from memrl.eval.results import read_results
from memrl.eval.runner import evaluate

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "memagent-official-eval.yaml"
OFFICIAL_PROMPTS_FILE = ROOT / ".." / "shared" / "data" / "memagent-official" / "prompts.json"

# The official strings, copied from ../shared/data/memagent-official/prompts.json (the templates after
# the official str.format escaping, with the official {prompt} named {question} as in memrl).
OFFICIAL_MEMORY_TEMPLATE = (
    "You are presented with a problem, a section of an article that may contain the answer to the problem, "
    "and a previous memory. Please read the provided section carefully and update the memory with the new "
    "information that helps to answer the problem. Be sure to retain all relevant details from the previous "
    "memory while adding any new, useful information.\n\n<problem> \n{question}\n</problem>\n\n"
    "<memory>\n{memory}\n</memory>\n\n<section>\n{chunk}\n</section>\n\nUpdated memory:\n"
)
OFFICIAL_FINAL_TEMPLATE = (
    "You are presented with a problem and a previous memory. Please answer the problem based on the previous "
    "memory and put the answer in \\boxed{}.\n\n<problem> \n{question}\n</problem>\n\n"
    "<memory>\n{memory}\n</memory>\n\nYour answer:\n"
)
OFFICIAL_NO_MEMORY_TEXT = "No previous memory"
# The non-boxed final template of the official "recurrent" method (utils/recurrent.py TEMPLATE_FINAL).
OFFICIAL_THEREFORE_FINAL_TEMPLATE = (
    "You are presented with a problem and a previous memory. Please answer the problem based on the previous "
    "memory and format your response as follows \"Therefore, the answer is (insert answer here)\".\n\n"
    "<problem> \n{question}\n</problem>\n\n<memory>\n{memory}\n</memory>\n\nYour answer:\n"
)
OFFICIAL_SETTINGS = {"chunk_tokens": 5000, "memory_tokens": 1024, "final_tokens": 1024,
                     "temperature": 0.7, "top_p": 0.95}


def as_official_source(template: str) -> str:
    """The template as the official Python source writes it, for its own `.format(prompt=...)` call."""
    return template.replace("\\boxed{}", "\\boxed{{}}").replace("{question}", "{prompt}")


def recurrent_variant_overrides() -> list[str]:
    """The recipe's commented recurrent variant, uncommented, as `--set` overrides."""
    lines = RECIPE.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("  # --- recurrent variant"))
    end = next(i for i, line in enumerate(lines) if line.startswith("  # --- end of the recurrent variant"))
    block = [line.removeprefix("  # ") for line in lines[start + 1:end]]
    keys = yaml.safe_load("\n".join(block[next(i for i, b in enumerate(block) if b.startswith("final_template:")):]))
    return [f"task.{k}={json.dumps(v)}" for k, v in keys.items()]


def test_copied_strings_equal_the_shared_file():
    if not OFFICIAL_PROMPTS_FILE.is_file():
        pytest.skip(f"official MemAgent prompts not found at {OFFICIAL_PROMPTS_FILE}")
    official = json.loads(OFFICIAL_PROMPTS_FILE.read_text(encoding="utf-8"))
    assert official["memory_template"] == OFFICIAL_MEMORY_TEMPLATE
    assert official["final_template"] == OFFICIAL_FINAL_TEMPLATE
    assert official["no_memory_text"] == OFFICIAL_NO_MEMORY_TEXT
    assert {k: official["evaluation"][k] for k in OFFICIAL_SETTINGS} == OFFICIAL_SETTINGS


def test_recipe_holds_the_official_prompts_and_settings():
    r = load_config(RECIPE)
    assert r.task.memory_template == OFFICIAL_MEMORY_TEMPLATE and "<problem> \n" in r.task.memory_template
    assert r.task.final_template == OFFICIAL_FINAL_TEMPLATE
    assert r.task.no_memory_text == OFFICIAL_NO_MEMORY_TEXT
    settings = {**r.task.model_dump(), **r.sampling.model_dump()}
    assert {k: settings[k] for k in OFFICIAL_SETTINGS} == OFFICIAL_SETTINGS
    assert ((r.task.strip_inputs, r.task.answer_extractor, r.task.enable_thinking, r.sampling.n_samples)
            == (True, "boxed", False, 1))
    # The official evaluation never truncates: the budget covers eval_25600 (~3.5M tokens).
    assert r.task.max_chunks * r.task.chunk_tokens >= 5_000_000


def test_recipe_recurrent_variant_is_the_official_non_boxed_prompt():
    r = load_config(RECIPE, recurrent_variant_overrides())
    assert r.task.final_template == OFFICIAL_THEREFORE_FINAL_TEMPLATE
    assert r.task.answer_extractor == "therefore"
    assert r.task.memory_template == OFFICIAL_MEMORY_TEMPLATE  # only the final turn differs


def chat(tokenizer, message: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                         add_generation_prompt=True, enable_thinking=False)


def reply(prompt: str, answer: str) -> str:
    """The scripted model: a memory naming the turn's first section line, then the final answer."""
    if "Updated memory:" not in prompt:
        return answer
    section = prompt.split("<section>\n", 1)[1].split("\n", 1)[0]
    return f"So far: {section[:60]} é ☃."


def official_prompts(tokenizer, question: str, context: str, final_template: str, answer: str) -> list[str]:
    """Every prompt text the official recurrent evaluation sends for one question (async_query_llm)."""
    context, prompt = context.strip(), question.strip()
    ids = tokenizer.encode(context)
    memory, sent = OFFICIAL_NO_MEMORY_TEXT, []
    for i in range(0, len(ids), 5000):
        message = as_official_source(OFFICIAL_MEMORY_TEMPLATE).format(
            prompt=prompt, chunk=tokenizer.decode(ids[i:i + 5000]), memory=memory)
        sent.append(chat(tokenizer, message))
        memory = reply(sent[-1], answer)  # the server's reply text is the next memory
    sent.append(chat(tokenizer, as_official_source(final_template).format(prompt=prompt, memory=memory)))
    return sent


@pytest.fixture(scope="module")
def official_records(hotpot_dev_records):
    """Questions with a trailing space (dev 23, 41), padded documents, one of several 5000-token chunks."""
    def document(records):
        return format_documents([paragraph_document(t, s) for r in records for t, s in r["context"]])

    picks = [(23, hotpot_dev_records[20:30]), (41, [hotpot_dev_records[41]]), (5, hotpot_dev_records[:2])]
    out = []
    for i, records in picks:
        raw = hotpot_dev_records[i]
        out.append(QuestionRecord(id=raw["_id"], question=raw["question"], answers=[raw["answer"]],
                                  context="\n " + document(records) + " \n"))
    assert out[0].question.endswith(" ") and out[1].question.endswith(" ")
    return out


@pytest.mark.parametrize("variant", ["boxed", "recurrent"])
def test_rendered_prompts_equal_the_official_pipeline(qwen3_tokenizer, official_records, tmp_path, variant):
    overrides = ["eval.concurrency=1"] + (recurrent_variant_overrides() if variant == "recurrent" else [])
    cfg = load_config(RECIPE, overrides)
    final_template = OFFICIAL_FINAL_TEMPLATE if variant == "boxed" else OFFICIAL_THEREFORE_FINAL_TEMPLATE
    expected, answers = [], {}
    for rec in official_records:
        answer = f"\\boxed{{{rec.answers[0]}}}" if variant == "boxed" else \
            f"Therefore, the answer is {rec.answers[0]}."
        answers[rec.question.strip()] = answer
        expected += official_prompts(qwen3_tokenizer, rec.question, rec.context, final_template, answer)

    engine = ScriptedEngine(qwen3_tokenizer, lambda p: reply(p, answers[p.split("<problem> \n")[1].split("\n")[0]]))
    summary = evaluate(engine, qwen3_tokenizer, cfg, official_records, tmp_path, model_name="scripted",
                       data_sha256="0" * 64, progress=False)

    sent = engine.prompt_texts()
    assert len(sent) == len(expected) and len(sent) > 2 * len(official_records), "one record spans chunks"
    for k, (ours, theirs) in enumerate(zip(sent, expected, strict=True)):
        assert ours == theirs, f"prompt {k} differs from the official one"
    assert {(r.max_tokens, r.temperature, r.top_p) for r in engine.requests} == {(1024, 0.7, 0.95)}
    # The shared scorer reads the variant's answer format: every scripted answer is right.
    assert summary["metrics"]["em"]["value"] == 100.0 and summary["missing_boxes"] == 0
    assert summary["format"]["strip_inputs"] is True
    assert {line["boxed"] for line in read_results(tmp_path / "results.jsonl")} == \
        {r.answers[0] for r in official_records}


def test_without_strip_inputs_the_prompts_differ(qwen3_tokenizer, official_records, tmp_path):
    # The check above would not see a missing strip: with it off, the trailing space reaches the prompt.
    cfg = load_config(RECIPE, ["task.strip_inputs=false"])
    rec = official_records[1]
    engine = ScriptedEngine(qwen3_tokenizer, lambda p: reply(p, "\\boxed{x}"))
    evaluate(engine, qwen3_tokenizer, cfg, [rec], tmp_path, model_name="scripted", data_sha256="0" * 64,
             progress=False)
    expected = official_prompts(qwen3_tokenizer, rec.question, rec.context, OFFICIAL_FINAL_TEMPLATE, "\\boxed{x}")
    assert engine.prompt_texts()[0] != expected[0]
    assert f"<problem> \n{rec.question}\n</problem>" in engine.prompt_texts()[0]


def test_eval_format_records_the_extractor_and_stripping(tiny_tokenizer):
    from memrl.config import Config
    from memrl.eval.results import eval_format

    default = eval_format(Config(), tiny_tokenizer, [0])
    # Unchanged for default runs, so evaluations recorded before these options still resume and compare.
    assert "strip_inputs" not in default
    assert default["scorer"] == "memrl.scoring.score_answer (HotpotQA normalization, last \\boxed{})"
    recurrent = eval_format(load_config(RECIPE, recurrent_variant_overrides()), tiny_tokenizer, [0])
    assert recurrent["strip_inputs"] is True and "the answer is" in recurrent["scorer"]
    assert eval_format(load_config(RECIPE), tiny_tokenizer, [0])["scorer"] == default["scorer"]


def test_the_recipe_reads_the_answer_after_think_and_the_eval_format_records_it(tiny_tokenizer):
    from memrl.config import Config
    from memrl.eval.results import eval_format

    assert load_config(RECIPE).task.answer_after_think is True and Config().task.answer_after_think is False
    assert eval_format(load_config(RECIPE), tiny_tokenizer, [0])["answer_after_think"] is True
    assert "answer_after_think" not in eval_format(Config(), tiny_tokenizer, [0])  # old runs still resume
