"""A `tokenizers` backend rebuilt from a GGUF file's tokenizer.ggml.* metadata.

Two vocabulary kinds, named by `tokenizer.ggml.model`:
- "gpt2": byte-level BPE (Llama 3, Qwen2, SmolLM, GPT-2, Phi-2, Mistral Nemo). The file has the
  merges; how text is split before merging is named by `tokenizer.ggml.pre`, mapped here to the
  Split regex the model's own tokenizer.json uses (llama.cpp keeps the same table in
  llama-vocab.cpp, per LLAMA_VOCAB_PRE_TYPE).
- "llama": SentencePiece BPE (Llama 2, Mistral 7B, Gemma, Phi-3): tokens with scores, unknown
  bytes as `<0xNN>` tokens, spaces as "▁" and, where `add_space_prefix` is set, a "▁" before the
  text. The file has no merges; they are rebuilt from the scores as transformers and
  SentencePiece's own converter do (a pair merges with the score of the token it makes).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from edgeinfer.models.pull import card_sampling_defaults
from edgeinfer.models.tokenizer import Tokenizer
from quant.gguf_eog import end_of_generation_ids
from quant.gguf_import import ModelFileError

log = logging.getLogger(__name__)

CONTROL_TOKEN_TYPE = 3
USER_DEFINED_TOKEN_TYPE = 4
BYTE_TOKEN_TYPE = 6
SUPPORTED_MODELS = ("gpt2", "llama")

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Llama 3's, with digits one by one.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Mistral Nemo's "tekken": words split at case changes, digits one by one.
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> (split regex, digits one by one first, NFC first). "smollm" is GPT-2's
# regex after Digits(individual_digits), as SmolLM2's tokenizer.json has it; Qwen2's
# tokenizer.json normalizes to NFC before splitting (llama.cpp does not).
PRE_TOKENIZERS: dict[str, tuple[str, bool, bool]] = {
    "gpt-2": (_GPT2_SPLIT, False, False),
    "phi-2": (_GPT2_SPLIT, False, False),
    "smollm": (_GPT2_SPLIT, True, False),
    "llama3": (_LLAMA3_SPLIT, False, False),
    "llama-v3": (_LLAMA3_SPLIT, False, False),
    "llama-bpe": (_LLAMA3_SPLIT, False, False),
    "smaug-bpe": (_LLAMA3_SPLIT, False, False),
    "dbrx": (_LLAMA3_SPLIT, False, False),
    "qwen2": (_QWEN2_SPLIT, False, True),
    "deepseek-r1-qwen": (_QWEN2_SPLIT, False, True),
    "tekken": (_TEKKEN_SPLIT, False, False),
}
FALLBACK_PRE = "gpt-2"
# Llama 3 looks a word up whole before merging (tokenizer.json's "ignore_merges", llama.cpp's
# ignore_merges for these names) and adds BOS unless the file says otherwise.
_LLAMA3_NAMES = ("llama3", "llama-v3", "llama-bpe")


def _byte_level(backend: HFTokenizer, pre: str | None) -> None:
    if pre not in PRE_TOKENIZERS:
        # One warning per file load: a wrong split changes ids, never crashes, so say it.
        log.warning("GGUF pre-tokenizer %r is not known to edgeinfer; splitting as %r, so token ids may "
                    "differ from the model's own tokenizer (known: %s)", pre, FALLBACK_PRE,
                    ", ".join(sorted(PRE_TOKENIZERS)))
        pre = FALLBACK_PRE
    split, digits, nfc = PRE_TOKENIZERS[pre]
    steps = [pre_tokenizers.Split(Regex(split), behavior="isolated"),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    if digits:
        steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
    backend.pre_tokenizer = pre_tokenizers.Sequence(steps)
    if nfc:
        backend.normalizer = normalizers.NFC()
    backend.decoder = decoders.ByteLevel()


def spm_merges(tokens: list[str], scores: list[float], skip: set[str]) -> list[tuple[str, str]]:
    """SentencePiece BPE merges from the vocabulary: every split of a token into two tokens is a
    merge ranked by the token's score (higher first), ties by the pieces' lengths and ids, as
    transformers' `generate_merges` orders them."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for token, score in zip(tokens, scores, strict=True):
        if token in skip:
            continue
        local = [(token[:k], token[k:], score) for k in range(1, len(token))
                 if token[:k] in vocab and token[k:] in vocab and token[:k] not in skip and token[k:] not in skip]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _sentencepiece(meta: dict[str, Any], tokens: list[str], special: set[str]) -> HFTokenizer:
    scores = [float(s) for s in meta.get("ggml.scores") or [0.0] * len(tokens)]
    vocab = {t: i for i, t in enumerate(tokens)}
    unk_id = meta.get("ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else None
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=spm_merges(tokens, scores, special), unk_token=unk,
                                     fuse_unk=True, byte_fallback=True))
    # SentencePiece treats the text as one piece: spaces become "▁", and with add_space_prefix
    # (llama.cpp's default for "llama" vocabularies) one "▁" goes before the text.
    prepend = bool(meta.get("ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first" if prepend else "never",
                                                     split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)] if prepend else steps)
    return backend


