"""Continuous batching for the local engine: a fixed-slot key-value cache, sequences refilled as others finish, and
the decode step replayed as CUDA graphs.

Why not HF's ``generate`` or ``StaticCache``: the engine needs its own sampling (log-probs of the temperature-scaled
distribution, top-p after them, one seeded generator) and weight pushes between two decode steps, and
``StaticCache`` writes every row at one shared position, so a row cannot start while others are half done. Here
each of ``slots`` rows of the cache holds one sequence at its own length: a finished sequence's slot takes the next
request (prefilled, right-padded, on its own), so a long-tailed batch keeps the slots busy instead of waiting for
its longest response, and once no request is left the survivors are moved into the lowest slots so that the decode
step runs over the smallest power-of-two batch that holds them. The cache is allocated once per call (or kept
across calls), never per token; attention reads only the columns in use, rounded up to ``WIDTH_STEP``.

The decode step (the HF model's own forward, with this cache and an explicit boolean mask) is captured as one CUDA
graph per (batch, width) bucket and replayed: a 0.5B model's step is hundreds of small kernels, whose launches
alone would take longer than the GPU's work. Weight loads copy into the same parameter tensors, so the graphs stay
valid across pushes. Attention is registered with transformers (``ATTENTION``): a decode step folds each key-value
group's query heads into one SDPA call over the cache as it lies (no grouped-query copy of the keys and values).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

log = logging.getLogger("rlfw.rollout")
ATTENTION = "rlfw_slots"
WIDTH_STEP = 256  # attention width buckets (columns); each (batch, width) bucket is one CUDA graph
MIN_BATCH = 8  # the smallest decode batch bucket
PREFILL_TOKENS = 16384  # tokens (rows x padded width) of one prefill forward


def slot_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                   scaling: float | None = None, dropout: float = 0.0, **kwargs) -> tuple[Tensor, None]:
    """SDPA over the slot cache; query [b, heads, q, d], key/value [b, groups, w, d], mask [b, 1, q, w] (bool,
    True = attend). Returns [b, q, heads, d] as HF's attention functions do."""
    b, heads, q, d = query.shape
    groups = key.shape[1]
    if q == 1 and heads != groups:  # decode: each group's query heads as the query rows of one group
        out = F.scaled_dot_product_attention(query.view(b, groups, heads // groups, d), key, value,
                                             attn_mask=attention_mask, scale=scaling)
        return out.view(b, heads, 1, d).transpose(1, 2), None
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                         is_causal=attention_mask is None, enable_gqa=groups != heads)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, slot_attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # outside the decoder (HF generate, a full forward): SDPA's


