"""Quality and cost of each weight format for a model: prints a markdown table (or --json).

--model is any source ``edgeinfer quantize`` accepts (GGUF file, HF folder; --gguf is its old
name). Rows: fp32 (every weight dequantized from the source), the source itself, and edgeinfer
checkpoints converted from it by ``edgeinfer quantize``: int8 (per row), int4 round-to-nearest g128/g64/g32
(g32 = the GGUF's Q4_1 bits), int4 g128 GPTQ, AWQ and AWQ+GPTQ, nf4 g64, and a ``--budget`` plan
at each of --budgets (for --budget-ctx tokens x 1 sequence, fp16 KV; its row says the plan's
mix of precisions). Columns: perplexity on the first --tokens tokens of the text in --window
windows (reference linear path, fp32 KV), its change against fp32, file size, load time
(load_model, warm page cache), decode tok/s (as the engine builds it, batch 1, median step),
conversion time and conversion peak RSS (the converter runs as a child process; os.wait4's
ru_maxrss). GPTQ and AWQ calibrate on --calib-tokens of the text's second half, disjoint from
the scored slice; a budget plan measures its layers on the bundled calibration text
(quant.budget).

    .venv/bin/python tools/quant_report.py [--model SRC] [--tokens 4096] [--calib-tokens 4096] [--json]
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from edgeinfer.config import ModelConfig, RuntimeConfig  # noqa: E402
from edgeinfer.models.llama import LlamaModel  # noqa: E402
from edgeinfer.models.loader import LoadedModel, load_model  # noqa: E402
from edgeinfer.worker.batch import SeqChunk  # noqa: E402
from edgeinfer.worker.build import build_model  # noqa: E402
from edgeinfer.worker.kv_pools import kv_pool  # noqa: E402
from edgeinfer.worker.model_runner import ModelRunner  # noqa: E402
from kernels.dispatch import choose_backend  # noqa: E402
from quant.formats import QuantizedTensor  # noqa: E402
from quant.perplexity import model_perplexity, text_tokens  # noqa: E402

WARMUP_STEPS = 4  # decode steps run before timing starts (first-call costs)
DEFAULT_GGUF = str(Path.home() / ".cache" / "edgeinfer" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
DEFAULT_TEXT = str(REPO.parent / "shared" / "data" / "tinyshakespeare.txt")
DEFAULT_BUDGETS = ("143MB", "144MB")  # default model, 2048 x 1 fp16 KV: a mix of g32 / g128, and all g32
CONVERSIONS = {  # row name -> quantize arguments
    "int8": ["--weights", "int8"],
    "int4 g128 RTN*": ["--weights", "int4", "--group-size", "128"],
    "int4 g64 RTN": ["--weights", "int4", "--group-size", "64"],
    "int4 g32 RTN": ["--weights", "int4", "--group-size", "32"],
    "int4 g128 GPTQ*": ["--weights", "int4", "--group-size", "128", "--calibrate", "gptq"],
    "int4 g128 AWQ*": ["--weights", "int4", "--group-size", "128", "--calibrate", "awq"],
    "int4 g128 AWQ+GPTQ*": ["--weights", "int4", "--group-size", "128", "--calibrate", "awq+gptq"],
    "nf4 g64": ["--weights", "nf4", "--group-size", "64"],
}


_MAXRSS_WRAPPER = """
import os, subprocess, sys
proc = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL)
_, status, usage = os.wait4(proc.pid, 0)
print(usage.ru_maxrss)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def _size(path: Path) -> int:
    return (
        path.stat().st_size
        if path.is_file()
        else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    )


def _convert(src: str, dst: Path, extra: list[str]) -> tuple[float, float]:
    """Run the converter as a child; (seconds, peak RSS in MiB)."""
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "edgeinfer.cli", "quantize", src, str(dst), "-q", "--force", *extra]
    # Linux folds the RSS a child had when it was forked into its ru_maxrss across exec; forked
    # from this (large) process it would report our size. A small wrapper forks the converter.
    out = subprocess.run([sys.executable, "-c", _MAXRSS_WRAPPER, *cmd], cwd=REPO, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"conversion failed ({out.returncode}): {' '.join(cmd)}\n{out.stderr[-2000:]}")
    return time.perf_counter() - start, int(out.stdout.split()[-1]) / 1024


