"""Drafters reading several layers' features against those reading h_t alone, trained on the
same generations (each kind of c.feature_kinds: the sequential drafter, the context-attending
one).

  python -m experiments.measure.drafter_features --config=configs/drafter_kinds_w3.py

EAGLE-3 fuses low, mid and high layers' hidden states into its drafter's input; our drafters
read only the final state h_t (issue 46: "fused policy features, chosen by measurement").
Each variant of c.feature_layer_sets fuses h_t with those decoder layers' outputs at z_0
(speculative/drafter.py, FeatureFusion; the context drafter fuses them the same way for its
root and entries) and is trained with experiments.measure.
drafter_kinds' recipe on the same pairs, draft vocabulary and seed (its h_t part bit for bit
theirs), so the only difference is the input. Measured: held-out teacher-forced top-1
agreement with the drawn token, and the policy's mass on the top-1 draft, per depth; then,
through the rollout engine (which captures the layers in its prefill, tree and plain
forwards), each variant's proposing cost and whole tree and plain steps at one response (in
vanilla steps: the capture is priced in both), and tau at c.kind_cells on held-out GSM8K test
questions with the spine c.drafter_branching, every response checked against vanilla's, as
experiments.measure.drafter_kinds measures them.
"""
import dataclasses
from pathlib import Path

from absl import app
from ml_collections import config_flags

from experiments.lib.draft_cells import proposing_costs, run_cell, step_costs
from experiments.lib.drafter_recipes import PROPOSERS, SharedPairs, kinds, trained
from experiments.lib.results import Result, Table, command_line, write
from experiments.lib.workloads import benchmark_prompts
from specroll_jax import load_policy
from specroll_jax.rollout.sampling import SamplerConfig
from specroll_jax.speculative.drafter import drafter_metadata
from specroll_jax.speculative.drafter_proposer import spine_paths

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/drafter_kinds_w3.py')


def variant_name(kind: str, layers: tuple) -> str:
  return kind + ''.join(f'_l{i}' for i in layers)


def measure(c) -> dict:
  policy = load_policy(c.checkpoint, c.dtype)
  sampler = SamplerConfig(temperature=c.temperature)
  records, built = {}, {}
  # One set of pairs per layer set, shared by the kinds: widening them is a forward per row.
  pairs = {layers: SharedPairs(policy, c, layers)
           for layers in ((),) + tuple(tuple(s) for s in c.feature_layer_sets)}
  shapes = kinds(c)
  for kind in c.feature_kinds:
    for layers, shared in pairs.items():
      name = variant_name(kind, layers)
      config = dataclasses.replace(shapes[kind], feature_layers=layers)
      config, params = trained(policy, c, shared, name, config)
      records[name] = dict(layers=layers, **dataclasses.asdict(
          drafter_metadata(Path(c.kinds_dir) / name, type(config))))
      built[name] = (PROPOSERS[kind](policy.config, config, spine_paths(c.drafter_branching),
                                     sampler), params)
  prompts = benchmark_prompts(policy, c)
  costs = proposing_costs(policy, c, built, prompts, sampler) if c.kinds_costs else {}
  steps = step_costs(policy, c, built, prompts, sampler) if c.kinds_costs else {}
  cells = {f'{nodes}/{responses}': run_cell(policy, c, built, prompts, nodes, responses,
                                            sampler)
           for nodes, responses in c.kind_cells}
  return {'records': records, 'proposing_costs': costs, 'step_costs': steps, 'cells': cells}


def report(c, measured) -> Result:
  records, costs, cells = measured['records'], measured['proposing_costs'], measured['cells']
  steps = measured['step_costs']
  depth = len(next(iter(records.values()))['top1_by_depth'])
  rows = [[name, ', '.join(map(str, r['layers'])) or 'final only']
          + [f'{top1:.3f} ({mass:.3f})' for top1, mass in zip(r['top1_by_depth'],
                                                            r['mass_by_depth'])]
          + [f'{r["final_loss"]:.3f}', f'{r["seconds"] / 60:.1f}']
          for name, r in records.items()]
  taus = [[key.split('/')[0], key.split('/')[1]]
          + [f'{cell[n]["tau"]:.3f} ({cell[n]["identical"]}/{cell[n]["responses"]})'
             for n in records] for key, cell in cells.items()]
  priced = lambda table, n, part=None: (f'{table[n] if part is None else table[n][part]:.3f}'
                                        if n in table else 'not measured')
  taus += [['proposing', '1'] + [priced(costs, n) for n in records],
           ['tree step', '1'] + [priced(steps, n, 'tree') for n in records],
           ['plain step', '1'] + [priced(steps, n, 'plain') for n in records]]
  data = {'backend': 'cpu', 'records': records, 'cells': cells, 'proposing_costs': costs,
          'step_costs': steps,
          'config': c.to_dict(),
          **{f'{name}_top1_by_depth': r['top1_by_depth'] for name, r in records.items()},
          **{f'{n}_tau_{key.replace("/", "_b")}': cell[n]['tau']
             for key, cell in cells.items() for n in records}}
  return Result(
      title='Drafters with layer features on W3 (same generations)',
      command=command_line('experiments.measure.drafter_features'), data=data,
      body=['Held-out teacher-forced top-1 agreement with the drawn token (the policy\'s mass '
            f'on the top-1 draft) per depth; {c.kinds_pairs.num_sequences} training answers, '
            f'{c.kinds_training.steps} steps of {c.kinds_training.batch_size}; final training '
            'loss; recipe minutes (generation, features and training):',
            Table(['drafter', 'decoder layers fused with h_t']
                  + [f'depth {d}' for d in range(1, depth + 1)] + ['loss', 'minutes'], rows,
                  align='ll' + 'r' * (depth + 2)),
            f'Through the engine, the spine {tuple(c.drafter_branching)}: tau at T = '
            f'{c.temperature} (identical to vanilla / responses); last rows: at one response and '
            f'{c.cost_nodes} nodes, proposing, the whole tree step and the engine\'s plain '
            'step (which captures the layers too), in vanilla steps:',
            Table(['nodes/row', 'responses'] + list(records), taus,
                  align='rr' + 'l' * len(records))])


def main(argv):
  del argv
  c = _CONFIG.value
  write(report(c, measure(c)), c.features_out_dir)


if __name__ == '__main__':
  app.run(main)
