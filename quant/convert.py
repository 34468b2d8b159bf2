"""The conversion tool: a GGUF file or HF-style folder in, an edgeinfer checkpoint out, streamed.

Which format each weight gets (``target_format``):

- names matching a ``--skip`` pattern (fnmatch) are copied in the source's own format;
- 1-D weights (norms) are fp32;
- the token embedding and lm_head (which *is* the embedding when tied, a quarter of the default
  model's bytes and the most sensitive matrix) are int8 group 32 for the int8/int4/nf4 targets
  and fp16/bf16 for those targets;
- every other 2-D weight (the attention and MLP projections) gets ``--weights`` and its group
  size (int4: 32, nf4: 64, int8: one scale per output row, unless ``--group-size``); where
  the group does not divide K, the largest smaller one that does (said before the conversion
  starts, and per weight in the report). A source already in 4 bits or fewer is converted with a
  note that a second rounding costs quality.

A weight already in its target format (GGUF Q4_0/Q4_1 -> int4 g32, Q8_0 -> int8 g32) is copied
bit for bit; anything else is dequantized to fp32 and quantized again, round-to-nearest, or with
GPTQ (quant.calibrate) when ``--calibrate gptq``; ``awq`` first scales each layer's input
channels (quant.awq, folded into the norms and linears before them), then rounds to nearest,
and ``awq+gptq`` runs GPTQ on the scaled weights. The source is read one tensor at a time (GGUF
memory-mapped, safetensors through safe_open) and handed to quant.checkpoint's streaming
writer, so peak memory is about one layer (calibration: one layer plus its activations and a
KV pool of one calibration sequence).
"""

from __future__ import annotations

import fnmatch
import json
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from quant.checkpoint import check_destination, save_checkpoint
from quant.corpus import CALIB_TEXT
from quant.formats import GROUP_SIZES, QuantizedTensor, quantize_int4, quantize_int8
from quant.gguf_import import ModelFileError
from quant.nf4 import quantize_nf4
from quant.sources import Source, open_source
from quant.weight_error import dense, relative_error

Weight = torch.Tensor | QuantizedTensor
WEIGHT_FORMATS = ("int8", "int4", "nf4", "fp16", "bf16")
CALIBRATION_METHODS = ("gptq", "awq", "awq+gptq")
EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
DEFAULT_GROUP = {"int4": 32, "nf4": 64, "int8": None}
_PLAIN = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class ConvertOptions:
    weights: str
    group_size: int | None = None  # None: the format's default (DEFAULT_GROUP)
    calibrate: str | None = None
    calib_data: str | None = None  # None: quant.corpus.CALIB_TEXT
    calib_tokens: int = 4096
    calib_seqlen: int = 512
    skip: tuple[str, ...] = ()
    force: bool = False
    verbose: bool = False
    fp16_scales: bool = False  # int4/int8 scales and mins as fp16 values (GGUF export: exact Q4_1 / Q8_0)
    ct_layout: bool = False  # compressed-tensors export: int4 integer zero points, fp16 plain tensors (exact)
    precisions: tuple[tuple[str, str, int | None], ...] = ()  # (name, format, group) per linear: a budget plan
    plan: str = ""  # the budget plan as JSON, stored in config.json as "edgeinfer_plan" (quant.budget)

    def __post_init__(self) -> None:
        if self.weights not in WEIGHT_FORMATS:
            raise ValueError(f"--weights must be one of {WEIGHT_FORMATS}, got {self.weights!r}")
        if self.group_size is not None and self.group_size not in GROUP_SIZES:
            raise ValueError(f"--group-size must be one of {GROUP_SIZES}, got {self.group_size}")
        if self.group_size is not None and self.weights in ("fp16", "bf16"):
            raise ValueError(f"--group-size does not apply to --weights {self.weights}")
        if self.calibrate is not None:
            if self.calibrate not in CALIBRATION_METHODS:
                raise ValueError(f"--calibrate must be one of {CALIBRATION_METHODS}, got {self.calibrate!r}")
            if self.weights not in ("int4", "int8"):
                raise ValueError(f"--calibrate {self.calibrate} quantizes to int4 or int8, not {self.weights}")
            if self.calibrate.startswith("awq") and self.weights != "int4":
                raise ValueError(f"--calibrate {self.calibrate} scales for int4 groups; got --weights {self.weights}")
        if self.calib_tokens < self.calib_seqlen or self.calib_seqlen < 16:
            raise ValueError(
                f"need calib_tokens ({self.calib_tokens}) >= calib_seqlen ({self.calib_seqlen}) >= 16"
            )
        object.__setattr__(self, "skip", tuple(self.skip))

    @property
    def linear_group_size(self) -> int | None:
        return self.group_size if self.group_size is not None else DEFAULT_GROUP.get(self.weights)