class SlotCache:
    """Keys and values of ``slots`` sequences, [slots, groups, length, head_dim] per layer. The HF model calls
    ``update`` once per layer; what it writes where is set beforehand: ``decode(b, w, columns)`` (one token for each
    of the first ``b`` slots, at its own column, attention over ``w`` columns) or ``prefill(rows)`` (whole
    sequences from column 0 into the slots ``rows``)."""

    def __init__(self, num_layers: int, slots: int, groups: int, length: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (slots, groups, length, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.slots, self.length = slots, length
        self._rows: Tensor | None = None
        self._columns: Tensor | None = None
        self._b = self._w = 0

    @property
    def nbytes(self) -> int:
        return 2 * sum(k.numel() * k.element_size() for k in self.keys)

    def decode(self, b: int, w: int, columns: Tensor) -> None:
        self._rows, self._b, self._w, self._columns = None, b, w, columns

    def prefill(self, rows: Tensor) -> None:
        self._rows = rows

    def update(self, key: Tensor, value: Tensor, layer_idx: int, *args, **kwargs) -> tuple[Tensor, Tensor]:
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if self._rows is not None:  # prefill: the new tokens attend among themselves
            width = key.shape[2]
            keys[self._rows, :, :width] = key
            values[self._rows, :, :width] = value
            return key, value
        b, w = self._b, self._w
        index = self._columns.view(b, 1, 1, 1).expand(b, key.shape[1], 1, key.shape[3])
        keys[:b].scatter_(2, index, key)
        values[:b].scatter_(2, index, value)
        return keys[:b, :, :w], values[:b, :, :w]

    def move(self, src: list[int], dst: list[int], width: int) -> None:
        """Copy the first ``width`` columns of slots ``src`` into slots ``dst``."""
        s = torch.tensor(src, device=self.keys[0].device)
        d = torch.tensor(dst, device=self.keys[0].device)
        for keys, values in zip(self.keys, self.values):
            keys[d, :, :width] = keys[s, :, :width]
            values[d, :, :width] = values[s, :, :width]


class SlotDecoder:
    """Runs a causal LM (a HF ``...ForCausalLM`` built with ``attn_implementation=ATTENTION``) over a
    ``SlotCache``: ``prefill`` whole sequences into slots, ``decode`` one token for the first ``b`` slots."""

    def __init__(self, model, slots: int, length: int, cuda_graphs: bool) -> None:
        config = model.config
        param = next(model.parameters())
        self.model, self.device = model, param.device
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        # one column past ``length``: the scratch column that a graph's warm-up writes, never attended to
        self.cache = SlotCache(config.num_hidden_layers, slots, config.num_key_value_heads, length + 1, head_dim,
                               param.dtype, self.device)
        self.slots, self.length = slots, length
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        # the decode step's inputs, static so that a CUDA graph reads them where it was captured
        self.ids = torch.zeros(slots, 1, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(slots, 1, dtype=torch.long, device=self.device)
        self.columns = torch.zeros(slots, dtype=torch.long, device=self.device)
        self._arange = torch.arange(length + 1, device=self.device)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None

    def _logits(self, input_ids: Tensor, mask: Tensor, positions: Tensor, last: Tensor | None) -> Tensor:
        hidden = self.model.model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                                  past_key_values=self.cache, use_cache=True).last_hidden_state
        hidden = hidden[:, -1] if last is None else hidden[torch.arange(len(last), device=self.device), last]
        return self.model.lm_head(hidden).float()

    def prefill(self, rows: list[int], sequences: list[list[int]]) -> Tensor:
        """Write ``sequences`` into slots ``rows`` from column 0; the next token's logits of each, [len(rows), V]."""
        out = []
        width_of = max(len(s) for s in sequences)
        per_call = max(1, PREFILL_TOKENS // width_of)
        for start in range(0, len(rows), per_call):
            chunk, seqs = rows[start:start + per_call], sequences[start:start + per_call]
            width = max(len(s) for s in seqs)
            ids = torch.zeros(len(seqs), width, dtype=torch.long)
            lengths = torch.tensor([len(s) for s in seqs])
            for i, s in enumerate(seqs):
                ids[i, :len(s)] = torch.tensor(s)
            ids, lengths = ids.to(self.device), lengths.to(self.device)
            cols = self._arange[:width]
            # causal, and no key past a row's own length (right padding; a pad query still sees column 0)
            mask = (cols[None, :] <= cols[:, None])[None] & (cols[None, None, :] < lengths[:, None, None])
            self.cache.prefill(torch.tensor(chunk, device=self.device))
            positions = cols[None, :].expand(len(seqs), width)
            out.append(self._logits(ids, mask[:, None], positions, lengths - 1))
        return torch.cat(out)

    def decode(self, b: int, w: int) -> Tensor:
        """One decode step of slots ``[0, b)`` from ``ids``/``positions``/``columns`` (attention over ``w``
        columns); logits [b, V] (a graph's output buffer: read before the next step)."""
        if not self.cuda_graphs:
            return self._decode_step(b, w)
        if (b, w) not in self._graphs:
            try:
                self._graphs[(b, w)] = self._capture(b, w)
            except RuntimeError as e:  # the step still runs, eagerly; said once, with the cause
                log.warning("the decode step could not be captured as a CUDA graph (%s); it runs eagerly", e)
                self.cuda_graphs = False
                return self._decode_step(b, w)
        graph, logits = self._graphs[(b, w)]
        graph.replay()
        return logits

    def _decode_step(self, b: int, w: int) -> Tensor:
        columns = self.columns[:b]
        mask = (self._arange[:w][None, :] <= columns[:, None])[:, None, None, :]
        self.cache.decode(b, w, columns)
        return self._logits(self.ids[:b], mask, self.positions[:b], None)

    def _capture(self, b: int, w: int) -> tuple[torch.cuda.CUDAGraph, Tensor]:
        # The warm-up runs (the capture only records): it writes the scratch column of slots that hold live
        # sequences, whose own columns it must not touch.
        saved = [t.clone() for t in (self.ids, self.positions, self.columns)]
        self.ids[:b].zero_(), self.positions[:b].zero_(), self.columns[:b].fill_(self.length)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._decode_step(b, w)  # warm-up: lazy initialisation, kernel selection, off the graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            logits = self._decode_step(b, w)
        for t, s in zip((self.ids, self.positions, self.columns), saved):
            t.copy_(s)
        return graph, logits

    def width(self, longest: int) -> int:
        """The attention width bucket holding ``longest`` columns."""
        return min(self.length, -(-longest // WIDTH_STEP) * WIDTH_STEP)

    @staticmethod
    def batch(highest_slot: int, slots: int) -> int:
        """The decode batch bucket holding slots ``[0, highest_slot]``."""
        b = MIN_BATCH
        while b <= highest_slot:
            b *= 2
        return min(b, slots)


def run_slots(decoder: SlotDecoder, prompts: list[list[int]], max_new_tokens: int, eos: int, pad: int,
              sample: Callable[[Tensor], tuple[Tensor, Tensor]], on_token: Callable[[int, int, float], None],
              take_weights: Callable[[], bool]) -> None:
    """Decode ``prompts`` over ``decoder``'s slots, refilling freed slots from the queue. ``sample(logits)`` gives
    tokens and log-probs; ``on_token(request, token, logprob)`` records one; ``take_weights()`` loads weights
    pushed meanwhile (True: the cache of every sequence in flight is rebuilt under them before the next token)."""
    slots = decoder.slots
    queue = deque(range(len(prompts)))
    request_of: list[int | None] = [None] * slots  # the request each slot decodes
    lengths = [0] * slots  # tokens in each slot's cache
    responses: dict[int, list[int]] = {}
    refill_at = max(1, slots // 8)  # free slots that make a refill worth a prefill forward

    while queue or any(r is not None for r in request_of):
        busy = [s for s in range(slots) if request_of[s] is not None]
        free = [s for s in range(slots) if request_of[s] is None]
        rows: list[int] = []
        chunks: list[Tensor] = []
        if take_weights() and busy:  # new weights: rebuild every sequence in flight under them
            chunks.append(decoder.prefill(busy, [prompts[request_of[s]] + responses[request_of[s]] for s in busy]))
            rows += busy
            for s in busy:
                lengths[s] = len(prompts[request_of[s]]) + len(responses[request_of[s]])
        elif busy:
            b = decoder.batch(max(busy), slots)
            # each slot's last token at its own column; idle slots decode a pad at column 0, never read
            tokens = [responses[request_of[s]][-1] if request_of[s] is not None else pad for s in range(b)]
            columns = [lengths[s] if request_of[s] is not None else 0 for s in range(b)]
            decoder.ids[:b, 0].copy_(torch.tensor(tokens))
            decoder.positions[:b, 0].copy_(torch.tensor(columns))
            decoder.columns[:b].copy_(torch.tensor(columns))
            logits = decoder.decode(b, decoder.width(max(columns) + 1))
            chunks.append(logits[torch.tensor(busy, device=logits.device)])
            rows += busy
            for s in busy:
                lengths[s] += 1
        if queue and (len(free) >= refill_at or len(free) >= len(queue) or not busy):
            new = free[:len(queue)]
            for s in new:
                request_of[s] = queue.popleft()
                responses[request_of[s]] = []
                lengths[s] = len(prompts[request_of[s]])
            chunks.append(decoder.prefill(new, [prompts[request_of[s]] for s in new]))
            rows += new
        tokens, logprobs = sample(torch.cat(chunks))
        for s, token, logprob in zip(rows, tokens.tolist(), logprobs.tolist()):
            request = request_of[s]
            responses[request].append(token)
            on_token(request, token, logprob)
            if token == eos or len(responses[request]) == max_new_tokens:
                request_of[s] = None
        if not queue:
            _compact(decoder, request_of, lengths)


def _compact(decoder: SlotDecoder, request_of: list[int | None], lengths: list[int]) -> None:
    """Move the sequences in flight into the lowest slots when they fit a smaller decode batch."""
    busy = [s for s, r in enumerate(request_of) if r is not None]
    if not busy or decoder.batch(len(busy) - 1, decoder.slots) >= decoder.batch(max(busy), decoder.slots):
        return
    target = decoder.batch(len(busy) - 1, decoder.slots)
    src = [s for s in busy if s >= target]
    dst = [s for s in range(target) if request_of[s] is None][:len(src)]
    decoder.cache.move(src, dst, decoder.width(max(lengths[s] for s in src)))
    for s, d in zip(src, dst):
        request_of[d], lengths[d] = request_of[s], lengths[s]
        request_of[s] = None
