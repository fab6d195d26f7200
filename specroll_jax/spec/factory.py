"""Building a rollout engine by name, and summarising what a rollout did."""
import numpy as np

from specroll_jax.spec.capacity import load_or_measure
from specroll_jax.rollout.vanilla import VanillaEngine
from specroll_jax.spec.heads import heads_metadata, load_heads
from specroll_jax.model.policy import Policy
from specroll_jax.rollout.sampling import SamplerConfig
from specroll_jax.spec.engine import SpecEngine, SpecParams
from specroll_jax.spec.tree import TreeConfig

ENGINES = ('vanilla', 'specroll')


def eos_ids(policy: Policy) -> tuple:
  return () if policy.config.eos_token_id is None else (policy.config.eos_token_id,)


def tree_config(policy: Policy, *, branching, max_nodes: int, capacity_tokens: int = 0,
                per_batch_capacity: bool = True) -> TreeConfig:
  """A fixed C_hw when capacity_tokens > 0, else the cached (or freshly measured) capacity
  profile of this model on this backend, per batch size unless per_batch_capacity=False."""
  if capacity_tokens > 0:
    return TreeConfig(branching=tuple(branching), max_nodes=max_nodes,
                      capacity_tokens=capacity_tokens)
  profile = load_or_measure(policy.config, policy.params)
  return TreeConfig(branching=tuple(branching), max_nodes=max_nodes,
                    capacity_tokens=profile.capacity_tokens,
                    capacity_by_batch=profile.capacity_by_batch() if per_batch_capacity else ())


def prior_acceptance(heads_dir) -> tuple | None:
  """Held-out (head, rank) hit rates from warm start: the trees' prior acceptance rates."""
  rates = heads_metadata(heads_dir).get('rank_hit_rate')
  return None if rates is None else tuple(tuple(float(x) for x in row) for row in rates)


def make_engine(policy: Policy, name: str, sampler: SamplerConfig, *, heads_dir=None,
                tree: TreeConfig | None = None, mesh=None,
                tree_attention: str = 'xla'):
  """Returns (engine, params) for `name` in ENGINES; specroll needs heads_dir and a tree."""
  if name == 'vanilla':
    return VanillaEngine(policy.config, sampler, eos_ids(policy), mesh=mesh), policy.params
  if name != 'specroll':
    raise ValueError(f'unknown engine {name!r} (choose from {", ".join(ENGINES)})')
  if heads_dir is None or tree is None:
    raise ValueError('engine=specroll needs --heads (a directory from experiments.train_heads)')
  heads_config, heads = load_heads(heads_dir, policy.config)
  engine = SpecEngine(policy.config, heads_config, tree, sampler, eos_ids(policy), mesh=mesh,
                      prior_accept=prior_acceptance(heads_dir), tree_attention=tree_attention)
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
  if responses and 'reflex_matured' in responses[0].stats:
    summary.update(_reflex_summary(responses))
  return summary


def _reflex_summary(responses) -> dict:
  """Per head: mean delayed alignment and error masses per matured feedback; mean gate,
  reliability and relative correction over the engine steps of every response."""
  total = lambda name: np.sum([r.stats[name] for r in responses], axis=0)
  matured = np.maximum(total('reflex_matured'), 1)
  steps = lambda name: np.concatenate([r.stats[name][:r.steps] for r in responses])
  out = {f'reflex_{name}': (total(f'reflex_{name}') / matured).round(4).tolist()
         for name in ('alignment', 'dist_error', 'coverage_error')}
  out.update({f'reflex_{name}': steps(f'reflex_{name}').mean(axis=0).round(4).tolist()
              for name in ('gate', 'reliability', 'correction')})
  return out
