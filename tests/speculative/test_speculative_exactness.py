"""The speculative engine emits exactly what the vanilla engine emits (never loosened).

Greedy: identical tokens, always. Sampling with the same seed: identical tokens; a
mismatch may only come from a float near-tie between differently shaped forwards, bounded
at 0.1% of tokens (counting every token after a response's first divergence). Heads range from fresh to random to deliberately bad, and the oracle
proposer (true future tokens) drives deep acceptances through EOS and length cut-offs.
Every test runs twice: with the static head proposer, and with the GRPO default's drafting
(group drafts, i.e. continuations from the prompt and the sibling samples, merged with
adapted heads: the Reflex proposer correcting the proposals inside the rollout, its gate
forced open, on heads the slow path has just updated). Drafts and adaptation may change
what is proposed, never what is emitted. The oracle proposer's chain runs alone with the
static proposer (as the benchmarks run it: no heads, no top-M in the walk) and merged with
the GRPO default's drafting.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.scipy.special import gammaincc

from specroll_jax import load_policy
from specroll_jax.adapt import consolidation, distill
from specroll_jax.adapt.consolidation import ConsolidationConfig
from specroll_jax.adapt.reflex import ReflexConfig
from specroll_jax.adapt.reflex_proposer import ReflexProposer
from specroll_jax.rollout.compilation import count_compilations
from specroll_jax.rollout.driver import Driver, RolloutConfig
from specroll_jax.rollout.sampling import SamplerConfig
from specroll_jax.rollout.vanilla import VanillaEngine
from specroll_jax.speculative.drafter import DrafterConfig, init_drafter
from specroll_jax.speculative.drafter_proposer import DrafterProposer, spine_paths
from specroll_jax.speculative.engine import SpecEngine
from specroll_jax.speculative.gate import GateConfig
from specroll_jax.speculative.group_proposer import GroupDraftConfig, GroupProposer
from specroll_jax.speculative.head_proposer import HeadDraftConfig, HeadProposer
from specroll_jax.speculative.heads import HeadsConfig, init_heads
from specroll_jax.speculative.oracle_proposer import OracleParams, OracleProposer
from specroll_jax.speculative.tree import TreeConfig
from tests.conftest import STORIES
from tests.tiny_models import make_checkpoint

PROMPTS = ['Once upon a time', 'The cat sat on', 'Lily and Tom went to the park to play', 'Hi']
# Log-probs come from differently shaped forwards (a tree of N nodes vs one token), and
# XLA:CPU's float32 results depend on shapes in the last bits. The vanilla engine against
# itself, changing only the batch bucket (1 vs 64 rows), differs by up to 3.3e-5 in
# log-probs on identical tokens (WORKSPACE_NOTES.md, "Log-prob agreement"): a pure 1e-5
# absolute bound sits below float32's floor for log-probs of magnitude > 1. The speculative
# engine is held to 1e-5 absolute plus 1e-5 relative, inside vanilla's own layout noise.
LOGPROB_ATOL = 1e-5
LOGPROB_RTOL = 1e-5
HEADS = HeadsConfig(num_heads=4)
# Gate open from the first feedback and large corrections: proposals really move.
OPEN_REFLEX = ReflexConfig(gate_threshold=-1.0, step_size=1.0, max_correction=1.0)


@pytest.fixture(autouse=True)
def release_compiled_programs_per_test():
  """This module compiles the largest programs of the suite (every engine variant, the
  gated loop, the Pallas kernel in interpret mode): releasing them once per module let the
  module's last test segfault in XLA:CPU's compile at the memory-map limit (see
  conftest.py), even when the module ran alone."""
  yield
  jax.clear_caches()


# Short matches and chains, so that these small runs find and verify group drafts often.
GROUP = GroupDraftConfig(chains=2, chain_depth=4, min_match=1, max_match=8, matches=8)


@pytest.fixture(params=['static', 'group_adaptive'], autouse=True)
def proposer_kind(request):
  """Module-wide switch read by _heads and _proposer."""
  global ADAPTIVE
  ADAPTIVE = request.param == 'group_adaptive'
  yield request.param


def _slow_path_update(policy, params, heads_config=HEADS):
  """Heads after one slow-path consolidation (all heads, kept) on the policy's own text."""
  rng = np.random.default_rng(0)
  sequences = [list(rng.integers(1, policy.config.vocab_size, 24)) for _ in range(8)]
  pairs = distill.build_batch(policy.config, policy.params, sequences, 24, 8)
  config = ConsolidationConfig(steps=3, batch_size=4, rollback=False)
  return consolidation.consolidate(heads_config, policy.config, config, params,
                                   consolidation.init_optimizer_state(config, params),
                                   policy.params, pairs, np.ones(4, bool), seed=0).params


