"""The GRPO training loop: rollout (vanilla or SpecRoll) -> rewards -> GRPO update.

Learner and rollout meet only through `Rollouts.generate(policy_params, head_params,
prompts, seed)`, so
the engine is a config switch and speculation changes nothing in GRPO. Everything needed to
resume bit for bit (policy, optimizer state, heads, step, data position) is an Orbax
checkpoint under workdir/checkpoints; the per-step rollout seed is derived from (seed,
step), so a resumed run draws exactly what the uninterrupted one would have.
"""
import hashlib
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from tqdm import tqdm

from specroll_jax.adapt import distill
from specroll_jax.rl import grpo
from specroll_jax.tasks import rewards
from specroll_jax.adapt import monitor as slow_path
from specroll_jax.rollout.vanilla import VanillaEngine
from specroll_jax.tasks.default_policy import ensure_default_policy
from specroll_jax.spec.factory import eos_ids, prior_acceptance, summarize, tree_config
from specroll_jax.spec.heads import HeadsConfig, load_heads, save_heads
from specroll_jax.model.policy import Policy, load_policy
from specroll_jax.adapt.reflex import ReflexConfig
from specroll_jax.rl.report import write_report
from specroll_jax.rollout.driver import Driver, RolloutConfig, pow2_at_least
from specroll_jax.rollout.sampling import SamplerConfig
from specroll_jax.adapt.monitor import MonitorState, SlowPathConfig
from specroll_jax.spec.engine import SpecEngine, SpecParams
from specroll_jax.tasks.sources import load_tasks

METRICS_FILE = 'metrics.jsonl'
# static: warm-started heads, never adapted; online: heads retrained on every batch (the
# FastGRPO-like baseline); reflex / slow: one timescale; both: SpecRoll.
ADAPTATION_MODES = ('static', 'online', 'reflex', 'slow', 'both')


class Rollouts:
  """The rollout side: an engine and its driver, fed the learner's current params."""

  def __init__(self, policy: Policy, c, heads_config: HeadsConfig | None, heads_dir: Path | None):
    r = c.rollout
    self.sampler = SamplerConfig(r.temperature, r.top_k, r.top_p)
    self.group_size = r.group_size
    self.speculative = r.engine == 'specroll'
    if self.speculative:
      tree = tree_config(policy, branching=r.branching, max_nodes=r.max_nodes,
                         capacity_tokens=r.capacity_tokens)
      reflex = (ReflexConfig(**c.adaptation.reflex)
                if c.adaptation.mode in ('reflex', 'both') else None)
      engine = SpecEngine(policy.config, heads_config, tree, self.sampler, eos_ids(policy),
                          prior_accept=prior_acceptance(heads_dir),
                          tree_attention=r.tree_attention, reflex=reflex)
    elif r.engine == 'vanilla':
      engine = VanillaEngine(policy.config, self.sampler, eos_ids(policy))
    else:
      raise ValueError(f'rollout.engine must be vanilla or specroll, got {r.engine!r}')
    self.driver = Driver(engine, RolloutConfig(r.max_new_tokens, max_batch=r.max_batch))

  def generate(self, policy_params, head_params, prompts, seed):
    params = SpecParams(policy_params, head_params) if self.speculative else policy_params
    return self.driver.generate(params, prompts, self.group_size, seed)


class HeadAdaptation:
  """The slow timescale between rollout batches: monitor + consolidation, or the
  always-online baseline. Reflex (the fast timescale) lives inside the engine."""

  def __init__(self, c, policy: Policy, heads_config: HeadsConfig):
    self.mode = c.adaptation.mode
    self.config = SlowPathConfig(**c.adaptation.slow_path)
    self.branching = tuple(c.rollout.branching)
    self.response_span = c.rollout.max_new_tokens + 1  # last prompt position + the response
    self.policy_config, self.heads_config = policy.config, heads_config

  @property
  def harvests(self) -> bool:
    return self.mode in ('online', 'slow', 'both')

  def init_state(self) -> MonitorState:
    return MonitorState.init(self.config, len(self.branching))

  def update(self, heads, monitor, policy_params, responses, pairs, prompt_lengths, seed):
    """Returns (heads, monitor, metrics) after one rollout batch; `pairs` are the GRPO
    forward's harvest over whole rows, `prompt_lengths` the rows' prompt lengths."""
    window = slow_path.window_stats(responses, self.branching)
    metrics = {'head_acceptance': window.acceptance.round(4).tolist(),
               'head_regret': window.regret.round(4).tolist()}
    if not self.harvests:
      return heads, monitor, metrics
    all_heads = np.ones(self.heads_config.num_heads, bool)
    if self.mode == 'online':
      triggered = all_heads
    else:
      monitor, triggered = slow_path.observe(self.config, monitor, window)
      metrics['triggered'] = np.flatnonzero(triggered).tolist()
      if not triggered.any():
        return heads, monitor, metrics
    mask = np.zeros_like(all_heads)
    mask[:len(triggered)] = triggered
    spans = slow_path.response_spans(pairs, jnp.asarray(prompt_lengths, jnp.int32) - 1,
                                     self.response_span)
    result = slow_path.consolidate(self.heads_config, self.policy_config, self.config, heads,
                                   policy_params, spans, mask, seed,
                                   rollback=self.mode != 'online')
    if self.mode != 'online':
      monitor = slow_path.after_update(self.config, monitor, triggered,
                                       result.kept[:len(triggered)])
      metrics['kept'] = np.flatnonzero(result.kept).tolist()
    metrics.update(head_kl_before=result.kl_before.round(4).tolist(),
                   head_kl_after=result.kl_after.round(4).tolist())
    return result.params, monitor, metrics


