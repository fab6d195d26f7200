"""Every shipped config loads and is consistent with what the trainer will build."""
import pytest

from configs import bench_w2, paper, tiny_math
from specroll_jax.tasks.data import load_dataset
from specroll_jax.adapt.reflex import ReflexConfig
from specroll_jax.adapt.monitor import SlowPathConfig
from specroll_jax.rl.trainer import ADAPTATION_MODES, grpo_config

PAPER_ARGS = [f'{m},{d}' for m in paper.MODELS for d in paper.DATASETS]


@pytest.mark.parametrize('config', [tiny_math.get_config()] + [paper.get_config(a) for a in PAPER_ARGS],
                         ids=['tiny_math'] + PAPER_ARGS)
def test_training_configs_are_consistent(config):
  rows = config.rollout.prompts_per_step * config.rollout.group_size
  assert rows % config.grpo.micro_batch_size == 0
  assert config.rollout.engine in ('vanilla', 'specroll')
  assert config.rollout.max_batch % 8 == 0
  grpo_config(config, config.adaptation.harvest_top_k)  # validates clip ranges, lr, ...
  assert config.adaptation.mode in ADAPTATION_MODES
  ReflexConfig(**config.adaptation.reflex)
  SlowPathConfig(**config.adaptation.slow_path)
  if not config.task.source.startswith('synthetic:'):
    assert load_dataset(config.task.source).examples


def test_paper_config_rejects_unknown_names():
  with pytest.raises(ValueError, match='choose MODEL'):
    paper.get_config('gpt2,gsm8k')


def test_bench_config_loads():
  c = bench_w2.get_config()
  assert c.num_prompts in c.batch_sweep and len(c.branching) <= c.heads.num_heads
