"""Exact-match reward: the response (or the answer a regex extracts from it) must equal the reference answer."""

from __future__ import annotations

import re


def exact_match_reward(
    prompt_text: str, response_text: str, answer: str, *, pattern: str | None = None, format_score: float = 0.0
) -> float:
    """1.0 when the answer equals ``answer`` after stripping surrounding whitespace, else ``format_score`` or 0.

    Without ``pattern`` the whole response is the answer. With it, the response must match the regex (its one
    capture group, or the whole match, is the answer; the last match counts, since a response restates its final
    answer at the end): a response that never matches is unformatted and scores 0, one whose extracted answer
    differs scores ``format_score``, a small credit that teaches the format before the answers are right.
    """
    if pattern is None:
        return float(response_text.strip() == answer.strip())
    regex = re.compile(pattern)
    if regex.groups > 1:
        raise ValueError(f"pattern {pattern!r} has {regex.groups} groups; it may capture at most one")
    matches = regex.findall(response_text)
    if not matches:
        return 0.0
    return 1.0 if matches[-1].strip() == answer.strip() else float(format_score)
