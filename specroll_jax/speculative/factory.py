"""Building a rollout engine by name, priced, for the trainer, CLIs, benchmarks and tunix.

The factory builds the speculative engine, so it lives at the top of speculative/ (in rollout/ it
would import upward).
"""
import dataclasses
from typing import Any, Callable

from specroll_jax.model.policy import Policy
from specroll_jax.rollout.driver import RolloutConfig
from specroll_jax.rollout.sampling import SamplerConfig
from specroll_jax.rollout.vanilla import VanillaEngine
from specroll_jax.speculative.capacity import load_or_measure
from specroll_jax.speculative.engine import SpecEngine
from specroll_jax.speculative.gate import GateConfig
from specroll_jax.speculative.group_proposer import GroupDraftConfig, GroupProposer
from specroll_jax.speculative.head_proposer import HeadDraftConfig, HeadProposer
from specroll_jax.speculative.heads import HeadsConfig, heads_metadata
from specroll_jax.speculative.step_cost import GatePrices, with_measured_step_costs
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


@dataclasses.dataclass(frozen=True)
class PricingWorkload:
  """The workload a gated engine is priced (and its trees sized) on: the first state a
  Driver(engine, rollout) runs for `prompts` x `num_samples`, under the policy's and the
  proposer's parameters."""
  policy_params: Any
  proposer_params: Any
  rollout: RolloutConfig
  prompts: list
  num_samples: int
  size_widths: bool = False  # also choose each bucket's tree width (step_cost.size_trees)


def build_engine(policy: Policy, name: str, sampler: SamplerConfig, *, proposer=None,
                 tree: TreeConfig | None = None, mesh=None, tree_attention: str = 'xla',
                 gate: GateConfig | None = None, prices: GatePrices | None = None,
                 workload: PricingWorkload | None = None,
                 agree: Callable[[GatePrices], GatePrices] = lambda prices: prices,
                 eos_ids: tuple | None = None):
  """The rollout engine `name` in ENGINES, the one place engines are built. SpecRoll needs a
  proposer and a tree configuration; with a `gate` it comes priced: by `prices` (saved by
  an earlier run), else measured on `workload` and passed through `agree` (a multi-process
  run agrees on one process's prices). Without a gate every step of width > 1 is a tree.
  `eos_ids` replaces the policy's end-of-sequence ids (() runs every row to the cap, as the
  measurements that compare fixed lengths do)."""
  eos_ids = policy.eos_ids if eos_ids is None else tuple(eos_ids)
  if name == 'vanilla':
    return VanillaEngine(policy.config, sampler, eos_ids, mesh=mesh)
  if name != 'specroll':
    raise ValueError(f'unknown engine {name!r} (choose from {", ".join(ENGINES)})')
  if proposer is None or tree is None:
    raise ValueError('engine=specroll needs a proposer (heads from experiments.train_heads) '
                     'and a tree configuration')
  engine = SpecEngine(policy.config, proposer, tree, sampler, eos_ids, mesh=mesh,
                      tree_attention=tree_attention)
  if gate is None:
    return engine
  engine = dataclasses.replace(engine, gate_config=gate)
  if prices is None:
    if workload is None:
      raise ValueError('a gated SpecRoll engine needs saved prices or a workload to price on')
    measured = with_measured_step_costs(
        engine, workload.rollout, engine.params(workload.policy_params, workload.proposer_params),
        workload.prompts, workload.num_samples, size_widths=workload.size_widths)
    prices = agree(GatePrices.of(measured))
  return prices.applied_to(engine)
