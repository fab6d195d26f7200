"""The rollout side of a GRPO run: an engine and its driver, fed the learner's current params.

The learner and the rollouts meet only in `Rollouts.generate(policy_params, heads, prompts,
seed)`, so the engine is a config switch and speculation changes nothing in GRPO.
The `rollout` config section has one subsection per dataclass it builds: sampler
(SamplerConfig), driver (RolloutConfig), tree (TreeConfig), head_drafts (HeadDraftConfig),
group (GroupDraftConfig), gate (GateConfig). The drafter's spine is c.drafter.branching
(rl/drafter_adaptation.py).
"""
import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np

from specroll_jax.adapt.reflex import ReflexConfig
from specroll_jax.adapt.reflex_proposer import ReflexProposer
from specroll_jax.model.policy import Policy
from specroll_jax.rl import distributed
from specroll_jax.rl.drafter_adaptation import drafter_branching
from specroll_jax.rl.sections import build
from specroll_jax.rollout.driver import Driver, RolloutConfig
from specroll_jax.rollout.sampling import SamplerConfig
from specroll_jax.speculative.drafter import DrafterConfig
from specroll_jax.speculative.drafter_proposer import DrafterProposer, spine_paths
from specroll_jax.speculative.factory import (head_proposer, make_engine, parse_proposers,
                                              tree_config, with_group_drafts)
from specroll_jax.speculative.gate import GateConfig
from specroll_jax.speculative.group_proposer import GroupDraftConfig
from specroll_jax.speculative.head_proposer import HeadDraftConfig
from specroll_jax.speculative.heads import HeadsConfig
from specroll_jax.speculative.step_cost import with_measured_step_costs
from specroll_jax.speculative.tree import TreeConfig

# Fields the trainer derives: every batch is padded to the run's one prompt width, and a
# tree's per-batch capacity comes from the profile (rollout.tree.capacity_tokens = 0).
DRIVER_DERIVED = ('prompt_bucket_min', 'prompt_buckets_per_octave')
TREE_DERIVED = ('capacity_by_batch', 'sized_widths', 'one_projection')


def sampler_config(c) -> SamplerConfig:
  return build(SamplerConfig, c.rollout.sampler, 'rollout.sampler')


def driver_config(c, prompt_width: int) -> RolloutConfig:
  return build(RolloutConfig, c.rollout.driver, 'rollout.driver', prompt_bucket_min=prompt_width)


def head_draft_config(c) -> HeadDraftConfig:
  config = build(HeadDraftConfig, c.rollout.head_drafts, 'rollout.head_drafts')
  # A static argument of the compiled proposer: hashable, whatever sequence the config held.
  return dataclasses.replace(config, branching=tuple(config.branching))


def check_tree_section(c) -> None:
  """rollout.tree builds a TreeConfig; its capacity_tokens 0 means the profiled capacity."""
  values = c.rollout.tree.to_dict()
  build(TreeConfig, {**values, 'capacity_tokens': values.get('capacity_tokens') or 1},
        'rollout.tree')


def step_seed(c, step: int) -> int:
  """The rollout (and consolidation) seed of GRPO step `step` (0-based): a resumed run draws
  exactly what the uninterrupted one would have."""
  return c.seed * 1_000_003 + step


