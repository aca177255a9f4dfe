"""One scorer for the training reward and for evaluation; its rules are docs/design.md §2.

`normalize_answer`, `exact_match`, `f1_score` are the official HotpotQA evaluator's. `therefore` reads to the
end of the line after the last "the answer is", any case (the official evaluator keeps everything after the
case-sensitive phrase, so a correct answer with an explanation scored 0). With `after_think`
(`task.answer_after_think`) the answer is read after its last `</think>` (`answer_after_think`).
Invariant: `score_answer` and `reward_from_text` never raise, whatever text and golds they get (only an
unknown extractor name, a configuration error, is a `ScoringError`).
"""

from __future__ import annotations

import logging
import re
import string
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from memrl.errors import MemrlError

logger = logging.getLogger(__name__)

_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")
_WRAPPER_OPEN = re.compile(
    r"\\(?:text|textbf|textit|textrm|textsf|texttt|textsc|textup|textnormal|emph"
    r"|mathrm|mathbf|mathit|mathsf|mathtt|mbox)\s*\{"
)
# "Therefore, the answer is X" (the official recurrent final prompt); whole words, so "isn't" is no answer.
_ANSWER_IS = re.compile(r"\bthe\s+answer\s+is\b", re.IGNORECASE)
# A backslash and the character after it form one LaTeX token, so `\{`, `\}` and `\\` never open or
# close a group; matching them as pairs in one left-to-right pass keeps the scan linear.
_BRACE_TOKEN = re.compile(r"\\.|[{}]", re.DOTALL)
_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_YES_NO = ("yes", "no", "noanswer")
THINK_END = "</think>"


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
    """Unwrap every balanced `\\text{...}`-like wrapper (nested ones too), then strip whitespace; a wrapper
    whose brace never closes stays."""
    matches = _matching_braces(content)
    drop: set[int] = set()  # the indices of each `\\name{` and of its closing `}`
    for wrapper in _WRAPPER_OPEN.finditer(content):
        close = matches.get(wrapper.end() - 1)
        if close is not None:
            drop.update(range(wrapper.start(), wrapper.end()), (close,))
    return "".join(ch for i, ch in enumerate(content) if i not in drop).strip()


def extract_boxed(text: str) -> str | None:
    """Content of the last closed `\\boxed{...}` or `\\fbox{...}` (`\\boxed{a \\boxed{b}}`: `b`), wrappers
    stripped; None if none."""
    opens = [m.end() - 1 for m in _BOX_OPEN.finditer(text)]
    if not opens:
        return None
    matches = _matching_braces(text)
    for brace in reversed(opens):
        close = matches.get(brace)
        if close is not None:
            return _strip_wrappers(text[brace + 1 : close])
    return None


def extract_therefore(text: str) -> str | None:
    """The answer after the last "the answer is" (any case), to the end of its line; None if absent.
    Markdown `*` goes first ("**the answer is** Paris"); a box there is unboxed; trailing periods go."""
    text = text.replace("*", "")
    phrases = list(_ANSWER_IS.finditer(text))
    if not phrases:
        return None
    # The answer may start on the next line ("the answer is:\n\nParis"); its explanation may follow.
    rest = text[phrases[-1].end():].lstrip(" \t:").strip()
    line = rest.split("\n", 1)[0]
    boxed = extract_boxed(line)
    return (boxed if boxed is not None else _strip_wrappers(line)).strip(" \t.")


def answer_after_think(text: str) -> str:
    """What the official MemAgent evaluation reads of an answer (ruler_hqa.py: `extract_answer(pred) if pred
    else extract_answer(response)`, `pred` = utils' `extract_solution`): the text after the last `</think>`,
    stripped; the whole text when it has no `</think>` or nothing follows it."""
    return (text.rpartition(THINK_END)[2].strip() if THINK_END in text else "") or text


# The `task.answer_extractor` choices: name -> function(text) -> answer or None (no answer).
ANSWER_EXTRACTORS: dict[str, Callable[[str], str | None]] = {
    "boxed": extract_boxed,
    "therefore": extract_therefore,
}


class ScoringError(ValueError, MemrlError):
    """Scoring asked for in a way it cannot be done; the message says what to change."""


class GoldAnswerError(ScoringError, TypeError):
    """Gold answers of a type the scorer cannot read; the message says what to pass instead."""


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
    """Scores of one answer against its golds (best gold per metric); all 0 when no box."""

    boxed: str | None
    em: float
    sub_em: float
    f1: float
    missing_box: bool


