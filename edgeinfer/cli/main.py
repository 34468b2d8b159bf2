"""The `edgeinfer` command: generate, chat, bench, serve, daemon, quantize, eval-ppl, and the model
store's pull, list, show and rm (cli/models.py).

Each subcommand parses its flags here and calls into the package; nothing else reads argv.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import resource
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from edgeinfer.cli.models import add_model_commands
from edgeinfer.cli.options import (
    HelpFormatter,
    add_log_level,
    add_runtime_args,
    model_path,
    runtime_config,
    setup_logging,
    version,
)
from edgeinfer.config import RuntimeConfig
from edgeinfer.core.sampling_params import GENERATION_DEFAULTS
from edgeinfer.models.host_memory import return_large_frees_to_the_os
from quant.corpus import EVAL_TEXT

if TYPE_CHECKING:
    from edgeinfer.core.events import Finished
    from edgeinfer.core.sampling_params import SamplingParams


def cmd_generate(args: argparse.Namespace) -> int:
    """One completion, streamed to stdout, through the engine `serve` runs (plain sampling, stop
    strings, speculative decoding by prompt lookup or a draft model, beam search)."""
    from edgeinfer.cli.event_loop import run_async
    from edgeinfer.config import SchedulerConfig
    from edgeinfer.core.events import Error, Finished, Token
    from edgeinfer.core.request import GenerateRequest
    from edgeinfer.engine.api import Engine, EngineConfig

    given = _given_sampling_flags(args)
    params = _generate_params(args)
    # Its prompt is at most a token per UTF-8 byte, plus up to 256 of the chat template's.
    tokens = len(args.prompt.encode()) + (0 if args.no_chat else 256) + args.max_tokens + 1
    runtime = _one_request_runtime(args, tokens, max(1, args.beam_width))
    if args.speculative and args.draft_model:
        raise ValueError("--speculative ngram and --draft-model are two drafters: choose one")
    scheduler = SchedulerConfig(speculative="draft" if args.draft_model else args.speculative or "off",
                                burst_window_s=0.0)
    draft = str(model_path(args.draft_model)) if args.draft_model else None
    if args.no_chat:
        request = GenerateRequest("generate", prompt=args.prompt, params=params, params_given=given)
    else:
        request = GenerateRequest("generate", messages=({"role": "user", "content": args.prompt},), params=params,
                                  params_given=given)

    async def run() -> None:
        config = EngineConfig(str(model_path(args.model)), runtime, scheduler, draft_model_path=draft)
        async with Engine(config) as engine:
            async for event in engine.generate(request):
                if isinstance(event, Error):
                    raise ValueError(f"{event.code}: {event.message}")
                if isinstance(event, Token) and not args.beam_width:
                    sys.stdout.write(event.text)
                    sys.stdout.flush()
                elif isinstance(event, Finished):
                    _print_finished(event, args.beam_width)

    run_async(run)
    return 0


def _one_request_runtime(args: argparse.Namespace, tokens: int, sequences: int = 1) -> RuntimeConfig:
    """The runtime flags, with a KV pool for one request of ``tokens`` tokens per sequence."""
    runtime = runtime_config(args)
    return dataclasses.replace(runtime, num_kv_blocks=(-(-tokens // runtime.block_size) + 1) * sequences)


# generate's sampling flags and what each is when not given: the engine replaces these with the
# model's own defaults (generation_config.json, GGUF general.sampling.*, the default model's card), else
# core.sampling_params.GENERATION_DEFAULTS (as for every front end).
_SAMPLING_FLAG_DEFAULTS = {"temperature": GENERATION_DEFAULTS.temperature, "top_p": GENERATION_DEFAULTS.top_p,
                           "top_k": 0, "max_tokens": GENERATION_DEFAULTS.max_tokens}


def _given_sampling_flags(args: argparse.Namespace) -> frozenset[str]:
    """The sampling flags the user typed; the others are set to their defaults."""
    given = frozenset(k for k in _SAMPLING_FLAG_DEFAULTS if getattr(args, k) is not None)
    for name, default in _SAMPLING_FLAG_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    args.temperature_given = "temperature" in given
    return given


_TEMPERATURE_HELP = (f"0: greedy (the likeliest token each step); higher: more varied answers; default: the "
                     f"model's own (generation_config.json, GGUF general.sampling.temp), else "
                     f"{GENERATION_DEFAULTS.temperature}")


def _generate_params(args: argparse.Namespace) -> SamplingParams:
    """generate's sampling parameters; a refused value is named as typed (--num-results, not n)."""
    from edgeinfer.core.sampling_params import InvalidParams

    try:
        return _sampling_params(args)
    except InvalidParams as exc:
        raise ValueError(_GENERATE_FIELDS.sub(lambda m: _GENERATE_FLAGS[m.group(0)], str(exc))) from None


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    from edgeinfer.core.sampling_params import SamplingParams

    if not args.beam_width:
        if args.num_results != 1:
            raise ValueError("--num-results chooses among beam search's results: give --beam-width too")
        return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, seed=args.seed, stop=tuple(args.stop or ()))
    sampled = args.temperature_given and args.temperature != 0
    conflicts = [flag for flag, on in (("--temperature", sampled), ("--stop", bool(args.stop)),
                                       ("--speculative", bool(args.speculative)),
                                       ("--draft-model", bool(args.draft_model))) if on]
    if conflicts:
        raise ValueError(f"beam search is deterministic and runs alone: drop {', '.join(conflicts)}")
    early = {"true": True, "false": False, "never": "never"}[args.early_stopping]
    return SamplingParams(max_tokens=args.max_tokens, temperature=0.0, beam_width=args.beam_width,
                          n=args.num_results, length_penalty=args.length_penalty, early_stopping=early)


