"""End-to-end GRPO benchmark: the same seeded run with each rollout engine, in one process.

  python -m experiments.bench.e2e --config=configs/bench_w1.py

Each engine trains from the same initial policy, data and seed in a fresh workdir (the
policy and the warm-started heads are cached and shared; their build time is excluded).
Speedups are ratios of summed step times; the first step of each run includes compilation
and is reported separately.
"""
from pathlib import Path

from absl import app
from ml_collections import config_flags

from experiments.lib.common import run_fresh, totals
from experiments.lib.results import Figure, Result, Table, command_line, write
from specroll_jax.rl.report import TIME_KEYS

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/bench_w1.py')


def run_engine(c, engine: str) -> list[dict]:
  run = c.copy_and_resolve_references()
  run.rollout.engine = engine
  return run_fresh(run, Path(c.workdir) / engine)


def main(argv):
  del argv
  c = _CONFIG.value
  runs = {engine: run_engine(c, engine) for engine in c.engines}
  write(report(c, runs), c.out_dir)


def summary(c, runs) -> dict:
  time = {engine: totals(rows) for engine, rows in runs.items()}
  base, spec = time['vanilla'], time['specroll']
  same = [a['rollout_digest'] == b['rollout_digest']
          for a, b in zip(runs['vanilla'], runs['specroll'])]
  # Per GRPO step after the first (which compiles): both engines sampled the same batch
  # from the same policy, so each step is one paired comparison of single timings.
  by_step = [a['time_rollout'] / b['time_rollout']
             for a, b in zip(runs['vanilla'][1:], runs['specroll'][1:])]
  return {
      'steps': c.steps, 'heads_dir': str(Path(c.workdir) / 'specroll' / 'heads'),
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


def report(c, runs) -> Result:
  data = summary(c, runs)
  keys = list(TIME_KEYS) + ['end_to_end']
  table = Table(['engine'] + [f'{k} s' for k in keys],
                [[engine] + [f'{t[k]:.1f}' for k in keys]
                 for engine, t in data['time_breakdown_s'].items()], align='l' + 'r' * len(keys))
  return Result(
      title='End-to-end GRPO benchmark (W1)', command=command_line('experiments.bench.e2e'),
      data=data,
      body=[f'Steps 2..{c.steps} (step 1 compiles): end-to-end speedup '
            f"{data['speedup_end_to_end']:.2f}x, generation speedup "
            f"{data['speedup_generation']:.2f}x (per step: min "
            f"{data['min_speedup_over_batches']:.2f}x), mean tau {data['tau']:.2f}, identical "
            f"rollouts in {data['identical_rollout_steps']}/{len(runs['specroll'])} steps.",
            table],
      figures=[Figure('e2e.png', 'reward and tau', lambda fig: plot_runs(fig, runs))])


def plot_runs(fig, runs) -> None:
  ax1, ax2 = fig.subplots(1, 2)
  for engine, rows in runs.items():
    ax1.plot([r['step'] for r in rows], [r['reward'] for r in rows], label=engine)
  ax1.set(xlabel='GRPO step', ylabel='reward')
  ax1.legend()
  ax2.plot([r['step'] for r in runs['specroll']], [r['tau'] for r in runs['specroll']])
  ax2.set(xlabel='GRPO step', ylabel='tau (specroll)')


if __name__ == '__main__':
  app.run(main)
