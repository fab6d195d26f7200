"""The rollout benchmarks' workloads, shared by bench_rollout and profile_step: prompts,
warm-started heads and the engines, all from a bench config (configs/bench_w2.py, bench_w3.py)."""
import dataclasses
import sys

import jax.numpy as jnp
import numpy as np

from specroll_jax.adapt.distill import DistillConfig, WarmStart, ensure_heads
from specroll_jax.adapt.drafter_training import DrafterTraining, warm_start_drafter
from specroll_jax.rollout.driver import Driver, RolloutConfig
from specroll_jax.rollout.sampling import SamplerConfig
from specroll_jax.rl.sections import build
from specroll_jax.speculative.drafter import DrafterConfig, has_drafter, load_drafter
from specroll_jax.speculative.drafter_proposer import DrafterProposer, spine_paths
from specroll_jax.speculative.factory import build_engine, head_proposer
from specroll_jax.speculative.group_proposer import GroupDraftConfig, GroupProposer
from specroll_jax.speculative.head_proposer import HeadDraftConfig
from specroll_jax.speculative.heads import HeadsConfig
from specroll_jax.speculative.oracle_proposer import OracleParams, OracleProposer
from specroll_jax.speculative.step_cost import GatePrices, with_measured_step_costs
from specroll_jax.tasks.sources import load_tasks


def benchmark_prompts(policy, c):
  """The prompts every engine samples: story openings (W2) or GSM8K test questions (W3)."""
  if c.prompts == 'story_openings':
    return story_openings(policy, c.num_prompts, c.opening_tokens, c.opening_seed)
  tasks = load_tasks(c.prompts, count=c.num_prompts, seed=c.seed, data_dir=c.data_dir,
                     split='test', chat=c.chat_template)[:c.num_prompts]
  return [policy.prompt_ids(t.prompt, c.chat_template) for t in tasks]


def head_training_prompts(policy, c, section=None):
  """What the heads (or the drafter: section=c.drafter) are warm-started from: BOS
  (stories) or the *train* split's questions."""
  s = c.heads if section is None else section
  if s.prompts == 'bos':
    return [[policy.config.bos_token_id]]
  tasks = load_tasks(s.prompts, count=s.num_sequences, seed=s.seed, data_dir=c.data_dir,
                     split='train', chat=c.chat_template)
  return [policy.prompt_ids(t.prompt, c.chat_template)
          for t in tasks[:s.num_sequences + s.held_out]]


def story_openings(policy, count, length, seed):
  """The first `length` tokens of `count` stories the policy writes from BOS."""
  engine = build_engine(policy, 'vanilla', SamplerConfig(temperature=1.0))
  stories = Driver(engine, RolloutConfig(length, max_batch=64)).generate(
      policy.params, [[policy.config.bos_token_id]], count, seed)
  return [[policy.config.bos_token_id] + s.token_ids for s in stories]


def warm_started_heads(policy, c):
  """The heads in c.heads_dir, self-distilled on the policy's own stories when missing."""
  h = c.heads
  plan = WarmStart(num_sequences=h.num_sequences, held_out=h.held_out,
                   max_new_tokens=h.max_new_tokens, temperature=c.temperature, seed=h.seed)
  distill = DistillConfig(steps=h.steps, batch_size=h.batch_size,
                          draft_vocab_size=h.draft_vocab_size)
  return ensure_heads(policy, HeadsConfig(h.num_heads), distill, head_training_prompts(policy, c),
                      plan, c.heads_dir, c.checkpoint)


@dataclasses.dataclass(frozen=True)
class Drafts:
  """What a benchmark's SpecRoll engine drafts with: the warm-started horizon heads, or
  (c.drafts = 'drafter') the sequential drafter; `config` and `params` are that proposer's."""
  kind: str      # 'heads' | 'drafter'
  config: object  # HeadsConfig | DrafterConfig
  params: object  # the proposer's parameters

  def proposer(self, policy, c, sampler):
    if self.kind == 'drafter':
      return DrafterProposer(policy.config, self.config, spine_paths(c.drafter_branching),
                             sampler)
    return head_proposer(policy, self.config, c.heads_dir, sampler,
                         HeadDraftConfig(tuple(c.branching)))


