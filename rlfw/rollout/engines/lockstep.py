"""The embedded engine's lockstep decoder (its CPU default) and the sampling both its decoders share.

Lockstep decodes a call's prompts as one left-padded batch until the last one stops: one prefill, then one token per
sequence per step through transformers' ``DynamicCache``. A weight push taken between two steps (``take``) rebuilds
the cache from the prompts and the tokens sampled so far under the new weights, so every later token is theirs
(partial rollouts). ``sample`` is the engine's distribution: ``log_softmax(logits / temperature)`` before top-p
truncation (greedy: ``log_softmax(logits)``), the one the trainer recomputes from its own logits.

Its own module because the engine's class is named by processes that never decode: the rollout manager creates
(and re-creates) engine actors from it and imports neither torch nor transformers (``rlfw.rollout.engines.local``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import Tensor
from transformers import DynamicCache

from rlfw.rollout.types import Generation, SamplingParams


def decode(model, prompts: list[list[int]], params: SamplingParams, started: float, *, pad_token_id: int,
           eos_token_id: int, sample: Callable[[Tensor, SamplingParams], tuple[Tensor, Tensor]],
           take: Callable[[], bool], version: Callable[[], int | None]) -> list[Generation]:
    """One response per prompt; ``take()`` loads weights pushed meanwhile (True if it did), ``version()`` names
    the weights loaded, ``sample`` draws the next tokens."""
    device = next(model.parameters()).device
    batch = len(prompts)
    out = Responses(batch)
    prompt_ids, prompt_mask = _left_pad(prompts, pad_token_id, device)
    decoded: list[Tensor] = []  # the token fed back at each step (pads for finished rows): the cache's input
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    cache, logits, next_position, attention_mask = _prefill(model, prompt_ids, prompt_mask, decoded)
    for step in range(params.max_new_tokens):
        if take():  # new weights: the cache and the logits belong to the old ones
            cache, logits, next_position, attention_mask = _prefill(model, prompt_ids, prompt_mask, decoded)
        tokens, token_logprobs = sample(logits, params)
        for i, (token, logprob, done) in enumerate(zip(tokens.tolist(), token_logprobs.tolist(), finished.tolist())):
            if not done:
                out.add(i, token, logprob, version(), time.perf_counter() - started)
        finished |= tokens == eos_token_id
        if finished.all() or step + 1 == params.max_new_tokens:
            break
        # Finished sequences keep decoding pads in lockstep (simpler than shrinking the cache); their outputs are
        # never read.
        tokens = tokens.masked_fill(finished, pad_token_id)
        decoded.append(tokens)
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(batch, 1)], dim=1)
        logits = _next_token_logits(model, tokens[:, None], attention_mask, next_position, cache)
        next_position = next_position + 1
    return out.generations(eos_token_id)


def sample(logits: Tensor, params: SamplingParams, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Next tokens [batch] and their logprobs [batch] (see the module docstring for which distribution)."""
    if params.temperature == 0:
        tokens = logits.argmax(dim=-1)
        logprobs = torch.log_softmax(logits, dim=-1)
    else:
        logprobs = torch.log_softmax(logits / params.temperature, dim=-1)
        probs = logprobs.exp()
        if params.top_p < 1:
            probs = _top_p_filter(probs, params.top_p)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


class Responses:
    """What a call has sampled so far, per request: tokens, their log-probs and versions, the seconds to the last."""

    def __init__(self, count: int) -> None:
        self.tokens: list[list[int]] = [[] for _ in range(count)]
        self.logprobs: list[list[float]] = [[] for _ in range(count)]
        self.versions: list[list[int]] = [[] for _ in range(count)]
        self.seconds = [0.0] * count

    def add(self, request: int, token: int, logprob: float, version: int, seconds: float) -> None:
        self.tokens[request].append(token)
        self.logprobs[request].append(logprob)
        self.versions[request].append(version)
        self.seconds[request] = seconds

    def generations(self, eos_token_id: int) -> list[Generation]:
        return [
            Generation(response, lps, "stop" if response[-1] == eos_token_id else "length", vers[0], secs,
                       token_versions=vers)
            for response, lps, vers, secs in zip(self.tokens, self.logprobs, self.versions, self.seconds)
        ]


def _prefill(model, prompt_ids: Tensor, prompt_mask: Tensor, decoded: list[Tensor]
             ) -> tuple[DynamicCache, Tensor, Tensor, Tensor]:
    """A fresh cache of the prompts and the tokens ``decoded`` so far under the current weights: (cache, the next
    token's logits, the next position, the attention mask)."""
    input_ids = torch.cat([prompt_ids, *[tokens[:, None] for tokens in decoded]], dim=1)
    attention_mask = torch.cat([prompt_mask, prompt_mask.new_ones(len(prompt_ids), len(decoded))], dim=1)
    # Each sequence counts positions from its first real token, as it would unpadded.
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    logits = _next_token_logits(model, input_ids, attention_mask, position_ids, cache)
    return cache, logits, position_ids[:, -1:] + 1, attention_mask


def _left_pad(prompts: list[list[int]], pad_token_id: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Right-align the prompts so that every sequence's next token lands in the same (last) column."""
    width = max(len(prompt) for prompt in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[row, width - len(prompt) :] = 1
    return input_ids.to(device), attention_mask.to(device)


def _next_token_logits(model, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor,
                       cache: DynamicCache) -> Tensor:
    """Run the new tokens through the model, appending their keys and values to ``cache``; [batch, vocab]."""
    output = model(
        input_ids=input_ids,
        attention_mask=attention_mask,  # covers the cached tokens and the new ones
        position_ids=position_ids,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    return output.logits[:, -1].float()


def _top_p_filter(probs: Tensor, top_p: float) -> Tensor:
    """Zero all but the smallest set of most likely tokens whose mass reaches ``top_p`` (unnormalised result)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # The most likely token has no mass before it, so at least one token always survives.
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    return torch.zeros_like(probs).scatter(-1, order, sorted_probs)
