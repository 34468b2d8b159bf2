"""Train a small Qwen2-architecture causal LM on tinyshakespeare: a second real architecture to
measure the converter on (issue #25), since no second model's weights can be downloaded here.

Qwen2 has q/k/v biases, which the default (Llama-architecture) model lacks, so the converter's
bias handling and its calibration meet trained, not random, values. The script trains a byte-level
BPE tokenizer (`tokenizers`) on the first --train-frac of the text, then the model with AdamW on
random --seq-len windows of the same part for --minutes of wall clock, and scores the rest (the
held-out part, written to --heldout-text) in non-overlapping --seq-len windows exactly as
`edgeinfer eval-ppl` does (no BOS, tokens 1.. of each window scored). The HF folder (fp32
safetensors, config.json, generation_config.json, tokenizer.json, tokenizer_config.json) is written
to a temporary sibling and renamed into place; then `edgeinfer eval-ppl --linear-path reference`
runs on it as a child and both figures are printed side by side.

    PYTHONPATH=$PWD nice -n 19 .venv/bin/python tools/train_tiny_model.py OUT_DIR [--minutes 8]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from edgeinfer.models.tokenizer import Tokenizer  # noqa: E402

DEFAULT_TEXT = str(REPO.parent / "shared" / "data" / "tinyshakespeare.txt")
EOS = "<|endoftext|>"  # Qwen2's own end-of-text token; like Qwen2, no BOS is added
# Qwen2's pre-tokenizer split: transformers loads a qwen2 folder's tokenizer as Qwen2Tokenizer,
# which imposes this split whatever tokenizer.json says, so training with it keeps transformers'
# and edgeinfer's token ids identical.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def train_tokenizer(text: str, vocab_size: int) -> Tokenizer:
    """A byte-level BPE (as Qwen2's and GPT-2's) trained on ``text``, wrapped as edgeinfer's
    Tokenizer so that its save() writes the files edgeinfer and transformers read."""
    from tokenizers import Regex, decoders, models, pre_tokenizers, processors, trainers
    from tokenizers import Tokenizer as HFTokenizer

    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    # The full byte alphabet: any text (not only Shakespeare's characters) encodes without <unk>.
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    chunk = 1 << 16
    backend.train_from_iterator((text[i:i + chunk] for i in range(0, len(text), chunk)), trainer)
    eos = backend.token_to_id(EOS)
    return Tokenizer(backend, bos_token_id=None, eos_token_id=eos, add_bos=False, chat_template=None,
                     stop_token_ids=(eos,))


def build_model(args: argparse.Namespace, vocab_size: int, eos: int) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.max_positions, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=eos, pad_token_id=eos,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    return Qwen2ForCausalLM(config)


@torch.no_grad()
def windowed_perplexity(model: torch.nn.Module, ids: torch.Tensor, window: int) -> tuple[float, int]:
    """quant.perplexity's protocol: non-overlapping windows (the last partial one included), each
    scored from an empty context on its tokens 1..; (perplexity, tokens scored)."""
    model.eval()
    nll, scored = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start:start + window]
        if len(chunk) < 2:
            break
        logits = model(chunk[None]).logits[0, :-1].float()
        nll += float(torch.nn.functional.cross_entropy(logits, chunk[1:], reduction="sum"))
        scored += len(chunk) - 1
    model.train()
    return math.exp(nll / scored), scored


def save_folder(model: torch.nn.Module, tokenizer: Tokenizer, out: Path, extra: dict) -> None:
    """Write the HF folder next to ``out`` and rename it into place, so that a crash or a
    concurrent reader never sees half a model."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    model.save_pretrained(tmp)
    tokenizer.save(tmp)
    # tokenizer.save writes only what edgeinfer reads; transformers' AutoTokenizer also wants the
    # class to build and the length the model was trained for.
    config_path = tmp / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    tok_config |= {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": EOS,
                   "model_max_length": model.config.max_position_embeddings}
    config_path.write_text(json.dumps(tok_config, indent=1))
    (tmp / "training.json").write_text(json.dumps(extra, indent=1))
    # mkdtemp makes the folder owner-only; the model is meant to be read by others' tools too.
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="HF folder to write")
    p.add_argument("--text", default=DEFAULT_TEXT)
    p.add_argument("--heldout-text", help="where the held-out part goes (default: OUT-heldout.txt beside OUT)")
    p.add_argument("--train-frac", type=float, default=0.9)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--max-positions", type=int, default=1024)
    p.add_argument("--seq-len", type=int, default=256, help="training sequence and scoring window length")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=30, help="linear warm-up steps")
    p.add_argument("--minutes", type=float, default=8.0, help="wall-clock training budget")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--eval-tokens", type=int, default=16384, help="held-out tokens scored (at most all of them)")
    p.add_argument("--no-check", action="store_true", help="skip the `edgeinfer eval-ppl` cross-check")
    args = p.parse_args(argv)
    for name in ("hidden", "intermediate"):
        if getattr(args, name) % 128:
            p.error(f"--{name} must be a multiple of 128 (the int4 kernels' group size)")
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    heldout_path = Path(args.heldout_text or out.parent / f"{out.name}-heldout.txt")

    text = Path(args.text).read_text(encoding="utf-8")
    cut = int(len(text) * args.train_frac)
    train_text, heldout_text = text[:cut], text[cut:]
    start = time.perf_counter()
    tokenizer = train_tokenizer(train_text, args.vocab)
    train_ids = torch.tensor(tokenizer.encode(train_text, add_special=False), dtype=torch.long)
    heldout_ids = torch.tensor(tokenizer.encode(heldout_text, add_special=False), dtype=torch.long)
    eval_ids = heldout_ids[:args.eval_tokens]
    print(f"tokenizer: {tokenizer.vocab_size} tokens, trained in {time.perf_counter() - start:.1f} s; "
          f"train {len(train_ids)} tokens ({cut} chars), held out {len(heldout_ids)} tokens", flush=True)

    model = build_model(args, tokenizer.vocab_size, tokenizer.eos_token_id)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: Qwen2, hidden {args.hidden}, {args.layers} layers, {args.heads} heads / {args.kv_heads} KV, "
          f"intermediate {args.intermediate}, vocab {tokenizer.vocab_size}: {params / 1e6:.2f} M parameters",
          flush=True)
    # No weight decay on biases and norms: the usual split, which keeps the q/k/v biases free.
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95))
    generator = torch.Generator().manual_seed(args.seed)
    budget = args.minutes * 60
    model.train()
    start = time.perf_counter()
    step, running, tokens_seen = 0, [], 0
    while (elapsed := time.perf_counter() - start) < budget:
        # Warm-up, then cosine decay over the wall-clock budget (steps are unknown in advance).
        scale = min(1.0, (step + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, elapsed / budget)))
        for group in optimizer.param_groups:
            group["lr"] = args.lr * max(scale, 0.05)
        offsets = torch.randint(0, len(train_ids) - args.seq_len - 1, (args.batch,), generator=generator)
        batch = torch.stack([train_ids[o:o + args.seq_len + 1] for o in offsets.tolist()])
        logits = model(batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        tokens_seen += batch[:, 1:].numel()
        running.append(float(loss.detach()))
        if step % args.log_every == 0:
            mean = sum(running) / len(running)
            print(f"step {step}: loss {mean:.4f} (train ppl {math.exp(mean):.1f}), "
                  f"{time.perf_counter() - start:.0f} s", flush=True)
            running = []
    train_s = time.perf_counter() - start
    heldout_ppl, scored = windowed_perplexity(model, eval_ids, args.seq_len)
    print(f"trained {step} steps ({tokens_seen} tokens, {tokens_seen / len(train_ids):.2f} epochs) "
          f"in {train_s / 60:.2f} min; held-out perplexity {heldout_ppl:.4f} ({scored} tokens scored in "
          f"windows of {args.seq_len})", flush=True)

    heldout_path.parent.mkdir(parents=True, exist_ok=True)
    heldout_path.write_text(heldout_text, encoding="utf-8")
    save_folder(model, tokenizer, out, {
        "steps": step, "train_minutes": train_s / 60, "tokens_seen": tokens_seen, "train_tokens": len(train_ids),
        "heldout_perplexity": heldout_ppl, "heldout_tokens_scored": scored, "window": args.seq_len,
        "args": {k: v for k, v in vars(args).items() if k != "out"},
    })
    print(f"saved {out}; held-out text {heldout_path}", flush=True)
    if args.no_check:
        return 0

    cmd = [sys.executable, "-m", "edgeinfer.cli", "eval-ppl", str(out), "--linear-path", "reference",
           "--text", str(heldout_path), "--tokens", str(len(eval_ids)), "--window", str(args.seq_len), "-q"]
    print("check:", " ".join(cmd[1:]), flush=True)
    result = subprocess.run(cmd, capture_output=True, text=True)
    match = re.search(r"perplexity ([0-9.]+)", result.stdout)
    if result.returncode or not match:
        print(f"check FAILED ({result.returncode}): {result.stdout}{result.stderr[-2000:]}", flush=True)
        return 1
    engine_ppl = float(match.group(1))
    diff = 100 * (engine_ppl / heldout_ppl - 1)
    # The engine tokenizes the first bytes of the same text itself; fp32 either side, so beyond
    # summation order the two should agree to well under 1%.
    verdict = "agrees" if abs(diff) < 1.0 else "DISAGREES"
    print(f"check: edgeinfer eval-ppl {engine_ppl:.4f} vs training script {heldout_ppl:.4f} "
          f"({diff:+.3f}%): {verdict}", flush=True)
    return 0 if abs(diff) < 1.0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
