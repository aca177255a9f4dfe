"""The MemAgent final turn alone, as a 1:1 task: question + a given memory -> the boxed answer, through the
rollout's own final prompt (`PromptBuilder.final_prompt_ids`). A record's `context` *is* the memory the final
turn reads (`memrl.memagent.hotpot_demonstrations.answer_memory_record` builds such records), so GRPO can train
the answering step without reading a chunk: ~10x cheaper a sample than a whole reading (docs/real-model.md).
`plugins.task: memrl.memagent.final_turn:FinalTurnTask`; the `task:` section is MemAgent's, so one config's
sizes and templates serve both. Its stop ids are the base Task's, the same list MemAgent's prompts stop on.
"""

from __future__ import annotations

from typing import Any

from memrl.memagent.prompts import encode_text
from memrl.memagent.rollout import builder_of
from memrl.memagent.settings import MemAgentSettings
from memrl.rollout import RolloutContext
from memrl.tasks.single_turn import SingleTurnTask


class FinalTurnTask(SingleTurnTask):
    Settings = MemAgentSettings

    def prompt_ids(self, ctx: RolloutContext, record: Any) -> list[int]:
        return builder_of(ctx).final_prompt_ids(record.question, encode_text(ctx.tokenizer, record.context))
