"""Plain logical parameters out of a train state, as `.npz`, and back."""
from __future__ import annotations

import os

import jax
import numpy as np

from zerojax.engine.layout import path_names
from zerojax.train.state_spec import SEP


def export_params(executor, state, path: str | None = None) -> dict:
  """The master weights as plain numpy arrays in the model's shapes; also written to `path` (.npz).

  Every process must call it (the arrays are gathered); only process 0 writes the file, whose keys are
  the leaves' paths joined by "/" (e.g. "blocks/qkv/kernel"; `load_params` rebuilds the tree).
  """
  params = executor.logical_params(state)
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    params = multihost_utils.process_allgather(params, tiled=True)
  params = jax.tree.map(np.asarray, params)
  if path is not None and jax.process_index() == 0:
    flat = {SEP.join(path_names(p)): x for p, x in jax.tree_util.tree_leaves_with_path(params)}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    np.savez(path, **flat)
  return params


def load_params(path: str) -> dict:
  """Reads a file written by `export_params` back into a nested dict of numpy arrays."""
  out = {}
  with np.load(path) as f:
    for key in f.files:
      d = out
      *parents, last = key.split(SEP)
      for n in parents:
        d = d.setdefault(n, {})
      d[last] = f[key]
  return out
