"""The README's commands: generate answers, bench reports its fields."""

import argparse
import json
import os
import socket
import subprocess
import sys

import pytest


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


def test_speculative_generate_prints_what_plain_generate_prints(default_model_path) -> None:
    prompt = "Repeat exactly: the quick brown fox jumps over the lazy dog, the quick brown fox."
    args = ("generate", prompt, "--max-tokens", "24", "--temperature", "0")
    plain = _edgeinfer(*args, model=default_model_path)
    assert plain.returncode == 0, plain.stderr
    for extra in (("--speculative", "ngram"), ("--draft-model", str(default_model_path))):
        result = _edgeinfer(*args, *extra, model=default_model_path)
        assert result.returncode == 0, result.stderr
        assert result.stdout == plain.stdout, extra


def test_missing_draft_model_is_a_clear_error(default_model_path, tmp_path) -> None:
    result = _edgeinfer("generate", "hi", "--draft-model", str(tmp_path / "nope.gguf"), model=default_model_path)
    assert result.returncode == 2
    assert "nope.gguf" in result.stderr
    both = _edgeinfer("generate", "hi", "--speculative", "ngram", "--draft-model", str(default_model_path),
                      model=default_model_path)
    assert both.returncode == 2 and "choose one" in both.stderr


def test_beam_search_generate(default_model_path) -> None:
    args = ("generate", "What is the capital of France?", "--max-tokens", "12")
    width1 = _edgeinfer(*args, "--beam-width", "1", model=default_model_path)
    greedy = _edgeinfer(*args, "--temperature", "0", model=default_model_path)
    assert width1.returncode == 0, width1.stderr
    assert width1.stdout == greedy.stdout  # one beam is greedy decoding
    result = _edgeinfer(*args, "--beam-width", "3", "--num-results", "2", model=default_model_path)
    assert result.returncode == 0, result.stderr
    headers = [line for line in result.stdout.splitlines() if line.startswith("--- ")]
    assert [h.split()[1] for h in headers] == ["1", "2"]
    scores = [float(h.split()[3]) for h in headers]
    assert scores[0] >= scores[1]
    assert "Paris" in result.stdout


def test_beam_search_refuses_sampling_flags(default_model_path) -> None:
    result = _edgeinfer("generate", "hi", "--beam-width", "2", "--temperature", "0.7", model=default_model_path)
    assert result.returncode == 2
    assert "--temperature" in result.stderr


def test_separate_key_and_value_cache_formats(default_model_path) -> None:
    # Greedy: sampled, an unseeded draw could part from the answer at the first token whatever
    # the caches (it did, once the activation rounding moved: 'La' at p = 0.13).
    result = _edgeinfer("generate", "What is the capital of France?", "--max-tokens", "16", "--k-dtype", "int8",
                        "--v-dtype", "int4", "--temperature", "0", model=default_model_path)
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_generate_errors_name_the_flags(default_model_path) -> None:
    """Refused values are named as typed on the command line, not as SamplingParams fields."""
    result = _edgeinfer("generate", "hi", "--beam-width", "2", "--num-results", "3", model=default_model_path)
    assert result.returncode == 2 and "--num-results must be <= --beam-width=2" in result.stderr, result.stderr
    result = _edgeinfer("generate", "hi", "--top-p", "2", model=default_model_path)
    assert result.returncode == 2 and "--top-p must be in (0, 1], got 2.0" in result.stderr, result.stderr



def test_memory_plan_flags() -> None:
    """--ctx, --parallel and --kv-memory (serve, daemon, chat) are refused as typed when they are
    not sizes; generate, whose pool fits its one request, does not offer them."""
    for flag, value, message in (("--kv-memory", "lots", "'lots' is not a size"),
                                 ("--kv-memory", "0%", "must be in (0, 100]"),
                                 ("--ctx", "0", "argument --ctx: must be positive, got 0"),
                                 ("--parallel", "two", "argument --parallel: 'two' is not a whole number")):
        result = subprocess.run([sys.executable, "-m", "edgeinfer.cli", "serve", flag, value],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and message in result.stderr, result.stderr
    result = subprocess.run([sys.executable, "-m", "edgeinfer.cli", "generate", "hi", "--kv-memory", "1GB"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "unrecognized arguments: --kv-memory" in result.stderr, result.stderr


def test_every_option_explains_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """--help gives every option of every subcommand a description and shows its default, the same
    --log-level / -v everywhere; --version answers."""
    monkeypatch.setenv("COLUMNS", "4000")  # one line per option: wrapping splits words at hyphens
    from edgeinfer.cli.main import build_parser, subcommands
    from edgeinfer.cli.quantize import _ppl_parser, _quantize_parser
    from edgeinfer.cli.serve import _daemon_parser, _serve_parser

    main, daemon = build_parser(), _daemon_parser()
    commands = [p for p in (*subcommands(main).values(), *subcommands(daemon).values()) if p.add_help]
    commands += [_quantize_parser(), _ppl_parser(), _serve_parser("edgeinfer serve")]
    parsers = [main, daemon, *commands]
    silent = [f"{p.prog} {'/'.join(a.option_strings) or a.dest}" for p in parsers for a in p._actions
              if not a.help and not isinstance(a, argparse._SubParsersAction)]
    assert not silent, silent
    switch = (argparse._StoreTrueAction, argparse._StoreConstAction, argparse._HelpAction, argparse._VersionAction)
    for parser in parsers:
        text = " ".join(parser.format_help().split())
        for action in parser._actions:
            unset = action.default in (None, argparse.SUPPRESS, [], (None, None))
            if action.option_strings and not unset and not isinstance(action, switch):
                shown = " ".join(f"{action.help} (default: {action.default})".split())
                assert shown in text or "default" in action.help, f"{parser.prog} {action.option_strings}"
    for parser in commands:
        flags = {s for a in parser._actions for s in a.option_strings}
        assert {"--log-level", "-v"} <= flags, parser.prog
    result = subprocess.run([sys.executable, "-m", "edgeinfer.cli", "--version"], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.startswith("edgeinfer ")


def test_num_results_without_beam_search_is_refused(default_model_path) -> None:
    result = _edgeinfer("generate", "hi", "--num-results", "3", model=default_model_path)
    assert result.returncode == 2 and "--num-results" in result.stderr and "--beam-width" in result.stderr


def test_serve_on_a_busy_port_fails_naming_it_before_loading_the_model(default_model_path, tmp_path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        env = {**os.environ, "EDGEINFER_CONFIG_DIR": str(tmp_path)}
        result = subprocess.run([sys.executable, "-m", "edgeinfer.cli", "serve", "--port", str(port),
                                 "--model", str(default_model_path), "-v"],
                                capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "loading" not in result.stderr  # it failed before the model load began
