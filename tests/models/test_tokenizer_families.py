"""Every tokenizer kind the target models use, from GGUF and from an HF folder, against
transformers on the same vocabulary (tests/tokenizer_fixtures.py makes them: no hub here).

References: transformers' AutoTokenizer on the HF folder, and transformers' own GGUF loader
(`AutoTokenizer.from_pretrained(dir, gguf_file=...)`) where it reads the file as the model's
runtime would. It does not honour `add_space_prefix = false` for a "llama" vocabulary under
architecture "llama" (it always puts "▁" before the text; it keys that choice on the
architecture, gemma), so that case is compared with the folder only.
"""

import json
import logging
from pathlib import Path

import pytest
from tokenizer_fixtures import (
    BPE_FAMILIES,
    EXTRA_TEXT,
    GEMMA_CHAT,
    corpus,
    save_hf_folder,
    train_byte_level,
    train_sentencepiece,
    write_byte_level_gguf,
    write_sentencepiece_gguf,
)

from edgeinfer.models.tokenizer import Tokenizer
from edgeinfer.models.tokenizer_gguf import tokenizer_from_gguf
from quant.gguf_import import ModelFileError, read_tokenizer_metadata
from quant.gguf_reader import open_gguf

transformers = pytest.importorskip("transformers")

TEXTS = [*corpus(), *EXTRA_TEXT, "<think>x</think> <|im_end|><|eot_id|></s>", "e\u0301 decomposed vs \u00e9",
         "   ", "\n\n\n", "x  5", "1234567890 12 345", "<start_of_turn>user\nhi<end_of_turn>"]
GEMMA_CONTROL = ("<start_of_turn>", "<end_of_turn>")


def _from_gguf(path: Path) -> Tokenizer:
    return tokenizer_from_gguf(read_tokenizer_metadata(open_gguf(path)))


@pytest.fixture(scope="module", params=sorted(BPE_FAMILIES))
def byte_level(request, tmp_path_factory):  # noqa: ANN001, ANN201
    pre = request.param
    _, bos, eos, template = BPE_FAMILIES[pre]
    folder = tmp_path_factory.mktemp(pre)
    tok = train_byte_level(pre)
    save_hf_folder(tok, folder, bos, eos, template)
    write_byte_level_gguf(tok, folder / "model.gguf", pre, bos, eos, template)
    return pre, folder


@pytest.fixture(scope="module", params=[True, False], ids=["llama2-prefix", "gemma-no-prefix"])
def sentencepiece(request, tmp_path_factory):  # noqa: ANN001, ANN201
    from transformers import LlamaTokenizer
    from transformers.tokenization_utils_base import generate_merges

    prefix = request.param
    folder = tmp_path_factory.mktemp(f"spm-{prefix}")
    tokens, scores = train_sentencepiece(GEMMA_CONTROL)
    vocab = {t: i for i, t in enumerate(tokens)}
    # The LlamaTokenizerFast-style tokenizer.json, merges recovered from the scores by transformers.
    hf = LlamaTokenizer(vocab=vocab, merges=generate_merges(vocab, dict(zip(tokens, scores, strict=True))),
                        add_prefix_space=prefix, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                        add_bos_token=True)  # as Llama 2's tokenizer_config.json
    hf.add_special_tokens({"additional_special_tokens": list(GEMMA_CONTROL)})
    hf.chat_template = GEMMA_CHAT
    hf.save_pretrained(str(folder))
    write_sentencepiece_gguf(tokens, scores, folder / "model.gguf", prefix, list(GEMMA_CONTROL), GEMMA_CHAT)
    return prefix, folder


def _mismatches(ours: Tokenizer, reference, texts: list[str], add_special: bool = False) -> list[str]:  # noqa: ANN001
    return [s for s in texts
            if ours.encode(s, add_special) != reference(s, add_special_tokens=add_special)["input_ids"]]


def test_byte_level_ids_match_transformers(byte_level) -> None:  # noqa: ANN001
    pre, folder = byte_level
    reference = transformers.AutoTokenizer.from_pretrained(str(folder))
    for ours in (_from_gguf(folder / "model.gguf"), Tokenizer.from_folder(folder)):
        bad = _mismatches(ours, reference, TEXTS)
        assert not bad, f"{pre}: {len(bad)} strings differ, e.g. {bad[:3]!r}"
        for s in TEXTS:
            ids = ours.encode(s, add_special=False)
            assert ours.decode(ids, skip_special=False) == reference.decode(ids) == (
                s if pre != "qwen2" else reference.backend_tokenizer.normalizer.normalize_str(s))
    gguf_reference = transformers.AutoTokenizer.from_pretrained(str(folder), gguf_file="model.gguf")
    bad = [s for s in TEXTS if gguf_reference(s, add_special_tokens=False)["input_ids"]
           != reference(s, add_special_tokens=False)["input_ids"]]
    assert not bad, f"{pre}: transformers' GGUF loader differs on {bad[:3]!r}"


