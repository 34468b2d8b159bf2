"""The README's commands: generate answers, bench reports its fields."""

import json
import subprocess
import sys


def _edgeinfer(*args: str, model) -> subprocess.CompletedProcess:  # noqa: ANN001
    cmd = [sys.executable, "-m", "edgeinfer.cli", *args, "--model", str(model)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def test_generate_capital_of_france(default_model_path) -> None:
    result = _edgeinfer("generate", "What is the capital of France?", "--max-tokens", "16",
                        "--temperature", "0", model=default_model_path)
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_bench_json(default_model_path) -> None:
    result = _edgeinfer("bench", "--prompt-tokens", "40", "--new-tokens", "4", "--json", model=default_model_path)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["prompt_tokens"] == 40 and report["new_tokens"] == 4
    assert report["prefill_tok_s"] > 0 and report["decode_tok_s"] > 0 and report["peak_rss_mb"] > 0


def test_prompt_too_long_is_a_clear_error(default_model_path) -> None:
    result = _edgeinfer("generate", "hi " * 9000, "--max-tokens", "4", model=default_model_path)
    assert result.returncode == 2
    assert "prompt_too_long" in result.stderr
