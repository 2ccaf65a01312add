"""The offloaded update computed on the host (`Sharding.offload_update="host"`, `zerojax.engine.host_update.host_update`,
`compute_on("device_host")`): it trains what the device trains, bit for bit on CPUs (the same XLA:CPU ops),
its states never leave host memory, and the settings it cannot run are refused in one line. Its compiled H100
program's moves are in test_offload_gpu.py."""
from __future__ import annotations

import chex
import jax
import pytest

import zerojax
import zerojax.plan as plans
from tests import helpers
from zerojax.engine.offload import HOST

BOTH = ("opt_state", "master")


@pytest.mark.parametrize("plan", ["dp", "zero3", "mics"])
def test_host_update_trains_bitwise_what_the_device_trains(plan):
  """3 steps of 2 micro-batches, AdamW after clipping by the global norm: losses and the whole train state equal
  those without offload; the master weights and moments stay in host memory."""
  mesh = zerojax.make_mesh(2, 4)
  make = getattr(plans, plan)
  _, ref, _, ref_losses = helpers.run(make(), mesh, helpers.optimizer())
  ex, state, _, losses = helpers.run(make(offload=BOTH, offload_update="host"), mesh, helpers.optimizer())
  assert ex.placement.offload.on_host
  assert losses == ref_losses
  chex.assert_trees_all_equal(state, ref)
  for field in (state.opt_state, state.params):
    assert {x.sharding.memory_kind for x in jax.tree.leaves(field) if x.ndim} == {HOST}


def test_offload_update_values_are_refused_in_one_line():
  with pytest.raises(ValueError, match="offload_update='sideways'.*'streamed'") as e:
    plans.dp(offload=BOTH, offload_update="sideways")
  assert "\n" not in str(e.value)
  mesh = zerojax.make_mesh(1, 1, devices=jax.devices()[:1])
  # the update reads and writes the master weights where they live: both fields on the host
  with pytest.raises(ValueError, match=r"needs offload=\('opt_state', 'master'\).*offload_update='streamed'") as e:
    zerojax.Executor(helpers.tiny_gpt(), helpers.optimizer(), plans.dp(offload=("opt_state",), offload_update="host"),
                     mesh)
  assert "\n" not in str(e.value)
  # without offload the setting moves nothing and is accepted
  assert not zerojax.Executor(helpers.tiny_gpt(), helpers.optimizer(), plans.dp(offload_update="host"),
                              mesh).placement.offload.on_host