def test_byte_level_special_tokens_and_template(byte_level) -> None:  # noqa: ANN001
    pre, folder = byte_level
    specials, bos, eos, template = BPE_FAMILIES[pre]
    reference = transformers.AutoTokenizer.from_pretrained(str(folder))
    ours = _from_gguf(folder / "model.gguf")
    for token in specials:  # control tokens are matched whole, never split or merged
        assert ours.encode(f"a{token}b", add_special=False)[1] == reference.convert_tokens_to_ids(token)
        assert ours.decode(ours.encode(token, add_special=False)) == ""  # skipped as special
    assert ours.encode("<think>", add_special=False) == [reference.convert_tokens_to_ids("<think>")]
    assert ours.decode(ours.encode("<think>", add_special=False)) == "<think>"  # user-defined: text
    if template is not None:
        messages = [{"role": "user", "content": "Hi 😀 1234"}, {"role": "assistant", "content": "Hello."}]
        for tok in (ours, Tokenizer.from_folder(folder)):
            rendered = tok.apply_chat_template(messages)
            assert rendered == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            assert tok.encode(rendered, add_special=False) == reference(rendered, add_special_tokens=False)["input_ids"]


def test_sentencepiece_ids_match_transformers(sentencepiece) -> None:  # noqa: ANN001
    prefix, folder = sentencepiece
    reference = transformers.AutoTokenizer.from_pretrained(str(folder))
    references = [reference]
    if prefix:  # see the module docstring for the other case
        references.append(transformers.AutoTokenizer.from_pretrained(str(folder), gguf_file="model.gguf"))
    for ours in (_from_gguf(folder / "model.gguf"), Tokenizer.from_folder(folder)):
        for ref in references:
            for add_special in (False, True):  # the GGUF and the folder both add BOS
                bad = _mismatches(ours, ref, TEXTS, add_special)
                assert not bad, f"{len(bad)} strings differ, e.g. {bad[:3]!r}"
        for s in TEXTS:
            ids = ours.encode(s, add_special=False)
            assert ours.decode(ids, skip_special=False) == reference.decode(ids)
            assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    # Bytes missing from the vocabulary come out as <0xNN> pieces and decode back whole.
    ours = _from_gguf(folder / "model.gguf")
    ids = ours.encode("🦜", add_special=False)
    assert [ours.backend.id_to_token(i) for i in ids[-4:]] == ["<0xF0>", "<0x9F>", "<0xA6>", "<0x9C>"]
    detok = ours.detokenizer()
    assert "".join([detok.push(i) for i in ids] + [detok.flush()]).strip() == "🦜"


def test_sentencepiece_stop_ids_and_template(sentencepiece) -> None:  # noqa: ANN001
    _, folder = sentencepiece
    reference = transformers.AutoTokenizer.from_pretrained(str(folder))
    ours = _from_gguf(folder / "model.gguf")
    end_of_turn = reference.convert_tokens_to_ids("<end_of_turn>")
    assert ours.stop_token_ids == (2, end_of_turn)  # EOS, then the end of turn the template writes
    messages = [{"role": "user", "content": "Hi 😀"}]
    rendered = ours.apply_chat_template(messages)
    assert rendered == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.encode(rendered, add_special=False) == reference(rendered, add_special_tokens=False)["input_ids"]


