"""Tokenizer parity with the HF tokenizer transformers builds from the same GGUF."""

import copy

import pytest
from tokenizer_fixtures import corpus as _corpus

from edgeinfer.models.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(loaded_model) -> Tokenizer:
    return loaded_model.tokenizer


def _mismatches(tokenizer: Tokenizer, backend, corpus: list[str]) -> list[str]:
    return [s for s in corpus if tokenizer.encode(s) != backend.encode(s, add_special_tokens=False).ids]


def test_encode_matches_transformers(tokenizer: Tokenizer, hf_reference) -> None:
    _, hf_tok = hf_reference
    corpus = [s for s in _corpus() if not any(ch.isdigit() for ch in s)]
    assert len(corpus) >= 200
    bad = _mismatches(tokenizer, hf_tok.backend_tokenizer, corpus)
    assert not bad, f"{len(bad)} strings differ, e.g. {bad[:3]!r}"


def test_digits_split_as_the_models_own_tokenizer(tokenizer: Tokenizer, hf_reference) -> None:
    """GGUF says pre-tokenizer 'smollm': digits split one by one before the GPT-2 regex, as in
    SmolLM2's tokenizer.json and llama.cpp. transformers' GGUF import has no 'smollm' entry and
    falls back to plain GPT-2 splitting, which differs on whitespace runs before a digit
    ("x  5"). With its pre-tokenizer set to the model's own, transformers agrees everywhere."""
    from tokenizers import pre_tokenizers

    _, hf_tok = hf_reference
    backend = copy.deepcopy(hf_tok.backend_tokenizer)
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    corpus = _corpus()
    assert len(corpus) >= 300
    bad = _mismatches(tokenizer, backend, corpus)
    assert not bad, f"{len(bad)} strings differ, e.g. {bad[:3]!r}"
    assert tokenizer.encode("x  5") == [tokenizer.backend.token_to_id(t) for t in ("x", "ĠĠ", "5")]


def test_decode_round_trips(tokenizer: Tokenizer, hf_reference) -> None:
    _, hf_tok = hf_reference
    for s in _corpus():
        ids = tokenizer.encode(s)
        assert tokenizer.decode(ids, skip_special=False) == s
        assert tokenizer.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)


def test_chat_template_matches_transformers(tokenizer: Tokenizer, hf_reference) -> None:
    _, hf_tok = hf_reference
    conversations = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi 😀"},
         {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Count: 1 2 3"}],
    ]
    for messages in conversations:
        for add in (True, False):
            ours = tokenizer.apply_chat_template(messages, add_generation_prompt=add)
            theirs = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)
            assert ours == theirs
            assert tokenizer.encode(ours) == hf_tok(ours, add_special_tokens=False)["input_ids"]


def test_incremental_detokenizer_never_emits_half_a_character(tokenizer: Tokenizer) -> None:
    text = "émoji 😀🎉 中文 👩‍👩‍👧 ok"
    ids = tokenizer.encode(text)
    detok = tokenizer.detokenizer()
    pieces = [detok.push(i) for i in ids] + [detok.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    # At least one emoji spans several byte-level tokens, so some pushes must return "".
    assert "" in pieces[:-1]


def test_stop_ids_of_the_default_model(loaded_model) -> None:
    """The file names EOS <|im_end|>; <|endoftext|> also ends SmolLM2's generation (llama.cpp's
    end-of-generation list), and the engine's config carries the same set (read_config)."""
    tok = loaded_model.tokenizer
    ids = (tok.backend.token_to_id("<|im_end|>"), tok.backend.token_to_id("<|endoftext|>"))
    assert tok.stop_token_ids == loaded_model.config.eos_token_ids == ids
