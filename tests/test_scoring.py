"""Tests for memrl.scoring: agreement with the official HotpotQA evaluator, box extraction, never raising."""

from __future__ import annotations

import dataclasses
import re
import string
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memrl import scoring
from memrl.scoring import (
    ANSWER_EXTRACTORS,
    AnswerScore,
    GoldAnswerError,
    ScoringError,
    exact_match,
    extract_boxed,
    extract_therefore,
    f1_score,
    gold_list,
    normalize_answer,
    reward_from_text,
    score_answer,
    sub_exact_match,
)


# --- Reference: hotpot_evaluate_v1.py, copied as published (only renamed with a ref_ prefix) ---------
def ref_normalize_answer(s):
    def remove_articles(text):
        return re.sub(r"\b(a|an|the)\b", " ", text)

    def white_space_fix(text):
        return " ".join(text.split())

    def remove_punc(text):
        exclude = set(string.punctuation)
        return "".join(ch for ch in text if ch not in exclude)

    def lower(text):
        return text.lower()

    return white_space_fix(remove_articles(remove_punc(lower(s))))


def ref_f1_score(prediction, ground_truth):
    normalized_prediction = ref_normalize_answer(prediction)
    normalized_ground_truth = ref_normalize_answer(ground_truth)

    ZERO_METRIC = (0, 0, 0)

    if (
        normalized_prediction in ["yes", "no", "noanswer"]
        and normalized_prediction != normalized_ground_truth
    ):
        return ZERO_METRIC
    if (
        normalized_ground_truth in ["yes", "no", "noanswer"]
        and normalized_prediction != normalized_ground_truth
    ):
        return ZERO_METRIC

    prediction_tokens = normalized_prediction.split()
    ground_truth_tokens = normalized_ground_truth.split()
    common = Counter(prediction_tokens) & Counter(ground_truth_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return ZERO_METRIC
    precision = 1.0 * num_same / len(prediction_tokens)
    recall = 1.0 * num_same / len(ground_truth_tokens)
    f1 = (2 * precision * recall) / (precision + recall)
    return f1, precision, recall


def ref_exact_match_score(prediction, ground_truth):
    return ref_normalize_answer(prediction) == ref_normalize_answer(ground_truth)


# --- Strategies: answer-like text rich in what normalization touches ---------------------------------
_WORDS = [
    "a",
    "an",
    "the",
    "The",
    "A",
    "yes",
    "no",
    "Yes",
    "NO",
    "noanswer",
    "paris",
    "Paris",
    "an-the",
    "théâtre",
    "x",
    "1,000",
    "U.S.",
    "İstanbul",
    "ǅ",
    "straße",
]
_SEPARATORS = [" ", "  ", "\t", "\n", ".", ",", "-", "'", "\u00a0", "\u2003", "", "!", "(", ")"]
answer_text = st.one_of(
    st.text(),
    st.lists(
        st.one_of(
            st.sampled_from(_WORDS),
            st.sampled_from(_SEPARATORS),
            st.text(alphabet=string.punctuation + "aAnNtThHeEsyo ", max_size=6),
        ),
        max_size=12,
    ).map("".join),
)
# Text mixing LaTeX syntax into arbitrary unicode, to hunt for crashes in extraction.
latex_noise = st.lists(
    st.one_of(
        st.text(max_size=8),
        st.sampled_from(
            [
                "\\",
                "{",
                "}",
                "\\boxed{",
                "\\boxed",
                "\\fbox{",
                "\\text{",
                "\\{",
                "\\}",
                "\\\\",
                "$",
                "\\boxed {",
                "\\textbf{",
            ]
        ),
    ),
    max_size=30,
).map("".join)


# --- Agreement with the official evaluator ------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(answer_text)
def test_normalize_matches_official(s):
    assert normalize_answer(s) == ref_normalize_answer(s)


@settings(max_examples=200, deadline=None)
@given(answer_text, answer_text)
def test_em_and_f1_match_official(pred, gold):
    assert exact_match(pred, gold) == float(ref_exact_match_score(pred, gold))
    ours, ref = f1_score(pred, gold), ref_f1_score(pred, gold)
    assert ours == pytest.approx(ref)
    assert all(isinstance(x, float) for x in ours)


@pytest.mark.parametrize(
    ("pred", "gold", "expected"),
    [
        ("The Paris.", "paris", (1.0, 1.0, 1.0)),
        ("yes", "yes indeed", (0.0, 0.0, 0.0)),  # yes/no rule: no partial credit
        ("no way", "no", (0.0, 0.0, 0.0)),
        ("Yes.", "yes", (1.0, 1.0, 1.0)),
        ("new york city", "new york", (0.8, 2 / 3, 1.0)),
        ("the", "a", (0.0, 0.0, 0.0)),  # both normalize to "": EM 1 but no tokens
    ],
)
def test_f1_explicit(pred, gold, expected):
    assert f1_score(pred, gold) == pytest.approx(expected)
    assert f1_score(pred, gold) == pytest.approx(ref_f1_score(pred, gold))


def test_normalize_explicit():
    assert normalize_answer("  The  Beatles, an  English band!") == "beatles english band"
    assert normalize_answer("theatre") == "theatre"  # articles only as whole words
    assert normalize_answer("U.S.A.") == "usa"


# --- sub_EM ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("pred", "gold", "expected"),
    [
        ("Paris, France", "paris", 1.0),
        ("Paris", "Paris, France", 1.0),
        ("London", "Paris", 0.0),
        ("the", "Paris", 0.0),  # normalizes to "": must not match everything
        ("Paris", "The", 0.0),
        ("", "Paris", 0.0),
        ("...", "Paris", 0.0),
        ("The", "a", 1.0),  # EM is 1 (both ""), so sub_EM is 1 too
    ],
)
def test_sub_exact_match(pred, gold, expected):
    assert sub_exact_match(pred, gold) == expected


