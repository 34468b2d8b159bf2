"""The text excerpts that ship with edgeinfer, so eval-ppl and calibration work from any folder.

Two public-domain excerpts of tinyshakespeare (Karpathy's char-rnn corpus), 64 KiB each, disjoint
so a calibrated model is never scored on its calibration text:
- ``EVAL_TEXT``: characters 0-65535, the figures in docs/BENCHMARKS.md ("the first 4096 tokens of
  tinyshakespeare") are on it, so the default eval-ppl reproduces them;
- ``CALIB_TEXT``: characters 557697-623232, the calibration slice the GPTQ/AWQ figures used.
"""

from __future__ import annotations

from pathlib import Path

_DATA = Path(__file__).parent / "data"
EVAL_TEXT = _DATA / "shakespeare_eval.txt"
CALIB_TEXT = _DATA / "shakespeare_calib.txt"