def _plan_mix(checkpoint: Path) -> str:
    """A budget plan's precisions, counted from the edgeinfer_plan its config.json stores."""
    plan = json.loads((checkpoint / "config.json").read_text())["edgeinfer_plan"]
    counts = collections.Counter(precision for _name, precision, _bytes, _error in plan["layers"])
    return ", ".join(f"{n} {precision}" for precision, n in sorted(counts.items()))


def _source_formats(loaded: LoadedModel) -> str:
    """The source's linear weights' formats (a GGUF's quantized formats, or a folder's dtypes)."""
    formats = collections.Counter(
        f"{w.format} g{w.group_size}" if isinstance(w, QuantizedTensor) else str(w.dtype).removeprefix("torch.")
        for name, w in loaded.weights.items() if name.startswith("model.layers.") and len(w.shape) == 2
    )
    return "/".join(f for f, _ in formats.most_common())


def _g128_footnote(config: ModelConfig) -> str:
    """Which linears the *g128 rows hold at g128: the converter falls back to g64 where 128 does
    not divide a linear's input size K."""
    ks = {"hidden": config.hidden_size, "intermediate (down_proj)": config.intermediate_size,
          "heads x head_dim (o_proj)": config.num_heads * config.head_dim}
    odd = {name: k for name, k in ks.items() if k % 128}
    if not odd:
        return "*g128 everywhere (every K is a multiple of 128: " + ", ".join(f"{n} {k}" for n, k in ks.items()) + ")."
    fine = [f"{n}, K={k}" for n, k in ks.items() if n not in odd]
    return (f"*g128 where it divides K ({'; '.join(fine) or 'nowhere'}), g64 where "
            + ", ".join(f"K={k}" for k in sorted(set(odd.values()))) + " (not a multiple of 128).")


def _decode_tok_s(loaded: LoadedModel, num_tokens: int) -> float:
    """Batch-1 decode speed as the engine builds the model (build_model, default RuntimeConfig:
    int4_cpu path, int4 head with exact refinement). 1 / median step time: the machine is
    shared, and the median ignores steps a neighbour's job stretched."""
    model = build_model(loaded, RuntimeConfig())
    c = loaded.config
    num_tokens += WARMUP_STEPS
    num_blocks = (16 + num_tokens) // 16 + 1
    runner = ModelRunner(model, kv_pool(c, num_blocks, 16, "fp32", "fp32"), 16)
    table = tuple(range(num_blocks))
    token = int(runner.logits([SeqChunk(tuple(range(100, 116)), 0, table)]).argmax(-1)[0])
    steps = []
    for pos in range(16, 16 + num_tokens):
        start = time.perf_counter()
        token = int(runner.logits([SeqChunk((token,), pos, table)]).argmax(-1)[0])
        steps.append(time.perf_counter() - start)
    return 1.0 / statistics.median(steps[WARMUP_STEPS:])


