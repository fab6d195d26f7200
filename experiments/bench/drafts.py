"""Draft quality at fixed node budgets: tau of each proposer, and what proposing costs.

  python -m experiments.bench.drafts --config=configs/drafts_w3.py

For each cell (nodes per row, responses in flight, sampler) every proposer's engine runs
the same held-out prompts and seed as vanilla with every step a tree of that many nodes
(no gate, no sizing), and its tau (tokens per row step) is recorded with whether its
responses are vanilla's. Proposers: the warm-started heads, the sequential drafter on its
spine ('drafter') or on a rank-path tree chosen from its own held-out ranks, a pool from
which each row keeps its best paths ('drafter_tree': c.drafter_tree_pools names the pool's
size per budget, c.drafter_trees the file of experiments.measure.drafter_trees), heads or
drafter under group drafts, and the oracle (vanilla's own future as a chain as deep as the
heads' trees: the ceiling at that depth). Proposing cost, in plain steps at one response: the
proposer's `propose` timed alone against the vanilla step; and each tree step's whole
price. Writes results.json and README.md to out_dir.
"""
import json
import sys
from pathlib import Path

import jax
from absl import app
from ml_collections import config_flags

from specroll_jax import load_policy
from specroll_jax.rl.sections import build
from specroll_jax.rollout.sampling import SamplerConfig
from specroll_jax.speculative.drafter import drafter_metadata
from specroll_jax.speculative.drafter_proposer import DrafterProposer, spine_paths
from specroll_jax.speculative.factory import head_proposer
from specroll_jax.speculative.group_proposer import GroupDraftConfig, GroupProposer
from specroll_jax.speculative.head_proposer import HeadDraftConfig
from specroll_jax.speculative.heads import heads_metadata
from specroll_jax.speculative.oracle_proposer import OracleProposer
from specroll_jax.speculative.step_cost import with_measured_step_costs
from experiments.lib.draft_cells import (cell_workload, fixed_budget_engine, proposing_costs,
                                         run_cell)
from experiments.lib.results import Result, Table, command_line, write
from experiments.lib.workloads import (benchmark_prompts, warm_started_drafter,
                                       warm_started_heads)

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/drafts_w3.py')
GROUPED = {'heads_group': 'heads', 'drafter_group': 'drafter'}
TAU_KEYS = ('heads', 'drafter', 'drafter_tree')  # proposers with top-level tau keys


def drafter_tree(c, nodes: int) -> tuple:
  """The rank paths of the pool drafted at `nodes` nodes per row: the best tree of
  c.drafter_tree_pools' size for that budget (experiments.measure.drafter_trees)."""
  pools = {int(budget): int(size) for budget, size in c.drafter_tree_pools}
  if nodes not in pools:
    raise ValueError(f'config drafter_tree_pools has no pool for {nodes} nodes')
  path = Path(c.drafter_trees)
  if not path.is_file():
    raise FileNotFoundError(f'{path}: not found (run experiments.measure.drafter_trees)')
  trees = json.loads(path.read_text())['trees']
  if str(pools[nodes]) not in trees:
    raise ValueError(f'{path}: no tree of {pools[nodes]} nodes (it has {", ".join(trees)})')
  return tuple(tuple(p) for p in trees[str(pools[nodes])])


def proposers(policy, c, sampler, heads_config, heads, drafter_config, drafter,
              nodes: int) -> dict:
  """name -> (proposer, its parameters) for trees of `nodes` nodes; the oracle's parameters
  come with each cell's reference."""
  head = head_proposer(policy, heads_config, c.heads_dir, sampler,
                       HeadDraftConfig(tuple(c.branching)))
  built = {'heads': (head, heads),
           'drafter': (DrafterProposer(policy.config, drafter_config,
                                       spine_paths(c.drafter_branching), sampler), drafter)}
  if 'drafter_tree' in c.proposers:
    built['drafter_tree'] = (DrafterProposer(policy.config, drafter_config,
                                             drafter_tree(c, nodes), sampler), drafter)
  group = build(GroupDraftConfig, c.group, 'group')
  for name, base in GROUPED.items():
    built[name] = (GroupProposer(group, base=built[base][0]), built[base][1])
  built['oracle'] = (OracleProposer(head.depth), None)
  return {name: built[name] for name in c.proposers}


def tree_step_prices(policy, c, built, prompts, sampler) -> dict:
  """A whole tree step's price (plain steps) at one response and c.cost_nodes nodes, for
  the proposers that fill that width (the oracle's chain stops at its depth + 1 nodes)."""
  prompts, samples, rollout = cell_workload(c, prompts[:1], 1)
  prices = {}
  for name, (proposer, proposer_params) in built.items():
    if name == 'oracle':
      continue
    engine = fixed_budget_engine(policy, proposer, sampler, c.cost_nodes, 1)
    priced = with_measured_step_costs(engine, rollout,
                                      engine.params(policy.params, proposer_params), prompts,
                                      samples)
    prices[name] = priced.tree_step_cost(1)
    jax.clear_caches()
  return prices


