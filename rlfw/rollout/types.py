"""The records that flow between tasks, generation engines and the trainer during rollout."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Prompt:
    """One task instance: what the policy sees, and what the task's verifier compares the response against.

    ``prompt_id`` is unique per task instance, so the several responses sampled for one prompt can be grouped
    (e.g. for group-relative advantages). ``target`` is token ids for synthetic tasks that score tokens (copy) and
    the reference answer text for dataset tasks that score decoded text (math, exact match).
    """

    prompt_id: int
    token_ids: list[int]
    target: list[int] | str


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How an engine samples a response; invalid values raise ValueError naming the field.

    ``temperature=0`` means greedy decoding; ``top_p`` keeps the smallest set of most likely tokens whose
    probability mass reaches it (1.0 keeps all).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int
    # Reseeds the engine's sampler for this call: the same requests, weights and seed give the same responses, so
    # a resumed run (or a retried request) samples exactly what the uninterrupted run sampled. None = keep going.
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass(frozen=True)
class Generation:
    """One sampled response.

    ``logprobs[i]`` is the log-probability of ``response_ids[i]`` under the distribution it was sampled from
    (see the engine for what that means exactly). ``finish_reason`` is "stop" when the response ends with the
    end-of-sequence token (which it then includes) and "length" when it ran out of ``max_new_tokens``.
    ``weight_version`` is the policy version the engine held when it sampled the first token, so a consumer can
    refuse a response from stale weights. ``token_versions[i]`` is the version that sampled ``response_ids[i]``:
    an engine that takes new weights in the middle of a response (a partial rollout, ``Engine
    .supports_partial_rollout``) continues it under them, so its tokens carry several versions; None when every
    token carries ``weight_version``. ``seconds`` is the time from the start of the engine call that produced it to
    its last token (a measurement, so it takes no part in equality).
    """

    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: int | None = None
    seconds: float = field(default=0.0, compare=False)
    token_versions: list[int] | None = None

    def versions(self) -> list[int | None]:
        """The policy version of every response token."""
        if self.token_versions is not None:
            return list(self.token_versions)
        return [self.weight_version] * len(self.response_ids)


class PartialResponse:
    """A response put together from the requests it took: a partial rollout continues it, after each weight change
    in flight, as a new request from its prompt and the tokens so far. The engines that do so (vLLM, SGLang) record
    each piece here, with the version that sampled it."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.finish_reason: str | None = None  # None while tokens are to come
        self.seconds = 0.0

    def add(self, tokens: list[int], logprobs: list[float], version: int) -> None:
        self.tokens += tokens
        self.logprobs += logprobs
        self.versions += [version] * len(tokens)

    def generation(self) -> Generation:
        return Generation(self.tokens, self.logprobs, self.finish_reason, self.versions[0], self.seconds,
                          token_versions=self.versions)