@dataclass
class ConvertReport:
    dst: Path
    errors: dict[str, float] = field(default_factory=dict)  # relative Frobenius error per weight
    formats: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0


def target_format(name: str, ndim: int, opts: ConvertOptions) -> tuple[str, int | None]:
    """(format, group size) for one weight; "keep" copies the source format. See module docstring."""
    if any(fnmatch.fnmatchcase(name, pattern) for pattern in opts.skip):
        return "keep", None
    for planned, fmt, group in opts.precisions:
        if planned == name:
            return fmt, group
    if opts.ct_layout and (ndim != 2 or name in (EMBED, LM_HEAD)):
        return "fp16", None  # what vLLM runs in fp16: the same numbers
    if ndim != 2:
        return "fp32", None
    if name in (EMBED, LM_HEAD):
        return (opts.weights, None) if opts.weights in _PLAIN else ("int8", 32)
    return opts.weights, opts.linear_group_size


def preflight_notes(source: Source, opts: ConvertOptions) -> list[str]:
    """What the user should know before the slow part: a --group-size that some weights cannot
    take (they get the largest smaller group that divides their K), and a source already stored
    in 4 bits or fewer, which another rounding makes worse than quantizing the original weights."""
    notes = []
    group = opts.linear_group_size
    if opts.weights not in _PLAIN and group is not None:
        fallbacks: dict[tuple[int, int], list[str]] = {}
        for part, (_, k) in source.config.linear_shapes().items():
            if effective_group(group, k) != group:
                fallbacks.setdefault((k, effective_group(group, k)), []).append(part)
        for (k, used), parts in fallbacks.items():
            notes.append(f"--group-size {group} does not divide K={k} of {', '.join(parts)}: those use g{used}")
    keeps = opts.weights == "int4" and group == 32 and set(source.four_bit) <= {"Q4_0", "Q4_1"}
    if source.four_bit and not keeps:
        target = opts.weights + (f" g{group}" if group and opts.weights not in _PLAIN else "")
        notes.append(f"{source.path.name} is already quantized ({', '.join(source.four_bit)}): {target} rounds "
                     "those weights a second time (the default model's Q4_1 as int4 g128: perplexity 67.35 "
                     "against 46.58); quantize the original weights instead where you have them")
    return notes


def effective_group(group_size: int | None, k: int) -> int:
    """``group_size`` if it divides K, else the largest smaller allowed group that does (the default
    model's K=576 takes g64 where g128 was asked); None means one group per row."""
    if group_size is None:
        return k
    for group in sorted((g for g in GROUP_SIZES if g <= group_size), reverse=True):
        if k % group == 0:
            return group
    raise ModelFileError(f"no group size <= {group_size} divides K={k}; choose another --group-size")


def convert_weight(weight: Weight, fmt: str, group_size: int | None, fp16_scales: bool = False,
                   zero_points: bool = False) -> Weight:
    """Round-to-nearest conversion; a weight already in (fmt, group_size) is returned unchanged
    (with ``fp16_scales`` only if its scales are fp16). ``fp16_scales``: see quant.fp16_groups;
    ``zero_points`` (compressed-tensors export): int4 with an integer zero point and fp16 scale
    values, int8 with fp16 scales (quant.ctensors_codes), always re-rounded."""
    if fmt == "keep":
        return weight
    if fmt in _PLAIN:
        if not isinstance(weight, QuantizedTensor) and weight.dtype == _PLAIN[fmt]:
            return weight
        return dense(weight).to(_PLAIN[fmt])
    group = effective_group(group_size, weight.shape[1])
    if isinstance(weight, QuantizedTensor) and weight.format == fmt and weight.group_size == group and (
            not fp16_scales or weight.scales.dtype == torch.float16) and not zero_points:
        return weight
    w = dense(weight)
    if fmt == "int4" and zero_points:
        from quant.ctensors_codes import quantize_int4_zp

        return quantize_int4_zp(w, group)
    fp16_scales = fp16_scales or zero_points
    if fmt in ("int4", "int8") and fp16_scales:
        from quant.fp16_groups import quantize_int4_fp16, quantize_int8_fp16

        return (quantize_int4_fp16 if fmt == "int4" else quantize_int8_fp16)(w, group)
    if fmt == "int4":
        return quantize_int4(w, group)
    if fmt == "int8":
        return quantize_int8(w, group)
    return quantize_nf4(w, group)


def layer_groups(names: list[str]) -> list[list[str]]:
    """Names grouped: [embedding], layer 0, layer 1, ..., [everything else] (calibration order)."""
    layers: dict[int, list[str]] = {}
    rest = []
    for name in names:
        m = LAYER_NAME.match(name)
        if m:
            layers.setdefault(int(m.group(1)), []).append(name)
        elif name != EMBED:
            rest.append(name)
    return [[EMBED]] + [layers[i] for i in sorted(layers)] + [rest]


