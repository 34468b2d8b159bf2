"""Flags that every model-running subcommand shares (main.py's and serve.py's), and what they mean."""

from __future__ import annotations

import argparse
from pathlib import Path

from edgeinfer.config import KV_DTYPES, LINEAR_PATHS, RuntimeConfig


def model_path(arg: str | None) -> Path:
    """--model, else the default model (pulled if missing)."""
    from edgeinfer.models.pull import default_model_path, pull

    if arg:
        return Path(arg)
    path = default_model_path()
    return path if path.is_file() else pull()


def add_runtime_args(p: argparse.ArgumentParser) -> None:
    """The model and runtime flags every model-running subcommand shares."""
    p.add_argument("--model", help="GGUF file, HF folder or edgeinfer checkpoint (default: the pulled default model)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"))
    p.add_argument("--linear-path", default="auto", choices=LINEAR_PATHS,
                   help="auto: int4 CPU kernels / Triton on CUDA; reference: exact fp32")
    p.add_argument("--kv-dtype", default="auto", choices=("auto", *KV_DTYPES),
                   help="K and V cache format (auto: fp16; fp32 with --linear-path reference)")
    p.add_argument("--k-dtype", default=None, choices=KV_DTYPES, help="K cache format (overrides --kv-dtype)")
    p.add_argument("--v-dtype", default=None, choices=KV_DTYPES, help="V cache format (overrides --kv-dtype)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--cuda-graphs", action="store_true", help="replay decode steps as CUDA graphs (CUDA only)")
    p.add_argument("--exact-head", action="store_true",
                   help="exact logits for every token (the int4 CPU path otherwise recomputes only the 64 "
                        "likeliest exactly: exact choices, approximate logprobs of unlikely tokens; slower decode)")


def runtime_config(args: argparse.Namespace) -> RuntimeConfig:
    return RuntimeConfig(device=args.device, linear_path=args.linear_path, kv_dtype=args.kv_dtype,
                         k_dtype=args.k_dtype, v_dtype=args.v_dtype, num_threads=args.threads,
                         cuda_graphs=args.cuda_graphs, exact_head=args.exact_head)
