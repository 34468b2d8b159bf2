"""Batched token sampling over (B, V) logits in one vectorised pass.

The model actor owns the sampler. Each step it builds a `SamplingBatch` (per-row parameters as
tensors) from plain data in the StepPlan, then calls `sample(logits, batch)`. Nothing here keeps
state between steps, and nothing loops over rows on the tensors' path.

Order of operations, per row:
  1. repetition penalty (HF) over tokens seen in prompt or output: x/r if x > 0 else x*r;
  2. presence and frequency penalties (OpenAI) over output token counts: x - c*f - (c > 0)*p;
  3. logit_bias added;
  4. min_tokens: EOS and stop_token_ids set to -inf while the output is shorter than min_tokens;
     a guided row's tokens outside its grammar mask (SeqStep.guide_masks) set to -inf;
     logprobs are reported from log_softmax of these logits: after penalties and bias (they
     are what the request asked the model to be), before temperature and truncation (so
     alternatives outside top-k/top-p keep a finite logprob, as OpenAI reports them);
  5. temperature (greedy rows, SamplingParams.is_greedy, take the argmax of step 4 instead);
  6. top-k; 7. top-p over the top-k renormalised distribution; 8. min-p relative to the
     largest probability (which every truncation keeps);
  9. one uniform u per row picks the token by inverse CDF: the first token whose cumulative
     probability exceeds u times the total.

Where the C++ CPU ops build, CPU logits take steps 5-9 (and greedy rows' argmax) in one op,
kernels.cpu_ops.sample_rows, whose reference is the torch path here (CUDA, and CPUs without the
ops, run it): with from_params, a one-row step 8-9x as fast with top-p and 11-13x with top-k
(tools/bench_sampler.py --compare).
Steps 1-4 stay in torch; penalties touch only the tokens a row has seen.

Seeds: a seeded row's u is a pure function of (seed, choice index, step) where step is the
number of tokens already generated, so the same seed gives the same tokens whatever the batch
neighbours are, and again after a preemption recomputes the sequence. Unseeded rows draw u from
a torch generator.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from edgeinfer.core.sampling_params import SamplingParams
from kernels import cpu_ops

_MASK64 = (1 << 64) - 1
_MIN_CANDIDATES = 512  # partial-sort width for top-k/top-p; see _top_k_top_p_keep


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded_uniform(seed: int, *counters: int) -> float:
    """A uniform in (0, 1) that depends only on seed and counters (e.g. choice, step, stream)."""
    h = _splitmix64(seed & _MASK64)
    for counter in counters:
        h = _splitmix64(h ^ (counter & _MASK64))
    return ((h >> 11) + 0.5) / 2**53  # 53 bits: every float64 step, never 0 or 1


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling parameters for one step, as tensors on the logits' device."""

    temperature: torch.Tensor  # (B,) float32; 1 on greedy rows, so division is harmless
    greedy: torch.Tensor  # (B,) bool
    top_k: torch.Tensor  # (B,) int64; V where off
    top_p: torch.Tensor  # (B,) float32
    log_min_p: torch.Tensor  # (B,) float32; -inf where off
    uniforms: torch.Tensor  # (B,) float64 in (0, 1)
    # Penalties: None when no row uses them, so the common case costs nothing.
    repetition_penalty: torch.Tensor | None  # (B,) float32
    presence_penalty: torch.Tensor | None  # (B,) float32
    frequency_penalty: torch.Tensor | None  # (B,) float32
    # The (row, token) pairs penalties touch: every token a row has seen (its output's, and its
    # prompt's where it sent one: SeqStep.prompt_ids, for repetition_penalty), with its count in
    # the output (0: the prompt's alone). Sparse: dense (B, V) counts made a 16-row step with
    # repetition_penalty 3-4x as slow (tools/bench_sampler.py).
    penalty_rows: torch.Tensor | None  # (P,) int64
    penalty_ids: torch.Tensor | None  # (P,) int64
    penalty_counts: torch.Tensor | None  # (P,) float32
    # Sparse (row, token) lists: logit_bias entries, and tokens forbidden by min_tokens.
    bias_rows: torch.Tensor  # (N,) int64
    bias_ids: torch.Tensor  # (N,) int64
    bias_values: torch.Tensor  # (N,) float32
    suppress_rows: torch.Tensor  # (M,) int64
    suppress_ids: torch.Tensor  # (M,) int64
    needs_sort: bool  # some row has top-k or top-p on
    max_top_k: int  # the largest top-k that is on (< V) in any row; 0 if none
    all_greedy: bool  # every row takes the argmax: nothing to truncate or draw
    num_logprobs: tuple[int | None, ...]  # per row, as SamplingParams.logprobs
    # Structured output: the guided rows and their token bitmasks (edgeinfer.core.guides), None if none.
    guide_rows: torch.Tensor | None = None  # (G,) int64
    guide_words: torch.Tensor | None = None  # (G, ceil(V' / 32)) int32, V' the grammar's vocabulary

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        vocab_size: int,
        eos_token_ids: Sequence[int] = (),
        choice_indices: Sequence[int] | None = None,
        device: torch.device | str = "cpu",
        generator: torch.Generator | None = None,
        guide_masks: Sequence[bytes] | None = None,
        num_outputs: Sequence[int] | None = None,
    ) -> SamplingBatch:
        """Build a batch. Row i samples the next token of a sequence with prompt_ids[i] and
        output_ids[i] generated so far; choice_indices[i] separates the n choices of one seeded
        request (default 0); generator (a CPU torch.Generator) feeds unseeded rows;
        guide_masks[i] is row i's packed token bitmask (SeqStep.guide_masks; b"": unconstrained).
        num_outputs[i]: how many tokens row i has generated (seeded draws and min_tokens read it;
        default len(output_ids[i])), so that a row no penalty reads may send no tokens at all
        (SeqStep.output_ids)."""
        num_rows = len(params)
        assert len(prompt_ids) == len(output_ids) == num_rows
        lengths = num_outputs if num_outputs is not None else [len(ids) for ids in output_ids]
        assert len(lengths) == num_rows
        choices = choice_indices if choice_indices is not None else [0] * num_rows
        uniforms = torch.rand(num_rows, dtype=torch.float64, generator=generator)
        seeded = [(i, seeded_uniform(p.seed, choices[i], lengths[i]))
                  for i, p in enumerate(params) if p.seed is not None]
        if seeded:
            rows, values = zip(*seeded, strict=True)
            uniforms[list(rows)] = torch.tensor(values, dtype=torch.float64)

        penalised = any(p.penalised for p in params)
        penalty_rows = penalty_ids = penalty_counts = None
        if penalised:
            penalty_rows, penalty_ids, penalty_counts = _seen_tokens(prompt_ids, output_ids, vocab_size)

        bias = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias]
        suppress = [(i, t) for i, p in enumerate(params) if lengths[i] < p.min_tokens
                    for t in (*eos_token_ids, *p.stop_token_ids)]
        bias_rows, bias_ids, bias_values = zip(*bias, strict=True) if bias else ((), (), ())
        suppress_rows, suppress_ids = zip(*suppress, strict=True) if suppress else ((), ())

        # One host tensor per dtype, cut into views: a decode step's batch costs a few tensor
        # constructions, not one per field.
        n, b, m = num_rows, len(bias), len(suppress)
        penalties = [v for p in params for v in (p.repetition_penalty, p.presence_penalty, p.frequency_penalty)] \
            if penalised else []
        floats = torch.tensor([*(1.0 if p.is_greedy else p.temperature for p in params), *(p.top_p for p in params),
                               *(math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params), *bias_values,
                               *penalties], dtype=torch.float32)
        longs = torch.tensor([*(p.top_k if p.top_k > 0 else vocab_size for p in params), *bias_rows, *bias_ids,
                              *suppress_rows, *suppress_ids], dtype=torch.int64)
        by_row = floats[3 * n + b:].view(n, 3) if penalised else None

        batch = cls(
            temperature=floats[:n],
            greedy=torch.tensor([p.is_greedy for p in params], dtype=torch.bool),
            top_k=longs[:n],
            top_p=floats[n:2 * n],
            log_min_p=floats[2 * n:3 * n],
            uniforms=uniforms,
            repetition_penalty=by_row[:, 0] if by_row is not None else None,
            presence_penalty=by_row[:, 1] if by_row is not None else None,
            frequency_penalty=by_row[:, 2] if by_row is not None else None,
            penalty_rows=penalty_rows,
            penalty_ids=penalty_ids,
            penalty_counts=penalty_counts,
            bias_rows=longs[n:n + b],
            bias_ids=longs[n + b:n + 2 * b],
            bias_values=floats[3 * n:3 * n + b],
            suppress_rows=longs[n + 2 * b:n + 2 * b + m],
            suppress_ids=longs[n + 2 * b + m:],
            needs_sort=any(0 < p.top_k < vocab_size or p.top_p < 1 for p in params),
            max_top_k=max((p.top_k for p in params if 0 < p.top_k < vocab_size), default=0),
            all_greedy=all(p.is_greedy for p in params),
            num_logprobs=tuple(p.logprobs for p in params),
            **_guide_fields(guide_masks),
        )
        return batch if torch.device(device).type == "cpu" else batch.to(device)  # built on the CPU

    def to(self, device: torch.device | str) -> SamplingBatch:
        moved = {name: value.to(device) if isinstance(value, torch.Tensor) else value
                 for name, value in self.__dict__.items()}
        return SamplingBatch(**moved)


