"""A GRPO run's config, typed: checked once at the edge, then a frozen tree of dataclasses.

Shipped configs (configs/*.py) are ml_collections ConfigDicts, so that `--config.x=`
overrides work from the command line; `run_config(c)` turns one into a `RunConfig` before
anything is loaded, naming the field at fault when one is wrong, and every component then
receives its own section (a `SamplerConfig`, a `GRPOConfig`, ...), never the whole config.
The sections are the components' own config dataclasses where they have one; the few that
only the run reads (policy, task, heads, drafter, adaptation, metrics) are defined here.
"""
import dataclasses

import jax

from specroll_jax.adapt.consolidation import ConsolidationConfig
from specroll_jax.adapt.distill import WarmStart
from specroll_jax.adapt.drafter_training import DrafterTraining
from specroll_jax.adapt.monitor import MonitorConfig
from specroll_jax.adapt.reflex import ReflexConfig
from specroll_jax.model.mesh import AXES, ROWS, MeshConfig, axis_size
from specroll_jax.rl.audit import AuditConfig
from specroll_jax.rl.evaluation import EvaluationConfig
from specroll_jax.rl.grpo import GRPOConfig
from specroll_jax.rl.learned_proposers import KINDS, learned_kind_name, parse_proposers
from specroll_jax.rl.sections import build
from specroll_jax.rollout.driver import RolloutConfig
from specroll_jax.rollout.sampling import SamplerConfig
from specroll_jax.speculative.drafter import DrafterConfig
from specroll_jax.speculative.drafter_proposer import best_first_counts
from specroll_jax.speculative.factory import ENGINES
from specroll_jax.speculative.gate import GateConfig
from specroll_jax.speculative.group_proposer import GroupDraftConfig
from specroll_jax.speculative.head_proposer import HeadDraftConfig
from specroll_jax.speculative.tree import TreeConfig
from specroll_jax.tasks.rewards import REWARD_RULES

# Fields the trainer derives: every batch is padded to the run's one prompt width, and a
# tree's per-batch capacity comes from the profile (rollout.tree.capacity_tokens = 0).
DRIVER_DERIVED = ('prompt_bucket_min', 'prompt_buckets_per_octave')
TREE_DERIVED = ('capacity_by_batch', 'sized_widths', 'one_projection')
# GRPO's fields that are the rollout's (group size, temperature, the scored span) or the
# adaptation's (harvest_top_k; the layers the learned proposer reads), not the grpo section's.
GRPO_DERIVED = ('group_size', 'temperature', 'harvest_top_k', 'score_span',
                'harvest_feature_layers')
# static: warm-started heads, never adapted; online: heads retrained on every batch (the
# FastGRPO-like baseline); reflex / slow: one timescale; both: SpecRoll.
ADAPTATION_MODES = ('static', 'online', 'reflex', 'slow', 'both')


@dataclasses.dataclass(frozen=True)
class PolicySection:
  checkpoint: str = ''                # '' = the committed W1 policy (built into cache_dir)
  cache_dir: str = 'workdir/policies'
  dtype: str = 'float32'              # of the parameters
  compute_dtype: str = 'float32'      # ModelConfig.compute_dtype


@dataclasses.dataclass(frozen=True)
class TaskSection:
  source: str                 # tasks.sources.load_tasks: 'synthetic:easy', 'gsm8k', ...
  count: int
  data_dir: str = ''          # '' = the default data directory
  split: str = ''             # '' = the source's default split
  chat_template: bool = False  # prompts as a user turn through the chat template
  reward: str = 'strict'      # a rule of tasks.rewards.REWARD_RULES

  def __post_init__(self):
    if self.reward not in REWARD_RULES:
      raise ValueError(f'config task.reward must be one of {REWARD_RULES}, got {self.reward!r}')


@dataclasses.dataclass(frozen=True)
class TreeSection:
  """rollout.tree: TreeConfig's own fields; capacity_tokens 0 = this model's profiled
  capacity (experiments.profile.capacity, cached)."""
  max_nodes: int = TreeConfig.max_nodes
  capacity_tokens: int = 0

  def __post_init__(self):
    TreeConfig(max_nodes=self.max_nodes, capacity_tokens=self.capacity_tokens or 1)


