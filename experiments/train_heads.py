"""Warm-starts horizon heads by self-distillation on the policy's own sampled generations.

  python -m experiments.train_heads --checkpoint=specroll_jax/tasks/stories260K --out=workdir/heads

Generates `--num_sequences` responses with the vanilla engine (from `--prompts`, or from BOS
alone when no prompts file is given), runs one policy forward over them for the targets,
trains the heads with Optax, and prints per-head top-1 / top-5 agreement with the realised
tokens of held-out generations before and after training.
"""
from pathlib import Path

from absl import app, flags

from experiments.common import DEFAULT_CHECKPOINT, read_prompts
from specroll_jax import load_policy
from specroll_jax.adapt import distill
from specroll_jax.spec.heads import HeadsConfig

flags.DEFINE_string('checkpoint', str(DEFAULT_CHECKPOINT), 'HF-format policy directory.')
flags.DEFINE_string('out', None, 'Directory to write the heads to.')
flags.DEFINE_string('prompts', None, 'Optional JSONL prompts; default: generate from BOS.')
flags.DEFINE_bool('chat_template', False,
                  'Each prompt as a user turn through the tokenizer\'s chat template '
                  '(instruct models; base models keep raw prompts).')
flags.DEFINE_integer('num_sequences', 512, 'Training generations.')
flags.DEFINE_integer('held_out', 64, 'Held-out generations for the agreement report.')
flags.DEFINE_integer('max_new_tokens', 256, 'Tokens per generation.')
flags.DEFINE_float('temperature', 1.0, 'Sampling temperature of the generations.')
flags.DEFINE_integer('num_heads', 4, 'Horizon heads.')
flags.DEFINE_float('hidden_multiplier', 1.0, 'Head block width in units of the hidden size.')
flags.DEFINE_integer('steps', 800, 'Optimizer steps.')
flags.DEFINE_integer('batch_size', 32, 'Sequences per step.')
flags.DEFINE_float('learning_rate', 3e-3, 'AdamW learning rate.')
flags.DEFINE_integer('seed', 0, 'Seed for generation, init and batching.')
flags.mark_flags_as_required(['out'])
FLAGS = flags.FLAGS


def report(name, rates):
  for k, row in enumerate(rates):
    print(f'{name} head {k + 1}: top-1 {row[0]:.3f}  top-5 {row[:5].sum():.3f}')


def main(argv):
  del argv
  policy = load_policy(FLAGS.checkpoint)
  if FLAGS.prompts:
    texts = read_prompts(Path(FLAGS.prompts))
    prompts = [policy.prompt_ids(t, FLAGS.chat_template) for t in texts]
  else:
    prompts = [[policy.config.bos_token_id]]
  heads_config = HeadsConfig(FLAGS.num_heads, FLAGS.hidden_multiplier)
  config = distill.DistillConfig(batch_size=FLAGS.batch_size, steps=FLAGS.steps,
                                 learning_rate=FLAGS.learning_rate)
  plan = distill.WarmStart(num_sequences=FLAGS.num_sequences, held_out=FLAGS.held_out,
                           max_new_tokens=FLAGS.max_new_tokens, temperature=FLAGS.temperature,
                           seed=FLAGS.seed)
  result = distill.warm_start_and_save(policy, heads_config, config, prompts, plan, FLAGS.out,
                                       source=str(FLAGS.checkpoint))
  report('before', result.rank_hit_rate_before)
  report('after', result.rank_hit_rate_after)
  print(f'saved heads to {FLAGS.out}')


if __name__ == '__main__':
  app.run(main)
