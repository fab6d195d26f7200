"""The capacity profiler: knee selection, a real (tiny) measurement, and the profile cache."""
import dataclasses
import json
import math
import re

import pytest

from specroll_jax.speculative import capacity
from specroll_jax.speculative.capacity import CapacityProfile, pick_capacity


def _sweep(batch, latencies):
  """Rows for nodes 1, 2, 4, ... with the given latencies (ms), measured steadily."""
  return [(batch, 2 ** i, batch * 2 ** i, ms, 0.0) for i, ms in enumerate(latencies)]


def test_knee_is_last_total_before_first_crossing():
  rows = _sweep(8, [1.0, 1.0, 1.1, 1.3, 1.31, 2.0])
  assert pick_capacity(rows, knee_factor=1.3) == 8 * 8  # 1.3 is within, 1.31 is not
  # A noisy dip back under the threshold after the knee does not move it.
  assert pick_capacity(_sweep(8, [1.0, 1.1, 1.5, 1.2, 1.25]), knee_factor=1.3) == 16


def test_capacity_is_median_of_batches_and_at_least_largest_batch():
  rows = (_sweep(16, [1.0, 1.0, 2.0])             # knee at 32 tokens
          + _sweep(8, [1.0, 1.0, 1.0, 1.0, 2.0])  # knee at 64
          + _sweep(4, [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 2.0]))  # knee at 128
  assert pick_capacity(rows, 1.3) == 64
  # Every batch saturates at once: still one node per row at the largest batch.
  assert pick_capacity(_sweep(64, [1.0, 3.0]) + _sweep(8, [1.0, 3.0]), 1.3) == 64


def test_batches_that_never_cross_are_lower_bounds():
  flat = [1.0] * 5  # nodes 1..16 all within the knee
  # Most batches flat: C_hw is the largest total measured flat.
  rows = _sweep(32, flat) + _sweep(16, flat) + _sweep(8, [1.0, 2.0, 2.0, 2.0, 2.0])
  assert pick_capacity(rows, 1.3) == 32 * 16
  # A flat batch sorts above every knee, whatever its own total.
  rows = _sweep(32, [1.0, 1.0, 1.0, 2.0]) + _sweep(16, [1.0, 1.0, 2.0]) + _sweep(2, flat)
  assert pick_capacity(rows, 1.3) == 128


def test_bad_measurements_are_rejected():
  with pytest.raises(ValueError, match='no nodes=1'):
    pick_capacity([(8, 2, 16, 1.0, 0.0)], 1.3)
  with pytest.raises(ValueError, match='knee_factor'):
    pick_capacity(_sweep(8, [1.0, 1.0]), 1.0)


def test_relative_spread_ignores_one_slow_run_but_not_a_busy_machine():
  assert capacity.relative_spread([10.0, 10.1, 9.9, 10.0, 30.0]) == pytest.approx(0.01)
  assert capacity.relative_spread([10.0, 14.0, 9.0, 17.0, 12.0]) == pytest.approx(4.0 / 12.0)
  assert capacity.relative_spread([10.0]) == 0.0


def test_node_counts_double_up_to_the_maximum():
  assert capacity.node_counts(1) == [1]
  assert capacity.node_counts(8) == [1, 2, 4, 8]
  assert capacity.node_counts(6) == [1, 2, 4, 6]


def test_real_measurement_gives_a_sane_profile(stories_policy):
  config = stories_policy.config
  # Each (batch, nodes) compiles once (seconds on CPU), so the grid is kept to four shapes.
  profile = capacity.measure_capacity(config, stories_policy.params, batches=(4, 2),
                                      max_nodes=2, cache_length=32, repeats=2)
  assert profile.key == capacity.profile_key(config)
  assert [(b, n, t) for b, n, t, *_ in profile.measurements] == [
      (4, 1, 4), (4, 2, 8), (2, 1, 2), (2, 2, 4)]
  assert all(math.isfinite(ms) and ms > 0 and 0 <= spread < math.inf
             for *_, ms, spread in profile.measurements)
  assert profile.software == capacity.software_versions()
  assert profile.capacity_tokens == pick_capacity(profile.measurements, profile.knee_factor)
  assert 4 <= profile.capacity_tokens <= 8
  assert CapacityProfile.from_json(profile.to_json()) == profile


def _canned_profile(config, spread=0.01, capacity_tokens=128):
  fingerprint, dtype, backend, device_kind, cpu, software = capacity.profile_key(config)
  return CapacityProfile(
      config_fingerprint=fingerprint, dtype=dtype, backend=backend, device_kind=device_kind,
      host_cpu=cpu, software=software, capacity_tokens=capacity_tokens,
      measurements=((64, 1, 64, 1.0, spread), (64, 2, 128, 1.2, spread)),
      knee_factor=1.3, cache_length=256, created='2026-01-01T00:00:00+00:00')