def _heads(policy, kind: str, heads_config=HEADS):
  params = init_heads(heads_config, policy.config, seed=1)
  if kind != 'fresh':
    scale = {'random': 0.3, 'bad': 30.0}[kind]
    noise = jax.random.normal(jax.random.key(2), params['w2'].shape) * scale
    params = dict(params, w2=noise)
  return _slow_path_update(policy, params, heads_config) if ADAPTIVE else params


def _proposer(policy, sampler, branching, oracle=False, heads_config=HEADS):
  proposer = HeadProposer(policy.config, heads_config, HeadDraftConfig(branching), sampler)
  if ADAPTIVE:
    proposer = GroupProposer(GROUP, base=ReflexProposer(proposer, OPEN_REFLEX))
  if not oracle:
    return proposer
  return OracleProposer(len(branching), base=proposer if ADAPTIVE else None)


def _engine(policy, tree, sampler, eos, branching=(8, 4, 2, 2), oracle=False, heads_config=HEADS,
            **kwargs):
  return SpecEngine(policy.config, _proposer(policy, sampler, branching, oracle, heads_config),
                    tree, sampler, eos, **kwargs)


def _run_both(policy, sampler, heads, tree, prompts, num_samples, max_new, max_batch, eos,
              oracle=False, seed=0, branching=(8, 4, 2, 2), heads_config=HEADS,
              **engine_fields):
  config = RolloutConfig(max_new_tokens=max_new, max_batch=max_batch)
  vanilla = Driver(VanillaEngine(policy.config, sampler, eos), config).generate(
      policy.params, prompts, num_samples, seed)
  proposer_params = heads
  if oracle:
    future = np.zeros((len(vanilla), max_new), np.int32)
    for i, r in enumerate(vanilla):
      future[i, :len(r.token_ids)] = r.token_ids
    proposer_params = OracleParams(heads if ADAPTIVE else None, jnp.asarray(future))
  engine = _engine(policy, tree, sampler, eos, branching, oracle, heads_config, **engine_fields)
  spec = Driver(engine, config).generate(engine.params(policy.params, proposer_params),
                                         prompts, num_samples, seed)
  return vanilla, spec


def _check(vanilla, spec, greedy):
  total = sum(len(v.token_ids) for v in vanilla)
  diverged = 0
  for v, s in zip(vanilla, spec):
    if v.token_ids == s.token_ids:
      assert v.finish_reason == s.finish_reason
      np.testing.assert_allclose(s.logprobs, v.logprobs, atol=LOGPROB_ATOL, rtol=LOGPROB_RTOL)
      continue
    first = next((i for i, (a, b) in enumerate(zip(v.token_ids, s.token_ids)) if a != b),
                 min(len(v.token_ids), len(s.token_ids)))
    diverged += len(v.token_ids) - first
    assert not greedy, f'greedy response {v.prompt_index}/{v.sample_index} diverges at {first}'
  assert diverged <= 0.001 * total, f'{diverged} of {total} tokens after a divergence'
  return sum(len(s.token_ids) for s in spec) / sum(s.steps for s in spec)


@pytest.fixture(scope='module')
def peaked_qwen(tmp_path_factory):
  directory = tmp_path_factory.mktemp('qwen')
  make_checkpoint(directory, 'qwen2_untied_gqa4', seed=3, initializer_range=0.25)
  return load_policy(directory)


def _encode(policy):
  return [policy.tokenizer.encode(t) for t in PROMPTS]


@pytest.mark.parametrize('heads_kind,capacity', [('fresh', 16), ('bad', 64)])
def test_greedy_identical_on_stories(stories_policy, heads_kind, capacity):
  vanilla, spec = _run_both(stories_policy, SamplerConfig(temperature=0.0),
                            _heads(stories_policy, heads_kind),
                            TreeConfig(capacity_tokens=capacity, max_nodes=16),
                            _encode(stories_policy), 3, 40, 8, (2,))
  _check(vanilla, spec, greedy=True)
  if ADAPTIVE:  # the group drafts were verified and accepted, not only carried along
    assert sum(float(r.stats.proposer.group.accepted) for r in spec) > 0


