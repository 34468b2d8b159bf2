"""AWQ: activation-aware per-input-channel scales, searched on calibration text and folded away.

AWQ (Lin et al., 2023) protects the weights that meet large activations. For a linear with
inputs X (T, K) and weight W (N, K), ``X W^T = (X / s)(W s)^T`` for any per-channel s > 0;
quantizing ``W s`` instead of W rounds the columns with large s on a finer relative grid. The
scale is ``s = mean|x|^alpha`` (normalised so sqrt(max s * min s) = 1), alpha on a grid in [0, 1)
chosen per group of linears to minimise ``||X W^T - (X / s) Q(W s)^T||^2`` on the calibration
inputs; alpha = 0 is round-to-nearest, so the chosen scale never does worse there.

The 1 / s on the inputs costs nothing at run time: it is folded into what produces them:
- q/k/v (and Phi-3's fused qkv): the input norm, whose weight is applied as ``w + norm_offset``
  (Gemma's HF ``1 + w``: the stored weight becomes ``(offset + w) / s - offset``);
- gate/up: the norm before the MLP (``post_norm``: Gemma's pre_feedforward_layernorm);
- o: v's output rows (and v's bias), as attention is linear in V per channel. With GQA a KV
  head feeds several query heads, so o's channels of the heads sharing one KV head get one scale
  (their mean|x| is averaged before the search);
- down: up's rows (``act(gate) * up`` is linear in up), the second half of a fused gate_up.
In exact arithmetic the scaled model is the original one; in fp32 the logits agree to ~1e-6.

Inputs come from the model's own forward through quant.calibrate's ``GPTQCalibrator`` (a layer
run that stops at the watched linear's input); the four groups are scaled in forward order, each
searched on the inputs of the layer with the groups before it already scaled (not quantized).
Quantization afterwards is round-to-nearest or GPTQ on the scaled weights (``awq+gptq``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from edgeinfer.config import ModelConfig
from quant.formats import QuantizedTensor
from quant.weight_error import dense

Weight = torch.Tensor | QuantizedTensor
FakeQuant = Callable[[torch.Tensor], torch.Tensor]  # W (N, K) -> the values its quantized form holds
AWQ_GRID = 20  # alphas 0, 0.05, ..., 0.95, as the AWQ paper's code searches
AWQ_TOKENS = 2048  # calibration inputs the search scores (evenly spaced), to bound its matmuls
LinearInputs = Callable[[Mapping[str, torch.Tensor], str], torch.Tensor]


def activation_scale(x: torch.Tensor) -> torch.Tensor:
    """mean |x| per input channel of inputs x (..., K) -> (K,)."""
    return x.reshape(-1, x.shape[-1]).abs().float().mean(dim=0)


def output_error(w: torch.Tensor, x: torch.Tensor, s: torch.Tensor, fake_quant: FakeQuant) -> float:
    """Mean squared error of the linear's outputs on x (T, K) when W is stored as Q(W s) / s."""
    q = fake_quant(w * s) / s
    return float(((x @ (w - q).t()) ** 2).mean())


def search_scale(
    w: torch.Tensor, x: torch.Tensor, x_mean: torch.Tensor, fake_quant: FakeQuant, grid: int = AWQ_GRID
) -> tuple[torch.Tensor, float, float]:
    """The best s (K,) for W (N, K) on inputs x (T, K) whose channel magnitudes are x_mean (K,);
    returns (s, its output error, round-to-nearest's output error)."""
    x_mean = x_mean.clamp(min=1e-4)  # a dead channel must not make s zero or infinite
    best_s, best_err, rtn_err = torch.ones_like(x_mean), float("inf"), float("inf")
    for i in range(grid):
        alpha = i / grid
        s = x_mean.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        err = output_error(w, x, s, fake_quant)
        if i == 0:
            rtn_err = err
        if err < best_err:
            best_s, best_err = s, err
    return best_s, best_err, rtn_err


def _rows(config: ModelConfig) -> dict[str, slice]:
    """Where v sits in a fused qkv_proj and up in a fused gate_up_proj (rows)."""
    q = config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    return {"v": slice(q + kv, q + 2 * kv), "up": slice(config.intermediate_size, 2 * config.intermediate_size)}


