"""The embedded default job: GRPO on the synthetic math task with the W1 policy.

  python -m experiments.train_grpo --config=configs/tiny_math.py --workdir=workdir/tiny_math

Starts from the committed W1 policy (specroll_jax/tasks/w1_policy; another build config is
pretrained once into policy.cache_dir), warm-starts horizon heads on it, then runs GRPO with
SpecRoll rollouts (--config.rollout.engine=vanilla for the baseline). The speculation gate
(rollout.speculation_gate) runs a plain step wherever a tree is not expected to pay for
its measured cost.
"""
import ml_collections

from specroll_jax.adapt.consolidation import ConsolidationConfig
from specroll_jax.adapt.drafter_training import DrafterTraining
from specroll_jax.adapt.monitor import MonitorConfig
from specroll_jax.adapt.reflex import ReflexConfig
from specroll_jax.model.mesh import MeshConfig
from specroll_jax.rl.audit import AuditConfig
from specroll_jax.rl.evaluation import EvaluationConfig
from specroll_jax.rl.grpo import GRPOConfig
from specroll_jax.rl.run_config import DRIVER_DERIVED, GRPO_DERIVED, TREE_DERIVED
from specroll_jax.rl.sections import section
from specroll_jax.rollout.driver import RolloutConfig
from specroll_jax.rollout.sampling import SamplerConfig
from specroll_jax.speculative.drafter import DrafterConfig
from specroll_jax.speculative.gate import GateConfig
from specroll_jax.speculative.group_proposer import GroupDraftConfig
from specroll_jax.speculative.head_proposer import HeadDraftConfig
from specroll_jax.speculative.tree import TreeConfig


def get_config():
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.steps = 40
  c.checkpoint_every = 5
  # Serve allocations of >= 1 MiB by their own mmap, from the process's start (rl/resources):
  # freed XLA buffers then leave the resident set, but every such allocation pays its page
  # faults again. The SmolLM2 job: peak 6,714 MiB with it, 9,767 without; its update
  # 41-45 s with it, 29-31 s without (results/smol_grpo).
  c.return_large_frees = True
  c.policy = ml_collections.ConfigDict(dict(
      checkpoint='',                     # '' = the committed W1 policy
      cache_dir='workdir/policies',
      dtype='float32',                   # of the parameters
      # 'bfloat16': bf16 matmuls, batch-invariant (rollouts equal the learner bit for bit;
      # ModelConfig.compute_dtype). float32 stays the default until its speed is measured
      # on the main job (notes/history.md, "bf16 compute").
      compute_dtype='float32'))
  # chat_template: prompts as a user turn through the tokenizer's chat template (instruct
  # models); the W1 policy is a base model and reads raw prompts.
  # 64 easy tasks, cycled (4 steps per pass): GRPO raises the reward on them visibly
  # within the run (notes/history.md, "Main job"); the hard split and fresh tasks every
  # step showed no trend over 40 steps at any learning rate tried.
  # reward: a rule of tasks.rewards.REWARD_RULES (strict reads '#### n' or a box).
  c.task = ml_collections.ConfigDict(dict(
      source='synthetic:easy', count=64, data_dir='', split='', chat_template=False,
      reward='strict'))
  # Held-out prompts the run never trains on, scored every `every` updates (0 = never).
  c.evaluation = section(EvaluationConfig)
  # One subsection per dataclass the rollouts build (rl/rollouts.py); tree.capacity_tokens 0
  # = this model's profiled capacity (experiments.profile.capacity, cached).
  c.rollout = ml_collections.ConfigDict(dict(
      engine='specroll', prompts_per_step=16, group_size=8, tree_attention='xla',
      speculation_gate=True,
      # Drafting sources (rl.learned_proposers.PROPOSERS): the heads and the GRPO group's
      # continuations, merged into one tree.
      proposers='heads,group',
      sampler=section(SamplerConfig),
      driver=section(RolloutConfig, exclude=DRIVER_DERIVED, max_new_tokens=64, max_batch=128),
      tree=section(TreeConfig, exclude=TREE_DERIVED, capacity_tokens=0),
      head_drafts=section(HeadDraftConfig), group=section(GroupDraftConfig),
      gate=section(GateConfig)))
  c.heads = ml_collections.ConfigDict(dict(
      num_heads=4, draft_vocab_size=0, num_sequences=512, held_out=64, steps=600,
      batch_size=32))
  # The drafters, when rollout.proposers names one ('drafter', 'context_drafter', with or
  # without ',group'): the block (model), its warm start on the initial policy's answers to
  # the first num_sequences + held_out task prompts (training), its spine's candidates per
  # depth, the context-attending drafter's attention heads, and how many nodes per depth
  # each row expands best path first (expanded, one count per depth above the deepest;
  # () = the spine itself).
  c.drafter = ml_collections.ConfigDict(dict(
      model=section(DrafterConfig), training=section(DrafterTraining), branching=(4, 2, 2, 1),
      num_sequences=512, held_out=64, context_heads=4, expanded=()))
  # Adaptation of the heads or the drafter (rl.run_config.ADAPTATION_MODES): slow = the
  # slow path alone. Reflex (mode=reflex|both; heads only) is off: on W1 its gates never open
  # and it costs generation time (notes/history.md, "Issue 15").
  c.adaptation = ml_collections.ConfigDict(dict(
      mode='slow', harvest_top_k=32, reflex=section(ReflexConfig),
      monitor=section(MonitorConfig), consolidation=section(ConsolidationConfig),
      # The always-online baseline's retraining after every batch (mode=online), tuned on
      # its own for its best end-to-end time (notes/history.md, "Adaptation").
      online=section(ConsolidationConfig)))
  # One mesh for rollouts and learner (model/mesh.py): rows over data x fsdp, weights over
  # fsdp x tensor; -1 = every device the other axes leave.
  c.mesh = section(MeshConfig)
  # drift_kl_every: KL(current || initial) on every N-th step's own tokens (0 = never).
  c.metrics = ml_collections.ConfigDict(dict(drift_kl_every=0))
  # Every 5th step vanilla replays the rollout: identical responses and the measured
  # speedup go into metrics.jsonl and report.md.
  c.audit = section(AuditConfig, every=5)
  # group_size and temperature are the rollout's, score_span follows its max_new_tokens; the
  # update harvests head pairs (adaptation.harvest_top_k) only on steps that train heads.
  c.grpo = section(GRPOConfig, exclude=GRPO_DERIVED, learning_rate=1e-4, micro_batch_size=32)
  return c
