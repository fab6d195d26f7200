"""Adaptation ablation: the same seeded GRPO run with every variant, in one process.

  python -m experiments.bench.adaptation --config=configs/ablation_w1.py

Variants (rl.run_config.ADAPTATION_MODES): static heads, always-online retraining, Reflex only,
slow path only, both. Every variant starts from the same policy, data, seed and warm-started
heads or drafter (rollout.proposers; trained once, or c.initial_heads, and copied), and emits
the same tokens (their rollout digests are compared). Times are sums over the steps after
`warmup_steps` (the first steps compile the engine's shapes, including the compaction
gathers as rows first finish), medians over `repeats` runs of every variant in alternating
order; tau is per step.
"""
import shutil
from pathlib import Path

import jax
import numpy as np
from absl import app
from ml_collections import config_flags

from experiments.lib.common import run_fresh, totals
from specroll_jax.rl.resources import restart_with_large_frees_returned
from specroll_jax.rl.learned_proposers import learned_kind_name, parse_proposers
from experiments.lib.results import Figure, Result, Table, command_line, write

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/ablation_w1.py')


def learned_directory(c) -> str:
  """Where a run keeps its warm-started heads ('heads') or drafter ('drafter')."""
  return learned_kind_name(parse_proposers(c.rollout.proposers))


def run_variant(c, name: str, heads_source: Path | None) -> list[dict]:
  run = c.copy_and_resolve_references()
  workdir = Path(c.workdir) / name
  if name == 'vanilla':
    run.rollout.engine = 'vanilla'
  else:
    run.adaptation.mode = name
    if heads_source is not None and not (workdir / learned_directory(c)).exists():
      shutil.copytree(heads_source, workdir / learned_directory(c))
  return run_fresh(run, workdir)


def median_totals(repeats: list[list[dict]], warmup: int) -> dict:
  """Each phase's seconds (and end to end): the median over repeats of the run."""
  each = [totals(rows, warmup) for rows in repeats]
  return {k: float(np.median([t[k] for t in each])) for k in each[0]}


def variant_result(repeats: list[list[dict]], window: int, warmup: int) -> dict:
  """Per-step metrics from the first repeat (every repeat emits the same tokens and
  decisions: `identical_repeats`), times as medians over repeats."""
  rows = repeats[0]
  tau = [r['tau'] for r in rows]
  t = median_totals(repeats, warmup)
  triggers = [(r['step'], r['triggered']) for r in rows if r.get('triggered')]
  return {
      'tau_mean': float(np.mean(tau)), 'tau_first20': float(np.mean(tau[:window])),
      'tau_last20': float(np.mean(tau[-window:])),
      'time_end_to_end_s': t['end_to_end'], 'time_generation_s': t['rollout'],
      'time_proposer_updates_s': t['proposer_update'], 'time_update_s': t['update'],
      'first_step_s': t['first_step'],
      'time_end_to_end_by_repeat_s': [totals(r, warmup)['end_to_end'] for r in repeats],
      'identical_repeats': len({tuple(x['rollout_digest'] for x in r) for r in repeats}) == 1,
      'trigger_events': [{'step': s, 'heads': h} for s, h in triggers],
      'kept_updates': sum(len(r.get('kept', [])) for r in rows),
      'tau_by_step': tau,
      'head_acceptance_by_step': [r.get('head_acceptance') for r in rows],
      'reflex_gate_by_step': [r.get('reflex_gate') for r in rows],
      'reflex_alignment_by_step': [r.get('reflex_alignment') for r in rows],
      'drift_kl_by_step': [r.get('drift_kl') for r in rows],
      'reward_by_step': [r['reward'] for r in rows],
      'rollout_digests': [r['rollout_digest'] for r in rows],
  }


