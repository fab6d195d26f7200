"""The rollout side of a GRPO run: an engine and its driver, fed the learner's current params.

The learner and the rollouts meet only in `Rollouts.generate(policy_params, heads, prompts,
seed)`, so the engine is a config switch and speculation changes nothing in GRPO.
`Rollouts` receives the run's `RolloutSection` (rl/run_config.py: sampler, driver, tree,
head_drafts, group and gate, each its component's dataclass) and the proposer
`make_proposer` builds from the rollout, adaptation and drafter sections.
"""
import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np

from specroll_jax.model.policy import Policy
from specroll_jax.rl import distributed
from specroll_jax.rl.adaptation import WarmStarted
from specroll_jax.rl.learned_proposers import KINDS, learned_kind_name, parse_proposers
from specroll_jax.rl.run_config import RolloutSection, RunConfig
from specroll_jax.rollout.driver import Driver
from specroll_jax.speculative.factory import make_engine, tree_config, with_group_drafts
from specroll_jax.speculative.step_cost import with_measured_step_costs


def make_proposer(policy: Policy, config: RunConfig, warm: WarmStarted | None):
  """The rollouts' proposer: the learned kind's (warm-started as `warm`) merged with group
  drafts as rollout.proposers says; None for vanilla."""
  r = config.rollout
  if r.engine != 'specroll':
    return None
  names = parse_proposers(r.proposers)
  learned = learned_kind_name(names)
  proposer = None if learned is None else KINDS[learned].proposer(policy, config, warm)
  return with_group_drafts(proposer, names, r.group)


def step_seed(config: RunConfig, step: int) -> int:
  """The rollout (and consolidation) seed of GRPO step `step` (0-based): a resumed run draws
  exactly what the uninterrupted one would have."""
  return config.seed * 1_000_003 + step


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

  def __init__(self, policy: Policy, config: RolloutSection, proposer, prompt_width: int, mesh,
               step_costs_path: Path | None = None):
    self.group_size = config.group_size
    gated = config.engine == 'specroll' and config.speculation_gate
    self.step_costs_path = step_costs_path if gated else None
    # Priced once, even when no bucket has trees (the prices are then empty).
    self.unpriced = self.step_costs_path is not None
    self.proposer = proposer
    tree = None
    if config.engine == 'specroll':
      tree = distributed.agreed_tree_config(
          lambda: tree_config(policy, max_nodes=config.tree.max_nodes,
                              capacity_tokens=config.tree.capacity_tokens))
    self.engine = make_engine(policy, config.engine, config.sampler, proposer=proposer,
                              tree=tree, mesh=mesh, tree_attention=config.tree_attention)
    if self.step_costs_path is not None:
      self.engine = dataclasses.replace(self.engine, gate_config=config.gate)
    self.driver = Driver(self.engine, dataclasses.replace(config.driver,
                                                          prompt_bucket_min=prompt_width))

  def generate(self, policy_params, proposer_state, prompts, seed):
    """Responses to `prompts` x group_size; `proposer_state` is the learned proposer's
    ProposerState (None: none drafts)."""
    params = self.engine.params(policy_params, proposer_state and proposer_state.params)
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
