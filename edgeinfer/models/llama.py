"""The decoder forward pass in plain torch over a paged KV cache, for every architecture.

One layer's arithmetic is Llama's, changed where the config's ArchSpec (edgeinfer.config) says:
q/k/v biases, q/k norms, sandwich norms, GELU-tanh, soft-capped attention and logits, sliding
windows with their own RoPE base, a scaled embedding, RoPE scaling.

``LlamaLayers`` is the decoder's arithmetic for one config and kernels.dispatch.Backend: it owns
the RoPE tables and the KV transform (rotation, key centres), hands the backend's flags to the
kernels, and runs one decoder layer (``decoder_layer``) whose weights are passed in.
``LlamaModel`` adds the weights edgeinfer.models.weights prepares (once, at construction) and
runs the whole forward, every layer through that one method; GPTQ calibration
(quant.calibrate) runs it on the layers it is quantizing, one at a time, and watches each
linear's input through an observer. Both read and write only the KV pool they are handed and
decide nothing about which sequences run. A step is a flattened, variable-length batch
(BatchMeta): T new tokens from S sequences, each sequence's new tokens sitting at the end of its
context.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from edgeinfer.config import ModelConfig
from edgeinfer.models.weights import PreparedLayer, Weight, prepare_weights, row_reader, spec_features, weight_rows
from kernels import cpu_a8, cpu_ops
from kernels.dispatch import Backend, choose_backend, linear, scratch_numel
from kernels.kv_pool import KVPool
from kernels.kv_quant import PLAIN_DTYPES, kv_rotation
from kernels.paged_attention import paged_decode_attention, paged_prefill_attention
from quant.gguf_import import FileRows

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchMeta:
    """Tensors describing one step's flattened batch (built by the model runner)."""

    positions: torch.Tensor  # (T,) int64, position of each new token
    slot_mapping: torch.Tensor  # (T,) int64, KV pool slot (block * block_size + offset) per token
    block_tables: torch.Tensor  # (S, max_blocks) int32, padded with 0
    context_lens: torch.Tensor  # (S,) int32, tokens in context after this step
    query_start_loc: torch.Tensor  # (S + 1,) int32, cumulative new-token counts
    logits_indices: torch.Tensor  # (L,) int64, rows of the T tokens whose logits are wanted
    is_decode: bool  # every sequence has exactly one new token
    # An upper bound on context_lens for decode attention, so CUDA (graphs) needs no host sync to
    # find the longest context; None: read from context_lens.
    max_context_len: int | None = None
    # (first block, context length) when the step is one sequence whose blocks are consecutive
    # in the pool (always so for a single-stream runner): CPU decode attention then reads K/V
    # as a view of the pool instead of gathering blocks.
    seq_view: tuple[int, int] | None = None
    # (T,) bool on the CPU: the rows that are prompt tokens (SeqChunk.prompt_tokens); None: none.
    prompt_rows: torch.Tensor | None = None


HEAD_REFINE_ROWS = 64
# KV formats the fused step writes and reads (K and V in one format; mixed ones take the per-op
# forward).
FUSED_KV_DTYPES = (*PLAIN_DTYPES, "int8", "int4")
# ArchSpec features the Triton attention kernels and the per-op forward's C++ one lack: such
# layers attend in torch there (the fused C++ step runs them itself).
ATTENTION_KERNELS_LACK = ("attn_softcap", "sliding_window")


# ``observe(layer, name, x)`` is shown, in forward order, each linear's input under the name of
# its PreparedLayer field ("qkv", "o", "gate_up", "down") and the keys after RoPE ("keys",
# (T, Hkv, D)): what calibration measures (GPTQ Hessians, key centres). It may raise to end the
# step there (GPTQ stops a layer at the input it wants); the K/V written so far stay in the pool.
Observer = Callable[[int, str, torch.Tensor], None]


@dataclass(frozen=True)
class LayerStep:
    """What every decoder layer of one step reads besides its weights (LlamaLayers.layer_step)."""

    batch: BatchMeta
    kv: KVPool
    cos: torch.Tensor  # (T, 1, head_dim), RoPE at the step's positions
    signed_sin: torch.Tensor  # (T, 1, head_dim)
    local_rope: tuple[torch.Tensor, torch.Tensor] | None  # (cos, signed_sin) of sliding-window layers, if own
    key_centres: torch.Tensor | None  # (layers, Hkv, D), subtracted where the pool transforms keys
    observe: Observer | None


