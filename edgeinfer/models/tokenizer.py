"""Tokenizer, chat template and incremental detokenizer, built from a model's own metadata.

A GGUF file carries a byte-level BPE or SentencePiece vocabulary, token types, special token ids
and a Jinja chat template (edgeinfer/models/tokenizer_gguf.py rebuilds it); an HF folder or
edgeinfer checkpoint carries tokenizer.json, tokenizer_config.json (special tokens, chat template)
and generation_config.json (stop ids, sampling defaults). Both become one `Tokenizer`.
Detokenization works on bytes: every token maps to the raw bytes it stands for (byte-level
characters, or SentencePiece's "▁" and <0xNN> pieces), and an incremental UTF-8 decoder releases
text only once a character is complete, so a stream never emits half a character.
"""

from __future__ import annotations

import array
import codecs
import json
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer


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


_BYTE_OF = {c: b for b, c in _bytes_to_unicode().items()}


def _byte_level_bytes(piece: str) -> bytes:
    """A byte-level token's raw bytes; a token outside the byte alphabet (an added one) as text."""
    if all(ch in _BYTE_OF for ch in piece):
        return bytes(_BYTE_OF[ch] for ch in piece)
    return piece.encode("utf-8")


def _sentencepiece_bytes(piece: str) -> bytes:
    """A SentencePiece token's bytes: "<0xNN>" is the byte NN (byte fallback), "▁" a space."""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return bytes([int(piece[3:5], 16)])
    return piece.replace("\u2581", " ").encode("utf-8")


# core.sampling_params.MODEL_DEFAULT_FIELDS, named again: this file imports nothing of core/.
SAMPLING_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_sampling_defaults(generation_config: dict[str, Any]) -> dict[str, Any]:
    """The sampling fields of an HF generation_config.json. They mean something only when the
    file samples: with do_sample false (HF's default) transformers decodes greedily, and so does
    an edgeinfer request that says temperature 0."""
    if not generation_config.get("do_sample", False):
        return {"temperature": 0.0} if "do_sample" in generation_config else {}
    return {k: generation_config[k] for k in SAMPLING_DEFAULT_FIELDS if generation_config.get(k) is not None}


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
        stop_token_ids: tuple[int, ...] = (),
        byte_level: bool = True,
        add_eos: bool = False,
        sampling_defaults: dict[str, Any] | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.chat_template = chat_template
        # Every id that ends generation as the model's own runtime would stop (EOS, EOT, EOM,
        # <|im_end|>, <end_of_turn>, generation_config.json's eos_token_id list).
        eos = () if eos_token_id is None else (eos_token_id,)
        self.stop_token_ids = tuple(dict.fromkeys((*eos, *stop_token_ids)))
        # generation_config.json's sampling fields: the engine fills a request's unset fields from them.
        self.sampling_defaults = dict(sampling_defaults or {})
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        special = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
        # SentencePiece decoding drops the "▁" it put before the text (HF's Strip decoder).
        self._strip_first_space = not byte_level and b'"Strip"' in (backend.decoder.__getstate__() or b"")
        # Every token's bytes in one buffer, token i at [offsets[i], offsets[i + 1]): a bytes
        # object per token cost ~2.5 MB for a 49k vocabulary, this ~0.5 MB.
        pieces = bytearray()
        self._offsets = array.array("I", [0])
        piece_bytes = _byte_level_bytes if byte_level else _sentencepiece_bytes
        for token_id in range(self.vocab_size):
            piece = backend.id_to_token(token_id) or ""
            pieces += piece.encode("utf-8") if piece in special else piece_bytes(piece)
            self._offsets.append(len(pieces))
        self._pieces = bytes(pieces)
        self.special_ids = frozenset(backend.token_to_id(t) for t in special)
        self._template = None

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

        generation: dict[str, Any] = {}
        if (folder / "generation_config.json").is_file():
            generation = json.loads((folder / "generation_config.json").read_text())
        eos = generation.get("eos_token_id")
        bos_id, eos_id = token_id("bos_token"), token_id("eos_token")
        # Without add_bos_token / add_eos_token in the config, the tokenizer class decides; the
        # tokenizer.json's post-processor says what that class adds (Llama 3's adds BOS).
        with_specials = backend.encode("", add_special_tokens=True).ids
        decoder = backend.decoder.__getstate__() if backend.decoder is not None else b""
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_id=eos_id,
            add_bos=bool(config.get("add_bos_token", bos_id is not None and bos_id in with_specials[:1])),
            add_eos=bool(config.get("add_eos_token", eos_id is not None and eos_id in with_specials[-1:])),
            chat_template=template,
            stop_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
            byte_level=not decoder or decoder.startswith(b'{"type":"ByteLevel"'),
            sampling_defaults=generation_sampling_defaults(generation),
        )

    def save(self, folder: str | Path) -> None:
        """Write tokenizer.json, tokenizer_config.json, generation_config.json (stop ids, sampling
        defaults) and chat_template.jinja into ``folder``."""
        folder = Path(folder)
        self.backend.save(str(folder / "tokenizer.json"))
        name = lambda i: None if i is None else self.backend.id_to_token(i)  # noqa: E731
        config = {"bos_token": name(self.bos_token_id), "eos_token": name(self.eos_token_id),
                  "add_bos_token": self.add_bos, "add_eos_token": self.add_eos}
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
        generation = {**self.sampling_defaults, "eos_token_id": list(self.stop_token_ids)}
        if self.sampling_defaults:
            generation["do_sample"] = True
        (folder / "generation_config.json").write_text(json.dumps(generation, indent=1))
        if self.chat_template:
            (folder / "chat_template.jinja").write_text(self.chat_template)

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        if add_special and self.add_eos and self.eos_token_id is not None:
            ids = [*ids, self.eos_token_id]
        return ids

    def decode(self, token_ids: list[int], skip_special: bool = True) -> str:
        text = self.token_bytes(token_ids, skip_special).decode("utf-8", errors="replace")
        return text.removeprefix(" ") if self._strip_first_space else text

    def token_bytes(self, token_ids: list[int], skip_special: bool = True) -> bytes:
        pieces, offsets = self._pieces, self._offsets
        return b"".join(
            pieces[offsets[i]:offsets[i + 1]] for i in token_ids if not (skip_special and i in self.special_ids)
        )

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        """The chat rendered by the model's template, as transformers' `apply_chat_template` renders
        it: the same sandbox, `tojson` (unescaped, with indent/separators/sort_keys), `strftime_now`
        and `raise_exception`, and `tools` (OpenAI-shaped function dicts) in the template's own variable."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        if self._template is None:
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise ValueError(f"chat template error: {message}")

            def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
                       separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
                # jinja's own tojson escapes HTML characters; templates are written against HF's.
                return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                                  sort_keys=sort_keys)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            env.filters["tojson"] = tojson
            self._template = env.from_string(self.chat_template)
        name = lambda i: "" if i is None else self.backend.id_to_token(i)  # noqa: E731
        return self._template.render(
            messages=messages,
            tools=tools,
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