def backend_from_gguf(meta: dict[str, Any]) -> tuple[HFTokenizer, bool]:
    """The tokenizer the metadata describes, and whether it is byte-level (else SentencePiece)."""
    kind = meta.get("ggml.model")
    if kind not in SUPPORTED_MODELS:
        raise ModelFileError(f"unsupported GGUF tokenizer model {kind!r}; edgeinfer reads "
                             "'gpt2' (byte-level BPE) and 'llama' (SentencePiece)")
    tokens: list[str] = list(meta["ggml.tokens"])
    types = list(meta.get("ggml.token_type") or [])
    control = [tokens[i] for i, t in enumerate(types) if t == CONTROL_TOKEN_TYPE]
    user = [tokens[i] for i, t in enumerate(types) if t == USER_DEFINED_TOKEN_TYPE]
    if kind == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in meta.get("ggml.merges", [])]
        backend = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                         fuse_unk=False, byte_fallback=False,
                                         ignore_merges=meta.get("ggml.pre") in _LLAMA3_NAMES))
        _byte_level(backend, meta.get("ggml.pre"))
    else:
        backend = _sentencepiece(meta, tokens, set(control) | set(user))
    # Control tokens (<|im_end|>, <start_of_turn>) are matched whole before any split, never
    # built from pieces; user-defined ones too, but they decode as text.
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    if user:
        backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    return backend, kind == "gpt2"


def tokenizer_from_gguf(meta: dict[str, Any]) -> Tokenizer:
    """The tokenizer a GGUF file's tokenizer.* metadata describes (keys without "tokenizer.")."""
    backend, byte_level = backend_from_gguf(meta)
    # llama.cpp's defaults when the file does not say: BOS for SentencePiece and Llama 3.
    bos_by_default = not byte_level or meta.get("ggml.pre") in _LLAMA3_NAMES
    return Tokenizer(
        backend,
        bos_token_id=meta.get("ggml.bos_token_id"),
        eos_token_id=meta.get("ggml.eos_token_id"),
        add_bos=bool(meta.get("ggml.add_bos_token", bos_by_default)),
        add_eos=bool(meta.get("ggml.add_eos_token", False)),
        chat_template=meta.get("chat_template"),
        stop_token_ids=end_of_generation_ids(meta),
        byte_level=byte_level,
        sampling_defaults=gguf_sampling_defaults(meta.get("sampling") or {}),
    )


def gguf_file_tokenizer(path: Path, meta: dict[str, Any]) -> Tokenizer:
    """tokenizer_from_gguf for the file at ``path``; the pulled default model's file, which sets no
    sampling of its own, gets its model card's (edgeinfer.models.pull.DEFAULT_MODEL)."""
    tokenizer = tokenizer_from_gguf(meta)
    if not tokenizer.sampling_defaults:
        tokenizer.sampling_defaults = card_sampling_defaults(path)
    return tokenizer


# GGUF general.sampling.* keys -> SamplingParams fields (tokenizer.SAMPLING_DEFAULT_FIELDS).
GGUF_SAMPLING_FIELDS = {"temp": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p"}


def gguf_sampling_defaults(sampling: dict[str, Any]) -> dict[str, Any]:
    """The sampling defaults a GGUF file's general.sampling.* keys (without the prefix) set.
    Those edgeinfer does not sample the same way are left out, named in the log: penalty_repeat
    (llama.cpp's spans the last penalty_last_n tokens, edgeinfer's repetition_penalty the whole
    context), mirostat, XTC and the sampler order."""
    ignored = sorted(k for k in sampling if k not in GGUF_SAMPLING_FIELDS)
    if ignored:
        log.info("GGUF sampling defaults not applied (edgeinfer does not sample that way): %s",
                 ", ".join(f"general.sampling.{k}" for k in ignored))
    return {GGUF_SAMPLING_FIELDS[k]: v for k, v in sampling.items() if k in GGUF_SAMPLING_FIELDS}
