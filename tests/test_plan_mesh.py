"""Plans, meshes and the memory report: validation and clear errors."""
import jax
import optax
import pytest

import zerojax
from zerojax import plan as plans
from zerojax.executor.memory import memory_report
from tests import helpers


def test_mesh_shapes_and_errors():
  mesh = zerojax.make_mesh(2, 4)
  assert mesh.axis_names == ("node", "gpu") and mesh.devices.shape == (2, 4)
  assert [d.id for d in mesh.devices[1]] == [4, 5, 6, 7]
  assert zerojax.make_mesh(8).devices.shape == (8, 1)
  with pytest.raises(ValueError, match="8 devices cannot form 3 nodes"):
    zerojax.make_mesh(3)
  with pytest.raises(ValueError, match="needs 12 devices"):
    zerojax.make_mesh(2, 6)


def test_plan_validation():
  with pytest.raises(ValueError, match="must nest"):
    zerojax.Plan(param_axes=("node", "gpu"), grad_axes=("gpu",), opt_axes=("node", "gpu"))
  with pytest.raises(ValueError, match="not a dtype"):
    zerojax.Plan(param_dtype="float99")
  with pytest.raises(ValueError, match="names axis 'rack'"):
    zerojax.Plan(param_axes=("rack",), grad_axes=("rack",), opt_axes=("rack",)).validate(zerojax.make_mesh(2, 4))
  p = zerojax.Plan(param_axes=("gpu",), grad_axes=("gpu", "node"), opt_axes=("node", "gpu"))
  assert p.sharding.grad_order == ("gpu", "node") and p.sharding.opt_order == ("gpu", "node")
  assert plans.mics().sharding.replica_axes(zerojax.make_mesh(2, 4)) == ("node",)


def test_bad_inputs_get_clear_errors():
  mesh = zerojax.make_mesh(2, 4)
  ex = zerojax.Executor(helpers.tiny_gpt(), helpers.optimizer(), plans.zero3(), mesh)
  state = ex.init(jax.random.key(0))
  with pytest.raises(ValueError, match="divisible"):
    ex.step_fn()(state, jax.device_put(helpers.batches(1, 1, batch=12)[0]))
  with pytest.raises(ValueError, match="zero elements"):
    model = zerojax.Model(lambda r: {"u": {"w": jax.numpy.zeros((0, 3))}}, lambda p, t: 0.0)
    zerojax.Executor(model, helpers.optimizer(), plans.zero3(), mesh)
  with pytest.raises(ValueError, match="factored optimizers"):
    zerojax.Executor(helpers.tiny_gpt(), optax.adafactor(1e-3), plans.zero3(), mesh).init(jax.random.key(0))


@pytest.mark.parametrize("name", helpers.sweep(sorted(plans.PLANS), ["mics", "zeropp"]))
def test_memory_report_matches_plan(name):
  """Per-device bytes are P/s_p + G/s_g + OS/s_os; the measured shards of a live state agree."""
  mesh = zerojax.make_mesh(2, 4)
  ex = zerojax.Executor(helpers.tiny_gpt(), optax.adamw(1e-3), plans.PLANS[name](pad_multiple=4), mesh)
  rep = memory_report(ex, ex.init(jax.random.key(0)))
  exp, degree = rep["expected"], {"dp": 1, "zero1": 8, "zero2": 8, "zero3": 8, "mics": 4, "zeropp": 8}[name]
  n = exp["numel_padded"]
  assert exp["opt_shard_degree"] == degree
  assert exp["master"] == n * 4 // degree and exp["optimizer"] == 2 * n * 4 // degree
  assert exp["params"] == n * 2 // exp["param_shard_degree"]
  assert rep["measured"] == {"master": exp["master"], "optimizer": exp["optimizer"], "host": 0} and exp["host"] == 0
  assert exp["hpz_secondary"] == (n * 2 // 4 if name == "zeropp" else 0)
