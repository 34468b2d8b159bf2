"""Every supported architecture against transformers, from its GGUF and from its HF folder.

Tiny random-weight fixtures (tests/models/arch_fixtures.py: every parameter random, biases and
norms included; a 64-token original context for Llama 3 scaling and windows of 48 so both bite
within the prompt). On the exact fp32 path the logits at every position of a 300-token prompt
and at each of 32 greedy steps stay within 1e-4 relative error of transformers' (eager
attention, fp32), and the greedy tokens are the same.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from arch_fixtures import ARCHS, hf_model, save_hf, write_gguf

from edgeinfer.config import ModelConfig, RuntimeConfig
from edgeinfer.models.loader import LoadedModel
from edgeinfer.worker.batch import SeqChunk, build_batch
from edgeinfer.worker.build import build_model, fixed_runner
from kernels import cpu_ops
from quant.formats import quantize_int4
from quant.gguf_arch import ModelFileError
from quant.gguf_import import load_gguf
from quant.hf_import import load_hf_folder, read_hf_config

pytest.importorskip("transformers")
PROMPT_LEN, STEPS = 300, 32
GGUF_ARCHS = [name for name, (_, _, arch) in ARCHS.items() if arch is not None]


class Fixture:
    """One architecture's model, its files and transformers' run on the prompt."""

    def __init__(self, name: str, folder: Path) -> None:
        self.name = name
        self.model = hf_model(name)
        self.folder = save_hf(self.model, folder / name)
        generator = torch.Generator().manual_seed(1)
        self.prompt = torch.randint(3, self.model.config.vocab_size, (PROMPT_LEN,), generator=generator).tolist()
        self.prompt_logits, self.tokens, self.step_logits = _hf_run(self.model, self.prompt)

    def gguf(self, folder: Path, dtype: str) -> Path:
        path = folder / f"{self.name}.{dtype}.gguf"
        return path if path.exists() else write_gguf(self.name, self.model, self.folder, path, dtype)


@pytest.fixture(scope="module")
def fixtures() -> dict[str, Fixture]:
    return {}


def _fixture(fixtures: dict[str, Fixture], name: str, folder: Path) -> Fixture:
    if name not in fixtures:
        fixtures[name] = Fixture(name, folder)
    return fixtures[name]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("archs")


def _hf_run(model: torch.nn.Module, prompt: list[int]) -> tuple[torch.Tensor, list[int], list[torch.Tensor]]:
    """Logits at every prompt position, then 32 greedy tokens, each step a full forward (no
    cache: the plainest oracle), with their logits."""
    ids = list(prompt)
    tokens, step_logits = [], []
    with torch.no_grad():
        prompt_logits = model(torch.tensor([ids])).logits[0].float()
        logits = prompt_logits[-1]
        for _ in range(STEPS):
            tokens.append(int(logits.argmax()))
            ids.append(tokens[-1])
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            step_logits.append(logits)
    return prompt_logits, tokens, step_logits


def _ours_run(loaded: LoadedModel, prompt: list[int]) -> tuple[torch.Tensor, list[int], list[torch.Tensor]]:
    runtime = RuntimeConfig(linear_path="reference")
    runner = fixed_runner(build_model(loaded, runtime), runtime, PROMPT_LEN + STEPS)
    table = tuple(range(runner.pool.num_blocks))
    prompt_logits = runner.logits([SeqChunk(tuple(prompt), 0, table, num_logits=len(prompt))])
    logits = prompt_logits[-1]
    tokens, step_logits = [], []
    for _ in range(STEPS):  # decode steps: one token each over the paged cache
        tokens.append(int(logits.argmax()))
        logits = runner.logits([SeqChunk((tokens[-1],), len(prompt) + len(tokens) - 1, table)])[0]
        step_logits.append(logits)
    return prompt_logits, tokens, step_logits


def _check_against_transformers(fixture: Fixture, loaded: LoadedModel) -> None:
    prompt_logits, tokens, step_logits = _ours_run(loaded, fixture.prompt)
    errors = (prompt_logits - fixture.prompt_logits).norm(dim=-1) / fixture.prompt_logits.norm(dim=-1)
    assert errors.max() < 1e-4, (fixture.name, int(errors.argmax()), float(errors.max()))
    assert tokens == fixture.tokens, fixture.name
    for step, (ours, ref) in enumerate(zip(step_logits, fixture.step_logits, strict=True)):
        assert float((ours - ref).norm() / ref.norm()) < 1e-4, (fixture.name, step)


@pytest.mark.parametrize("name", list(ARCHS))
def test_hf_folder_matches_transformers(name: str, fixtures: dict[str, Fixture], folder: Path) -> None:
    fixture = _fixture(fixtures, name, folder)
    config, weights = load_hf_folder(fixture.folder)
    _check_against_transformers(fixture, LoadedModel(config, weights, None, "hf"))


@pytest.mark.parametrize("name", GGUF_ARCHS)
def test_gguf_matches_transformers(name: str, fixtures: dict[str, Fixture], folder: Path) -> None:
    fixture = _fixture(fixtures, name, folder)
    gguf = load_gguf(fixture.gguf(folder, "F16"))
    assert gguf.config.architecture == ARCHS[name][2]
    _check_against_transformers(fixture, LoadedModel(gguf.config, gguf.weights, None, "gguf"))


def test_f32_gguf_matches_transformers(fixtures: dict[str, Fixture], folder: Path) -> None:
    fixture = _fixture(fixtures, "llama3", folder)
    gguf = load_gguf(fixture.gguf(folder, "F32"))
    _check_against_transformers(fixture, LoadedModel(gguf.config, gguf.weights, None, "gguf"))


@pytest.mark.parametrize("name", list(ARCHS))
def test_transformers_4_config_reads_the_same(name: str, tmp_path: Path) -> None:
    """config.json as transformers 4.x wrote it (rope_theta / rope_scaling at the top level)
    gives the config transformers 5's layout (rope_parameters, layer_types) does; the spec
    survives an edgeinfer checkpoint's config.json (quant.checkpoint: to_dict / from_dict)."""
    model = hf_model(name)
    v5 = read_hf_config(save_hf(model, tmp_path / "v5"))
    assert read_hf_config(save_hf(model, tmp_path / "v4", v4_config=True)) == v5
    assert ModelConfig.from_dict(json.loads(json.dumps(v5.to_dict()))) == v5


