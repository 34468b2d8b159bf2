"""Small tokenizers of each kind the target models use, as an HF folder and as a GGUF.

No hub here, so each model family's tokenizer is remade in miniature: a byte-level BPE (or a
SentencePiece-style BPE with byte fallback) trained with `tokenizers` on tinyshakespeare plus
code, CJK and emoji text, with the family's own pre-tokenizer as its tokenizer.json on the hub
has it. The same vocabulary is saved as an HF folder (tokenizer.json + tokenizer_config.json)
and written into a GGUF's tokenizer.ggml.* metadata the way llama.cpp's convert_hf_to_gguf.py
does (_set_vocab_gpt2 / _set_vocab_sentencepiece): tokens, token types, merges or scores, pre,
special ids, chat template.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from edgeinfer.models.tokenizer_gguf import PRE_TOKENIZERS

SHAKESPEARE = Path("/work/shared/data/tinyshakespeare.txt")
EXTRA_TEXT = [
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { printf(\"%d\\n\", i * i); }  // squares\n",
    "import numpy as np\nx = np.zeros((3, 4), dtype=np.float32)\t# tabs\tand  spaces\n",
    "中文的文本，日本語のテキスト、한국어 텍스트。机器学习和自然语言处理。",
    "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다.",
    "emoji 😀🎉👩‍👩‍👧 🙂🙂 🚀 ❤️ 👍🏽 done",
    "Prices: $1,234.56 and 3.14159, 2024-01-01, 0xDEADBEEF, 1e-5, 100%",
    "naïve café résumé Ångström ÀÉÎÕÜ ß ø æ",
]
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA3_CHAT = ("{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n'"
               " + m['content'] + '<|eot_id|>' }}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
GEMMA_CHAT = ("{{ bos_token }}{% for m in messages %}{{ '<start_of_turn>' + m['role'] + '\n' + m['content'] "
              "+ '<end_of_turn>\n' }}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")

# pre-tokenizer -> (special tokens, bos, eos, chat template): each as its family's files have them.
BPE_FAMILIES = {
    "gpt-2": (["<|endoftext|>"], "<|endoftext|>", "<|endoftext|>", None),
    "smollm": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|im_start|>", "<|im_end|>", CHATML),
    "llama-bpe": (["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                   "<|eot_id|>"], "<|begin_of_text|>", "<|end_of_text|>", LLAMA3_CHAT),
    "qwen2": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>", CHATML),
    "tekken": (["<unk>", "<s>", "</s>", "[INST]", "[/INST]"], "<s>", "</s>", None),
}


def corpus() -> list[str]:
    """English, code, digits, whitespace runs, CJK, emoji and special tokens, fixed and random."""
    rng = random.Random(1234)
    fixed = [
        "", " ", "Hello world", "  leading and trailing  ", "tabs\tand\nnewlines\r\n\n", "   \n\n   ",
        "12345 and 3.14159 and 1,000,000", "émoji 😀🎉👩‍👩‍👧 done", "中文，日本語のテキスト、한국어",
        "def f(x):\n    return x ** 2  # square\n", "<|im_start|>user\nhi<|im_end|>", "don't I'll we've",
        "ÀÉÎÕÜ ß ø æ", "\u200b zero width", "a" * 300, "The quick brown fox jumps over the lazy dog.",
        "{\"json\": [1, 2, {\"k\": null}]}", "<b>html</b> &amp; entities", "naïve café résumé",
        "mixed\u00a0nbsp", "🙂" * 10, "x = [i for i in range(10) if i % 2]",
    ]
    alphabet = list("abcdefghijklmnopqrstuvwxyz ABCXYZ0123456789.,;:!?'\"-_()[]{}\n\t") + [
        "é", "ñ", "中", "😀", "🎉", "ß", "\u00a0", "  ", "    ", "<|im_end|>"]
    no_digits = [ch for ch in alphabet if not any(c.isdigit() for c in ch)]
    randoms = ["".join(rng.choice(pool) for _ in range(rng.randint(1, 60)))
               for pool in (alphabet, no_digits) for _ in range(180)]
    return fixed + randoms


def training_text(num_chars: int = 150_000) -> list[str]:
    return [*SHAKESPEARE.read_text()[:num_chars].split("\n\n"), *EXTRA_TEXT * 20]


def _byte_level_pipeline(pre: str) -> tuple[normalizers.Normalizer | None, pre_tokenizers.PreTokenizer]:
    split, digits, nfc = PRE_TOKENIZERS[pre]
    steps = [pre_tokenizers.Split(Regex(split), behavior="isolated"),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    if pre in ("gpt-2", "smollm"):  # as GPT-2's and SmolLM2's tokenizer.json: ByteLevel's own regex
        steps = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if digits:
        steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
    return (normalizers.NFC() if nfc else None), pre_tokenizers.Sequence(steps)


def train_byte_level(pre: str, vocab_size: int = 3000) -> Tokenizer:
    specials = BPE_FAMILIES[pre][0]
    tok = Tokenizer(models.BPE())
    normalizer, pre_tokenizer = _byte_level_pipeline(pre)
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(training_text(), trainer)
    tok.model.ignore_merges = pre == "llama-bpe"  # as Llama 3's tokenizer.json
    tok.add_tokens([AddedToken("<think>", normalized=False, special=False)])  # a user-defined token
    return tok


def train_sentencepiece(control: tuple[str, ...] = (), vocab_size: int = 2000) -> tuple[list[str], list[float]]:
    """A Llama-2-style vocabulary: <unk> <s> </s>, `control` tokens, the 256 byte tokens, then
    BPE pieces with SentencePiece's scores (a piece made by a later merge scores lower)."""
    trainer_tok = Tokenizer(models.BPE())
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    specials = ["<unk>", "<s>", "</s>", *control, *(f"<0x{b:02X}>" for b in range(256))]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False, limit_alphabet=300,
                                  special_tokens=specials)
    trainer_tok.train_from_iterator(training_text(), trainer)
    vocab = trainer_tok.get_vocab()
    tokens = sorted(vocab, key=vocab.__getitem__)
    scores = [0.0 if i < 259 + len(control) else -float(i) for i in range(len(tokens))]
    return tokens, scores


