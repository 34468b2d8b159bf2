"""The `edgeinfer` command: pull, generate, chat, bench, serve, daemon, quantize, eval-ppl.

Each subcommand parses its flags here and calls into the package; nothing else reads argv.
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from edgeinfer.cli.options import add_runtime_args, model_path, runtime_config
from edgeinfer.models.host_memory import return_large_frees_to_the_os

if TYPE_CHECKING:
    from edgeinfer.models.llama import LlamaModel
    from edgeinfer.models.loader import LoadedModel
    from edgeinfer.worker.draft_model import DraftModel
    from edgeinfer.worker.model_runner import ModelRunner


def _load(args: argparse.Namespace) -> tuple[LoadedModel, LlamaModel]:
    from edgeinfer.models.loader import load_model
    from edgeinfer.worker.llm import build_model

    loaded = load_model(model_path(args.model))
    return loaded, build_model(loaded, runtime_config(args), take_weights=True)


def _runner(args: argparse.Namespace, model: LlamaModel, num_tokens: int) -> ModelRunner:
    from edgeinfer.worker.llm import single_stream_runner

    if num_tokens > model.config.max_position:
        raise ValueError(f"prompt_too_long: {num_tokens} tokens (prompt + new) exceed the model's context "
                         f"of {model.config.max_position}")
    return single_stream_runner(model, runtime_config(args), num_tokens)


def cmd_pull(args: argparse.Namespace) -> int:
    from edgeinfer.models.pull import pull

    print(pull())
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from edgeinfer.core.sampling_params import SamplingParams
    from edgeinfer.core.stop import StopChecker
    from edgeinfer.worker.llm import generate_tokens

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=tuple(args.stop or ()))
    loaded, model = _load(args)
    tok = loaded.tokenizer
    text = args.prompt if args.no_chat else tok.apply_chat_template([{"role": "user", "content": args.prompt}])
    prompt_ids = tok.encode(text, add_special=args.no_chat)
    eos = tuple(loaded.config.eos_token_ids)
    if args.beam_width:
        return _beam_generate(args, loaded, model, prompt_ids)
    runner = _runner(args, model, len(prompt_ids) + params.max_tokens)
    checker = StopChecker(params, eos)
    detok = tok.detokenizer()
    drafter = _drafter(args, len(prompt_ids) + params.max_tokens)
    for token in generate_tokens(runner, prompt_ids, params, eos, drafter=drafter):
        out, reason = checker.push(token, detok.push(token))
        sys.stdout.write(out)
        sys.stdout.flush()
        if reason:
            break
    sys.stdout.write(checker.flush() + "\n")
    return 0


def _beam_generate(args: argparse.Namespace, loaded: LoadedModel, model: LlamaModel, prompt_ids: list[int]) -> int:
    """generate --beam-width: the best --num-results continuations, with their scores when several."""
    from edgeinfer.core.beam_search import BeamSearchParams
    from edgeinfer.worker.beam_runner import beam_pool_blocks, beam_search_tokens
    from edgeinfer.worker.llm import single_stream_runner

    conflicts = [flag for flag, on in (("--temperature", args.temperature != 0), ("--stop", bool(args.stop)),
                                       ("--speculative", bool(args.speculative)),
                                       ("--draft-model", bool(args.draft_model))) if on]
    if conflicts:
        raise ValueError(f"beam search is deterministic and runs alone: drop {', '.join(conflicts)}")
    early = {"true": True, "false": False, "never": "never"}[args.early_stopping]
    params = BeamSearchParams(width=args.beam_width, max_tokens=args.max_tokens, num_results=args.num_results,
                              length_penalty=args.length_penalty, early_stopping=early,
                              eos_token_ids=tuple(loaded.config.eos_token_ids))
    runtime = runtime_config(args)
    blocks = beam_pool_blocks(len(prompt_ids), params, runtime.block_size)
    if len(prompt_ids) + params.max_tokens > model.config.max_position:
        raise ValueError(f"prompt_too_long: {len(prompt_ids) + params.max_tokens} tokens (prompt + new) exceed "
                         f"the model's context of {model.config.max_position}")
    runner = single_stream_runner(model, runtime, blocks * runtime.block_size)  # one pool the beams share
    hypotheses = beam_search_tokens(runner, prompt_ids, params)
    for rank, hyp in enumerate(hypotheses, 1):
        text = loaded.tokenizer.decode(list(hyp.token_ids))  # special tokens (EOS) skipped
        if len(hypotheses) > 1:
            print(f"--- {rank} score {hyp.score:.4f} logprob {hyp.logprob:.4f} ({hyp.finish_reason})")
        print(text)
    return 0


def _drafter(args: argparse.Namespace, num_tokens: int) -> str | DraftModel | None:
    """generate's drafter: --draft-model (a DraftModel), --speculative ngram, or none."""
    if args.draft_model:
        from edgeinfer.models.loader import load_model
        from edgeinfer.worker.draft_model import DraftModel
        from edgeinfer.worker.llm import build_model, single_stream_runner

        draft = build_model(load_model(model_path(args.draft_model)), runtime_config(args), take_weights=True)
        return DraftModel(single_stream_runner(draft, runtime_config(args), num_tokens))
    return args.speculative


