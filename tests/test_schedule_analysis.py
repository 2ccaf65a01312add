"""`zerojax.analysis.schedule` on small hand-written HLO modules (no GPU needed): how long gathered
weights live (a tuple that holds gathered weights beside an activation, as XLA builds when it expands an
optimization barrier, extends their life through its weight elements only, whichever order the walk
meets them in), and the role of a collective XLA:GPU combined from several (its own source path gone)."""
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


# A MiCS backward layer loop as XLA:GPU schedules it (2 nodes x 4 gpus): the replica all-reduce over
# `node` of the layer's reduced leaves, combined into one buffer (no source path of its own; the slices
# that unpack it keep the psum's), with a matmul scheduled between its start and done; after the loop,
# the gradient norm's two scalar partial sums over `gpu`, combined the same way.
COMBINED = """HloModule m, is_scheduled=true, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%cat (a: f32[4], b: f32[4]) -> f32[8] {
  %a = f32[4]{0} parameter(0)
  %b = f32[4]{0} parameter(1)
  ROOT %c = f32[8]{0} concatenate(%a, %b), dimensions={0}
}

%lo (p: f32[8]) -> f32[4] {
  %p = f32[8]{0} parameter(0)
  ROOT %s = f32[4]{0} slice(%p), slice={[0:4]}
}

%hi (p: f32[8]) -> f32[4] {
  %p = f32[8]{0} parameter(0)
  ROOT %s = f32[4]{0} slice(%p), slice={[4:8]}
}

%mm (a: f32[4,4], b: f32[4,4]) -> f32[4,4] {
  %a = f32[4,4]{1,0} parameter(0)
  %b = f32[4,4]{1,0} parameter(1)
  ROOT %d = f32[4,4]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%pair (a: f32[], b: f32[]) -> f32[2] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  %ra = f32[1]{0} reshape(%a)
  %rb = f32[1]{0} reshape(%b)
  ROOT %c = f32[2]{0} concatenate(%ra, %rb), dimensions={0}
}

%first (p: f32[2]) -> f32[1] {
  %p = f32[2]{0} parameter(0)
  ROOT %s = f32[1]{0} slice(%p), slice={[0:1]}
}

%second (p: f32[2]) -> f32[1] {
  %p = f32[2]{0} parameter(0)
  ROOT %s = f32[1]{0} slice(%p), slice={[1:2]}
}

%body (p: (s32[], f32[4], f32[4], f32[4,4])) -> (s32[], f32[4], f32[4], f32[4,4]) {
  %p = (s32[], f32[4]{0}, f32[4]{0}, f32[4,4]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[4]{0} get-tuple-element(%p), index=1
  %y = f32[4]{0} get-tuple-element(%p), index=2
  %w = f32[4,4]{1,0} get-tuple-element(%p), index=3
  %packed = f32[8]{0} fusion(%x, %y), kind=kLoop, calls=%cat
  %ars = f32[8]{0} all-reduce-start(%packed), channel_id=1, replica_groups={{0,4},{1,5},{2,6},{3,7}}, use_global_device_ids=true, to_apply=%add
  %g = f32[4,4]{1,0} fusion(%w, %w), kind=kCustom, calls=%mm, metadata={op_name="jit(_train_step)/shard_map/transpose(jvp())/while/body/closed_call/dot_general"}
  %ard = f32[8]{0} all-reduce-done(%ars)
  %s0 = f32[4]{0} fusion(%ard), kind=kLoop, calls=%lo, metadata={op_name="jit(_train_step)/shard_map/transpose(jvp())/while/body/closed_call/psum"}
  %s1 = f32[4]{0} fusion(%ard), kind=kLoop, calls=%hi, metadata={op_name="jit(_train_step)/shard_map/transpose(jvp())/while/body/closed_call/psum"}
  ROOT %t = (s32[], f32[4]{0}, f32[4]{0}, f32[4,4]{1,0}) tuple(%i, %s0, %s1, %g)
}

%cond (p: (s32[], f32[4], f32[4], f32[4,4])) -> pred[] {
  %p = (s32[], f32[4]{0}, f32[4]{0}, f32[4,4]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(2)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (a: (s32[], f32[4], f32[4], f32[4,4]), u: f32[], v: f32[]) -> f32[] {
  %a = (s32[], f32[4]{0}, f32[4]{0}, f32[4,4]{1,0}) parameter(0)
  %u = f32[] parameter(1)
  %v = f32[] parameter(2)
  %loop = (s32[], f32[4]{0}, f32[4]{0}, f32[4,4]{1,0}) while(%a), condition=%cond, body=%body, metadata={op_name="jit(_train_step)/shard_map/transpose(jvp())/while"}, backend_config={"known_trip_count":{"n":"2"}}
  %sums = f32[2]{0} fusion(%u, %v), kind=kLoop, calls=%pair
  %nrs = f32[2]{0} all-reduce-start(%sums), channel_id=2, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%add
  %nrd = f32[2]{0} all-reduce-done(%nrs)
  %n0 = f32[1]{0} fusion(%nrd), kind=kLoop, calls=%first
  %n1 = f32[1]{0} fusion(%nrd), kind=kLoop, calls=%second
  %b0 = f32[] bitcast(%n0), metadata={op_name="jit(_train_step)/reduce_sum"}
  %b1 = f32[] bitcast(%n1), metadata={op_name="jit(_train_step)/reduce_sum"}
  ROOT %norm = f32[] add(%b0, %b1), metadata={op_name="jit(_train_step)/add"}
}
"""


def test_a_combined_in_backward_all_reduce_is_the_replica_sync_and_counted_in_the_overlap_table():
  """XLA:GPU's combiner drops the replica all-reduce's source path: the role comes from the psum's slices
  ("replica sync", not "other"), and the overlap table counts it with the layer loops' other roles."""
  from jax.sharding import AbstractMesh

  found = schedule.schedule_from_hlo(COMBINED, AbstractMesh((2, 4), ("node", "gpu")))
  sync, norm = found
  assert (sync.collective.op, sync.collective.axes, sync.collective.op_name) == ("all-reduce", ("node",), "")
  assert sync.collective.role == "replica sync" and sync.in_layer_loop and sync.collective.count == 2
  assert (sync.matmuls, sync.kernels) == (1, 1)
  assert norm.collective.role == "metrics" and not norm.in_layer_loop  # two scalars packed into one f32[2]
  assert schedule.overlap_summary(found) == {"replica sync": {"in_loop": 1, "overlapped": 1}}
