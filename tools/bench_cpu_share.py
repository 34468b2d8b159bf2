"""The engine beside busy programs: threads that follow the free cores (worker/cpu_share.py,
the default) against --fixed-threads, alternated, with N busy loops (one Python process each,
`while True: pass`) running for the whole round.

Per round and busy count: one stream (`edgeinfer bench --prompt-tokens 64 --new-tokens 128`,
prefill / decode tok/s) and 16 streams (`tools/bench_serving.py --target engine --streams 16`,
aggregate decode tok/s), each with and without --fixed-threads.

    python tools/bench_cpu_share.py [--busy 0 1 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one_stream(fixed: bool) -> str:
    cmd = [sys.executable, "-m", "edgeinfer.cli", "bench", "--prompt-tokens", "64", "--new-tokens", "128", "--json"]
    out = json.loads(subprocess.run(cmd + (["--fixed-threads"] if fixed else []), capture_output=True, text=True,
                                    check=True, cwd=ROOT).stdout)
    return f"{out['prefill_tok_s']:.0f} / {out['decode_tok_s']:.1f}"


def sixteen_streams(fixed: bool) -> str:
    cmd = [sys.executable, str(ROOT / "tools" / "bench_serving.py"), "--target", "engine", "--streams", "16",
           "--new-tokens", "64", "--json"]
    lines = subprocess.run(cmd + (["--fixed-threads"] if fixed else []), capture_output=True, text=True, check=True,
                           cwd=ROOT).stdout.splitlines()
    rows = next(json.loads(line)["rows"] for line in lines if line.startswith("{"))
    return f"{rows[-1]['decode_tok_s']:.1f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--busy", type=int, nargs="+", default=[0, 1, 2], help="busy loops beside the engine")
    p.add_argument("--rounds", type=int, default=3, help="alternated rounds per busy count (default: 3)")
    args = p.parse_args()
    print("busy  round  threads  1 stream prefill / decode tok/s  16 streams decode tok/s")
    for busy in args.busy:
        loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
        try:
            time.sleep(0.5)
            for r in range(args.rounds):
                for fixed in (True, False):
                    print(f"{busy:4d}  {r:5d}  {'fixed' if fixed else 'share':7s}  {one_stream(fixed):>32s}  "
                          f"{sixteen_streams(fixed):>23s}", flush=True)
        finally:
            for loop in loops:
                loop.kill()
                loop.wait()


if __name__ == "__main__":
    main()
