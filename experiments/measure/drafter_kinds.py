"""The sequential against the context-attending drafter, trained on the same generations.

  python -m experiments.measure.drafter_kinds --config=configs/drafter_kinds_w3.py

One set of distillation pairs (the policy's own T = 1 answers, c.kinds_pairs) trains both
kinds with the same steps, batches, learning rate (c.kinds_training), draft vocabulary and
seed, so the only difference is the context: the sequential drafter reads h_t and the token before,
the context drafter also attends over its cached entries of the response so far. Measured:
held-out teacher-forced top-1 agreement per depth and the policy's mass on it, the recipe's
wall time, proposing cost at one response (plain steps, as experiments.bench.drafts prices
it), and tau at c.kind_cells on held-out GSM8K test questions with both drafting the same
spine (c.drafter_branching), every response checked against vanilla's. The pairs and the
trained drafters are kept in c.kinds_dir and reused (a killed run loses no generation).
"""
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np
from absl import app
from ml_collections import config_flags

from experiments.lib.draft_cells import proposing_costs, run_cell
from experiments.lib.results import Result, Table, command_line, write
from experiments.lib.workloads import benchmark_prompts, drafter_config, head_training_prompts
from specroll_jax import load_policy
from specroll_jax.adapt.distill import WarmStart, generated_pairs
from specroll_jax.adapt.drafter_training import (DrafterTraining, agreement_rates,
                                                 train_drafter, vocabulary_coverage)
from specroll_jax.rollout.sampling import SamplerConfig
from specroll_jax.speculative.context_drafter import ContextDrafterConfig
from specroll_jax.speculative.context_drafter_proposer import ContextDrafterProposer
from specroll_jax.speculative.drafter import (DrafterMetadata, drafter_metadata, has_drafter,
                                              load_drafter, save_drafter)
from specroll_jax.speculative.drafter_proposer import DrafterProposer, spine_paths
from specroll_jax.speculative.pairs import DistillPairs

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/drafter_kinds_w3.py')
PROPOSERS = {'drafter': DrafterProposer, 'context_drafter': ContextDrafterProposer}
FIELDS = [f.name for f in dataclasses.fields(DistillPairs)]


def kinds(c) -> dict:
  sequential = drafter_config(c.drafter)
  return {'drafter': sequential,
          'context_drafter': ContextDrafterConfig.from_block(sequential, c.context_heads)}


class SharedPairs:
  """The pairs both kinds train on: generated once when a kind needs them, kept in
  c.kinds_dir/pairs.npz (written aside, then renamed)."""

  def __init__(self, policy, c):
    self.policy, self.c, self.pairs = policy, c, None
    self.path = Path(c.kinds_dir) / 'pairs.npz'

  def get(self):
    if self.pairs is None and self.path.is_file():
      with np.load(self.path) as saved:
        self.seconds = float(saved['seconds'])
        self.pairs = tuple(DistillPairs(**{f: saved[f'{part}_{f}'] for f in FIELDS})
                           for part in ('train', 'held'))
    if self.pairs is None:
      p, start = self.c.kinds_pairs, time.perf_counter()
      plan = WarmStart(num_sequences=p.num_sequences, held_out=p.held_out,
                       max_new_tokens=p.max_new_tokens, temperature=self.c.temperature,
                       seed=p.seed)
      self.pairs = generated_pairs(self.policy, head_training_prompts(self.policy, self.c, p),
                                   plan, DrafterTraining().target_top_k)
      self.seconds = time.perf_counter() - start
      self.path.parent.mkdir(parents=True, exist_ok=True)
      arrays = {f'{part}_{f}': np.asarray(getattr(pairs, f))
                for part, pairs in zip(('train', 'held'), self.pairs) for f in FIELDS}
      with open(self.path.with_suffix('.tmp'), 'wb') as file:
        np.savez(file, seconds=self.seconds, **arrays)
      self.path.with_suffix('.tmp').replace(self.path)
    return self.pairs