def save_hf_folder(tok: Tokenizer, folder: Path, bos: str | None, eos: str | None, template: str | None,
                   tokenizer_class: str = "PreTrainedTokenizerFast", **extra: object) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": tokenizer_class, "bos_token": bos, "eos_token": eos, "add_bos_token": False,
              "chat_template": template, **extra}
    (folder / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))


def _writer(path: Path) -> object:
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    # transformers' GGUF loader reads a config too: a minimal llama one.
    writer.add_context_length(256)
    writer.add_embedding_length(64)
    writer.add_block_count(1)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_layer_norm_rms_eps(1e-5)
    return writer


def _finish(writer: object) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_byte_level_gguf(tok: Tokenizer, path: Path, pre: str, bos: str | None, eos: str | None,
                          template: str | None, sampling: dict[str, float] | None = None) -> None:
    """As convert_hf_to_gguf.py's _set_vocab_gpt2: added special tokens CONTROL, other added
    tokens USER_DEFINED, the rest NORMAL; merges as "left right". ``sampling``: general.sampling.*
    keys (without the prefix), written by the gguf writer's add_sampling_* methods."""
    import gguf

    vocab = tok.get_vocab()
    added = tok.get_added_tokens_decoder()
    tokens = sorted(vocab, key=vocab.__getitem__)
    types = [gguf.TokenType.NORMAL] * len(tokens)
    for token_id, added_token in added.items():
        types[token_id] = gguf.TokenType.CONTROL if added_token.special else gguf.TokenType.USER_DEFINED
    merges = [" ".join(m) for m in json.loads(tok.to_str())["model"]["merges"]]
    writer = _writer(path)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    if bos is not None:
        writer.add_bos_token_id(vocab[bos])
    writer.add_eos_token_id(vocab[eos])
    writer.add_add_bos_token(False)
    if template is not None:
        writer.add_chat_template(template)
    for key, value in (sampling or {}).items():
        getattr(writer, f"add_sampling_{key}")(value)
    _finish(writer)


def write_sentencepiece_gguf(tokens: list[str], scores: list[float], path: Path, add_space_prefix: bool,
                             control: list[str], template: str | None = None) -> None:
    """As convert_hf_to_gguf.py's _set_vocab_sentencepiece: no merges, scores; <unk> UNKNOWN,
    <s> </s> and added control tokens CONTROL, <0xNN> BYTE."""
    import gguf

    types = [gguf.TokenType.NORMAL] * len(tokens)
    for i, token in enumerate(tokens):
        if token == "<unk>":
            types[i] = gguf.TokenType.UNKNOWN
        elif token in ("<s>", "</s>", *control):
            types[i] = gguf.TokenType.CONTROL
        elif token.startswith("<0x") and len(token) == 6:
            types[i] = gguf.TokenType.BYTE
    writer = _writer(path)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(add_space_prefix)
    if template is not None:
        writer.add_chat_template(template)
    _finish(writer)