def test_greedy_oracle_accepts_deep_paths_through_eos_and_length(stories_policy):
  policy = stories_policy
  # 267 ('.') ends many sentences: as EOS it cuts responses inside accepted paths.
  vanilla, spec = _run_both(policy, SamplerConfig(temperature=0.0), _heads(policy, 'fresh'),
                            TreeConfig(capacity_tokens=64, max_nodes=16),
                            _encode(policy), 2, 30, 8, (267,), oracle=True,
                            branching=(2, 2, 2, 2))
  tau = _check(vanilla, spec, greedy=True)
  assert {v.finish_reason for v in vanilla} == {'eos', 'length'}
  assert tau > 3.0, f'oracle proposals should be accepted almost always (tau={tau:.2f})'


def test_budget_one_is_plain_decoding_on_random_policy(peaked_qwen):
  vanilla, spec = _run_both(peaked_qwen, SamplerConfig(temperature=0.0),
                            _heads(peaked_qwen, 'random'), TreeConfig(capacity_tokens=1),
                            [[1, 5, 9], [1, 300, 301, 302, 303, 304, 305, 306, 307]], 3, 30, 4, ())
  _check(vanilla, spec, greedy=True)
  assert all(s.steps == len(s.token_ids) for s in spec)
  # Not a one-node tree but the vanilla step itself: the same bits, not only the same tokens.
  assert [s.logprobs for s in spec] == [v.logprobs for v in vanilla]


def test_greedy_identical_on_random_policy_with_random_heads(peaked_qwen):
  vanilla, spec = _run_both(peaked_qwen, SamplerConfig(temperature=0.0),
                            _heads(peaked_qwen, 'random'),
                            TreeConfig(capacity_tokens=32, max_nodes=32),
                            [[1, 5, 9], [1, 300, 301, 302, 303, 304, 305, 306, 307], [1]], 2,
                            30, 4, (7,), oracle=True, branching=(4, 2, 2))
  _check(vanilla, spec, greedy=True)


@pytest.mark.parametrize('sampler,heads_kind,oracle', [
    (SamplerConfig(temperature=1.0), 'random', True),
    (SamplerConfig(temperature=1.0, top_k=20, top_p=0.9), 'bad', False),
    (SamplerConfig(temperature=0.7, top_p=0.8), 'fresh', False),
])
def test_sampling_identical_with_the_same_seed(stories_policy, sampler, heads_kind, oracle):
  vanilla, spec = _run_both(stories_policy, sampler, _heads(stories_policy, heads_kind),
                            TreeConfig(capacity_tokens=32, max_nodes=16),
                            _encode(stories_policy), 3, 40, 8, (2,), oracle=oracle, seed=11)
  _check(vanilla, spec, greedy=False)


# Budgets the drafter's spine fills (16 nodes at 1 row) or overflows (4 at 8 rows and 16).
@pytest.mark.parametrize('sampler,capacity,expanded', [
    (SamplerConfig(temperature=0.0), 16, ()), (SamplerConfig(temperature=1.0), 64, ()),
    (SamplerConfig(temperature=1.0), 64, (2, 2))], ids=['greedy', 'T=1', 'T=1-best-first'])
def test_sequential_drafter_identical(stories_policy, sampler, capacity, expanded):
  """The drafter alone (static) or under group drafts (group_adaptive), over half the
  vocabulary with a block whose output is noise: it proposes, it is rarely right. Its static
  tree leaves the spine below depth 1's second guess, so a depth expands two candidates; its
  best-first tree expands each row's two most probable paths per depth (parents per row)."""
  policy = stories_policy
  drafter = DrafterConfig(depth=3, hidden_multiplier=1.0, draft_vocab_size=256)
  params = init_drafter(drafter, policy.config, np.arange(0, policy.config.vocab_size, 2), 1)
  down = params.weights['down']['kernel']
  params = params.replace(weights=dict(params.weights, down={
      'kernel': jax.random.normal(jax.random.key(3), down.shape) * 0.3}))
  paths = spine_paths((4, 2, 2)) + (() if expanded else ((1, 0), (1, 1), (1, 0, 0)))
  proposer = DrafterProposer(policy.config, drafter, paths, sampler, expanded=expanded)
  if ADAPTIVE:
    proposer = GroupProposer(GROUP, base=proposer)
  engine = SpecEngine(policy.config, proposer, TreeConfig(capacity_tokens=capacity,
                                                          max_nodes=16), sampler, (2,))
  config = RolloutConfig(max_new_tokens=40, max_batch=8)
  vanilla = Driver(VanillaEngine(policy.config, sampler, (2,)), config).generate(
      policy.params, _encode(policy), 3, 11)
  spec = Driver(engine, config).generate(engine.params(policy.params, params), _encode(policy),
                                         3, 11)
  _check(vanilla, spec, greedy=sampler.greedy)