def trained(policy, c, pairs: SharedPairs, name, config):
  """(config, params) of kind `name`, trained into c.kinds_dir/name when missing."""
  directory = Path(c.kinds_dir) / name
  if not has_drafter(directory, type(config)):
    train, held = pairs.get()
    t, start = c.kinds_training, time.perf_counter()
    print(f'training {name} into {directory}', file=sys.stderr)
    params, loss = train_drafter(policy, config, DrafterTraining(
        batch_size=t.batch_size, steps=t.steps, learning_rate=t.learning_rate), train,
        c.kinds_pairs.seed)
    top1, mass = agreement_rates(config, policy.config, params, policy.params, held)
    save_drafter(directory, config, params, DrafterMetadata(
        source=c.checkpoint, num_sequences=c.kinds_pairs.num_sequences,
        positions=int(train.valid.sum()), steps=t.steps, final_loss=loss,
        seconds=pairs.seconds + time.perf_counter() - start, top1_by_depth=top1.tolist(),
        mass_by_depth=mass.tolist(), vocab_coverage=vocabulary_coverage(params.vocab_ids, held)))
  return load_drafter(directory, policy.config, type(config))


def measure(c) -> dict:
  policy = load_policy(c.checkpoint, c.dtype)
  sampler = SamplerConfig(temperature=c.temperature)
  pairs = SharedPairs(policy, c)
  built, records = {}, {}
  for name, config in kinds(c).items():
    config, params = trained(policy, c, pairs, name, config)
    built[name] = (PROPOSERS[name](policy.config, config, spine_paths(c.drafter_branching),
                                   sampler), params)
    records[name] = dataclasses.asdict(drafter_metadata(Path(c.kinds_dir) / name,
                                                        type(config)))
  prompts = benchmark_prompts(policy, c)
  costs = proposing_costs(policy, c, built, prompts, sampler) if c.kinds_costs else {}
  cells = {f'{nodes}/{responses}': run_cell(policy, c, built, prompts, nodes, responses,
                                            sampler)
           for nodes, responses in c.kind_cells}
  return {'records': records, 'proposing_costs': costs, 'cells': cells}


def report(c, measured) -> Result:
  names = list(measured['records'])
  cells, records = measured['cells'], measured['records']
  rows = [[key.split('/')[0], key.split('/')[1]]
          + [f'{cell[n]["tau"]:.3f} ({cell[n]["identical"]}/{cell[n]["responses"]})'
             for n in names] for key, cell in cells.items()]
  costs = measured['proposing_costs']
  depths = [[n] + [f'{x:.3f}' for x in records[n]['top1_by_depth']]
            + [f'{costs[n]:.3f}' if n in costs else 'not measured',
               f'{records[n]["seconds"] / 60:.1f}'] for n in names]
  depth = len(records[names[0]]['top1_by_depth'])
  data = {'backend': 'cpu', 'cells': cells, 'records': records,
          'proposing_costs': measured['proposing_costs'], 'config': c.to_dict(),
          **{f'{n}_tau_{key.replace("/", "_b")}': cell[n]['tau']
             for key, cell in cells.items() for n in names}}
  return Result(
      title='Sequential against context-attending drafter on W3 (same generations)',
      command=command_line('experiments.measure.drafter_kinds'), data=data,
      body=[f'tau at T = {c.temperature} (identical to vanilla / responses), spine '
            f'{tuple(c.drafter_branching)}:',
            Table(['nodes/row', 'responses'] + names, rows, align='rr' + 'l' * len(names)),
            'Held-out teacher-forced top-1 agreement by depth, proposing cost at one response '
            f'and {c.cost_nodes} nodes (plain steps), and the recipe (generation + training, '
            'minutes):',
            Table(['kind'] + [f'depth {d}' for d in range(1, depth + 1)]
                  + ['proposing', 'minutes'], depths, align='l' + 'r' * (depth + 2))])


def main(argv):
  del argv
  c = _CONFIG.value
  write(report(c, measure(c)), c.out_dir)


if __name__ == '__main__':
  app.run(main)
