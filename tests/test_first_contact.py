"""First contact with `from_linen` / `from_nnx`, checked by structure: an object holding the flax module at
`.module` or `.model` (any class), and a `loss_fn` output that is no scalar loss or `(loss, aux)` (a
mapping, an `OrderedDict` subclass as Hugging Face's `ModelOutput` is, a dataclass, an array of the wrong
shape), each fail at wrap time in one line naming what was passed and the fix."""
import collections
import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import zerojax
from tests import flax_models as fm

BATCH = jax.tree.map(lambda x: x[:2], fm.batch())


class Wrapped:
  """Any object that holds a flax module as an attribute (not a Hugging Face class: no `.params`)."""

  def __init__(self, **attrs):
    self.__dict__.update(attrs)

  def __call__(self, *args, **kwargs):  # callable, as model wrappers are: not an NNX constructor
    raise AssertionError("the wrapper must not be called")


class Output(collections.OrderedDict):
  """A dict-like model output, as Hugging Face's `ModelOutput` (not a registered pytree)."""


@dataclasses.dataclass
class LossOutput:
  loss: jax.Array
  logits: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Metrics:
  """A dataclass registered as a pytree: valid aux."""
  logits: jax.Array


def wrap(adapter, module, loss_fn=fm.loss_fn):
  if adapter == "linen":
    return zerojax.from_linen(module, BATCH, loss_fn, units=(fm.Block,), mutable=("batch_stats",),
                              rngs=("dropout",))
  return zerojax.from_nnx(module, BATCH, loss_fn, units=(fm.NBlock,), mutable=("batch_stats",),
                          rngs=("dropout",))


def flax_module(adapter):
  return fm.Net(scan=False) if adapter == "linen" else fm.NNet(nnx.Rngs(0, dropout=1))


def one_line(excinfo) -> str:
  msg = str(excinfo.value)
  assert "\n" not in msg, msg
  return msg


@pytest.mark.parametrize("adapter", ["linen", "nnx"])
@pytest.mark.parametrize("attr", ["module", "model"])
def test_wrapper_holding_the_module(adapter, attr):
  with pytest.raises(TypeError) as e:
    wrap(adapter, Wrapped(**{attr: flax_module(adapter)}))
  kind = "a flax linen Module" if adapter == "linen" else "an NNX Module"
  assert one_line(e) == (f"module is a Wrapped holding {kind} at .{attr}; pass that module: "
                         f"zerojax.from_{adapter}(wrapped.{attr}, ...)")


@pytest.mark.parametrize("adapter", ["linen", "nnx"])
def test_wrapper_holding_the_other_kind_names_the_other_adapter(adapter):
  other = "nnx" if adapter == "linen" else "linen"
  with pytest.raises(TypeError, match=rf"at \.model; pass that module: zerojax\.from_{other}\(wrapped\.model"):
    wrap(adapter, Wrapped(model=flax_module(other)))


def loss_returning(make):
  """A loss_fn returning `make(loss, logits)` instead of a scalar loss or (loss, aux)."""
  def loss_fn(apply, batch, rng):
    logits = apply(batch["x"], train=rng is not None)
    return make(jnp.mean(logits ** 2), logits)
  return loss_fn


PREFIX = "loss_fn must return a scalar loss or (loss, aux); it returned "


@pytest.mark.parametrize("adapter", ["linen", "nnx"])
def test_mapping_output(adapter):
  with pytest.raises(ValueError) as e:
    wrap(adapter, flax_module(adapter), loss_returning(lambda loss, logits: {"loss": loss, "logits": logits}))
  assert one_line(e) == PREFIX + "a dict (return out['loss'], out)"


@pytest.mark.parametrize("adapter", ["linen", "nnx"])
def test_ordered_dict_subclass_output(adapter):
  """Not a pytree, so it cannot be aux as it is: the fix passes a dict of it."""
  with pytest.raises(ValueError) as e:
    wrap(adapter, flax_module(adapter), loss_returning(lambda loss, logits: Output(loss=loss, logits=logits)))
  assert one_line(e) == PREFIX + "an Output (return out['loss'], dict(out))"


@pytest.mark.parametrize("adapter", ["linen", "nnx"])
def test_dataclass_output(adapter):
  with pytest.raises(ValueError) as e:
    wrap(adapter, flax_module(adapter), loss_returning(LossOutput))
  assert one_line(e) == PREFIX + "a LossOutput (return out.loss, vars(out))"


@pytest.mark.parametrize("adapter", ["linen", "nnx"])
def test_wrong_shape_array_output(adapter):
  with pytest.raises(ValueError) as e:
    wrap(adapter, flax_module(adapter), loss_returning(lambda loss, logits: jnp.mean(logits ** 2, -1)))
  assert one_line(e) == PREFIX + "an array of shape (2,) (reduce it to the mean loss of the micro-batch)"


@pytest.mark.parametrize("adapter", ["linen", "nnx"])
def test_aux_that_is_no_pytree_of_arrays(adapter):
  with pytest.raises(ValueError) as e:
    wrap(adapter, flax_module(adapter), loss_returning(lambda loss, logits: (loss, LossOutput(loss, logits))))
  want = re.escape(PREFIX + "(loss, aux) with an aux holding a LossOutput") + r" \(.*\)"
  assert re.fullmatch(want, one_line(e))


@pytest.mark.parametrize("adapter", ["linen", "nnx"])
def test_accepted_outputs(adapter):
  """A scalar, a (loss, aux) pair with a dict or a registered dataclass as aux."""
  assert not wrap(adapter, flax_module(adapter), loss_returning(lambda loss, logits: loss)).has_aux
  for aux in (lambda loss, logits: {"logits": logits}, lambda loss, logits: Metrics(logits)):
    model = wrap(adapter, flax_module(adapter), loss_returning(lambda loss, logits: (loss, aux(loss, logits))))
    assert model.has_aux
