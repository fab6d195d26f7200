"""The GRPO training loop: rollout (vanilla or SpecRoll) -> rewards -> GRPO update.

Learner and rollout meet only through `Rollouts.generate(policy_params, head_params,
prompts, seed)`, so the engine is a config switch and speculation changes nothing in GRPO.
Everything needed to resume bit for bit (`TrainState`: policy, optimizer state, heads and
the slow path's monitor, step, data position) is an Orbax checkpoint under
workdir/checkpoints; the per-step rollout seed is `step_seed(c, step)`, so a resumed run
draws exactly what the uninterrupted one would have.
"""
import dataclasses
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from flax import struct
from jax.experimental import multihost_utils
from tqdm import tqdm

from specroll_jax.adapt import consolidation, monitor
from specroll_jax.adapt.consolidation import ConsolidationConfig
from specroll_jax.adapt.distill import DistillConfig, WarmStart, ensure_heads
from specroll_jax.adapt.monitor import MonitorConfig, MonitorState
from specroll_jax.adapt.reflex import ReflexConfig
from specroll_jax.adapt.reflex_proposer import ReflexProposer
from specroll_jax.model.mesh import (AXES, ROWS, MeshConfig, axis_size, head_sharding, make_mesh,
                                     optimizer_sharding, param_sharding, put_rows,
                                     shard_params, to_host)
from specroll_jax.model.policy import Policy, load_policy
from specroll_jax.rl import distributed, grpo, lora, memory
from specroll_jax.rl.audit import Audit, AuditConfig
from specroll_jax.rl.report import write_report
from specroll_jax.rl.resources import process_memory
from specroll_jax.rl.sections import build
from specroll_jax.rollout.compilation import compilations_so_far
from specroll_jax.rollout.driver import Driver, RolloutConfig
from specroll_jax.rollout.sampling import SamplerConfig
from specroll_jax.spec.factory import (ENGINES, head_proposer, make_engine, parse_proposers,
                                       tree_config, with_group_drafts)
from specroll_jax.spec.gate import GateConfig
from specroll_jax.spec.group_proposer import GroupDraftConfig
from specroll_jax.spec.head_proposer import HeadDraftConfig
from specroll_jax.spec.heads import HeadsConfig
from specroll_jax.spec.step_cost import with_measured_step_costs
from specroll_jax.tasks import rewards
from specroll_jax.tasks.default_policy import ensure_default_policy
from specroll_jax.tasks.sources import load_tasks

METRICS_FILE = 'metrics.jsonl'
STEP_COSTS_FILE = 'step_costs.json'  # the speculation gate's prices, measured on the first batch
# static: warm-started heads, never adapted; online: heads retrained on every batch (the
# FastGRPO-like baseline); reflex / slow: one timescale; both: SpecRoll.
ADAPTATION_MODES = ('static', 'online', 'reflex', 'slow', 'both')


@struct.dataclass
class HeadsState:
  params: dict           # the horizon heads, as the slow path has adapted them
  opt_state: Any         # their optimizer state (consolidation.persistent_optimizer)
  monitor: MonitorState  # the slow path's monitor


@struct.dataclass
class TrainState:
  """Everything a run resumes from (one Orbax checkpoint per saved step)."""
  policy: dict               # with LoRA, the frozen base
  opt_state: Any             # of the policy, or of the adapters
  step: int
  data_position: int         # index of the next task in the (cycled) task list
  heads: HeadsState | None   # None when rollouts are vanilla
  adapters: dict | None = None  # LoRA adapters (grpo.lora_rank > 0)


