"""Memory per device of a GRPO config on a mesh, before launching it.

  python -m experiments.measure.memory_report --config=configs/paper.py:qwen2.5-7b,gsm8k \
      --devices=8
  python -m experiments.measure.memory_report --config=configs/paper.py:qwen2.5-7b,gsm8k \
      --devices=8 --config.grpo.lora_rank=64 --config.grpo.lora_alpha=32

The model's shapes come from config.policy.checkpoint's config.json, else (the paper
configs) from configs/paper.py's ARCHITECTURES. The rollout cache and the learner's rows are
--prompt_width + rollout.driver.max_new_tokens wide (the trainer uses the longest task prompt,
rounded up to 16).
"""
import sys
from pathlib import Path

from absl import app, flags
from ml_collections import config_flags

from configs import paper
from specroll_jax.model.config import config_from_hf, load_config
from specroll_jax.model.mesh import AXES
from specroll_jax.rl import memory
from specroll_jax.rl.run_config import run_config
from specroll_jax.rl.learned_proposers import KINDS
from experiments.lib.results import command_line, write_json

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/tiny_math.py')
flags.DEFINE_integer('devices', 8, 'Devices the run will have (all processes together).')
flags.DEFINE_integer('prompt_width', 256,
                     'Prompt slots per row (GSM8K chat prompts: 85-169 tokens).')
flags.DEFINE_string('architecture', '', f'One of {sorted(paper.ARCHITECTURES)}; default: the '
                    'checkpoint\'s config.json, else the paper config\'s model.')
flags.DEFINE_string('out', '', 'Also write the report as JSON here.')
FLAGS = flags.FLAGS


def model_config(c):
  checkpoint = Path(c.policy.checkpoint) if c.policy.checkpoint else None
  if not FLAGS.architecture and checkpoint is not None and (checkpoint / 'config.json').is_file():
    return load_config(checkpoint, c.policy.dtype)
  name = FLAGS.architecture or (checkpoint.name if checkpoint else '')
  if name not in paper.ARCHITECTURES:
    sys.exit(f'error: no config.json at {checkpoint}; pass --architecture from '
             f'{sorted(paper.ARCHITECTURES)}')
  return config_from_hf(paper.ARCHITECTURES[name], Path(f'configs/paper.py:{name}'),
                        c.policy.dtype)


def main(argv):
  del argv
  c = _CONFIG.value
  config = model_config(c)
  run = run_config(c, num_devices=FLAGS.devices)
  shape = dict(zip(AXES, run.mesh.shape(FLAGS.devices)))
  width = FLAGS.prompt_width + run.rollout.driver.max_new_tokens
  learned = run.rollout.learned_proposer
  proposer = None
  if learned is not None:
    kind = KINDS[learned]
    proposer = kind.memory(config, kind.static_config(run))
  report = memory.report(config, memory.Workload.from_config(run, width, proposer), shape)
  print(report.table())
  if FLAGS.out:
    write_json(FLAGS.out, {'command': command_line('experiments.measure.memory_report'),
                           'mesh': report.mesh, 'parts': dict(report.parts),
                           'total': report.total})


if __name__ == '__main__':
  app.run(main)
