"""The rollout profile by batch bucket: medians per bucket, buckets one engine never visits."""
import ml_collections

from experiments.lib import bucket_times as buckets
from experiments.lib.results import write
from specroll_jax.rollout.driver import Segment


def _segment(batch, seconds, tokens):
  return Segment(batch=batch, running=batch, seconds=seconds, tokens=tokens, row_steps=tokens)


def test_buckets_are_summed_per_rollout_then_medians_taken():
  rollouts = [[_segment(32, 10.0, 320), _segment(16, 2.0, 40), _segment(16, 1.0, 20)],
              [_segment(32, 12.0, 320), _segment(16, 4.0, 60)],
              [_segment(32, 11.0, 320)]]
  per_bucket = buckets.by_bucket(rollouts)
  assert list(per_bucket) == [32, 16]
  assert per_bucket[32] == {'seconds': 11.0, 'tokens': 320, 'row_steps': 320}
  # 3 s and 4 s where the bucket ran, 0 in the rollout that never reached it.
  assert per_bucket[16] == {'seconds': 3.0, 'tokens': 60, 'row_steps': 60}


def test_report_compares_each_bucket_and_names_those_one_engine_never_ran(tmp_path):
  segments = {'vanilla': [[_segment(32, 10.0, 300)]],
              'specroll': [[_segment(32, 8.0, 300), _segment(4, 1.0, 10)]]}
  summaries = {'vanilla': {'tau': 1.0}, 'specroll': {'tau': 1.5, 'tree_step_share': 0.25}}
  data = buckets.summary(segments, summaries, {'vanilla': [], 'specroll': [[32, 2.0]]})
  assert list(data['buckets']['specroll']) == ['32', '4']
  assert data['speedup'] == {'specroll': 10.0 / 9.0}
  c = ml_collections.ConfigDict({'variants': ('vanilla', 'specroll'),
                                 'rollout': {'prompts_per_step': 4, 'group_size': 8}})
  result = buckets.report(c, data)
  write(result, tmp_path, tensorboard_dir=tmp_path / 'tensorboard')
  table = (tmp_path / 'README.md').read_text()
  assert '| 32 | 10.00 | 30.0 | 8.00 | 37.5 | 1.25 |' in table
  assert '| 4 | - | - | 1.00 | 10.0 | - |' in table
