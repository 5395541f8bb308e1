"""The embedded generation engine: a Hugging Face copy of the policy (Llama, Qwen2 or Qwen3) and a batched
sampling loop, in-process, no vLLM.

It serves small policies on CPU (tests, the CPU smoke runs) and is the reference the vLLM engine is checked
against, so the loop is written out rather than delegated to ``generate()``: what a logprob means, how top-p
cuts and when a sequence stops are all decided here, in one place. It is a plain class implementing
``rlfw.rollout.engines.base.Engine``; wrapping it as a Ray actor happens in the engine factory.

Two decoders share that sampling: ``lockstep`` (the CPU default) decodes a call's prompts as one left-padded batch
until the last one stops; ``slots`` (the CUDA default, ``rlfw.rollout.engines.slots``) decodes them by continuous
batching over a fixed-slot cache with CUDA graphs, in bf16. On CUDA the engine runs in bf16; on CPU in fp32.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from rlfw.model.hf_convert import hf_config
from rlfw.model.shape import ModelShape
from rlfw.rollout.engines.base import Engine
from rlfw.model.device_weights import SharedWeights
from rlfw.rollout.engines.handoff import WeightHandoff
from rlfw.rollout.types import Generation, SamplingParams

if TYPE_CHECKING:
    from transformers import DynamicCache

    from rlfw.rollout.engines.slots import SlotDecoder


class LocalEngine(Engine):
    """Samples responses from the policy last loaded with ``update_weights``."""

    supports_partial_rollout = True

    def __init__(
        self,
        shape: ModelShape,
        eos_token_id: int,
        pad_token_id: int,
        seed: int,
        device: str | torch.device = "cpu",
        decoder: str = "auto",
        max_batch: int = 0,
        cuda_graphs: bool = True,
        release_cache: bool = False,
        gpu_index: int = 0,
    ) -> None:
        """``device``: cpu, cuda, or auto (cuda when torch sees a GPU); ``decoder``: lockstep | slots | auto (slots on
        CUDA); ``max_batch``: slots of the slots decoder (0: a call's requests at once); ``release_cache``: free
        the slots decoder's cache after each call (colocated with a trainer, which needs the memory meanwhile);
        ``gpu_index``: with ``device`` cuda, which of the GPUs this process sees (modulo their count: a colocated
        engine sees every GPU of its node, a separate one the GPU Ray gave it)."""
        self.shape = shape
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda" and torch.cuda.is_available():
            device = torch.device("cuda", gpu_index % torch.cuda.device_count())
        self.device = torch.device(device)
        on_cuda = self.device.type == "cuda"
        self.decoder = ("slots" if on_cuda else "lockstep") if decoder == "auto" else decoder
        if self.decoder not in ("lockstep", "slots"):
            raise ValueError(f"decoder={decoder!r} is not one of lockstep, slots, auto")
        self.max_batch, self.cuda_graphs, self.release_cache = max_batch, cuda_graphs, release_cache
        # The HF class of the policy's family (hf_config picks Llama, Qwen2 or Qwen3 from the shape). HF's modeling
        # code is imported here, in the engine's process: whoever only names the class (the rollout manager, which
        # starts the engines) need not wait for it before the engine's own process starts.
        from transformers import AutoModelForCausalLM

        from rlfw.rollout.engines.slots import ATTENTION

        attention = {"attn_implementation": ATTENTION} if self.decoder == "slots" else {}
        dtype = torch.bfloat16 if on_cuda else torch.float32
        self.model = AutoModelForCausalLM.from_config(hf_config(shape), **attention).to(self.device, dtype).eval()
        self._slots: SlotDecoder | None = None  # the slots decoder's cache and graphs, kept between calls
        # Policy version of the loaded weights; None until the first update_weights.
        self.weight_version: int | None = None
        self._generator = torch.Generator(self.device).manual_seed(seed)
        self._handoff = WeightHandoff()  # weights pushed during a generate call wait for its next decode step

    @classmethod
    def init_kwargs(cls, cfg, shape: ModelShape, tokenizer, seed: int, index: int, workdir: Path) -> dict[str, Any]:
        rollout = cfg.rollout
        return {"shape": shape, "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
                "seed": seed, "device": cfg.cluster.device, "max_batch": rollout.max_batch,
                "cuda_graphs": rollout.cuda_graphs, "release_cache": cfg.cluster.placement == "colocated",
                "gpu_index": index}

    def update_weights(self, hf_state: dict[str, Tensor] | SharedWeights, version: int) -> None:
        """Load a full HF state dict (see ``rlfw.model.hf_convert.megatron_to_hf``) into the model's own tensors
        (cast to its dtype; CUDA graphs stay valid), or the writer's buffer on this GPU that ``hf_state`` shares
        (``rollout.weight_transport=device``: a device-to-device copy). During a
        ``generate`` call the call under way loads them before its next decode step, and this returns once it has
        (a partial rollout: see ``generate``)."""
        self._handoff.load(lambda: self._load(hf_state, version), f"weights v{version}")

    def _load(self, hf_state: dict[str, Tensor] | SharedWeights, version: int) -> None:
        if isinstance(hf_state, SharedWeights):
            try:
                packed = hf_state.open()
            except (RuntimeError, OSError) as e:  # CUDA's error, or the sharer's reference-count file gone
                raise RuntimeError(
                    f"weights v{version} were shared from the writer's GPU memory (rollout.weight_transport=device) "
                    f"and this engine cannot open them: {e}. The writer's process may be gone (an engine restarted "
                    "after its writer died), or it sits on another GPU this one cannot reach; "
                    "rollout.weight_transport=host sends a host copy instead") from e
            self.model.load_state_dict(packed.tensors(), strict=True)
            torch.cuda.current_stream(self.device).synchronize()  # copied before the mapping closes
            del packed
        else:
            self.model.load_state_dict(hf_state, strict=True)
        self.weight_version = version

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """Sample one response per prompt, all prompts decoded together as one left-padded batch.

        ``logprobs`` are those of the temperature-scaled distribution, ``log_softmax(logits / temperature)``,
        taken *before* top-p truncation: that is the distribution the trainer recomputes from its own logits, and
        the truncation is a sampling heuristic it does not model. Greedy decoding (temperature 0) reports
        ``log_softmax(logits)``. Sequences stop at ``eos_token_id`` (kept in the response) or after
        ``max_new_tokens``.

        **Partial rollouts.** ``update_weights`` may run while this call decodes (the engine's actor takes two calls
        at a time): this call loads the new weights before its next decode step, rebuilds the key-value cache from
        the prompts and the tokens sampled so far under them, and goes on. Every token records the version that
        sampled it (``Generation.token_versions``).
        """
        self._require_weights()
        if not prompts:
            return []
        self._check_lengths(prompts, params)
        started = time.perf_counter()
        if params.seed is not None:
            self._generator.manual_seed(params.seed)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        with self._handoff.generating():
            if self.decoder == "slots":
                return self._decode_slots(prompts, params, started)
            return self._decode(prompts, params, started)

    def _decode_slots(self, prompts: list[list[int]], params: SamplingParams, started: float) -> list[Generation]:
        from rlfw.rollout.engines.slots import SlotDecoder, run_slots

        out = _Responses(len(prompts))
        slots = min(len(prompts), self.max_batch or len(prompts))
        length = max(len(prompt) for prompt in prompts) + params.max_new_tokens
        if self._slots is None or self._slots.slots < slots or self._slots.length < length:
            self.release_memory()
            self._slots = SlotDecoder(self.model, slots, length, self.cuda_graphs)

        def on_token(request: int, token: int, logprob: float) -> None:
            out.add(request, token, logprob, self.weight_version, time.perf_counter() - started)

        try:
            run_slots(self._slots, prompts, params.max_new_tokens, self.eos_token_id, self.pad_token_id,
                      lambda logits: self._sample(logits, params), on_token, self._handoff.take)
        finally:
            if self.release_cache:
                self.release_memory()
        return out.generations(self.eos_token_id)

    def health(self) -> dict[str, Any]:
        """``Engine.health``, and on CUDA the peak memory this process allocated since its last generate began."""
        answer = super().health()
        if self.device.type == "cuda":
            answer["gpu_peak_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return answer

    def release_memory(self) -> None:
        """Free the slots decoder's key-value cache and CUDA graphs (the next call builds them again)."""
        self._slots = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _decode(self, prompts: list[list[int]], params: SamplingParams, started: float) -> list[Generation]:
        batch = len(prompts)
        out = _Responses(batch)
        prompt_ids, prompt_mask = self._left_pad(prompts)
        decoded: list[Tensor] = []  # the token fed back at each step (pads for finished rows): the cache's input
        finished = torch.zeros(batch, dtype=torch.bool, device=self.device)
        cache, logits, next_position, attention_mask = self._prefill(prompt_ids, prompt_mask, decoded)
        for step in range(params.max_new_tokens):
            if self._handoff.take():  # new weights: the cache and the logits belong to the old ones
                cache, logits, next_position, attention_mask = self._prefill(prompt_ids, prompt_mask, decoded)
            tokens, token_logprobs = self._sample(logits, params)
            for i, (token, logprob, done) in enumerate(
                zip(tokens.tolist(), token_logprobs.tolist(), finished.tolist())
            ):
                if not done:
                    out.add(i, token, logprob, self.weight_version, time.perf_counter() - started)
            finished |= tokens == self.eos_token_id
            if finished.all() or step + 1 == params.max_new_tokens:
                break
            # Finished sequences keep decoding pads in lockstep (simpler than shrinking the cache); their outputs are
            # never read.
            tokens = tokens.masked_fill(finished, self.pad_token_id)
            decoded.append(tokens)
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(batch, 1)], dim=1)
            logits = self._next_token_logits(tokens[:, None], attention_mask, next_position, cache)
            next_position = next_position + 1

        return out.generations(self.eos_token_id)

    def _prefill(
        self, prompt_ids: Tensor, prompt_mask: Tensor, decoded: list[Tensor]
    ) -> tuple[DynamicCache, Tensor, Tensor, Tensor]:
        """A fresh cache of the prompts and the tokens ``decoded`` so far under the current weights: (cache, the
        next token's logits, the next position, the attention mask)."""
        from transformers import DynamicCache

        input_ids = torch.cat([prompt_ids, *[tokens[:, None] for tokens in decoded]], dim=1)
        attention_mask = torch.cat([prompt_mask, prompt_mask.new_ones(len(prompt_ids), len(decoded))], dim=1)
        # Each sequence counts positions from its first real token, as it would unpadded.
        position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        logits = self._next_token_logits(input_ids, attention_mask, position_ids, cache)
        return cache, logits, position_ids[:, -1:] + 1, attention_mask

    def _check_lengths(self, prompts: list[list[int]], params: SamplingParams) -> None:
        for prompt in prompts:
            if not prompt:
                raise ValueError("prompts must not be empty")
            if len(prompt) + params.max_new_tokens > self.shape.max_seq_len:
                raise ValueError(
                    f"a prompt of {len(prompt)} tokens plus max_new_tokens={params.max_new_tokens} exceeds "
                    f"max_seq_len={self.shape.max_seq_len}"
                )

    def _left_pad(self, prompts: list[list[int]]) -> tuple[Tensor, Tensor]:
        """Right-align the prompts so that every sequence's next token lands in the same (last) column."""
        width = max(len(prompt) for prompt in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            attention_mask[row, width - len(prompt) :] = 1
        return input_ids.to(self.device), attention_mask.to(self.device)

    def _next_token_logits(
        self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, cache: DynamicCache
    ) -> Tensor:
        """Run the new tokens through the model, appending their keys and values to ``cache``; [batch, vocab]."""
        output = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,  # covers the cached tokens and the new ones
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return output.logits[:, -1].float()

    def _sample(self, logits: Tensor, params: SamplingParams) -> tuple[Tensor, Tensor]:
        """Next tokens [batch] and their logprobs [batch] (see ``generate`` for which distribution)."""
        if params.temperature == 0:
            tokens = logits.argmax(dim=-1)
            logprobs = torch.log_softmax(logits, dim=-1)
        else:
            logprobs = torch.log_softmax(logits / params.temperature, dim=-1)
            probs = logprobs.exp()
            if params.top_p < 1:
                probs = _top_p_filter(probs, params.top_p)
            tokens = torch.multinomial(probs, 1, generator=self._generator).squeeze(-1)
        return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


class _Responses:
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


def _top_p_filter(probs: Tensor, top_p: float) -> Tensor:
    """Zero all but the smallest set of most likely tokens whose mass reaches ``top_p`` (unnormalised result)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # The most likely token has no mass before it, so at least one token always survives.
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    return torch.zeros_like(probs).scatter(-1, order, sorted_probs)
