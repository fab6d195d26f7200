"""Config sections <-> config dataclasses: each default lives in its dataclass only.

Shipped configs build a section from the dataclass (`section`), setting only what differs,
so every field exists for `--config.x=` overrides; the trainer builds the dataclass back
(`build`), and a key the dataclass does not have is an error that names it.
"""
import dataclasses

import ml_collections


def section(cls, exclude=(), **overrides) -> ml_collections.ConfigDict:
  """A ConfigDict of `cls`'s fields at their defaults, with `overrides` applied; fields in
  `exclude` are derived from other sections by the trainer."""
  fields = {f.name: f.default for f in dataclasses.fields(cls) if f.name not in exclude}
  unknown = sorted(set(overrides) - set(fields))
  if unknown:
    raise ValueError(f'{cls.__name__} has no field(s) {unknown}')
  required = sorted(name for name, default in fields.items()
                    if default is dataclasses.MISSING and name not in overrides)
  if required:
    raise ValueError(f'{cls.__name__} needs a value for {required} (no default)')
  return ml_collections.ConfigDict({**fields, **overrides})


def build(cls, config_section, name: str, **derived):
  """`cls` from a config section (`name` for errors, e.g. 'adaptation.reflex') and the
  fields the trainer derives elsewhere."""
  values = {key: config_section[key] for key in config_section.keys()}
  fields = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(values) - fields)
  if unknown:
    raise ValueError(f'config {name}: unknown field(s) {unknown} (valid: {sorted(fields)})')
  clash = sorted(set(values) & set(derived))
  if clash:
    raise ValueError(f'config {name}: field(s) {clash} are derived by the trainer; remove them')
  return cls(**values, **derived)
