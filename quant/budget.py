"""A plan to a memory budget: one precision per linear layer so that weights plus KV fit.

``--budget 1.5GB`` with the server's ``--ctx``, ``--parallel`` and KV dtype: the KV cache for
ctx x parallel tokens is taken off the budget first (worker.kv_pools.bytes_per_token, what
the server's pool will take), the embedding, head and norms as the converter stores them next,
and the linear layers share what is left. Each linear is measured alone against the choices
(int8 per row, int4 g32, g64, g128): its relative output error on calibration text,
``tr(dW H dW^T) / tr(W H W^T)`` with ``H = X^T X`` the Hessian of its real inputs X
(quant.calibrate: the float model's activations, every other layer unquantized, so the figure
is that layer's alone), and its bytes exactly as the quantized tensor stores them. Greedy:
start with every layer at its most accurate choice (choices beaten on both bytes and error are
dropped: a source already on a 4-bit grid keeps g32 exactly, cheaper than int8) and, while the
plan does not fit, move the layer whose next cheaper choice costs the least error increase per
byte saved. What the smallest plan (every linear at its fewest bytes) needs is known from the
shapes and source formats alone (``sizes``: the conversion run on the meta device), so a budget
it misses is refused before the measurement, with the shortfall and those figures. The plan is
printed as a table and stored in the checkpoint's config.json (``edgeinfer_plan``), which the
server checks against the machine at start (edgeinfer.worker.build).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from edgeinfer.config import KV_DTYPES, ModelConfig, RuntimeConfig
from edgeinfer.worker.kv_pools import bytes_per_token
from quant.checkpoint import check_destination
from quant.convert import (
    EMBED,
    LAYER_NAME,
    ConvertOptions,
    ConvertReport,
    Weight,
    convert,
    convert_weight,
    layer_groups,
    target_format,
)
from quant.corpus import CALIB_TEXT
from quant.formats import QuantizedTensor
from quant.sources import Source, open_source
from quant.weight_error import dense

CHOICES: tuple[tuple[str, int | None], ...] = (("int8", None), ("int4", 32), ("int4", 64), ("int4", 128))
MB = 10**6


@dataclass(frozen=True)
class Budget:
    total_bytes: int
    context: int | None  # --ctx; None: the server's default (the model's context, at most DEFAULT_CONTEXT)
    parallel: int  # --parallel
    kv_dtype: str

    def __post_init__(self) -> None:
        if self.total_bytes <= 0 or self.parallel <= 0 or (self.context is not None and self.context <= 0):
            raise ValueError(f"--budget, --ctx and --parallel must be positive, got {self.total_bytes}, "
                             f"{self.context}, {self.parallel}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"--kv-dtype must be one of {KV_DTYPES}, got {self.kv_dtype!r}")

    def for_model(self, config: ModelConfig) -> Budget:
        """With the context the server would serve this model at."""
        return replace(self, context=RuntimeConfig(max_model_len=self.context).context_length(config.max_position))

    def kv_bytes(self, config: ModelConfig) -> int:
        assert self.context is not None, "Budget.for_model resolves the context first"
        return bytes_per_token(config, self.kv_dtype, self.kv_dtype) * self.context * self.parallel


@dataclass(frozen=True)
class LayerChoice:
    name: str
    fmt: str
    group: int | None
    nbytes: int
    error: float  # relative output error on calibration text, this layer alone quantized

    @property
    def precision(self) -> str:
        return self.fmt if self.group is None else f"{self.fmt} g{self.group}"


@dataclass(frozen=True)
class Plan:
    budget: Budget
    fixed_bytes: int  # embedding, head, norms
    kv_bytes: int
    layers: tuple[LayerChoice, ...]

    @property
    def weight_bytes(self) -> int:
        return self.fixed_bytes + sum(c.nbytes for c in self.layers)

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes

    def table(self) -> str:
        rows = [f"{'layer':<44} {'precision':<10} {'bytes':>10} {'error':>10}"]
        rows += [f"{c.name:<44} {c.precision:<10} {c.nbytes:>10,} {c.error:>10.3e}" for c in self.layers]
        b = self.budget
        rows.append(f"weights {self.weight_bytes / MB:,.2f} MB (embedding, head, norms {self.fixed_bytes / MB:,.2f}) "
                    f"+ KV {self.kv_bytes / MB:,.2f} MB ({b.context} tokens x {b.parallel}, {b.kv_dtype}) = "
                    f"{self.total_bytes / MB:,.2f} MB of a {b.total_bytes / MB:,.2f} MB budget")
        return "\n".join(rows)

    def to_dict(self) -> dict[str, Any]:
        """What config.json stores (plain values)."""
        b = self.budget
        return {"budget_bytes": b.total_bytes, "ctx": b.context, "parallel": b.parallel, "kv_dtype": b.kv_dtype,
                "weight_bytes": self.weight_bytes, "kv_bytes": self.kv_bytes,
                "layers": [[c.name, c.precision, c.nbytes, c.error] for c in self.layers]}


def output_error(w: torch.Tensor, q: QuantizedTensor, h: torch.Tensor) -> float:
    """Relative squared output error of ``q`` for ``w`` (N, K) on inputs with Hessian ``h`` (K, K)."""
    h, w = h.double(), w.double()
    d = q.dequantize(torch.float32).double() - w
    return float(((d @ h) * d).sum() / ((w @ h) * w).sum().clamp(min=1e-30))


def undominated(choices: Iterable[LayerChoice]) -> list[LayerChoice]:
    """The choices no other beats on both bytes and error, most bytes first (so error rises
    along the list). A source already on a 4-bit grid makes int4 g32 exact and smaller than
    int8, which re-rounds it: int8 then has no place in the plan."""
    ordered = sorted(choices, key=lambda c: (c.nbytes, c.error))
    kept: list[LayerChoice] = []
    for c in ordered:  # fewest bytes first: keep one only if it is more accurate than all smaller
        if not kept or c.error < kept[-1].error:
            kept.append(c)
    return kept[::-1]


def require_fits(smallest: Plan) -> None:
    """ValueError with the shortfall and the figures if the smallest plan misses its budget."""
    budget = smallest.budget
    if smallest.total_bytes > budget.total_bytes:
        raise ValueError(
            f"--budget {budget.total_bytes / MB:,.2f} MB cannot be met: it is "
            f"{(smallest.total_bytes - budget.total_bytes) / MB:,.2f} MB short of the smallest plan (every linear "
            f"at its fewest bytes): weights {smallest.weight_bytes / MB:,.2f} MB + KV "
            f"{smallest.kv_bytes / MB:,.2f} MB for {budget.context} tokens x {budget.parallel} ({budget.kv_dtype}) "
            f"= {smallest.total_bytes / MB:,.2f} MB; lower --ctx or --parallel, or use --kv-dtype int8")


def stored_bytes(weight: Weight) -> int:
    """Bytes of a weight as the checkpoint stores it."""
    return weight.nbytes if isinstance(weight, QuantizedTensor) else weight.numel() * weight.element_size()


def planned_names(config: ModelConfig) -> set[str]:
    """The linears a plan chooses a precision for (those the calibrator hands to ``measure``)."""
    parts = [part for group in config.spec.linear_parts().values() for part in group]
    return {f"model.layers.{i}.{part}.weight" for i in range(config.num_layers) for part in parts}


def converted_choices(weight: Weight, opts: ConvertOptions) -> dict[tuple[str, int | None], QuantizedTensor]:
    """``weight`` under each of CHOICES as convert stores it with ``opts`` (a source's g32 is
    kept; the compressed-tensors layout re-rounds), by (format, group): the group is the one
    made, g64 where 128 does not divide K, so two choices can be one."""
    converted: dict[tuple[str, int | None], QuantizedTensor] = {}
    for fmt, size in CHOICES:
        q = convert_weight(weight, fmt, size, opts.fp16_scales, opts.ct_layout)
        converted.setdefault((fmt, q.group_size if fmt == "int4" else None), q)
    return converted


def sizes(source: Source, opts: ConvertOptions) -> tuple[dict[str, LayerChoice], int]:
    """Each planned linear at its fewest bytes over CHOICES (its error not measured: nan), and
    the bytes of everything else with ``opts``, as convert stores them, without the measurement:
    the weights are converted on the meta device, so only their shapes and source formats count
    (a source's g32 is kept with its own scales) and no number is computed."""
    planned = planned_names(source.config)
    smallest: dict[str, LayerChoice] = {}
    fixed = 0
    for name in source.names:
        old = source.load(name).to("meta")
        if name not in planned:
            fixed += stored_bytes(convert_weight(old, *target_format(name, len(old.shape), opts), opts.fp16_scales,
                                                 opts.ct_layout))
            continue
        for (fmt, group), q in converted_choices(old, opts).items():
            if name not in smallest or q.nbytes < smallest[name].nbytes:
                smallest[name] = LayerChoice(name, fmt, group, q.nbytes, float("nan"))
    return smallest, fixed


def smallest_plan(source: Source, opts: ConvertOptions, budget: Budget) -> Plan:
    """Every linear at its fewest bytes, from shapes alone (``budget``'s context resolved:
    Budget.for_model); what ``require_fits`` checks before the minutes of measurement."""
    smallest, fixed = sizes(source, opts)
    return Plan(budget, fixed, budget.kv_bytes(source.config), tuple(smallest.values()))


def choose(options: dict[str, list[LayerChoice]], fixed_bytes: int, budget: Budget, config: ModelConfig) -> Plan:
    """Greedy: every layer at its first (most precise) option, then the cheapest error per byte
    saved moves first, until weights + KV fit ``budget``; ValueError with the figures if even
    the last options do not."""
    kv = budget.kv_bytes(config)
    at = dict.fromkeys(options, 0)

    def plan() -> Plan:
        return Plan(budget, fixed_bytes, kv, tuple(options[name][i] for name, i in at.items()))

    require_fits(Plan(budget, fixed_bytes, kv, tuple(opts[-1] for opts in options.values())))
    current = plan()
    while current.total_bytes > budget.total_bytes:
        def cost(name: str) -> float:
            now, nxt = options[name][at[name]], options[name][at[name] + 1]
            return (nxt.error - now.error) / max(1, now.nbytes - nxt.nbytes)

        movable = [name for name in at if at[name] + 1 < len(options[name])]
        at[min(movable, key=cost)] += 1
        current = plan()
    return current


def measure(source: Source, opts: ConvertOptions, calib_tokens: int = 512, calib_seqlen: int = 128,
            log: Callable[[str], None] | None = None) -> dict[str, list[LayerChoice]]:
    """Every planned linear's choices (most bytes first) measured alone on CALIB_TEXT, after the
    embedding as the converter stores it with ``opts``."""
    from quant.calibrate import GPTQCalibrator, calibration_tokens

    tokens = calibration_tokens(source.tokenizer, Path(CALIB_TEXT), calib_tokens, calib_seqlen)
    calibrator = GPTQCalibrator(source.config, tokens)
    calibrator.set_embedding(dense(convert_weight(source.load(EMBED), *target_format(EMBED, 2, opts),
                                                  opts.fp16_scales, opts.ct_layout)))
    options: dict[str, list[LayerChoice]] = {}
    for group in layer_groups(source.names):
        if not (group and LAYER_NAME.match(group[0])):
            continue
        olds = {name: source.load(name) for name in group}
        index = int(LAYER_NAME.match(group[0]).group(1))

        def alone(name: str, h: torch.Tensor, layer: dict[str, Any] = olds) -> torch.Tensor:
            w = dense(layer[name])
            options[name] = undominated(LayerChoice(name, fmt, group, q.nbytes, output_error(w, q, h))
                                        for (fmt, group), q in converted_choices(layer[name], opts).items())
            return w  # the layer runs in float: the next layers' figures are theirs alone

        calibrator.run_layer(index, olds, alone)
        if log:
            log(f"measured layer {index}")
    return options


EXPORTS = ("edgeinfer", "compressed-tensors")  # --format values a plan can be written as


def convert_to_budget(src: str | Path, dst: str | Path, opts: ConvertOptions, budget: Budget,
                      progress: Callable[[int, int, str], None] | None = None,
                      log: Callable[[str], None] | None = None,
                      export: str = "edgeinfer") -> tuple[ConvertReport, Plan]:
    """``edgeinfer quantize --budget``: measure, plan (printed), convert with the plan's precisions
    and store the plan in the checkpoint's config.json; ``export`` "compressed-tensors" plans
    with that layout's rounding (integer zero points, fp16 scale values: what the folder holds)
    and writes the folder, one config group per precision (quant.export_ctensors)."""
    log = log or (lambda line: print(line, file=sys.stderr))
    if export not in EXPORTS:
        raise ValueError(f"--budget writes --format {' or '.join(EXPORTS)}, not {export} (GGUF's Q4_1 and Q8_0 "
                         "hold groups of 32 only: no g64, g128 or per-row int8)")
    write: Callable[..., ConvertReport] = convert
    if export == "compressed-tensors":
        from quant.export_ctensors import check_ct_destination, convert_to_ctensors

        check_ct_destination(dst, opts.force)
        opts, write = replace(opts, ct_layout=True), convert_to_ctensors
    else:
        check_destination(dst, opts.force)  # fail before the measurement
    source = open_source(src)
    budget = budget.for_model(source.config)
    smallest = smallest_plan(source, opts, budget)
    require_fits(smallest)  # before the minutes of measurement
    plan = choose(measure(source, opts), smallest.fixed_bytes, budget, source.config)
    log(plan.table())
    precisions = tuple((c.name, c.fmt, c.group) for c in plan.layers)
    report = write(src, dst, replace(opts, precisions=precisions, plan=json.dumps(plan.to_dict())), progress, log)
    return report, plan
