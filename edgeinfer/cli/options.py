"""Flags that every model-running subcommand shares (main.py's and serve.py's), and what they mean."""

from __future__ import annotations

import argparse
import logging
import re
from pathlib import Path

from edgeinfer.config import CPU_ACTIVATIONS, DEFAULT_CONTEXT, KV_DTYPES, LINEAR_PATHS, RuntimeConfig


def model_path(arg: str | None) -> Path:
    """--model (a path, or a name from `edgeinfer list`), else the default model (pulled if missing)."""
    from edgeinfer.models.pull import default_model_path, pull
    from edgeinfer.models.store import resolve_model

    if arg:
        return resolve_model(arg)
    path = default_model_path()
    return path if path.is_file() else pull()


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def memory_size(text: str) -> tuple[int | None, float | None]:
    """--kv-memory's value: (bytes, None) for "1.5GB", "512MiB", "800000000"; (None, fraction) for "10%"."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(%|[kmg]i?b|b)?\s*", text.lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: write e.g. 1.5GB, 512MiB or 10%")
    number, unit = float(match.group(1)), match.group(2) or ""
    if unit == "%":
        if not 0 < number <= 100:
            raise argparse.ArgumentTypeError(f"{text!r}: a percentage must be in (0, 100]")
        return None, number / 100
    size = int(number * _UNITS[unit])
    if size <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the KV cache needs more than 0 bytes")
    return size, None


class HelpFormatter(argparse.HelpFormatter):
    """--help shows each option's default after its help text, where it has one worth saying
    (not for switches, not where the text already says it)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (default is None or default is False or default == argparse.SUPPRESS
                or isinstance(action, argparse._StoreConstAction)
                or isinstance(default, (tuple, list)) and not any(default)
                or "default" in text or "%(default)" in text or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)"


LOG_LEVELS = ("debug", "info", "warning", "error")


def add_log_level(p: argparse.ArgumentParser) -> None:
    """--log-level and -v, its short form for info: the same two flags in every command."""
    p.add_argument("--log-level", choices=LOG_LEVELS, default="warning",
                   help="what edgeinfer logs on stderr (info: what the engine and server do)")
    p.add_argument("-v", dest="log_level", action="store_const", const="info", help="short for --log-level info")


def setup_logging(level: str) -> None:
    """Log at ``level`` (one of LOG_LEVELS) on stderr, once per process."""
    logging.basicConfig(level=getattr(logging, level.upper()), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if level not in ("debug", "info"):  # uvicorn logs its start, every close and its shutdown steps at INFO
        logging.getLogger("uvicorn.error").setLevel(logging.WARNING)


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        return package_version("edgeinfer")
    except PackageNotFoundError:  # run from a checkout that was not installed
        return "unknown (not installed)"


def _whole_number(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def positive_int(text: str) -> int:
    value = _whole_number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def niceness(text: str) -> int:
    value = _whole_number(text)
    if not 0 <= value <= 19:
        raise argparse.ArgumentTypeError(f"must be from 0 to 19, got {value}")
    return value


def add_runtime_args(p: argparse.ArgumentParser, memory_budget: bool = True) -> None:
    """The model and runtime flags every model-running subcommand shares; ``memory_budget`` adds
    the memory plan's --ctx, --parallel and --kv-memory, for the commands that serve many requests
    (generate and bench size their pool to the one request they run)."""
    p.add_argument("--model", help="a name from `edgeinfer list`, or a GGUF file, HF folder or edgeinfer checkpoint "
                   "(default: the pulled default model)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"),
                   help="where the model runs (auto: cuda when torch sees a GPU)")
    p.add_argument("--linear-path", default="auto", choices=LINEAR_PATHS,
                   help="auto: int4 CPU kernels / Triton on CUDA; reference: exact fp32")
    p.add_argument("--cpu-activations", default=RuntimeConfig.cpu_activations, choices=CPU_ACTIVATIONS,
                   help="how the CPU int4/int8 kernels round activations: int16 per 4 values (the accuracy "
                        "reference), int8 per 32 (VNNI GEMMs: fastest, +0.5%% perplexity, llama.cpp's rounding), "
                        "int8x2 (x and its rounding residual in int8: int16's accuracy through the VNNI GEMMs), "
                        "int8x2-lean (int8x2 with the attention output and the head's coarse pass in one term: "
                        "the same accuracy measured, less work), "
                        "bf16 (AMX-BF16 Xeons only: x and weights in bf16, fastest for prompts and many streams, "
                        "slower for one), bf16-prompts (prompts in bf16, generated tokens in int8x2) or auto "
                        "(bf16-prompts on AMX-BF16, int8x2-lean where the CPU has VNNI, else int16) "
                        "(default: %(default)s)")
    p.add_argument("--kv-dtype", default="auto", choices=("auto", *KV_DTYPES),
                   help="K and V cache format (auto: fp16; fp32 with --linear-path reference)")
    p.add_argument("--k-dtype", default=None, choices=KV_DTYPES, help="K cache format (overrides --kv-dtype)")
    p.add_argument("--v-dtype", default=None, choices=KV_DTYPES, help="V cache format (overrides --kv-dtype)")
    if memory_budget:
        p.add_argument("--ctx", type=positive_int, default=None, metavar="TOKENS",
                       help=f"longest sequence (prompt + answer) served (default: the model's context, at most "
                            f"{DEFAULT_CONTEXT})")
        p.add_argument("--parallel", type=positive_int, default=RuntimeConfig.parallel, metavar="N",
                       help="full-length sequences the KV cache holds; shorter ones share it, more of them at "
                            "once (default: %(default)s)")
        p.add_argument("--kv-memory", type=memory_size, default=(None, None), metavar="SIZE",
                       help="size the KV cache by memory instead of --ctx x --parallel: bytes (1.5GB, 512MiB) or "
                            "a share of available memory (10%%)")
    p.add_argument("--threads", type=positive_int, default=None, help="CPU threads (default: torch's choice, "
                   "one per core); fewer while other programs keep some cores busy")
    p.add_argument("--fixed-threads", action="store_true",
                   help="keep --threads even while other programs keep cores busy")
    p.add_argument("--compute-nice", type=niceness, default=RuntimeConfig.compute_nice, metavar="N",
                   help="niceness added to the threads that run the model, so other programs, local clients "
                        "and the server's own I/O get a core sooner during a step (0 to 19; default: %(default)s)")
    p.add_argument("--cuda-graphs", action="store_true", help="replay decode steps as CUDA graphs (CUDA only)")
    p.add_argument("--exact-head", action="store_true",
                   help="exact logits for every token (the int4 CPU path otherwise recomputes only the 64 "
                        "likeliest exactly: exact choices, approximate logprobs of unlikely tokens; slower decode)")


def runtime_config(args: argparse.Namespace) -> RuntimeConfig:
    kv_bytes, kv_fraction = getattr(args, "kv_memory", (None, None))
    pool = {"max_model_len": args.ctx, "parallel": args.parallel} if hasattr(args, "ctx") else {}
    return RuntimeConfig(device=args.device, linear_path=args.linear_path, kv_dtype=args.kv_dtype,
                         cpu_activations=args.cpu_activations, k_dtype=args.k_dtype, v_dtype=args.v_dtype,
                         num_threads=args.threads, share_cpu=not args.fixed_threads,
                         compute_nice=args.compute_nice, cuda_graphs=args.cuda_graphs, exact_head=args.exact_head,
                         kv_memory_bytes=kv_bytes, kv_memory_fraction=kv_fraction, **pool)
