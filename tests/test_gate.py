"""The speculation gate's rule and the step-cost measurement that prices it."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specroll_jax.rollout.driver import Driver, RolloutConfig
from specroll_jax.rollout.sampling import SamplerConfig
from specroll_jax.rollout.vanilla import VanillaEngine
from specroll_jax.spec import gate
from specroll_jax.spec.engine import SpecEngine
from specroll_jax.spec.gate import GateConfig, GateState
from specroll_jax.spec.head_proposer import HeadDraftConfig, HeadProposer
from specroll_jax.spec.heads import HeadsConfig, init_heads
from specroll_jax.spec.step_cost import size_trees, with_measured_step_costs
from specroll_jax.spec.tree import TreeConfig

CONFIG = GateConfig(warmup_tree_steps=2, probe_interval=4, max_probe_interval=16, horizon=4)


def _state(accepted, tree_steps, since_tree):
  return GateState(accepted=jnp.asarray(accepted, jnp.float32),
                   tree_steps=jnp.asarray(tree_steps, jnp.int32),
                   since_tree=jnp.asarray(since_tree, jnp.int32),
                   interval=jnp.full((len(accepted),), CONFIG.probe_interval, jnp.int32))


def test_tree_runs_while_warming_up_probing_or_paying():
  running = jnp.array([True, True, False])
  # Warmed up, last tree one step ago, 1 + mean(0.5, 1.5) = 2.0 tokens expected.
  settled = _state([0.5, 1.5, 9.0], [5, 5, 0], [1, 1, 0])
  assert float(gate.expected_tokens(settled, running)) == 2.0  # the finished row is ignored
  assert bool(gate.tree_pays(CONFIG, settled, running, 1.9))
  assert not bool(gate.tree_pays(CONFIG, settled, running, 2.1))
  warming = settled.replace(tree_steps=jnp.array([5, 1, 5], jnp.int32))
  assert bool(gate.tree_pays(CONFIG, warming, running, 2.1))
  probing = settled.replace(since_tree=jnp.array([4, 4, 0], jnp.int32))
  assert bool(gate.tree_pays(CONFIG, probing, running, 2.1))
  # A finished row neither warms up nor probes.
  finished_only = settled.replace(tree_steps=jnp.array([5, 5, 0], jnp.int32),
                                  since_tree=jnp.array([1, 1, 9], jnp.int32))
  assert not bool(gate.tree_pays(CONFIG, finished_only, running, 2.1))


def test_running_mean_then_decay_and_plain_steps_count():
  running = jnp.array([True, False])
  state = GateState.init(CONFIG, 2)
  for accepted in (4, 2):
    state = gate.after_tree(CONFIG, state, jnp.array([accepted, 7]), running, 1.5)
  # A plain mean over the first trees (3.0), then weight 1 / horizon.
  np.testing.assert_allclose(np.asarray(state.accepted), [3.0, 0.0])
  state = gate.after_tree(CONFIG, state, jnp.array([0, 7]), running, 1.5)  # 3 + (0 - 3) / 3
  state = gate.after_tree(CONFIG, state, jnp.array([4, 7]), running, 1.5)  # 2 + (4 - 2) / 4
  state = gate.after_tree(CONFIG, state, jnp.array([0, 7]), running, 1.5)  # 2.5 - 2.5 / 4
  np.testing.assert_allclose(np.asarray(state.accepted), [1.875, 0.0])
  assert state.tree_steps.tolist() == [5, 0]
  state = gate.after_plain(gate.after_plain(state, running), running)
  assert state.since_tree.tolist() == [2, 0]
  assert gate.after_tree(CONFIG, state, jnp.array([1, 1]), running,
                         1.5).since_tree.tolist() == [0, 0]


def test_probes_that_do_not_pay_back_off_and_a_tree_that_pays_resets():
  running = jnp.array([True, False])
  state = GateState.init(CONFIG, 2)
  intervals = []
  for _ in range(4):
    state = gate.after_tree(CONFIG, state, jnp.array([0, 0]), running, 2.0)
    intervals.append(state.interval.tolist())
  # Doubling up to max_probe_interval; the finished row keeps its interval.
  assert intervals == [[8, 4], [16, 4], [16, 4], [16, 4]]
  paid = gate.after_tree(CONFIG, state, jnp.array([9, 0]), running, 2.0)  # mean 9 / 5 + 1 > 2
  assert paid.interval.tolist() == [4, 4]


def test_config_rejects_nonpositive_fields():
  with pytest.raises(ValueError, match='probe_interval'):
    GateConfig(probe_interval=0)
  with pytest.raises(ValueError, match='max_probe_interval 8 < probe_interval 16'):
    GateConfig(probe_interval=16, max_probe_interval=8)


def _small_engine(policy, sampler):
  """(engine, its params, two prompts) with random heads; C_hw = 8 tokens: at most 4 nodes
  at 1 and 2 rows, 2 at 4 rows, 1 (plain, unpriced) at 8 rows."""
  heads = HeadsConfig(num_heads=2)
  proposer = HeadProposer(policy.config, heads, HeadDraftConfig((2, 2)), sampler)
  engine = SpecEngine(policy.config, proposer, TreeConfig(capacity_tokens=8, max_nodes=4),
                      sampler, (2,))
  params = engine.params(policy.params, init_heads(heads, policy.config, seed=0))
  return engine, params, [policy.tokenizer.encode(t) for t in ('Once upon a time', 'The cat')]


def test_step_costs_are_measured_for_every_bucket_with_trees(stories_policy):
  engine, params, prompts = _small_engine(stories_policy, SamplerConfig(temperature=1.0))
  priced = with_measured_step_costs(engine, RolloutConfig(max_new_tokens=16, max_batch=8),
                                    params, prompts, 4, repeats=2)
  assert [b for b, _ in priced.tree_step_costs] == [1, 2, 4]
  assert all(cost > 0 for _, cost in priced.tree_step_costs)
  assert priced.tree_step_cost(8) == priced.tree_step_costs[-1][1]
  assert priced.tree_step_cost(3) == priced.tree_step_costs[2][1]
  assert engine.tree_step_cost(4) is None


def test_trees_are_sized_by_measured_price_and_tokens_per_step(stories_policy):
  policy, sampler = stories_policy, SamplerConfig(temperature=1.0)
  engine, params, prompts = _small_engine(policy, sampler)
  rollout = RolloutConfig(max_new_tokens=16, max_batch=8)
  driver = Driver(engine, rollout)
  state = driver.first_state(params, prompts, 4)
  sized, trials = size_trees(engine, params, state, jax.random.key(0), driver.buckets,
                             repeats=2)
  # Every width with a projection per depth; where rows x nodes are few, also with one.
  assert [(t.batch, t.width, t.one_projection) for t in trials] == [
      (1, 2, False), (1, 2, True), (1, 4, False), (1, 4, True), (2, 2, False), (2, 2, True),
      (2, 4, False), (2, 4, True), (4, 2, False), (4, 2, True)]
  assert all(t.cost > 0 and 1 <= t.tokens_per_step <= t.width for t in trials)
  best = {b: max((t for t in trials if t.batch == b), key=lambda t: t.gain) for b in (1, 2, 4)}
  assert sized.tree_config.sized_widths == tuple((b, t.width) for b, t in best.items())
  assert sized.tree_config.one_projection == tuple(b for b, t in best.items() if t.one_projection)
  assert sized.tree_step_costs == tuple((b, t.cost) for b, t in best.items())
  assert [sized.tree_width(b) for b in (1, 2, 4, 8)] == [best[1].width, best[2].width, 2, 1]
  # Whatever widths were chosen, the rollout is vanilla's.
  vanilla = Driver(VanillaEngine(policy.config, sampler, (2,)), rollout).generate(
      policy.params, prompts, 4, seed=3)
  speculative = Driver(sized, rollout).generate(params, prompts, 4, seed=3)
  assert [r.token_ids for r in speculative] == [r.token_ids for r in vanilla]