def resolve_policy(c) -> Path:
  if c.policy.checkpoint:
    path = Path(c.policy.checkpoint)
    if not path.is_dir():
      raise FileNotFoundError(f'config policy.checkpoint: {path} does not exist')
    return path
  return ensure_default_policy(c.policy.cache_dir)


def warm_start_heads(policy: Policy, c, tasks, workdir: Path) -> Path:
  """Heads self-distilled on the initial policy's own answers to task prompts (cached)."""
  directory = workdir / 'heads'
  if not (directory / 'heads.safetensors').exists():
    h = c.heads
    heads_config = HeadsConfig(h.num_heads)
    prompts = [policy.tokenizer.encode(t.prompt) for t in tasks[:h.num_sequences + h.held_out]]
    result = distill.warm_start(
        policy, heads_config, distill.DistillConfig(steps=h.steps), prompts,
        num_sequences=h.num_sequences, held_out=h.held_out,
        max_new_tokens=c.rollout.max_new_tokens, temperature=c.rollout.temperature,
        seed=c.seed)
    save_heads(directory, heads_config, result.params,
               {'steps': h.steps, 'final_loss': result.loss,
                'rank_hit_rate': result.rank_hit_rate_after.tolist()})
  return directory


def grpo_config(c, harvest_top_k: int) -> grpo.GRPOConfig:
  g = c.grpo
  return grpo.GRPOConfig(
      group_size=c.rollout.group_size, clip_epsilon_low=g.clip_epsilon_low,
      clip_epsilon_high=g.clip_epsilon_high, kl_coef=g.kl_coef,
      loss_aggregation=g.loss_aggregation, temperature=c.rollout.temperature or 1.0,
      learning_rate=g.learning_rate, weight_decay=g.weight_decay,
      max_grad_norm=g.max_grad_norm, micro_batch_size=g.micro_batch_size,
      learner_old_logprobs=g.learner_old_logprobs, harvest_top_k=harvest_top_k)


def rollout_digest(responses) -> str:
  """A short hash of every emitted token: equal digests mean identical rollouts."""
  h = hashlib.sha256()
  for r in responses:
    h.update(np.asarray(r.token_ids, np.int32).tobytes() + b'|')
  return h.hexdigest()[:16]


def drift_kl(model_config, initial_params, batch: grpo.RolloutBatch, temperature: float) -> float:
  """KL(pi_current || pi_initial) estimated on the rollout's own tokens (sampled from the
  current policy): the mean of log pi_current - log pi_initial over response tokens."""
  initial = grpo.token_logprobs(model_config, initial_params, batch.tokens, temperature)
  mask = np.asarray(batch.response_mask)
  return float(np.sum(np.where(mask, np.asarray(batch.old_logprobs) - np.asarray(initial), 0.0))
               / max(mask.sum(), 1))


def _truncate_metrics(path: Path, last_step: int) -> None:
  """Drops metric lines after the restored step (written before an interruption)."""
  if path.exists():
    keep = [line for line in path.read_text().splitlines()
            if line and json.loads(line)['step'] <= last_step]
    path.write_text(''.join(line + '\n' for line in keep))


