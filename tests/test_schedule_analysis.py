"""`zerojax.analysis.schedule`'s reading of how long gathered weights live, on small hand-written HLO
modules (no GPU needed): a tuple that holds gathered weights beside an activation (as XLA builds when it
expands an optimization barrier) extends their life through its weight elements only, whichever order
the walk meets them in."""
from zerojax.analysis import schedule
from zerojax.analysis.hlo_text import Module

HLO = """HloModule m, is_scheduled=true

%s0 (p: f32[8]) -> f32[4] {
  %p = f32[8]{0} parameter(0)
  ROOT %s = f32[4]{0} slice(%p), slice={[0:4]}
}

%s1 (p: f32[8]) -> f32[4] {
  %p = f32[8]{0} parameter(0)
  ROOT %s = f32[4]{0} slice(%p), slice={[4:8]}
}

%c0 (p: f32[4]) -> bf16[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %c = bf16[4]{0} convert(%p)
}

ENTRY %main (a: f32[8], x: f32[4]) -> f32[4] {
  %a = f32[8]{0} parameter(0)
  %x = f32[4]{0} parameter(1)
  %done = f32[8]{0} copy(%a)
  %f0 = f32[4]{0} fusion(%done), kind=kLoop, calls=%s0
  %f1 = f32[4]{0} fusion(%done), kind=kLoop, calls=%s1
  %w0 = bf16[4]{0} fusion(%f0), kind=kLoop, calls=%c0
  %w1 = bf16[4]{0} fusion(%f1), kind=kLoop, calls=%c0
  %t = (bf16[4]{0}, bf16[4]{0}, f32[4]{0}) tuple(%w0, %w1, %x)
  %g0 = bf16[4]{0} get-tuple-element(%t), index=0
  %g1 = bf16[4]{0} get-tuple-element(%t), index=1
  %g2 = f32[4]{0} get-tuple-element(%t), index=2
  %u1 = bf16[4]{0} add(%g1, %g1)
  %u0 = bf16[4]{0} multiply(%g0, %g0)
  ROOT %late = f32[4]{0} negate(%g2)
}
"""


def test_a_tuple_extends_the_weights_life_through_each_weight_element_only():
  mod = Module(HLO)
  order = mod.comps[mod.entry]
  pos = {i.name: n for n, i in enumerate(order)}
  last, reaches_root = schedule.last_use(mod, mod.entry, mod.by_name[mod.entry]["done"], pos)
  assert last == pos["u0"]  # both weight elements are followed (u0 is met last through the longer path)
  assert last < pos["late"] and not reaches_root  # the activation beside them is not their use
