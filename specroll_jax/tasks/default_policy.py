"""The W1 default policy: a small Llama pretrained on synthetic_math, committed to the repo.

The GRPO main job post-trains it. The committed directory (w1_policy/, 2 MB) was built on
an idle 2-core CPU with

  python -m experiments.pretrain_policy --out=specroll_jax/tasks/w1_policy

(pretrain.PretrainConfig's defaults; its pretrain_report.json holds the config, accuracy,
and the weights' sha256), so every machine starts from the same policy at once. Any other
build config is pretrained on first use into cache_dir, under a name keyed by that config,
so a changed config never reuses a policy built with another.
"""
import dataclasses
import hashlib
import json
import sys
from pathlib import Path

from specroll_jax.tasks import pretrain

COMMITTED_POLICY = Path(__file__).parent / 'w1_policy'
DIRECTORY_PREFIX = 'w1_synthetic_math_'


def build_key(config: pretrain.PretrainConfig, tokenizer_dir: Path) -> str:
  """A short hash of everything a build depends on."""
  spec = dict(dataclasses.asdict(config), tokenizer_dir=str(Path(tokenizer_dir).resolve()))
  return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]


def committed_config() -> pretrain.PretrainConfig:
  report = json.loads((COMMITTED_POLICY / pretrain.REPORT_FILE).read_text())
  return pretrain.PretrainConfig(**report['config'])


def ensure_default_policy(cache_dir, config: pretrain.PretrainConfig = pretrain.PretrainConfig(),
                          tokenizer_dir: Path = pretrain.DEFAULT_TOKENIZER_DIR) -> Path:
  """The committed policy when it was built with `config`; otherwise
  cache_dir/w1_synthetic_math_<build key>, pretrained there first if missing.

  A directory that holds a policy is complete: pretrain publishes it in one rename.
  """
  same_tokenizer = Path(tokenizer_dir).resolve() == pretrain.DEFAULT_TOKENIZER_DIR.resolve()
  if same_tokenizer and config == committed_config():
    return COMMITTED_POLICY
  directory = Path(cache_dir) / f'{DIRECTORY_PREFIX}{build_key(config, tokenizer_dir)}'
  if not pretrain.has_policy(directory):
    print(f'building a W1 policy in {directory}', file=sys.stderr)
    report = pretrain.pretrain(config, directory, tokenizer_dir=tokenizer_dir)
    print(f'W1 policy: easy accuracy {report["accuracy_easy"]:.3f}, hard accuracy '
          f'{report["accuracy_hard"]:.3f}', file=sys.stderr)
  return directory
