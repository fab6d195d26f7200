"""Slow path for the sequential drafter: its block trained on the GRPO step's harvest.

The heads' consolidation (adapt/consolidation.py) trains each triggered head alone; the
drafter is one block shared by every depth, so any triggered depth trains all of it. The
loss is the warm start's (adapt/drafter_training.py: soft cross-entropy towards the policy's
top-K law, depth d weighted decay^(d-1)) plus the same proximal term towards the weights the
update started from, over the same harvested pairs, held-out split and optimizer
(ConsolidationConfig; its ce_weight has no counterpart: the drafter's loss is the soft
cross-entropy alone). Only the block's weights move; the draft vocabulary stays the warm
start's, so the compiled proposer keeps its shapes.

With rollback the update is kept only if the held-out loss falls. Over fixed targets the
soft cross-entropy and KL(p || q) differ by p's entropy, so a fall in one is a fall in the
other.
"""
import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specroll_jax.adapt.consolidation import (ConsolidationConfig, make_optimizer,
                                              scanned_steps, split_rows)
from specroll_jax.adapt.drafter_training import DrafterTraining, depth_losses, drafter_loss
from specroll_jax.model.mesh import to_host
from specroll_jax.speculative.drafter import DrafterConfig, DrafterParams
from specroll_jax.speculative.pairs import DistillPairs


def _proximal(weights, anchor):
  """Mean squared distance per parameter tensor, summed over the block's tensors."""
  return sum(jax.tree.leaves(jax.tree.map(lambda w, a: jnp.mean(jnp.square(w - a)),
                                          weights, anchor)))


@partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _train(config: DrafterConfig, model_config, training: DrafterTraining,
           consolidation: ConsolidationConfig, weights, opt_state, vocab_ids, policy_params,
           batch: DistillPairs, order):
  """`order` [steps, batch_size] row indices. Returns (weights, optimizer state, last loss)."""
  loss = lambda w, minibatch: (
      drafter_loss(config, model_config, training, w, vocab_ids, policy_params, minibatch)
      + consolidation.prox_weight * _proximal(w, weights))
  return scanned_steps(make_optimizer(consolidation), loss, weights, opt_state, batch, order)


@partial(jax.jit, static_argnums=(0, 1))
def held_out_losses(config: DrafterConfig, model_config, params: DrafterParams, policy_params,
                    batch: DistillPairs):
  """Mean soft cross-entropy per depth [depth] on held-out pairs."""
  loss, count = depth_losses(config, model_config, params, policy_params, batch)
  return loss / jnp.maximum(count, 1)


def init_optimizer_state(consolidation: ConsolidationConfig, params: DrafterParams):
  """The block's Adam state before its first update (zero moments)."""
  return make_optimizer(consolidation).init(params.weights)


@dataclasses.dataclass(frozen=True)
class DrafterConsolidation:
  params: DrafterParams
  opt_state: Any                 # the block's optimizer state after the update (or before it)
  kept: bool                     # finite and, with rollback, the held-out loss fell
  loss_before: np.ndarray | None  # [depth] held-out soft cross-entropy (None: no rollback)
  loss_after: np.ndarray | None   # [depth] of the trained (pre-rollback) block
  loss: float


def consolidate(config: DrafterConfig, model_config, training: DrafterTraining,
                consolidation: ConsolidationConfig, params: DrafterParams, opt_state,
                policy_params, pairs: DistillPairs, seed: int, groups=None) -> DrafterConsolidation:
  """Trains the drafter's block on `pairs` (the pre-update policy's harvest, so
  `policy_params` must be that policy's); `groups` [rows] are the rows' prompts (see
  consolidation.split_rows). A rejected update also keeps the old Adam moments, so it does
  not echo through momentum into the next one."""
  split = split_rows(consolidation, pairs, groups, seed)
  start = (opt_state if consolidation.persistent_optimizer
           else init_optimizer_state(consolidation, params))
  weights, trained_state, loss = _train(config, model_config, training, consolidation,
                                        params.weights, start, params.vocab_ids, policy_params,
                                        split.train, jnp.asarray(split.order))
  trained = params.replace(weights=weights)
  kept = bool(all(np.isfinite(to_host(w)).all() for w in jax.tree.leaves(weights)))
  before = after = None
  if consolidation.rollback:
    before = to_host(held_out_losses(config, model_config, params, policy_params,
                                     split.held_out))
    after = to_host(held_out_losses(config, model_config, trained, policy_params,
                                    split.held_out))
    decay = training.depth_decay ** np.arange(config.depth)
    kept = kept and bool(np.sum(decay * after) < np.sum(decay * before))
  return DrafterConsolidation(params=trained if kept else params,
                              opt_state=trained_state if kept else opt_state, kept=kept,
                              loss_before=before, loss_after=after, loss=float(loss))
