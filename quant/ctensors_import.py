"""compressed-tensors import: a pack-quantized HF folder's int4/int8 layers as QuantizedTensors.

Many quantized models on the hub are published this way (llm-compressor's W4A16 / W8A16
presets): ``config.json`` carries ``quantization_config`` with ``quant_method``
"compressed-tensors", format "pack-quantized", and config groups whose ``targets`` (exact
module names, ``re:`` regexes or the class name ``Linear``) give each layer's bits, group
size and symmetry (several groups: mixed precisions, such as a ``--budget`` plan's; the most
specific target wins, as in the library). A layer ``M`` is stored as ``M.weight_packed`` (int32), ``M.weight_scale``,
``M.weight_shape`` and, asymmetric, ``M.weight_zero_point`` (packed along N). The codes are
unpacked with the library's own ``unpack_from_int32`` and mapped by quant.ctensors_codes onto the
engine's int4/int8 without loss. Refused by name: other formats (float, naive, sparse), a
per-tensor or activation-ordered (``g_idx``) scheme, bit widths other than 4 and 8.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

from quant.ctensors_codes import Codes, from_codes
from quant.formats import QuantizedTensor
from quant.gguf_arch import ModelFileError

METHOD = "compressed-tensors"
PARTS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")


def is_ctensors(qcfg: dict[str, Any]) -> bool:
    return qcfg.get("quant_method") == METHOD


def _specificity(target: str, module: str) -> int | None:
    """How closely ``target`` names ``module``: 0 its exact name, 1 a ``re:`` regex that matches
    it, 2 the class name Linear; None: no match."""
    if target.startswith("re:"):
        return 1 if re.match(target[3:], module) is not None else None
    return 0 if target == module else 2 if target == "Linear" else None


def _scheme(qcfg: dict[str, Any], module: str, where: str) -> dict[str, Any]:
    """The weights' QuantizationArgs (as a dict) of the config group that targets ``module``;
    where several do, the most specific target wins (exact name, then regex, then Linear), as
    compressed-tensors' own ``match_targets`` orders them, so mixed-precision folders (a budget
    plan's, or a default scheme with per-layer exceptions) read each layer with its own group."""
    matches = []
    for order, (name, group) in enumerate((qcfg.get("config_groups") or {}).items()):
        found = [k for k in (_specificity(t, module) for t in group.get("targets", ())) if k is not None]
        if found:
            matches.append((min(found), order, name, group))
    if not matches:
        raise ModelFileError(f"{where}: {module} has packed weights but no config group targets it")
    _, _, name, group = min(matches, key=lambda m: m[:2])
    fmt = group.get("format") or qcfg.get("format")
    args = group.get("weights") or {}
    why = None
    if fmt != "pack-quantized":
        why = f"format {fmt!r} (edgeinfer imports pack-quantized)"
    elif args.get("type", "int") != "int" or args.get("num_bits") not in (4, 8):
        why = f"{args.get('type')} {args.get('num_bits')}-bit weights (edgeinfer runs int4 and int8)"
    elif args.get("strategy") not in ("group", "channel"):
        why = f"strategy {args.get('strategy')!r} (edgeinfer imports group and channel scales)"
    elif args.get("actorder") not in (None, False, "weight", "static"):
        why = f"actorder {args.get('actorder')!r} (a permuted group order edgeinfer's kernels do not read)"
    if why:
        raise ModelFileError(f"{where}: {module} ({name}) is quantized with {why}")
    return args


def ct_weight(qcfg: dict[str, Any], module: str, get: Callable[[str], torch.Tensor],
              has: Callable[[str], bool], where: str) -> QuantizedTensor:
    """Module ``module``'s weight (its ``weight_*`` tensors read through ``get``) as int4/int8."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    args = _scheme(qcfg, module, where)
    bits = int(args["num_bits"])
    shape = torch.Size(int(d) for d in get(f"{module}.weight_shape").tolist())
    scale = get(f"{module}.weight_scale")
    if scale.dim() != 2 or shape[1] % scale.shape[1]:
        raise ModelFileError(f"{where}: {module}.weight_scale of shape {list(scale.shape)} does not fit {list(shape)}")
    zero = None
    if not args.get("symmetric", True):
        if not has(f"{module}.weight_zero_point"):
            raise ModelFileError(f"{where}: {module} is asymmetric but has no weight_zero_point")
        zero = unpack_from_int32(get(f"{module}.weight_zero_point"), bits, scale.shape, packed_dim=0)
    codes = unpack_from_int32(get(f"{module}.weight_packed"), bits, shape)
    return from_codes(Codes(bits, shape[1] // scale.shape[1], codes, scale, zero))


def module_names(keys: list[str]) -> list[str]:
    """The modules stored packed: ``M`` for every ``M.weight_packed``."""
    return [key.removesuffix(".weight_packed") for key in keys if key.endswith(".weight_packed")]


def is_part(key: str) -> bool:
    return key.rsplit(".", 1)[-1] in PARTS