_GENERATE_FLAGS = {"n": "--num-results", "beam_width": "--beam-width", "top_p": "--top-p", "top_k": "--top-k",
                   "max_tokens": "--max-tokens", "length_penalty": "--length-penalty", "temperature": "--temperature",
                   "seed": "--seed", "stop": "--stop"}
_GENERATE_FIELDS = re.compile(r"\b(" + "|".join(sorted(_GENERATE_FLAGS, key=len, reverse=True)) + r")\b(?!-)")


def _print_finished(event: Finished, beam_width: int) -> None:
    if not beam_width:
        sys.stdout.write("\n")
        return
    for rank, choice in enumerate(event.choices, 1):  # best first
        if len(event.choices) > 1:
            print(f"--- {rank} score {choice['score']:.4f} logprob {choice['logprob']:.4f} ({choice['finish_reason']})")
        print(choice["text"])


def cmd_bench(args: argparse.Namespace) -> int:
    """Prefill and greedy decode speed of one stream through the engine `serve` runs, with its
    default scheduler: prefill from a fresh prompt's time to its first token, decode from a
    second request on the same prompt (its prefix cached) between its first and last token,
    after a warm-up request of the same length (so first-call allocations are not timed). The
    KV pool holds that one request, as a single-stream tool needs."""
    from edgeinfer.cli.event_loop import run_async
    from edgeinfer.config import SchedulerConfig
    from edgeinfer.core.events import Error, Finished
    from edgeinfer.core.request import GenerateRequest
    from edgeinfer.core.sampling_params import SamplingParams
    from edgeinfer.engine.api import Engine, EngineConfig

    runtime = _one_request_runtime(args, args.prompt_tokens + args.new_tokens + 1)
    corpus = Path(args.text)

    async def finished(engine: Engine, request_id: str, ids: tuple[int, ...], max_tokens: int) -> Finished:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        async for event in engine.generate(GenerateRequest(request_id, prompt_token_ids=ids, params=params)):
            if isinstance(event, Error):
                raise ValueError(f"{event.code}: {event.message}")
            if isinstance(event, Finished):
                return event
        raise RuntimeError("the engine ended the request without a final event")

    async def run() -> dict[str, object]:
        config = EngineConfig(str(model_path(args.model)), runtime, SchedulerConfig(burst_window_s=0.0))
        async with Engine(config) as engine:
            ids = tuple(engine.tokenizer.encode(corpus.read_text()[: args.prompt_tokens * 8]))[: args.prompt_tokens]
            if len(ids) < args.prompt_tokens:
                raise ValueError(f"--text {corpus} has only {len(ids)} tokens in its first "
                                 f"{args.prompt_tokens * 8} characters; --prompt-tokens asks for {args.prompt_tokens}")
            await finished(engine, "warm-up", ids[::-1], 2)  # the same step sizes; shares no prefix
            prefill = (await finished(engine, "prefill", ids, 1)).usage
            decode = (await finished(engine, "decode", ids, args.new_tokens + 1)).usage
            linear_path = engine.linear_path
        return {
            "prompt_tokens": len(ids),
            "new_tokens": decode.completion_tokens - 1,
            "prefill_tok_s": round(len(ids) / prefill.ttft_s, 1),
            "decode_tok_s": round(1 / decode.tpot_s, 1),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "linear_path": linear_path,
        }

    result = run_async(run)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>14}: {value}")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from edgeinfer.cli.serve import chat_main

    return chat_main(args)


