"""The sequential against the context-attending drafter, trained on the same generations.

  python -m experiments.measure.drafter_kinds --config=configs/drafter_kinds_w3.py

One set of distillation pairs (the policy's own T = 1 answers, c.kinds_pairs) trains both
kinds with the same steps, batches, learning rate (c.kinds_training), draft vocabulary and
seed, so the only difference is the context: the sequential drafter reads h_t and the token before,
the context drafter also attends over its cached entries of the response so far. Measured:
held-out teacher-forced top-1 agreement per depth and the policy's mass on it, the recipe's
wall time, proposing cost at one response (plain steps, as experiments.bench.drafts prices
it), and tau at c.kind_cells on held-out GSM8K test questions, every response checked
against vanilla's, with both kinds drafting each tree of c.kind_trees: the spine
(c.drafter_branching) and trees grown best-first per row from it. The pairs and the
trained drafters are kept in c.kinds_dir and reused (a killed run loses no generation).
"""
import dataclasses
from pathlib import Path

from absl import app
from ml_collections import config_flags

from experiments.lib.draft_cells import proposing_costs, run_cell
from experiments.lib.drafter_recipes import PROPOSERS, SharedPairs, kinds, trained
from experiments.lib.results import Result, Table, command_line, write
from experiments.lib.workloads import benchmark_prompts
from specroll_jax import load_policy
from specroll_jax.rollout.sampling import SamplerConfig
from specroll_jax.speculative.drafter import drafter_metadata
from specroll_jax.speculative.drafter_proposer import spine_paths

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/drafter_kinds_w3.py')

def measure(c) -> dict:
  policy = load_policy(c.checkpoint, c.dtype)
  sampler = SamplerConfig(temperature=c.temperature)
  pairs = SharedPairs(policy, c)
  built, records = {}, {}
  for name, config in kinds(c).items():
    config, params = trained(policy, c, pairs, name, config)
    for tree, expanded in c.kind_trees.items():
      built[name if tree == 'spine' else f'{name}_{tree}'] = (PROPOSERS[name](
          policy.config, config, spine_paths(c.drafter_branching), sampler,
          expanded=tuple(expanded)), params)
    records[name] = dataclasses.asdict(drafter_metadata(Path(c.kinds_dir) / name,
                                                        type(config)))
  prompts = benchmark_prompts(policy, c)
  costs = proposing_costs(policy, c, built, prompts, sampler) if c.kinds_costs else {}
  cells = {f'{nodes}/{responses}': run_cell(policy, c, built, prompts, nodes, responses,
                                            sampler)
           for nodes, responses in c.kind_cells}
  return {'records': records, 'proposers': list(built), 'proposing_costs': costs,
          'cells': cells}


def report(c, measured) -> Result:
  cells, records, costs = measured['cells'], measured['records'], measured['proposing_costs']
  names = measured['proposers']
  rows = [[key.split('/')[0], key.split('/')[1]]
          + [f'{cell[n]["tau"]:.3f} ({cell[n]["identical"]}/{cell[n]["responses"]})'
             for n in names] for key, cell in cells.items()]
  rows.append(['proposing', '1'] + [f'{costs[n]:.3f}' if n in costs else 'not measured'
                                    for n in names])
  depths = [[kind] + [f'{x:.3f}' for x in record['top1_by_depth']]
            + [f'{record["seconds"] / 60:.1f}'] for kind, record in records.items()]
  depth = len(next(iter(records.values()))['top1_by_depth'])
  data = {'backend': 'cpu', 'proposers': names, 'cells': cells, 'records': records,
          'proposing_costs': costs,
          'config': c.to_dict(),
          **{f'{n}_tau_{key.replace("/", "_b")}': cell[n]['tau']
             for key, cell in cells.items() for n in names}}
  trees = ', '.join(f'{name} expands {tuple(e) or "the best guess"} per depth'
                    for name, e in c.kind_trees.items())
  return Result(
      title='Sequential against context-attending drafter on W3 (same generations)',
      command=command_line('experiments.measure.drafter_kinds'), data=data,
      body=[f'tau at T = {c.temperature} (identical to vanilla / responses), trees grown from '
            f'the spine {tuple(c.drafter_branching)} ({trees}); last row: proposing cost at '
            f'one response and {c.cost_nodes} nodes (plain steps):',
            Table(['nodes/row', 'responses'] + names, rows, align='rr' + 'l' * len(names)),
            'Held-out teacher-forced top-1 agreement by depth and the recipe (generation + '
            'training, minutes):',
            Table(['kind'] + [f'depth {d}' for d in range(1, depth + 1)] + ['minutes'], depths,
                  align='l' + 'r' * (depth + 1))])


def main(argv):
  del argv
  c = _CONFIG.value
  write(report(c, measure(c)), c.out_dir)


if __name__ == '__main__':
  app.run(main)
