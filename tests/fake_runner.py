"""Test doubles for the scheduler and the model actor: a fake model runner whose next token hashes
the whole context read back through the block table (a wrong block table, position, copy or
prefix hit changes the output, so "same tokens as alone" checks the paging too), a fake KV pool,
a letter detokenizer, and helpers that drive a Scheduler with a ModelActor step by step (over the
fake runner, or a real ModelRunner: `run_requests`, `greedy_alone`)."""

from __future__ import annotations

import torch

from edgeinfer.config import SchedulerConfig
from edgeinfer.core.events import Finished, Token
from edgeinfer.core.messages import StepPlan
from edgeinfer.core.sampling_params import SamplingParams
from edgeinfer.core.scheduler import Scheduler
from edgeinfer.engine.model_actor import ModelActor
from edgeinfer.worker.batch import SeqChunk

VOCAB = 32
EOS = 0


def next_token(context: list[int]) -> int:
    """The fake model: a deterministic function of the whole context, never EOS."""
    return 1 + (sum((i + 1) * t for i, t in enumerate(context)) * 7 + len(context)) % (VOCAB - 1)


def expected_tokens(prompt: list[int], num_tokens: int) -> list[int]:
    context = list(prompt)
    for _ in range(num_tokens):
        context.append(next_token(context))
    return context[len(prompt):]


class FakePool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.slots: dict[int, int] = {}  # slot -> token id stored there

    def bytes_per_token(self) -> int:
        return 10

    def copy_blocks(self, src_dst: list[tuple[int, int]]) -> None:
        bs = self.block_size
        for src, dst in src_dst:
            for offset in range(bs):
                if src * bs + offset in self.slots:
                    self.slots[dst * bs + offset] = self.slots[src * bs + offset]


class FakeRunner:
    """Stands in for ModelRunner: `logits(chunks)` -> one (VOCAB,) row per chunk."""

    def __init__(self, num_blocks: int = 8, block_size: int = 4, on_step=None,  # noqa: ANN001
                 logits_fn=None) -> None:  # noqa: ANN001
        self.pool = FakePool(num_blocks, block_size)
        self.on_step = on_step  # called with the chunks before each step (tests hook in here)
        self.logits_fn = logits_fn or fake_logits  # context -> (VOCAB,) next-token logits
        self.steps: list[list[SeqChunk]] = []
        self.activation_bytes_per_token = 0
        self.free_bytes: int | None = None  # what free_step_bytes reports (None: a CPU)

    def free_step_bytes(self) -> int | None:
        return self.free_bytes

    def logits(self, chunks: list[SeqChunk]) -> torch.Tensor:
        if self.on_step is not None:
            self.on_step(chunks)
        self.steps.append(chunks)
        bs, slots = self.pool.block_size, self.pool.slots
        rows = []
        for chunk in chunks:
            slot = lambda pos: chunk.block_table[pos // bs] * bs + pos % bs  # noqa: B023
            for k, token_id in enumerate(chunk.token_ids):
                slots[slot(chunk.start_pos + k)] = token_id
            end = chunk.start_pos + len(chunk.token_ids)
            for last in range(end - chunk.num_logits, end):  # one row per wanted position
                rows.append(self.logits_fn([slots[slot(pos)] for pos in range(last + 1)]))
        return torch.stack(rows)


def fake_logits(context: list[int]) -> torch.Tensor:
    row = torch.zeros(VOCAB)
    row[next_token(context)] = 10.0
    return row


class Letters:
    """Fake detokenizer: token t is the letter chr(ord('a') + t % 26)."""

    def push(self, token_id: int) -> str:
        return chr(ord("a") + token_id % 26)


GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


def make(num_blocks: int = 8, block_size: int = 4, logits_fn=None,  # noqa: ANN001
         **config) -> tuple[Scheduler, ModelActor]:  # noqa: ANN003
    runner = FakeRunner(num_blocks, block_size, logits_fn=logits_fn)
    cfg = SchedulerConfig(**{"max_num_seqs": 4, "max_num_batched_tokens": 16, "kv_watermark": 0.0, **config})
    sched = Scheduler(cfg, num_blocks=num_blocks, block_size=block_size, max_model_len=64, vocab_size=VOCAB,
                      eos_token_ids=(EOS,), bytes_per_token=10, make_detokenizer=Letters)
    return sched, ModelActor(runner, VOCAB, (EOS,))


def step(sched: Scheduler, model: ModelActor) -> tuple[StepPlan, list]:
    plan = sched.schedule()
    events = sched.postprocess(plan, model.execute(plan))
    sched.block_manager.check_invariants()
    return plan, events


def run_all(sched: Scheduler, model: ModelActor) -> dict[str, list]:
    events: dict[str, list] = {}
    for _ in range(500):
        if not sched.has_work:
            return events
        for event in step(sched, model)[1]:
            events.setdefault(event.request_id, []).append(event)
    raise AssertionError("the scheduler did not finish in 500 steps")


def tokens_of(events: list) -> list[int]:
    return [t for e in events if isinstance(e, Token) for t in e.token_ids]


def run_requests(runner, prompts: list[list[int]], params: list[SamplingParams], draft=None,  # noqa: ANN001
                 **config) -> dict[str, list[int]]:  # noqa: ANN003
    """Every request (ids "0", "1", ...) submitted at once and run to the end through a Scheduler
    and a ModelActor over ``runner`` (and ``draft``, a draft model's runner, for speculative
    "draft"); each finished request's tokens. Checks the block manager after every step."""
    cfg = SchedulerConfig(**{"max_num_seqs": 8, "max_num_batched_tokens": 32, "kv_watermark": 0.0,
                             "speculative": "off" if draft is None else "draft", "speculate_max_seqs": 8, **config})
    vocab = runner.model.config.vocab_size
    sched = Scheduler(cfg, num_blocks=runner.pool.num_blocks, block_size=runner.block_size,
                      max_model_len=runner.model.config.max_position, vocab_size=vocab, eos_token_ids=(),
                      bytes_per_token=1, make_detokenizer=Letters)
    actor = ModelActor(runner, vocab, (), draft=draft)
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        sched.add_request(str(i), prompt, p)
    events: dict[str, list] = {}
    for _ in range(5000):
        if not sched.has_work:
            assert sched.block_manager.num_used == 0
            return {rid: tokens_of(evs) for rid, evs in events.items() if isinstance(evs[-1], Finished)}
        for event in step(sched, actor)[1]:
            events.setdefault(event.request_id, []).append(event)
    raise AssertionError("the scheduler did not finish in 5000 steps")


def greedy_alone(runner, prompt_ids: list[int], max_tokens: int) -> list[int]:  # noqa: ANN001
    """One request's greedy tokens (EOS ignored) through the scheduler and the model actor."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return run_requests(runner, [prompt_ids], [params])["0"]