def _fake_measurements(monkeypatch, profiles):
  """Replaces the measurement: each call returns the next of `profiles` (the last one
  repeats); returns the list of the calls' keyword arguments."""
  calls = []

  def measure(config, params, **kwargs):
    calls.append(kwargs)
    return profiles[min(len(calls), len(profiles)) - 1]

  monkeypatch.setattr(capacity, 'measure_capacity', measure)
  return calls


@pytest.fixture
def fake_measure(monkeypatch, stories_policy):
  """Replaces the measurement with a canned steady profile for this model."""
  profile = _canned_profile(stories_policy.config)
  return profile, _fake_measurements(monkeypatch, [profile])


def test_cached_profile_is_reused(tmp_path, stories_policy, fake_measure, monkeypatch):
  profile, calls = fake_measure
  config, params = stories_policy.config, stories_policy.params
  assert capacity.load_or_measure(config, params, tmp_path, repeats=3) == profile
  assert calls == [{'repeats': 3}]
  [path] = tmp_path.glob('*.json')  # and no temporary file left behind

  def fail(*args, **kwargs):
    raise AssertionError('measured although a valid profile was cached')

  monkeypatch.setattr(capacity, 'measure_capacity', fail)
  assert capacity.load_or_measure(config, params, tmp_path) == profile
  assert path == capacity.profile_path(profile.key, tmp_path)


def test_cache_dir_comes_from_the_environment(tmp_path, stories_policy, fake_measure,
                                              monkeypatch):
  monkeypatch.setenv(capacity.CACHE_DIR_ENV, str(tmp_path))
  profile, _ = fake_measure
  capacity.load_or_measure(stories_policy.config, stories_policy.params)
  assert capacity.profile_path(profile.key, tmp_path).is_file()


def _without(profile, field):
  raw = json.loads(profile.to_json())
  del raw[field]
  return json.dumps(raw)


@pytest.mark.parametrize('corrupt, reason', [
    (lambda p: '{"capacity_tokens": 12', 'unusable'),
    (lambda p: _without(p, 'capacity_tokens'), "missing fields \\['capacity_tokens'\\]"),
    (lambda p: p.to_json().replace('"measurements": [', '"measurements": [7, '), 'unusable'),
    (lambda p: dataclasses.replace(p, device_kind='TPU v9').to_json(), 'is for'),
    (lambda p: dataclasses.replace(p, host_cpu='another CPU x96').to_json(), 'is for'),
    (lambda p: dataclasses.replace(p, software='jax 0.4.30, jaxlib 0.4.30').to_json(),
     'is for'),
    (lambda p: dataclasses.replace(p, measurements=((64, 1, 64, 1.0, 0.5),
                                                    (64, 2, 128, 1.2, 0.5))).to_json(),
     'spread 0.500 > 0.100'),
])
def test_corrupt_or_mismatched_profile_is_measured_again(tmp_path, stories_policy, fake_measure,
                                                         caplog, corrupt, reason):
  profile, calls = fake_measure
  path = capacity.profile_path(profile.key, tmp_path)
  path.write_text(corrupt(profile))
  with caplog.at_level('WARNING'):
    assert capacity.load_or_measure(stories_policy.config, stories_policy.params,
                                    tmp_path) == profile
  assert len(calls) == 1
  [record] = [r for r in caplog.records if r.levelname == 'WARNING']
  assert str(path) in record.getMessage()
  assert re.search(reason, record.getMessage())
  assert CapacityProfile.from_json(path.read_text()) == profile


def test_a_busy_measurement_is_repeated_and_the_steadiest_kept(tmp_path, stories_policy,
                                                               monkeypatch, caplog):
  config = stories_policy.config
  busy = [_canned_profile(config, spread, capacity_tokens=tokens)
          for spread, tokens in ((0.4, 64), (0.2, 96), (0.3, 128))]
  calls = _fake_measurements(monkeypatch, busy)
  with caplog.at_level('WARNING'):
    profile = capacity.load_or_measure(config, stories_policy.params, tmp_path)
  assert len(calls) == capacity.MEASURE_ATTEMPTS
  assert profile == busy[1]
  warnings = [r.getMessage() for r in caplog.records if r.levelname == 'WARNING']
  assert len(warnings) == capacity.MEASURE_ATTEMPTS + 1
  assert 'keeping the steadiest of 3 busy' in warnings[-1]
  # Saved, but not trusted: the next load measures again, and keeps a steady result.
  steady = _canned_profile(config, 0.02, capacity_tokens=80)
  calls = _fake_measurements(monkeypatch, [steady])
  assert capacity.load_or_measure(config, stories_policy.params, tmp_path) == steady
  assert len(calls) == 1
  assert CapacityProfile.from_json(
      capacity.profile_path(steady.key, tmp_path).read_text()) == steady


def test_a_steady_measurement_is_not_repeated(tmp_path, stories_policy, monkeypatch):
  config = stories_policy.config
  profiles = [_canned_profile(config, 0.05), _canned_profile(config, 0.01)]
  calls = _fake_measurements(monkeypatch, profiles)
  assert capacity.load_or_measure(config, stories_policy.params, tmp_path) == profiles[0]
  assert len(calls) == 1
