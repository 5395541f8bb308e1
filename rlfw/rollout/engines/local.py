"""The embedded generation engine: a Hugging Face copy of the policy (Llama, Qwen2 or Qwen3) and a batched
sampling loop, in-process, no vLLM.

It serves small policies on CPU (tests, the CPU smoke runs) and is the reference the vLLM engine is checked
against, so the loop is written out rather than delegated to ``generate()``: what a logprob means, how top-p
cuts and when a sequence stops are all decided here, in one place. It is a plain class implementing
``rlfw.rollout.engines.base.Engine``; wrapping it as a Ray actor happens in the engine factory.

Two decoders share that sampling: ``lockstep`` (the CPU default, ``rlfw.rollout.engines.lockstep``) decodes a
call's prompts as one left-padded batch until the last one stops; ``slots`` (the CUDA default,
``rlfw.rollout.engines.slots``) decodes them by continuous batching over a fixed-slot cache with CUDA graphs, in
bf16. On CUDA the engine runs in bf16; on CPU in fp32.

torch and transformers are imported by the engine's methods, in the engine's process, not with this module: the
rollout manager creates (and re-creates) the engine actors from this class and uses neither (their import is
most of a manager's start, which every rollout waits for).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlfw.model.shape import ModelShape
from rlfw.rollout.engines.base import Engine
from rlfw.rollout.engines.handoff import WeightHandoff
from rlfw.rollout.types import Generation, SamplingParams

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from rlfw.model.device_weights import SharedWeights
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
        import torch
        from transformers import AutoModelForCausalLM

        from rlfw.model.hf_convert import hf_config
        from rlfw.rollout.engines.slots import ATTENTION

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
        # The HF class of the policy's family (hf_config picks Llama, Qwen2 or Qwen3 from the shape).
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
        import torch

        from rlfw.model.device_weights import SharedWeights

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
        import torch

        from rlfw.rollout.engines import lockstep

        self._require_weights()
        if not prompts:
            return []
        self._check_lengths(prompts, params)
        started = time.perf_counter()
        if params.seed is not None:
            self._generator.manual_seed(params.seed)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        with torch.inference_mode(), self._handoff.generating():
            if self.decoder == "slots":
                return self._decode_slots(prompts, params, started)
            return lockstep.decode(self.model, prompts, params, started, pad_token_id=self.pad_token_id,
                                   eos_token_id=self.eos_token_id, sample=self._sample, take=self._handoff.take,
                                   version=lambda: self.weight_version)

    def _sample(self, logits: Tensor, params: SamplingParams) -> tuple[Tensor, Tensor]:
        from rlfw.rollout.engines.lockstep import sample

        return sample(logits, params, self._generator)

    def _decode_slots(self, prompts: list[list[int]], params: SamplingParams, started: float) -> list[Generation]:
        from rlfw.rollout.engines.lockstep import Responses
        from rlfw.rollout.engines.slots import SlotDecoder, run_slots

        out = Responses(len(prompts))
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
        import torch

        answer = super().health()
        if self.device.type == "cuda":
            answer["gpu_peak_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return answer

    def release_memory(self) -> None:
        """Free the slots decoder's key-value cache and CUDA graphs (the next call builds them again)."""
        import torch

        self._slots = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _check_lengths(self, prompts: list[list[int]], params: SamplingParams) -> None:
        for prompt in prompts:
            if not prompt:
                raise ValueError("prompts must not be empty")
            if len(prompt) + params.max_new_tokens > self.shape.max_seq_len:
                raise ValueError(
                    f"a prompt of {len(prompt)} tokens plus max_new_tokens={params.max_new_tokens} exceeds "
                    f"max_seq_len={self.shape.max_seq_len}"
                )
