"""Admission: which requests the scheduler takes (add_request refuses what can never run, with the
field named) and when a waiting sequence may start (the blocks of its whole lifetime, plus the
watermark, are free, or nothing runs)."""

from __future__ import annotations

from collections.abc import Sequence

from edgeinfer.core.beam_search import BeamSearchParams, BeamState
from edgeinfer.core.events import INVALID_PARAMS, OVERLOADED, PROMPT_TOO_LONG, Accepted, RequestError
from edgeinfer.core.guides import Guide, GuideError
from edgeinfer.core.sampling_params import InvalidParams, SamplingParams
from edgeinfer.core.sequence import BeamGroup, SeqState
from edgeinfer.core.stop import StopChecker


class AdmissionMixin:
    """Methods of edgeinfer.core.scheduler.Scheduler, kept apart by job: they read and write its state."""

    def add_request(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams) -> Accepted:
        """Queue a request, or raise RequestError (invalid_params, prompt_too_long, overloaded)."""
        if request_id in self._by_request:
            raise RequestError(INVALID_PARAMS, f"request id {request_id!r} is already in use")
        if not prompt_ids:
            raise RequestError(INVALID_PARAMS, "the prompt is empty")
        width = max(params.n, params.beam_width)
        if width > self.config.max_num_seqs:
            raise RequestError(INVALID_PARAMS, f"n / beam_width is {width}; at most max_num_seqs = "
                                               f"{self.config.max_num_seqs} sequences run at once")
        try:
            params.check_vocab(self.vocab_size)
        except InvalidParams as exc:
            raise RequestError(INVALID_PARAMS, str(exc)) from None
        if params.max_tokens > self.max_model_len:
            raise RequestError(INVALID_PARAMS, f"max_tokens must be at most the model's context of "
                                               f"{self.max_model_len} tokens, got {params.max_tokens}")
        if not all(0 <= t < self.vocab_size for t in prompt_ids):
            raise RequestError(INVALID_PARAMS, f"prompt token ids must be in [0, {self.vocab_size})")
        if len(prompt_ids) >= self.max_seq_len:
            raise RequestError(PROMPT_TOO_LONG, (
                f"the prompt has {len(prompt_ids)} tokens; at most {self.max_seq_len - 1} fit "
                f"(context and KV pool of {self.block_manager.num_blocks * self.block_size} tokens)"))
        if len(self.waiting) >= self.config.max_waiting:
            raise RequestError(OVERLOADED, f"{len(self.waiting)} requests are already waiting",
                               self.config.retry_after_s)
        max_len = min(len(prompt_ids) + params.max_tokens, self.max_seq_len)
        if self._lifetime_blocks(len(prompt_ids), max_len, width) > self.block_manager.num_blocks:
            raise RequestError(INVALID_PARAMS, (
                f"{width} sequences of {max_len} tokens (n / beam_width) do not fit the KV pool of "
                f"{self.block_manager.num_blocks * self.block_size} tokens; lower n, beam_width or max_tokens"))
        guide = self._compile_guide(params)
        seq = SeqState(self._next_seq_id, request_id, tuple(prompt_ids), params, max_len, self._clock(),
                       self._make_detokenizer(), StopChecker(params, self.eos_token_ids),
                       to_fork=0 if params.beam_width else params.n - 1,
                       prompt_logprobs=None if params.prompt_logprobs is None else [], guide=guide)
        if params.beam_width:
            eos = () if params.ignore_eos else self.eos_token_ids
            search = BeamSearchParams(params.beam_width, max_len - len(prompt_ids), params.n, params.length_penalty,
                                      params.early_stopping, tuple(dict.fromkeys((*eos, *params.stop_token_ids))))
            seq.beam = BeamGroup(request_id, len(prompt_ids), seq.arrival_s, BeamState(search), [seq])
        self._next_seq_id += 1
        position = len(self.waiting)
        self.waiting.append(seq)
        self._by_request[request_id] = [seq]
        self._by_seq[seq.seq_id] = seq
        return Accepted(request_id, position, len(prompt_ids))

    def _compile_guide(self, params: SamplingParams) -> Guide | None:
        """The request's grammar state, or RequestError (invalid_params) naming what is wrong."""
        if params.guide is None:
            return None
        if self.guides is None:
            raise RequestError(INVALID_PARAMS, "this engine has no grammar support for its tokenizer: "
                                               "guide (structured output) is not available")
        try:
            return self.guides.guide(*params.guide)
        except GuideError as exc:
            raise RequestError(INVALID_PARAMS, str(exc)) from None

    def _lifetime_blocks(self, prompt_len: int, max_len: int, n: int) -> int:
        """Blocks a request may hold at once: its first choice's lifetime, plus each other
        choice's output and one copy-on-write block."""
        own = -(-max_len // self.block_size)
        return own + (n - 1) * (-(-(max_len - prompt_len) // self.block_size) + 1)

    def _can_admit(self, seq: SeqState) -> bool:
        width = seq.to_fork + 1
        if seq.beam is not None:
            if seq.beam.state.step:
                return True  # a beam back from preemption: its group waits on it, blocks permitting
            width = seq.params.beam_width
        if width > 1 and len(self.running) + width > self.config.max_num_seqs:
            return False  # its choices / beams join the running batch at the first sample
        if not self.running:
            return True  # it fits the pool alone (checked at add_request)
        lifetime = self._lifetime_blocks(len(seq.prompt_ids), seq.max_len, width)
        return lifetime + self._watermark <= self.block_manager.num_available
