"""End-to-end GRPO benchmark: one seeded job per rollout variant, stepped in turn in one process.

  python -m experiments.bench.e2e --config=configs/bench_smol_paper.py
  python -m experiments.bench.e2e --config=configs/bench_w1.py

Each variant of c.variants ('vanilla' first, then 'specroll' with the job's adaptation mode or
'specroll:MODE' with another, e.g. 'specroll:static', 'specroll:online') is its own run from the
same initial policy, data and seed in a fresh c.workdir/<variant>; the runs take GRPO steps in
turn, the order rotated every step, so the machine's drift falls on all alike. Speculation is
exact, so every variant's rollouts are vanilla's tokens: each step's rollout digest, reward,
loss, gradient norm, ratio, entropy (LEARNING_KEYS), and the final policy, must be bitwise
vanilla's. The benchmark writes what it measured, then fails if they are not.

Times are summed over the steps after the first (which compiles most shapes): generation is
the rollout phase; the learner is reward, log-probs, the GRPO update and the proposer's
adaptation; end to end is every timed phase (the benchmark configs turn the audit and the
held-out evaluation off: the side-by-side audits every step, and the evaluation is the job's).
c.proposer_dir places a proposer trained beforehand into each speculative run, in place of the
run's own warm start.
"""
import sys

import numpy as np
import jax
from absl import app
from ml_collections import config_flags
from tqdm import tqdm

from experiments.lib.common import totals
from experiments.lib.results import Figure, Result, Table, command_line, write
from experiments.lib.variant_runs import BASELINE, build_runs
from specroll_jax.rl.report import TIME_KEYS
from specroll_jax.rl.resources import restart_with_large_frees_returned
from specroll_jax.rl.trainer import finish, step

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/bench_smol_paper.py')

# What a step learned: bitwise equal between variants whose rollouts are the same tokens.
LEARNING_KEYS = ('rollout_digest', 'reward', 'accuracy', 'response_length', 'loss',
                 'policy_loss', 'grad_norm', 'ratio', 'entropy', 'clip_fraction',
                 'update_skipped')
LEARNER_PHASES = ('reward', 'logprobs', 'update', 'proposer_update')


def check_steps(c) -> None:
  if c.steps < 2:
    raise ValueError(f'config steps must be >= 2 (the first compiles), got {c.steps}')


def step_in_turn(c, runs: dict) -> tuple[dict, dict]:
  """Steps every run c.steps times, in turn, the order rotated every step (drift falls on
  each variant in every position); (each variant's metric lines, final states)."""
  states = {variant: state for variant, (_, state) in runs.items()}
  rows = {variant: [] for variant in runs}
  order = list(runs)
  for number in tqdm(range(c.steps), desc='e2e steps', file=sys.stderr):
    shift = number % len(order)
    for variant in order[shift:] + order[:shift]:
      run = runs[variant][0]
      states[variant], metrics = step(run, states[variant])
      # Orbax writes in the background: finished here, no save overlaps another run's step.
      run.checkpoints.wait_until_finished()
      rows[variant].append(metrics)
  for run, _ in runs.values():
    finish(run)
  return rows, states


def same_learning(rows: dict, states: dict) -> dict:
  """Per variant against vanilla: the steps whose rollout (digest) or learning keys differ
  (bitwise), and whether the final policy (and LoRA adapters) are vanilla's bit for bit."""
  base_rows, base = rows[BASELINE], states[BASELINE]
  out = {}
  for variant in rows:
    if variant == BASELINE:
      continue
    pairs = list(zip(base_rows, rows[variant], strict=True))
    leaves = jax.tree.leaves(jax.tree.map(
        lambda x, y: bool(np.array_equal(np.asarray(x), np.asarray(y))),
        (base.policy, base.adapters), (states[variant].policy, states[variant].adapters)))
    out[variant] = {
        'rollout_differs_at': [a['step'] for a, b in pairs
                               if a['rollout_digest'] != b['rollout_digest']],
        'learning_differs_at': [a['step'] for a, b in pairs
                                if any(a[k] != b[k] for k in LEARNING_KEYS)],
        'final_policy_bitwise_equal': bool(leaves) and all(leaves)}
  return out


def step_seconds(row: dict) -> dict:
  """A step's generation (the rollout), learner (reward, log-probs, update, the proposer's
  adaptation) and end-to-end seconds (every timed phase, as common.totals sums them)."""
  return {'generation': row.get('time_rollout', 0.0),
          'learner': sum(row.get(f'time_{k}', 0.0) for k in LEARNER_PHASES),
          'end_to_end': sum(row.get(f'time_{k}', 0.0) for k in TIME_KEYS)}


