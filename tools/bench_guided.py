"""Structured output's cost: TPOT with and without a guide, at 1 and 16 streams, through the serving
engine on the default model; and the two pieces of the mask's cost, the grammar library's mask fill
per row (scheduler side) and the sampler's unpack-and-mask per step.

Both modes generate exactly --new-tokens tokens per stream: plain requests ignore EOS, guided ones
follow a JSON schema (an array of at least 100 small records) that cannot end before. Waves
alternate plain / guided --repeat times in one engine; TPOT is each request's decode time per
token after the first (Usage.tpot_s), averaged over the wave's streams, then the best wave of each
mode. Overhead = guided / plain - 1 (the issue's bound: <= 10%); parts_overhead_pct adds up the
measured parts instead (every row's mask fill and the sampler's masking, per step, over the plain
TPOT), which a busy machine's noise moves far less.

    python tools/bench_guided.py [--streams 1,16] [--new-tokens 64] [--repeat 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import anyio  # noqa: E402
import torch  # noqa: E402

from edgeinfer.config import SchedulerConfig  # noqa: E402
from edgeinfer.core.events import Finished  # noqa: E402
from edgeinfer.core.guides import GuideCompiler  # noqa: E402
from edgeinfer.core.request import GenerateRequest  # noqa: E402
from edgeinfer.core.sampling_params import SamplingParams  # noqa: E402
from edgeinfer.engine.api import Engine, EngineConfig  # noqa: E402
from edgeinfer.models.pull import default_model_path, pull  # noqa: E402
from edgeinfer.worker.sampler import SamplingBatch, processed_logits  # noqa: E402
from tools.bench_common import int_list, table_cell  # noqa: E402

RECORD = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 999}, "name": {"type": "string", "maxLength": 12},
    "kind": {"enum": ["alpha", "beta", "gamma"]}, "score": {"type": "number", "minimum": 0, "maximum": 1}},
    "required": ["id", "name", "kind", "score"], "additionalProperties": False}
SCHEMA = json.dumps({"type": "array", "items": RECORD, "minItems": 100})
PROMPT = "List records of the inventory as JSON."


async def wave(engine: Engine, streams: int, new_tokens: int, guided: bool, tag: str) -> tuple[float, list[int]]:
    """(mean TPOT in seconds over the streams, the first stream's tokens)."""
    tpots: list[float] = []
    first: list[int] = []
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=new_tokens, ignore_eos=not guided,
                            guide=("json_schema", SCHEMA) if guided else None)

    async def one(i: int) -> None:
        request = GenerateRequest(f"{tag}-{i}", messages=({"role": "user", "content": PROMPT},), params=params)
        tokens: list[int] = []
        async for event in engine.generate(request):
            tokens.extend(getattr(event, "token_ids", ()))
            if isinstance(event, Finished):
                assert event.usage.completion_tokens == new_tokens, (event.finish_reason, event.usage)
                tpots.append(event.usage.tpot_s)
        if i == 0:
            first.extend(tokens)

    async with anyio.create_task_group() as tg:
        for i in range(streams):
            tg.start_soon(one, i)
    return statistics.mean(tpots), first


def mask_fill_us(compiler: GuideCompiler, tokens: list[int]) -> float:
    """Mean microseconds of one row's mask fill along a guided answer (cached compile excluded)."""
    guide = compiler.guide("json_schema", SCHEMA)
    times = []
    for token_id in tokens:
        start = time.perf_counter()
        guide.mask()
        times.append(time.perf_counter() - start)
        guide.advance(token_id)
    return statistics.mean(times[1:]) * 1e6  # the first fill warms the lexer


def sampler_mask_us(vocab_size: int, rows: int, mask: bytes) -> tuple[float, float]:
    """(microseconds of processed_logits for `rows` rows without, with a mask on every row)."""
    logits = torch.randn(rows, vocab_size)
    params = [SamplingParams(temperature=0.8, top_p=0.95)] * rows
    plain = SamplingBatch.from_params(params, [[]] * rows, [[]] * rows, vocab_size)
    guided = SamplingBatch.from_params(params, [[]] * rows, [[]] * rows, vocab_size, guide_masks=[mask] * rows)

    def timed(batch: SamplingBatch) -> float:
        processed_logits(logits, batch)
        start = time.perf_counter()
        for _ in range(50):
            processed_logits(logits, batch)
        return (time.perf_counter() - start) / 50 * 1e6

    return timed(plain), timed(guided)


async def main_async(args: argparse.Namespace) -> list[dict]:
    path = default_model_path()
    if not path.is_file():
        path = pull(quiet=True)
    rows = []
    config = SchedulerConfig(max_num_seqs=max(args.streams))
    async with Engine(EngineConfig(str(path), scheduler=config)) as engine:
        tok = engine.tokenizer  # the engine's own compiler is the scheduler's: this one is alike
        compiler = GuideCompiler(tok.backend.to_str, tok.vocab_size, tok.stop_token_ids)
        await wave(engine, 1, 8, True, "warm")
        for streams in args.streams:
            best = {False: float("inf"), True: float("inf")}
            tokens: list[int] = []
            for r in range(args.repeat):
                for guided in (False, True):
                    tpot, first = await wave(engine, streams, args.new_tokens, guided, f"{streams}-{r}-{guided}")
                    best[guided] = min(best[guided], tpot)
                    tokens = first if guided else tokens
            rows.append({"streams": streams, "plain_tpot_ms": best[False] * 1e3, "guided_tpot_ms": best[True] * 1e3,
                         "overhead_pct": (best[True] / best[False] - 1) * 100,
                         "mask_fill_us_per_row": mask_fill_us(compiler, tokens)})
        mask = compiler.guide("json_schema", SCHEMA).mask()
        for row in rows:
            plain_us, guided_us = sampler_mask_us(tok.vocab_size, row["streams"], mask)
            row["sampler_plain_us"], row["sampler_guided_us"] = plain_us, guided_us
            # What the guide adds to a step from its measured parts, steadier than a TPOT difference on a
            # busy machine: every row's mask fill plus the sampler's masking, against the plain step.
            added_ms = (row["streams"] * row["mask_fill_us_per_row"] + guided_us - plain_us) / 1e3
            row["parts_overhead_pct"] = added_ms / row["plain_tpot_ms"] * 100
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int_list, default=[1, 16])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = anyio.run(main_async, args)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    columns = list(rows[0])
    print(" | ".join(columns))
    for row in rows:
        print(" | ".join(table_cell(row[c]) for c in columns))


if __name__ == "__main__":
    main()