def _measure(path: str, token_ids: list[int], args: argparse.Namespace, dequantize: bool = False) -> dict:
    start = time.perf_counter()
    loaded = load_model(path)
    load_s = time.perf_counter() - start
    weights = loaded.weights
    has_nf4 = any(isinstance(w, QuantizedTensor) and w.format == "nf4" for w in weights.values())
    if dequantize or has_nf4:
        # nf4: LlamaModel cannot fuse nf4 QKV yet (quant.formats.concat_rows refuses it), so the
        # perplexity runs on the dequantized values (the reference path's exact numbers) and no
        # decode speed is reported.
        weights = {
            n: w.dequantize() if isinstance(w, QuantizedTensor) else w.float() for n, w in weights.items()
        }
    model = LlamaModel(loaded.config, weights, choose_backend("reference"))
    ppl = model_perplexity(model, loaded.tokenizer, token_ids, args.window).perplexity
    del model
    tok_s = None if has_nf4 else _decode_tok_s(replace(loaded, weights=weights), args.decode_tokens)
    return {"perplexity": ppl, "load_s": load_s, "decode_tok_s": tok_s}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", "--gguf", dest="model", default=DEFAULT_GGUF,
                   help="source: GGUF file or HF folder, as `edgeinfer quantize` takes it (default: the default model)")
    p.add_argument("--text", default=DEFAULT_TEXT)
    p.add_argument("--tokens", type=int, default=4096, help="tokens scored (default 4096)")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--calib-tokens", type=int, default=4096)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--rows", nargs="*", default=list(CONVERSIONS), help="conversions to run")
    p.add_argument("--budgets", nargs="*", default=list(DEFAULT_BUDGETS), help="--budget plans to run")
    p.add_argument("--budget-ctx", type=int, default=2048, help="--ctx of the budget plans (1 sequence, fp16 KV)")
    p.add_argument("--workdir", help="where checkpoints go (default: a temporary folder)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="quant_report-"))
    work.mkdir(parents=True, exist_ok=True)
    text = Path(args.text).read_text(encoding="utf-8")
    calib = work / "calib.txt"
    calib.write_text(text[len(text) // 2 :])  # disjoint from the scored slice at the start
    source = load_model(args.model)
    token_ids = text_tokens(source.tokenizer, args.text, args.tokens)
    fp32_bytes = sum(int(torch.Size(w.shape).numel()) * 4 for w in source.weights.values())
    kind = {"gguf": "GGUF", "hf": "HF folder"}.get(source.source, source.source)
    footnote = _g128_footnote(source.config)
    source_label = f"{kind} {_source_formats(source)} (source)"
    del source
    rows: list[dict] = []
    rows.append(
        {"format": f"fp32 (from {kind})", "file_bytes": fp32_bytes, **_measure(args.model, token_ids, args, True)}
    )
    rows[-1]["load_s"] = None  # dequantized in memory, never a file
    rows.append(
        {
            "format": source_label,
            "file_bytes": _size(Path(args.model)),
            **_measure(args.model, token_ids, args),
        }
    )
    conversions = {name: CONVERSIONS[name] for name in args.rows}
    for budget in args.budgets:
        conversions[f"--budget {budget}"] = ["--weights", "int4", "--budget", budget, "--ctx", str(args.budget_ctx),
                                             "--parallel", "1"]
    for name, arguments in conversions.items():
        extra = list(arguments)
        if "--calibrate" in extra:
            extra += ["--calib-data", str(calib), "--calib-tokens", str(args.calib_tokens),
                      "--calib-seqlen", str(min(512, args.calib_tokens))]
        dst = work / name.replace(" ", "_").replace("+", "_").strip("-*")
        seconds, rss = _convert(args.model, dst, extra)
        rows.append(
            {
                "format": f"{name} ({_plan_mix(dst)})" if "--budget" in extra else name,
                "file_bytes": _size(dst),
                **_measure(str(dst), token_ids, args),
                "convert_s": seconds,
                "convert_peak_rss_mib": rss,
            }
        )
    base = rows[0]["perplexity"]
    for row in rows:
        row["ppl_vs_fp32_pct"] = 100 * (row["perplexity"] / base - 1)
    settings = {
        "tokens": args.tokens,
        "window": args.window,
        "calib_tokens": args.calib_tokens,
        "decode_tokens": args.decode_tokens,
        "budget_ctx": args.budget_ctx,
        "threads": torch.get_num_threads(),
    }
    if args.json:
        print(json.dumps({"settings": settings, "rows": rows}, indent=1))
        return 0
    print(
        f"Perplexity on the first {args.tokens} tokens of {Path(args.text).name} "
        f"({args.window}-token windows); GPTQ and AWQ calibrated on {args.calib_tokens} tokens of the text's "
        f"second half; --budget plans for {args.budget_ctx} tokens x 1 (fp16 KV), measured on the bundled "
        f"calibration text; {settings['threads']} threads. {footnote}\n"
    )
    print("| format | perplexity | vs fp32 | file MB | load s | decode tok/s | convert s | convert peak RSS MiB |")  # noqa: E501
    print("|---|---|---|---|---|---|---|---|")
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for r in rows:
        print(
            f"| {r['format']} | {r['perplexity']:.3f} | {r['ppl_vs_fp32_pct']:+.2f}% "
            f"| {r['file_bytes'] / 1e6:.1f} "
            f"| {fmt(r['load_s'], '.2f')} | {fmt(r['decode_tok_s'], '.1f')} | {fmt(r.get('convert_s'), '.1f')} "
            f"| {fmt(r.get('convert_peak_rss_mib'), '.0f')} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
