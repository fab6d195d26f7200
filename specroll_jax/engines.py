"""Building a rollout engine by name, and summarising what a rollout did."""
import numpy as np

from specroll_jax.decode import VanillaEngine
from specroll_jax.heads import load_heads
from specroll_jax.policy import Policy
from specroll_jax.sampling import SamplerConfig
from specroll_jax.speculative import SpecEngine, SpecParams
from specroll_jax.tree import TreeConfig

ENGINES = ('vanilla', 'specroll')


def eos_ids(policy: Policy) -> tuple:
  return () if policy.config.eos_token_id is None else (policy.config.eos_token_id,)


def make_engine(policy: Policy, name: str, sampler: SamplerConfig, *, heads_dir=None,
                tree: TreeConfig | None = None, mesh=None, data_size: int = 1,
                tree_attention: str = 'xla'):
  """Returns (engine, params) for `name` in ENGINES; specroll needs heads_dir and a tree."""
  if name == 'vanilla':
    return VanillaEngine(policy.config, sampler, eos_ids(policy), mesh=mesh), policy.params
  if name != 'specroll':
    raise ValueError(f'unknown engine {name!r} (choose from {", ".join(ENGINES)})')
  if heads_dir is None or tree is None:
    raise ValueError('engine=specroll needs --heads (a directory from experiments.train_heads)')
  heads_config, heads = load_heads(heads_dir, policy.config)
  engine = SpecEngine(policy.config, heads_config, tree, sampler, eos_ids(policy),
                      data_size=data_size, mesh=mesh, tree_attention=tree_attention)
  return engine, SpecParams(policy.params, heads)


def summarize(responses) -> dict:
  """tau (tokens per policy forward a response took part in) and acceptance by depth."""
  tokens = sum(len(r.token_ids) for r in responses)
  steps = sum(r.steps for r in responses)
  summary = {'responses': len(responses), 'tokens': tokens, 'row_forwards': steps,
             'tau': tokens / max(steps, 1)}
  if responses and 'accepted_by_depth' in responses[0].stats:
    accepted = np.sum([r.stats['accepted_by_depth'] for r in responses], axis=0)
    reached = np.sum([r.stats['reached_by_depth'] for r in responses], axis=0)
    nodes = float(np.sum([r.stats['tree_nodes'] for r in responses]))
    summary.update(
        acceptance_by_depth=(accepted / np.maximum(reached, 1)).round(4).tolist(),
        accepted_by_depth=accepted.astype(int).tolist(),
        mean_tree_nodes=nodes / max(steps, 1))
  return summary