class LlamaLayers:
    """The decoder's arithmetic for one config and backend; the weights come by argument."""

    def __init__(self, config: ModelConfig, backend: Backend, scratch_numel: int = 0,
                 max_positions: int | None = None) -> None:
        """``scratch_numel``: fp32 elements of the buffer the CPU int4/int8 prefill paths reuse for
        their dequantized weights (kernels.dispatch.scratch_numel; too small: a buffer per call).
        ``max_positions``: the longest sequence ever run (the memory plan's context; default the
        model's), the most positions the RoPE tables cover."""
        self.config = config
        self.max_positions = min(max_positions or config.max_position, config.max_position)
        self.backend = backend
        self.device = backend.device
        # The a8 kernel of the fused step: bf16 activations, or the best int8 one this CPU runs.
        self._a8_isa = cpu_a8.BF16_ISA if backend.a8_bf16 else cpu_a8.default_isa() if backend.int8_activations else ""
        c = config
        self._read_rows = row_reader(backend)
        # One reused buffer for prefill's dequantized weights (the model runs on one thread).
        self._scratch = torch.empty(scratch_numel, device=self.device)
        spec = c.spec
        self._inv_freq = _inv_freq(c.rope_theta, c.head_dim)
        if spec.rope_scaling == "linear":  # positions / factor
            self._inv_freq = self._inv_freq / spec.rope_factor
        elif spec.rope_scaling == "llama3":
            self._inv_freq = self._inv_freq / torch.tensor(spec.rope_freq_factors, dtype=torch.float64)
        # Sliding-window layers with their own RoPE base (Gemma 3) take it unscaled.
        self._local_inv_freq = None if spec.local_rope_theta is None else _inv_freq(spec.local_rope_theta, c.head_dim)
        # CUDA graphs hold the tables' addresses, so there they cover the planned context at once
        # (a 131k-position model would otherwise hold ~0.5 GB of tables); the CPU grows them with
        # the contexts it sees (the default model's 8192 positions: 4 MB).
        rope_length = self.max_positions if self.device.type == "cuda" else min(256, self.max_positions)
        self._cos, self._sin = self._rope_tables(rope_length, self._inv_freq)
        self._local_rope = self._local_rope_tables(rope_length)
        self._scale = spec.attn_scale or c.head_dim ** -0.5
        self._act = F.silu if spec.activation == "silu" else lambda x: F.gelu(x, approximate="tanh")
        slow_attention = spec_features(spec, ATTENTION_KERNELS_LACK)
        if slow_attention and (backend.triton or backend.cpu_ops):
            log.info("%s: attention with %s runs in torch (the %s lack it)", c.architecture,
                     " and ".join(slow_attention), "Triton attention kernels" if backend.triton else
                     "per-op forward's C++ attention, for steps the fused step does not take,")
        self._kv_rotation = kv_rotation(c.head_dim, self.device)  # for quantized KV formats
        self.key_centres: torch.Tensor | None = None  # (layers, Hkv, D), once measured

    @property
    def linear_path(self) -> str:
        return self.backend.linear_path

    def _cover_positions(self, num_positions: int) -> None:
        """Grow the RoPE tables (at least doubling, at most ``max_positions``) to hold
        ``num_positions``; positions past that still fail where the tables are read."""
        if num_positions > self._cos.shape[0] < self.max_positions:
            length = min(max(num_positions, 2 * self._cos.shape[0]), self.max_positions)
            self._cos, self._sin = self._rope_tables(length, self._inv_freq)
            self._local_rope = self._local_rope_tables(length)

    def _local_rope_tables(self, length: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None if self._local_inv_freq is None else self._rope_tables(length, self._local_inv_freq)

    def _rope_tables(self, length: int, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = torch.outer(torch.arange(length, dtype=torch.float64), inv_freq)
        # rotate_half(x) * sin == roll(x, half) * signed_sin with the first half negated: the
        # sign lives in the table so RoPE is three ops per step for q and k together.
        cos = torch.cat((freqs.cos(), freqs.cos()), dim=-1)  # (length, head_dim)
        signed_sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1)
        return cos.float().to(self.device), signed_sin.float().to(self.device)

    def embed(self, weight: Weight | FileRows, token_ids: torch.Tensor) -> torch.Tensor:
        """The residual stream entering the first layer (T, hidden) fp32 from the embedding ``weight``."""
        h = weight_rows(weight, token_ids, self._read_rows)
        return h if self.config.spec.embed_scale == 1.0 else h * self.config.spec.embed_scale

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Over x's last dimension (hidden, or head_dim for q/k norms); ``weight`` includes the
        spec's norm offset (edgeinfer.models.weights)."""
        # 61 norms per decode step: torch's eager rms_norm is ~40 us on one CPU row, the C++ op ~1.
        if self.backend.cpu_ops and x.is_contiguous():
            return cpu_ops.rms_norm(x, weight, self.config.rms_norm_eps)
        return F.rms_norm(x, (x.shape[-1],), weight, self.config.rms_norm_eps)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        # x: (T, heads, head_dim); cos/signed_sin: (T, 1, head_dim)
        return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)

    def layer_step(self, batch: BatchMeta, kv: KVPool, observe: Observer | None = None) -> LayerStep:
        """The per-step inputs of ``decoder_layer``, computed once for all layers of the step."""
        self._cover_positions(batch.block_tables.shape[1] * kv.block_size)  # a bound known without a sync
        local = None
        if self._local_rope is not None:
            local_cos, local_sin = self._local_rope
            local = (local_cos[batch.positions].unsqueeze(1), local_sin[batch.positions].unsqueeze(1))
        return LayerStep(batch, kv, self._cos[batch.positions].unsqueeze(1), self._sin[batch.positions].unsqueeze(1),
                         local, self.key_centres if kv.transform_k else None, observe)

    def decoder_layer(self, index: int, layer: PreparedLayer, h: torch.Tensor, step: LayerStep) -> torch.Tensor:
        """Layer ``index`` of a step with the weights ``layer``: the residual stream h (T, hidden)
        in and out; the step's K/V are written into layer ``index`` of its pool."""
        c, batch, kv, observe = self.config, step.batch, step.kv, step.observe
        num_tokens = h.shape[0]
        q_size = c.num_heads * c.head_dim
        kv_size = c.num_kv_heads * c.head_dim
        bf16_rows = self._bf16_rows(batch)
        x = self._rms_norm(h, layer.input_norm)
        if observe is not None:
            observe(index, "qkv", x)
        qkv = linear(x, layer.qkv, self._scratch, bf16_rows)  # (T, (Hq + 2 Hkv) * D)
        if layer.v is not None:  # V's own weight (PreparedLayer.v): qkv held Q and K
            qkv = torch.cat((qkv, linear(x, layer.v, self._scratch, bf16_rows)), dim=-1)
        if layer.qkv_bias is not None:
            qkv = qkv + layer.qkv_bias
        qk = qkv[:, :q_size + kv_size].view(num_tokens, c.num_heads + c.num_kv_heads, c.head_dim)
        if layer.q_norm is not None:  # per head, over head_dim
            qk = torch.cat([self._rms_norm(qk[:, :c.num_heads].contiguous(), layer.q_norm),
                            self._rms_norm(qk[:, c.num_heads:].contiguous(), layer.k_norm)], dim=1)
        local = c.spec.is_local(index)
        cos, signed_sin = step.local_rope if local and step.local_rope is not None else (step.cos, step.signed_sin)
        qk = self._rope(qk, cos, signed_sin)
        if observe is not None:
            observe(index, "keys", qk[:, c.num_heads:])
        if step.key_centres is not None:  # keys only: the shift is the same for every key of a query
            qk = torch.cat([qk[:, :c.num_heads], qk[:, c.num_heads:] - step.key_centres[index]], dim=1)
        # Quantized caches hold rotated vectors (kernels.kv_quant.kv_rotation): q and k turn
        # together, v turns in and the attention output turns back.
        rot = self._kv_rotation
        if kv.transform_k:
            qk = qk @ rot
        q, k = qk[:, :c.num_heads], qk[:, c.num_heads:]
        v = qkv[:, q_size + kv_size:].view(num_tokens, c.num_kv_heads, c.head_dim)
        if kv.transform_v:
            v = v.to(rot.dtype) @ rot  # v comes in the linear's dtype (bf16/fp16 on fast paths)
        use_triton = self.backend.triton
        kv.write(index, k, v, batch.slot_mapping, use_triton=use_triton)
        window = c.spec.sliding_window if local else None
        softcap = c.spec.attn_softcap
        if batch.is_decode:
            attn = paged_decode_attention(q, kv, index, batch.block_tables, batch.context_lens, self._scale,
                                          use_triton=use_triton, use_cpu_ops=self.backend.cpu_ops,
                                          max_context_len=batch.max_context_len, seq_view=batch.seq_view,
                                          window=window, softcap=softcap)
        else:
            attn = paged_prefill_attention(q, kv, index, batch.block_tables, batch.context_lens,
                                           batch.query_start_loc, self._scale, use_triton=use_triton,
                                           window=window, softcap=softcap)
        if kv.transform_v:
            attn = attn @ rot.t()
        x = attn.reshape(num_tokens, q_size).to(h.dtype)
        if observe is not None:
            observe(index, "o", x)
        h = h + self._sandwich(linear(x, layer.o, self._scratch, bf16_rows), layer.attn_out_norm)
        x = self._rms_norm(h, layer.post_norm)
        if observe is not None:
            observe(index, "gate_up", x)
        gate, up = linear(x, layer.gate_up, self._scratch, bf16_rows).chunk(2, dim=-1)
        x = self._act(gate) * up
        if observe is not None:
            observe(index, "down", x)
        return h + self._sandwich(linear(x, layer.down, self._scratch, bf16_rows), layer.mlp_out_norm)

    def _bf16_rows(self, batch: BatchMeta) -> torch.Tensor | None:
        """The rows the a8 linears run in bf16: the prompt rows with cpu_activations bf16-prompts."""
        return batch.prompt_rows if self.backend.a8_bf16_prompts else None

    def _sandwich(self, x: torch.Tensor, norm: torch.Tensor | None) -> torch.Tensor:
        """A block's output before it joins the residual stream: normed where the spec has
        sandwich norms (Gemma)."""
        return x if norm is None else self._rms_norm(x.float().contiguous(), norm)


