"""Demonstrations for `memrl sft` from a JSONL file, tokenized with the model's chat template.

One line = one demonstration: `{"turns": [{"prompt": P, "response": R}, ...]}` (P: user text or chat
messages). Prompts get the generation prompt (thinking off, as the rollout) and responses the end-of-turn
token, so the warm start teaches the model to stop as the rollout expects.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memrl.io import jsonl_lines
from memrl.train.sft import Demonstration, SFTError

_EXPECTED = 'expected {"turns": [{"prompt": ..., "response": ...}]}'


def _prompt_ids(tokenizer: Any, prompt: Any, enable_thinking: bool) -> list[int]:
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return list(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                              return_dict=False, enable_thinking=enable_thinking))


def load_demonstrations(path: str | Path, tokenizer: Any, enable_thinking: bool = False) -> list[Demonstration]:
    """Token-id demonstrations from the JSONL at `path`; a malformed line is an error naming it."""
    def bad_line(n: int, e: Exception) -> SFTError:
        return SFTError(f"{path}, line {n}: {_EXPECTED} ({type(e).__name__}: {e})")

    demos: list[Demonstration] = []
    for n, record in jsonl_lines(path, bad_line):
        try:
            demo = []
            for turn in record["turns"]:
                response = tokenizer(turn["response"], add_special_tokens=False)["input_ids"]
                demo.append((_prompt_ids(tokenizer, turn["prompt"], enable_thinking),
                             [*response, tokenizer.eos_token_id]))
        except (KeyError, TypeError) as e:
            raise bad_line(n, e) from e
        if not demo:
            raise SFTError(f"{path}, line {n}: a demonstration needs at least one turn")
        demos.append(demo)
    return demos
