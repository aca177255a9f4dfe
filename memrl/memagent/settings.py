"""MemAgent's `task:` section (`MemAgentTask.Settings`): chunking and token limits, prompts, what a memory turn
passes on; the settings every task shares (answer limit and scorer, thinking, the reward's time) come from
`memrl.config.TaskSettings`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from memrl.config import IDENTITY_WHEN_CHANGED, TaskSettings

DEFAULT_MEMORY_TEMPLATE = (
    "You are reading a long document one part at a time to answer a question. "
    "You keep a short memory of what matters.\n\n"
    "Question: {question}\n\n"
    "Your memory so far:\n{memory}\n\n"
    "Next part of the document:\n{chunk}\n\n"
    "Rewrite your memory: keep what helps answer the question, add what this part contributes, "
    "drop the rest. Reply with the updated memory only."
)
DEFAULT_FINAL_TEMPLATE = (
    "You have read a long document and kept a memory of it. Answer the question from your memory.\n\n"
    "Question: {question}\n\n"
    "Your memory:\n{memory}\n\n"
    "Put your final answer in \\boxed{}, for example \\boxed{Paris}."
)
DEFAULT_NO_MEMORY_TEXT = "No memory yet."


class MemAgentSettings(TaskSettings):
    """What the reader sees: chunking and token limits, prompts, what a memory turn passes on."""

    chunk_tokens: int = Field(512, gt=0, description="Tokens per document chunk.")
    memory_tokens: int = Field(128, gt=0, description="Token limit of a memory turn (and the memory passed on).")
    max_chunks: int = Field(4, gt=0, description="Most chunks read; longer documents are truncated.")
    truncation: Literal["head", "tail", "center", "center_chunks"] = Field(
        "center", description="What a document over max_chunks x chunk_tokens keeps: `head` / `tail` the "
        "first / last chunks, `center` the first and last half of the tokens (MemAgent's), `center_chunks` "
        "of whole chunks.")
    memory_template: str = Field(DEFAULT_MEMORY_TEMPLATE, description="Memory-turn prompt: {question} "
                                 "{memory} {chunk}.")
    final_template: str = Field(DEFAULT_FINAL_TEMPLATE, description="Final-turn prompt: {question} {memory}.")
    no_memory_text: str = Field(DEFAULT_NO_MEMORY_TEXT, description="Memory shown before the first chunk.")
    prompt_layout: Literal["memagent", "chunk_first"] = Field(
        "memagent", description="`memagent`: memory_template as written; `chunk_first`: its memory block "
        "after its chunk, so a group's prompts share a prefix the engine computes once.",
        json_schema_extra={IDENTITY_WHEN_CHANGED: True})  # evaluations recorded before it resume
    strip_inputs: bool = Field(False, description="str.strip() each question and document before prompting "
                               "(the official MemAgent evaluation does).")
    memory_after_think: bool = Field(False, description="Pass on as memory only what a memory turn wrote "
                                     "after its last </think> (the official MemAgent evaluation's rule); "
                                     "training still sees every token.")

    @model_validator(mode="after")
    def _templates_have_placeholders(self) -> MemAgentSettings:
        for name, needed in (("memory_template", ("{question}", "{memory}", "{chunk}")),
                             ("final_template", ("{question}", "{memory}"))):
            missing = [p for p in needed if p not in getattr(self, name)]
            if missing:
                raise ValueError(f"task.{name} must contain {', '.join(needed)}; missing {', '.join(missing)}")
        if "{chunk}" in self.final_template:
            raise ValueError("task.final_template must not contain {chunk}: the final turn sees only question + memory")
        return self