def check_config(c) -> None:
  """Every section builds its dataclass and names are valid, before anything is loaded."""
  if c.rollout.engine not in ENGINES:
    raise ValueError(f'config rollout.engine must be one of {ENGINES}, got {c.rollout.engine!r}')
  if c.adaptation.mode not in ADAPTATION_MODES:
    raise ValueError(f'config adaptation.mode must be one of {ADAPTATION_MODES}, '
                     f'got {c.adaptation.mode!r}')
  build(ReflexConfig, c.adaptation.reflex, 'adaptation.reflex')
  build(MonitorConfig, c.adaptation.monitor, 'adaptation.monitor')
  build(ConsolidationConfig, c.adaptation.consolidation, 'adaptation.consolidation')
  build(ConsolidationConfig, c.adaptation.online, 'adaptation.online')
  grpo_config(c, c.adaptation.harvest_top_k)
  HeadDraftConfig(tuple(c.rollout.branching))
  if 'heads' not in parse_proposers(c.rollout.proposers) and c.adaptation.mode != 'static':
    raise ValueError(f'config adaptation.mode={c.adaptation.mode!r} adapts the heads, but '
                     f'rollout.proposers={c.rollout.proposers!r} has none (use mode=static)')
  build(GroupDraftConfig, c.rollout.group, 'rollout.group')
  build(GateConfig, c.rollout.gate, 'rollout.gate')
  build(AuditConfig, c.audit, 'audit')
  sampler(c)
  mesh = build(MeshConfig, c.mesh, 'mesh')
  rows_split = axis_size(dict(zip(AXES, mesh.shape(jax.device_count()))), ROWS)
  for name, value in (('rollout.max_batch', c.rollout.max_batch),
                      ('grpo.micro_batch_size', c.grpo.micro_batch_size)):
    if value % rows_split:
      raise ValueError(f'config {name}={value} must be a multiple of mesh data x fsdp = '
                       f'{rows_split} (rows are split over both)')
  if c.rollout.prompts_per_step % jax.process_count():
    raise ValueError(f'config rollout.prompts_per_step={c.rollout.prompts_per_step} must be '
                     f'a multiple of the {jax.process_count()} processes (each scores its share)')


def step_seed(c, step: int) -> int:
  """The rollout (and consolidation) seed of GRPO step `step`: a resumed run draws exactly
  what the uninterrupted one would have."""
  return c.seed * 1_000_003 + step


def sampler(c) -> SamplerConfig:
  r = c.rollout
  return SamplerConfig(r.temperature, r.top_k, r.top_p)


class Rollouts:
  """The rollout side: an engine and its driver, fed the learner's current params.

  With `rollout.speculation_gate`, the gate is priced on the first batch (the measured cost
  of a tree step per bucket) and the prices are saved in `step_costs_path`, so a resumed
  run makes the same tree-or-plain choices as the uninterrupted one.

  Every batch has the run's one prompt width (`run_prompt_width`).
  """

  def __init__(self, policy: Policy, c, heads_config: HeadsConfig | None, heads_dir: Path | None,
               prompt_width: int, mesh, step_costs_path: Path | None = None):
    r = c.rollout
    self.group_size = r.group_size
    self.step_costs_path = step_costs_path if r.engine == 'specroll' and r.speculation_gate else None
    # Priced once, even when no bucket has trees (the prices are then empty).
    self.unpriced = self.step_costs_path is not None
    self.proposer = tree = None
    if r.engine == 'specroll':
      names = parse_proposers(r.proposers)
      if 'heads' in names:
        self.proposer = head_proposer(policy, heads_config, heads_dir, sampler(c),
                                      HeadDraftConfig(tuple(r.branching)))
        if c.adaptation.mode in ('reflex', 'both'):
          self.proposer = ReflexProposer(
              self.proposer, build(ReflexConfig, c.adaptation.reflex, 'adaptation.reflex'))
      self.proposer = with_group_drafts(self.proposer, names,
                                        build(GroupDraftConfig, r.group, 'rollout.group'))
      tree = distributed.agreed_tree_config(
          lambda: tree_config(policy, max_nodes=r.max_nodes, capacity_tokens=r.capacity_tokens))
    self.engine = make_engine(policy, r.engine, sampler(c), proposer=self.proposer, tree=tree,
                              mesh=mesh, tree_attention=r.tree_attention)
    if self.step_costs_path is not None:
      self.engine = dataclasses.replace(self.engine, gate_config=build(GateConfig, r.gate,
                                                                       'rollout.gate'))
    # Every batch's prompts fit prompt_width, so every batch gets exactly that width.
    self.driver = Driver(self.engine, RolloutConfig(r.max_new_tokens, max_batch=r.max_batch,
                                                    prompt_bucket_min=prompt_width))

  def generate(self, policy_params, head_params, prompts, seed):
    params = self.engine.params(policy_params, head_params)
    if self.unpriced:
      self._price_gate(params, prompts)
      self.unpriced = False
    return self.driver.generate(params, prompts, self.group_size, seed)

  def _price_gate(self, params, prompts):
    path = self.step_costs_path
    if path.exists():
      try:
        costs = tuple((int(b), float(cost)) for b, cost in json.loads(path.read_text()))
      except (ValueError, TypeError) as e:
        raise ValueError(f'{path}: not a list of [batch, cost] pairs ({e}); delete it to '
                         'measure the tree-step costs again') from e
      self.engine = dataclasses.replace(self.engine, tree_step_costs=costs)
    else:
      # Every process must run the same program: process 0's prices are everyone's.
      measured = with_measured_step_costs(self.engine, self.driver.config, params, prompts,
                                          self.group_size).tree_step_costs
      self.engine = dataclasses.replace(self.engine,
                                        tree_step_costs=distributed.agreed_costs(measured))
      if distributed.is_primary():
        tmp = path.with_name(path.name + '.tmp')
        tmp.write_text(json.dumps(self.engine.tree_step_costs))
        tmp.replace(path)
    self.driver = Driver(self.engine, self.driver.config)