@dataclasses.dataclass(frozen=True)
class RolloutSection:
  engine: str                 # speculative.factory.ENGINES
  prompts_per_step: int
  group_size: int
  tree_attention: str         # 'xla' or 'pallas'
  speculation_gate: bool      # a plain step wherever a tree is not expected to pay
  proposers: str              # rl.learned_proposers.PROPOSERS, comma-separated
  sampler: SamplerConfig
  driver: RolloutConfig       # its DRIVER_DERIVED fields are set per run
  tree: TreeSection
  head_drafts: HeadDraftConfig
  group: GroupDraftConfig
  gate: GateConfig

  def __post_init__(self):
    if self.engine not in ENGINES:
      raise ValueError(f'config rollout.engine must be one of {ENGINES}, got {self.engine!r}')
    parse_proposers(self.proposers)

  @property
  def learned_proposer(self) -> str | None:
    """The learned kind the rollouts draft with (rl/learned_proposers.py), else None."""
    if self.engine != 'specroll':
      return None
    return learned_kind_name(parse_proposers(self.proposers))


@dataclasses.dataclass(frozen=True)
class HeadsSection:
  """The horizon heads' warm start (self-distillation on the initial policy's answers)."""
  num_heads: int
  num_sequences: int
  held_out: int
  steps: int
  batch_size: int
  draft_vocab_size: int = 0


@dataclasses.dataclass(frozen=True)
class DrafterSection:
  """The drafters (sequential, or context-attending: rollout.proposers names which): the
  block, its warm start on the initial policy's answers to the first num_sequences +
  held_out task prompts, and its spine's candidates per depth."""
  model: DrafterConfig
  training: DrafterTraining
  branching: tuple
  num_sequences: int
  held_out: int
  context_heads: int  # the context-attending drafter's attention heads
  # Per depth above the deepest, the nodes each row expands, best path first (a tree grown
  # per row from the spine, EAGLE-2's dynamic tree); () = the spine itself.
  expanded: tuple = ()

  def __post_init__(self):
    # Static arguments of the compiled proposer: hashable, whatever sequence the config held.
    object.__setattr__(self, 'branching', tuple(int(b) for b in self.branching))
    object.__setattr__(self, 'expanded', tuple(int(e) for e in self.expanded))

  def check(self) -> None:
    """The spine fits the block and the best-first expansion fits the spine (checked where
    the drafter drafts)."""
    if (not self.branching or min(self.branching) < 1
        or len(self.branching) > self.model.depth):
      raise ValueError(f'config drafter.branching={self.branching}: one width >= 1 per depth, '
                       f'at most drafter.model.depth={self.model.depth} depths')
    if self.expanded:
      try:
        best_first_counts(self.branching, self.expanded)
      except ValueError as error:
        raise ValueError(f'config drafter.expanded: {error}') from None


@dataclasses.dataclass(frozen=True)
class AdaptationSection:
  mode: str                   # ADAPTATION_MODES
  harvest_top_k: int          # head-training pairs per position, from the update's forward
  reflex: ReflexConfig
  monitor: MonitorConfig
  consolidation: ConsolidationConfig
  online: ConsolidationConfig  # the always-online baseline's retraining (mode=online)

  def __post_init__(self):
    if self.mode not in ADAPTATION_MODES:
      raise ValueError(f'config adaptation.mode must be one of {ADAPTATION_MODES}, '
                       f'got {self.mode!r}')

  @property
  def retraining(self) -> ConsolidationConfig:
    """The slow path's consolidation, or the online baseline's retraining."""
    return self.online if self.mode == 'online' else self.consolidation


@dataclasses.dataclass(frozen=True)
class MetricsSection:
  drift_kl_every: int = 0     # KL(current || initial) on every N-th step's tokens (0 = never)


@dataclasses.dataclass(frozen=True)
class RunConfig:
  seed: int
  steps: int
  checkpoint_every: int
  return_large_frees: bool    # rl/resources.py
  policy: PolicySection
  task: TaskSection
  evaluation: EvaluationConfig
  rollout: RolloutSection
  heads: HeadsSection
  drafter: DrafterSection
  adaptation: AdaptationSection
  mesh: MeshConfig
  metrics: MetricsSection
  audit: AuditConfig
  grpo: GRPOConfig            # with the rollout's group size, temperature and scored span

  def warm_start_plan(self, num_sequences: int, held_out: int) -> WarmStart:
    """A learned proposer's warm start: the initial policy answers the first task prompts
    as the rollouts will (their length and temperature)."""
    return WarmStart(num_sequences=num_sequences, held_out=held_out,
                     max_new_tokens=self.rollout.driver.max_new_tokens,
                     temperature=self.rollout.sampler.temperature, seed=self.seed)


