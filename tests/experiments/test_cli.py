"""The generate CLI end to end on stories260K: vanilla and specroll write the same samples."""
import json
import subprocess
import sys

import pytest

from specroll_jax.speculative.heads import HeadsConfig, init_heads, save_heads
from tests.conftest import REPO


def _generate(tmp_path, engine, *extra):
  out = tmp_path / f'{engine}.jsonl'
  subprocess.run([sys.executable, '-m', 'experiments.generate',
                  '--prompts=experiments/prompts/story_openings.jsonl', '--num_samples=2',
                  '--max_new_tokens=16', '--seed=3', f'--engine={engine}', f'--out={out}',
                  # The 16 rows' own bucket: larger ones would only be compiled and priced.
                  '--max_batch=16',
                  *extra], cwd=REPO, check=True, capture_output=True, text=True)
  return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.mark.slow
def test_generate_cli_engines_agree(tmp_path, stories_policy):
  save_heads(tmp_path / 'heads', HeadsConfig(), init_heads(HeadsConfig(), stories_policy.config))
  vanilla = _generate(tmp_path, 'vanilla')
  spec = _generate(tmp_path, 'specroll', f'--proposer_dir={tmp_path / "heads"}',
                   '--capacity_tokens=64')
  assert len(vanilla) == 8
  assert {'prompt_index', 'sample_index', 'token_ids', 'text', 'logprobs',
          'finish_reason'} <= set(vanilla[0])
  assert [r['token_ids'] for r in vanilla] == [r['token_ids'] for r in spec]
  assert vanilla[0]['text'] == stories_policy.tokenizer.decode(vanilla[0]['token_ids'],
                                                               skip_special_tokens=True)
