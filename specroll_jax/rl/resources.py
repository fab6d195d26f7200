"""What a run holds in memory, sampled once per GRPO step (the soak's evidence), and the
allocator setting that keeps what it holds close to what it uses."""
import ctypes
import ctypes.util
import os
import platform
import sys

import jax

# glibc's mallopt parameter for the size from which an allocation is its own mmap.
_M_MMAP_THRESHOLD = -3
LARGE_ALLOCATION_BYTES = 1 << 20
# The same setting as glibc reads it from the environment when a process starts.
MMAP_THRESHOLD_ENV = 'MALLOC_MMAP_THRESHOLD_'


def return_large_frees_to_the_os() -> bool:
  """Serves every allocation of at least 1 MiB by its own mmap, so freeing it returns it to
  the OS; returns False where the C library has no mallopt (not glibc).

  Why: glibc raises its mmap threshold to the size of each large block freed (up to 32
  MiB), after which such blocks come from its heap arenas and stay resident when freed. A
  GRPO step frees and reallocates gigabytes of XLA buffers (rollout caches, the learner's
  activations): on the SmolLM2 job the resident set sat at 10.3-10.6 GB after each step
  while live arrays were 1.5 GB; with this call, 8.1-8.4 GB at the same step times and
  tokens (notes/history.md, issue 31). It reaches only what is allocated after the call;
  `restart_with_large_frees_returned` covers the whole process. Setting the threshold also
  turns off glibc's dynamic raising of it, for the whole process.
  """
  path = ctypes.util.find_library('c')
  libc = ctypes.CDLL(path) if path else None
  if libc is None or not hasattr(libc, 'mallopt'):
    return False
  return bool(libc.mallopt(_M_MMAP_THRESHOLD, LARGE_ALLOCATION_BYTES))


def restart_with_large_frees_returned() -> None:
  """Re-executes this program (same pid, same arguments) with the setting of
  `return_large_frees_to_the_os` in its environment, unless it is there already; does nothing
  where the C library is not glibc. For entry points only (it replaces the process).

  Why: glibc reads the variable at its first allocation, so the setting then covers what
  the interpreter, the imports and the first compilations allocate too, which a call from
  inside the run cannot reach. Measured on the SmolLM2 job (notes/history.md, issue 31): a
  4-step check started this way held 7.3-7.6 GB after each step against 8.1-8.4 GB with the
  call alone, but the whole job's peak, set inside its updates, did not fall (8,617 vs
  8,520 MiB).
  """
  wanted = str(LARGE_ALLOCATION_BYTES)
  if platform.libc_ver()[0] != 'glibc' or os.environ.get(MMAP_THRESHOLD_ENV) == wanted:
    return
  os.environ[MMAP_THRESHOLD_ENV] = wanted
  sys.stdout.flush()
  sys.stderr.flush()
  os.execv(sys.executable, sys.orig_argv)


def _resident_mib() -> float | None:
  """The current resident set (Linux's /proc; None where the platform has no such file)."""
  try:
    with open('/proc/self/statm') as f:
      return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE') / 2**20
  except FileNotFoundError:
    return None


def process_memory() -> dict:
  """Resident set size of this process and JAX's live device buffers, in MiB."""
  arrays = jax.live_arrays()
  return {'rss_mib': _resident_mib(),
          'live_arrays': len(arrays),
          'live_array_mib': sum(a.nbytes for a in arrays) / 2**20}