@settings(max_examples=150, deadline=None)
@given(answer_text, answer_text)
def test_sub_em_is_at_least_em(pred, gold):
    assert sub_exact_match(pred, gold) >= exact_match(pred, gold)
    if normalize_answer(pred) == "" and normalize_answer(gold) != "":
        assert sub_exact_match(pred, gold) == 0.0


# --- Box extraction ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so \boxed{The Paris.}", "The Paris."),
        (r"\boxed{f(x) = {a, {b}}} done", "f(x) = {a, {b}}"),
        (r"\boxed{first} then \boxed{second}", "second"),
        (r"\boxed{\text{Paris}}", "Paris"),
        (r"\boxed{ \textbf{ \mathrm{Paris} } }", "Paris"),
        (r"\boxed{\text{New} \text{York}}", "New York"),  # wrappers go wherever they stand
        (r"\boxed{\text{New} York}", "New York"),
        (r"\boxed{\text{Paris}, France}", "Paris, France"),
        (r"\boxed{\emph{The} \textsc{Beatles} and \mathrm{co}}", "The Beatles and co"),
        (r"\boxed{\text{New \textbf{York}} City}", "New York City"),  # nested inside a partial wrapper
        (r"\boxed{\text {spaced} wrapper}", "spaced wrapper"),
        (r"\boxed{\textcolor{red}{x}}", r"\textcolor{red}{x}"),  # not a wrapper of the answer's text
        (r"\boxed{a \text{b}", None),  # the box never closes
        (r"\boxed{ok} and then \boxed{unclosed", "ok"),  # unclosed trailing box ignored
        (r"\boxed{unclosed", None),
        (r"\boxed{a \boxed{b}}", "b"),
        (r"\fbox{x}", "x"),
        (r"\boxed{}", ""),
        (r"\boxed {spaced}", "spaced"),
        (r"\boxed Paris", None),  # no braces, no box
        (r"\boxedParis{x}", None),
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped braces are literal
        (r"\boxed{a\}", None),  # the only closing brace is escaped
        (r"\\boxed{json escaped}", "json escaped"),
        ("no box at all", None),
        ("", None),
        ("\\", None),
        ("}{", None),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.timeout(60)
