"""Answer scoring for open-domain QA: exact match and token F1 with the SQuAD/HotpotQA
answer normalisation.

The functions follow the official evaluation scripts (SQuAD v1.1 ``evaluate-v1.1.py`` and
HotpotQA ``hotpot_evaluate_v1.py``) to the letter, so scores are comparable with published
numbers:

* :func:`normalize_answer`: lower-case, drop ASCII punctuation, drop the articles
  a/an/the, collapse whitespace (in that order).
* :func:`exact_match`: normalised strings are equal.
* :func:`f1_score`: bag-of-tokens F1 of the normalised strings; as in HotpotQA, a yes/no/
  noanswer prediction or gold answer scores 0 unless both are the same.

Several gold answers (aliases) are handled as in both scripts: the maximum over them.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Iterable

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_SPECIAL = ("yes", "no", "noanswer")


def normalize_answer(text: str) -> str:
    """SQuAD/HotpotQA normalisation: lower, remove punctuation, remove articles, fix spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match(prediction: str, ground_truth: str) -> float:
    """1.0 when the normalised prediction equals the normalised gold answer, else 0.0."""
    return float(normalize_answer(prediction) == normalize_answer(ground_truth))


def f1_parts(prediction: str, ground_truth: str) -> tuple[float, float, float]:
    """(F1, precision, recall) of the normalised token bags, HotpotQA's yes/no rule included."""
    pred, gold = normalize_answer(prediction), normalize_answer(ground_truth)
    if (pred in _SPECIAL or gold in _SPECIAL) and pred != gold:
        return 0.0, 0.0, 0.0
    pred_tokens, gold_tokens = pred.split(), gold.split()
    same = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if same == 0:
        return 0.0, 0.0, 0.0
    precision = same / len(pred_tokens)
    recall = same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall), precision, recall


def f1_score(prediction: str, ground_truth: str) -> float:
    """Token F1 of the normalised strings (see :func:`f1_parts`)."""
    return f1_parts(prediction, ground_truth)[0]


def best_over_answers(metric, prediction: str, answers: Iterable[str]) -> float:
    """``max(metric(prediction, a) for a in answers)``; 0.0 when there are no answers."""
    return max((float(metric(prediction, a)) for a in answers), default=0.0)


def names_several(prediction: str, candidates: Iterable[str]) -> bool:
    """True when the prediction contains two or more of ``candidates`` as whole normalised
    token runs: the "A or B" hedge on a comparison question, which token F1 alone would
    still reward with about 0.5."""
    pred = f" {normalize_answer(prediction)} "
    hits = 0
    for cand in candidates:
        norm = normalize_answer(cand)
        if norm and f" {norm} " in pred:
            hits += 1
    return hits >= 2
