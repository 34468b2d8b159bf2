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

Inputs come from running the model layer by layer in plain torch (``GPTQCalibrator``) on
``calibration_tokens`` sequences: "true sequential" GPTQ, each linear sees the outputs of the
already-quantized linears before it. The decoder-layer math mirrors edgeinfer.models.llama
(rotate-half RoPE, GQA, RMSNorm; a test checks the logits agree).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from edgeinfer.config import ModelConfig
from edgeinfer.models.tokenizer import Tokenizer
from quant.formats import QuantizedTensor, pack_int4

Weight = torch.Tensor | QuantizedTensor
GPTQ_BLOCK = 128
GPTQ_DAMP = 0.01  # fraction of the mean Hessian diagonal added for a stable Cholesky


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


def _group_params(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale (and min) of one group of columns w (N, g), as quant.formats' RTN computes them."""
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
    w: torch.Tensor, h: torch.Tensor, fmt: str, group_size: int, damp: float = GPTQ_DAMP
) -> QuantizedTensor:
    """GPTQ-quantize W (N, K) fp32 given the Hessian H (K, K) of its inputs; int4 or int8."""
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
        return _gptq(w, h, fmt, group_size, damp)
    finally:
        torch.set_num_threads(threads)


def _gptq(w: torch.Tensor, h: torch.Tensor, fmt: str, group_size: int, damp: float) -> QuantizedTensor:
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
                scale, lo = _group_params(w[:, col : col + group_size], fmt)
                scales[:, col // group_size] = scale
                if mins is not None:
                    mins[:, col // group_size] = lo
            q[:, col], deq = _round(block[:, j], scale, lo)
            err = (block[:, j] - deq) / u_block[j, j]
            block[:, j:] -= err[:, None] * u_block[j, j:][None, :]
            errors[:, j] = err
        w[:, i2:] -= errors @ u[i1:i2, i2:]
    if fmt == "int4":
        return QuantizedTensor("int4", (n, k), group_size, pack_int4(q), scales, mins)
    return QuantizedTensor("int8", (n, k), group_size, q.to(torch.int8), scales)


def _dense(weight: Weight) -> torch.Tensor:
    return weight.dequantize(torch.float32) if isinstance(weight, QuantizedTensor) else weight.float()


class GPTQCalibrator:
    """Carries the calibration activations through the model one decoder layer at a time.

    Owns ``hidden`` (num_seqs, seqlen, hidden_size): the residual stream entering the next layer,
    computed with the already-quantized weights.
    """

    def __init__(self, config: ModelConfig, token_ids: torch.Tensor) -> None:
        self.config = config
        self.token_ids = token_ids  # (num_seqs, seqlen)
        self.hidden: torch.Tensor | None = None
        d = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        freqs = torch.outer(torch.arange(token_ids.shape[1], dtype=torch.float64), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # (seqlen, head_dim), rotate-half layout
        self._cos, self._sin = emb.cos().float(), emb.sin().float()

    def set_embedding(self, embed: torch.Tensor) -> None:
        self.hidden = embed[self.token_ids].float()

    def _rope(self, x: torch.Tensor) -> torch.Tensor:
        # x: (S, heads, T, head_dim)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * self._cos + rotated * self._sin

    def _attention(
        self, x: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor
    ) -> torch.Tensor:
        c = self.config
        s, t, _ = x.shape
        q = self._rope((x @ wq.t()).view(s, t, c.num_heads, c.head_dim).transpose(1, 2))
        k = self._rope((x @ wk.t()).view(s, t, c.num_kv_heads, c.head_dim).transpose(1, 2))
        v = (x @ wv.t()).view(s, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        rep = c.num_heads // c.num_kv_heads
        out = F.scaled_dot_product_attention(
            q,
            k.repeat_interleave(rep, dim=1),
            v.repeat_interleave(rep, dim=1),
            is_causal=True,
            scale=c.head_dim**-0.5,
        )
        return out.transpose(1, 2).reshape(s, t, c.num_heads * c.head_dim)

    @torch.no_grad()
    def run_layer(self, prefix: str, quantize: Callable[[str, torch.Tensor | None], Weight]) -> None:
        """Quantize one decoder layer (``prefix`` = "model.layers.{i}.") and advance ``hidden``.

        ``quantize(name, H)`` returns the stored weight for ``name``; H is the input Hessian for
        linear weights and None for norms. Calls go in forward order.
        """
        if self.hidden is None:
            raise RuntimeError("set_embedding must be called before run_layer")
        c = self.config
        get = lambda part, h=None: _dense(quantize(f"{prefix}{part}.weight", h))  # noqa: E731
        h = self.hidden
        x = F.rms_norm(h, (c.hidden_size,), get("input_layernorm"), c.rms_norm_eps)
        hx = hessian(x)
        wq, wk, wv = (get(f"self_attn.{p}_proj", hx) for p in "qkv")
        attn = self._attention(x, wq, wk, wv)
        h = h + attn @ get("self_attn.o_proj", hessian(attn)).t()
        x = F.rms_norm(h, (c.hidden_size,), get("post_attention_layernorm"), c.rms_norm_eps)
        hx = hessian(x)
        gate, up = get("mlp.gate_proj", hx), get("mlp.up_proj", hx)
        act = F.silu(x @ gate.t()) * (x @ up.t())
        self.hidden = h + act @ get("mlp.down_proj", hessian(act)).t()