def _kv_channels(config: ModelConfig, x: torch.Tensor) -> torch.Tensor:
    """o's per-channel values x (Hq * D,) averaged over the query heads sharing a KV head, so the
    scale can be folded into v's rows (Hkv * D): (Hkv * D,)."""
    group = config.num_heads // config.num_kv_heads
    return x.view(config.num_kv_heads, group, config.head_dim).mean(dim=1).reshape(-1)


def _to_o_channels(config: ModelConfig, s_kv: torch.Tensor) -> torch.Tensor:
    """A per-V-channel scale (Hkv * D,) on o's input channels (Hq * D,): head h reads KV head h // group."""
    group = config.num_heads // config.num_kv_heads
    return s_kv.view(config.num_kv_heads, 1, config.head_dim).expand(-1, group, -1).reshape(-1)


def fold_scale(weights: dict[str, torch.Tensor], config: ModelConfig, index: int, linear: str,
               s: torch.Tensor) -> None:
    """Scale the inputs of ``linear`` ("qkv", "o", "gate_up", "down") of layer ``index`` by 1 / s
    and its weight columns by s, in place in ``weights`` (dense fp32, full names). For "o", s is
    per V channel (Hkv * D,); the others take s over the linear's K."""
    spec = config.spec
    prefix = f"model.layers.{index}."
    parts = spec.linear_parts()
    column_scale = _to_o_channels(config, s) if linear == "o" else s
    for part in parts[linear]:
        weights[f"{prefix}{part}.weight"] = weights[f"{prefix}{part}.weight"] * column_scale
    if linear in ("qkv", "gate_up"):
        norm = f"{prefix}{spec.norm_names()['input_norm' if linear == 'qkv' else 'post_norm']}.weight"
        offset = spec.norm_offset
        weights[norm] = (weights[norm] + offset) / s - offset
        return
    # o: v's rows (and bias); down: up's rows. A fused tensor holds them at _rows' slice.
    source, rows = ("qkv", "v") if linear == "o" else ("gate_up", "up")
    fused = len(parts[source]) == 1
    part = parts[source][0] if fused else parts[source][-1]  # v_proj / up_proj come last
    suffixes = (".weight", ".bias") if linear == "o" and spec.qkv_bias else (".weight",)
    for suffix in suffixes:
        name = f"{prefix}{part}{suffix}"
        t = weights[name].clone()
        target = t[_rows(config)[rows]] if fused else t
        target /= s.view(-1, *([1] * (t.dim() - 1)))  # target is a view: t changes
        weights[name] = t


def scale_layer(
    config: ModelConfig,
    index: int,
    weights: Mapping[str, Weight],
    linear_inputs: LinearInputs,
    fake_quant: Callable[[torch.Tensor, str], torch.Tensor],
    log: Callable[[str], None] | None = None,
) -> dict[str, torch.Tensor]:
    """AWQ-scale decoder layer ``index``: the layer's weights (full names, as in the source) ->
    the scaled ones, dense fp32. ``linear_inputs(weights, linear)`` runs the layer with
    ``weights`` and returns the inputs of ``linear`` (num_seqs, seqlen, K);
    ``fake_quant(w, name)`` is the quantizer the weight ``name`` will get, as dense values."""
    current = {name: dense(w) for name, w in weights.items()}
    prefix = f"model.layers.{index}."
    for linear, parts in config.spec.linear_parts().items():
        x = linear_inputs(current, linear)
        x = x.reshape(-1, x.shape[-1]).float()
        step = max(1, x.shape[0] // AWQ_TOKENS)
        x = x[::step][:AWQ_TOKENS]
        names = [f"{prefix}{part}.weight" for part in parts]
        w = torch.cat([current[name] for name in names])
        x_mean = activation_scale(x)
        if linear == "o":  # one scale per V channel, shared by the query heads reading it
            x_mean = _to_o_channels(config, _kv_channels(config, x_mean))

        def quantized(scaled: torch.Tensor, names: list[str] = names) -> torch.Tensor:
            # Each part keeps its own quantizer (the same for all linears today, but K-dependent
            # group fallbacks are per weight); rows of the concatenation split back per part.
            sizes = [current[name].shape[0] for name in names]
            return torch.cat([fake_quant(piece, name) for piece, name in zip(scaled.split(sizes), names, strict=True)])

        s, err, rtn = search_scale(w, x, x_mean, quantized)
        if log is not None:
            log(f"awq layer {index} {linear:<8} output error {err:.3e} (round-to-nearest {rtn:.3e})")
        fold_scale(current, config, index, linear, _kv_channels(config, s) if linear == "o" else s)
    return current