@dataclass(frozen=True)
class SampleOutput:
    """What one step sampled. Rows that asked for fewer alternatives read the first ones."""

    token_ids: torch.Tensor  # (B,) int64
    logprobs: torch.Tensor | None  # (B,) float32, the chosen tokens'; None if no row asked
    top_ids: torch.Tensor | None  # (B, N) int64, N = the most alternatives any row asked for
    top_logprobs: torch.Tensor | None  # (B, N) float32, descending


def _guide_fields(guide_masks: Sequence[bytes] | None) -> dict[str, torch.Tensor]:
    """guide_rows and guide_words for the rows with a mask (all masks of one step have one width)."""
    rows = [i for i, mask in enumerate(guide_masks or ()) if mask]
    if not rows:
        return {}
    words = torch.frombuffer(bytearray(b"".join(guide_masks[i] for i in rows)), dtype=torch.int32)
    return {"guide_rows": torch.tensor(rows, dtype=torch.int64), "guide_words": words.view(len(rows), -1)}


def refused_tokens(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(G, vocab_size) bool, True where the (G, W) int32 bitmask words refuse a token: bit t % 32
    of word t // 32 (little-endian: bit t % 8 of byte t // 8) allows token t; tokens past 32 * W
    are refused. One table lookup per mask byte: a shift per bit costs several times more."""
    num_rows = words.shape[0]
    table = ((torch.arange(256, device=words.device)[:, None] >> torch.arange(8, device=words.device)) & 1) == 0
    refused = table.index_select(0, words.view(torch.uint8).reshape(-1).long()).view(num_rows, -1)  # (G, 32 W)
    if refused.shape[-1] >= vocab_size:
        return refused[:, :vocab_size]
    return torch.nn.functional.pad(refused, (0, vocab_size - refused.shape[-1]), value=True)


def _seen_tokens(prompt_ids: Sequence[Sequence[int]], output_ids: Sequence[Sequence[int]],
                 vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SamplingBatch's penalty pairs: each row's distinct tokens of prompt and output, in (row,
    token) order, and how often the output holds each."""
    def keys(lists: Sequence[Sequence[int]]) -> torch.Tensor:  # row * V + token, flat
        lengths = torch.tensor([len(t) for t in lists], dtype=torch.int64)
        rows = torch.repeat_interleave(torch.arange(len(lists)), lengths)
        return rows * vocab_size + torch.tensor(list(itertools.chain.from_iterable(lists)), dtype=torch.int64)

    prompt_keys, output_keys = keys(prompt_ids), keys(output_ids)
    seen, where = torch.unique(torch.cat([prompt_keys, output_keys]), return_inverse=True)
    counts = torch.zeros(len(seen)).index_add_(0, where[len(prompt_keys):], torch.ones(len(output_keys)))
    return seen // vocab_size, seen % vocab_size, counts


def processed_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Steps 1-4: penalties, logit_bias, min_tokens and grammar masking. Returns (B, V) float32: a new
    tensor, or the input itself when no step applies (callers never write into it)."""
    has_bias, has_suppress = batch.bias_rows.numel() > 0, batch.suppress_rows.numel() > 0
    guided = batch.guide_words is not None
    # A plain greedy row skips the copy and the empty index ops: ~70 us of a 7 ms decode step.
    penalised = batch.penalty_rows is not None
    logits = logits.to(torch.float32, copy=penalised or has_bias or has_suppress or guided)
    if penalised:
        rows, ids, counts = batch.penalty_rows, batch.penalty_ids, batch.penalty_counts
        seen = logits[rows, ids]
        penalty = batch.repetition_penalty[rows]
        seen = torch.where(seen > 0, seen / penalty, seen * penalty)
        seen -= counts * batch.frequency_penalty[rows]
        seen -= (counts > 0) * batch.presence_penalty[rows]
        logits[rows, ids] = seen
    if has_bias:
        logits.index_put_((batch.bias_rows, batch.bias_ids), batch.bias_values, accumulate=True)
    if has_suppress:
        logits[batch.suppress_rows, batch.suppress_ids] = -math.inf
    if guided:
        refused = refused_tokens(batch.guide_words, logits.shape[-1])
        if batch.guide_rows.numel() == logits.shape[0]:  # every row (rows are ascending): in place
            logits.masked_fill_(refused, -math.inf)
        else:
            logits[batch.guide_rows] = logits[batch.guide_rows].masked_fill(refused, -math.inf)
    return logits


def _truncated_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Steps 5-8 on processed logits: temperature-scaled, truncated tokens at -inf. (B, V)."""
    scaled = logits / batch.temperature[:, None]
    keep = scaled >= scaled.amax(dim=-1, keepdim=True) + batch.log_min_p[:, None]
    if batch.needs_sort:
        keep &= _top_k_top_p_keep(scaled, batch)
    return scaled.masked_fill(~keep, -math.inf)


def _top_k_top_p_keep(scaled: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """(B, V) bool: the tokens top-k, then top-p over the top-k renormalised distribution, keep.

    A full sort of (B, V) costs ~8x a partial one (topk of 512 of 49152 on the CPU), and
    nuclei are usually far smaller than V, so this works on the best `num_candidates` tokens and
    redoes the work over all V only when some row's nucleus does not fit in them. Exact either
    way: a row's top-k set lies inside the candidates (num_candidates >= every top_k that is on)
    and its nucleus does whenever the candidates hold at least top_p of its mass."""
    vocab_size = scaled.shape[-1]
    top_k, top_p = batch.top_k[:, None], batch.top_p[:, None]
    num_candidates = min(vocab_size, max(_MIN_CANDIDATES, batch.max_top_k))
    while True:
        cand_logits, cand_ids = scaled.topk(num_candidates, dim=-1)  # (B, C), descending
        rank = torch.arange(num_candidates, device=scaled.device)
        keep = rank[None, :] < top_k
        # Normalise by the top-k mass where top-k is on, else by the whole row's.
        log_total = torch.where(top_k < vocab_size,
                                cand_logits.masked_fill(~keep, -math.inf).logsumexp(-1, keepdim=True),
                                scaled.logsumexp(-1, keepdim=True))
        probs = torch.exp(cand_logits - log_total).masked_fill(~keep, 0.0)
        # Keep the shortest prefix whose mass reaches top_p: tokens with less than top_p before
        # them. top_p == 1 keeps everything, which rounding in the cumsum would not guarantee.
        keep &= (probs.cumsum(dim=-1) - probs < top_p) | (top_p >= 1)
        fits = (probs.sum(-1, keepdim=True) >= top_p) | (top_k < vocab_size) | (top_p >= 1)
        if num_candidates == vocab_size or bool(fits.all()):
            break
        num_candidates = vocab_size
    untruncated = (top_k >= vocab_size) & (top_p >= 1)  # rows beside others that truncate
    mask = torch.zeros_like(scaled, dtype=torch.bool).scatter_(-1, cand_ids, keep)
    return mask | untruncated


def takes_argmax(params: SamplingParams, num_output_tokens: int, guided: bool) -> bool:
    """Whether `sample` gives this row its logits' argmax untouched: a greedy row that steps 1-4
    leave alone (no penalty, logit_bias, pending min_tokens or grammar mask) and that asks for no
    logprobs. A step of such rows needs `greedy_ids` alone, not a SamplingBatch: after a CPU
    forward has streamed the weights through the caches, its ~15 tensor operations cost ~0.2 ms
    of a ~5 ms one-row step (ModelActor)."""
    return (params.is_greedy and params.logprobs is None and not guided and not params.logit_bias
            and not params.penalised and num_output_tokens >= params.min_tokens)


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """(B,) the index of each row's largest value, the first of ties (as argmax). Over a 49152-token
    row torch's max took ~0.1 ms for its indices, the C++ top-1 ~0.03 (tools/bench_sampler.py)."""
    if _cpu_kernels(logits):
        return cpu_ops.row_topk(logits.reshape(-1, logits.shape[-1]), 1)[1].view(logits.shape[:-1])
    return logits.max(dim=-1).indices


def top_values(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices), each (B, k): the k largest of each row of x (B, V), largest first (torch.topk)."""
    return cpu_ops.row_topk(x, k) if _cpu_kernels(x) else x.topk(k, dim=-1)


def _cpu_kernels(logits: torch.Tensor) -> bool:
    """Whether the C++ ops choose the tokens (kernels/cpu/sampling.cpp): fp32 logits on the CPU,
    where the ops build. The torch path (their reference) runs elsewhere: CUDA, or without them."""
    return logits.device.type == "cpu" and logits.dtype == torch.float32 and cpu_ops.available()


def sampling_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The (B, V) distribution `sample` draws from: one-hot argmax on greedy rows.
    Speculative verification uses it as the target distribution."""
    processed = processed_logits(logits, batch)
    probs = torch.softmax(_truncated_logits(processed, batch), dim=-1)
    greedy = torch.nn.functional.one_hot(greedy_ids(processed), probs.shape[-1]).to(probs.dtype)
    return torch.where(batch.greedy[:, None], greedy, probs)


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: (B, V) non-negative weights, (B,) uniforms -> (B,) int64 token ids.
    Zero-weight tokens are never chosen: the CDF is flat over them."""
    cdf = probs.to(torch.float64).cumsum(dim=-1)  # float64: V-long sums stay exact enough
    target = uniforms.to(cdf.device, torch.float64)[:, None] * cdf[:, -1:]
    token_ids = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return token_ids.clamp_(max=probs.shape[-1] - 1)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SampleOutput:
    """Sample one token per row of (B, V) logits; see the module docstring for the order."""
    processed = processed_logits(logits, batch)
    if batch.all_greedy:
        token_ids = greedy_ids(processed)
    elif _cpu_kernels(processed):
        token_ids = cpu_ops.sample_rows(processed, batch.temperature, batch.greedy, batch.top_k, batch.top_p,
                                        batch.log_min_p, batch.uniforms)
    else:
        probs = torch.softmax(_truncated_logits(processed, batch), dim=-1)
        token_ids = torch.where(batch.greedy, greedy_ids(processed), sample_from_probs(probs, batch.uniforms))
    asked = [k for k in batch.num_logprobs if k is not None]
    if not asked:
        return SampleOutput(token_ids, None, None, None)
    # log_softmax's values without its (B, V) tensor: a logit less its row's logsumexp.
    lse = torch.logsumexp(processed, dim=-1, keepdim=True)
    chosen = (processed.gather(-1, token_ids[:, None]) - lse).squeeze(-1)
    top, top_ids = top_values(processed, max(asked))
    return SampleOutput(token_ids, chosen, top_ids, top - lse)
