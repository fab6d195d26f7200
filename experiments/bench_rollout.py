"""Rollout benchmark: vanilla vs SpecRoll (static heads) vs oracle, wall-time ratios.

  python -m experiments.bench_rollout --config=configs/bench_w2.py

All engines run in this process on the same prompts, seed and sampler; each is compiled
once, then timed `repeats` times in alternation, and ratios of medians are reported. The
oracle uses the same trees and budget as SpecRoll, with the vanilla rollout's true future
tokens as every head's rank-0 proposal: the ceiling of this design on this hardware. A
sweep over the number of prompts gives tau and speedup against the active batch size.
"""
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
from absl import app
from ml_collections import config_flags

from specroll_jax import load_policy
from specroll_jax.adapt.distill import DistillConfig, WarmStart, ensure_heads
from specroll_jax.rollout.driver import Driver, RolloutConfig
from specroll_jax.rollout.sampling import SamplerConfig
from specroll_jax.rollout.vanilla import VanillaEngine
from specroll_jax.spec.factory import head_proposer, make_engine, tree_config
from specroll_jax.spec.head_proposer import HeadDraftConfig
from specroll_jax.spec.heads import HeadsConfig
from specroll_jax.spec.oracle_proposer import OracleParams, OracleProposer

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/bench_w2.py')


def story_openings(policy, count, length, seed):
  """The first `length` tokens of `count` stories the policy writes from BOS."""
  engine = VanillaEngine(policy.config, SamplerConfig(temperature=1.0), policy.eos_ids)
  stories = Driver(engine, RolloutConfig(length, max_batch=64)).generate(
      policy.params, [[policy.config.bos_token_id]], count, seed)
  return [[policy.config.bos_token_id] + s.token_ids for s in stories]


def warm_started_heads(policy, c):
  """The heads in c.heads_dir, self-distilled on the policy's own stories when missing."""
  h = c.heads
  plan = WarmStart(num_sequences=h.num_sequences, held_out=h.held_out,
                   max_new_tokens=h.max_new_tokens, temperature=c.temperature, seed=h.seed)
  return ensure_heads(policy, HeadsConfig(h.num_heads), DistillConfig(steps=h.steps),
                      [[policy.config.bos_token_id]], plan, c.heads_dir, c.checkpoint)


def timed(fn, repeats):
  out, times = None, []
  for _ in range(repeats):
    start = time.perf_counter()
    out = fn()
    times.append(time.perf_counter() - start)
  return out, times


def compare(policy, heads_config, heads, prompts, c, tree, sampler):
  """One side-by-side run of the three engines on `prompts`."""
  rollout = RolloutConfig(c.max_new_tokens, max_batch=max(len(prompts), 1))
  vanilla = Driver(VanillaEngine(policy.config, sampler, policy.eos_ids), rollout)
  heads_proposer = head_proposer(policy, heads_config, c.heads_dir, sampler,
                                 HeadDraftConfig(tuple(c.branching)))
  spec_engine = make_engine(policy, 'specroll', sampler, proposer=heads_proposer, tree=tree)
  oracle_engine = make_engine(policy, 'specroll', sampler, proposer=OracleProposer(heads_proposer),
                              tree=tree)
  spec, oracle = Driver(spec_engine, rollout), Driver(oracle_engine, rollout)
  reference = vanilla.generate(policy.params, prompts, 1, c.seed)  # also compiles
  oracle_tokens = np.zeros((len(prompts), c.max_new_tokens), np.int32)
  for i, r in enumerate(reference):
    oracle_tokens[i, :len(r.token_ids)] = r.token_ids
  spec_params = spec_engine.params(policy.params, heads)
  oracle_params = oracle_engine.params(policy.params,
                                       OracleParams(heads, jnp.asarray(oracle_tokens)))
  runs = {'vanilla': lambda: vanilla.generate(policy.params, prompts, 1, c.seed),
          'specroll': lambda: spec.generate(spec_params, prompts, 1, c.seed),
          'oracle': lambda: oracle.generate(oracle_params, prompts, 1, c.seed)}
  for run in runs.values():
    run()  # compile every shape this workload reaches
  times = {name: [] for name in runs}
  outputs = {}
  for _ in range(c.repeats):
    for name, run in runs.items():
      outputs[name], t = timed(run, 1)
      times[name] += t
  engines = {'vanilla': vanilla.engine, 'specroll': spec_engine, 'oracle': oracle_engine}
  result = {}
  for name in runs:
    same = [a.token_ids == b.token_ids for a, b in zip(outputs[name], reference)]
    tokens_same = sum(len(a.token_ids) for a, s in zip(reference, same) if s)
    result[name] = dict(engines[name].summarize(outputs[name]), seconds=times[name],
                        median_seconds=statistics.median(times[name]),
                        identical_fraction=tokens_same / sum(len(a.token_ids) for a in reference),
                        identical_responses=sum(same))
  for name in runs:
    result[name]['speedup'] = result['vanilla']['median_seconds'] / result[name]['median_seconds']
  return result


