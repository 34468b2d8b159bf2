"""Tokenizer, chat template and incremental detokenizer, built from a model's own metadata.

A GGUF file carries a gpt2-style byte-level BPE vocabulary, merges, token types and a Jinja chat
template; an HF folder or edgeinfer checkpoint carries tokenizer.json (+ a chat template). Both
become one `Tokenizer`. Detokenization works on bytes: every byte-level token maps to the raw
bytes it stands for, and an incremental UTF-8 decoder releases text only once a character is
complete, so a stream never emits half a character.
"""

from __future__ import annotations

import array
import codecs
import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

CONTROL_TOKEN_TYPE = 3
USER_DEFINED_TOKEN_TYPE = 4

# llama.cpp's pre-tokenizer names -> split regex; 'smollm' splits digits one by one, as the
# model's original tokenizer.json does (Digits(individual_digits) + the GPT-2 regex).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = keep[:]
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(keep, (chr(c) for c in chars), strict=True))


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in ("llama3", "llama-bpe", "llama-v3", "smaug-bpe", "dbrx"):
        split = pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated")
        return pre_tokenizers.Sequence([split, byte_level])
    steps = [pre_tokenizers.Split(Regex(_GPT2_SPLIT), behavior="isolated"), byte_level]
    if pre == "smollm":
        steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
    return pre_tokenizers.Sequence(steps)


class Tokenizer:
    """Encode, decode, and render chats."""

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        add_bos: bool,
        chat_template: str | None,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        byte_of = {c: b for b, c in _bytes_to_unicode().items()}
        special = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
        # Every token's bytes in one buffer, token i at [offsets[i], offsets[i + 1]): a bytes
        # object per token cost ~2.5 MB for a 49k vocabulary, this ~0.5 MB.
        pieces = bytearray()
        self._offsets = array.array("I", [0])
        for token_id in range(self.vocab_size):
            piece = backend.id_to_token(token_id) or ""
            if piece in special or not all(ch in byte_of for ch in piece):
                pieces += piece.encode("utf-8")
            else:
                pieces += bytes(byte_of[ch] for ch in piece)
            self._offsets.append(len(pieces))
        self._pieces = bytes(pieces)
        self.special_ids = frozenset(backend.token_to_id(t) for t in special)
        self._template = None

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> Tokenizer:
        model_type = meta.get("ggml.model")
        if model_type != "gpt2":
            raise ValueError(
                f"unsupported GGUF tokenizer model {model_type!r}; edgeinfer reads 'gpt2' (byte-level BPE)"
            )
        tokens: list[str] = list(meta["ggml.tokens"])
        vocab = {tok: i for i, tok in enumerate(tokens)}
        merges = [tuple(m.split(" ", 1)) for m in meta.get("ggml.merges", [])]
        backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        backend.pre_tokenizer = _pre_tokenizer(meta.get("ggml.pre"))
        backend.decoder = decoders.ByteLevel()
        types = list(meta.get("ggml.token_type") or [])
        control = [tokens[i] for i, t in enumerate(types) if t == CONTROL_TOKEN_TYPE]
        user = [tokens[i] for i, t in enumerate(types) if t == USER_DEFINED_TOKEN_TYPE]
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
        if user:
            backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
        return cls(
            backend,
            bos_token_id=meta.get("ggml.bos_token_id"),
            eos_token_id=meta.get("ggml.eos_token_id"),
            add_bos=bool(meta.get("ggml.add_bos_token", False)),
            chat_template=meta.get("chat_template"),
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer:
        """tokenizer.json (+ tokenizer_config.json / chat_template.jinja) of an HF-style folder."""
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{folder} has no tokenizer.json")
        backend = HFTokenizer.from_file(str(path))
        config: dict[str, Any] = {}
        if (folder / "tokenizer_config.json").is_file():
            config = json.loads((folder / "tokenizer_config.json").read_text())
        template = config.get("chat_template")
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text()

        def token_id(key: str) -> int | None:
            value = config.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            return None if value is None else backend.token_to_id(value)

        return cls(
            backend,
            bos_token_id=token_id("bos_token"),
            eos_token_id=token_id("eos_token"),
            add_bos=bool(config.get("add_bos_token", False)),
            chat_template=template,
        )

    def save(self, folder: str | Path) -> None:
        """Write tokenizer.json, tokenizer_config.json and chat_template.jinja into ``folder``."""
        folder = Path(folder)
        self.backend.save(str(folder / "tokenizer.json"))
        name = lambda i: None if i is None else self.backend.id_to_token(i)  # noqa: E731
        config = {"bos_token": name(self.bos_token_id), "eos_token": name(self.eos_token_id),
                  "add_bos_token": self.add_bos}
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
        if self.chat_template:
            (folder / "chat_template.jinja").write_text(self.chat_template)

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, token_ids: list[int], skip_special: bool = True) -> str:
        return self.token_bytes(token_ids, skip_special).decode("utf-8", errors="replace")

    def token_bytes(self, token_ids: list[int], skip_special: bool = True) -> bytes:
        pieces, offsets = self._pieces, self._offsets
        return b"".join(
            pieces[offsets[i]:offsets[i + 1]] for i in token_ids if not (skip_special and i in self.special_ids)
        )

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise ValueError(f"chat template error: {message}")

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            env.filters["tojson"] = lambda v, indent=None: json.dumps(v, indent=indent, ensure_ascii=False)
            self._template = env.from_string(self.chat_template)
        name = lambda i: "" if i is None else self.backend.id_to_token(i)  # noqa: E731
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=name(self.bos_token_id),
            eos_token=name(self.eos_token_id),
        )

    def detokenizer(self, skip_special: bool = True) -> Detokenizer:
        return Detokenizer(self, skip_special)


class Detokenizer:
    """Incremental detokenization: feed token ids, get text deltas of whole characters only."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._decoder.decode(self._tokenizer.token_bytes([token_id], self._skip_special))

    def flush(self) -> str:
        """Whatever bytes are left (an incomplete character becomes U+FFFD)."""
        return self._decoder.decode(b"", final=True)
