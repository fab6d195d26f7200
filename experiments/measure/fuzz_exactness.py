"""Fuzzed exactness: the speculative engine against vanilla on random cases.

  python -m experiments.measure.fuzz_exactness --cases=200 --out_dir=results/fuzz_exactness

A case is a random tiny policy (vocabulary, width, depth, attention heads, tied or not, how
peaked its next-token distributions are), random draft heads (fresh, random or
deliberately bad, 1-4 of them with random branching), a proposer (static heads, Reflex with
its gate forced open, group drafts over Reflex, the oracle, or the sequential drafter alone
or under group drafts, over half the vocabulary, as fresh, random or bad as the heads), a
tree budget, a batch
(prompts of random lengths and ids, samples per prompt, the largest batch bucket), an EOS
id or none, a response length and a sampler (greedy, or temperature / top-k / top-p).
Greedy cases must be token-identical. A sampled response may differ only where a float
near-tie explains it: the contract's draw margin at its first differing token, from a
third forward, is below `audit.NEAR_TIE_MARGIN`; anything else is a contract break. The
cases come from one hypothesis strategy, which `tests/speculative/test_fuzz_exactness.py`
also runs (a few cases per suite run); this script runs many and commits what it saw.
"""
import dataclasses
import time

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from hypothesis import strategies as st

from specroll_jax.adapt.reflex import ReflexConfig
from specroll_jax.adapt.reflex_proposer import ReflexProposer
from specroll_jax.model.config import ModelConfig, RopeConfig
from specroll_jax.model.policy import Policy
from specroll_jax.model.transformer import Transformer, causal_mask
from experiments.lib.workloads import oracle_engine_params
from specroll_jax.rl.audit import NEAR_TIE_MARGIN, divergence_margin
from specroll_jax.rollout.driver import Driver, RolloutConfig
from specroll_jax.rollout.sampling import SamplerConfig
from specroll_jax.speculative.drafter import DrafterConfig, DrafterParams, init_drafter
from specroll_jax.speculative.drafter_proposer import DrafterProposer, spine_paths
from specroll_jax.speculative.factory import build_engine
from specroll_jax.speculative.group_proposer import GroupDraftConfig, GroupProposer
from specroll_jax.speculative.head_proposer import HeadDraftConfig, HeadProposer
from specroll_jax.speculative.heads import HeadsConfig, init_heads
from specroll_jax.speculative.oracle_proposer import OracleProposer
from specroll_jax.speculative.tree import TreeConfig
from experiments.lib.results import Result, Table, command_line, write

PROPOSERS = ('heads', 'reflex', 'group', 'oracle', 'drafter', 'drafter_group')
MAX_PROMPT, MAX_NEW = 12, 24
# The gate open from the first feedback, with large corrections: proposals really move.
OPEN_REFLEX = ReflexConfig(gate_threshold=-1.0, step_size=1.0, max_correction=1.0)
# Short matches and chains, so these small runs find group drafts.
GROUP = GroupDraftConfig(chains=2, chain_depth=4, min_match=1, max_match=8, matches=8)


@dataclasses.dataclass(frozen=True)
class Case:
  vocab_size: int
  hidden_size: int
  num_layers: int
  attention: tuple      # (query heads, key/value heads)
  tied: bool
  peak: float           # scale of the final norm: larger = more peaked next-token laws
  model_seed: int
  heads_kind: str       # fresh | random | bad
  branching: tuple      # candidates per draft head (its length = the number of heads)
  proposer: str         # one of PROPOSERS
  capacity_tokens: int
  max_nodes: int
  prompts: tuple        # tuples of token ids
  num_samples: int
  max_batch: int
  max_new_tokens: int
  eos: int              # -1 = no EOS
  temperature: float    # 0 = greedy
  top_k: int
  top_p: float
  seed: int

  @property
  def sampler(self) -> SamplerConfig:
    return SamplerConfig(self.temperature, self.top_k, self.top_p)