class HeadAdaptation:
  """The slow timescale between rollout batches: monitor + consolidation, or the
  always-online baseline. Reflex (the fast timescale) lives inside the engine.

  `observe` reads the rollout's verifier feedback before the GRPO update and decides which
  heads to train; only then does the update harvest pairs (the harvest costs ~19% of a W1
  update), so a slow-path step without a trigger pays nothing for the heads."""

  def __init__(self, c, policy: Policy, heads_config: HeadsConfig, proposer):
    self.mode = c.adaptation.mode
    self.monitor_config = build(MonitorConfig, c.adaptation.monitor, 'adaptation.monitor')
    # The always-online baseline is tuned on its own (WORKSPACE_NOTES, issue 15).
    section = 'online' if self.mode == 'online' else 'consolidation'
    self.consolidation_config = build(ConsolidationConfig, c.adaptation[section],
                                      f'adaptation.{section}')
    self.branching = tuple(c.rollout.branching)
    self.policy_config, self.heads_config = policy.config, heads_config
    self.proposer = proposer

  @property
  def harvests(self) -> bool:
    return self.mode in ('online', 'slow', 'both')

  def init_state(self, params, mesh) -> HeadsState:
    config = self.consolidation_config
    opt_state = consolidation.init_optimizer_state(config, params)
    opt_state = jax.device_put(opt_state, optimizer_sharding(
        mesh, consolidation.make_optimizer(config), opt_state, head_sharding(mesh, params)))
    return HeadsState(params=params, opt_state=opt_state,
                      monitor=MonitorState.init(self.monitor_config, len(self.branching)))

  def observe(self, heads: HeadsState, responses):
    """Returns (heads, triggered bool [num_heads], metrics) after one rollout batch."""
    window = monitor.window_stats(
        [self.proposer.head_stats(r.stats.proposer) for r in responses], self.branching)
    metrics = {'head_acceptance': window.acceptance.round(4).tolist(),
               'head_regret': window.regret.round(4).tolist()}
    triggered = np.zeros(self.heads_config.num_heads, bool)
    if self.mode == 'online':
      triggered[:] = True
    elif self.harvests:
      watch, observed = monitor.observe(self.monitor_config, heads.monitor, window)
      triggered[:len(observed)] = observed
      metrics['triggered'] = np.flatnonzero(observed).tolist()
      heads = heads.replace(monitor=watch)
    return heads, triggered, metrics

  def consolidate(self, heads: HeadsState, triggered, policy_params, pairs, groups, seed):
    """Trains the triggered heads on the GRPO forward's harvest of the responses; `groups`
    are the rows' prompt indices. Returns (heads, metrics)."""
    result = consolidation.consolidate(self.heads_config, self.policy_config,
                                       self.consolidation_config, heads.params, heads.opt_state,
                                       policy_params, pairs, triggered, seed, groups=groups)
    watch, metrics = heads.monitor, {}
    if self.mode != 'online':
      watched = len(self.branching)
      watch = monitor.after_update(self.monitor_config, watch, triggered[:watched],
                                   result.kept[:watched])
      metrics['kept'] = np.flatnonzero(result.kept).tolist()
    if result.kl_before is not None:
      metrics.update(head_kl_before=result.kl_before.round(4).tolist(),
                     head_kl_after=result.kl_after.round(4).tolist())
    return HeadsState(params=result.params, opt_state=result.opt_state, monitor=watch), metrics


def resolve_policy(c) -> Path:
  if c.policy.checkpoint:
    path = Path(c.policy.checkpoint)
    if not path.is_dir():
      raise FileNotFoundError(f'config policy.checkpoint: {path} does not exist')
    return path
  return ensure_default_policy(c.policy.cache_dir)


