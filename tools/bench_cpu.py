"""CPU speed against the peers on the same GGUF: edgeinfer, llama.cpp (llama-cpp-python), transformers.

Each engine runs in its own subprocess (so peak RSS is its own) with the same thread count, the
same prompt (cut from tinyshakespeare) of --prompt-tokens tokens, then --new-tokens greedy
decode steps one token at a time. Prints a table with ratios against llama.cpp.

    python tools/bench_cpu.py [--model FILE] [--prompt-tokens 256] [--new-tokens 128] [--threads 2]
                              [--runs 3] [--engines edgeinfer llama.cpp] [--cpu-activations int16 int8x2] [--json]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"


def _prompt_ids(tokenizer_encode, n: int) -> list[int]:  # noqa: ANN001
    text = CORPUS.read_text()[: n * 8] if CORPUS.is_file() else "the quick brown fox " * n
    return tokenizer_encode(text)[:n]


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_edgeinfer(model: str, prompt_tokens: int, new_tokens: int, threads: int, cpu_activations: str) -> dict:
    cmd = [sys.executable, "-m", "edgeinfer.cli", "bench", "--model", model, "--prompt-tokens", str(prompt_tokens),
           "--new-tokens", str(new_tokens), "--threads", str(threads), "--cpu-activations", cpu_activations, "--json"]
    if CORPUS.is_file():
        cmd += ["--text", str(CORPUS)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT).stdout
    return json.loads(out.strip().splitlines()[-1])


def worker_llamacpp(model: str, prompt_tokens: int, new_tokens: int, threads: int) -> dict:
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(model_path=model, n_threads=threads, n_threads_batch=threads, n_ctx=prompt_tokens + new_tokens + 8,
                n_batch=512, verbose=False, logits_all=False)
    ids = _prompt_ids(lambda t: llm.tokenize(t.encode(), add_bos=False), prompt_tokens)

    def next_token() -> int:
        # The last token's logits, from the context (without logits_all the binding keeps no
        # scores: llm.scores is never written, and it has n_batch rows, fewer than a long prompt).
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))

    llm.eval(ids[:16])  # warm-up
    llm.reset()
    start = time.perf_counter()
    llm.eval(ids)
    prefill_s = time.perf_counter() - start
    token = next_token()
    start = time.perf_counter()
    for _ in range(new_tokens):
        llm.eval([token])
        token = next_token()
    decode_s = time.perf_counter() - start
    return {"prefill_tok_s": len(ids) / prefill_s, "decode_tok_s": new_tokens / decode_s, "peak_rss_mb": _peak_rss_mb()}


def worker_transformers(model: str, prompt_tokens: int, new_tokens: int, threads: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    path = Path(model)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    lm = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    ids = torch.tensor([_prompt_ids(lambda t: tok(t, add_special_tokens=False)["input_ids"], prompt_tokens)])
    with torch.inference_mode():
        lm(ids[:, :16])
        start = time.perf_counter()
        out = lm(ids, use_cache=True)
        prefill_s = time.perf_counter() - start
        past, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        start = time.perf_counter()
        for _ in range(new_tokens):
            out = lm(token, past_key_values=past, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        decode_s = time.perf_counter() - start
    return {"prefill_tok_s": ids.shape[1] / prefill_s, "decode_tok_s": new_tokens / decode_s,
            "peak_rss_mb": _peak_rss_mb()}


WORKERS = {"llama.cpp": worker_llamacpp, "transformers": worker_transformers}


def run_worker(name: str, args: argparse.Namespace) -> dict | None:
    cmd = [sys.executable, __file__, "--worker", name, "--model", args.model, "--prompt-tokens",
           str(args.prompt_tokens), "--new-tokens", str(args.new_tokens), "--threads", str(args.threads)]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if result.returncode != 0:
        print(f"# {name} skipped: {result.stderr.strip().splitlines()[-1] if result.stderr else 'failed'}",
              file=sys.stderr)
        return None
    return json.loads(result.stdout.strip().splitlines()[-1])


def _engine_runs(args: argparse.Namespace) -> list[tuple[str, Callable[[], dict | None]]]:
    """(row name, run) for each engine asked for: edgeinfer once per --cpu-activations mode."""
    runs = []
    for name in args.engines:
        if name == "edgeinfer":
            for mode in args.cpu_activations:
                label = "edgeinfer" if len(args.cpu_activations) == 1 else f"edgeinfer {mode}"
                runs.append((label, lambda mode=mode: run_edgeinfer(args.model, args.prompt_tokens, args.new_tokens,
                                                                    args.threads, mode)))
        else:
            runs.append((name, lambda name=name: run_worker(name, args)))
    return runs


def _spread(values: list[float], fmt: str = ".1f") -> str:
    """median (min-max): the machine is shared, so one figure alone says little."""
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:{fmt}}"
    return f"{med:{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3, help="rounds; each round runs every engine once, in turn")
    parser.add_argument("--engines", nargs="+", choices=("edgeinfer", "llama.cpp", "transformers"),
                        default=["edgeinfer", "llama.cpp", "transformers"])
    parser.add_argument("--cpu-activations", nargs="+", default=["auto"],
                        choices=("auto", "int16", "int8", "int8x2", "int8x2-lean", "bf16"),
                        help="edgeinfer's activation rounding (default: auto, as the engine); several: a row each")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.model is None:
        sys.path.insert(0, str(ROOT))
        from edgeinfer.models.pull import default_model_path, pull

        args.model = str(default_model_path() if default_model_path().is_file() else pull())
    if args.worker:
        print(json.dumps(WORKERS[args.worker](args.model, args.prompt_tokens, args.new_tokens, args.threads)))
        return 0

    engines = _engine_runs(args)
    runs: dict[str, list[dict]] = {name: [] for name, _ in engines}
    for _ in range(args.runs):  # alternated, so slow phases of a shared machine hit every engine
        for name, run in engines:
            if runs[name] is None:
                continue
            result = run()
            if result is None:
                runs[name] = None
            else:
                runs[name].append(result)
    rows = {name: r for name, r in runs.items() if r}
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    base = rows.get("llama.cpp")
    print(f"prompt {args.prompt_tokens} tokens, {args.new_tokens} greedy decode steps, {args.threads} threads, "
          f"{args.runs} alternated runs: median (min-max)")
    extra = " prefill / decode / RSS vs llama.cpp (same round) |" if base else ""
    print(f"| engine | prefill tok/s | decode tok/s | peak RSS MB |{extra}")
    print(f"|---|---|---|---|{'---|' if base else ''}")
    for name, r in rows.items():
        ratio = ""
        if base:
            pairs = list(zip(r, base, strict=False))  # a peer that failed a round has fewer
            ratio = " " + " / ".join(
                _spread([a[key] / b[key] for a, b in pairs], ".2f") + "x"
                for key in ("prefill_tok_s", "decode_tok_s", "peak_rss_mb")) + " |"
        cells = " | ".join(_spread([x[key] for x in r], ".0f" if key == "peak_rss_mb" else ".1f")
                           for key in ("prefill_tok_s", "decode_tok_s", "peak_rss_mb"))
        print(f"| {name} | {cells} |{ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
