"""Slow path, second half: consolidation of the heads the monitor triggered (METHOD.md 5).

An update trains only the triggered heads (Optax over the head pytree, the other heads'
gradients masked out) on pairs the GRPO step's own forward produced (rl/grpo.py,
`harvest_top_k`): KL(p || q_k) + lambda_tok CE + lambda_prox ||phi - phi_anchor||^2. A head
whose parameters are not finite afterwards rolls back to the anchor; with `rollback`, so
does one whose held-out KL does not improve.

The heads' Adam state can persist from one update to the next (`persistent_optimizer`), so
that a run's small updates continue one optimisation. A fresh Adam moves every parameter by
~lr on its first steps whatever the gradient's size (m / sqrt(v) = sign(g) at step one), so a
4-step update from fresh moments is mostly a sign step on one batch's noise.
"""
import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from specroll_jax.adapt import distill
from specroll_jax.adapt.distill import DistillConfig
from specroll_jax.model.mesh import to_host
from specroll_jax.speculative.heads import HeadsConfig
from specroll_jax.speculative.pairs import DistillPairs


@dataclasses.dataclass(frozen=True)
class ConsolidationConfig:
  # 4 steps x 8 rows: the always-online baseline's best end-to-end setting on W1; the slow
  # path runs the same update a quarter as often (notes/history.md, "Adaptation").
  steps: int = 4                  # Optax steps per update
  batch_size: int = 8             # harvested responses per step
  learning_rate: float = 1e-3
  ce_weight: float = 1.0          # lambda_tok
  prox_weight: float = 1e-2       # lambda_prox, per parameter (mean squared distance)
  held_out_fraction: float = 0.25
  # True: hold out whole prompt groups and roll back each head whose held-out KL does not
  # improve. False (measured better on W1: the check rejected most early updates that the
  # always-online baseline gains from, and cost half again as much) keeps every update whose
  # parameters stay finite.
  rollback: bool = False
  # Carry Adam's moments from one update to the next (ProposerState.opt_state) instead of
  # starting each update from fresh ones (W1, always-online: tau_last20 3.065 vs 3.030).
  persistent_optimizer: bool = True

  def __post_init__(self):
    if not 0.0 < self.held_out_fraction < 1.0:
      raise ValueError(f'held_out_fraction must be in (0, 1), got {self.held_out_fraction}')


def _distill_config(config: ConsolidationConfig) -> DistillConfig:
  return DistillConfig(ce_weight=config.ce_weight, learning_rate=config.learning_rate,
                       batch_size=config.batch_size, steps=config.steps)


def _along_heads(mask, x):
  """A per-head vector [H] shaped to broadcast against a head tensor (head axis first)."""
  return mask.reshape((-1,) + (1,) * (x.ndim - 1))


def _per_head(tree, mask):
  """Multiplies every head tensor by a per-head mask."""
  return jax.tree.map(lambda x: x * _along_heads(mask, x).astype(x.dtype), tree)


def _loss(heads_config, model_config, config: ConsolidationConfig, mask, anchor, head_params,
          policy_params, batch):
  kl, ce, count = distill.head_losses(heads_config, model_config, head_params, policy_params,
                                      batch)
  per_head = (kl + config.ce_weight * ce) / jnp.maximum(count, 1)
  distance = jax.tree.map(lambda p, a: jnp.mean(jnp.square(p - a).reshape(p.shape[0], -1), 1),
                          head_params, anchor)
  proximal = sum(jax.tree.leaves(distance))
  return jnp.sum(mask * (per_head + config.prox_weight * proximal)) / jnp.maximum(jnp.sum(mask), 1)


def make_optimizer(config: ConsolidationConfig) -> optax.GradientTransformation:
  return distill.make_optimizer(_distill_config(config))


def init_optimizer_state(config: ConsolidationConfig, head_params):
  """The heads' Adam state before their first update (zero moments)."""
  return make_optimizer(config).init(head_params)


def _where_heads(keep, new, old):
  """Per head (head axis first): `new` where keep [H] else `old`."""
  return jax.tree.map(lambda n, o: jnp.where(_along_heads(keep, n) > 0, n, o), new, old)


def _where_head_moments(config: ConsolidationConfig, keep, new, old):
  """`_where_heads` for the optimizer state: its moments mirror the head parameters; its step
  count is shared by all heads and taken from `new`."""
  is_moment = optax.tree_map_params(make_optimizer(config), lambda _: True, new,
                                    transform_non_params=lambda _: False)
  return jax.tree.map(lambda moment, n, o: _where_heads(keep, n, o) if moment else n,
                      is_moment, new, old)


def scanned_steps(optimizer, loss, params, opt_state, batch: DistillPairs, order,
                  gate=lambda tree: tree):
  """Optax steps of loss(params, minibatch) over the row minibatches `order` [steps,
  batch_size] of `batch`, as one scan inside the caller's jit; `gate` is applied to the
  gradients and to the updates. Returns (params, optimizer state, last loss)."""
  def step(carry, rows):
    params, opt_state = carry
    value, grads = jax.value_and_grad(loss)(params, jax.tree.map(lambda x: x[rows], batch))
    updates, opt_state = optimizer.update(gate(grads), opt_state, params)
    return (optax.apply_updates(params, gate(updates)), opt_state), value

  (params, opt_state), losses = jax.lax.scan(step, (params, opt_state), order)
  return params, opt_state, losses[-1]