# Heads over every other token id (a draft vocabulary), alone (static) or corrected by Reflex
# under group drafts after a slow-path update over that vocabulary (group_adaptive).
@pytest.mark.parametrize('sampler,capacity', [(SamplerConfig(temperature=0.0), 16),
                                              (SamplerConfig(temperature=1.0), 64)],
                         ids=['greedy', 'T=1'])
def test_draft_vocabulary_heads_identical(stories_policy, sampler, capacity):
  policy = stories_policy
  heads_config = dataclasses.replace(
      HEADS, draft_vocab=tuple(range(0, policy.config.vocab_size, 2)))
  vanilla, spec = _run_both(policy, sampler, _heads(policy, 'random', heads_config),
                            TreeConfig(capacity_tokens=capacity, max_nodes=16), _encode(policy),
                            3, 40, 8, (2,), seed=11, branching=(4, 2, 2),
                            heads_config=heads_config)
  _check(vanilla, spec, greedy=sampler.greedy)


@pytest.fixture(scope='module')
def stories_bf16():
  """stories260K in bfloat16 with float32 decisions (the default for bf16 parameters)."""
  return load_policy(STORIES, dtype='bfloat16')


@pytest.mark.parametrize('sampler', [SamplerConfig(temperature=0.0),
                                     SamplerConfig(temperature=1.0)], ids=['greedy', 'T=1'])
def test_bfloat16_policy_identical(stories_bf16, sampler):
  # The oracle keeps most tokens inside a tree's block, where bf16 would differ most.
  vanilla, spec = _run_both(stories_bf16, sampler, _heads(stories_bf16, 'random'),
                            TreeConfig(capacity_tokens=64, max_nodes=16),
                            _encode(stories_bf16), 3, 40, 8, (2,), oracle=True, seed=11)
  _check(vanilla, spec, greedy=sampler.greedy)


# Widths the tree sizing may choose, different per bucket, and both ways the walk gets its
# logits: one projection of every node (buckets 1, 2 and 4) and one per depth (bucket 8).
SIZED_TREES = TreeConfig(capacity_tokens=32, max_nodes=16,
                         sized_widths=((1, 2), (2, 16), (4, 8), (8, 4)), one_projection=(1, 2, 4))


@pytest.mark.parametrize('sampler,dtype', [(SamplerConfig(temperature=0.0), 'float32'),
                                           (SamplerConfig(temperature=1.0), 'float32'),
                                           (SamplerConfig(temperature=1.0), 'bfloat16')],
                         ids=['greedy', 'T=1', 'T=1-bf16'])
def test_sized_trees_and_one_projection_walk_identical(stories_policy, stories_bf16, sampler,
                                                       dtype):
  policy = stories_bf16 if dtype == 'bfloat16' else stories_policy
  run = lambda tree: _run_both(policy, sampler, _heads(policy, 'random'), tree, _encode(policy),
                               3, 40, 8, (2,), oracle=True, seed=11)
  vanilla, one_projection = run(SIZED_TREES)
  _check(vanilla, one_projection, greedy=sampler.greedy)
  _, per_depth = run(dataclasses.replace(SIZED_TREES, one_projection=()))
  # Tokens equal exactly. The two walks project with different matmul shapes ([B * N, D]
  # vs [B, D] rows), so their log-probs differ in the last float32 bits, which is the
  # same shape noise this module's LOGPROB bounds hold every engine to.
  for a, b in zip(one_projection, per_depth):
    assert a.token_ids == b.token_ids
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=LOGPROB_ATOL, rtol=LOGPROB_RTOL)


# A quick probe and a price no tree pays: the gate alternates warm-up and probing trees with
# plain steps, so both kinds of step (and the switch between them) emit every response.
PROBING_GATE = dict(tree_step_costs=((8, 1e9),),
                    gate_config=GateConfig(probe_interval=3, max_probe_interval=3))


@pytest.mark.parametrize('sampler,oracle', [(SamplerConfig(temperature=0.0), True),
                                            (SamplerConfig(temperature=1.0), False)])
