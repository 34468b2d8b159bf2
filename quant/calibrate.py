"""GPTQ calibration: second-order rounding of each linear weight against its real inputs.

GPTQ (Frantar et al., 2022) quantizes a weight W (N, K) one input column at a time and spreads
each column's rounding error over the columns not yet quantized, weighted by the inverse
Hessian of the layer's reconstruction loss ``||X W^T - X Q^T||^2``, ``H = 2 X^T X / num_tokens``
with X (num_tokens, K) the inputs that linear sees on calibration text. Invariant of the inner
loop: after column j is rounded, the remaining columns j+1.. hold the weights that minimise the
loss given columns 0..j fixed (the optimal-brain-surgeon update, ``err / U[j, j] * U[j, j:]``
with U the upper Cholesky factor of H^-1); updates are applied lazily per block of 128 columns.
Group parameters (int4 scale/min, int8 scale) are computed from the *updated* weights when a
group starts. We use static groups and no activation reordering (act-order), so the stored
layout is exactly the round-to-nearest one and every kernel runs it unchanged.

Inputs come from the model's own forward (``GPTQCalibrator``): edgeinfer.models.llama's
``LlamaLayers.decoder_layer`` runs one layer at a time on ``calibration_tokens`` sequences over
a scratch KV pool, on the reference backend, and its observer hands over each linear's input.
"True sequential" GPTQ: each linear sees the outputs of the already-quantized linears before it,
in the layer too, so a layer runs once per group of linears that share an input (q/k/v, o,
gate/up, down: ArchSpec.linear_parts) and stops at that group's input, the group is
quantized and swapped in, and a last run with every linear quantized gives the next layer's
input. This module knows no layer math: a new architecture in the forward is calibrated as it
runs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from edgeinfer.config import ModelConfig
from edgeinfer.models.llama import LlamaLayers
from edgeinfer.models.tokenizer import Tokenizer
from edgeinfer.models.weights import prepare_layer
from edgeinfer.worker.batch import SeqChunk, build_batch
from edgeinfer.worker.kv_pools import kv_pool
from kernels.dispatch import choose_backend
from quant.formats import QuantizedTensor, pack_int4
from quant.fp16_groups import int4_params_fp16, int8_scale_fp16

Weight = torch.Tensor | QuantizedTensor
GPTQ_BLOCK = 128
GPTQ_DAMP = 0.01  # fraction of the mean Hessian diagonal added for a stable Cholesky
CALIB_BLOCK_SIZE = 16  # KV block size of the scratch pool (any size works; the engine's)


def calibration_tokens(tokenizer: Tokenizer, path: Path, num_tokens: int, seqlen: int) -> torch.Tensor:
    """The first ``num_tokens`` tokens of a text file as (num_tokens // seqlen, seqlen) int64."""
    if not path.is_file():
        raise FileNotFoundError(f"calibration text not found: {path}")
    text = path.read_text(encoding="utf-8", errors="replace")
    num_seqs = num_tokens // seqlen
    ids = tokenizer.encode(text[: num_tokens * 8], add_special=False)
    if len(ids) < num_seqs * seqlen:
        ids = tokenizer.encode(text, add_special=False)
    if len(ids) < num_seqs * seqlen:
        raise ValueError(f"{path} has {len(ids)} tokens; calibration needs {num_seqs * seqlen}")
    return torch.tensor(ids[: num_seqs * seqlen], dtype=torch.int64).view(num_seqs, seqlen)


def hessian(x: torch.Tensor) -> torch.Tensor:
    """2 X^T X / num_tokens in fp64 for inputs x (..., K)."""
    x = x.reshape(-1, x.shape[-1]).double()
    return 2.0 * (x.t() @ x) / x.shape[0]


def _group_params(w: torch.Tensor, fmt: str, fp16_scales: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale (and min) of one group of columns w (N, g), as quant.formats' RTN computes them
    (quant.fp16_groups' when ``fp16_scales``: fp16 values, held in fp32 for the column loop)."""
    if fp16_scales:
        if fmt == "int4":
            scale, lo = int4_params_fp16(w)
            return scale.float(), lo.float()
        return int8_scale_fp16(w).float(), None
    if fmt == "int4":
        lo, hi = w.amin(dim=1), w.amax(dim=1)
        return ((hi - lo) / 15).clamp(min=1e-8), lo
    return (w.abs().amax(dim=1) / 127).clamp(min=1e-8), None


def _round(
    x: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Integer codes and dequantized values of one column x (N,)."""
    if lo is not None:
        q = torch.round((x - lo) / scale).clamp(0, 15)
        return q, q * scale + lo
    q = torch.round(x / scale).clamp(-127, 127)
    return q, q * scale


def gptq_quantize(
    w: torch.Tensor, h: torch.Tensor, fmt: str, group_size: int, damp: float = GPTQ_DAMP, fp16_scales: bool = False
) -> QuantizedTensor:
    """GPTQ-quantize W (N, K) fp32 given the Hessian H (K, K) of its inputs; int4 or int8
    (scales and mins fp16 values, stored as fp16, with ``fp16_scales``)."""
    if fmt not in ("int4", "int8"):
        raise ValueError(f"GPTQ quantizes to int4 or int8, not {fmt}")
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"group size {group_size} does not divide K={k}")
    # The column loop is thousands of tiny ops: intra-op threads only add sync cost (measured on
    # 2 cores: 26 s with 2 threads, 0.5 s with 1 for a 576 x 1536 weight).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _gptq(w, h, fmt, group_size, damp, fp16_scales)
    finally:
        torch.set_num_threads(threads)


def _gptq(w: torch.Tensor, h: torch.Tensor, fmt: str, group_size: int, damp: float,
          fp16_scales: bool) -> QuantizedTensor:
    n, k = w.shape
    w = w.clone().float()
    h = h.clone().double()
    dead = h.diagonal() == 0  # inputs that are always zero: their weights do not matter
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h.diagonal().add_(damp * h.diagonal().mean())
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()
    q = torch.zeros(n, k)
    num_groups = k // group_size
    scales = torch.zeros(n, num_groups)
    mins = torch.zeros(n, num_groups) if fmt == "int4" else None
    scale = lo = None
    for i1 in range(0, k, GPTQ_BLOCK):
        i2 = min(i1 + GPTQ_BLOCK, k)
        block = w[:, i1:i2]  # view: updated in place
        errors = torch.zeros(n, i2 - i1)
        u_block = u[i1:i2, i1:i2]
        for j in range(i2 - i1):
            col = i1 + j
            if col % group_size == 0:
                scale, lo = _group_params(w[:, col : col + group_size], fmt, fp16_scales)
                scales[:, col // group_size] = scale
                if mins is not None:
                    mins[:, col // group_size] = lo
            q[:, col], deq = _round(block[:, j], scale, lo)
            err = (block[:, j] - deq) / u_block[j, j]
            block[:, j:] -= err[:, None] * u_block[j, j:][None, :]
            errors[:, j] = err
        w[:, i2:] -= errors @ u[i1:i2, i2:]
    if fp16_scales:  # exact: they hold fp16 values
        scales, mins = scales.half(), None if mins is None else mins.half()
    if fmt == "int4":
        return QuantizedTensor("int4", (n, k), group_size, pack_int4(q), scales, mins)
    return QuantizedTensor("int8", (n, k), group_size, q.to(torch.int8), scales)


def _dense(weight: Weight) -> torch.Tensor:
    return weight.dequantize(torch.float32) if isinstance(weight, QuantizedTensor) else weight.float()


class GPTQCalibrator:
    """Carries the calibration activations through the model one decoder layer at a time.

    Owns ``hidden`` (num_seqs, seqlen, hidden_size): the residual stream entering the next layer,
    computed with the already-quantized weights. The sequences run one at a time over one
    scratch fp32 pool of ``seqlen`` tokens (each run writes its K/V before attending), so the
    pool is one sequence's, not the whole calibration set's.
    """

    def __init__(self, config: ModelConfig, token_ids: torch.Tensor) -> None:
        seqlen = token_ids.shape[1]
        if seqlen > config.max_position:
            raise ValueError(f"calibration sequences of {seqlen} tokens exceed the model's context of "
                             f"{config.max_position}; choose a smaller --calib-seqlen")
        self.token_ids = token_ids  # (num_seqs, seqlen)
        self.hidden: torch.Tensor | None = None
        self.decoder = LlamaLayers(config, choose_backend("reference"))
        num_blocks = -(-seqlen // CALIB_BLOCK_SIZE)
        self._pool = kv_pool(config, num_blocks, CALIB_BLOCK_SIZE, "fp32", "fp32", self.decoder.device)
        # Every sequence has the same positions, slots and block table, and a layer reads no token
        # ids: one batch serves them all.
        chunk = SeqChunk(tuple(token_ids[0].tolist()), 0, tuple(range(num_blocks)))
        _, self._batch = build_batch([chunk], CALIB_BLOCK_SIZE, self.decoder.device)

    def set_embedding(self, embed: Weight) -> None:
        rows = self.decoder.embed(embed, self.token_ids.flatten())
        self.hidden = rows.view(*self.token_ids.shape, -1)

    @torch.no_grad()
    def run_layer(
        self, index: int, weights: Mapping[str, Weight], quantize: Callable[[str, torch.Tensor], Weight]
    ) -> None:
        """Quantize decoder layer ``index`` and advance ``hidden``.

        ``weights``: the layer's weights by full name ("model.layers.{index}.mlp.up_proj.weight"),
        as in the source. ``quantize(name, H)`` returns the stored weight for the linear ``name``
        given its input Hessian H; it is called in forward order, and the layer then runs with
        what it returned. The norms run as in the source: stored as fp32, they keep its values.
        """
        if self.hidden is None:
            raise RuntimeError("set_embedding must be called before run_layer")
        prefix = f"model.layers.{index}."
        # Dequantized once, not on every run: the values the reference backend runs them with.
        current = {name: _dense(weight) for name, weight in weights.items()}
        for linear, parts in self.decoder.config.spec.linear_parts().items():
            h = hessian(self._run(index, current, watch=linear))
            for part in parts:
                name = f"{prefix}{part}.weight"
                current[name] = _dense(quantize(name, h))
        self.hidden = self._run(index, current)

    @torch.no_grad()
    def layer_inputs(self, index: int, weights: Mapping[str, Weight], linear: str) -> torch.Tensor:
        """The inputs (num_seqs, seqlen, K) of ``linear`` ("qkv", "o", "gate_up", "down") of layer
        ``index`` run with ``weights`` (full names) on the current residual stream (AWQ's search)."""
        return self._run(index, {name: _dense(w) for name, w in weights.items()}, watch=linear)

    @torch.no_grad()
    def advance(self, index: int, weights: Mapping[str, Weight]) -> None:
        """Run layer ``index`` with its final ``weights`` to give the next layer's input (when the
        weights were quantized without Hessians, so ``run_layer`` has nothing to do)."""
        self.hidden = self._run(index, {name: _dense(w) for name, w in weights.items()})

    def _run(self, index: int, weights: Mapping[str, Weight], watch: str | None = None) -> torch.Tensor:
        """Layer ``index`` over every sequence: the inputs of the linear ``watch`` (num_seqs,
        seqlen, K), or the layer's outputs when None."""
        prefix = f"model.layers.{index}."
        layer = prepare_layer(lambda name: weights[prefix + name], self.decoder.backend, self.decoder.config.spec)
        seen: list[torch.Tensor] = []

        def observe(_: int, name: str, x: torch.Tensor) -> None:
            if name == watch:
                seen.append(x)
                raise _Seen

        step = self.decoder.layer_step(self._batch, self._pool, observe if watch else None)
        outputs = []
        for h in self.hidden:
            try:
                outputs.append(self.decoder.decoder_layer(index, layer, h, step))
            except _Seen:
                continue
        return torch.stack(seen if watch else outputs)


class _Seen(Exception):
    """Ends a run of a layer at the input it watches for: the rest of the layer would be thrown
    away (a run for the q/k/v inputs stops after the norm, about halving calibration's forward)."""
