"""Token-in prompt building for MemAgent turns (docs/design.md §1.2, 1.3, 1.5): the chat template around
`memory_template` ({question}, {memory}, {chunk}) or `final_template` ({question}, {memory}; no chunk).

Chunk and memory are token ids spliced in as ids, never decoded and re-encoded (pitfall "Text round
trips"): the template is filled (`fill_template`) with the question and a sentinel string for each of
{chunk} and {memory}, rendered by the chat template to text, and the text is split at the sentinels,
each static piece tokenized on its own (special-token strings still become their one id).
Invariant (tested): decoding a prompt gives the rendered text with the decoded chunk and memory in place.
Questions are trusted data (a question holding a special-token string becomes that token).

`chunk_first_template` is `task.prompt_layout: chunk_first` (docs/design.md §1.5); `input_text` is where
question and document text enter the prompt path.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any

from memrl.errors import MemrlError
from memrl.memagent.settings import MemAgentSettings
from memrl.task import chat_stop_token_ids

# Unlikely in any question or template; rendering must keep each exactly as often as the template has it.
CHUNK_SENTINEL = "\u27e6memrl:chunk:7c1f\u27e7"
MEMORY_SENTINEL = "\u27e6memrl:memory:7c1f\u27e7"
_SLOT_OF = {CHUNK_SENTINEL: "chunk", MEMORY_SENTINEL: "memory"}
_SPLIT = re.compile(f"({re.escape(CHUNK_SENTINEL)}|{re.escape(MEMORY_SENTINEL)})")

# A piece of a prompt: static token ids, or the name of a slot ("chunk" / "memory") filled per call.
Segment = tuple[int, ...] | str


class PromptError(ValueError, MemrlError):
    """A prompt that cannot be built as configured; the message says what to change."""


_PLACEHOLDER = re.compile(r"\{(question|memory|chunk)\}")
_BLANK_LINE = "\n\n"


def _block(template: str, placeholder: str) -> tuple[int, int]:
    """The span of `placeholder`'s block in `template`: back to the blank line before it (or to the end of
    the previous placeholder, when that comes later), forward to the blank line after it (or to the
    placeholder's own end, when the next placeholder comes first; to the template's end after the last)."""
    spans = [m.span() for m in _PLACEHOLDER.finditer(template)]
    i = [template[a:b] for a, b in spans].index(placeholder)
    begin, end = spans[i]
    before = spans[i - 1][1] if i else 0
    blank = template.rfind(_BLANK_LINE, before, begin)
    start = before if blank < 0 else blank + len(_BLANK_LINE)
    after = spans[i + 1][0] if i + 1 < len(spans) else len(template)
    blank = template.find(_BLANK_LINE, end, after)
    stop = blank if blank >= 0 else (end if i + 1 < len(spans) else len(template))
    return start, stop


def chunk_first_template(template: str) -> str:
    """`template` with its {memory} block (`_block`: a paragraph, or a placeholder and the label before it
    where there are no blank lines) moved to just after its {chunk} block; e.g. the toy template becomes
    `{question} text : {chunk} memory : {memory}`. Already in that order: returned as it is."""
    for placeholder in ("{memory}", "{chunk}"):
        if template.count(placeholder) != 1:
            raise PromptError(f"task.prompt_layout = chunk_first moves the one {placeholder} of memory_template, "
                              f"but it has {template.count(placeholder)}; use one, or prompt_layout = memagent")
    memory, chunk = _block(template, "{memory}"), _block(template, "{chunk}")
    if memory[0] >= chunk[1]:
        return template
    return (template[:memory[0]] + template[chunk[0]:chunk[1]] + template[memory[1]:chunk[0]]
            + template[memory[0]:memory[1]] + template[chunk[1]:])


def fill_template(template: str, **parts: str) -> str:
    """`template` with the placeholders named in `parts` filled in one pass: not str.format (templates hold
    literal braces such as \\boxed{}), nor chained replaces (an inserted "{memory}" stays literal text)."""
    return _PLACEHOLDER.sub(lambda m: parts.get(m.group(1), m.group(0)), template)


def layout_memory_template(cfg: MemAgentSettings) -> str:
    """The memory-turn template in the order `task.prompt_layout` asks for (every prompt path reads it here)."""
    return chunk_first_template(cfg.memory_template) if cfg.prompt_layout == "chunk_first" else cfg.memory_template


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Ids of a static prompt piece or memory text: no special tokens added, and split_special_tokens=False
    explicitly, so template markers like <|im_start|> stay single ids even on a tokenizer set to split them."""
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=False)["input_ids"]) if text else []


def text_budget(max_tokens: int) -> int:
    """How many text ids a demonstrated turn may write: its token limit (the rollout's generation limit)
    less the stop token it ends on, which that limit counts. Such a turn stops within its limit, so the
    rollout passes its memory on whole (`PromptBuilder.cap_memory` cuts nothing); 0 at a limit of 1."""
    return max(max_tokens - 1, 0)


