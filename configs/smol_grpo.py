"""GRPO on a real model: SmolLM2-135M-Instruct (W3) on GSM8K chat prompts, SpecRoll rollouts.

  python3 -m experiments.import_gguf --out=workdir/models/smollm2-135m-instruct
  python3 -m experiments.train_grpo --config=configs/smol_grpo.py --workdir=workdir/smol_grpo

The reward rule is what `experiments.measure.reward_survey` found this model can earn (results/
reward_survey): at T=1 it answers 0 of 64 GSM8K train samples right under the strict or the
lenient reader and 3% of the synthetic tasks, so correctness gives GRPO no groups to learn
from; 7.8% of its GSM8K answers end in the asked-for '#### <number>' format (31% of groups
carry signal), so the run rewards the format ('format') and the held-out evaluation reports
every rule on GSM8K test questions the run never trains on. Drafts: group drafts alone
(the heads' warm start on this model takes ~20 minutes of this budget), so the slow path has
no heads to adapt (adaptation.mode static).
"""
from configs.tiny_math import get_config as base_config


def get_config():
  c = base_config()
  c.steps = 13
  c.checkpoint_every = 4
  c.policy.checkpoint = 'workdir/models/smollm2-135m-instruct'
  c.task.update(source='gsm8k', chat_template=True, reward='format')
  # The policy each step starts from, after 0, 4, 8 and 12 updates.
  c.evaluation.update(every=4, count=24, samples=2, split='test')
  c.rollout.prompts_per_step = 4
  c.rollout.group_size = 4
  c.rollout.driver.update(max_new_tokens=256, max_batch=16)
  c.rollout.proposers = 'group'
  c.rollout.tree.update(capacity_tokens=64, max_nodes=16)
  c.adaptation.mode = 'static'
  c.audit.every = 6
  # Micro-batches of one row, the loss's logits whole: with only the response span projected
  # (grpo.score_span) an update takes 30.2 s and peaks at 5.3 GB in profile_learner, against
  # 27.8 s / 7.1 GB for 2 rows and 32.7 s / 5.3 GB streamed (results/smol_grpo/
  # profile_learner; 8 rows with every position projected peaked above 23 GB and were killed).
  c.grpo.update(learning_rate=2e-5, micro_batch_size=1)
  # Rows on one device: micro-batches of 2 cannot be split over more row shards.
  c.mesh.data = 1
  return c
