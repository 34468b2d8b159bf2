"""Write the first few layers of a model as an edgeinfer checkpoint small enough to travel.

The default GGUF (98 MB) is over the 64 MiB a GPU call can carry; its first 4 layers plus the
embedding (tied head) and final norm come to about 40 MB. Tensors keep their imported formats
(GGUF Q4_1 -> int4 g32, Q8_0 -> int8 g32, fp32 norms) bit for bit: the slice is the real model
truncated, not re-quantized, so the CPU and GPU paths can be compared on real weights.

    python tools/make_slice.py [--model PATH] [--layers 4] [--out build/gpu/slice] [--force]
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from edgeinfer.models.loader import LoadedModel  # noqa: E402

DEFAULT_OUT = "build/gpu/slice"
DEFAULT_LAYERS = 4
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def slice_model(loaded: LoadedModel, num_layers: int) -> LoadedModel:
    """The first ``num_layers`` layers of ``loaded`` with its embedding, final norm and head;
    the weight objects are shared, not copied."""
    if not 0 < num_layers <= loaded.config.num_layers:
        raise ValueError(f"num_layers must be in 1..{loaded.config.num_layers}, got {num_layers}")
    weights = {}
    for name, weight in loaded.weights.items():
        match = _LAYER.match(name)
        if match is None or int(match.group(1)) < num_layers:
            weights[name] = weight
    return LoadedModel(replace(loaded.config, num_layers=num_layers), weights, loaded.tokenizer, loaded.source)


def write_slice(model_path: str | Path, num_layers: int, out: str | Path, force: bool = False) -> Path:
    """Load ``model_path``, slice it and save it atomically as an edgeinfer checkpoint at ``out``."""
    from edgeinfer.models.loader import load_model
    from quant.checkpoint import save_checkpoint

    sliced = slice_model(load_model(model_path), num_layers)
    names = sorted(sliced.weights)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    return save_checkpoint(out, sliced.config, sliced.tokenizer, ((n, sliced.weights[n]) for n in names), names,
                           force=force)


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main(argv: list[str] | None = None) -> int:
    from edgeinfer.models.pull import default_model_path

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="source model (default: the cached default GGUF)")
    parser.add_argument("--layers", type=int, default=DEFAULT_LAYERS, help="layers to keep, from the first")
    parser.add_argument("--out", default=DEFAULT_OUT, help="checkpoint folder to write")
    parser.add_argument("--force", action="store_true", help="replace an existing checkpoint")
    args = parser.parse_args(argv)
    model = Path(args.model) if args.model else default_model_path()
    out = write_slice(model, args.layers, args.out, force=args.force)
    size = folder_bytes(out)
    print(f"wrote {out}: {args.layers} layers of {model.name}, {size / 2**20:.1f} MiB")
    if size >= 64 * 2**20:
        print("warning: 64 MiB or more: too big to carry to a GPU machine", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
