"""The run's allocator setting: large freed buffers go back to the OS."""
import subprocess
import sys

from tests.conftest import REPO

# Holes between live 2 MiB blocks, after a 16 MiB free has raised glibc's mmap threshold:
# without the setting they stay resident (measured here: 0 of 16 MiB returned).
PROBE = '''
import numpy as np
from specroll_jax.rl.resources import _resident_mib, return_large_frees_to_the_os
assert return_large_frees_to_the_os()
big = np.ones(16 << 17)
del big
blocks = [np.ones(2 << 17) for _ in range(16)]
before = _resident_mib()
del blocks[::2]
print(before - _resident_mib())
'''


def test_freed_large_blocks_leave_the_resident_set():
  # A fresh process: the setting is process-wide, and this one's heap has a history.
  out = subprocess.run([sys.executable, '-c', PROBE], cwd=REPO, check=True, capture_output=True,
                       text=True)
  assert float(out.stdout) >= 15.0, out.stdout