def warm_started_drafts(policy, c) -> Drafts:
  """c.drafts' proposer ('heads' when the config has no such field), warm-started if missing."""
  kind = c.get('drafts', 'heads')
  if kind not in ('heads', 'drafter'):
    raise ValueError(f"config drafts must be 'heads' or 'drafter', got {kind!r}")
  loaded = warm_started_drafter(policy, c) if kind == 'drafter' else warm_started_heads(policy, c)
  return Drafts(kind, *loaded)


def warm_started_drafter(policy, c):
  """The sequential drafter in c.drafter_dir, self-distilled (c.drafter) when missing."""
  d = c.drafter
  if not has_drafter(c.drafter_dir):
    print(f'warm-starting a drafter into {c.drafter_dir}', file=sys.stderr)
    plan = WarmStart(num_sequences=d.num_sequences, held_out=d.held_out,
                     max_new_tokens=d.max_new_tokens, temperature=c.temperature, seed=d.seed)
    warm_start_drafter(policy, drafter_config(d), DrafterTraining(
        batch_size=d.batch_size, steps=d.steps, learning_rate=d.learning_rate),
        head_training_prompts(policy, c, d), plan, c.drafter_dir, c.checkpoint)
  return load_drafter(c.drafter_dir, policy.config)


def drafter_config(section) -> DrafterConfig:
  return DrafterConfig(depth=section.depth, hidden_multiplier=section.hidden_multiplier,
                       draft_vocab_size=section.draft_vocab_size)


def sweep_slice(prompts, samples, responses):
  """`responses` rows of the GRPO-shaped batch: whole groups first, then one partial group."""
  per_prompt = min(samples, responses)
  return prompts[:max(1, responses // per_prompt)], per_prompt


ENGINE_NAMES = ('vanilla', 'specroll', 'oracle', 'group', 'both')


def workload_engines(policy, drafts: Drafts, c, tree, sampler,
                     names=('vanilla', 'specroll', 'oracle')) -> dict:
  """The engines `names` of ENGINE_NAMES, with the same trees and budget: 'vanilla';
  'specroll' (`drafts`: the warm-started heads or drafter); 'oracle' (the vanilla rollout's
  true future as a chain as deep as those drafts' trees, alone: the ceiling of the tree,
  paying for no proposer); 'group' (group drafts alone, c.group); 'both' (group drafts
  merged with `drafts`)."""
  base_proposer = drafts.proposer(policy, c, sampler)
  group_drafts = (build(GroupDraftConfig, c.group, 'group')
                  if {'group', 'both'} & set(names) else None)
  speculative = lambda proposer: build_engine(policy, 'specroll', sampler, proposer=proposer,
                                              tree=tree)
  makers = {
      'vanilla': lambda: build_engine(policy, 'vanilla', sampler),
      'specroll': lambda: speculative(base_proposer),
      'oracle': lambda: speculative(OracleProposer(base_proposer.depth)),
      'group': lambda: speculative(GroupProposer(group_drafts)),
      'both': lambda: speculative(GroupProposer(group_drafts, base=base_proposer))}
  unknown = [n for n in names if n not in makers]
  if unknown:
    raise ValueError(f'unknown engines {unknown} (choose from {", ".join(ENGINE_NAMES)})')
  return {name: makers[name]() for name in names}


def oracle_engine_params(oracle_engine, policy, reference, max_new_tokens, base_params=None):
  """The oracle's parameters: the `reference` responses' tokens and its base proposer's
  parameters (`base_params`, None for a chain alone)."""
  oracle_tokens = np.zeros((len(reference), max_new_tokens), np.int32)
  for i, r in enumerate(reference):
    oracle_tokens[i, :len(r.token_ids)] = r.token_ids
  return oracle_engine.params(policy.params, OracleParams(base_params, jnp.asarray(oracle_tokens)))


def gated_engines(engines, params, rollout, prompts, samples, prices: dict,
                  size_widths: bool = False) -> dict:
  """`engines` with each speculative engine's gate priced (speculative/step_cost.py), and with
  `size_widths` its trees sized there too: on this workload the first time an engine name is
  seen, then from `prices` (name -> GatePrices), so a sweep prices once, on its largest
  batch, and every smaller run reuses those buckets."""
  gated = {}
  for name, engine in engines.items():
    if name == 'vanilla':
      gated[name] = engine
      continue
    if name not in prices:
      prices[name] = GatePrices.of(with_measured_step_costs(
          engine, rollout, params[name], prompts, samples, size_widths=size_widths))
    gated[name] = prices[name].applied_to(engine)
  return gated