def test_fused_cpu_step_runs_every_architecture_as_the_per_op_forward(
        fixtures: dict[str, Fixture], folder: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The C++ step is Llama's layer with q/k/v biases, q/k norms, sliding windows, local and
    global layers, sandwich norms, GELU and soft-capped attention: with int4 weights every
    fixture (llama3's scaled RoPE tables; windows shorter than the prompt) runs it and agrees
    with the per-op forward, and none is logged as running layer by layer."""
    if not cpu_ops.available():
        pytest.skip("the C++ ops do not build here")
    for name in ("llama3", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3"):
        fixture = _fixture(fixtures, name, folder)
        config, weights = load_hf_folder(fixture.folder)
        weights = {k: quantize_int4(w, 32) if w.dim() == 2 and "embed" not in k else w for k, w in weights.items()}
        with caplog.at_level(logging.INFO, logger="edgeinfer.models.weights"):
            # int8x2, not auto's int8x2-lean: every linear in two terms keeps the bound below tight
            # (lean's one-term linears: tests/kernels/test_decode_layers.py)
            model = build_model(LoadedModel(config, weights, None, "hf"),
                                RuntimeConfig(linear_path="int4_cpu", cpu_activations="int8x2"))
        runtime = RuntimeConfig(linear_path="int4_cpu", kv_dtype="fp32")
        runner = fixed_runner(model, runtime, 64)
        # 60 tokens: past the fixtures' 48-token windows
        chunk = SeqChunk(tuple(fixture.prompt[:60]), 0, tuple(range(runner.pool.num_blocks)), num_logits=60)
        token_ids, batch = build_batch([chunk], runtime.block_size, model.device)
        assert model.runs_fused(60, runner.pool), name
        fused = model.forward(token_ids, batch, runner.pool)
        per_op = model.forward(token_ids, batch, runner.pool, observe=lambda *_: None)
        # Two-term int8 activations: a last-bit difference upstream can move a residual code by
        # one, a sixteenth of a code step (0.0018-0.0024 seen); a wiring mistake moves every logit
        # by its own size.
        assert float((fused - per_op).norm() / per_op.norm()) < 5e-3, name
    assert not [r for r in caplog.records if "per-op" in r.getMessage() or "layer by layer" in r.getMessage()]


def _hf_config(tmp_path: Path, name: str, **changes: object) -> Path:
    """Fixture ``name``'s config.json with ``changes`` (None: the key removed), alone in a folder."""
    save_hf(hf_model(name), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    for key, value in changes.items():
        cfg.pop(key) if value is None else cfg.__setitem__(key, value)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


@pytest.mark.parametrize("name,changes,message", [
    ("llama3", {"model_type": "mamba"}, "unsupported architecture 'mamba'; edgeinfer runs .*'gemma3_text'"),
    ("llama3", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
     "RoPE scaling 'yarn' is not supported; edgeinfer runs .*'llama3'"),
    ("llama3", {"rope_parameters": None, "rope_theta": 1e4, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
     "RoPE scaling 'dynamic'"),
    ("phi3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8,
                                  "long_factor": [2.0] * 8}}, "RoPE scaling 'longrope'"),
    ("phi3", {"partial_rotary_factor": 0.75}, "partial_rotary_factor"),
    ("qwen2", {"use_sliding_window": True, "layer_types": None}, "use_sliding_window"),
    ("llama3", {"hidden_act": "relu"}, "activation 'relu'"),
    ("gemma3", {"layer_types": ["sliding_attention", "full_attention"] * 3}, "layer_types"),
])
def test_hf_refusals_name_what_is_unsupported(name: str, changes: dict, message: str, tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match=message):
        read_hf_config(_hf_config(tmp_path, name, **changes))


def _gguf_header(path: Path, arch: str, tensor: str, **metadata: object) -> Path:
    """A GGUF of ``arch`` with the usual shape keys, ``metadata`` and one tensor named ``tensor``."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in {"context_length": 64, "embedding_length": 64, "feed_forward_length": 128,
                       "block_count": 1, "attention.head_count": 4,
                       "attention.layer_norm_rms_epsilon": 1e-6, **metadata}.items():
        (writer.add_string if isinstance(value, str) else writer.add_float32 if isinstance(value, float)
         else writer.add_uint32)(f"{arch}.{key}", value)
    writer.add_token_list(["a", "b"])
    writer.add_tensor(tensor, np.ones((2, 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("arch,tensor,metadata,message", [
    ("mamba", "token_embd.weight", {}, "unsupported architecture 'mamba'; edgeinfer runs .*'gemma3'"),
    ("llama", "token_embd.weight", {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0},
     "RoPE scaling 'yarn' is not supported; edgeinfer runs .*llama3"),
    ("phi3", "rope_factors_long.weight", {}, "RoPE scaling 'longrope'"),
    ("llama", "token_embd.weight", {"rope.dimension_count": 8}, "partial rotary"),
    ("llama", "blk.0.attn_output.bias", {}, r"biases on \['attn_output'\]"),
])
def test_gguf_refusals_name_what_is_unsupported(arch: str, tensor: str, metadata: dict, message: str,
                                                tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match=message):
        load_gguf(_gguf_header(tmp_path / "m.gguf", arch, tensor, **metadata))