_NO_ANSWER = AnswerScore(boxed=None, em=0.0, sub_em=0.0, f1=0.0, missing_box=True)
_REPORTED_GOLD_TYPES: set[str] = set()


def gold_list(golds: object) -> list[str]:
    """Gold answers as a list: one str, or the str items of any other sequence (list, numpy array read
    from parquet, ...). A mapping, bytes or a non-iterable is a `GoldAnswerError`: such golds would
    otherwise score every answer 0 without a word."""
    if isinstance(golds, str):
        return [golds]
    if isinstance(golds, Iterable) and not isinstance(golds, bytes | bytearray | Mapping):
        try:
            return [g for g in golds if isinstance(g, str)]
        except TypeError:  # iterable in name only, e.g. a 0-d numpy array
            pass
    raise GoldAnswerError(f"gold answers must be a str or a sequence of str (list, tuple, numpy array), got "
                          f"{type(golds).__name__}; pass the record's answers as a list of strings")


def _golds_or_empty(golds: object) -> list[str]:
    """`gold_list`, but a bad type is logged (once per type, with what to change) and scores 0."""
    try:
        return gold_list(golds)
    except GoldAnswerError as e:
        if type(golds).__name__ not in _REPORTED_GOLD_TYPES:
            _REPORTED_GOLD_TYPES.add(type(golds).__name__)
            logger.error("%s; every answer scores 0 against them", e)
        return []


def score_answer(text: str, golds: Iterable[str] | str, extractor: str = "boxed",
                 after_think: bool = False) -> AnswerScore:
    """Score a final answer read by `extractor` (`ANSWER_EXTRACTORS`), only after its last `</think>` with
    `after_think` (`answer_after_think`). Never raises: bad input scores as a missing box or a wrong answer;
    no usable gold leaves the metrics at 0 but keeps what was extracted."""
    try:
        extract = ANSWER_EXTRACTORS[extractor]
    except (KeyError, TypeError):
        raise ScoringError(f"unknown answer extractor {extractor!r}; use one of {', '.join(ANSWER_EXTRACTORS)} "
                           "(task.answer_extractor)") from None
    if not isinstance(text, str):
        return _NO_ANSWER
    try:
        boxed = extract(answer_after_think(text) if after_think else text)
        if boxed is None:
            return _NO_ANSWER
        answers = _golds_or_empty(golds)
        return AnswerScore(
            boxed=boxed,
            em=max((exact_match(boxed, g) for g in answers), default=0.0),
            sub_em=max((sub_exact_match(boxed, g) for g in answers), default=0.0),
            f1=max((f1_score(boxed, g)[0] for g in answers), default=0.0),
            missing_box=False,
        )
    except Exception:  # last resort: one odd answer must not stop a training or evaluation run
        logger.exception("scoring failed; counted as a missing box (text starts %r)", text[:200])
        return _NO_ANSWER


_WORD = re.compile(r"\S+")
_DROP_PUNCTUATION = str.maketrans("", "", string.punctuation)


def gold_spans(text: str, golds: Iterable[str] | str) -> list[tuple[int, int, int]]:
    """Where each gold occurs in `text`: sorted `(gold index, start, end)` character ranges of the gold's
    normalized words as consecutive whole normalized words ("1" is not in "1990", "the U.S." is in "US").
    Each word is normalized on its own, keeping its range."""
    if not isinstance(text, str):
        return []
    targets = [(g, normalize_answer(gold).split()) for g, gold in enumerate(_golds_or_empty(golds))]
    plain = text.lower().translate(_DROP_PUNCTUATION)  # normalize_answer's first step, at C speed
    targets = [(g, words) for g, words in targets if words and all(w in plain for w in words)]
    if not targets:
        return []
    words = [(m.start(), m.end(), part) for m in _WORD.finditer(text) for part in normalize_answer(m.group()).split()]
    normalized = [w[2] for w in words]
    spans = []
    for g, target in targets:
        n = len(target)
        spans += [(g, words[i][0], words[i + n - 1][1]) for i in range(len(words) - n + 1)
                  if normalized[i] == target[0] and normalized[i:i + n] == target]
    return sorted(spans)


def reward_from_text(text: str, golds: Iterable[str] | str, extractor: str = "boxed",
                     after_think: bool = False) -> float:
    """The training reward: 1.0 if the extracted answer exactly matches a gold answer, else 0.0."""
    return 1.0 if score_answer(text, golds, extractor, after_think).em == 1.0 else 0.0
