"""End-to-end GRPO benchmark: one seeded job per rollout variant, stepped in turn in one process.

  python -m experiments.bench.e2e --config=configs/bench_smol_paper.py
  python -m experiments.bench.e2e --config=configs/bench_w1.py

Each variant of c.variants ('vanilla' first, then 'specroll' with the job's adaptation mode or
'specroll:MODE' with another, e.g. 'specroll:static', 'specroll:online') is its own run from the
same initial policy, data and seed in a fresh c.workdir/<variant>; the runs take GRPO steps in
turn, the order reversed every step, so the machine's drift falls on all alike. Speculation is
exact, so every variant's rollouts are vanilla's tokens: each step's rollout digest, reward,
loss, gradient norm, ratio and entropy, and the final policy, must be bitwise vanilla's. The
benchmark writes what it measured, then fails if they are not.

Times are summed over the steps after the first (which compiles most shapes): generation is
the rollout phase; the update is reward, log-probs, the GRPO update and the proposer's
adaptation; end to end is both. The audit and the held-out evaluation are checks outside the
comparison (the benchmark's side-by-side audits every step); c.proposer_dir places a drafter
trained beforehand into each speculative run, in place of the run's own warm start.
"""
import shutil
import sys
from pathlib import Path

import numpy as np
import jax
from absl import app
from ml_collections import config_flags
from tqdm import tqdm

from experiments.lib.common import clear_run, trainer_part
from experiments.lib.results import Figure, Result, Table, command_line, write
from specroll_jax.rl.learned_proposers import KINDS
from specroll_jax.rl.resources import restart_with_large_frees_returned
from specroll_jax.rl.run import make_run
from specroll_jax.rl.run_config import run_config
from specroll_jax.rl.trainer import finish, step

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/bench_smol_paper.py')

BASELINE = 'vanilla'
# What a step learned: equal between variants when their rollouts are the same tokens.
LEARNING_KEYS = ('rollout_digest', 'reward', 'loss', 'grad_norm', 'ratio', 'entropy')
UPDATE_PHASES = ('reward', 'logprobs', 'update', 'head_update')


def variant_config(c, variant: str):
  """The typed run config of `variant` ('vanilla', 'specroll' or 'specroll:MODE')."""
  engine, _, mode = variant.partition(':')
  run = trainer_part(c)
  run.rollout.engine = engine
  if mode:
    if engine != 'specroll':
      raise ValueError(f'config variants: {variant!r}: only specroll variants take an '
                       'adaptation mode')
    run.adaptation.mode = mode
  return run_config(run)


def place_proposer(c, config, workdir: Path) -> None:
  """Copies the drafter trained beforehand (c.proposer_dir) to where the run's warm start
  finds it, for the variants that draft with a learned proposer."""
  learned = config.rollout.learned_proposer
  if not c.proposer_dir or learned is None:
    return
  kind, source = KINDS[learned], Path(c.proposer_dir)
  if not kind.is_saved(source):
    raise FileNotFoundError(f'config proposer_dir: {source} holds no saved {learned}')
  shutil.copytree(source, workdir / kind.directory_name, dirs_exist_ok=True)


def build_runs(c) -> dict:
  """Every variant's run and starting state, from step 0 in its own fresh workdir."""
  if not c.variants or c.variants[0] != BASELINE or len(c.variants) < 2:
    raise ValueError(f"config variants must start with {BASELINE!r} and name at least one "
                     f"other, got {tuple(c.variants)}")
  runs = {}
  for variant in c.variants:
    config = variant_config(c, variant)
    workdir = Path(c.workdir) / variant.replace(':', '_')
    clear_run(workdir)
    place_proposer(c, config, workdir)
    runs[variant] = make_run(config, workdir)
  return runs


def step_in_turn(c, runs: dict) -> tuple[dict, dict]:
  """Steps every run c.steps times, in turn; (each variant's metric lines, final states)."""
  states = {variant: state for variant, (_, state) in runs.items()}
  rows = {variant: [] for variant in runs}
  order = list(runs)
  for number in tqdm(range(c.steps), desc='e2e steps', file=sys.stderr):
    for variant in (order if number % 2 == 0 else order[::-1]):
      states[variant], metrics = step(runs[variant][0], states[variant])
      rows[variant].append(metrics)
  for run, _ in runs.values():
    finish(run)
  return rows, states


def same_learning(rows: dict, states: dict) -> dict:
  """Per variant: the steps whose learning keys differ from vanilla's (bitwise), and whether
  the final policy (and LoRA adapters) are vanilla's bit for bit."""
  base_rows, base = rows[BASELINE], states[BASELINE]
  out = {}
  for variant in rows:
    if variant == BASELINE:
      continue
    differing = [a['step'] for a, b in zip(base_rows, rows[variant])
                 if any(a.get(k) != b.get(k) for k in LEARNING_KEYS)]
    equal = jax.tree.map(lambda x, y: bool(np.array_equal(np.asarray(x), np.asarray(y))),
                         (base.policy, base.adapters),
                         (states[variant].policy, states[variant].adapters))
    out[variant] = {'differing_steps': differing,
                    'final_policy_bitwise_equal': all(jax.tree.leaves(equal))}
  return out


def phase_seconds(row: dict) -> dict:
  generation = row.get('time_rollout', 0.0)
  update = sum(row.get(f'time_{k}', 0.0) for k in UPDATE_PHASES)
  return {'generation': generation, 'update': update, 'end_to_end': generation + update}


