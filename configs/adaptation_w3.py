"""Head adaptation under a real model's drift: GRPO on SmolLM2-135M-Instruct (W3's model).

  python -m experiments.import_gguf --out=workdir/models/smollm2-135m-instruct
  python -m experiments.bench.adaptation --config=configs/adaptation_w3.py

A real instruct model drifts under GRPO differently from the from-scratch W1 policy; this
run asks whether Reflex's gates open there (delayed alignment, gate activity) and what it
buys. The tasks are the synthetic easy split as chat turns, not GSM8K: the 135M model
answers almost no GSM8K question, so nearly every group's advantages are zero and GRPO would
not move the policy. Sized for a 2-core CPU: each GRPO update of the 135M model over 16 rows
takes tens of seconds, and the heads are warm-started on 96 of the policy's own answers
(each distillation step projects every position onto the 49,152-token vocabulary).
Measured (results/adaptation_w3, 4 of 8 steps): even these tasks earned 2 rewards in 64,
so the policy barely drifted (KL 0.0009).
"""
from configs.ablation_w1 import get_config as ablation_config


def get_config():
  c = ablation_config()
  c.policy.checkpoint = 'workdir/models/smollm2-135m-instruct'
  c.task.source, c.task.count, c.task.chat_template = 'synthetic:easy', 512, True
  c.steps = 8
  c.checkpoint_every = 8
  c.rollout.prompts_per_step = 4
  c.rollout.group_size = 4
  c.rollout.driver.max_new_tokens = 128
  c.rollout.driver.max_batch = 16
  # 4 nodes per row at 16 rows: W3's verification forward is compute-bound beyond that here.
  c.rollout.tree.capacity_tokens = 64
  c.rollout.tree.max_nodes = 16
  c.rollout.head_drafts.branching = (4, 2, 2, 1)
  c.heads.update(num_sequences=96, held_out=16, steps=150, batch_size=4)
  c.grpo.micro_batch_size = 8
  # A step size that moves a pretrained 135M policy measurably within 8 steps.
  c.grpo.learning_rate = 2e-5
  # Reflex alone first: while its gates stay shut it drafts exactly what static heads do.
  c.variants = ('reflex',)
  c.include_vanilla = False
  c.repeats = 1
  c.window = 3
  c.warmup_steps = 1
  c.out_dir = 'results/adaptation_w3'
  c.workdir = 'workdir/adaptation_w3'
  return c
