"""transport.service: what the server process does for itself beyond serving."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_the_service_freezes_its_start_up_heap_after_collecting_its_garbage() -> None:
    """transport.service.freeze_startup_heap (run_service calls it once the model is up): what is
    alive leaves the collector's generations, so a full collection no longer walks the start-up
    heap (69-126 ms with the default model); cyclic garbage made before it is collected, not
    frozen. In a child process: freezing is for the whole process."""
    code = """
import gc, weakref
from transport.service import freeze_startup_heap
class Node: pass
a, b = Node(), Node()
a.other, b.other = b, a
gone = weakref.ref(a)
del a, b
kept = [Node() for _ in range(1000)]
frozen = freeze_startup_heap()
assert gone() is None, "a cycle of garbage was frozen"
assert frozen >= 1000 and len(gc.get_objects()) < 100 and gc.isenabled(), (frozen, len(gc.get_objects()))
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