def input_text(cfg: MemAgentSettings, text: str) -> str:
    """A question or document as the prompt path reads it: stripped when `cfg.strip_inputs` is on (the
    official evaluation strips both; off by default, as memrl's own runs trained on unstripped text)."""
    return text.strip() if cfg.strip_inputs and isinstance(text, str) else text


class PromptBuilder:
    """Memory-turn and final-turn prompt ids for one tokenizer and rollout config; the static pieces are
    cached per (template, question), shared by every turn of every sample of a question."""

    def __init__(self, tokenizer: Any, task_cfg: MemAgentSettings) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise PromptError("the tokenizer has no chat template; MemAgent prompts go through one "
                              "(set tokenizer.chat_template, or use a chat/instruct model's tokenizer)")
        self.tokenizer = tokenizer
        self.cfg = task_cfg
        self.memory_template = layout_memory_template(task_cfg)
        self._segments = functools.lru_cache(maxsize=256)(self._build_segments)
        self._no_memory_ids = encode_text(tokenizer, task_cfg.no_memory_text)
        self._stop_token_ids = chat_stop_token_ids(tokenizer)
        if not self._stop_token_ids:
            raise PromptError("the tokenizer has no eos token and no <|im_end|> / <|endoftext|>; "
                              "set tokenizer.eos_token")

    @property
    def stop_token_ids(self) -> list[int]:
        """Ids that end a turn: the tokenizer's eos (and pad), plus <|im_end|> / <|endoftext|> if present."""
        return list(self._stop_token_ids)

    def memory_prompt_ids(self, question: str, memory_ids: Sequence[int] | None,
                          chunk_ids: Sequence[int]) -> list[int]:
        """Prompt ids of a memory turn: question + previous memory (None: the no-memory text) + chunk, in the
        order of `task.prompt_layout`."""
        return self._assemble(self.memory_template, question, memory_ids, chunk_ids)

    def final_prompt_ids(self, question: str, memory_ids: Sequence[int] | None) -> list[int]:
        """Prompt ids of the final turn: question + final memory + answer instruction, nothing else."""
        return self._assemble(self.cfg.final_template, question, memory_ids, None)

    def cap_memory(self, response_ids: Sequence[int]) -> tuple[list[int], bool]:
        """The memory passed on from a memory-turn response (trailing stop tokens stripped, cut to
        `memory_tokens`) and whether it had to be cut; an empty one still replaces the old (§1.2)."""
        ids = [int(i) for i in response_ids]
        stops = set(self._stop_token_ids)
        end = len(ids)
        while end > 0 and ids[end - 1] in stops:
            end -= 1
        limit = self.cfg.memory_tokens
        return ids[: min(end, limit)], end > limit

    def _build_segments(self, template: str, question: str) -> tuple[Segment, ...]:
        for sentinel in _SLOT_OF:
            if sentinel in question or sentinel in template:
                raise PromptError(f"the question or template contains the reserved string {sentinel!r}; "
                                  "remove it")
        user = fill_template(template, question=question, chunk=CHUNK_SENTINEL, memory=MEMORY_SENTINEL)
        message = [{"role": "user", "content": user}]
        rendered = self.tokenizer.apply_chat_template(message, tokenize=False, add_generation_prompt=True,
                                                      enable_thinking=self.cfg.enable_thinking)
        for sentinel, slot in _SLOT_OF.items():
            if rendered.count(sentinel) != user.count(sentinel):
                raise PromptError(f"the chat template did not keep the {{{slot}}} placeholder of the user message "
                                  f"intact ({user.count(sentinel)} in the message, {rendered.count(sentinel)} "
                                  "rendered); use a chat template that passes the user content through unchanged")
        segments: list[Segment] = []
        for part in _SPLIT.split(rendered):
            if part in _SLOT_OF:
                segments.append(_SLOT_OF[part])
            elif part:
                segments.append(tuple(encode_text(self.tokenizer, part)))
        return tuple(segments)

    def _assemble(self, template: str, question: str, memory_ids: Sequence[int] | None,
                  chunk_ids: Sequence[int] | None) -> list[int]:
        if not isinstance(question, str):
            raise PromptError(f"question must be a str, got {type(question).__name__}")
        question = input_text(self.cfg, question)
        memory = self._no_memory_ids if memory_ids is None else memory_ids
        fill = {"memory": memory, "chunk": chunk_ids}
        out: list[int] = []
        for segment in self._segments(template, question):
            if isinstance(segment, str):  # a final template has no {chunk}: the config refuses one
                out.extend(int(i) for i in fill[segment])
            else:
                out.extend(segment)
        return out
