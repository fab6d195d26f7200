"""End-to-end GRPO benchmark: the same seeded run with each rollout engine, in one process.

  python -m experiments.bench_e2e --config=configs/bench_w1.py

Each engine trains from the same initial policy, data and seed in a fresh workdir (the
policy and the warm-started heads are cached and shared; their build time is excluded).
Speedups are ratios of summed step times; the first step of each run includes compilation
and is reported separately.
"""
import json
import sys
from pathlib import Path

import matplotlib
from absl import app
from ml_collections import config_flags

from experiments.common import run_fresh, totals
from specroll_jax.rl.report import TIME_KEYS

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/bench_w1.py')


def run_engine(c, engine: str) -> list[dict]:
  run = c.copy_and_resolve_references()
  run.rollout.engine = engine
  return run_fresh(run, Path(c.workdir) / engine)


def main(argv):
  del argv
  c = _CONFIG.value
  spec_heads = Path(c.workdir) / 'specroll' / 'heads'
  runs = {engine: run_engine(c, engine) for engine in c.engines}
  time = {engine: totals(rows) for engine, rows in runs.items()}
  base, spec = time['vanilla'], time['specroll']
  same = [a['rollout_digest'] == b['rollout_digest']
          for a, b in zip(runs['vanilla'], runs['specroll'])]
  # Per GRPO step after the first (which compiles): both engines sampled the same batch
  # from the same policy, so each step is one paired comparison of single timings.
  by_step = [a['time_rollout'] / b['time_rollout']
             for a, b in zip(runs['vanilla'][1:], runs['specroll'][1:])]
  result = {
      'command': ' '.join(['python -m experiments.bench_e2e'] + sys.argv[1:]),
      'steps': c.steps, 'heads_dir': str(spec_heads),
      'speedup_end_to_end': base['end_to_end'] / spec['end_to_end'],
      'speedup_generation': base['rollout'] / spec['rollout'],
      'min_speedup_over_batches': min(by_step),
      'speedup_generation_by_step': by_step,
      'tree_step_share_by_step': [r['tree_step_share'] for r in runs['specroll']],
      'tau': sum(r['tau'] for r in runs['specroll']) / len(runs['specroll']),
      'identical_rollout_steps': sum(same),
      'time_breakdown_s': time,
      'final_reward': {e: rows[-1]['reward'] for e, rows in runs.items()},
      'reward_by_step': {e: [r['reward'] for r in rows] for e, rows in runs.items()},
      'tau_by_step': [r['tau'] for r in runs['specroll']],
  }
  out = Path(c.out_dir)
  out.mkdir(parents=True, exist_ok=True)
  (out / 'results.json').write_text(json.dumps(result, indent=2) + '\n')
  keys = list(TIME_KEYS) + ['end_to_end']
  lines = ['| engine | ' + ' | '.join(f'{k} s' for k in keys) + ' |',
           '|---|' + '---:|' * len(keys)]
  for engine, t in time.items():
    lines.append(f'| {engine} | ' + ' | '.join(f'{t[k]:.1f}' for k in keys) + ' |')
  summary = (f"end-to-end speedup {result['speedup_end_to_end']:.2f}x, generation speedup "
             f"{result['speedup_generation']:.2f}x (per step: min {min(by_step):.2f}x), mean tau "
             f"{result['tau']:.2f}, identical rollouts in {sum(same)}/{len(same)} steps")
  (out / 'README.md').write_text(
      f"# End-to-end GRPO benchmark (W1)\n\nCommand: `{result['command']}`; steps 2..{c.steps} "
      f"(step 1 compiles).\n\n{summary}\n\n" + '\n'.join(lines)
      + '\n\n![reward and tau](e2e.png)\n')
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
  for engine, rows in runs.items():
    ax1.plot([r['step'] for r in rows], [r['reward'] for r in rows], label=engine)
  ax1.set(xlabel='GRPO step', ylabel='reward')
  ax1.legend()
  ax2.plot([r['step'] for r in runs['specroll']], result['tau_by_step'])
  ax2.set(xlabel='GRPO step', ylabel='tau (specroll)')
  fig.tight_layout()
  fig.savefig(out / 'e2e.png', dpi=100)
  print(summary)
  print('\n'.join(lines))


if __name__ == '__main__':
  app.run(main)
