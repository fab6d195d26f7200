"""Test setup: 8 host CPU devices (for the sharding tests), one compilation cache for the
session, and shared fixtures."""
import os
import shutil
import tempfile

# Must happen before jax is imported anywhere in the test process. Once: pytest-xdist's
# workers inherit the environment of the process that imported this file first.
HOST_DEVICES_FLAG = '--xla_force_host_platform_device_count=8'
if HOST_DEVICES_FLAG not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = f"{os.environ.get('XLA_FLAGS', '')} {HOST_DEVICES_FLAG}".strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
# A persistent compilation cache, new for each session, shared by the pytest-xdist workers
# (they inherit this variable from the first process) and the subprocesses the tests start:
# a program compiled once (the same HLO, options and devices) is loaded by later tests
# instead of compiled again, the same executable and so the same bits (the exactness module
# ran 28% faster with it, 2026-12-04). A size limit makes JAX guard each read and write with
# a file lock (filelock), so one process never reads an entry another is still writing; the
# limit itself is far above what a session writes. Loads still count as
# compilations (rollout/compilation.py), so the no-recompilation tests see them.
CACHE_OWNER_VARIABLE = 'SPECROLL_TESTS_XLA_CACHE_OWNER'
if 'JAX_COMPILATION_CACHE_DIR' not in os.environ:
  os.environ['JAX_COMPILATION_CACHE_DIR'] = tempfile.mkdtemp(prefix='specroll_tests_xla_cache_')
  os.environ[CACHE_OWNER_VARIABLE] = str(os.getpid())
os.environ['JAX_COMPILATION_CACHE_MAX_SIZE'] = str(64 * 2**30)
os.environ['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'] = '0'
os.environ['JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES'] = '-1'

import pytest  # noqa: E402

from specroll_jax.tasks import paths  # noqa: E402

REPO = paths.REPO_DIR
STORIES = paths.STORIES260K_DIR
# The first rows of every dataset file, in a data directory's layout (see its README).
FIXTURE_DATA = REPO / 'tests' / 'fixtures' / 'data'
# Only the tests of the full datasets themselves (row counts, their first rows) need them;
# a clone with nothing beside it has only the fixtures, and CI has the full files.
needs_full_data = pytest.mark.skipif(
    not paths.data_dir_exists(),
    reason=f'the full datasets are not here: set {paths.DATA_DIR_VARIABLE} or place them at '
           f'{paths.DEFAULT_DATA_DIR}')


def pytest_configure(config):
  config.addinivalue_line(
      'markers', 'slow: starts processes or runs a notebook (minutes); `pytest -m "not slow"` '
      'is the fast set, CI runs everything')


# The modules that take longest (summed durations, 2026-12-07), longest first. pytest-xdist
# hands whole modules (`--dist loadfile`) to the workers in collection order, so the longest
# start first and the short ones fill in at the end, instead of one long module running alone
# on one worker after the other has finished. Only the order changes, never what runs.
LONGEST_MODULES = (
    'speculative/test_speculative_exactness.py',
    'speculative/test_context_drafter.py',
    'experiments/test_notebooks.py',
    'rl/test_scale_out.py',
    'model/test_bf16_compute.py',
    'rl/test_trainer.py',
    'speculative/test_drafter.py',
    'adapt/test_reflex.py',
)


def pytest_collection_modifyitems(items):
  def rank(item):
    module = item.nodeid.split('::')[0]
    return next((i for i, name in enumerate(LONGEST_MODULES) if module.endswith(name)),
                len(LONGEST_MODULES))
  items.sort(key=rank)


def pytest_unconfigure(config):
  """The process that made the session's compilation cache removes it when the session ends."""
  del config
  if os.environ.get(CACHE_OWNER_VARIABLE) == str(os.getpid()):
    shutil.rmtree(os.environ['JAX_COMPILATION_CACHE_DIR'], ignore_errors=True)


@pytest.fixture(scope='session')
def stories_policy():
  from specroll_jax import load_policy
  return load_policy(STORIES)


@pytest.fixture(autouse=True, scope='module')
def release_compiled_programs():
  """Drops JAX's compiled programs after each test module. Every XLA:CPU executable keeps
  anonymous memory mappings (the kernel allows 65,530): without this a whole-suite process
  crashed in a compile near the end (a segfault in backend_compile_and_load); with it the
  suite passed, peaking at ~42,000 mappings inside test_trainer."""
  yield
  import jax
  jax.clear_caches()