def run_prompt_width(prompts: list[list[int]]) -> int:
  """The one prompt width of a GRPO run: its longest prompt, rounded up to a multiple of 16.

  Rollouts and the learner use it for every batch. Each new width compiles the decode
  loops again: with power-of-two widths per batch, the two W1 GRPO steps that met a new
  width generated at 0.23x and 0.06x of vanilla's speed (the gated loop compiles both kinds
  of step). W1's prompts (65-154 tokens) get 160 slots, where batches of 8 prompts got 128
  (70% of them) or 256.
  """
  return -(-max(len(p) for p in prompts) // 16) * 16


def rollout_digest(responses) -> str:
  """A short hash of every emitted token: equal digests mean identical rollouts."""
  h = hashlib.sha256()
  for r in responses:
    h.update(np.asarray(r.token_ids, np.int32).tobytes() + b'|')
  return h.hexdigest()[:16]


class Rollouts:
  """An engine and its driver, every batch at the run's one prompt width.

  With `rollout.speculation_gate`, the gate is priced on the first batch (the measured cost
  of a tree step per bucket) and the prices are saved in `step_costs_path`, so a resumed
  run makes the same tree-or-plain choices as the uninterrupted one.
  """

  def __init__(self, policy: Policy, c, heads_config: HeadsConfig | None, heads_dir: Path | None,
               prompt_width: int, mesh, step_costs_path: Path | None = None,
               drafter: DrafterConfig | None = None):
    r = c.rollout
    self.group_size = r.group_size
    gated = r.engine == 'specroll' and r.speculation_gate
    self.step_costs_path = step_costs_path if gated else None
    # Priced once, even when no bucket has trees (the prices are then empty).
    self.unpriced = self.step_costs_path is not None
    self.proposer = tree = None
    if r.engine == 'specroll':
      names = parse_proposers(r.proposers)
      if 'heads' in names:
        self.proposer = head_proposer(policy, heads_config, heads_dir, sampler_config(c),
                                      head_draft_config(c))
        if c.adaptation.mode in ('reflex', 'both'):
          self.proposer = ReflexProposer(
              self.proposer, build(ReflexConfig, c.adaptation.reflex, 'adaptation.reflex'))
      elif 'drafter' in names:
        self.proposer = DrafterProposer(policy.config, drafter,
                                        spine_paths(drafter_branching(c)), sampler_config(c))
      self.proposer = with_group_drafts(self.proposer, names,
                                        build(GroupDraftConfig, r.group, 'rollout.group'))
      tree = distributed.agreed_tree_config(
          lambda: tree_config(policy, max_nodes=r.tree.max_nodes,
                              capacity_tokens=r.tree.capacity_tokens))
    self.engine = make_engine(policy, r.engine, sampler_config(c), proposer=self.proposer,
                              tree=tree, mesh=mesh, tree_attention=r.tree_attention)
    if self.step_costs_path is not None:
      self.engine = dataclasses.replace(self.engine, gate_config=build(GateConfig, r.gate,
                                                                       'rollout.gate'))
    self.driver = Driver(self.engine, driver_config(c, prompt_width))

  def generate(self, policy_params, heads, prompts, seed):
    """Responses to `prompts` x group_size; `heads` is the learned proposer's HeadsState
    (None: none drafts)."""
    params = self.engine.params(policy_params, heads and heads.params)
    if self.unpriced:
      self._price_gate(params, prompts)
      self.unpriced = False
    return self.driver.generate(params, prompts, self.group_size, seed)

  def _price_gate(self, params, prompts):
    path = self.step_costs_path
    if path.exists():
      try:
        costs = tuple((int(b), float(cost)) for b, cost in json.loads(path.read_text()))
      except (ValueError, TypeError) as e:
        raise ValueError(f'{path}: not a list of [batch, cost] pairs ({e}); delete it to '
                         'measure the tree-step costs again') from e
      self.engine = dataclasses.replace(self.engine, tree_step_costs=costs)
    else:
      # Every process must run the same program: process 0's prices are everyone's.
      measured = with_measured_step_costs(self.engine, self.driver.config, params, prompts,
                                          self.group_size).tree_step_costs
      self.engine = dataclasses.replace(self.engine,
                                        tree_step_costs=distributed.agreed_costs(measured))
      if distributed.is_primary():
        tmp = path.with_name(path.name + '.tmp')
        tmp.write_text(json.dumps(self.engine.tree_step_costs))
        tmp.replace(path)
    self.driver = Driver(self.engine, self.driver.config)
