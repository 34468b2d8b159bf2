"""Configuration dataclasses: one per concern, frozen, validated at construction.

ModelConfig describes a checkpoint's architecture (read from GGUF metadata or config.json);
RuntimeConfig says how to run it (device, linear-layer path, KV cache sizing).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

LINEAR_PATHS = ("auto", "int4_cpu", "triton", "reference")
ACTIVATIONS = ("silu", "gelu_tanh")
ROPE_SCALINGS = ("none", "linear", "llama3")
DEVICES = ("cpu", "cuda", "auto")
DEFAULT_CONTEXT = 8192  # tokens a sequence may hold unless --ctx says otherwise
# How the CPU kernels round activations (kernels.dispatch).
CPU_ACTIVATIONS = ("auto", "int16", "int8", "int8x2", "int8x2-lean", "bf16", "bf16-prompts")
KV_DTYPES = ("fp32", "bf16", "fp16", "int8", "int4")


@dataclass(frozen=True)
class ArchSpec:
    """What one decoder architecture computes beyond Llama's layer: the one forward
    (edgeinfer.models.llama) reads these flags; every default is Llama's.

    The norm weights a checkpoint stores are applied as ``w + norm_offset`` (Gemma's HF weights:
    1 + w; llama.cpp's converter adds the 1 before writing a GGUF, so those have offset 0).
    Layer i attends within ``sliding_window`` tokens (a query and the window - 1 before it)
    unless it is global: every layer is local when ``global_every`` is 0, else layers with
    (i + 1) % global_every == 0 are global (Gemma 2: 2, Gemma 3: 6). Local layers take RoPE base
    ``local_rope_theta`` without scaling where it is set (Gemma 3), else the global RoPE.
    RoPE scaling: "linear" divides positions by ``rope_factor``; "llama3" divides each
    frequency by its ``rope_freq_factors`` entry (head_dim / 2 of them, what a GGUF's
    rope_freqs tensor holds; quant.hf_import computes them from config.json's parameters).
    """

    qkv_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each head's q and k before RoPE (Qwen 3, Gemma 3)
    norm_offset: float = 0.0
    sandwich_norms: bool = False  # norms on the attention and MLP outputs too (Gemma 2/3)
    fused_qkv: bool = False  # the checkpoint stores Q/K/V as one qkv_proj (Phi-3)
    fused_gate_up: bool = False  # and gate/up as one gate_up_proj
    activation: str = "silu"
    embed_scale: float = 1.0  # the embedding rows are multiplied by it (Gemma: sqrt(hidden))
    attn_scale: float | None = None  # q.k scale; None: head_dim ** -0.5
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap)
    final_softcap: float | None = None  # the same on the logits
    sliding_window: int | None = None
    global_every: int = 0
    local_rope_theta: float | None = None
    rope_scaling: str = "none"
    rope_factor: float = 1.0
    rope_freq_factors: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "rope_freq_factors", tuple(float(f) for f in self.rope_freq_factors))
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"ArchSpec.activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.rope_scaling not in ROPE_SCALINGS:
            raise ValueError(f"ArchSpec.rope_scaling must be one of {ROPE_SCALINGS}, got {self.rope_scaling!r}")
        if self.norm_offset not in (0.0, 1.0):
            raise ValueError(f"ArchSpec.norm_offset must be 0 (w) or 1 (1 + w), got {self.norm_offset}")
        if (self.rope_scaling == "llama3") != bool(self.rope_freq_factors):
            raise ValueError("ArchSpec.rope_freq_factors are given exactly when rope_scaling is 'llama3'")
        if self.rope_scaling == "linear" and self.rope_factor < 1:
            raise ValueError(f"ArchSpec.rope_factor must be >= 1 for linear RoPE scaling, got {self.rope_factor}")
        for name in ("attn_softcap", "final_softcap", "sliding_window", "attn_scale", "local_rope_theta"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"ArchSpec.{name} must be positive or None, got {value}")
        if self.global_every < 0 or (self.global_every or self.local_rope_theta) and self.sliding_window is None:
            raise ValueError("ArchSpec.global_every (>= 0) and local_rope_theta need a sliding_window")
        if self.embed_scale <= 0:
            raise ValueError(f"ArchSpec.embed_scale must be positive, got {self.embed_scale}")

    def is_local(self, layer: int) -> bool:
        """Whether layer ``layer`` attends within the sliding window."""
        if self.sliding_window is None:
            return False
        return not self.global_every or (layer + 1) % self.global_every != 0

    def linear_parts(self) -> dict[str, tuple[str, ...]]:
        """The checkpoint weights ("model.layers.{i}.{part}.weight") behind each fused linear of
        the forward, in the order it runs them; the parts of one share its input."""
        return {
            "qkv": ("self_attn.qkv_proj",) if self.fused_qkv else
            ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            "o": ("self_attn.o_proj",),
            "gate_up": ("mlp.gate_up_proj",) if self.fused_gate_up else ("mlp.gate_proj", "mlp.up_proj"),
            "down": ("mlp.down_proj",),
        }

    def norm_names(self) -> dict[str, str]:
        """The forward's per-layer norms -> their checkpoint names (HF's: Gemma's
        post_attention_layernorm is on the attention output, Llama's before the MLP)."""
        names = {"input_norm": "input_layernorm"}
        if self.sandwich_norms:
            names |= {"attn_out_norm": "post_attention_layernorm", "post_norm": "pre_feedforward_layernorm",
                      "mlp_out_norm": "post_feedforward_layernorm"}
        else:
            names["post_norm"] = "post_attention_layernorm"
        if self.qk_norm:
            names |= {"q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}
        return names

    def layer_weight_names(self) -> list[str]:
        """Every tensor of one decoder layer, by name within it ("self_attn.q_proj.bias", ...)."""
        names = [f"{part}.weight" for parts in self.linear_parts().values() for part in parts]
        names += [f"{norm}.weight" for norm in self.norm_names().values()]
        if self.qkv_bias:
            names += [f"{part}.bias" for part in self.linear_parts()["qkv"]]
        return names


@dataclass(frozen=True)
class ModelConfig:
    """A decoder's shape, and what its architecture computes (``spec``)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "llama"
    spec: ArchSpec = ArchSpec()

    def __post_init__(self) -> None:
        if isinstance(self.spec, dict):  # from_dict of a checkpoint's config.json
            object.__setattr__(self, "spec", ArchSpec(**self.spec))
        factors = self.spec.rope_freq_factors
        if factors and len(factors) != self.head_dim // 2:
            raise ValueError(f"ArchSpec.rope_freq_factors has {len(factors)} entries, head_dim {self.head_dim} "
                             f"needs {self.head_dim // 2}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(N, K) of each layer's projections, by HF name suffix ("self_attn.q_proj", ...)."""
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {
            "self_attn.q_proj": (q_size, self.hidden_size),
            "self_attn.k_proj": (kv_size, self.hidden_size),
            "self_attn.v_proj": (kv_size, self.hidden_size),
            "self_attn.o_proj": (self.hidden_size, q_size),
            "mlp.gate_proj": (self.intermediate_size, self.hidden_size),
            "mlp.up_proj": (self.intermediate_size, self.hidden_size),
            "mlp.down_proj": (self.hidden_size, self.intermediate_size),
        }

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(frozen=True)
class RuntimeConfig:
    """How to run a model: where, which linear path, and the KV cache's shape and budget."""

    device: str = "cpu"
    linear_path: str = "auto"  # auto: int4_cpu on the CPU, triton on CUDA
    num_threads: int | None = None
    # Fewer threads while other programs keep some of the cores busy (worker/cpu_share.py); False:
    # always num_threads.
    share_cpu: bool = True
    # Added to the niceness of the thread that runs the steps (and so of its OpenMP threads,
    # which inherit it; Linux only). A step keeps every core busy, and a local client or the
    # server's own event loop woken beside it waits for a time slice: with an httpx client what
    # the HTTP path added to a request's TTFT was 3.9-8.3 ms (medians of 3 runs) at equal
    # priority, 3.4-4.4 niced (tools/bench_http_overhead.py, docs/BENCHMARKS.md). 0: the
    # process's own priority.
    compute_nice: int = 5
    block_size: int = 16
    # K and V, unless overridden below. auto: fp16, as llama.cpp keeps it (the default model on
    # the CPU: the same decode speed as fp32 and half the pool, 9 MB less at 400 tokens); fp32 on
    # the exact reference path.
    kv_dtype: str = "auto"
    k_dtype: str | None = None
    v_dtype: str | None = None
    # The KV pool, first that is set: a fixed count of blocks, a byte budget, a fraction of the
    # memory available; else room for `parallel` sequences of the full context (the memory plan).
    num_kv_blocks: int | None = None
    kv_memory_bytes: int | None = None
    kv_memory_fraction: float | None = None
    # The longest sequence (prompt + output) admission accepts, --ctx; None: the model's own,
    # capped at DEFAULT_CONTEXT (a 128k-context model would otherwise plan gigabytes per sequence).
    max_model_len: int | None = None
    parallel: int = 4  # full-context sequences the default pool holds (short ones share it, paged)
    cuda_graphs: bool = False  # replay pure-decode steps as CUDA graphs (CUDA only; ignored on the CPU)
    graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)  # decode batches padded up to the nearest
    # The checkpoint's own output layer for every logit. Off, the int4 CPU path keeps an int4 copy
    # and recomputes only each row's 64 likeliest logits exactly: greedy and top-k choices are
    # exact, the log-probabilities of other tokens are not (default model: perplexity 47.21
    # against 46.58), for a faster decode.
    exact_head: bool = False
    # int16: the int16-activation kernels, a scale per 4 values, the accuracy reference; int8: the
    # int8-activation (VNNI) GEMMs on the CPU's quantized linears, a scale per 32 values
    # (kernels.cpu_a8; llama.cpp's rounding, +0.5% perplexity); int8x2: x and its rounding
    # residual (on d / 16) as two int8 terms, int16's accuracy through the same GEMMs; int8x2-lean:
    # int8x2 with the attention output projection and the head's coarse pass in one term (the same
    # measured accuracy, less work: kernels.dispatch.LEAN_ONE_TERM); bf16: x and the
    # weights rounded to bf16, fp32 sums on the AMX-BF16 tile unit (Sapphire Rapids and later
    # Xeons only; fastest from ~16 rows, slow for one); bf16-prompts: prompt tokens in bf16,
    # generated ones in int8x2; auto: bf16-prompts where the CPU has AMX-BF16, int8x2-lean where it
    # has VNNI, else int16 (kernels.dispatch.resolve_cpu_activations).
    cpu_activations: str = "auto"

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.linear_path not in LINEAR_PATHS:
            raise ValueError(f"linear_path must be one of {LINEAR_PATHS}, got {self.linear_path!r}")
        if self.cpu_activations not in CPU_ACTIVATIONS:
            raise ValueError(f"cpu_activations must be one of {CPU_ACTIVATIONS}, got {self.cpu_activations!r}")
        if self.kv_dtype != "auto" and self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be 'auto' or one of {KV_DTYPES}, got {self.kv_dtype!r}")
        for name in ("k_dtype", "v_dtype"):
            value = getattr(self, name)
            if value is not None and value not in KV_DTYPES:
                raise ValueError(f"{name} must be one of {KV_DTYPES}, got {value!r}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        if self.kv_memory_fraction is not None and not 0 < self.kv_memory_fraction <= 1:
            raise ValueError(f"kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction}")
        if self.kv_memory_bytes is not None and self.kv_memory_bytes <= 0:
            raise ValueError(f"kv_memory_bytes must be positive, got {self.kv_memory_bytes}")
        for name in ("max_model_len", "parallel"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if not 0 <= self.compute_nice <= 19:
            raise ValueError(f"compute_nice must be in [0, 19] (added to the process's niceness), "
                             f"got {self.compute_nice}")
        if self.num_threads is not None and self.num_threads <= 0:
            raise ValueError(f"num_threads must be positive, got {self.num_threads}")
        object.__setattr__(self, "graph_batch_sizes", tuple(self.graph_batch_sizes))
        if not self.graph_batch_sizes or any(
            not isinstance(b, int) or b <= 0 for b in self.graph_batch_sizes
        ):
            raise ValueError(f"graph_batch_sizes must be a non-empty tuple of positive ints, "
                             f"got {self.graph_batch_sizes}")

    def context_length(self, model_max_position: int) -> int:
        """The longest sequence served: max_model_len, else the model's context capped at
        DEFAULT_CONTEXT. Longer than the model's context is refused: positions it was never
        trained on give answers nobody can vouch for."""
        if self.max_model_len is None:
            return min(DEFAULT_CONTEXT, model_max_position)
        if self.max_model_len > model_max_position:
            raise ValueError(f"a context of {self.max_model_len} tokens (--ctx) is longer than the model's own "
                             f"({model_max_position} tokens)")
        return self.max_model_len

    @property
    def key_dtype(self) -> str:
        return self.k_dtype or self._kv_dtype

    @property
    def value_dtype(self) -> str:
        return self.v_dtype or self._kv_dtype

    @property
    def _kv_dtype(self) -> str:
        if self.kv_dtype != "auto":
            return self.kv_dtype
        return "fp32" if self.linear_path == "reference" else "fp16"


SPECULATIVE_MODES = ("off", "ngram", "draft")
CPU_STEP_TOKENS = 128  # SchedulerConfig.max_num_batched_tokens's default per device (for_device)
GPU_STEP_TOKENS = 512
CPU_BURST_WINDOW_S = 0.002  # SchedulerConfig.burst_window_s's default per device (for_device)
GPU_BURST_WINDOW_S = 0.0005


@dataclass(frozen=True)
class SchedulerConfig:
    """How the scheduler shares the model between requests: batch size, per-step token budget,
    waiting-queue bound and the KV watermark kept free at admission."""

    max_num_seqs: int = 64  # sequences in one step (running batch cap)
    # Tokens per step: decodes first, prefill chunks fill the rest. None: the device's default
    # (for_device): 128 on the CPU, where a step of up to 128 tokens is one fused C++ call
    # (kernels.dispatch.FUSED_STEP_MAX_TOKENS) and smaller chunks let waiting prompts and running
    # decodes in sooner (16 streams: TTFT p50 354 against 733 ms at 512, docs/BENCHMARKS.md);
    # 512 on a GPU, whose steps are launch-bound below that.
    max_num_batched_tokens: int | None = None
    max_waiting: int = 256  # past this a new request gets `overloaded`
    kv_watermark: float = 0.01  # fraction of KV blocks admission leaves free for running decodes
    retry_after_s: float = 1.0  # hint sent with `overloaded`
    mailbox_size: int = 1024  # scheduler actor inbox bound (submissions wait when it is full)
    # An idle engine's first submission waits in windows of this many seconds while more keep
    # arriving, so requests sent together share the first step (engine/scheduler_actor.py
    # `_let_a_burst_in`); a lone request pays one window. None: the device's default (for_device),
    # a small part of the first step it protects: 2 ms on the CPU, whose 64-token prompt takes a
    # ~50 ms step (a local client's parallel requests reached the server over ~2 ms: the server,
    # woken by the first, took the client's core; with 0.5 ms windows the first prompt often ran
    # alone and the other 15 waited out its step, docs/BENCHMARKS.md), 0.5 ms on a GPU. 0: plan
    # at the first submission (a front end with one request at a time: generate, bench, the
    # in-process chat).
    burst_window_s: float | None = None
    # Speculative decoding for decoding sequences: "off", "ngram" (prompt lookup) or "draft" (a
    # draft model, which the engine then loads beside the target): up to max_draft_tokens drafts
    # per step (adapted to each sequence's acceptance), only while at most speculate_max_seqs
    # sequences run: in a wide batch the extra verify rows cost more than
    # drafts save (on the CPU the int4 kernel's cost grows with rows from M = 4 on).
    speculative: str = "off"
    max_draft_tokens: int = 8
    speculate_max_seqs: int = 2

    def __post_init__(self) -> None:
        if self.speculative not in SPECULATIVE_MODES:
            raise ValueError(f"SchedulerConfig.speculative must be one of {SPECULATIVE_MODES}, "
                             f"got {self.speculative!r}")
        if not 1 <= self.max_draft_tokens <= 16:
            raise ValueError(f"SchedulerConfig.max_draft_tokens must be in [1, 16], got {self.max_draft_tokens}")
        if self.speculate_max_seqs < 1:
            raise ValueError(f"SchedulerConfig.speculate_max_seqs must be >= 1, got {self.speculate_max_seqs}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_waiting", "mailbox_size"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"SchedulerConfig.{name} must be positive, got {value}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so every running sequence can decode each step"
            )
        if not 0 <= self.kv_watermark < 1:
            raise ValueError(f"kv_watermark must be in [0, 1), got {self.kv_watermark}")
        if self.retry_after_s < 0:
            raise ValueError(f"retry_after_s must be >= 0, got {self.retry_after_s}")
        if self.burst_window_s is not None and not 0 <= self.burst_window_s <= 0.05:
            raise ValueError(f"burst_window_s must be in [0, 0.05] seconds, got {self.burst_window_s}")

    def for_device(self, device_type: str) -> SchedulerConfig:
        """This config with the step token budget and the burst window settled for a device type
        ("cpu", "cuda"): those given, else the device's defaults (a budget of at least
        max_num_seqs, so every running sequence can decode each step)."""
        cpu = device_type == "cpu"
        budget, window = self.max_num_batched_tokens, self.burst_window_s
        if budget is None:
            budget = max(CPU_STEP_TOKENS if cpu else GPU_STEP_TOKENS, self.max_num_seqs)
        if window is None:
            window = CPU_BURST_WINDOW_S if cpu else GPU_BURST_WINDOW_S
        return replace(self, max_num_batched_tokens=budget, burst_window_s=window)
