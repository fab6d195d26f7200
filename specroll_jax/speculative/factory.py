"""Building a rollout engine by name for CLIs, benchmarks and the trainer.

The factory builds the speculative engine, so it lives at the top of speculative/ (in rollout/ it
would import upward).
"""
from specroll_jax.model.policy import Policy
from specroll_jax.rollout.sampling import SamplerConfig
from specroll_jax.rollout.vanilla import VanillaEngine
from specroll_jax.speculative.capacity import load_or_measure
from specroll_jax.speculative.engine import SpecEngine
from specroll_jax.speculative.group_proposer import GroupDraftConfig, GroupProposer
from specroll_jax.speculative.head_proposer import HeadDraftConfig, HeadProposer
from specroll_jax.speculative.heads import HeadsConfig, heads_metadata
from specroll_jax.speculative.tree import TreeConfig

ENGINES = ('vanilla', 'specroll')


def with_group_drafts(learned, names: tuple, group: GroupDraftConfig):
  """The proposer for the parsed rollout.proposers `names` (rl/learned_proposers.py): the
  learned one, group drafts merged with it, or group drafts alone."""
  if 'group' not in names:
    return learned
  return GroupProposer(group, base=learned)


def tree_config(policy: Policy, *, max_nodes: int, capacity_tokens: int = 0,
                per_batch_capacity: bool = True) -> TreeConfig:
  """A fixed C_hw when capacity_tokens > 0, else the cached (or freshly measured) capacity
  profile of this model on this backend, per batch size unless per_batch_capacity=False."""
  if capacity_tokens > 0:
    return TreeConfig(max_nodes=max_nodes, capacity_tokens=capacity_tokens)
  profile = load_or_measure(policy.config, policy.params)
  return TreeConfig(max_nodes=max_nodes, capacity_tokens=profile.capacity_tokens,
                    capacity_by_batch=profile.capacity_by_batch() if per_batch_capacity else ())


def prior_acceptance(heads_dir) -> tuple | None:
  """Held-out (head, rank) hit rates from warm start: the trees' prior acceptance rates."""
  metadata = heads_metadata(heads_dir)
  return None if metadata is None else metadata.rank_hit_rate


def head_proposer(policy: Policy, heads_config: HeadsConfig, heads_dir, sampler: SamplerConfig,
                  draft: HeadDraftConfig) -> HeadProposer:
  """Static horizon heads, scored with the warm start's hit rates as their prior."""
  return HeadProposer(policy.config, heads_config, draft, sampler,
                      prior_accept=prior_acceptance(heads_dir))


def make_engine(policy: Policy, name: str, sampler: SamplerConfig, *, proposer=None,
                tree: TreeConfig | None = None, mesh=None, tree_attention: str = 'xla'):
  """The engine `name` in ENGINES; specroll needs a proposer and a tree configuration."""
  if name == 'vanilla':
    return VanillaEngine(policy.config, sampler, policy.eos_ids, mesh=mesh)
  if name != 'specroll':
    raise ValueError(f'unknown engine {name!r} (choose from {", ".join(ENGINES)})')
  if proposer is None or tree is None:
    raise ValueError('engine=specroll needs a proposer (heads from experiments.train_heads) '
                     'and a tree configuration')
  return SpecEngine(policy.config, proposer, tree, sampler, policy.eos_ids, mesh=mesh,
                    tree_attention=tree_attention)
