"""The run's allocator setting: large freed buffers go back to the OS."""
import os
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


# Prints the setting before and after the restart, and the pid that runs on after it.
RESTART = '''
import os
from specroll_jax.rl.resources import MMAP_THRESHOLD_ENV, restart_with_large_frees_returned
print('start', os.environ.get(MMAP_THRESHOLD_ENV), flush=True)
restart_with_large_frees_returned()
print('running', os.getpid(), os.environ[MMAP_THRESHOLD_ENV])
'''


def test_restart_sets_the_allocator_before_the_program_runs_once_more():
  env = {k: v for k, v in os.environ.items() if k != 'MALLOC_MMAP_THRESHOLD_'}
  run = subprocess.Popen([sys.executable, '-c', RESTART, 'arg'], cwd=REPO, env=env, text=True,
                         stdout=subprocess.PIPE)
  out, _ = run.communicate()
  assert run.returncode == 0
  # The same process (exec keeps the pid a parent waits on), restarted exactly once.
  assert out.split('\n') == ['start None', 'start 1048576', f'running {run.pid} 1048576', '']