def _nested(cls, config_section, name: str, **sections):
  """`cls` from a section whose keys `sections` are built already (subsections)."""
  plain = {k: config_section[k] for k in config_section.keys() if k not in sections}
  return build(cls, plain, name, **sections)


def _rollout(r) -> RolloutSection:
  head_drafts = build(HeadDraftConfig, r.head_drafts, 'rollout.head_drafts')
  return _nested(
      RolloutSection, r, 'rollout',
      sampler=build(SamplerConfig, r.sampler, 'rollout.sampler'),
      driver=build(RolloutConfig, r.driver, 'rollout.driver'),
      tree=build(TreeSection, r.tree, 'rollout.tree'),
      head_drafts=dataclasses.replace(head_drafts, branching=tuple(head_drafts.branching)),
      group=build(GroupDraftConfig, r.group, 'rollout.group'),
      gate=build(GateConfig, r.gate, 'rollout.gate'))


def _adaptation(a) -> AdaptationSection:
  return _nested(AdaptationSection, a, 'adaptation',
                 reflex=build(ReflexConfig, a.reflex, 'adaptation.reflex'),
                 monitor=build(MonitorConfig, a.monitor, 'adaptation.monitor'),
                 consolidation=build(ConsolidationConfig, a.consolidation,
                                     'adaptation.consolidation'),
                 online=build(ConsolidationConfig, a.online, 'adaptation.online'))


def run_config(c, num_devices: int | None = None) -> RunConfig:
  """The typed, checked config of a run from its ml_collections config `c`, for a mesh over
  `num_devices` devices (default: this process's JAX devices); loads nothing, so a bad field
  fails in seconds, with its name."""
  rollout = _rollout(c.rollout)
  drafter = _nested(DrafterSection, c.drafter, 'drafter',
                    model=build(DrafterConfig, c.drafter.model, 'drafter.model'),
                    training=build(DrafterTraining, c.drafter.training, 'drafter.training'))
  grpo = build(GRPOConfig, c.grpo, 'grpo', group_size=rollout.group_size,
               temperature=rollout.sampler.temperature or 1.0, harvest_top_k=0,
               # The loss scores each row from its last prompt position on, as far as the
               # longest response the rollouts can return.
               score_span=rollout.driver.max_new_tokens + 1)
  config = _nested(RunConfig, c, '(top level)', policy=build(PolicySection, c.policy, 'policy'),
                   task=build(TaskSection, c.task, 'task'),
                   evaluation=build(EvaluationConfig, c.evaluation, 'evaluation'),
                   rollout=rollout, heads=build(HeadsSection, c.heads, 'heads'),
                   drafter=drafter, adaptation=_adaptation(c.adaptation),
                   mesh=build(MeshConfig, c.mesh, 'mesh'),
                   metrics=build(MetricsSection, c.metrics, 'metrics'),
                   audit=build(AuditConfig, c.audit, 'audit'), grpo=grpo)
  _check_across_sections(config, jax.device_count() if num_devices is None else num_devices)
  return config


def _check_across_sections(config: RunConfig, num_devices: int) -> None:
  # Checked on the proposers whatever the engine: a vanilla baseline of a run keeps its
  # adaptation section (and ignores it).
  mode = config.adaptation.mode
  learned = learned_kind_name(parse_proposers(config.rollout.proposers))
  if learned is None and mode != 'static':
    raise ValueError(f'config adaptation.mode={mode!r} adapts heads or a drafter, but '
                     f'rollout.proposers={config.rollout.proposers!r} has neither (use '
                     'mode=static)')
  if learned is not None:
    if mode in ('reflex', 'both') and not KINDS[learned].supports_reflex:
      raise ValueError(f'config adaptation.mode={mode!r}: Reflex corrects horizon heads\' '
                       f'hidden states and does not apply to the {learned}; use static, slow '
                       'or online')
    KINDS[learned].check(config)
  rows_split = axis_size(dict(zip(AXES, config.mesh.shape(num_devices))), ROWS)
  for name, value in (('rollout.driver.max_batch', config.rollout.driver.max_batch),
                      ('grpo.micro_batch_size', config.grpo.micro_batch_size)):
    if value % rows_split:
      raise ValueError(f'config {name}={value} must be a multiple of mesh data x fsdp = '
                       f'{rows_split} (rows are split over both)')
  if config.rollout.prompts_per_step % jax.process_count():
    raise ValueError(f'config rollout.prompts_per_step={config.rollout.prompts_per_step} must '
                     f'be a multiple of the {jax.process_count()} processes (each scores its '
                     'share)')
