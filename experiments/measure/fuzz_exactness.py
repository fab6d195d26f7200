"""Fuzzed exactness: the speculative engine against vanilla on random cases.

  python -m experiments.measure.fuzz_exactness --cases=200 --out_dir=results/fuzz_exactness

A case is a random tiny policy (vocabulary, width, depth, attention heads, tied or not, how
peaked its next-token distributions are), random draft heads (fresh, random or
deliberately bad, 1-4 of them with random branching), a proposer (static heads, Reflex with
its gate forced open, group drafts over Reflex, the oracle, or a drafter alone or under group
drafts: the sequential one, which may fuse random decoder layers' features with h_t, or the
context-attending one; over half the vocabulary, as fresh, random or bad as the heads, with a
static tree or one grown best-first per row), a tree budget, a batch
(prompts of random lengths and ids, samples per prompt, the largest batch bucket), an EOS
id or none, a response length and a sampler (greedy, or temperature / top-k / top-p).
Greedy cases must be token-identical. A sampled response may differ only where a float
near-tie explains it: the contract's draw margin at its first differing token, from a
third forward, is below `audit.NEAR_TIE_MARGIN`; anything else is a contract break. The
cases come from one hypothesis strategy (experiments/lib/fuzz_cases.py), which
`tests/speculative/test_fuzz_exactness.py` also runs (a few cases per suite run); this
script runs many and commits what it saw.
"""
import dataclasses
import time

import hypothesis
import jax
import numpy as np
from absl import app, flags

from experiments.lib.fuzz_cases import (MAX_PROMPT, PROPOSERS, Case, cases, proposer_of,
                                        random_policy)
from experiments.lib.results import Result, Table, command_line, write
from experiments.lib.workloads import oracle_engine_params
from specroll_jax.rl.audit import NEAR_TIE_MARGIN, divergence_margin
from specroll_jax.rollout.driver import Driver, RolloutConfig
from specroll_jax.speculative.factory import build_engine
from specroll_jax.speculative.tree import TreeConfig


@dataclasses.dataclass(frozen=True)
class Outcome:
  responses: int
  identical: int
  near_ties: int
  breaks: int
  tokens: int
  tau: float
  seconds: float


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
  proposer, heads = proposer_of(case, config)
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
