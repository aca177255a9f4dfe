"""One scorer for the training reward and for evaluation (SPEC §2).

Answer extraction (`extract_boxed`):
- The answer is the content of the last *closed* `\\boxed{...}` anywhere in the text (the whole text is
  read, not a tail). "Last" means the last opening `\\boxed{` that has a matching `}`; so in
  `\\boxed{a \\boxed{b}}` the answer is `b`, and an unclosed trailing `\\boxed{` is ignored in favour of an
  earlier closed box. `\\fbox{...}` (LaTeX's text-mode box) counts as a box too; `\\boxed X` without
  braces does not.
- Braces are matched with LaTeX escapes respected: `\\{` and `\\}` are literal characters, not groups.
- Wrappers that enclose the whole content are stripped, repeatedly: `\\boxed{\\text{\\textbf{X}}}` -> `X`.

Metrics: `normalize_answer`, `exact_match`, `f1_score` are exactly the official HotpotQA evaluator's
(hotpot_evaluate_v1.py), yes/no/noanswer rule included. `sub_exact_match` is MemAgent's two-way
substring test, except that an empty normalized string never matches a non-empty one.

Invariant: `score_answer` and `reward_from_text` never raise, whatever they are given.
"""

from __future__ import annotations

import logging
import re
import string
from collections import Counter
from dataclasses import dataclass

logger = logging.getLogger(__name__)

_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")
_WRAPPER_OPEN = re.compile(r"\\(?:text|textbf|textit|textrm|textsf|texttt|mathrm|mathbf|mathit|mbox)\s*\{")
# A backslash and the character after it form one LaTeX token, so `\{`, `\}` and `\\` never open or
# close a group; matching them as pairs in one left-to-right pass keeps the scan linear.
_BRACE_TOKEN = re.compile(r"\\.|[{}]", re.DOTALL)
_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_YES_NO = ("yes", "no", "noanswer")


def _matching_braces(text: str) -> dict[int, int]:
    """Map the index of every balanced `{` to the index of its `}` (unbalanced ones are absent)."""
    matches: dict[int, int] = {}
    stack: list[int] = []
    for token in _BRACE_TOKEN.finditer(text):
        char = token.group()
        if char == "{":
            stack.append(token.start())
        elif char == "}" and stack:
            matches[stack.pop()] = token.start()
    return matches


def _strip_wrappers(content: str) -> str:
    """Remove `\\text{...}`-like wrappers that enclose the whole (whitespace-stripped) content."""
    content = content.strip()
    while (wrapper := _WRAPPER_OPEN.match(content)) is not None:
        close = _matching_braces(content).get(wrapper.end() - 1)
        if close != len(content) - 1:
            break  # the wrapper covers only part of the content: keep it all
        content = content[wrapper.end() : close].strip()
    return content


def extract_boxed(text: str) -> str | None:
    """Content of the last closed `\\boxed{...}` (or `\\fbox{...}`), wrappers stripped; None if none."""
    opens = [m.end() - 1 for m in _BOX_OPEN.finditer(text)]
    if not opens:
        return None
    matches = _matching_braces(text)
    for brace in reversed(opens):
        close = matches.get(brace)
        if close is not None:
            return _strip_wrappers(text[brace + 1 : close])
    return None


def normalize_answer(s: str) -> str:
    """Official HotpotQA normalization: lower, drop punctuation, drop articles, collapse whitespace."""
    s = "".join(ch for ch in s.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", s).split())


def exact_match(prediction: str, gold: str) -> float:
    """1.0 when the normalized strings are equal (official `exact_match_score`), else 0.0."""
    return float(normalize_answer(prediction) == normalize_answer(gold))


def f1_score(prediction: str, gold: str) -> tuple[float, float, float]:
    """Official HotpotQA token F1 as (f1, precision, recall), yes/no/noanswer rule included."""
    pred, ref = normalize_answer(prediction), normalize_answer(gold)
    # A yes/no answer is right or wrong as a whole: no partial credit for sharing tokens with it.
    if (pred in _YES_NO or ref in _YES_NO) and pred != ref:
        return 0.0, 0.0, 0.0
    pred_tokens, ref_tokens = pred.split(), ref.split()
    same = sum((Counter(pred_tokens) & Counter(ref_tokens)).values())
    if same == 0:
        return 0.0, 0.0, 0.0
    precision, recall = same / len(pred_tokens), same / len(ref_tokens)
    return 2 * precision * recall / (precision + recall), precision, recall


def sub_exact_match(prediction: str, gold: str) -> float:
    """1.0 if EM is 1, or both normalized strings are non-empty and one contains the other."""
    pred, ref = normalize_answer(prediction), normalize_answer(gold)
    if pred == ref:
        return 1.0
    # MemAgent's test without this guard lets an answer like "the" (normalized "") match every gold.
    return float(bool(pred) and bool(ref) and (pred in ref or ref in pred))


@dataclass(frozen=True, slots=True)
class AnswerScore:
    """Scores of one answer text against its golds (best gold per metric); all 0 when no box."""

    boxed: str | None
    em: float
    sub_em: float
    f1: float
    missing_box: bool


_NO_ANSWER = AnswerScore(boxed=None, em=0.0, sub_em=0.0, f1=0.0, missing_box=True)


def _as_gold_list(golds: object) -> list[str]:
    """Accept one gold string or an iterable of them; anything that is not a string is skipped."""
    if isinstance(golds, str):
        return [golds]
    if isinstance(golds, list | tuple | set | frozenset):
        return [g for g in golds if isinstance(g, str)]
    return []


def score_answer(text: str, golds: list[str] | str) -> AnswerScore:
    """Score a final answer. Never raises: bad input scores as a missing box or as a wrong answer.

    Non-string `text` is no answer (missing_box True). No usable gold leaves the metrics at 0 but
    still reports what was boxed.
    """
    if not isinstance(text, str):
        return _NO_ANSWER
    try:
        boxed = extract_boxed(text)
        if boxed is None:
            return _NO_ANSWER
        gold_list = _as_gold_list(golds)
        return AnswerScore(
            boxed=boxed,
            em=max((exact_match(boxed, g) for g in gold_list), default=0.0),
            sub_em=max((sub_exact_match(boxed, g) for g in gold_list), default=0.0),
            f1=max((f1_score(boxed, g)[0] for g in gold_list), default=0.0),
            missing_box=False,
        )
    except Exception:  # last resort: one odd answer must not stop a training or evaluation run
        logger.exception("scoring failed; counted as a missing box (text starts %r)", text[:200])
        return _NO_ANSWER


def reward_from_text(text: str, golds: list[str] | str) -> float:
    """The training reward: 1.0 if the boxed answer exactly matches a gold answer, else 0.0."""
    return 1.0 if score_answer(text, golds).em == 1.0 else 0.0