def build_parser() -> argparse.ArgumentParser:
    """The `edgeinfer` parser and its subcommands (serve, daemon, quantize and eval-ppl parse their own)."""
    parser = argparse.ArgumentParser(prog="edgeinfer", description="Quantized LLM inference at the edge.",
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"edgeinfer {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_model_commands(sub)

    gen = sub.add_parser("generate", help="complete one prompt; prints only the completion",
                         formatter_class=HelpFormatter)
    gen.add_argument("prompt", help="the user's message (sent through the chat template unless --no-chat)")
    gen.add_argument("--max-tokens", type=int, help=f"most tokens of the answer (default: "
                                                    f"{GENERATION_DEFAULTS.max_tokens})")
    gen.add_argument("--temperature", type=float, help=_TEMPERATURE_HELP)
    gen.add_argument("--top-p", type=float, help="sample from the smallest set of tokens this likely; default: the "
                                                 f"model's generation_config.json, else {GENERATION_DEFAULTS.top_p}")
    gen.add_argument("--top-k", type=int, help="sample from the k likeliest tokens (0: all); default: the model's "
                                               "generation_config.json, else 0")
    gen.add_argument("--seed", type=int, default=None, help="seed for sampling (the same seed, the same answer)")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--no-chat", action="store_true", help="send the prompt as is, without the chat template")
    gen.add_argument("--beam-width", type=int, default=0, help="beam search with this many beams (0: sampling)")
    gen.add_argument("--num-results", type=int, default=1,
                     help="beam search: how many best continuations to print (needs --beam-width)")
    gen.add_argument("--length-penalty", type=float, default=1.0,
                     help="beam search: score = logprob / length ** this (> 0 favours longer answers)")
    gen.add_argument("--early-stopping", choices=("true", "false", "never"), default="false",
                     help="beam search: stop at width finished beams (true), when no live beam can win by "
                          "the current-length heuristic (false), or only when none can win at any length (never)")
    gen.add_argument("--speculative", choices=("ngram",), default=None,
                     help="speculative decoding with prompt-lookup drafts (helps when the answer copies the prompt)")
    gen.add_argument("--draft-model", metavar="MODEL",
                     help="speculative decoding with this model drafting (same vocabulary), e.g. the int4 "
                          "GGUF for an int8 or bf16 checkpoint of the same model")
    add_runtime_args(gen, memory_budget=False)
    gen.set_defaults(func=cmd_generate)

    bench = sub.add_parser("bench", help="time prefill and greedy decode", formatter_class=HelpFormatter)
    bench.add_argument("--prompt-tokens", type=int, default=256, help="prompt length")
    bench.add_argument("--new-tokens", type=int, default=128, help="greedy tokens decoded")
    bench.add_argument("--text", default=str(EVAL_TEXT), help="text the prompt is cut from")
    bench.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    add_runtime_args(bench, memory_budget=False)
    bench.set_defaults(func=cmd_bench)

    chat = sub.add_parser("chat", help="streaming chat in the terminal (uses the daemon when it runs)",
                          formatter_class=HelpFormatter)
    chat.add_argument("--max-tokens", type=int, help=f"most tokens of each answer (default: "
                                                     f"{GENERATION_DEFAULTS.max_tokens})")
    chat.add_argument("--temperature", type=float, help=_TEMPERATURE_HELP)
    chat.add_argument("--no-daemon", action="store_true", help="run the engine in this process even if a daemon runs")
    add_runtime_args(chat)
    chat.set_defaults(func=cmd_chat)

    for name, helptext in (("serve", "websocket server"), ("daemon", "background server: start|stop|status|logs"),
                           ("quantize", "convert a model to an edgeinfer checkpoint"),
                           ("eval-ppl", "perplexity of a model on a text")):
        sub.add_parser(name, help=helptext, add_help=False)
    for command in subcommands(parser).values():
        if command.add_help:
            add_log_level(command)
    return parser


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The parsers of ``parser``'s subcommands, by name."""
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return_large_frees_to_the_os()
    # Subcommands implemented elsewhere take their own argv.
    if argv and argv[0] in ("quantize", "eval-ppl", "serve", "daemon"):
        if argv[0] in ("quantize", "eval-ppl"):
            from edgeinfer.cli import quantize as quant_cli

            run = quant_cli.quantize_main if argv[0] == "quantize" else quant_cli.eval_ppl_main
        else:
            from edgeinfer.cli import serve

            run = serve.serve_main if argv[0] == "serve" else serve.daemon_main
        return run(argv[1:])

    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    try:
        return args.func(args)
    except (OSError, ValueError, RuntimeError) as exc:  # a file, the network, a bad value: one line
        print(f"edgeinfer: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\nedgeinfer {args.command}: interrupted", file=sys.stderr)
        return 130
