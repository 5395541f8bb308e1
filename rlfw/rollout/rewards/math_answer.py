"""Math reward: the response's final answer must be mathematically equal to the reference answer (math-verify).

math-verify extracts the final answer (``\\boxed{...}``, "the answer is ...", else the last number or expression)
and compares with SymPy, so ``\\frac{1}{2}``, ``1/2`` and ``0.5`` agree. Its timeouts use ``signal.alarm``, which
works only in a process's main thread; elsewhere math-verify raises ``ValueError`` on every call. rlfw's
RolloutManager is a plain (single-threaded) Ray actor whose methods run in the worker's main thread, so there the
timeouts hold. In any other thread (a threaded or async actor, a thread pool) the timeouts are switched off, with
one warning, instead of failing every sample: the response is bounded by the task's ``max_response_len``.
"""

from __future__ import annotations

import logging
import threading

from math_verify import parse, verify

log = logging.getLogger(__name__)
_warned_no_timeout = False


def _timeout_in_this_thread(timeout_s: int) -> int | None:
    global _warned_no_timeout
    if threading.current_thread() is threading.main_thread():
        return timeout_s
    if not _warned_no_timeout:
        log.warning("math_reward runs outside the main thread: math-verify's signal-based timeouts are off")
        _warned_no_timeout = True
    return None


def math_reward(prompt_text: str, response_text: str, answer: str, *, timeout_s: int = 5) -> float:
    """1.0 if the response's final answer equals ``answer`` (numerically or symbolically), else 0.0.

    A response without a parseable answer scores 0.0, and so does one whose parse or comparison exceeds
    ``timeout_s`` seconds (math-verify logs those). A reference answer without parseable math raises ValueError:
    it is a broken dataset record, not a wrong response.
    """
    timeout = _timeout_in_this_thread(timeout_s)
    gold = parse(answer, parsing_timeout=timeout)
    if not gold:
        raise ValueError(f"the reference answer {answer!r} holds no math that math-verify can parse")
    predicted = parse(response_text, parsing_timeout=timeout)
    return float(verify(gold, predicted, timeout_seconds=timeout))
