"""Kernels chosen by the platform a program is lowered for, never by the host's default device.

A program may be traced on one platform and compiled for another: on a CPU host, `jax.jit(f).lower`
for compile-only GPUs (`jax.experimental.topologies`) lowers for "cuda" while `jax.default_backend()`
is "cpu". So the kernels offer one implementation per platform through `jax.lax.platform_dependent`:
every branch is traced, and only the branch of the platform being lowered for is lowered (the cpu
branch runs the Pallas interpreter, the cuda branch compiles Triton kernels). A branch may instead be
a refusal: lowering it (or running it eagerly) raises its error, so no platform ever falls back to
another implementation silently. Platforms without a branch are refused the same way.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
from jax import lax
from jax.extend import core as jex_core
from jax.interpreters import mlir


@dataclasses.dataclass(frozen=True)
class Refusal:
  """A branch that must not be lowered: `error(message)` is raised when it is ("{platform}" in the
  message is replaced by the platform being lowered for)."""
  message: str
  error: type[Exception] = NotImplementedError

  def raise_for(self, platform: str):
    raise self.error(self.message.replace("{platform}", platform))


_refused_p = jex_core.Primitive("zerojax_kernel_refused")
_refused_p.multiple_results = True
_refused_p.def_abstract_eval(lambda *args, out_avals, refusal: out_avals)


def _refused_impl(*args, out_avals, refusal):
  del args, out_avals
  refusal.raise_for(jax.default_backend())


def _refused_lowering(ctx, *args, out_avals, refusal):
  del args, out_avals
  refusal.raise_for("/".join(ctx.module_context.platforms))


_refused_p.def_impl(_refused_impl)
mlir.register_lowering(_refused_p, _refused_lowering)

NO_KERNEL = Refusal(
    "the zerojax kernels (backend='pallas' or 'triton') have no implementation for {platform};"
    " use backend='xla'")


def choose(*args, cpu: Callable | Refusal, cuda: Callable | Refusal, like: Callable | None = None):
  """`lax.platform_dependent(*args, cpu=..., cuda=...)`, where a branch may be a `Refusal`.

  A refused branch claims the outputs' types of `like(*args)` (traced, never lowered; by default the
  branch that is not refused).
  """
  like = like or (cpu if callable(cpu) else cuda)
  if not callable(like):
    raise ValueError("choose: both branches are refused; pass `like`, a function giving the outputs")
  closed, shapes = jax.make_jaxpr(like, return_shape=True)(*args)
  out_avals, treedef = tuple(closed.out_avals), jax.tree.structure(shapes)

  def branch(b):
    if callable(b):
      return b
    return lambda *a: jax.tree.unflatten(treedef, _refused_p.bind(*a, out_avals=out_avals, refusal=b))

  return lax.platform_dependent(*args, cpu=branch(cpu), cuda=branch(cuda), default=branch(NO_KERNEL))