def warm_start_heads(policy: Policy, c, task_prompts, workdir: Path, source: Path):
  """Heads self-distilled on the initial policy's own answers to the task prompts (token
  ids; cached in workdir/heads); returns (heads config, params, directory)."""
  h = c.heads
  directory = workdir / 'heads'
  prompts = task_prompts[:h.num_sequences + h.held_out]
  plan = WarmStart(num_sequences=h.num_sequences, held_out=h.held_out,
                   max_new_tokens=c.rollout.max_new_tokens, temperature=c.rollout.temperature,
                   seed=c.seed)
  heads_config, params = ensure_heads(policy, HeadsConfig(h.num_heads),
                                      DistillConfig(steps=h.steps, batch_size=h.batch_size),
                                      prompts, plan, directory, str(source))
  return heads_config, params, directory


def grpo_config(c, harvest_top_k: int) -> grpo.GRPOConfig:
  return build(grpo.GRPOConfig, c.grpo, 'grpo', group_size=c.rollout.group_size,
               temperature=c.rollout.temperature or 1.0, harvest_top_k=harvest_top_k)


def rollout_digest(responses) -> str:
  """A short hash of every emitted token: equal digests mean identical rollouts."""
  h = hashlib.sha256()
  for r in responses:
    h.update(np.asarray(r.token_ids, np.int32).tobytes() + b'|')
  return h.hexdigest()[:16]


def drift_kl(model_config, initial_params, batch: grpo.RolloutBatch, temperature: float) -> float:
  """KL(pi_current || pi_initial) estimated on the rollout's own tokens (sampled from the
  current policy): the mean of log pi_current - log pi_initial over response tokens."""
  current, initial, mask = to_host((
      batch.old_logprobs,
      grpo.token_logprobs(model_config, initial_params, batch.tokens, temperature),
      batch.response_mask))
  return float(np.sum(np.where(mask, current - initial, 0.0)) / max(mask.sum(), 1))


