"""Reflex: feedback direction, gate behaviour, bounded correction, per-response state."""
import jax
import jax.numpy as jnp
import numpy as np

from specroll_jax.adapt import reflex
from specroll_jax.adapt.reflex import ReflexConfig, ReflexState
from specroll_jax.adapt.reflex_proposer import ReflexProposer
from specroll_jax.rollout.driver import Driver, RolloutConfig
from specroll_jax.rollout.sampling import SamplerConfig
from specroll_jax.speculative.engine import SpecEngine
from specroll_jax.speculative.head_proposer import HeadDraftConfig, HeadProposer
from specroll_jax.speculative.heads import HeadsConfig, init_heads
from specroll_jax.speculative.tree import TreeConfig

VOCAB, DIM, HEADS, TOP = 128, 64, 2, 16  # DIM as in stories260K; TOP: proposal K and policy M


def _kl(p, logits):
  return float(jnp.sum(p * (jnp.log(p) - jax.nn.log_softmax(logits))))


def test_feedback_moves_the_head_toward_the_policy():
  """A small step along r lowers KL(p || q) whether or not C covers the vocabulary."""
  for seed in range(20):
    kw, kz, kp = jax.random.split(jax.random.key(seed), 3)
    w = jax.random.normal(kw, (VOCAB, DIM))
    z = jax.random.normal(kz, (DIM,))
    p = jax.nn.softmax(w @ (z + 0.8 * jax.random.normal(kp, (DIM,))))
    q = jax.nn.softmax(w @ z)
    for candidates in (VOCAB, 4):
      ids_q = jnp.argsort(-q)[:TOP] if candidates < VOCAB else jnp.argsort(-q)
      ids_p = jnp.argsort(-p)[:TOP]
      r, _, coverage = reflex.feedback(ids_q, jnp.log(q[ids_q]),
                                       jnp.arange(ids_q.shape[0]) < candidates, ids_p, p[ids_p],
                                       w[ids_q], w[ids_p], ReflexConfig())
      step = 1e-3 * r / jnp.linalg.norm(r)
      assert _kl(p, w @ (z + step)) < _kl(p, w @ z), (seed, candidates)
      if candidates == VOCAB:
        assert float(coverage) == 0.0


def _run(config, targets_for_step, steps, heads=HEADS):
  """Feeds `steps` engine steps that each advance one token and reach depth 1.

  targets_for_step(i) -> (proposal logits [heads, V], policy logits [V]) at step i.
  Returns the state and the gate after every step.
  """
  w = jax.random.normal(jax.random.key(0), (VOCAB, DIM))
  state = ReflexState.init(1, heads, DIM, TOP, steps)
  gates = []
  for i in range(steps):
    proposal_logits, policy_logits = targets_for_step(i)
    logq, ids = jax.lax.top_k(jax.nn.log_softmax(proposal_logits), TOP)
    root = jnp.array([10 + i])
    state = reflex.record_proposals(state, ids[None].astype(jnp.int32), logq[None], root,
                                    jnp.ones((1, heads), bool))
    probs, ids_p = jax.lax.top_k(jax.nn.softmax(policy_logits), TOP)
    target_ids = jnp.broadcast_to(ids_p.astype(jnp.int32), (1, heads, TOP))
    target_probs = jnp.broadcast_to(probs, (1, heads, TOP))
    reached = jnp.arange(heads)[None] < 1
    state = reflex.mature(config, state, target_ids, target_probs, reached, root, (4,) * heads,
                          lambda x: w[x])
    gates.append(np.asarray(reflex.gate(config, state.reliability))[0])
  return state, np.array(gates), w


def test_gate_stays_shut_on_noise_and_opens_on_a_persistent_shift():
  config = ReflexConfig()
  keys = jax.random.split(jax.random.key(1), 400)
  noise = lambda i: (jax.random.normal(keys[2 * i], (HEADS, VOCAB)) * 2,
                     jax.random.normal(keys[2 * i + 1], (VOCAB,)) * 2)
  _, gates, _ = _run(config, noise, 120)
  assert gates.max() == 0.0, gates.max()

  base = jax.random.normal(jax.random.key(2), (VOCAB,))
  shift = jax.random.normal(jax.random.key(3), (VOCAB,)) * 3
  jitter = jax.random.split(jax.random.key(4), 200)
  persistent = lambda i: (jnp.stack([base] * HEADS),
                          base + shift + 0.3 * jax.random.normal(jitter[i], (VOCAB,)))
  state, gates, _ = _run(config, persistent, 60)
  assert gates[-1, 0] > 0.5, gates[-1]
  assert float(state.matured[0, 0]) == 60.0
  # Head 2's proposals (for root + 2) mature one step later, when depth 1 reaches them.
  assert float(state.matured[0, 1]) == 59.0


def test_correction_respects_its_bound_and_corrects_toward_the_shift():
  config = ReflexConfig(step_size=0.8, max_correction=0.25, gate_threshold=0.0)
  base = jax.random.normal(jax.random.key(5), (VOCAB,))
  shift = jax.random.normal(jax.random.key(6), (VOCAB,)) * 3
  state, _, _ = _run(config, lambda i: (jnp.stack([base] * HEADS), base + shift), 40)
  hidden = jax.random.normal(jax.random.key(7), (1, DIM)) * 7.0
  delta, g, relative = reflex.correction(config, state, hidden)
  bound = config.step_size * config.max_correction * float(jnp.linalg.norm(hidden))
  assert float(jnp.max(jnp.linalg.norm(delta, axis=-1))) <= bound * (1 + 1e-5)
  assert float(g[0, 0]) > 0.8 and float(relative[0, 0]) > 0.8 * 0.8 * 0.25