def test_gated_steps_identical(stories_policy, sampler, oracle):
  vanilla, spec = _run_both(stories_policy, sampler, _heads(stories_policy, 'fresh'),
                            TreeConfig(capacity_tokens=32, max_nodes=16),
                            _encode(stories_policy), 2, 30, 8, (2,), oracle=oracle, seed=3,
                            **PROBING_GATE)
  _check(vanilla, spec, greedy=sampler.temperature == 0.0)
  trees = [int(s.stats.gate.tree_steps) for s in spec]
  assert all(0 < t < s.steps for t, s in zip(trees, spec)), (trees, [s.steps for s in spec])


def test_gate_that_pays_runs_every_step_as_a_tree(stories_policy):
  vanilla, spec = _run_both(stories_policy, SamplerConfig(temperature=0.0),
                            _heads(stories_policy, 'fresh'),
                            TreeConfig(capacity_tokens=32, max_nodes=16),
                            _encode(stories_policy), 2, 20, 8, (2,), oracle=True,
                            tree_step_costs=((8, 0.5),))
  _check(vanilla, spec, greedy=True)
  assert all(int(s.stats.gate.tree_steps) == s.steps for s in spec)


def test_independent_seeds_give_the_same_token_law(stories_policy):
  """Spec rollouts (seed 1) and vanilla rollouts (seed 2): per-position chi-square."""
  policy, samples, positions = stories_policy, 256, 3
  sampler = SamplerConfig(temperature=1.0)
  prompt = [policy.tokenizer.encode('The dog')]
  config = RolloutConfig(max_new_tokens=positions, max_batch=256)
  vanilla = Driver(VanillaEngine(policy.config, sampler, ()), config).generate(
      policy.params, prompt, samples, seed=2)
  engine = _engine(policy, TreeConfig(capacity_tokens=1024, max_nodes=8), sampler, ())
  spec = Driver(engine, config).generate(engine.params(policy.params, _heads(policy, 'fresh')),
                                         prompt, samples, seed=1)
  for position in range(positions):
    a = np.bincount([r.token_ids[position] for r in vanilla], minlength=512)
    b = np.bincount([r.token_ids[position] for r in spec], minlength=512)
    seen = (a + b) > 0
    a, b = a[seen], b[seen]
    # Two-sample chi-square homogeneity test on the tokens either engine drew.
    expected_a = (a + b) * a.sum() / (a.sum() + b.sum())
    expected_b = (a + b) * b.sum() / (a.sum() + b.sum())
    stat = np.sum((a - expected_a) ** 2 / expected_a + (b - expected_b) ** 2 / expected_b)
    p_value = float(gammaincc((seen.sum() - 1) / 2, stat / 2))
    assert p_value > 1e-3, (position, stat, p_value)


def test_no_recompilation_in_steady_state(stories_policy):
  policy = stories_policy
  sampler = SamplerConfig(temperature=1.0)
  engine = _engine(policy, TreeConfig(capacity_tokens=32, max_nodes=16), sampler, (2,),
                   **PROBING_GATE)
  driver = Driver(engine, RolloutConfig(max_new_tokens=24, max_batch=8))
  params = engine.params(policy.params, _heads(policy, 'random'))
  for seed in range(3):  # visit every batch bucket (rows finish at data-dependent steps)
    driver.generate(params, _encode(policy), 3, seed=seed)
  other = [policy.tokenizer.encode(t) for t in ('A dog', 'The sun was hot', 'Tim', 'Sue ran')]
  with count_compilations() as compiled:
    driver.generate(params, other, 3, seed=5)
    assert compiled() == 0


def test_pallas_tree_attention_engine_matches_vanilla(stories_policy):
  """The engine with the Pallas kernel (interpret mode on CPU) in the verification forward."""
  policy = stories_policy
  sampler = SamplerConfig(temperature=0.0)
  config = RolloutConfig(max_new_tokens=12, max_batch=2)
  prompts = _encode(policy)[:2]
  vanilla = Driver(VanillaEngine(policy.config, sampler, (2,)), config).generate(
      policy.params, prompts, 1, 0)
  engine = _engine(policy, TreeConfig(capacity_tokens=16, max_nodes=8), sampler, (2,),
                   tree_attention='pallas')
  spec = Driver(engine, config).generate(engine.params(policy.params, _heads(policy, 'fresh')),
                                         prompts, 1, 0)
  _check(vanilla, spec, greedy=True)