def run_prompt_width(prompts: list[list[int]]) -> int:
  """The one prompt width of a GRPO run: its longest prompt, rounded up to a multiple of 16.

  Rollouts and the learner use it for every batch. Each new width compiles the decode
  loops again: with power-of-two widths per batch, the two W1 GRPO steps that met a new
  width generated at 0.23x and 0.06x of vanilla's speed (the gated loop compiles both kinds
  of step). W1's prompts (65-154 tokens) get 160 slots, where batches of 8 prompts got 128
  (70% of them) or 256.
  """
  return -(-max(len(p) for p in prompts) // 16) * 16


def _truncate_metrics(path: Path, last_step: int) -> None:
  """Drops metric lines after the restored step (written before an interruption), and a
  last line a kill cut short (every complete line ends with a newline)."""
  if path.exists():
    lines = path.read_text().split('\n')[:-1]
    keep = [line for line in lines if json.loads(line)['step'] <= last_step]
    tmp = path.with_name(path.name + '.tmp')
    tmp.write_text(''.join(line + '\n' for line in keep))
    tmp.replace(path)


def _phase(step: int, name: str) -> None:
  """Logs where the run is (the kill-and-resume test interrupts each phase)."""
  logging.info('step %d: %s', step, name)


def _scored_shard(tasks, responses, tokenizer) -> np.ndarray:
  """Rewards of every response (`tasks`: the step's, one per prompt), each process scoring
  its own block of the prompts (its share of the answer checks), gathered so every process
  holds them all."""
  share = len(tasks) // jax.process_count()
  mine = range(jax.process_index() * share, (jax.process_index() + 1) * share)
  scores = np.array([rewards.score(tokenizer.decode(r.token_ids, skip_special_tokens=True),
                                   tasks[r.prompt_index].answer, tasks[r.prompt_index].kind)
                     for r in responses if r.prompt_index in mine], np.float32)
  if jax.process_count() == 1:
    return scores
  return np.asarray(multihost_utils.process_allgather(scores)).reshape(-1)


def train(c, workdir) -> dict:
  """Runs (or resumes) GRPO per config `c` in `workdir`; returns the last step's metrics.

  Every process of a multi-process run calls this with the same config and workdir (a
  shared filesystem): process 0 writes metrics, the report and cached files, Orbax writes
  the checkpoints from every process.
  """
  check_config(c)
  workdir = Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  primary = distributed.is_primary()
  policy_dir = distributed.primary_first('policy', lambda: resolve_policy(c))
  policy = load_policy(policy_dir, dtype=c.policy.dtype)
  tasks = load_tasks(c.task.source, count=c.task.count, seed=c.seed,
                     data_dir=c.task.data_dir or None, split=c.task.split or None,
                     chat=c.task.chat_template)
  if not tasks:
    raise ValueError(f'config task.source={c.task.source!r} yielded no prompts')
  # Encoded once: rollouts, the learner's width and warm-start data all use these ids.
  task_prompts = [policy.prompt_ids(t.prompt, c.task.chat_template) for t in tasks]
  heads_dir = heads_config = adaptation = None
  uses_heads = c.rollout.engine == 'specroll' and 'heads' in parse_proposers(c.rollout.proposers)
  if uses_heads:
    heads_config, heads, heads_dir = distributed.primary_first(
        'heads', lambda: warm_start_heads(policy, c, task_prompts, workdir, policy_dir))
  mesh = make_mesh(build(MeshConfig, c.mesh, 'mesh'))
  prompt_width = run_prompt_width(task_prompts)
  width = prompt_width + c.rollout.max_new_tokens
  report = memory.report(policy.config, memory.Workload.from_config(c, width, heads_config),
                         dict(mesh.shape))
  if primary:
    print(report.table(), file=sys.stderr)
  rollouts = Rollouts(policy, c, heads_config, heads_dir, prompt_width, mesh,
                      workdir / STEP_COSTS_FILE)
  audit = Audit(policy, build(AuditConfig, c.audit, 'audit'), sampler(c),
                rollouts.driver.config, c.rollout.group_size, mesh)
  if uses_heads:
    adaptation = HeadAdaptation(c, policy, heads_config, rollouts.proposer)
  config = grpo_config(c, 0)
  # The same update that also returns head-training pairs (the last prompt position and
  # the response: every pair whose horizon lies in the response): a second compiled
  # program, run on the steps whose heads were triggered.
  harvest_config = dataclasses.replace(config, harvest_top_k=c.adaptation.harvest_top_k,
                                       harvest_span=c.rollout.max_new_tokens + 1)
  optimizer = grpo.make_optimizer(config)
  # One copy of every array, sharded by the mesh's rules: rollouts and learner share it.
  base = shard_params(mesh, policy.params)
  adapters = None
  if config.lora_rank:
    adapters = lora.init_adapters(policy.params, config.lora_rank, config.lora_targets, c.seed)
    adapters = shard_params(mesh, adapters)
  trained = base if adapters is None else adapters
  opt_state = optimizer.init(trained)
  opt_state = jax.device_put(opt_state, optimizer_sharding(mesh, optimizer, opt_state,
                                                           param_sharding(mesh, trained)))
  if uses_heads:
    heads = jax.device_put(heads, head_sharding(mesh, heads))
  state = TrainState(policy=base, opt_state=opt_state, step=0, data_position=0,
                     heads=None if adaptation is None else adaptation.init_state(heads, mesh),
                     adapters=adapters)
  initial_policy = base
  reference = base if config.kl_coef > 0 else None
  manager = ocp.CheckpointManager(
      (workdir / 'checkpoints').resolve(),
      options=ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=1))
  if manager.latest_step() is not None:
    state = manager.restore(manager.latest_step(), args=ocp.args.StandardRestore(state))
    if primary:
      print(f'resumed from step {int(state.step)}', file=sys.stderr)
  metrics_path = workdir / METRICS_FILE
  if primary:
    _truncate_metrics(metrics_path, int(state.step))
  per_step = c.rollout.prompts_per_step
  last = {}
  with tqdm(total=c.steps, initial=int(state.step), desc='grpo', file=sys.stderr,
            disable=not primary) as bar:
    while int(state.step) < c.steps:
      step, position = int(state.step), int(state.data_position)
      indices = [(position + i) % len(tasks) for i in range(per_step)]
      batch_tasks = [tasks[i] for i in indices]
      prompts = [task_prompts[i] for i in indices]
      times = {}
      compiled_before = compilations_so_far()
      # Rollouts (and the audit, the heads' projection) run on the merged weights, merged
      # once per step.
      policy_params = (state.policy if state.adapters is None else
                       lora.merge_jit(state.policy, state.adapters, config.lora_scale))
      _phase(step + 1, 'rollout')
      start = time.perf_counter()
      responses = rollouts.generate(policy_params, state.heads and state.heads.params, prompts,
                                    seed=step_seed(c, step))
      times['rollout'] = time.perf_counter() - start
      audited = {}
      if audit.due(step + 1):
        _phase(step + 1, 'audit')
        start = time.perf_counter()
        audited = audit(policy_params, prompts, step_seed(c, step), responses, times['rollout'])
        times['audit'] = time.perf_counter() - start
      start = time.perf_counter()
      scores = _scored_shard(batch_tasks, responses, policy.tokenizer)
      times['reward'] = time.perf_counter() - start
      start = time.perf_counter()
      row_prompts = [prompts[r.prompt_index] for r in responses]
      batch = grpo.batch_from_rollouts(
          row_prompts, [r.token_ids for r in responses], [r.logprobs for r in responses],
          grpo.group_advantages(scores, config.group_size, config.advantage_eps), width)
      batch = jax.tree.map(lambda x: put_rows(mesh, x), batch)
      if reference is not None:
        batch = batch.replace(ref_logprobs=grpo.token_logprobs(
            policy.config, reference, batch.tokens, config.temperature))
      jax.block_until_ready(batch)
      times['logprobs'] = time.perf_counter() - start
      start = time.perf_counter()
      heads, triggered, adapted = state.heads, None, {}
      if adaptation is not None:
        heads, triggered, adapted = adaptation.observe(heads, responses)
      times['head_update'] = time.perf_counter() - start
      harvest = triggered is not None and triggered.any()
      step_config = harvest_config if harvest else config
      _phase(step + 1, 'update')
      start = time.perf_counter()
      if adapters is None:
        params, opt_state, update, pairs = grpo.train_step(
            policy.config, step_config, state.policy, state.opt_state, batch, mesh=mesh)
        new_policy, new_adapters = params, None
      else:
        params, opt_state, update, pairs = grpo.train_step(
            policy.config, step_config, state.adapters, state.opt_state, batch, state.policy,
            mesh=mesh)
        new_policy, new_adapters = state.policy, params
      jax.block_until_ready(params)
      times['update'] = time.perf_counter() - start
      if float(update['update_skipped']):
        logging.warning('step %d: non-finite GRPO loss %s or gradient norm %s; the policy '
                        'update was rolled back (metrics: update_skipped)', step + 1,
                        float(update['loss']), float(update['grad_norm']))
      if harvest:
        _phase(step + 1, 'head update')
        start = time.perf_counter()
        # Pairs come from the pre-update policy's forward, so they are scored with it.
        heads, consolidated = adaptation.consolidate(
            heads, triggered, policy_params, pairs, [r.prompt_index for r in responses],
            seed=step_seed(c, step))
        jax.block_until_ready(heads)
        adapted.update(consolidated)
        times['head_update'] += time.perf_counter() - start
      if c.metrics.drift_kl:
        adapted['drift_kl'] = drift_kl(policy.config, initial_policy, batch, config.temperature)
      state = TrainState(policy=new_policy, opt_state=opt_state, step=step + 1,
                         data_position=(position + per_step) % len(tasks), heads=heads,
                         adapters=new_adapters)
      summary = rollouts.engine.summarize(responses)
      last = {'step': step + 1, 'reward': float(scores.mean()),
              'accuracy': float((scores == 1.0).mean()),
              'response_length': summary['tokens'] / len(responses),
              'tau': summary['tau'], 'acceptance_by_depth': summary.get('acceptance_by_depth'),
              'tree_step_share': summary.get('tree_step_share'),
              'rollout_digest': rollout_digest(responses),
              **{k: v for k, v in summary.items() if k.startswith(('reflex_', 'group_'))},
              **adapted, **audited,
              **{k: float(v) for k, v in update.items()},
              **{f'time_{k}': v for k, v in times.items()},
              'compilations': compilations_so_far() - compiled_before, **process_memory()}
      if primary:
        with metrics_path.open('a') as f:
          f.write(json.dumps(last) + '\n')
      if (step + 1) % c.checkpoint_every == 0 or step + 1 == c.steps:
        _phase(step + 1, 'checkpoint')
        manager.save(step + 1, args=ocp.args.StandardSave(state))
      bar.update(1)
      bar.set_postfix(reward=f"{last['reward']:.2f}", tau=f"{last['tau']:.2f}")
  manager.wait_until_finished()
  if primary:
    # Whole passes over the task list, so both windows hold the same prompts when it cycles.
    steps_per_pass = -(-len(tasks) // per_step)
    write_report(workdir, window=max(1, min(steps_per_pass, c.steps // 4)))
  return last