def quarter_tau(rows: list[dict]) -> tuple[float, float]:
  """Mean tau over the first and over the last quarter of the steps (>= 1 step each)."""
  quarter = max(1, len(rows) // 4)
  mean = lambda part: sum(r['tau'] for r in part) / len(part)
  return mean(rows[:quarter]), mean(rows[-quarter:])


def adaptation_comparison(c, rows: dict) -> dict:
  """The slow path against always-online (variants whose mode is 'slow' and 'online'): tau
  over the last quarter of steps, and the seconds spent adapting the proposer."""
  # A variant's mode is its name's (checked by variant_runs.variant_config), else the job's.
  modes = {v.partition(':')[2] or c.adaptation.mode: v for v in rows if v != BASELINE}
  if 'slow' not in modes or 'online' not in modes:
    return {'slow_over_online_tau': None, 'slow_update_share_of_online': None}
  slow, online = rows[modes['slow']], rows[modes['online']]
  slow_seconds, online_seconds = (totals(r)['proposer_update'] for r in (slow, online))
  return {'slow_over_online_tau': quarter_tau(slow)[1] / quarter_tau(online)[1],
          'slow_update_share_of_online':
              slow_seconds / online_seconds if online_seconds else None}


def summary(c, rows: dict, states: dict) -> dict:
  seconds = {v: [step_seconds(r) for r in variant_rows] for v, variant_rows in rows.items()}
  steady = {v: {k: sum(s[k] for s in steps[1:]) for k in steps[0]}
            for v, steps in seconds.items()}
  headline, base = c.variants[1], steady[BASELINE]
  learning = same_learning(rows, states)
  speedups = {v: {k: base[k] / t[k] for k in t} for v, t in steady.items() if v != BASELINE}
  first_tau, last_tau = quarter_tau(rows[headline])
  return {
      'steps': c.steps, 'variants': list(c.variants), 'headline_variant': headline,
      'rows_at_start': rows[BASELINE][0]['rows_at_start'],
      'generation_speedup': speedups[headline]['generation'],
      'e2e_speedup': speedups[headline]['end_to_end'],
      'min_generation_speedup_over_steps': min(
          a['generation'] / b['generation']
          for a, b in zip(seconds[BASELINE][1:], seconds[headline][1:])),
      'learning_bitwise_equal': all(not v['learning_differs_at'] and
                                    v['final_policy_bitwise_equal'] for v in learning.values()),
      # The side-by-side is the audit: a step whose rollout is not vanilla's is a break.
      'audit_breaks': sum(len(v['rollout_differs_at']) for v in learning.values()),
      **adaptation_comparison(c, rows),
      'tau_last_over_first': last_tau / first_tau,
      'speedups': speedups, 'seconds_after_first_step': steady, 'learning': learning,
      'per_step': {v: [{'step': r['step'], **s, 'tau': r['tau'],
                        'tail_decode_share': r['tail_decode_share'],
                        'response_length': r['response_length'], 'reward': r['reward'],
                        'compilations': r['compilations']}
                       for r, s in zip(rows[v], seconds[v])] for v in rows},
  }


def report(c, data: dict) -> Result:
  steady, speedups = data['seconds_after_first_step'], data['speedups']
  ratio = lambda v, k: f'{speedups[v][k]:.2f}' if v in speedups else '1'
  table = Table(['variant', 'generation s', 'learner s', 'end to end s', 'generation x',
                 'end to end x', 'mean tau'],
                [[v, f"{t['generation']:.1f}", f"{t['learner']:.1f}", f"{t['end_to_end']:.1f}",
                  ratio(v, 'generation'), ratio(v, 'end_to_end'),
                  f"{np.mean([s['tau'] for s in data['per_step'][v]]):.3f}"]
                 for v, t in steady.items()], align='lrrrrrr')
  headline = data['headline_variant']
  per_step = Table(['step', 'vanilla gen s', f'{headline} gen s', 'gen x', 'tau',
                    'vanilla decode in <= 4-row buckets', 'mean length'],
                   [[a['step'], f"{a['generation']:.1f}", f"{b['generation']:.1f}",
                     f"{a['generation'] / b['generation']:.2f}", f"{b['tau']:.3f}",
                     f"{a['tail_decode_share']:.0%}", f"{a['response_length']:.0f}"]
                    for a, b in zip(data['per_step'][BASELINE], data['per_step'][headline])],
                   align='rrrrrrr')
  adaptation = ('' if data['slow_over_online_tau'] is None else
                f" Slow path over always-online: tau (last quarter) "
                f"{data['slow_over_online_tau']:.3f}, adaptation seconds "
                f"{data['slow_update_share_of_online']:.2f}.")
  return Result(
      title=f'End-to-end GRPO: {" / ".join(c.variants)}, stepped in turn',
      command=command_line('experiments.bench.e2e'), data=data,
      body=[f"{c.steps} GRPO steps, {data['rows_at_start']} rows at each rollout's start; "
            f"steps 2..{c.steps} (step 1 compiles): {headline} generation "
            f"{data['generation_speedup']:.2f}x (per step: min "
            f"{data['min_generation_speedup_over_steps']:.2f}x) and end to end "
            f"{data['e2e_speedup']:.2f}x of vanilla; learning bitwise equal: "
            f"{data['learning_bitwise_equal']} ({data['audit_breaks']} rollouts unlike "
            f"vanilla's); tau last / first quarter {data['tau_last_over_first']:.3f}."
            + adaptation, table, per_step],
      figures=[Figure('e2e.png', 'generation time and tau per step',
                      lambda fig: plot_steps(fig, data['per_step']))])


def plot_steps(fig, per_step: dict) -> None:
  ax1, ax2 = fig.subplots(1, 2)
  for variant, steps in per_step.items():
    ax1.plot([s['step'] for s in steps], [s['generation'] for s in steps], label=variant)
    if variant != BASELINE:
      ax2.plot([s['step'] for s in steps], [s['tau'] for s in steps], label=variant)
  ax1.set(xlabel='GRPO step', ylabel='generation s')
  ax2.set(xlabel='GRPO step', ylabel='tau')
  ax1.legend()
  ax2.legend()


def main(argv):
  del argv
  c = _CONFIG.value
  if c.return_large_frees:
    restart_with_large_frees_returned()
  check_steps(c)
  rows, states = step_in_turn(c, build_runs(c, c.workdir))
  data = summary(c, rows, states)
  write(report(c, data), c.out_dir)
  if not data['learning_bitwise_equal']:
    raise SystemExit(f"learning differs from vanilla's: {data['learning']}")


if __name__ == '__main__':
  app.run(main)
