"""The plan to a memory budget: the measured error is the layer's output error (checked against
its inputs directly), the plan fits and mixes precisions, it is stored and used, a budget that
cannot be met says by how much before anything is measured, and the server refuses a plan the
machine cannot hold."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from test_checkpoint import make_tiny_folder

import quant.budget
from edgeinfer.cli.quantize import quantize_main
from edgeinfer.config import RuntimeConfig
from edgeinfer.models.loader import load_model
from edgeinfer.worker.build import build_runners
from quant.budget import Budget, LayerChoice, choose, measure, output_error, sizes, undominated
from quant.checkpoint import load_checkpoint
from quant.convert import ConvertOptions, convert
from quant.formats import quantize_int4
from quant.sources import open_source


def test_output_error_is_the_layers_output_error() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(300, 96, generator=gen, dtype=torch.float64) * torch.linspace(0.1, 3, 96, dtype=torch.float64)
    w = torch.randn(40, 96, generator=gen)
    q = quantize_int4(w, 32)
    want = ((x @ w.double().T - x @ q.dequantize().double().T) ** 2).sum() / ((x @ w.double().T) ** 2).sum()
    assert output_error(w, q, x.T @ x) == pytest.approx(float(want), rel=1e-9)


def test_choices_beaten_on_bytes_and_error_are_dropped() -> None:
    """A 4-bit source: g32 keeps its grid exactly (error 0) in fewer bytes than int8 re-rounds it;
    g64 re-rounded costs what g32 does with more error."""
    c = {p: LayerChoice("w", *p, nbytes=b, error=e) for p, b, e in
         [(("int8", None), 1000, 1e-5), (("int4", 32), 625, 0.0), (("int4", 64), 625, 3e-3),
          (("int4", 128), 562, 4e-3)]}
    assert undominated(c.values()) == [c["int4", 32], c["int4", 128]]


def test_plan_fits_mixes_precisions_and_is_stored(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    src = make_tiny_folder(tmp_path / "src")
    source = open_source(src)
    options = measure(source, ConvertOptions(weights="int4"))
    smallest, fixed = sizes(source, ConvertOptions(weights="int4"))
    assert smallest.keys() == options.keys()
    for name, choices in options.items():  # int8, g32, g64, g128: fewer bytes, more error
        assert [c.precision for c in choices] == ["int8", "int4 g32", "int4 g64", "int4 g128"], name
        assert [c.error for c in choices] == sorted(c.error for c in choices), name
        # the shapes-only size of the smallest choice is the measured one's
        assert (smallest[name].precision, smallest[name].nbytes) == (choices[-1].precision, choices[-1].nbytes)
    # int8 is one fp32 scale per row, as the converter stores it (down_proj: N=128, K=256)
    assert options["model.layers.0.mlp.down_proj.weight"][0].nbytes == 128 * 256 + 128 * 4
    budget = Budget(10**9, 64, 2, "int8").for_model(source.config)
    largest = choose(options, fixed, budget, source.config)
    assert {c.precision for c in largest.layers} == {"int8"}
    smallest = sum(c[-1].nbytes for c in options.values()) + fixed + largest.kv_bytes
    middle = (largest.total_bytes + smallest) // 2
    args = [str(src), str(tmp_path / "out"), "--weights", "int4", "--budget", str(middle), "--ctx", "64",
            "--parallel", "2", "--kv-dtype", "int8", "-q"]
    assert quantize_main(args) == 0
    table = capsys.readouterr().err
    assert "model.layers.1.mlp.down_proj.weight" in table and f"of a {middle / 1e6:,.2f} MB budget" in table
    plan = json.loads((tmp_path / "out" / "config.json").read_text())["edgeinfer_plan"]
    assert plan["weight_bytes"] + plan["kv_bytes"] <= middle and plan["ctx"] == 64 and plan["kv_dtype"] == "int8"
    _, weights = load_checkpoint(tmp_path / "out")
    precisions = set()
    for name, precision, nbytes, _error in plan["layers"]:
        got = weights[name]
        assert (got.format if got.format == "int8" else f"int4 g{got.group_size}") == precision, name
        assert got.nbytes == nbytes, name
        precisions.add(precision)
    assert len(precisions) > 1  # a budget between the extremes mixes them
    assert plan["weight_bytes"] == sum(w.nbytes if hasattr(w, "format") else w.numel() * w.element_size()
                                       for w in weights.values())


def test_an_impossible_budget_is_refused_before_the_measurement(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    src = make_tiny_folder(tmp_path / "src")
    # The smallest plan, independently: every linear int4 g128 (K = 128 and 256 here), the rest as
    # --weights int4 stores it; KV fp16: K and V x 2 layers x 2 heads x 32 dims x 2 bytes per token.
    convert(src, tmp_path / "g128", ConvertOptions(weights="int4", group_size=128), progress=None,
            log=lambda line: None)
    _, weights = load_checkpoint(tmp_path / "g128")
    weight_bytes = sum(w.nbytes if hasattr(w, "format") else w.numel() * w.element_size() for w in weights.values())
    kv_bytes = 2 * 2 * 2 * 32 * 2 * 128 * 2
    budget = weight_bytes + kv_bytes - 12_345

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the measurement ran for a budget the shapes already rule out")

    monkeypatch.setattr(quant.budget, "measure", never)
    start = time.perf_counter()
    rc = quantize_main([str(src), str(tmp_path / "out"), "--weights", "int4", "--ctx", "128", "--parallel", "2",
                        "--budget", str(budget), "-q"])
    seconds = time.perf_counter() - start
    err = capsys.readouterr().err
    assert rc == 2, err
    assert (f"--budget {budget / 1e6:,.2f} MB cannot be met: it is {12_345 / 1e6:,.2f} MB short of the smallest "
            f"plan (every linear at its fewest bytes): weights {weight_bytes / 1e6:,.2f} MB + KV "
            f"{kv_bytes / 1e6:,.2f} MB for 128 tokens x 2 (fp16) = {(weight_bytes + kv_bytes) / 1e6:,.2f} MB") in err
    assert not (tmp_path / "out").exists()
    assert seconds < 10, seconds  # the tiny model's shapes take well under a second; the measurement is never run
    # one byte more and the plan is all g128: the measurement runs (here: refuses to, as patched)
    with pytest.raises(AssertionError, match="the measurement ran"):
        quantize_main([str(src), str(tmp_path / "out"), "--weights", "int4", "--ctx", "128", "--parallel", "2",
                       "--budget", str(weight_bytes + kv_bytes), "-q"])


def test_a_budget_that_cannot_be_met_and_a_machine_too_small(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture) -> None:
    src = make_tiny_folder(tmp_path / "src")
    args = [str(src), str(tmp_path / "out"), "--weights", "int4", "--ctx", "128", "--parallel", "2", "-q"]
    assert quantize_main([*args, "--budget", "100kB"]) == 2
    err = capsys.readouterr().err
    assert "--budget 0.10 MB cannot be met: it is" in err and "short of the smallest plan" in err
    assert "KV 0.13 MB for 128 tokens x 2 (fp16)" in err
    assert not (tmp_path / "out").exists()
    assert quantize_main([*args, "--budget", "1MB", "--format", "gguf"]) == 2
    assert "--budget writes --format edgeinfer or compressed-tensors, not gguf" in capsys.readouterr().err
    assert quantize_main([*args, "--budget", "1MB"]) == 0
    loaded = load_model(tmp_path / "out")
    assert dict(loaded.budget_plan)["ctx"] == 128
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    config["edgeinfer_plan"]["kv_bytes"] = 10**15  # planned for a machine far larger than this one
    (tmp_path / "out" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"planned for weights .* MB \+ KV 1,000,000,000 MB \(128 tokens x 2, fp16\)"):
        build_runners(load_model(tmp_path / "out"), RuntimeConfig(linear_path="reference"))