@partial(jax.jit, static_argnums=(0, 1, 2))
def _train(heads_config: HeadsConfig, model_config, config: ConsolidationConfig, head_params,
           opt_state, policy_params, batch: DistillPairs, mask, order):
  """`order` [steps, batch_size] row indices; Optax on the head pytree, masked per head.
  Returns (params, optimizer state, last loss)."""
  loss = lambda params, minibatch: _loss(heads_config, model_config, config, mask, head_params,
                                         params, policy_params, minibatch)
  # Adam's update of a zero gradient is zero; masking the updates too keeps frozen heads
  # bit-exact.
  return scanned_steps(make_optimizer(config), loss, head_params, opt_state, batch, order,
                       gate=lambda tree: _per_head(tree, mask))


@partial(jax.jit, static_argnums=(0, 1))
def held_out_kl(heads_config: HeadsConfig, model_config, head_params, policy_params,
                batch: DistillPairs):
  """Mean KL(p || q_k) per head on held-out pairs [H]."""
  kl, _, count = distill.head_losses(heads_config, model_config, head_params, policy_params,
                                     batch)
  return kl / jnp.maximum(count, 1)


@dataclasses.dataclass(frozen=True)
class RowSplit:
  """The harvested rows an update trains on, and those it holds out to judge it."""
  train: DistillPairs
  held_out: DistillPairs | None  # None without rollback: nothing is held out
  order: np.ndarray           # int [steps, batch_size] rows of `train` per Optax step


def split_rows(config: ConsolidationConfig, pairs: DistillPairs, groups, seed: int) -> RowSplit:
  """With `config.rollback`, whole prompt groups held out (`groups` [rows] names each row's
  prompt; None: every row its own): a GRPO group's samples share their prompt's text, so a
  held-out row of a trained prompt would reward memorising that prompt instead of tracking
  the policy. Without it every row trains."""
  rows = pairs.tokens.shape[0]
  groups = np.arange(rows) if groups is None else np.asarray(groups)
  if groups.shape != (rows,):
    raise ValueError(f'groups has shape {groups.shape}, expected ({rows},) like the pairs')
  rng = np.random.default_rng(seed)
  held_out_rows = np.zeros(rows, bool)
  if config.rollback:
    names = np.unique(groups)
    held = max(1, int(round(len(names) * config.held_out_fraction)))
    if len(names) - held < 1:
      raise ValueError(f'slow path needs at least 2 harvested prompt groups, got {len(names)}')
    held_out_rows = np.isin(groups, rng.permutation(names)[:held])
  train_rows = np.flatnonzero(~held_out_rows)
  take = lambda index: jax.tree.map(lambda x: x[index], pairs)
  order = np.stack([rng.choice(len(train_rows), min(config.batch_size, len(train_rows)),
                               replace=False) for _ in range(config.steps)])
  return RowSplit(train=take(train_rows),
                  held_out=take(np.flatnonzero(held_out_rows)) if config.rollback else None,
                  order=order)


@dataclasses.dataclass(frozen=True)
class Consolidation:
  params: dict
  opt_state: Any          # the heads' optimizer state after the update (rolled back per head)
  kept: np.ndarray        # bool [H] updated heads kept (finite; with rollback, KL improved)
  kl_before: np.ndarray | None  # [H] held-out KL (None without rollback: nothing held out)
  kl_after: np.ndarray | None   # [H] held-out KL of the trained (pre-rollback) heads
  loss: float


def _finite_heads(head_params) -> np.ndarray:
  """bool [H]: every parameter of the head is finite."""
  return np.all([np.isfinite(to_host(x)).reshape(x.shape[0], -1).all(1)
                 for x in jax.tree.leaves(head_params)], axis=0)


def consolidate(heads_config: HeadsConfig, model_config, config: ConsolidationConfig, head_params,
                opt_state, policy_params, pairs: DistillPairs, heads_mask, seed: int,
                groups=None) -> Consolidation:
  """Trains the heads in `heads_mask` on `pairs`; with `config.rollback` keeps a head only if
  its held-out KL improves.

  `opt_state` is the heads' optimizer state from the last update (used only with
  `config.persistent_optimizer`). With `config.rollback` False (the always-online
  baseline) it trains on every row, holds none out and keeps every trained head whose
  parameters stay finite (kl_before / kl_after are then None). `groups`: see split_rows."""
  heads_mask = np.asarray(heads_mask, bool)
  split = split_rows(config, pairs, groups, seed)
  mask = jnp.asarray(heads_mask, jnp.float32)
  start = opt_state if config.persistent_optimizer else init_optimizer_state(config, head_params)
  trained, trained_state, loss = _train(heads_config, model_config, config, head_params, start,
                                        policy_params, split.train, mask,
                                        jnp.asarray(split.order))
  before = after = None
  if config.rollback:
    held_out = split.held_out
    before = to_host(held_out_kl(heads_config, model_config, head_params, policy_params,
                                 held_out))
    after = to_host(held_out_kl(heads_config, model_config, trained, policy_params, held_out))
    kept = heads_mask & np.isfinite(after) & (after < before)
  else:
    kept = heads_mask & _finite_heads(trained)
  keep = jnp.asarray(kept, jnp.float32)
  # A rolled-back head also keeps its old moments: the rejected step must not echo through
  # momentum into the next update.
  if config.persistent_optimizer:
    opt_state = _where_head_moments(config, keep, trained_state, opt_state)
  return Consolidation(params=_where_heads(keep, trained, head_params), opt_state=opt_state,
                       kept=kept, kl_before=before, kl_after=after, loss=float(loss))
