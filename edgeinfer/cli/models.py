"""`edgeinfer pull`, `list`, `show` and `rm`: the model store (edgeinfer.models.store) at the terminal.

`show` answers "does it run here, and in how much memory" without loading a weight: the weights'
bytes from the file's header, plus the KV cache the default memory plan would build (--ctx x
--parallel sequences, edgeinfer.worker.device_memory.num_kv_blocks's arithmetic) against the
memory available now.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from edgeinfer.cli.options import HelpFormatter, positive_int
from edgeinfer.config import DEFAULT_CONTEXT, KV_DTYPES, ModelConfig, RuntimeConfig
from edgeinfer.models.discover import FoundModel
from edgeinfer.models.store import all_models, pull_model, remove_model, resolve_model

MB = 10**6


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 1e9:,.2f} GB" if num_bytes >= 1e9 else f"{num_bytes / MB:,.1f} MB"


def _disk_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def cmd_pull(args: argparse.Namespace) -> int:
    model = pull_model(args.model, name=args.name, copy=args.copy, progress=not args.quiet)
    how = "copied into the store" if model.copied else "stored by reference"
    print(f"{model.name}: {how} ({model.path})", file=sys.stderr)
    print(model.path)
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    models = all_models()
    if not models:
        print("no models found: `edgeinfer pull` fetches the default one")
        return 0
    width = max(len(m.name) for m in models)
    print(f"{'NAME':<{width}}  {'WHERE':<9}  {'SIZE':>9}  PATH")
    for model in models:
        size = "broken" if model.problem else _size(_disk_bytes(model.path))
        print(f"{model.name:<{width}}  {model.where:<9}  {size:>9}  {model.path}")
        if model.problem:
            print(f"{'':<{width}}  ! {model.problem}")
    return 0


def _where(arg: str, path: Path) -> str:
    found = [m for m in all_models() if m.name == arg or m.path == path]
    return found[0].where if found else "path"


def _memory_line(config: ModelConfig, args: argparse.Namespace, weight_bytes: int) -> str:
    import psutil

    from edgeinfer.worker.kv_pools import bytes_per_token

    runtime = RuntimeConfig(max_model_len=args.ctx, parallel=args.parallel, kv_dtype=args.kv_dtype)
    context = runtime.context_length(config.max_position)
    blocks = -(-context // runtime.block_size) * runtime.parallel  # the default pool's arithmetic
    kv = blocks * runtime.block_size * bytes_per_token(config, runtime.key_dtype, runtime.value_dtype)
    need, free = weight_bytes + kv, psutil.virtual_memory().available
    verdict = "yes" if need <= free else "no: lower --ctx or --parallel, or --kv-dtype int8"
    kv_dtype = runtime.key_dtype if runtime.key_dtype == runtime.value_dtype else "mixed"
    return (f"{verdict} (CPU): {_size(need)} = weights {_size(weight_bytes)} + KV cache {kv_dtype} {_size(kv)} "
            f"for {runtime.parallel} x {context}-token sequences; {_size(free)} available now")


def cmd_show(args: argparse.Namespace) -> int:
    from edgeinfer.models.model_info import model_info

    path = resolve_model(args.model)
    info = model_info(path)
    types = ", ".join(f"{name} x{count}" for name, count in sorted(info.tensor_types.items(), key=lambda kv: -kv[1]))
    rows = [
        ("model", f"{args.model} ({_where(args.model, path)})"),
        ("file", f"{info.path} ({_size(info.file_bytes)})"),
        ("format", info.format),
        ("architecture", info.architecture),
        ("parameters", f"{info.num_parameters / 1e6:,.1f} M"),
        ("tensor types", types or "none"),
        ("context", f"{info.context_length} tokens" if info.context_length else "not recorded"),
        ("chat template", "yes" if info.chat_template else "no (generate and chat need --no-chat or a template)"),
    ]
    if info.config is None:
        rows.append(("runs here", f"no: {info.unsupported}"))
    else:
        try:
            rows.append(("runs here", _memory_line(info.config, args, info.weight_bytes)))
        except ValueError as exc:  # --ctx past the model's context
            rows.append(("runs here", f"not as asked: {exc}"))
    for key, value in rows:
        print(f"{key + ':':<15}{value}")
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    entry: FoundModel = remove_model(args.model)
    what = "deleted its files" if entry.copied else f"its files stay at {entry.path}"
    print(f"removed {entry.name} from the store ({what})")
    return 0


def add_model_commands(sub: argparse._SubParsersAction) -> None:
    pull = sub.add_parser("pull", help="add a model to the store: the default, a local file or folder, or a "
                          "Hugging Face repo", formatter_class=HelpFormatter)
    pull.add_argument("model", nargs="?", metavar="NAME|PATH|URL",
                      help="smollm2-135m-instruct (the default when omitted), a GGUF / HF folder / edgeinfer "
                           "checkpoint path, or a Hugging Face ORG/REPO[/FILE.gguf] or hf://ORG/REPO[/FILE]")
    pull.add_argument("--name", help="the store name to give it (default: from its file or repo name)")
    pull.add_argument("--copy", action="store_true",
                      help="copy a local model into the store instead of referencing it where it is")
    pull.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    pull.set_defaults(func=cmd_pull)

    lister = sub.add_parser("list", help="the store's models, and those found in the Hugging Face cache, "
                            "ollama's store and llama.cpp's cache", formatter_class=HelpFormatter)
    lister.set_defaults(func=cmd_list)

    show = sub.add_parser("show", help="a model's architecture, size, formats, and whether it runs here",
                          formatter_class=HelpFormatter)
    show.add_argument("model", help="a name from `edgeinfer list`, or a path")
    show.add_argument("--ctx", type=positive_int, default=None, metavar="TOKENS",
                      help=f"the memory figure for this context (default: the model's, at most {DEFAULT_CONTEXT})")
    show.add_argument("--parallel", type=positive_int, default=RuntimeConfig.parallel, metavar="N",
                      help="the memory figure for this many full-length sequences")
    show.add_argument("--kv-dtype", default="auto", choices=("auto", *KV_DTYPES),
                      help="the memory figure for this K and V cache format (auto: fp16)")
    show.set_defaults(func=cmd_show)

    rm = sub.add_parser("rm", help="remove a model from the store (a referenced model's files are kept)",
                        formatter_class=HelpFormatter)
    rm.add_argument("model", help="its store name (`edgeinfer list`)")
    rm.set_defaults(func=cmd_rm)