def train(c, workdir) -> dict:
  """Runs (or resumes) GRPO per config `c` in `workdir`; returns the last step's metrics."""
  workdir = Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  policy = load_policy(resolve_policy(c), dtype=c.policy.dtype)
  tasks = load_tasks(c.task.source, count=c.task.count, seed=c.seed,
                     data_dir=c.task.data_dir or None, split=c.task.split or None)
  if not tasks:
    raise ValueError(f'config task.source={c.task.source!r} yielded no prompts')
  if c.adaptation.mode not in ADAPTATION_MODES:
    raise ValueError(f'config adaptation.mode must be one of {ADAPTATION_MODES}, '
                     f'got {c.adaptation.mode!r}')
  speculative = c.rollout.engine == 'specroll'
  heads_dir = heads_config = adaptation = None
  if speculative:
    heads_dir = warm_start_heads(policy, c, tasks, workdir)
    heads_config, heads = load_heads(heads_dir, policy.config)
    adaptation = HeadAdaptation(c, policy, heads_config)
  rollouts = Rollouts(policy, c, heads_config, heads_dir)
  config = grpo_config(c, c.adaptation.harvest_top_k if adaptation and adaptation.harvests else 0)
  optimizer = grpo.make_optimizer(config)
  state = {'policy': policy.params, 'opt_state': optimizer.init(policy.params), 'step': 0,
           'data_position': 0}
  if speculative:
    # Adapted heads and the slow path's monitor resume with everything else.
    state.update(heads=heads, monitor=adaptation.init_state())
  initial_policy = policy.params
  reference = policy.params if config.kl_coef > 0 else None
  manager = ocp.CheckpointManager(
      (workdir / 'checkpoints').resolve(),
      options=ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=1))
  if manager.latest_step() is not None:
    state = manager.restore(manager.latest_step(), args=ocp.args.StandardRestore(state))
    print(f'resumed from step {int(state["step"])}', file=sys.stderr)
  metrics_path = workdir / METRICS_FILE
  _truncate_metrics(metrics_path, int(state['step']))
  width = pow2_at_least(max(len(policy.tokenizer.encode(t.prompt)) for t in tasks)
                        + c.rollout.max_new_tokens, 16)
  per_step = c.rollout.prompts_per_step
  last = {}
  with tqdm(total=c.steps, initial=int(state['step']), desc='grpo', file=sys.stderr) as bar:
    while int(state['step']) < c.steps:
      step, position = int(state['step']), int(state['data_position'])
      batch_tasks = [tasks[(position + i) % len(tasks)] for i in range(per_step)]
      prompts = [policy.tokenizer.encode(t.prompt) for t in batch_tasks]
      times = {}
      start = time.perf_counter()
      responses = rollouts.generate(state['policy'], state.get('heads'), prompts,
                                    seed=c.seed * 1_000_003 + step)
      times['rollout'] = time.perf_counter() - start
      start = time.perf_counter()
      texts = [policy.tokenizer.decode(r.token_ids, skip_special_tokens=True) for r in responses]
      scores = np.array([rewards.score(text, batch_tasks[r.prompt_index].answer,
                                       batch_tasks[r.prompt_index].kind)
                         for text, r in zip(texts, responses)], np.float32)
      times['reward'] = time.perf_counter() - start
      start = time.perf_counter()
      batch = grpo.batch_from_responses(prompts, responses,
                                        grpo.group_advantages(scores, config.group_size,
                                                              config.advantage_eps), width)
      if reference is not None:
        batch = batch.replace(ref_logprobs=grpo.token_logprobs(
            policy.config, reference, batch.tokens, config.temperature))
      jax.block_until_ready(batch)
      times['logprobs'] = time.perf_counter() - start
      start = time.perf_counter()
      params, opt_state, update, pairs = grpo.train_step(policy.config, config, state['policy'],
                                                         state['opt_state'], batch)
      jax.block_until_ready(params)
      times['update'] = time.perf_counter() - start
      start = time.perf_counter()
      adapted = {}
      if adaptation is not None:
        # Pairs come from the pre-update policy's forward, so they are scored with it.
        heads, monitor, adapted = adaptation.update(state['heads'], state['monitor'],
                                                    state['policy'], responses, pairs,
                                                    [len(prompts[r.prompt_index])
                                                     for r in responses],
                                                    seed=c.seed * 1_000_003 + step)
        jax.block_until_ready(heads)
      times['head_update'] = time.perf_counter() - start
      if c.metrics.drift_kl:
        adapted['drift_kl'] = drift_kl(policy.config, initial_policy, batch, config.temperature)
      state = {**state, 'policy': params, 'opt_state': opt_state, 'step': step + 1,
               'data_position': (position + per_step) % len(tasks)}
      if adaptation is not None:
        state.update(heads=heads, monitor=monitor)
      summary = summarize(responses)
      last = {'step': step + 1, 'reward': float(scores.mean()),
              'accuracy': float((scores == 1.0).mean()),
              'response_length': summary['tokens'] / len(responses),
              'tau': summary['tau'], 'acceptance_by_depth': summary.get('acceptance_by_depth'),
              'rollout_digest': rollout_digest(responses),
              **{k: v for k, v in summary.items() if k.startswith('reflex_')}, **adapted,
              **{k: float(v) for k, v in update.items()},
              **{f'time_{k}': v for k, v in times.items()}}
      with metrics_path.open('a') as f:
        f.write(json.dumps(last) + '\n')
      if (step + 1) % c.checkpoint_every == 0 or step + 1 == c.steps:
        manager.save(step + 1, args=ocp.args.StandardSave(state))
      bar.update(1)
      bar.set_postfix(reward=f"{last['reward']:.2f}", tau=f"{last['tau']:.2f}")
  manager.wait_until_finished()
  write_report(workdir)
  return last