def test_extract_boxed_handles_pathological_input():
    # Many unclosed boxes: a naive "scan to the end for each box" would be quadratic here (hours, so the
    # timeout fails it); the linear scan takes milliseconds. No timing assertion: speed lives in bench/.
    text = "\\boxed{" * 200_000 + r"\boxed{ok}"
    assert extract_boxed(text) == "ok"
    assert extract_boxed("\\boxed{" * 200_000) is None


# --- score_answer / reward ---------------------------------------------------------------------------
def test_score_answer_paris():
    score = score_answer(r"so \boxed{The Paris.}", ["paris"])
    assert score == AnswerScore(boxed="The Paris.", em=1.0, sub_em=1.0, f1=1.0, missing_box=False)
    assert reward_from_text(r"so \boxed{The Paris.}", ["paris"]) == 1.0


def _filler(n_chars: int) -> str:
    """`n_chars` of ordinary prose with no box, no brace and no backslash in it."""
    sentence = "I checked this against every document in memory and found nothing to contradict it. "
    return (sentence * (n_chars // len(sentence) + 1))[:n_chars]


@pytest.mark.parametrize(
    "text",
    [
        r"\boxed{Paris}" + " " + _filler(1_000),  # the box, then 1,000 characters of explanation
        r"\boxed{Paris}" + _filler(5_000 - len(r"\boxed{Paris}")),  # the box opens a 5,000-character answer
        _filler(2_000) + r" \boxed{Paris} " + _filler(2_000),  # the box in the middle of a long answer
    ],
)
def test_whole_answer_is_read_not_only_its_tail(text):
    # Pitfall "Math normalizer for QA" (docs/design.md): "only the last 300 characters read" (MemAgent, VIME): a model
    # that boxes its answer and then keeps explaining would score 0. The scorer reads the whole text, wherever the
    # box sits.
    assert len(text) >= 1_000 and r"\boxed" not in text[-300:]
    assert extract_boxed(text) == "Paris"
    assert score_answer(text, ["Paris"]) == AnswerScore(boxed="Paris", em=1.0, sub_em=1.0, f1=1.0, missing_box=False)
    assert reward_from_text(text, "Paris") == 1.0


def test_score_answer_is_frozen():
    score = score_answer(r"\boxed{x}", "x")
    with pytest.raises(dataclasses.FrozenInstanceError):
        score.em = 0.0  # type: ignore[misc]


def test_score_answer_missing_box():
    assert score_answer("The answer is Paris", ["Paris"]) == AnswerScore(None, 0.0, 0.0, 0.0, True)
    assert reward_from_text("The answer is Paris", ["Paris"]) == 0.0


def test_score_answer_best_gold_per_metric():
    # No gold gives EM; sub_EM comes from "new york", the best F1 from another gold: best per metric.
    score = score_answer(r"\boxed{new york city}", ["boston", "new york", "New York City, USA"])
    assert score.em == 0.0
    assert score.sub_em == 1.0
    assert score.f1 == pytest.approx(
        max(ref_f1_score("new york city", g)[0] for g in ["boston", "new york", "New York City, USA"])
    )
    assert score_answer(r"\boxed{Paris}", ["London", "paris"]).em == 1.0
    assert score_answer(r"\boxed{Paris}", "paris").em == 1.0  # a single gold string


def test_score_answer_yes_no_rule():
    score = score_answer(r"\boxed{yes}", ["yes it is"])
    assert (score.em, score.f1) == (0.0, 0.0)
    assert score.sub_em == 1.0  # substring still holds; only F1 has the yes/no rule
    assert reward_from_text(r"\boxed{No.}", ["no"]) == 1.0


def test_score_answer_article_only_answer_scores_zero():
    score = score_answer(r"\boxed{the}", ["Paris", "Tokyo"])
    assert (score.em, score.sub_em, score.f1, score.missing_box) == (0.0, 0.0, 0.0, False)


def test_score_answer_empty_box_is_a_box():
    score = score_answer(r"\boxed{}", ["Paris"])
    assert score.boxed == "" and not score.missing_box and score.em == 0.0


@pytest.mark.parametrize("bad_text", [None, 42, b"\\boxed{x}", ["\\boxed{x}"], object()])
def test_score_answer_non_string_text(bad_text):
    assert score_answer(bad_text, ["x"]) == AnswerScore(None, 0.0, 0.0, 0.0, True)  # type: ignore[arg-type]
    assert reward_from_text(bad_text, ["x"]) == 0.0  # type: ignore[arg-type]


@pytest.mark.parametrize("bad_golds", [None, [], [None, 3], 7, {"a": "x"}])
def test_score_answer_bad_golds(bad_golds):
    score = score_answer(r"\boxed{x}", bad_golds)  # type: ignore[arg-type]
    assert (score.boxed, score.em, score.f1, score.missing_box) == ("x", 0.0, 0.0, False)


def test_score_answer_mixed_golds_skips_non_strings():
    assert score_answer(r"\boxed{x}", [None, "x"]).em == 1.0  # type: ignore[list-item]


@settings(max_examples=300, deadline=None)
@given(latex_noise, st.one_of(latex_noise, st.lists(latex_noise, max_size=3)))
def test_score_answer_never_raises(text, golds):
    score = score_answer(text, golds)
    assert isinstance(score, AnswerScore)
    assert score.missing_box == (score.boxed is None)
    for value in (score.em, score.sub_em, score.f1):
        assert 0.0 <= value <= 1.0
    assert score.sub_em >= score.em


@settings(max_examples=150, deadline=None)
@given(answer_text, answer_text)
def test_boxed_answer_scores_like_official_em(answer, gold):
    # Any answer without braces/backslashes survives boxing intact, so the score equals the official EM.
    if any(ch in answer for ch in "{}\\"):
        return
    text = f"Reasoning... \\boxed{{{answer}}}"
    assert score_answer(text, [gold]).em == float(ref_exact_match_score(answer.strip(), gold))


def test_real_hotpotqa_golds_score_one_when_boxed(hotpot_dev_records, hotpot_train_records):
    answers = [rec["answer"] for rec in hotpot_dev_records + hotpot_train_records]
    assert len(answers) == 300
    for answer in answers:
        score = score_answer(f"The answer is \\boxed{{{answer}}}.", [answer])
        assert (score.em, score.sub_em, score.f1) == (1.0, 1.0, 1.0), answer


# --- Gold answers as any sequence (1.5) ----------------------------------------------------------------
def test_golds_from_a_numpy_array_score_as_a_list():
    np = pytest.importorskip("numpy")
    # A parquet column read back gives numpy arrays (object or unicode dtype), not lists.
    for golds in (np.array(["Paris"]), np.array(["Paris"], dtype=object), np.array(["London", "Paris"])):
        assert score_answer("\\boxed{Paris}", golds).em == 1.0
        assert reward_from_text("\\boxed{Paris}", golds) == 1.0
    assert gold_list(np.array(["a", "b"])) == ["a", "b"]


@pytest.mark.parametrize("golds", [("Paris",), ["Paris"], {"Paris"}, frozenset({"Paris"}), "Paris",
                                   iter(["Paris"]), (g for g in ["x", "Paris"])])
def test_golds_from_any_sequence_of_str(golds):
    assert score_answer("\\boxed{Paris}", golds).em == 1.0


@pytest.mark.parametrize("bad_golds", [None, 7, 2.5, {"a": "Paris"}, b"Paris", bytearray(b"Paris")])
def test_wrong_gold_types_are_a_named_error_and_score_zero(bad_golds, caplog, monkeypatch):
    with pytest.raises(GoldAnswerError, match="must be a str or a sequence of str.*pass the record's answers"):
        gold_list(bad_golds)
    # score_answer never raises (docs/design.md §2): the error is logged with what to change (once per type, so
    # a bad data set does not flood the log), and the answer scores 0.
    monkeypatch.setattr(scoring, "_REPORTED_GOLD_TYPES", set())
    with caplog.at_level("ERROR", logger="memrl.scoring"):
        score = score_answer("\\boxed{Paris}", bad_golds)
        score_answer("\\boxed{Paris}", bad_golds)
    assert (score.boxed, score.em, score.sub_em, score.f1) == ("Paris", 0.0, 0.0, 0.0)
    assert [r.getMessage().count(f"got {type(bad_golds).__name__};") for r in caplog.records] == [1]


def test_zero_dimensional_array_is_a_named_error():
    np = pytest.importorskip("numpy")
    with pytest.raises(GoldAnswerError, match="got ndarray"):
        gold_list(np.array("Paris"))
    assert score_answer("\\boxed{Paris}", np.array("Paris")).em == 0.0


# --- The "therefore" extractor (official non-boxed final prompt) --------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Therefore, the answer is Paris.", "Paris"),
        ("Reasoning...\nTherefore, the answer is (Wolf Alice).", "(Wolf Alice)"),
        ("**Therefore, the answer is Paris**", "Paris"),  # markdown bold
        ("Therefore, the **answer** is Paris", "Paris"),
        ("THE ANSWER IS Paris", "Paris"),  # any case (the official match is case-sensitive)
        ("Therefore, the answer is:\n\nParis\n\nThis follows from the memory.", "Paris"),  # one line
        ("the answer is Rome. Wait, the answer is Paris.", "Paris"),  # the last phrase counts
        ("Therefore, the answer is \\boxed{\\text{Paris}}.", "Paris"),
        ("Therefore, the answer is \\text{Paris}, France", "Paris, France"),
        ("Therefore, the answer is", ""),  # the phrase with nothing after it: an empty answer
        ("The answer isn't in the memory.", None),  # whole words only
        ("\\boxed{Paris}", None),  # a box alone is not this format's answer
        ("", None),
    ],
)
def test_extract_therefore(text, expected):
    assert extract_therefore(text) == expected