def main(argv):
  del argv
  c = _CONFIG.value
  write(report(c, measure(c)), c.out_dir)


def measure(c) -> dict:
  """Proposing costs and tree-step prices at one response, then every cell's tau."""
  policy = load_policy(c.checkpoint, c.dtype)
  heads_config, heads = warm_started_heads(policy, c)
  drafter_config, drafter = warm_started_drafter(policy, c)
  prompts = benchmark_prompts(policy, c)
  samplers = {'t1': SamplerConfig(temperature=c.temperature),
              'greedy': SamplerConfig(temperature=0.0)}
  # Prices first: they are timings, and the cells after them only count tokens and steps.
  built = proposers(policy, c, samplers['t1'], heads_config, heads, drafter_config, drafter,
                    c.cost_nodes)
  costs = proposing_costs(policy, c, built, prompts, samplers['t1'])
  prices = tree_step_prices(policy, c, built, prompts, samplers['t1'])
  print(f'at one response, {c.cost_nodes} nodes: proposing costs {costs}, tree-step prices '
        f'{prices} (plain steps)', file=sys.stderr)
  cells = {}
  for key, sampler in samplers.items():
    for nodes in c.budgets:
      built = proposers(policy, c, sampler, heads_config, heads, drafter_config, drafter, nodes)
      for responses in c.responses:
        if key == 'greedy' and (nodes, responses) not in {tuple(x) for x in c.greedy_cells}:
          continue
        cells[f'{key}/{nodes}/{responses}'] = run_cell(policy, c, built, prompts, nodes,
                                                       responses, sampler)
  return {'costs': costs, 'prices': prices, 'cells': cells}


def summary(c, measured) -> dict:
  cells = measured['cells']
  heads_record = heads_metadata(c.heads_dir)
  drafter_record = drafter_metadata(c.drafter_dir)
  tau = lambda name, nodes, responses: cells[f't1/{nodes}/{responses}'][name]['tau']
  return {
      'backend': jax.default_backend(),
      **{f'{name}_tau_16': tau(name, 16, 1) for name in TAU_KEYS if name in c.proposers},
      **{f'{name}_tau_4_b16': tau(name, 4, 16) for name in TAU_KEYS if name in c.proposers},
      # Held-out agreement with the policy's T = 1 draw: head 1's top-1 and the drafter's
      # depth-1 top-1 (teacher-forced, on its training run's held-out generations).
      'head1_top1': float(heads_record.rank_hit_rate[0][0]),
      'drafter_depth1_top1': drafter_record.top1_by_depth[0],
      'drafter_top1_by_depth': list(drafter_record.top1_by_depth),
      'drafter_top1_mass_by_depth': list(drafter_record.mass_by_depth),
      # The heads' recipe (configs/bench_w3.py heads), and the drafter's.
      'warm_start_s': heads_record.seconds,
      'drafter_warm_start_s': drafter_record.seconds,
      'drafter_cost': measured['costs'].get('drafter'),
      'proposing_costs': measured['costs'],
      'tree_step_prices': measured['prices'],
      'identical_fraction': (sum(r['identical'] for cell in cells.values() for r in cell.values())
                             / sum(r['responses'] for cell in cells.values()
                                   for r in cell.values())),
      'cells': cells,
      'config': c.to_dict(),
  }


def report(c, measured) -> Result:
  data = summary(c, measured)
  names = list(c.proposers)
  rows = [key.split('/') + [f'{cell[n]["tau"]:.2f}' for n in names]
          for key, cell in measured['cells'].items()]
  in_steps = lambda values: ', '.join(f'{n} {v:.2f}' for n, v in values.items())
  return Result(
      title='Draft quality on W3 at fixed budgets (tau)',
      command=command_line('experiments.bench.drafts'), data=data,
      body=[Table(['sampler', 'nodes/row', 'responses'] + names, rows,
                  align='l' * (3 + len(names))),
            f'At one response and {c.cost_nodes} nodes, in plain steps: proposing '
            f"{in_steps(measured['costs'])}; whole tree step {in_steps(measured['prices'])}. "
            f"Held-out top-1: head 1 {data['head1_top1']:.3f}, drafter depth 1 "
            f"{data['drafter_depth1_top1']:.3f}. Warm starts: heads "
            f"{data['warm_start_s'] / 60:.1f} min, drafter "
            f"{data['drafter_warm_start_s'] / 60:.1f} min. Identical responses: "
            f"{data['identical_fraction']:.3f}."])


if __name__ == '__main__':
  app.run(main)