def convert(
    src: str | Path,
    dst: str | Path,
    opts: ConvertOptions,
    progress: Callable[[int, int, str], None] | None = None,
    log: Callable[[str], None] | None = None,
) -> ConvertReport:
    """Convert SRC into the checkpoint folder DST; returns the per-weight errors. ``progress``
    is told (weights done, total, the last one's name) after each weight."""
    start = time.perf_counter()
    log = log or (lambda line: print(line, file=sys.stderr))
    check_destination(dst, opts.force)  # fail before the slow part
    source = open_source(src)
    for note in preflight_notes(source, opts):
        log(f"note: {note}")
    report = ConvertReport(Path(dst).absolute())
    calibrator = None
    if opts.calibrate:
        from quant.calibrate import GPTQCalibrator, calibration_tokens

        tokens = calibration_tokens(
            source.tokenizer, Path(opts.calib_data or CALIB_TEXT), opts.calib_tokens, opts.calib_seqlen
        )
        calibrator = GPTQCalibrator(source.config, tokens)
    total = len(source.names)

    def emit(name: str, new: Weight, old: Weight) -> tuple[str, Weight]:
        report.errors[name] = relative_error(new, old)
        fmt = new.format if isinstance(new, QuantizedTensor) else str(new.dtype).removeprefix("torch.")
        group = f" g{new.group_size}" if isinstance(new, QuantizedTensor) else ""
        report.formats[name] = fmt + group
        if progress:
            progress(len(report.errors), total, name)
        if opts.verbose:
            log(f"{name:<48} {fmt + group:<12} rel_err {report.errors[name]:.3e}")
        return name, new

    def stream() -> Iterator[tuple[str, Weight]]:
        for group in layer_groups(source.names):
            if calibrator is not None and group and LAYER_NAME.match(group[0]):
                yield from _calibrated_layer(group, source, opts, calibrator, emit, log)
                continue
            for name in group:
                old = source.load(name)
                new = convert_weight(
                    old, *target_format(name, old.dim() if isinstance(old, torch.Tensor) else 2, opts),
                    opts.fp16_scales, opts.ct_layout)
                if calibrator is not None and name == EMBED:
                    calibrator.set_embedding(dense(new))
                yield emit(name, new, old)

    save_checkpoint(dst, source.config, source.tokenizer, stream(), source.names, force=opts.force,
                    extra_config={"edgeinfer_plan": json.loads(opts.plan)} if opts.plan else None)
    report.seconds = time.perf_counter() - start
    errors = [e for n, e in report.errors.items() if report.formats[n] not in ("float32",)]
    if errors:
        log(
            f"converted {total} weights in {report.seconds:.1f} s; relative error mean "
            f"{sum(errors) / len(errors):.3e}, max {max(errors):.3e}"
        )
    return report


def _calibrated_layer(
    names: list[str],
    source: Source,
    opts: ConvertOptions,
    calibrator: Any,
    emit: Callable[[str, Weight, Weight], tuple[str, Weight]],
    log: Callable[[str], None],
) -> Iterator[tuple[str, Weight]]:
    from quant.calibrate import gptq_quantize

    index = int(LAYER_NAME.match(names[0]).group(1))
    olds = {name: source.load(name) for name in names}
    if opts.calibrate.startswith("awq"):
        from quant.awq import scale_layer

        # The errors reported are then against the scaled weights, which the checkpoint holds.
        olds = scale_layer(source.config, index, olds, lambda w, linear: calibrator.layer_inputs(index, w, linear),
                           lambda w, name: dense(convert_weight(w, *target_format(name, 2, opts), opts.fp16_scales,
                                                                opts.ct_layout)),
                           log if opts.verbose else None)
    news: dict[str, Weight] = {}

    def quantize(name: str, hessian: torch.Tensor | None) -> Weight:
        old = olds[name]
        fmt, group = target_format(name, old.dim() if isinstance(old, torch.Tensor) else 2, opts)
        if hessian is None or fmt not in ("int4", "int8"):
            news[name] = convert_weight(old, fmt, group, opts.fp16_scales, opts.ct_layout)
        else:
            news[name] = gptq_quantize(dense(old), hessian, fmt, effective_group(group, old.shape[1]),
                                       fp16_scales=opts.fp16_scales)
        return news[name]

    if opts.calibrate.endswith("gptq"):
        calibrator.run_layer(index, olds, quantize)
    for name in names:
        if name not in news:
            quantize(name, None)
    if not opts.calibrate.endswith("gptq"):
        calibrator.advance(index, news)
    for name in names:
        yield emit(name, news[name], olds[name])
