"""Ctrl-C mid-run: every long command ends with exit status 130, one line saying so, no
traceback, and no partial output file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def interrupt(args: list[str], ready: str, tmp_path: Path) -> tuple[int, str]:
    """Run `edgeinfer ARGS`, send SIGINT once its stderr shows ``ready`` (the run is under way),
    return (exit status, stderr)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "EDGEINFER_CONFIG_DIR": str(tmp_path / "config")}
    # SIGINT back to its default in the child, as a terminal's Ctrl-C finds it: a shell starts
    # background jobs with SIGINT ignored, and an ignored SIGINT is inherited (Python then never
    # raises KeyboardInterrupt), so `make test &` would otherwise fail here.
    process = subprocess.Popen([sys.executable, "-m", "edgeinfer.cli", *args], env=env, text=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = ""
    deadline = time.monotonic() + 120
    assert process.stderr is not None
    while ready not in seen and time.monotonic() < deadline:
        chunk = process.stderr.read(1)
        if not chunk:
            break
        seen += chunk
    assert ready in seen, f"never saw {ready!r}: {seen[-500:]}"
    time.sleep(0.3)  # into the work itself, not just past the line
    process.send_signal(signal.SIGINT)
    rest = process.stderr.read()
    return process.wait(timeout=60), seen + rest


def assert_one_line(stderr: str, command: str) -> None:
    assert "Traceback" not in stderr, stderr
    assert stderr.strip().splitlines()[-1].startswith(f"edgeinfer {command}: interrupted"), stderr


def test_quantize(default_model_path, tmp_path) -> None:  # noqa: ANN001
    dst = tmp_path / "out"
    args = ["quantize", str(default_model_path), str(dst), "--weights", "int8"]
    status, stderr = interrupt(args, "weight/s", tmp_path)
    assert status == 130
    assert_one_line(stderr, "quantize")
    assert not dst.exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_eval_ppl(default_model_path, tmp_path) -> None:  # noqa: ANN001
    status, stderr = interrupt(["eval-ppl", str(default_model_path)], "scoring", tmp_path)  # the bundled text
    assert status == 130
    assert_one_line(stderr, "eval-ppl")


def test_generate(default_model_path, tmp_path) -> None:  # noqa: ANN001
    status, stderr = interrupt(["generate", "-v", "Tell me a long story.", "--max-tokens", "4000",
                                "--model", str(default_model_path)], "engine ready", tmp_path)
    assert status == 130
    assert_one_line(stderr, "generate")


def test_serve(default_model_path, tmp_path) -> None:  # noqa: ANN001
    """Ctrl-C drains like SIGTERM, then says so and exits 130."""
    status, stderr = interrupt(["serve", "--model", str(default_model_path), "--port", "0", "--kv-memory", "64MB",
                                "-v"], "engine ready", tmp_path)
    assert status == 130
    assert_one_line(stderr, "serve")
