"""The W1 default policy: a small Llama pretrained on synthetic_math, cached on disk.

The GRPO main job calls ensure_default_policy so that a fresh machine builds the policy it
post-trains (about 10 minutes on a 2-core CPU) instead of downloading one; later runs reuse
the cached directory. The training is pretrain.pretrain, the same as
experiments/pretrain_policy.py.
"""
import sys
from pathlib import Path

from specroll_jax.tasks import pretrain

DIRECTORY_NAME = 'w1_synthetic_math_policy'


def ensure_default_policy(cache_dir, config: pretrain.PretrainConfig = pretrain.PretrainConfig(),
                          tokenizer_dir: Path = pretrain.DEFAULT_TOKENIZER_DIR) -> Path:
  """Returns cache_dir/w1_synthetic_math_policy, pretraining it there first if missing.

  A directory that holds a policy is complete: pretrain publishes it in one rename.
  """
  directory = Path(cache_dir) / DIRECTORY_NAME
  if not pretrain.has_policy(directory):
    print(f'building the default W1 policy in {directory}', file=sys.stderr)
    report = pretrain.pretrain(config, directory, tokenizer_dir=tokenizer_dir)
    print(f'default policy: easy accuracy {report["accuracy_easy"]:.3f}, hard accuracy '
          f'{report["accuracy_hard"]:.3f}', file=sys.stderr)
  return directory