@st.composite
def cases(draw) -> Case:
  """The hypothesis strategy of fuzz cases."""
  vocab = draw(st.sampled_from((64, 256, 512)))
  prompts = draw(st.lists(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=MAX_PROMPT)
                          .map(tuple), min_size=1, max_size=4).map(tuple))
  greedy = draw(st.booleans())
  return Case(
      vocab_size=vocab, hidden_size=draw(st.sampled_from((32, 64))),
      num_layers=draw(st.integers(1, 2)),
      attention=draw(st.sampled_from(((4, 4), (4, 2), (4, 1), (2, 2)))),
      tied=draw(st.booleans()), peak=draw(st.sampled_from((1.0, 3.0, 8.0))),
      model_seed=draw(st.integers(0, 2**16)),
      heads_kind=draw(st.sampled_from(('fresh', 'random', 'bad'))),
      branching=tuple(draw(st.lists(st.sampled_from((1, 2, 4, 8)), min_size=1, max_size=4))),
      proposer=draw(st.sampled_from(PROPOSERS)),
      capacity_tokens=draw(st.sampled_from((1, 4, 16, 64))),
      max_nodes=draw(st.sampled_from((4, 16, 32))),
      prompts=prompts, num_samples=draw(st.integers(1, 3)),
      max_batch=draw(st.sampled_from((1, 2, 4, 8))),
      max_new_tokens=draw(st.integers(1, MAX_NEW)),
      eos=draw(st.one_of(st.just(-1), st.integers(0, 7))),
      temperature=0.0 if greedy else draw(st.sampled_from((0.7, 1.0))),
      top_k=0 if greedy else draw(st.sampled_from((0, 5, 20))),
      top_p=1.0 if greedy else draw(st.sampled_from((1.0, 0.9))),
      seed=draw(st.integers(0, 2**16)))


def _forward_and_project(model: Transformer, tokens, positions, mask):
  """Initialises every parameter, the untied output projection included."""
  hidden, _ = model(tokens, positions, mask)
  return model.project(hidden)


def random_policy(case: Case) -> Policy:
  """A random Llama (no tokenizer); the final norm's scale sets how peaked it is."""
  heads, kv_heads = case.attention
  config = ModelConfig(
      architecture='LlamaForCausalLM', vocab_size=case.vocab_size,
      hidden_size=case.hidden_size, intermediate_size=2 * case.hidden_size,
      num_layers=case.num_layers, num_heads=heads, num_kv_heads=kv_heads,
      head_dim=case.hidden_size // heads, max_position_embeddings=128, rms_norm_eps=1e-5,
      rope=RopeConfig(), tie_word_embeddings=case.tied, qkv_bias=False, o_bias=False,
      bos_token_id=None, eos_token_id=None)
  tokens = jnp.zeros((1, 2), jnp.int32)
  params = Transformer(config).init(jax.random.key(case.model_seed), tokens,
                                    jnp.arange(2)[None], causal_mask(jnp.ones((1, 2), bool)),
                                    method=_forward_and_project)['params']
  return Policy(config=config, tokenizer=None,
                params=dict(params, norm={'weight': params['norm']['weight'] * case.peak}))


def _heads(case: Case, config: ModelConfig, heads_config: HeadsConfig):
  params = init_heads(heads_config, config, seed=case.model_seed + 1)
  if case.heads_kind == 'fresh':
    return params
  scale = {'random': 0.3, 'bad': 30.0}[case.heads_kind]
  return dict(params, w2=jax.random.normal(jax.random.key(case.seed), params['w2'].shape) * scale)


@dataclasses.dataclass(frozen=True)
class Outcome:
  responses: int
  identical: int
  near_ties: int
  breaks: int
  tokens: int
  tau: float
  seconds: float


def _drafter_params(case: Case, config: ModelConfig, drafter: DrafterConfig) -> DrafterParams:
  """Over a random half of the vocabulary; fresh, or its block's output scaled by noise."""
  vocab = np.sort(np.random.default_rng(case.seed).permutation(config.vocab_size)[
      :drafter.vocab_size(config)])
  params = init_drafter(drafter, config, vocab, seed=case.model_seed + 1)
  if case.heads_kind == 'fresh':
    return params
  scale = {'random': 0.3, 'bad': 30.0}[case.heads_kind]
  down = params.weights['down']['kernel']
  noise = jax.random.normal(jax.random.key(case.seed), down.shape) * scale
  return params.replace(weights=dict(params.weights, down={'kernel': noise}))


