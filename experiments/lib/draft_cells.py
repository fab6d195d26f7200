"""One cell of a draft-quality measurement (nodes per row, responses in flight, sampler) and
what proposing costs: shared by experiments.bench.drafts and experiments.measure.drafter_kinds.

Every step of a cell's engines is a tree of exactly `nodes` nodes per row (no gate, no
sizing), so tau measures the drafts and nothing else; each proposer's responses are checked
against vanilla's from the same seed.
"""
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from experiments.lib.workloads import oracle_engine_params
from specroll_jax.rollout.driver import Driver, RolloutConfig, take_rows
from specroll_jax.speculative.engine import SpecEngine
from specroll_jax.speculative.factory import build_engine
from specroll_jax.speculative.proposer import StepContext, Vocabulary
from specroll_jax.speculative.step_cost import STEPS_PER_CALL, compiled_steps
from specroll_jax.speculative.tree import TreeConfig


def cell_workload(c, prompts, responses: int):
  """(prompts, samples, rollout config): one question at a time, or 4 x 4 in one bucket."""
  if responses == 1:
    return prompts, 1, RolloutConfig(c.max_new_tokens, max_batch=1,
                                     prompt_buckets_per_octave=c.prompt_buckets_per_octave)
  samples = responses // len(prompts)
  if samples * len(prompts) != responses:
    raise ValueError(f'responses={responses} is not a multiple of num_prompts={len(prompts)}')
  return prompts, samples, RolloutConfig(c.max_new_tokens, max_batch=responses,
                                         min_batch=responses,
                                         prompt_buckets_per_octave=c.prompt_buckets_per_octave)


def fixed_budget_engine(policy, proposer, sampler, nodes: int, responses: int) -> SpecEngine:
  return build_engine(policy, 'specroll', sampler, proposer=proposer,
                      tree=TreeConfig(max_nodes=nodes, capacity_tokens=nodes * responses))


def run_cell(policy, c, built, prompts, nodes, responses, sampler) -> dict:
  prompts, samples, rollout = cell_workload(c, prompts, responses)
  reference = Driver(build_engine(policy, 'vanilla', sampler), rollout).generate(
      policy.params, prompts, samples, c.seed)
  out = {}
  for name, (proposer, proposer_params) in built.items():
    engine = fixed_budget_engine(policy, proposer, sampler, nodes, responses)
    params = (oracle_engine_params(engine, policy, reference, c.max_new_tokens)
              if name == 'oracle' else engine.params(policy.params, proposer_params))
    start = time.perf_counter()
    spec = Driver(engine, rollout).generate(params, prompts, samples, c.seed)
    tokens = sum(len(r.token_ids) for r in spec)
    out[name] = dict(tau=tokens / sum(r.steps for r in spec), tokens=tokens,
                     identical=sum(a.token_ids == b.token_ids for a, b in zip(spec, reference)),
                     responses=len(spec), seconds=time.perf_counter() - start)
    print(f'{nodes} nodes, {responses} responses, T={sampler.temperature}: {name} tau '
          f'{out[name]["tau"]:.2f}', file=sys.stderr)
    jax.clear_caches()  # one engine per cell and proposer: release each compiled loop
  return out


def proposing_costs(policy, c, built, prompts, sampler, repeats: int = 15) -> dict:
  """Plain steps per proposal at one response: a proposer's `propose` for a tree of
  c.cost_nodes nodes, timed alone against the vanilla step in alternating calls of
  STEPS_PER_CALL each (the median ratio). The oracle proposes nothing (its chain is an input)."""
  prompts, samples, rollout = cell_workload(c, prompts[:1], 1)
  first_row = jnp.zeros((1,), jnp.int32)
  costs = {}
  for name, (proposer, proposer_params) in built.items():
    if name == 'oracle':
      continue
    engine = fixed_budget_engine(policy, proposer, sampler, c.cost_nodes, 1)
    params = engine.params(policy.params, proposer_params)
    state = Driver(engine, rollout).first_state(params, prompts, samples)
    levels = engine.tree_levels(1)

    @jax.jit
    def proposals(params, state):
      root = jnp.argmax(state.next_logits, axis=-1).astype(jnp.int32)
      vocab = Vocabulary(params.policy, policy.config)

      def one(_, features):
        proposal = proposer.propose(params.proposer, state.proposer,
                                    StepContext(features, root, state.seqs, vocab), levels)
        # A dependence on the proposal, so the calls are neither hoisted nor merged.
        return features + 0.0 * jnp.sum(proposal.candidates.scores)
      return jax.lax.fori_loop(0, STEPS_PER_CALL, one, state.last_features)

    plain = compiled_steps(engine.plain_step)
    key = jax.random.key(0)
    jax.block_until_ready((proposals(params, state),
                           plain(params, take_rows(state, first_row), key)))
    ratios = []
    for _ in range(repeats):
      start = time.perf_counter()
      jax.block_until_ready(proposals(params, state))
      propose_seconds = time.perf_counter() - start
      rows = jax.block_until_ready(take_rows(state, first_row))
      start = time.perf_counter()
      jax.block_until_ready(plain(params, rows, key))
      ratios.append(propose_seconds / (time.perf_counter() - start))
    costs[name] = statistics.median(ratios)
    jax.clear_caches()
  return costs


def step_costs(policy, c, built, prompts, sampler, repeats: int = 15) -> dict:
  """{name: {'tree': t, 'plain': p}}: at one response and c.cost_nodes nodes, each proposer's
  whole tree step and its engine's plain step (which also captures the proposer's feature
  layers, if any) in vanilla steps, every call from its engine's first state on the same
  prompt, calls of STEPS_PER_CALL steps alternating with vanilla's (median ratios)."""
  prompts, samples, rollout = cell_workload(c, prompts[:1], 1)
  vanilla = build_engine(policy, 'vanilla', sampler)
  vanilla_params = vanilla.params(policy.params)
  reference = (compiled_steps(vanilla.step), vanilla_params,
               Driver(vanilla, rollout).first_state(vanilla_params, prompts, samples))
  timed = {}
  for name, (proposer, proposer_params) in built.items():
    engine = fixed_budget_engine(policy, proposer, sampler, c.cost_nodes, 1)
    params = engine.params(policy.params, proposer_params)
    state = Driver(engine, rollout).first_state(params, prompts, samples)
    timed[name, 'tree'] = (compiled_steps(engine.tree_step), params, state)
    timed[name, 'plain'] = (compiled_steps(engine.plain_step), params, state)
  key, first_row = jax.random.key(0), jnp.zeros((1,), jnp.int32)

  def seconds(step, params, state):
    rows = jax.block_until_ready(take_rows(state, first_row))  # the call donates its state
    start = time.perf_counter()
    jax.block_until_ready(step(params, rows, key))
    return time.perf_counter() - start

  for entry in (reference, *timed.values()):
    seconds(*entry)  # compiles
  ratios = {k: [] for k in timed}
  for _ in range(repeats):
    base = seconds(*reference)
    for k, entry in timed.items():
      ratios[k].append(seconds(*entry) / base)
  costs = {}
  for (name, kind), values in ratios.items():
    costs.setdefault(name, {})[kind] = statistics.median(values)
  jax.clear_caches()
  return costs
