"""Centring quantized key caches: the text they are calibrated on, and the measurement.

Keys carry a large per-channel offset that is the same for every token (mostly the slow RoPE
channels); a 4-bit group spends its range on it. Subtracting a fixed per-(layer, KV head) mean
before quantizing costs attention nothing: q . (k - m) = q . k - q . m, and softmax ignores a
shift that is the same for every key of a query. The mean is measured once per model on this
short, mixed text (prose, code, a chat turn, numbers), deliberately not the evaluation corpus.
"""

from __future__ import annotations

import torch

from edgeinfer.models.llama import LlamaModel
from edgeinfer.models.tokenizer import Tokenizer
from edgeinfer.worker.batch import CPU_PREFILL_CHUNK, SeqChunk, build_batch
from edgeinfer.worker.kv_pools import kv_pool

CALIBRATION_TEXT = """\
The history of the printing press begins in the fifteenth century, when movable type made books cheaper and
faster to produce. Within fifty years, presses were running in more than two hundred cities across Europe, and
the number of books in circulation grew into the millions.
def merge_sorted(a, b):
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i]); i += 1
        else:
            out.append(b[j]); j += 1
    return out + a[i:] + b[j:]
User: Can you explain why the sky is blue?
Assistant: Sunlight is scattered by the molecules in the air, and shorter wavelengths such as blue are
scattered much more strongly than red, so blue light reaches your eyes from every direction of the sky.
Recipe: whisk two eggs with 200 ml of milk and 120 g of flour, rest the batter for 30 minutes, then fry thin
pancakes in a hot buttered pan, about one minute per side.
In 1969, the Apollo 11 mission landed on the Moon; Neil Armstrong and Buzz Aldrin spent about two and a half
hours walking on the surface while Michael Collins orbited above.
"""


def calibration_ids(tokenizer: Tokenizer | None) -> tuple[int, ...]:
    """Token ids of CALIBRATION_TEXT; empty without a tokenizer (keys are then not centred)."""
    return () if tokenizer is None else tuple(tokenizer.encode(CALIBRATION_TEXT))


def prepare_quantized_kv(model: LlamaModel) -> None:
    """Measure the model's key centres (once) before any quantized key cache is written: the
    runner calls this when it binds the model to a pool with quantized keys. The calibration
    text runs through the model's own forward in prompt chunks, into a scratch fp32 pool."""
    if model.key_centres is not None or not model.kv_calibration_ids:
        return
    c = model.config
    ids = tuple(model.kv_calibration_ids[: c.max_position])
    num_blocks = -(-len(ids) // 16)
    pool = kv_pool(c, num_blocks, 16, "fp32", "fp32", model.device)
    keys: list[list[torch.Tensor]] = [[] for _ in range(c.num_layers)]  # per layer, chunk after chunk

    def observe(layer: int, name: str, x: torch.Tensor) -> None:
        if name == "keys":
            keys[layer].append(x)

    for start in range(0, len(ids), CPU_PREFILL_CHUNK):  # bounded activations, as a prompt's prefill
        chunk = SeqChunk(ids[start:start + CPU_PREFILL_CHUNK], start, tuple(range(num_blocks)))
        token_ids, batch = build_batch([chunk], 16, model.device)
        model.forward(token_ids, batch, pool, observe=observe)
    model.key_centres = torch.stack([torch.cat(layer_keys).float().mean(dim=0) for layer_keys in keys])