def test_non_finite_values_reset_instead_of_spreading():
  config = ReflexConfig(gate_threshold=-1.0)
  state = ReflexState.init(2, HEADS, DIM, TOP, 4)
  state = state.replace(memory=state.memory.at[0].set(jnp.nan), matured=state.matured + 1)
  delta, _, relative = reflex.correction(config, state, jnp.ones((2, DIM)))
  assert bool(jnp.all(jnp.isfinite(delta))) and float(jnp.abs(delta[0]).max()) == 0.0
  assert float(relative[0].max()) == 0.0
  w = jax.random.normal(jax.random.key(0), (VOCAB, DIM))
  root = jnp.array([3, 3])
  ids = jnp.tile(jnp.arange(TOP, dtype=jnp.int32), (2, HEADS, 1))
  logq = jnp.full((2, HEADS, TOP), -np.log(TOP))
  state = reflex.record_proposals(state, ids, logq, root, jnp.ones((2, HEADS), bool))
  state = reflex.mature(config, state, ids, jnp.exp(logq) * 0 + jnp.eye(TOP)[0], jnp.ones((2, HEADS), bool),
                        root, (4,) * HEADS, lambda x: w[x])
  assert bool(jnp.all(jnp.isfinite(state.memory))) and bool(jnp.all(jnp.isfinite(state.reliability)))
  assert float(jnp.abs(state.memory[0, 0]).max()) == 0.0  # the NaN row was reset
  assert float(jnp.abs(state.memory[1, 0]).max()) > 0.0   # the healthy row learned


def test_state_is_per_row_and_fresh_for_each_response():
  config = ReflexConfig(gate_threshold=-1.0)
  state = ReflexState.init(3, HEADS, DIM, TOP, 8)
  assert all(float(jnp.abs(x).max()) == 0 for x in jax.tree.leaves(state)
             if x.dtype == jnp.float32)
  assert bool(jnp.all(state.pending_position == -1))
  w = jax.random.normal(jax.random.key(0), (VOCAB, DIM))
  ids = jnp.tile(jnp.arange(TOP, dtype=jnp.int32), (3, HEADS, 1))
  logq = jnp.full((3, HEADS, TOP), -np.log(TOP))
  root = jnp.array([5, 5, 5])
  only_row_1 = jnp.array([[False] * HEADS, [True] * HEADS, [False] * HEADS])
  state = reflex.record_proposals(state, ids, logq, root, only_row_1)
  state = reflex.mature(config, state, ids, jnp.broadcast_to(jnp.eye(TOP)[1], logq.shape),
                        jnp.ones((3, HEADS), bool), root, (4,) * HEADS, lambda x: w[x])
  assert float(state.matured[1, 0]) == 1.0
  for row in (0, 2):
    assert float(jnp.abs(state.memory[row]).max()) == 0.0
    assert float(state.matured[row].max()) == 0.0


def test_shut_rows_listen_on_a_schedule_and_open_rows_always():
  config = ReflexConfig(shut_listen_interval=8)
  state = ReflexState.init(6, HEADS, DIM, TOP, 8).replace(
      proposals=jnp.array([0, 1, 2, 7, 8, 9], jnp.int32))
  shut = jnp.zeros((6, HEADS))
  sketches, hears = reflex.listening(config, state, shut)
  # One sketch every 8 proposals; its targets lie within the next HEADS (2) proposals.
  assert sketches.tolist() == [True, False, False, False, True, False]
  assert hears.tolist() == [True, True, False, False, True, True]
  sketches, hears = reflex.listening(config, state, shut.at[:, 1].set(0.3))
  assert all(sketches.tolist()) and all(hears.tolist())
  sketches, hears = reflex.listening(ReflexConfig(shut_listen_interval=1), state, shut)
  assert all(sketches.tolist()) and all(hears.tolist())


def test_a_shut_reflex_hears_only_its_scheduled_feedback(stories_policy):
  """Inside the engine, with every gate shut: one sketch per `shut_listen_interval` proposals
  (so at most that many feedbacks per head), and the same tokens as listening always."""
  policy, sampler = stories_policy, SamplerConfig(temperature=0.0)
  heads_config = HeadsConfig(num_heads=2)
  heads = init_heads(heads_config, policy.config, seed=1)
  prompts = [policy.tokenizer.encode(t) for t in ('Once upon a time', 'The cat sat on')]

  def run(interval):
    proposer = ReflexProposer(HeadProposer(policy.config, heads_config, HeadDraftConfig((2, 1)),
                                           sampler),
                              ReflexConfig(gate_threshold=0.99, shut_listen_interval=interval))
    engine = SpecEngine(policy.config, proposer, TreeConfig(capacity_tokens=16, max_nodes=4),
                        sampler, ())
    return Driver(engine, RolloutConfig(max_new_tokens=24, max_batch=2)).generate(
        engine.params(policy.params, heads), prompts, 1, 0)

  sparse, every_step = run(8), run(1)
  assert [r.token_ids for r in sparse] == [r.token_ids for r in every_step]
  for r in sparse:
    assert r.stats.proposer.matured.max() <= -(-r.steps // 8), (r.steps, r.stats.proposer.matured)
  heard = lambda rs: sum(float(r.stats.proposer.matured.sum()) for r in rs)
  assert 0 < heard(sparse) < heard(every_step) / 4