def test_stop_ids_follow_the_file(tmp_path: Path) -> None:
    """EOS, EOT and EOM ids from the metadata, and the end-of-turn tokens of the chat formats,
    whatever ids the file gives them: <|eot_id|> (Llama 3), <|im_end|> (ChatML)."""
    tok = train_byte_level("llama-bpe")
    _, bos, eos, template = BPE_FAMILIES["llama-bpe"]
    write_byte_level_gguf(tok, tmp_path / "a.gguf", "llama-bpe", bos, eos, template)
    vocab = tok.get_vocab()
    assert _from_gguf(tmp_path / "a.gguf").stop_token_ids == (vocab["<|end_of_text|>"], vocab["<|eot_id|>"])
    meta = read_tokenizer_metadata(open_gguf(tmp_path / "a.gguf"))
    meta = {**meta, "ggml.eos_token_id": vocab["<|eot_id|>"], "ggml.eot_token_id": vocab["<|eot_id|>"],
            "ggml.eom_token_id": vocab["<think>"]}
    # llama.cpp adds Llama 3's BOS where the file does not say (this one says no).
    assert not tokenizer_from_gguf(meta).add_bos
    assert tokenizer_from_gguf({k: v for k, v in meta.items() if k != "ggml.add_bos_token"}).add_bos
    # EOS, EOT, EOM in that order, once each, then the end-of-turn tokens the file does not name.
    expected = (vocab["<|eot_id|>"], vocab["<think>"], vocab["<|end_of_text|>"])
    assert tokenizer_from_gguf(meta).stop_token_ids == expected


def test_folder_generation_config(tmp_path: Path) -> None:
    tok = train_byte_level("qwen2")
    save_hf_folder(tok, tmp_path, None, "<|im_end|>", None)
    vocab = tok.get_vocab()
    generation = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
                  "eos_token_id": [vocab["<|im_end|>"], vocab["<|endoftext|>"]], "max_new_tokens": 2048}
    (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    ours = Tokenizer.from_folder(tmp_path)
    assert ours.stop_token_ids == (vocab["<|im_end|>"], vocab["<|endoftext|>"])
    assert ours.sampling_defaults == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    saved = tmp_path / "saved"
    saved.mkdir()
    ours.save(saved)
    again = Tokenizer.from_folder(saved)
    assert (again.stop_token_ids, again.sampling_defaults) == (ours.stop_token_ids, ours.sampling_defaults)
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.6}))
    assert Tokenizer.from_folder(tmp_path).sampling_defaults == {"temperature": 0.0}  # greedy, as transformers


def test_gguf_sampling_keys_are_the_models_defaults(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """general.sampling.* (llama.cpp's converter writes them from generation_config.json and
    llama.cpp applies them) are the model's sampling defaults; those edgeinfer samples otherwise
    (a repeat penalty over the last n tokens, mirostat) are left out and named in the log."""
    tok = train_byte_level("qwen2")
    write_byte_level_gguf(tok, tmp_path / "plain.gguf", "qwen2", None, "<|im_end|>", None)
    assert _from_gguf(tmp_path / "plain.gguf").sampling_defaults == {}
    sampling = {"temp": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "penalty_repeat": 1.1, "mirostat": 2}
    write_byte_level_gguf(tok, tmp_path / "a.gguf", "qwen2", None, "<|im_end|>", None, sampling=sampling)
    with caplog.at_level(logging.INFO, logger="edgeinfer.models.tokenizer_gguf"):
        ours = _from_gguf(tmp_path / "a.gguf")
    assert ours.sampling_defaults == {"temperature": pytest.approx(0.6), "top_p": pytest.approx(0.95),
                                      "top_k": 20, "min_p": pytest.approx(0.05)}
    assert "general.sampling.mirostat, general.sampling.penalty_repeat" in caplog.text


def test_unknown_pre_tokenizer_warns_and_falls_back(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tok = train_byte_level("gpt-2")
    write_byte_level_gguf(tok, tmp_path / "a.gguf", "gpt-2", None, "<|endoftext|>", None)
    meta = {**read_tokenizer_metadata(open_gguf(tmp_path / "a.gguf")), "ggml.pre": "martian-7"}
    with caplog.at_level(logging.WARNING):
        ours = tokenizer_from_gguf(meta)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "'martian-7'" in warnings[0] and "'gpt-2'" in warnings[0]
    assert ours.encode("Hello world 123") == tok.encode("Hello world 123").ids


def test_unknown_tokenizer_model_is_refused(tmp_path: Path) -> None:
    tok = train_byte_level("gpt-2")
    write_byte_level_gguf(tok, tmp_path / "a.gguf", "gpt-2", None, "<|endoftext|>", None)
    meta = {**read_tokenizer_metadata(open_gguf(tmp_path / "a.gguf")), "ggml.model": "rwkv"}
    with pytest.raises(ModelFileError, match=r"'rwkv'.*'gpt2'.*'llama'"):
        tokenizer_from_gguf(meta)