def test_score_answer_with_the_therefore_extractor():
    text = "Therefore, the answer is The Beatles."
    assert score_answer(text, ["the beatles"], "therefore") == AnswerScore("The Beatles", 1.0, 1.0, 1.0, False)
    assert reward_from_text(text, ["the beatles"], "therefore") == 1.0
    assert score_answer(text, ["the beatles"]).missing_box  # the default reads boxes only
    assert score_answer("no phrase", ["x"], "therefore") == AnswerScore(None, 0.0, 0.0, 0.0, True)
    assert set(ANSWER_EXTRACTORS) == {"boxed", "therefore"}


def test_unknown_extractor_is_a_named_error():
    with pytest.raises(ScoringError, match="unknown answer extractor 'last_line'.*boxed, therefore"):
        score_answer("\\boxed{x}", ["x"], "last_line")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(latex_noise, st.sampled_from(["the answer is", "The Answer Is", "*", "\n", ":"])),
                max_size=8).map("".join), st.lists(latex_noise, max_size=3))
def test_therefore_scoring_never_raises(text, golds):
    score = score_answer(text, golds, "therefore")
    assert score.missing_box == (score.boxed is None) and score.sub_em >= score.em


def official_read(response: str) -> str:
    """The text the official evaluation extracts from (ruler_hqa.py get_pred with utils' extract_solution)."""
    response = response.strip()
    pred = response.split("</think>")[-1].strip() if "</think>" in response else None
    return pred if pred else response


@pytest.mark.parametrize("answer, whole, after", [
    ("<think>\\boxed{Paris}</think>\nI am not sure.", 1.0, 0.0),  # the box sits in the think block only
    ("<think>maybe \\boxed{Rome}</think>\n\\boxed{Paris}", 1.0, 1.0),
    ("<think>\\boxed{Rome}</think>\\boxed{Paris}</think>\n\\boxed{Rome}", 0.0, 0.0),  # the last </think> counts
    ("<think>\\boxed{Paris}</think>\n \n", 1.0, 1.0),  # nothing after it: the whole answer, as the official
    ("\\boxed{Paris}", 1.0, 1.0),  # no think block
])
def test_answer_after_think_reads_what_the_official_evaluation_reads(answer, whole, after):
    assert score_answer(answer, ["Paris"]).em == reward_from_text(answer, ["Paris"]) == whole
    assert score_answer(answer, ["Paris"], after_think=True).em == after
    assert reward_from_text(answer, ["Paris"], "boxed", after_think=True) == after
    assert score_answer(official_read(answer), ["Paris"]).em == after  # the official rule, ported
