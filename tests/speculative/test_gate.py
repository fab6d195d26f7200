"""The speculation gate's rule and the step-cost measurement that prices it."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specroll_jax.rollout.driver import Driver, RolloutConfig
from specroll_jax.rollout.sampling import SamplerConfig
from specroll_jax.rollout.vanilla import VanillaEngine
from specroll_jax.speculative import gate
from specroll_jax.speculative.engine import SpecEngine
from specroll_jax.speculative.gate import GateConfig, GateState
from specroll_jax.speculative.head_proposer import HeadDraftConfig, HeadProposer
from specroll_jax.speculative.heads import HeadsConfig, init_heads
from specroll_jax.speculative.step_cost import size_trees, with_measured_step_costs
from specroll_jax.speculative.tree import TreeConfig

CONFIG = GateConfig(warmup_tree_steps=2, probe_interval=4, max_probe_interval=16, horizon=4)


def _state(accepted, attempted, tree_steps, since_tree):
  return GateState(accepted=jnp.asarray(accepted, jnp.float32),
                   attempted=jnp.asarray(attempted, jnp.float32),
                   tree_steps=jnp.asarray(tree_steps, jnp.int32),
                   since_tree=jnp.asarray(since_tree, jnp.int32),
                   interval=jnp.full((len(accepted),), CONFIG.probe_interval, jnp.int32))


def test_tree_runs_while_warming_up_probing_or_paying():
  running = jnp.array([True, True, False])
  # Warmed up, last tree one step ago; level rates 0.5 and 1.0: at 2 levels a row expects
  # 0.5 + 0.25 and 1 + 1 tokens, 1 + mean(0.75, 2.0) = 2.375 in all.
  settled = _state([0.5, 2.0, 9.0], [1.0, 2.0, 9.0], [5, 5, 0], [1, 1, 0])
  # The finished row is ignored.
  np.testing.assert_allclose(float(gate.expected_tokens(settled, running, 2)), 2.375)
  assert bool(gate.tree_pays(CONFIG, settled, running, 2.3, 2))
  assert not bool(gate.tree_pays(CONFIG, settled, running, 2.4, 2))
  warming = settled.replace(tree_steps=jnp.array([5, 1, 5], jnp.int32))
  assert bool(gate.tree_pays(CONFIG, warming, running, 2.4, 2))
  probing = settled.replace(since_tree=jnp.array([4, 4, 0], jnp.int32))
  assert bool(gate.tree_pays(CONFIG, probing, running, 2.4, 2))
  # A finished row neither warms up nor probes.
  finished_only = settled.replace(tree_steps=jnp.array([5, 5, 0], jnp.int32),
                                  since_tree=jnp.array([1, 1, 9], jnp.int32))
  assert not bool(gate.tree_pays(CONFIG, finished_only, running, 2.4, 2))


def test_running_means_then_decay_and_plain_steps_count():
  running = jnp.array([True, False])
  state = GateState.init(CONFIG, 2)
  for accepted in (4, 2):
    state = gate.after_tree(CONFIG, state, jnp.array([accepted, 7]), running, 1.5, 4)
  # Plain means over the first trees (accepted 3.0; tried 4 and 3 levels), then weight
  # 1 / horizon.
  np.testing.assert_allclose(np.asarray(state.accepted), [3.0, 0.0])
  np.testing.assert_allclose(np.asarray(state.attempted), [3.5, 0.0])
  state = gate.after_tree(CONFIG, state, jnp.array([0, 7]), running, 1.5, 4)  # 3 + (0 - 3) / 3
  state = gate.after_tree(CONFIG, state, jnp.array([4, 7]), running, 1.5, 4)  # 2 + (4 - 2) / 4
  state = gate.after_tree(CONFIG, state, jnp.array([0, 7]), running, 1.5, 4)  # 2.5 - 2.5 / 4
  np.testing.assert_allclose(np.asarray(state.accepted), [1.875, 0.0])
  np.testing.assert_allclose(np.asarray(state.level_rate), [1.875 / 2.5, 0.0])
  assert state.tree_steps.tolist() == [5, 0]
  state = gate.after_plain(gate.after_plain(state, running), running)
  assert state.since_tree.tolist() == [2, 0]
  assert gate.after_tree(CONFIG, state, jnp.array([1, 1]), running,
                         1.5, 4).since_tree.tolist() == [0, 0]


def test_trees_that_accept_every_level_keep_paying_after_compaction_widens_them():
  """A row that accepts the one level of 2-node trees is a full-rate row: at the next
  bucket's 3 levels it expects 4 tokens, above a price of 2.6 (W4's 32 -> 16 rows)."""
  running = jnp.array([True, True])
  state = GateState.init(CONFIG, 2)
  for _ in range(3):
    state = gate.after_tree(CONFIG, state, jnp.array([1, 1]), running, 1.76, 1)
  np.testing.assert_allclose(float(gate.expected_tokens(state, running, 3)), 4.0)
  assert bool(gate.tree_pays(CONFIG, state, running, 2.6, 3))
  # A row that misses its one level half the time expects 1/2 + 1/4 + 1/8 at 3 levels.
  state = GateState.init(CONFIG, 2)
  for accepted in (0, 1, 0, 1):
    state = gate.after_tree(CONFIG, state, jnp.array([accepted, accepted]), running, 1.76, 1)
  # The running mean's steps of 1/3 and 1/4 round in float32 (rate 0.5 to within a few ulps).
  np.testing.assert_allclose(float(gate.expected_tokens(state, running, 3)), 1.875, rtol=1e-6)
  assert not bool(gate.tree_pays(CONFIG, state.replace(since_tree=jnp.zeros(2, jnp.int32),
                                                       tree_steps=jnp.full(2, 9, jnp.int32)),
                                 running, 2.6, 3))


def test_probes_that_do_not_pay_back_off_and_a_tree_that_pays_resets():
  running = jnp.array([True, False])
  state = GateState.init(CONFIG, 2)
  intervals = []
  for _ in range(4):
    state = gate.after_tree(CONFIG, state, jnp.array([0, 0]), running, 2.5, 4)
    intervals.append(state.interval.tolist())
  # Doubling up to max_probe_interval; the finished row keeps its interval.
  assert intervals == [[8, 4], [16, 4], [16, 4], [16, 4]]
  # All 4 levels accepted, weight 1/4: 1 accepted of 1.75 tried, rate 4/7, 2.19 tokens.
  unpaid = gate.after_tree(CONFIG, state, jnp.array([4, 0]), running, 2.5, 4)
  assert unpaid.interval.tolist() == [16, 4]
  # Again: 1.75 of 2.3125, rate 0.76, 3.09 tokens.
  paid = gate.after_tree(CONFIG, unpaid, jnp.array([4, 0]), running, 2.5, 4)
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