def _proposer(case: Case, config: ModelConfig):
  """(the case's proposer, its parameters without the oracle's future)."""
  if case.proposer.startswith('drafter'):
    drafter = DrafterConfig(depth=len(case.branching), hidden_multiplier=1.0,
                            draft_vocab_size=config.vocab_size // 2)
    paths = spine_paths(case.branching)
    if len(case.branching) > 1 and case.branching[0] > 1:
      paths += ((1, 0),)  # off the spine: depth 1 expands two candidates
    proposer = DrafterProposer(config, drafter, paths, case.sampler)
    if case.proposer == 'drafter_group':
      proposer = GroupProposer(GROUP, base=proposer)
    return proposer, _drafter_params(case, config, drafter)
  heads_config = HeadsConfig(num_heads=len(case.branching))
  proposer = HeadProposer(config, heads_config, HeadDraftConfig(case.branching), case.sampler)
  if case.proposer in ('reflex', 'group'):
    proposer = ReflexProposer(proposer, OPEN_REFLEX)
  if case.proposer == 'group':
    proposer = GroupProposer(GROUP, base=proposer)
  if case.proposer == 'oracle':
    proposer = OracleProposer(proposer.depth, base=proposer)
  return proposer, _heads(case, config, heads_config)


def run_case(case: Case) -> Outcome:
  """Vanilla and SpecRoll on one case, and how their responses compare."""
  start = time.perf_counter()
  policy = random_policy(case)
  config = policy.config
  sampler, eos = case.sampler, () if case.eos < 0 else (case.eos,)
  rollout = RolloutConfig(max_new_tokens=case.max_new_tokens, max_batch=case.max_batch)
  prompts = [list(p) for p in case.prompts]
  vanilla = Driver(build_engine(policy, 'vanilla', sampler, eos_ids=eos), rollout).generate(
      policy.params, prompts, case.num_samples, case.seed)
  proposer, heads = _proposer(case, config)
  engine = build_engine(policy, 'specroll', sampler, proposer=proposer,
                        tree=TreeConfig(max_nodes=case.max_nodes,
                                        capacity_tokens=case.capacity_tokens), eos_ids=eos)
  params = (oracle_engine_params(engine, policy, vanilla, case.max_new_tokens, heads)
            if case.proposer == 'oracle' else engine.params(policy.params, heads))
  spec = Driver(engine, rollout).generate(params, prompts, case.num_samples, case.seed)
  width = MAX_PROMPT + case.max_new_tokens
  margins = [divergence_margin(policy.config, policy.params, sampler, width, prompts, s, v,
                               case.seed, case.num_samples)
             for s, v in zip(spec, vanilla) if list(s.token_ids) != list(v.token_ids)]
  # Greedy has no near-tie allowance: every difference is a break.
  near_ties = sum(m < NEAR_TIE_MARGIN for m in margins) if not sampler.greedy else 0
  tokens = sum(len(s.token_ids) for s in spec)
  return Outcome(responses=len(spec), identical=len(spec) - len(margins), near_ties=near_ties,
                 breaks=len(margins) - near_ties, tokens=tokens,
                 tau=tokens / max(1, sum(s.steps for s in spec)),
                 seconds=time.perf_counter() - start)


_CASES = flags.DEFINE_integer('cases', 200, 'Fuzz cases to run.')
_SEED = flags.DEFINE_integer('seed', 0, "Hypothesis's seed for the cases.")
_OUT = flags.DEFINE_string('out_dir', 'results/fuzz_exactness', 'Where results go.')


def main(argv):
  del argv
  records = []

  @hypothesis.seed(_SEED.value)
  @hypothesis.settings(max_examples=_CASES.value, deadline=None, database=None,
                       phases=(hypothesis.Phase.generate, hypothesis.Phase.shrink),
                       suppress_health_check=list(hypothesis.HealthCheck))
  @hypothesis.given(cases())
  def fuzz(case):
    outcome = run_case(case)
    records.append({'case': dataclasses.asdict(case), 'outcome': dataclasses.asdict(outcome)})
    print(f'case {len(records)}: {outcome}', flush=True)
    jax.clear_caches()  # each case compiles its own programs (see WORKSPACE_NOTES: map limit)
    assert outcome.breaks == 0, f'contract break: {case} -> {outcome}'

  started = time.time()
  failure = None
  try:
    fuzz()
  except AssertionError as e:
    failure = str(e)
  greedy = [r for r in records if r['case']['temperature'] == 0.0]
  sampled = [r for r in records if r['case']['temperature'] > 0.0]
  count = lambda rows, key: sum(r['outcome'][key] for r in rows)
  summary = {
      'cases': len(records), 'greedy_cases': len(greedy), 'sampled_cases': len(sampled),
      'greedy_responses': count(greedy, 'responses'),
      'greedy_mismatches': count(greedy, 'responses') - count(greedy, 'identical'),
      'sampled_responses': count(sampled, 'responses'),
      'sampled_identical': count(sampled, 'identical'),
      'sampled_near_ties': count(sampled, 'near_ties'),
      'contract_breaks': count(records, 'breaks'),
      'tokens': count(records, 'tokens'),
      'cases_by_proposer': {p: sum(r['case']['proposer'] == p for r in records)
                            for p in PROPOSERS},
      'mean_tau_by_proposer': {
          p: float(np.mean([r['outcome']['tau'] for r in records if r['case']['proposer'] == p]))
          for p in PROPOSERS if any(r['case']['proposer'] == p for r in records)},
      'failure': failure, 'wall_seconds': time.time() - started}
  write(Result('Fuzzed exactness', command_line('experiments.measure.fuzz_exactness'),
                {'summary': summary, 'cases': records},
                body=[Table(['measure', 'value'], list(summary.items()), align='lr')]), _OUT.value)
  if failure:
    raise SystemExit(f'fuzzing found a contract break: {failure}')


if __name__ == '__main__':
  app.run(main)
