"""Soak: a long GRPO run whose memory stays flat and which compiles nothing after warm-up.

  python -m experiments.measure.soak --config=configs/tiny_math.py --config.steps=50 \
      --out_dir=results/soak

Runs the trainer in a fresh workdir and reads what it records every step: the process's
resident set, JAX's live device buffers (count and MiB) and the XLA compilations the step
triggered. The slopes are least-squares fits over the steps after `--warmup_steps` (which
compile the rollout, update, audit and slow-path programs on first use); a compilation
after warm-up is listed with the step and what that step ran for the first time, so a
first consolidation is told apart from a recompilation of a program already run.
"""
import json
import shutil
from pathlib import Path

import numpy as np
from absl import app, flags
from ml_collections import config_flags

from specroll_jax.rl.metrics import METRICS_FILE
from specroll_jax.rl.trainer import train
from experiments.lib.results import Figure, Result, Table, command_line, write

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/tiny_math.py')
_WORKDIR = flags.DEFINE_string('workdir', 'workdir/soak', 'Run directory (emptied first).')
_OUT = flags.DEFINE_string('out_dir', 'results/soak', 'Where results go.')
_WARMUP = flags.DEFINE_integer('warmup_steps', 5, 'Steps excluded from the slopes.')

# Work a step may do for the first time in a process (so compile on first use).
FIRST_USE = {'audit': 'audit_identical', 'consolidation': 'head_kl_after'}


def slope(steps, values) -> float:
  """Least-squares slope per step."""
  return float(np.polyfit(np.asarray(steps, float), np.asarray(values, float), 1)[0])


def compilations_after_warmup(rows, warmup: int) -> list[dict]:
  """Each step after warm-up that compiled, with the kinds of work it ran first."""
  seen, found = set(), []
  for row in rows:
    firsts = [kind for kind, key in FIRST_USE.items() if key in row and kind not in seen]
    seen.update(firsts)
    if row['step'] > warmup and row['compilations']:
      found.append({'step': row['step'], 'compilations': row['compilations'],
                    'first_use_of': firsts})
  return found


def main(argv):
  del argv
  c = _CONFIG.value
  workdir, out = Path(_WORKDIR.value), Path(_OUT.value)
  shutil.rmtree(workdir, ignore_errors=True)
  train(c, workdir)
  rows = [json.loads(line) for line in (workdir / METRICS_FILE).read_text().splitlines()]
  late = [r for r in rows if r['step'] > _WARMUP.value]
  steps = [r['step'] for r in late]
  compiled = compilations_after_warmup(rows, _WARMUP.value)
  recompiled = [entry for entry in compiled if not entry['first_use_of']]
  result = {
      'steps': len(rows), 'warmup_steps': _WARMUP.value,
      'rss_mib_first_last': [late[0]['rss_mib'], late[-1]['rss_mib']],
      'rss_mib_per_step': slope(steps, [r['rss_mib'] for r in late]),
      'live_array_mib_per_step': slope(steps, [r['live_array_mib'] for r in late]),
      'live_arrays_per_step': slope(steps, [r['live_arrays'] for r in late]),
      'live_arrays_min_max': [min(r['live_arrays'] for r in late),
                              max(r['live_arrays'] for r in late)],
      'compilations_in_warmup': sum(r['compilations'] for r in rows
                                    if r['step'] <= _WARMUP.value),
      'compilations_after_warmup': compiled,
      'recompilations': sum(entry['compilations'] for entry in recompiled)}
  write(Result('Soak', command_line('experiments.measure.soak'), result,
               body=[Table(['measure', 'value'], list(result.items()), align='lr')],
               figures=[Figure('memory.png', 'memory per step', lambda fig: plot_memory(fig, rows),
                               size=(10, 3.5))]), out)


def plot_memory(fig, rows) -> None:
  ax1, ax2 = fig.subplots(1, 2)
  ax1.plot([r['step'] for r in rows], [r['rss_mib'] for r in rows])
  ax1.set(xlabel='GRPO step', ylabel='resident set (MiB)')
  ax2.plot([r['step'] for r in rows], [r['live_array_mib'] for r in rows])
  ax2.set(xlabel='GRPO step', ylabel='live JAX arrays (MiB)')


if __name__ == '__main__':
  app.run(main)