def targets(result: dict, window: int) -> list[str]:
  """The issues' targets that this run's variants can judge, each with the measured values
  and whether it is met."""
  v = result['variants']
  met = lambda ok: 'met' if ok else 'missed'
  lines = []
  if {'static', 'online', 'both'} <= set(v):
    e2e = lambda name: v[name]['time_end_to_end_s']
    for rival in ('online', 'static'):
      ratio = e2e(rival) / e2e('both')
      lines.append(f'- both >= 1.05x faster end to end than {rival}: {met(ratio >= 1.05)} '
                   f'({ratio:.3f}x)')
    share = result['online_proposer_update_share']
    lines.append(f"- online's proposer updates <= 5% of its end to end: {met(share <= 0.05)} "
                 f"({share:.3f})")
  for name in ('both', 'slow'):
    if {name, 'online'} <= set(v):
      kept = v[name]['tau_last20'] / v['online']['tau_last20']
      lines.append(f"- {name}'s tau over the last {window} steps >= 0.97 x online's: "
                   f"{met(kept >= 0.97)} ({kept:.3f})")
      spent = v[name]['time_proposer_updates_s'] / v['online']['time_proposer_updates_s']
      lines.append(f"- {name}'s proposer-update time <= 25% of online's: {met(spent <= 0.25)} "
                   f"({spent:.3f})")
  return lines or ['- not judged: the targets compare slow or both with online']


def per_step_table(variants: dict) -> list[str]:
  """tau of every variant at every step beside the drift, and Reflex's gate activity (the
  share of proposals whose correction was applied, mean over heads) where Reflex ran."""
  first = next(iter(variants.values()))
  reflex = [n for n in ('reflex', 'both') if n in variants]
  lines = ['| step | drift KL | reward | ' + ' | '.join(f'tau {n}' for n in variants)
           + ''.join(f' | {n} gate open' for n in reflex) + ' |',
           '|---:|' + '---:|' * (2 + len(variants) + len(reflex))]
  for i, (kl, reward) in enumerate(zip(first['drift_kl_by_step'], first['reward_by_step'])):
    gates = [variants[n]['reflex_gate_by_step'][i] for n in reflex]
    lines.append(f'| {i + 1} | {kl if kl is not None else float("nan"):.4f} | {reward:.3f} | '
                 + ' | '.join(f"{v['tau_by_step'][i]:.3f}" for v in variants.values())
                 + ''.join(f' | {np.mean(g):.4f}' if g else ' | -' for g in gates) + ' |')
  return lines


def report(c, result: dict) -> Result:
  variants = result['variants']
  rows = [[name, f"{v['tau_mean']:.3f}", f"{v['tau_first20']:.3f}", f"{v['tau_last20']:.3f}",
           f"{v['tau_last20'] / v['tau_first20']:.3f}", f"{v['time_generation_s']:.1f}",
           f"{v['time_update_s']:.1f}", f"{v['time_proposer_updates_s']:.2f}",
           f"{v['time_end_to_end_s']:.1f}", len(v['trigger_events']), v['kept_updates']]
          for name, v in variants.items()]
  table = Table(['variant', 'tau mean', f'tau first {c.window}', f'tau last {c.window}',
                 'last/first', 'generation s', 'learner s', 'proposer updates s', 'end-to-end s',
                 'triggers', 'kept'], rows, align='l' + 'r' * 10)
  agreement = ''
  if result.get('vanilla_rollout_digests'):
    same_steps = {name: next((i for i, (a, b) in enumerate(
        zip(v['rollout_digests'], result['vanilla_rollout_digests'])) if a != b),
        len(v['rollout_digests'])) for name, v in variants.items()}
    agreement = (' Steps whose rollouts equal vanilla\'s before the first difference (a '
                 'sampling float near-tie changes one token, and the runs then train on '
                 'different data): ' + ', '.join(f'{n} {k}' for n, k in same_steps.items()) + '.')
  repeats = ', '.join(f"{n} " + '/'.join(f'{t:.1f}' for t in v['time_end_to_end_by_repeat_s'])
                      for n, v in variants.items())
  return Result(
      title=f'Adaptation ablation ({Path(c.out_dir).name}, {learned_directory(c)})',
      command=command_line('experiments.bench.adaptation'), data=result,
      body=[f'{c.steps} GRPO steps, {c.rollout.prompts_per_step} prompts x '
            f'{c.rollout.group_size} samples x <= {c.rollout.driver.max_new_tokens} tokens; '
            'drift KL(current || initial) at the last step '
            f"{result['drift_kl_last']:.3f} nats/token; identical rollouts across variants: "
            f"{result['identical_rollouts']}.{agreement}", table,
            f'Times are summed over steps {c.warmup_steps + 1}..{c.steps}, medians of '
            f'{c.repeats} runs of every variant in alternating order (end to end per run: '
            f'{repeats}). End-to-end ratios:\n'
            + '\n'.join(f'- {k}: {v:.3f}x' for k, v in result['speedups'].items()),
            'Per step:', '\n'.join(per_step_table(variants)),
            'Targets:\n' + '\n'.join(targets(result, c.window))],
      figures=[Figure('tau.png', 'tau', lambda fig: plot_tau(fig, variants), size=(11, 4))])


