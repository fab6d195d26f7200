"""The embedded default job: GRPO on the synthetic math task with the W1 policy.

  python -m experiments.train_grpo --config=configs/tiny_math.py --workdir=workdir/tiny_math

Builds the W1 policy on first use (pretrained from scratch, ~10 minutes on 2 CPU cores,
cached under policy_cache_dir), warm-starts horizon heads on it, then runs GRPO with
SpecRoll rollouts (--config.rollout.engine=vanilla for the baseline).
"""
import ml_collections


def get_config():
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.steps = 40
  c.checkpoint_every = 5
  c.policy = ml_collections.ConfigDict(dict(
      checkpoint='',                     # '' = the W1 default policy (built if missing)
      cache_dir='workdir/policies',
      dtype='float32'))
  c.task = ml_collections.ConfigDict(dict(
      source='synthetic:hard', count=4096, data_dir='', split=''))
  c.rollout = ml_collections.ConfigDict(dict(
      engine='specroll', prompts_per_step=16, group_size=8, max_new_tokens=64,
      temperature=1.0, top_k=0, top_p=1.0, max_batch=128,
      capacity_tokens=0, max_nodes=64, branching=(8, 4, 2, 2), tree_attention='xla'))
  c.heads = ml_collections.ConfigDict(dict(
      num_heads=4, num_sequences=512, held_out=64, steps=600))
  # Head adaptation (trainer.ADAPTATION_MODES): both = Reflex in the rollout + slow path.
  c.adaptation = ml_collections.ConfigDict(dict(
      mode='both', harvest_top_k=32,
      reflex=dict(half_life=48.0, reliability_decay=0.95, gate_threshold=0.1, step_size=1.0,
                  max_correction=0.5, dist_weight=1.0, coverage_weight=1.0),
      slow_path=dict(drop=0.05, regret_z=2.5, patience=2, cooldown=3, calibration_windows=2,
                     history=8, min_regret_scale=0.01, steps=40, batch_size=32,
                     learning_rate=1e-3, ce_weight=1.0, prox_weight=1e-2,
                     held_out_fraction=0.25)))
  c.metrics = ml_collections.ConfigDict(dict(drift_kl=False))
  c.grpo = ml_collections.ConfigDict(dict(
      clip_epsilon_low=0.2, clip_epsilon_high=0.2, kl_coef=0.0,
      loss_aggregation='token-mean', learning_rate=1e-4, weight_decay=0.0,
      max_grad_norm=1.0, micro_batch_size=32,
      # pi_old from the learner's forward: training then depends on the rollout's tokens
      # only, so engines (and adaptation variants) train identically.
      learner_old_logprobs=True))
  return c
