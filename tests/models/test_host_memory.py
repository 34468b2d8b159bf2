"""How the process hands memory back (edgeinfer.models.host_memory): once the models are loaded,
a step's freed buffers stay in the heap for the next step instead of being mapped and zeroed by
the kernel each time.

Each case runs in a fresh subprocess: malloc's thresholds belong to the process (pytest's must not
move), and a heap that already holds a free chunk of the size asked would hide the policy.
"""

import subprocess
import sys

import pytest

from edgeinfer.models import host_memory

pytestmark = pytest.mark.skipif(host_memory._libc() is None, reason="glibc's malloc only")

# Minor page faults over 20 rounds of a 4 MiB buffer allocated, written and freed (through
# malloc, as torch's CPU tensors are), after `setup` and one round to grow the heap.
PROBE = """
import ctypes, resource
from edgeinfer.models import host_memory
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes, libc.memset.argtypes = [ctypes.c_void_p], [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
{setup}
def one_round():
    p = libc.malloc(4 << 20)
    libc.memset(p, 1, 4 << 20)
    libc.free(p)
one_round()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    one_round()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(setup: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE.format(setup=setup)], capture_output=True, text=True,
                         check=True)
    return int(out.stdout.split()[-1])


def test_step_buffers_stay_in_the_heap_once_the_models_are_loaded() -> None:
    # Loading's 1 MiB threshold maps every such buffer: each round faults its 1,024 pages in.
    assert _faults("host_memory.return_large_frees_to_the_os()") >= 20 * 1000
    # After keep_step_buffers the freed buffer is the next round's.
    assert _faults("host_memory.return_large_frees_to_the_os()\nhost_memory.keep_step_buffers()") < 100