def steady_totals(rows: list[dict]) -> dict:
  """Seconds per phase summed over the steps after the first."""
  per_step = [phase_seconds(r) for r in rows[1:]]
  return {k: sum(s[k] for s in per_step) for k in ('generation', 'update', 'end_to_end')}


def tau_last_over_first(rows: list[dict]) -> float:
  """Mean tau over the last quarter of steps over that of the first quarter (>= 1 step)."""
  quarter = max(1, len(rows) // 4)
  mean = lambda part: sum(r['tau'] for r in part) / len(part)
  return mean(rows[-quarter:]) / mean(rows[:quarter])


def adaptation_comparison(rows: dict, totals: dict) -> dict:
  """The slow path against always-online: tau kept and update time spent (both variants
  needed; None otherwise)."""
  slow = next((v for v in rows if v in ('specroll', 'specroll:slow')), None)
  if slow is None or 'specroll:online' not in rows:
    return {'slow_over_online_tau': None, 'slow_update_share_of_online': None}
  mean_tau = lambda v: sum(r['tau'] for r in rows[v]) / len(rows[v])
  adaptation_seconds = lambda v: sum(r.get('time_head_update', 0.0) for r in rows[v][1:])
  online = adaptation_seconds('specroll:online')
  return {'slow_over_online_tau': mean_tau(slow) / mean_tau('specroll:online'),
          'slow_update_share_of_online': adaptation_seconds(slow) / online if online else None}


def summary(c, rows: dict, states: dict) -> dict:
  totals = {variant: steady_totals(r) for variant, r in rows.items()}
  headline, base = c.variants[1], totals[BASELINE]
  learning = same_learning(rows, states)
  speedups = {variant: {k: base[k] / t[k] for k in t} for variant, t in totals.items()
              if variant != BASELINE}
  return {
      'steps': c.steps, 'variants': list(c.variants), 'headline_variant': headline,
      'rows_at_start': rows[BASELINE][0]['rows_at_start'],
      'generation_speedup': speedups[headline]['generation'],
      'e2e_speedup': speedups[headline]['end_to_end'],
      'learning_bitwise_equal': all(not v['differing_steps'] and v['final_policy_bitwise_equal']
                                    for v in learning.values()),
      # The side-by-side is the audit: a step whose rollout differs from vanilla's is a break.
      'audit_breaks': sum(len(v['differing_steps']) for v in learning.values()),
      **adaptation_comparison(rows, totals),
      'tau_last_over_first': tau_last_over_first(rows[headline]),
      'speedups': speedups, 'seconds_after_first_step': totals, 'learning': learning,
      'first_step_seconds': {v: phase_seconds(r[0]) for v, r in rows.items()},
      'per_step': {v: [{'step': r['step'], **phase_seconds(r), 'tau': r['tau'],
                        'tail_decode_share': r['tail_decode_share'],
                        'response_length': r['response_length'], 'reward': r['reward']}
                       for r in variant_rows] for v, variant_rows in rows.items()},
  }


def report(c, data: dict) -> Result:
  totals, speedups = data['seconds_after_first_step'], data['speedups']
  table = Table(['variant', 'generation s', 'update s', 'end to end s', 'generation x',
                 'end to end x', 'mean tau'],
                [[v, f"{t['generation']:.1f}", f"{t['update']:.1f}", f"{t['end_to_end']:.1f}",
                  f"{speedups[v]['generation']:.2f}" if v in speedups else '1',
                  f"{speedups[v]['end_to_end']:.2f}" if v in speedups else '1',
                  f"{np.mean([s['tau'] for s in data['per_step'][v]]):.3f}"]
                 for v, t in totals.items()], align='lrrrrrr')
  base_steps, head_steps = data['per_step'][BASELINE], data['per_step'][data['headline_variant']]
  per_step = Table(['step', 'vanilla gen s', 'specroll gen s', 'gen x', 'tau',
                    'tail share of decode (vanilla)', 'mean length'],
                   [[a['step'], f"{a['generation']:.1f}", f"{b['generation']:.1f}",
                     f"{a['generation'] / b['generation']:.2f}", f"{b['tau']:.3f}",
                     f"{a['tail_decode_share']:.2f}", f"{a['response_length']:.0f}"]
                    for a, b in zip(base_steps, head_steps)], align='rrrrrrr')
  return Result(
      title=f'End-to-end GRPO: {" / ".join(c.variants)}, stepped in turn',
      command=command_line('experiments.bench.e2e'), data=data,
      body=[f"{c.steps} GRPO steps, {data['rows_at_start']} rows at each rollout's start; "
            f"steps 2..{c.steps} (step 1 compiles): {data['headline_variant']} generation "
            f"{data['generation_speedup']:.2f}x and end to end {data['e2e_speedup']:.2f}x of "
            f"vanilla; learning bitwise equal: {data['learning_bitwise_equal']} "
            f"({data['audit_breaks']} differing steps); tau last / first quarter "
            f"{data['tau_last_over_first']:.3f}.", table, per_step],
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
  rows, states = step_in_turn(c, build_runs(c))
  data = summary(c, rows, states)
  write(report(c, data), c.out_dir)
  if not data['learning_bitwise_equal']:
    raise SystemExit(f"learning differs from vanilla's: {data['learning']}")


if __name__ == '__main__':
  app.run(main)
