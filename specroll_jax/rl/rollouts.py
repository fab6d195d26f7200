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
from specroll_jax.speculative.factory import (PricingWorkload, build_engine, tree_config,
                                              with_group_drafts)
from specroll_jax.speculative.step_cost import GatePrices


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


def _saved_prices(path: Path) -> GatePrices | None:
  if not path.exists():
    return None
  try:
    return GatePrices(tuple((int(b), float(cost)) for b, cost in json.loads(path.read_text())))
  except (ValueError, TypeError) as e:
    raise ValueError(f'{path}: not a list of [batch, cost] pairs ({e}); delete it to '
                     'measure the tree-step costs again') from e


def _agreed(prices: GatePrices) -> GatePrices:
  """Every process must run the same program: process 0's prices are everyone's."""
  return dataclasses.replace(prices,
                             tree_step_costs=distributed.agreed_costs(prices.tree_step_costs))


class Rollouts:
  """An engine and its driver, built once, every batch at the run's one prompt width.

  With `rollout.speculation_gate` the engine comes priced (the measured cost of a tree step
  per bucket): by the prices saved in `step_costs_path`, so a resumed run makes the same
  tree-or-plain choices as the uninterrupted one, else measured on the run's first batch
  and saved there.
  """

  def __init__(self, policy: Policy, config: RolloutSection, proposer, prompt_width: int, mesh,
               step_costs_path: Path | None = None, first_batch: tuple | None = None):
    """`first_batch`: (policy params, proposer state, prompt ids) of the run's first step,
    the workload a gated engine without saved prices is priced on."""
    self.group_size, self.proposer = config.group_size, proposer
    driver_config = dataclasses.replace(config.driver, prompt_bucket_min=prompt_width)
    gated = config.engine == 'specroll' and config.speculation_gate
    tree = prices = workload = None
    if config.engine == 'specroll':
      tree = distributed.agreed_tree_config(
          lambda: tree_config(policy, max_nodes=config.tree.max_nodes,
                              capacity_tokens=config.tree.capacity_tokens))
    if gated:
      prices = _saved_prices(step_costs_path)
      if prices is None:
        policy_params, proposer_state, prompts = first_batch
        workload = PricingWorkload(policy_params, proposer_state and proposer_state.params,
                                   driver_config, prompts, self.group_size)
    self.engine = build_engine(policy, config.engine, config.sampler, proposer=proposer,
                               tree=tree, mesh=mesh, tree_attention=config.tree_attention,
                               gate=config.gate if gated else None, prices=prices,
                               workload=workload, agree=_agreed)
    if workload is not None and distributed.is_primary():
      tmp = step_costs_path.with_name(step_costs_path.name + '.tmp')
      tmp.write_text(json.dumps(self.engine.tree_step_costs))
      tmp.replace(step_costs_path)
    self.driver = Driver(self.engine, driver_config)

  def generate(self, policy_params, proposer_state, prompts, seed, segments: list | None = None):
    """Responses to `prompts` x group_size; `proposer_state` is the learned proposer's
    ProposerState (None: none drafts). With `segments`, each on-device loop's driver
    `Segment` is appended to it (where the rollout's time went, bucket by bucket)."""
    params = self.engine.params(policy_params, proposer_state and proposer_state.params)
    return self.driver.generate(params, prompts, self.group_size, seed, segments=segments)