def cmd_bench(args: argparse.Namespace) -> int:
    from edgeinfer.core.sampling_params import SamplingParams
    from edgeinfer.worker.batch import SeqChunk
    from edgeinfer.worker.llm import generate_tokens, prefill

    loaded, model = _load(args)
    runner = _runner(args, model, args.prompt_tokens + args.new_tokens + 1)
    corpus = Path(args.text)
    ids = loaded.tokenizer.encode(corpus.read_text()[: args.prompt_tokens * 8]) if corpus.is_file() else []
    ids = (ids or list(range(100, 100 + args.prompt_tokens)))[: args.prompt_tokens]
    table = tuple(range(runner.pool.num_blocks))
    runner.logits([SeqChunk(tuple(ids[:16]), 0, table)])  # warm-up: first-call allocations
    start = time.perf_counter()
    prefill(runner, ids)  # in chunks, as generate runs a prompt
    prefill_s = time.perf_counter() - start
    params = SamplingParams(max_tokens=args.new_tokens + 1, temperature=0.0, ignore_eos=True)
    stream = generate_tokens(runner, ids, params)
    next(stream)  # the first token comes from a prefill; decode timing starts after it
    start = time.perf_counter()
    decoded = sum(1 for _ in stream)
    decode_s = time.perf_counter() - start
    result = {
        "prompt_tokens": len(ids),
        "new_tokens": decoded,
        "prefill_tok_s": round(len(ids) / prefill_s, 1),
        "decode_tok_s": round(decoded / decode_s, 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "linear_path": runner.model.linear_path,
    }
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>14}: {value}")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from edgeinfer.cli.serve import chat_main

    return chat_main(args)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return_large_frees_to_the_os()
    # Subcommands implemented elsewhere take their own argv.
    if argv and argv[0] in ("quantize", "eval-ppl", "serve", "daemon"):
        if argv[0] in ("quantize", "eval-ppl"):
            from quant import cli as quant_cli

            run = quant_cli.quantize_main if argv[0] == "quantize" else quant_cli.eval_ppl_main
        else:
            from edgeinfer.cli import serve

            run = serve.serve_main if argv[0] == "serve" else serve.daemon_main
        return run(argv[1:])

    parser = argparse.ArgumentParser(prog="edgeinfer", description="Quantized LLM inference at the edge.")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("pull", help="fetch the default model into the cache").set_defaults(func=cmd_pull)

    gen = sub.add_parser("generate", help="complete one prompt; prints only the completion")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--no-chat", action="store_true", help="send the prompt as is, without the chat template")
    gen.add_argument("--beam-width", type=int, default=0, help="beam search with this many beams (0: sampling)")
    gen.add_argument("--num-results", type=int, default=1, help="beam search: how many best continuations to print")
    gen.add_argument("--length-penalty", type=float, default=1.0,
                     help="beam search: score = logprob / length ** this (> 0 favours longer answers)")
    gen.add_argument("--early-stopping", choices=("true", "false", "never"), default="false",
                     help="beam search: stop at width finished beams (true), when no live beam can win by "
                          "the current-length heuristic (false), or only when none can win at any length (never)")
    gen.add_argument("--speculative", choices=("ngram",), default=None,
                     help="speculative decoding with prompt-lookup drafts (helps when the answer copies the prompt)")
    gen.add_argument("--draft-model", metavar="PATH",
                     help="speculative decoding with this model drafting (same vocabulary), e.g. the int4 "
                          "GGUF for an int8 or bf16 checkpoint of the same model")
    add_runtime_args(gen)
    gen.set_defaults(func=cmd_generate)

    bench = sub.add_parser("bench", help="time prefill and greedy decode")
    bench.add_argument("--prompt-tokens", type=int, default=256)
    bench.add_argument("--new-tokens", type=int, default=128)
    bench.add_argument("--text", default=str(Path(__file__).resolve().parents[2] / "shared/data/tinyshakespeare.txt"),
                       help="text the prompt is cut from (falls back to synthetic ids)")
    bench.add_argument("--json", action="store_true")
    add_runtime_args(bench)
    bench.set_defaults(func=cmd_bench)

    chat = sub.add_parser("chat", help="streaming chat in the terminal (uses the daemon when it runs)")
    chat.add_argument("--max-tokens", type=int, default=512)
    chat.add_argument("--temperature", type=float, default=0.7)
    chat.add_argument("--no-daemon", action="store_true", help="run the engine in this process even if a daemon runs")
    add_runtime_args(chat)
    chat.set_defaults(func=cmd_chat)

    for name, helptext in (("serve", "websocket server"), ("daemon", "background server: start|stop|status|logs"),
                           ("quantize", "convert a model to an edgeinfer checkpoint"),
                           ("eval-ppl", "perplexity of a model on a text")):
        sub.add_parser(name, help=helptext, add_help=False)

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (FileNotFoundError, ValueError, RuntimeError) as exc:
        print(f"edgeinfer: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
