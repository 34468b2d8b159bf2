"""The bytes a GGUF's linear weights take once prepared for the CPU kernels, per GGUF tensor type,
against the file's bytes of those tensors (issue #21's bar: at most 1.1x for Q4_K and Q8_0).

Loads the model as `edgeinfer serve` would (the CPU path, --cpu-activations as given), then walks
its prepared layers: each linear's kernel bytes (codes, scales, mins, code sums) are charged to
the GGUF types of the tensors it was made of (a fused QKV or gate/up of one type to that type;
of several types, as "mixed"). The head's int4 copy, norms and the embedding's rows are not
linears and are listed apart.

    python tools/weight_bytes.py FILE.gguf [--cpu-activations auto]
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from edgeinfer.config import RuntimeConfig  # noqa: E402
from edgeinfer.models.loader import load_model  # noqa: E402
from edgeinfer.worker.build import build_model  # noqa: E402

GGUF_PARTS = {"qkv": ("attn_q", "attn_k", "attn_v"), "v": ("attn_v",), "o": ("attn_output",),
              "gate_up": ("ffn_gate", "ffn_up"), "down": ("ffn_down",)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path)
    parser.add_argument("--cpu-activations", default="auto")
    args = parser.parse_args()
    import gguf

    reader = gguf.GGUFReader(str(args.model))
    types = {t.name: (t.tensor_type.name, int(t.n_bytes)) for t in reader.tensors}
    model = build_model(load_model(args.model), RuntimeConfig(cpu_activations=args.cpu_activations),
                        take_weights=True)
    ours: collections.Counter[str] = collections.Counter()
    file: collections.Counter[str] = collections.Counter()
    for i, layer in enumerate(model.weights.layers):
        for role in ("qkv", "v", "o", "gate_up", "down"):
            linear = getattr(layer, role)
            if linear is None:
                continue
            names = [f"blk.{i}.{part}.weight" for part in GGUF_PARTS[role]]
            if role == "qkv" and layer.v is not None:
                names = names[:2]
            kinds = {types[name][0] for name in names}
            kind = kinds.pop() if len(kinds) == 1 else "mixed"
            ours[kind] += linear.nbytes
            file[kind] += sum(types[name][1] for name in names)
    print(f"{args.model.name}: linear weights per GGUF type, prepared ({model.linear_path}) against the file")
    print("| type | prepared MB | file MB | ratio |")
    print("|---|---|---|---|")
    for kind in sorted(ours):
        print(f"| {kind} | {ours[kind] / 1e6:.1f} | {file[kind] / 1e6:.1f} | {ours[kind] / file[kind]:.3f} |")
    total, total_file = sum(ours.values()), sum(file.values())
    print(f"| all linears | {total / 1e6:.1f} | {total_file / 1e6:.1f} | {total / total_file:.3f} |")
    print(f"head for the forward: {model.weights.head.nbytes / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
