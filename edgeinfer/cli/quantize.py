"""Command lines of the quant tools: ``edgeinfer quantize`` and ``edgeinfer eval-ppl``.

Each ``*_main(argv)`` parses its arguments, runs, prints, and returns an exit code; user errors
(bad arguments, unreadable or unsupported models, an unwritable DST) print one line on stderr
and return 2 instead of a traceback.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from edgeinfer.cli.options import HelpFormatter, add_log_level, memory_size, positive_int, setup_logging
from edgeinfer.config import CPU_ACTIVATIONS, DEFAULT_CONTEXT, KV_DTYPES, LINEAR_PATHS, RuntimeConfig
from edgeinfer.models.store import resolve_model
from quant.corpus import EVAL_TEXT
from quant.formats import GROUP_SIZES
from quant.gguf_import import ModelFileError


def _quantize_parser() -> argparse.ArgumentParser:
    from quant.convert import CALIBRATION_METHODS, WEIGHT_FORMATS

    p = argparse.ArgumentParser(
        prog="edgeinfer quantize", description="Convert a model into an edgeinfer checkpoint.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("src", help="GGUF file or HF-style folder (safetensors; bitsandbytes 4-bit detected), or its "
                   "name from `edgeinfer list`")
    p.add_argument("dst", help="checkpoint folder (or, with --format gguf, file; compressed-tensors, HF folder) "
                   "to write, atomically")
    p.add_argument("--weights", required=True, choices=WEIGHT_FORMATS, help="format of the linear layers")
    p.add_argument(
        "--group-size",
        type=int,
        choices=GROUP_SIZES,
        help="group size (default: int4 32, nf4 64, int8 one scale per row)",
    )
    p.add_argument("--calibrate", choices=CALIBRATION_METHODS,
                   help="calibrate on --calib-data: gptq (error-minimising rounding), awq (activation-aware "
                        "channel scales, int4), awq+gptq (both)")
    p.add_argument("--calib-data", help="text file to calibrate on (default: the 64 KiB of Shakespeare that ships "
                                        "with edgeinfer, quant/data/shakespeare_calib.txt, disjoint from eval-ppl's)")
    p.add_argument("--calib-tokens", type=int, default=4096, help="calibration tokens (default 4096)")
    p.add_argument("--calib-seqlen", type=int, default=512, help="calibration sequence length (default 512)")
    p.add_argument(
        "--skip",
        action="append",
        default=[],
        metavar="PATTERN",
        help="keep weights whose name matches this fnmatch pattern in the source format (repeatable)",
    )
    p.add_argument("--format", choices=("edgeinfer", "gguf", "compressed-tensors"), default="edgeinfer",
                   help="edgeinfer checkpoint folder (default), or one GGUF file for llama.cpp / ollama "
                        "(int4 as Q4_1, int8 as Q8_0, with fp16 scales so the file holds exactly these weights), "
                        "or an HF folder in the compressed-tensors layout for vLLM / transformers (pack-quantized "
                        "W4A16 with integer zero points, W8A16; fp16 scales and plain tensors: the same numbers)")
    p.add_argument("--budget", type=memory_size, default=(None, None), metavar="SIZE",
                   help="plan a precision per linear layer (int8, int4 g32/g64/g128) from each layer's measured "
                        "error on calibration text so that weights + KV for --ctx x --parallel fit SIZE (1.5GB, "
                        "800MiB); the plan is printed and stored in the checkpoint (--weights names the format "
                        "of everything else); --format edgeinfer or compressed-tensors (one config group per "
                        "precision)")
    p.add_argument("--ctx", type=positive_int, default=None, metavar="TOKENS",
                   help="with --budget: the longest sequence the server will hold (default: the model's "
                        f"context, at most {DEFAULT_CONTEXT}, as `edgeinfer serve`)")
    p.add_argument("--parallel", type=positive_int, default=RuntimeConfig.parallel, metavar="N",
                   help="with --budget: full-length sequences the KV cache holds (default: %(default)s)")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="fp16",
                   help="with --budget: the KV cache format the server will use (default: %(default)s)")
    p.add_argument("--force", action="store_true", help="overwrite an existing checkpoint at DST")
    add_log_level(p)  # info (-v) also prints each weight's format and relative error
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    return p


class ProgressBar:
    """A tqdm bar on stderr for a ``progress(done, total[, name])`` callback: convert's weights
    (with the last one's name), eval-ppl's windows."""

    def __init__(self, unit: str) -> None:
        self.unit = unit
        self.bar: Any = None

    def __call__(self, done: int, total: int, name: str = "") -> None:
        from tqdm import tqdm

        if self.bar is None:
            self.bar = tqdm(total=total, unit=self.unit, file=sys.stderr, dynamic_ncols=True)
        if name:
            self.bar.set_postfix_str(name, refresh=False)
        self.bar.update(done - self.bar.n)
        if done == total:
            self.close()

    def close(self) -> None:
        """Before any other line: a bar left open redraws itself when the program exits."""
        if self.bar is not None:
            self.bar.close()


def quantize_main(argv: list[str]) -> int:
    from quant.convert import ConvertOptions, convert

    args = _quantize_parser().parse_args(argv)
    setup_logging(args.log_level)
    progress = ProgressBar("weight")
    try:
        opts = ConvertOptions(
            weights=args.weights,
            group_size=args.group_size,
            calibrate=args.calibrate,
            calib_data=args.calib_data,
            calib_tokens=args.calib_tokens,
            calib_seqlen=args.calib_seqlen,
            skip=tuple(args.skip),
            force=args.force,
            verbose=args.log_level in ("info", "debug"),
        )
        src, shown = str(resolve_model(args.src)), None if args.quiet else progress
        budget_bytes, fraction = args.budget
        if fraction is not None:
            raise ValueError("--budget takes bytes (1.5GB, 800MiB), not a share of memory")
        if budget_bytes is None and (args.ctx, args.parallel, args.kv_dtype) != (None, RuntimeConfig.parallel, "fp16"):
            raise ValueError("--ctx, --parallel and --kv-dtype size the KV cache of a --budget plan; give --budget")
        if budget_bytes is not None:
            from quant.budget import Budget, convert_to_budget

            report, _ = convert_to_budget(src, args.dst, opts, Budget(budget_bytes, args.ctx, args.parallel,
                                                                      args.kv_dtype), progress=shown,
                                          export=args.format)
        elif args.format == "gguf":
            from quant.export_gguf import convert_to_gguf

            report = convert_to_gguf(src, args.dst, opts, progress=shown)
        elif args.format == "compressed-tensors":
            from quant.export_ctensors import convert_to_ctensors

            report = convert_to_ctensors(src, args.dst, opts, progress=shown)
        else:
            report = convert(src, args.dst, opts, progress=shown)
    except (ValueError, OSError) as exc:  # ModelFileError / CheckpointError are ValueErrors
        progress.close()
        print(f"edgeinfer quantize: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the checkpoint is written to a temporary folder and renamed at the end
        progress.close()
        print(f"\nedgeinfer quantize: interrupted; {args.dst} was not written", file=sys.stderr)
        return 130
    print(f"wrote {report.dst} ({len(report.errors)} weights, {report.seconds:.1f} s)")
    return 0


def _ppl_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="edgeinfer eval-ppl", description="Perplexity over a fixed slice of a text.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("model", help="GGUF file, HF folder or edgeinfer checkpoint, or its name from `edgeinfer list`")
    p.add_argument("--text", help="text file to score (default: the 64 KiB of Shakespeare that ships with "
                                  "edgeinfer, quant/data/shakespeare_eval.txt)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens of the text to score (default 4096)")
    p.add_argument("--window", type=int, default=512, help="window length (default 512)")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="fp32", help="K and V cache format (default fp32)")
    p.add_argument("--linear-path", choices=LINEAR_PATHS, default="reference",
                   help="linear kernels (default reference: exact fp32, the figure measures the weights alone)")
    p.add_argument("--cpu-activations", choices=CPU_ACTIVATIONS, default=RuntimeConfig.cpu_activations,
                   help="with --linear-path int4_cpu: auto, int16, int8, int8x2, int8x2-lean, bf16 or bf16-prompts "
                        "activations (see `edgeinfer serve --help`) (default %(default)s)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    add_log_level(p)
    return p


def eval_ppl_main(argv: list[str]) -> int:
    """Perplexity on the engine (quant.perplexity), the model loaded as ``edgeinfer serve`` loads it."""
    from edgeinfer.cli.event_loop import run_async
    from edgeinfer.engine.api import Engine
    from quant.perplexity import PerplexityResult, engine_config, perplexity, text_tokens

    args = _ppl_parser().parse_args(argv)
    setup_logging(args.log_level)
    text = args.text or str(EVAL_TEXT)

    async def run() -> PerplexityResult:
        # The checkpoint's own head: the figure measures the format, and the same text on the same
        # file gives the same number on every path.
        runtime = RuntimeConfig(linear_path=args.linear_path, kv_dtype=args.kv_dtype, exact_head=True,
                                cpu_activations=args.cpu_activations)
        print(f"edgeinfer eval-ppl: loading {args.model} ...", file=sys.stderr, flush=True)
        async with Engine(engine_config(str(resolve_model(args.model)), args.window, runtime)) as engine:
            token_ids = text_tokens(engine.tokenizer, text, args.tokens)
            print(f"edgeinfer eval-ppl: scoring {len(token_ids)} tokens of {text} in windows of {args.window}",
                  file=sys.stderr, flush=True)
            return await perplexity(engine, token_ids, window=args.window, progress=None if args.quiet else progress)

    progress = ProgressBar("window")
    try:
        start = time.perf_counter()
        result = run_async(run)
    except (ValueError, OSError, ModelFileError) as exc:
        progress.close()
        print(f"edgeinfer eval-ppl: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        progress.close()
        print("\nedgeinfer eval-ppl: interrupted", file=sys.stderr)
        return 130
    print(
        f"perplexity {result.perplexity:.4f} (nll {result.nll:.5f}, {result.num_scored} tokens in "
        f"{result.num_windows} windows of {args.window}, kv {args.kv_dtype}, "
        f"{time.perf_counter() - start:.1f} s)"
    )
    return 0