def main(argv):
  del argv
  c = _CONFIG.value
  policy = load_policy(c.checkpoint)
  heads_config, heads = warm_started_heads(policy, c)
  tree = tree_config(policy, max_nodes=c.max_nodes,
                     capacity_tokens=c.capacity_tokens,
                     per_batch_capacity=c.capacity_per_batch)
  capacity = tree.capacity_by_batch or tree.capacity_tokens
  sampler = SamplerConfig(temperature=c.temperature)
  openings = story_openings(policy, c.num_prompts, c.opening_tokens, c.opening_seed)
  main_run = compare(policy, heads_config, heads, openings, c, tree, sampler)
  sweep = {b: compare(policy, heads_config, heads, openings[:b], c, tree, sampler)
           for b in c.batch_sweep if b != c.num_prompts}
  sweep[c.num_prompts] = main_run

  out = Path(c.out_dir)
  out.mkdir(parents=True, exist_ok=True)
  result = {
      'command': ' '.join(['python -m experiments.bench_rollout'] + sys.argv[1:]),
      'config': c.to_dict(), 'capacity_tokens': capacity, 'backend': jax.default_backend(),
      'speedup_generation': main_run['specroll']['speedup'],
      'tau': main_run['specroll']['tau'],
      'oracle_speedup': main_run['oracle']['speedup'],
      'oracle_tau': main_run['oracle']['tau'],
      'identical_fraction': main_run['specroll']['identical_fraction'],
      'engines': main_run,
      'batch_sweep': {str(b): {name: {k: r[name][k] for k in ('tau', 'speedup')}
                               for name in ('specroll', 'oracle')} for b, r in sorted(sweep.items())},
  }
  (out / 'results.json').write_text(json.dumps(result, indent=2, default=float) + '\n')
  lines = ['| engine | median s | speedup | tau | identical tokens | accept. by depth |',
           '|---|---:|---:|---:|---:|---|']
  for name, r in main_run.items():
    lines.append(f"| {name} | {r['median_seconds']:.2f} | {r['speedup']:.2f}x | {r['tau']:.2f} | "
                 f"{r['identical_fraction']:.4f} | {r.get('acceptance_by_depth', '-')} |")
  sweep_lines = ['| prompts | specroll tau | specroll speedup | oracle tau | oracle speedup |',
                 '|---:|---:|---:|---:|---:|']
  for b, r in sorted(sweep.items()):
    sweep_lines.append(f"| {b} | {r['specroll']['tau']:.2f} | {r['specroll']['speedup']:.2f}x | "
                       f"{r['oracle']['tau']:.2f} | {r['oracle']['speedup']:.2f}x |")
  (out / 'README.md').write_text(
      f"# Rollout benchmark ({Path(c.out_dir).name})\n\nCommand: `{result['command']}` "
      f"(backend {jax.default_backend()}, C_hw = {capacity} tokens)\n\n"
      + '\n'.join(lines) + '\n\n## Against the number of prompts\n\n' + '\n'.join(sweep_lines)
      + '\n\n![tau and speedup](tau_speedup.png)\n')
  batches = sorted(sweep)
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
  for name in ('specroll', 'oracle'):
    ax1.plot(batches, [sweep[b][name]['tau'] for b in batches], 'o-', label=name)
    ax2.plot(batches, [sweep[b][name]['speedup'] for b in batches], 'o-', label=name)
  ax1.set(xlabel='prompts in the batch', ylabel='tau (tokens / policy forward)', xscale='log')
  ax2.set(xlabel='prompts in the batch', ylabel='speedup over vanilla', xscale='log')
  ax2.axhline(1.0, color='gray', lw=0.5)
  for ax in (ax1, ax2):
    ax.legend()
  fig.tight_layout()
  fig.savefig(out / 'tau_speedup.png', dpi=100)
  print('\n'.join(lines + [''] + sweep_lines))


if __name__ == '__main__':
  app.run(main)