class LlamaModel(LlamaLayers):
    """Prepared weights (edgeinfer.models.weights) + forward.

    With an int4 head ('int4' head_format) the HEAD_REFINE_ROWS highest logits of the coarse pass
    are recomputed exactly from the original rows: the tokens that sampling can pick get the
    exact head; only far-tail logits carry int4 error.
    """

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, Weight],
        backend: Backend | None = None,
        head_format: str = "same",
        take_weights: bool = False,
        kv_calibration_ids: Sequence[int] = (),
        max_positions: int | None = None,
    ) -> None:
        """``backend``: the kernels it runs (kernels.dispatch.choose_backend; None: its choice for
        the CPU). ``head_format`` and ``take_weights``: see edgeinfer.models.weights.
        ``kv_calibration_ids``: tokens whose mean keys centre quantized key caches
        (measured by edgeinfer.worker.kv_calibration.prepare_quantized_kv; none: keys not centred).
        ``max_positions``: see LlamaLayers."""
        backend = backend or choose_backend()
        prepared = prepare_weights(config, weights, backend, head_format, take_weights)
        super().__init__(config, backend, scratch_numel(prepared.linears()), max_positions)
        self.weights = prepared
        self.kv_calibration_ids = tuple(kv_calibration_ids)
        # The fused step's Qwen 2 biases, q/k norms and Gemma's sandwich norms, where the
        # architecture has them.
        self._qkv_biases = [layer.qkv_bias for layer in prepared.layers if layer.qkv_bias is not None]
        self._qk_norms = [w for layer in prepared.layers if layer.q_norm is not None
                          for w in (layer.q_norm, layer.k_norm)]
        self._out_norms = [w for layer in prepared.layers if layer.attn_out_norm is not None
                           for w in (layer.attn_out_norm, layer.mlp_out_norm)]
        # Per KV pool its fused steps ran over: (the key centres it was made with, its decode setup).
        self._decode_setups: weakref.WeakKeyDictionary[KVPool, tuple[torch.Tensor | None, torch.ScriptObject]] = \
            weakref.WeakKeyDictionary()
        # A (len(cpu_ops.DECODE_PHASES),) int64 tensor the fused steps add their phases' times into
        # (tools/bench_engine_step.py forward --phases); None: not timed.
        self.phase_ns: torch.Tensor | None = None

    @property
    def fused_steps(self) -> bool:
        """Whether steps can run as one C++ call for all layers (PreparedWeights.fused)."""
        return self.weights.fused is not None

    def runs_fused(self, num_tokens: int, kv: KVPool) -> bool:
        """Whether ``forward`` runs a step of ``num_tokens`` tokens over ``kv`` as that one call:
        within the backend's bound, K and V in one format and transformed as that format asks
        (the C++ step rotates quantized caches only)."""
        return self.weights.fused is not None and num_tokens <= self.backend.fused_step_max_tokens and \
            kv.k_dtype == kv.v_dtype and kv.k_dtype in FUSED_KV_DTYPES and \
            kv.transform_k == (kv.k_dtype not in PLAIN_DTYPES)

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(self.weights.embed, token_ids)

    def _head(self, h: torch.Tensor, batch: BatchMeta) -> torch.Tensor:
        """Logits of the rows h (batch.logits_indices); prompt rows on their kernel, as the layers."""
        prompt_rows = self._bf16_rows(batch)
        logits = linear(h, self.weights.head,
                        bf16_rows=None if prompt_rows is None else prompt_rows[batch.logits_indices]).float()
        if self.weights.head_exact is not None:
            k = min(HEAD_REFINE_ROWS, logits.shape[-1])
            top = (cpu_ops.row_topk(logits, k) if self.backend.cpu_ops else logits.topk(k, dim=-1))[1]  # (L, R)
            rows = weight_rows(self.weights.head_exact, top.flatten(), self._read_rows)  # (L * R, hidden)
            if self.backend.cpu_ops:
                cpu_ops.refine_logits(logits, h.float().contiguous(), top, rows)
            else:
                logits.scatter_(-1, top, torch.einsum("lh,lrh->lr", h.float(), rows.view(*top.shape, -1)))
        cap = self.config.spec.final_softcap  # monotonic: the refined rows stay the best
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _decode_setup(self, kv: KVPool) -> torch.ScriptObject:
        """The fused step's setup over ``kv`` (cpu_ops.decode_setup), made on the pool's first step
        and again once the key centres change."""
        made = self._decode_setups.get(kv)
        if made is not None and made[0] is self.key_centres:
            return made[1]
        c = self.config
        params = {}
        if kv.k_dtype not in PLAIN_DTYPES:  # then K and V both (FUSED_KV_DTYPES)
            params = {"k_scales": [cache.scale for cache in kv.k_caches],
                      "v_scales": [cache.scale for cache in kv.v_caches],
                      "rotation": self._kv_rotation, "key_centres": self.key_centres}
        if kv.k_dtype == "int4":
            params |= {"k_zeros": [cache.zero for cache in kv.k_caches],
                       "v_zeros": [cache.zero for cache in kv.v_caches]}
        setup = cpu_ops.decode_setup(
            self.weights.fused, [cache.data for cache in kv.k_caches], [cache.data for cache in kv.v_caches],
            c.num_heads, self._scale, c.rms_norm_eps, **params, a8_wsums=self.weights.fused_wsums,
            a8_isa=self._a8_isa if self.weights.fused_wsums else "", a8_terms=self.weights.fused_terms,
            qkv_biases=self._qkv_biases, qk_norms=self._qk_norms, out_norms=self._out_norms,
            window=c.spec.sliding_window or 0, global_every=c.spec.global_every, activation=c.spec.activation,
            attn_softcap=c.spec.attn_softcap or 0.0, v_weights=self.weights.fused_v,
        )
        self._decode_setups[kv] = (self.key_centres, setup)
        return setup

    def _fused_step(self, token_ids: torch.Tensor, batch: BatchMeta, kv: KVPool) -> torch.Tensor:
        h = self.embed_tokens(token_ids).contiguous()
        tables, context_lens = batch.block_tables, batch.context_lens
        if not batch.is_decode:  # a row per token: its sequence's table, causal up to its position
            tables = tables.repeat_interleave(batch.query_start_loc.diff(), dim=0)
            context_lens = batch.positions + 1
        cpu_ops.decode_layers(h, self._decode_setup(kv), self._cos, self._sin, batch.positions, batch.slot_mapping,
                              tables, context_lens, a8_bf16_rows=self._bf16_rows(batch), local_rope=self._local_rope,
                              phase_ns=self.phase_ns)
        return self._head(self._rms_norm(h[batch.logits_indices], self.weights.norm), batch)

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, batch: BatchMeta, kv: KVPool,
                observe: Observer | None = None) -> torch.Tensor:
        """Logits (len(batch.logits_indices), vocab) in fp32 for the requested token rows.
        ``observe`` is shown each layer's activations (Observer); it takes the per-op forward,
        the fused C++ step having no place to show them."""
        if observe is None and self.runs_fused(token_ids.shape[0], kv):
            self._cover_positions(batch.block_tables.shape[1] * kv.block_size)  # a bound known without a sync
            return self._fused_step(token_ids, batch, kv)
        step = self.layer_step(batch, kv, observe)
        h = self.embed_tokens(token_ids)  # (T, hidden)
        for index, layer in enumerate(self.weights.layers):
            h = self.decoder_layer(index, layer, h, step)
        return self._head(self._rms_norm(h[batch.logits_indices], self.weights.norm), batch)


def _inv_freq(theta: float, head_dim: int) -> torch.Tensor:
    """RoPE's inverse frequencies (head_dim / 2,) in float64: the tables are rounded to fp32 once."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
