"""The token ids that end generation, read from a GGUF file's tokenizer metadata."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Tokens that end a turn in the chat formats of the models people run, stopped on whatever id
# the file gives them: llama.cpp's end-of-generation list (llama-vocab.cpp), since many files
# name only EOS, not the end-of-turn token their chat template writes.
END_OF_GENERATION_TOKENS = frozenset({
    "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
    "<|end_of_text|>", "<EOT>", "_<EOT>", "<｜end▁of▁sentence｜>", "<|return|>", "<|call|>",
})


def end_of_generation_ids(meta: Mapping[str, Any]) -> tuple[int, ...]:
    """The ids that end generation, from tokenizer metadata (keys without "tokenizer."): EOS,
    EOT, EOM, then any token spelled as a known end of turn, in that order, once each."""
    ids = [meta.get(f"ggml.{key}_token_id") for key in ("eos", "eot", "eom")]
    tokens = meta.get("ggml.tokens") or []
    ids += [i for i, token in enumerate(tokens) if token in END_OF_GENERATION_TOKENS]
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))
