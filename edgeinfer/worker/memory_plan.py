"""The memory plan: what a running model holds, in one line every front end prints at start.

"weights 98 MB, KV cache fp16 755 MB = 32768 tokens = 4 x 8192-token sequences (cpu)". The pool's
size comes from edgeinfer.worker.device_memory.num_kv_blocks (--ctx x --parallel, or --kv-memory);
this module only measures and describes, so the plan printed is the pool built.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

MB = 10**6


@dataclass(frozen=True)
class MemoryPlan:
    device: str
    weight_bytes: int  # resident tensors (a GGUF embedding read from its file on demand is not)
    kv_bytes: int  # the pool's bytes: virtual on the CPU until blocks are first written
    kv_tokens: int
    k_dtype: str
    v_dtype: str
    context: int  # the longest sequence admission accepts (--ctx)
    activation_bytes: int = 0  # held back for a worst-case step (CUDA)

    def describe(self) -> str:
        kv = self.k_dtype if self.k_dtype == self.v_dtype else f"K {self.k_dtype} / V {self.v_dtype}"
        text = (f"weights {self.weight_bytes / MB:,.0f} MB, KV cache {kv} {self.kv_bytes / MB:,.0f} MB = "
                f"{self.kv_tokens} tokens = {self.kv_tokens / self.context:.3g} x {self.context}-token sequences")
        if self.activation_bytes:
            text += f", activations {self.activation_bytes / MB:,.0f} MB"
        return f"{text} ({self.device})"


def tensor_bytes(obj: Any) -> int:
    """Bytes of the distinct tensor storages reachable from ``obj`` (dataclasses, dicts, lists,
    plain objects), each storage counted once however many views of it there are."""
    seen: set[int] = set()
    visited: set[int] = set()
    total = 0
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
            continue
        if id(item) in visited or isinstance(item, (str, bytes, int, float, bool, type(None))):
            continue
        visited.add(id(item))
        if dataclasses.is_dataclass(item) and not isinstance(item, type):
            stack.extend(getattr(item, f.name) for f in dataclasses.fields(item))
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif hasattr(item, "__dict__"):
            stack.extend(vars(item).values())
    return total


def check_budget_plan(plan: dict[str, Any], available_bytes: int, device: str) -> None:
    """Refuse, with the figures, a checkpoint planned to a memory budget (quant.budget's
    "edgeinfer_plan": weights + KV for ctx x parallel) that the machine cannot hold."""
    if not plan:
        return
    need = int(plan["weight_bytes"]) + int(plan["kv_bytes"])
    if need > available_bytes:
        raise ValueError(
            f"this checkpoint was planned for weights {int(plan['weight_bytes']) / MB:,.0f} MB + KV "
            f"{int(plan['kv_bytes']) / MB:,.0f} MB ({plan['ctx']} tokens x {plan['parallel']}, {plan['kv_dtype']}) "
            f"= {need / MB:,.0f} MB, but {available_bytes / MB:,.0f} MB are available ({device}); "
            f"{(need - available_bytes) / MB:,.0f} MB short: plan it again with a smaller --budget, --ctx "
            "or --parallel")