def plot_tau(fig, variants) -> None:
  ax1, ax2 = fig.subplots(1, 2)
  for name, v in variants.items():
    ax1.plot(range(1, len(v['tau_by_step']) + 1), v['tau_by_step'], label=name)
  ax1.set(xlabel='GRPO step', ylabel='tau (tokens per policy forward)')
  ax1.legend()
  drift = next(iter(variants.values()))['drift_kl_by_step']
  ax2.plot(range(1, len(drift) + 1), drift)
  ax2.set(xlabel='GRPO step', ylabel='KL(current || initial) per token')


def main(argv):
  del argv
  c = _CONFIG.value
  if c.return_large_frees:
    restart_with_large_frees_returned()
  names = list(c.variants) + (['vanilla'] if c.include_vanilla else [])
  runs = {name: [] for name in names}
  heads_source = Path(c.initial_heads) if c.initial_heads else None
  # The CPU's speed drifts over a run of several minutes: repeats alternate the order so
  # that drift falls on every variant alike.
  for repeat in range(c.repeats):
    for name in names if repeat % 2 == 0 else names[::-1]:
      runs[name].append(run_variant(c, name, None if name == 'vanilla' else heads_source))
      if name != 'vanilla':
        heads_source = heads_source or Path(c.workdir) / name / learned_directory(c)
      # Every run compiles its own engines; dropping the last run's keeps memory flat.
      jax.clear_caches()
  variants = {name: variant_result(repeats, c.window, c.warmup_steps)
              for name, repeats in runs.items() if name != 'vanilla'}
  digests = {name: [r['rollout_digest'] for r in repeats[0]] for name, repeats in runs.items()}
  end_to_end = {name: median_totals(repeats, c.warmup_steps)['end_to_end']
                for name, repeats in runs.items()}
  speedups = {f'{name} vs online': end_to_end['online'] / t for name, t in end_to_end.items()
              if name not in ('online', 'vanilla') and 'online' in end_to_end}
  if 'vanilla' in end_to_end:
    speedups.update({f'{name} vs vanilla': end_to_end['vanilla'] / t
                     for name, t in end_to_end.items() if name != 'vanilla'})
  result = {
      'steps': c.steps, 'variants': variants, 'speedups': speedups,
      'time_end_to_end_s': end_to_end,
      'identical_rollouts': len({tuple(d) for d in digests.values()}) == 1,
      'vanilla_rollout_digests': digests.get('vanilla'),
      'drift_kl_last': next(iter(variants.values()))['drift_kl_by_step'][-1],
  }
  if 'online' in variants:
    result['online_proposer_update_share'] = (variants['online']['time_proposer_updates_s']
                                          / variants['online']['time_end_to_end_s'])
  write(report(c, result), c.out_dir)


if __name__ == '__main__':
  app.run(main)
