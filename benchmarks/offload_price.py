"""The planner's price of host offload (`zerojax.planner.cost.offload_time`) on the GPU kit's cost case,
beside what the H100 measured.

  python benchmarks/offload_price.py [--out benchmarks/offload_price.json]

The case: `bench_offload.py`'s cost mode on one H100 (dp, GPT d_model 2048, 8 layers, seq 1,024, vocabulary
256, bf16, 4 sequences per step; the GPU kit's `offload_cost.json`, jax 0.11.2, 2026-11-26), whose step
took 42.16 ms without offload, 160.21 ms with `offload=("opt_state",)` and 249.13 ms with
`("opt_state", "master")`, both with every state fetched at once after the backward ("bulk"). The
workload is the executor's (`planner.workload`, its unit sizes and AdamW's 8 bytes per parameter: nothing
is compiled or run); the host link is the measured 54 GB/s each way (`probe.json`). Per setting and update
mode: the bytes each way per step (`cost.offload_bytes`), the price, and the predicted step (the measured
step without offload plus the price), and for the streamed update of both fields the step as it was priced
while the fp32 master weights were fetched before the forward (before the device kept their bf16 rounding
between steps, `TrainState.forward`). The goal of issue 44 for the streamed update: at most the step
without offload + 1.15 x 12 bytes per parameter / 54.27 GB/s (the measured host->device rate).

Prints one JSON object; `--out` also writes it.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

import zerojax  # noqa: E402
from zerojax import planner  # noqa: E402
from zerojax.models.gpt import GPTConfig, gpt  # noqa: E402
from zerojax.planner import cost  # noqa: E402
from zerojax.train.optim import make_optimizer  # noqa: E402

MEASURED_MS = {"none": 42.16, "opt_state bulk": 160.21, "opt_state,master bulk": 249.13}  # offload_cost.json
H2D = 54.27e9  # probe.json: host->device bytes/s


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  cfg = GPTConfig(vocab_size=256, seq_len=1024, d_model=2048, num_heads=16, num_layers=8)
  mesh = zerojax.make_mesh(1, 1, devices=jax.devices("cpu")[:1])
  ex = zerojax.Executor(gpt(cfg), make_optimizer(total_steps=1000), zerojax.dp(compute_dtype="bfloat16"), mesh)
  work = planner.workload(ex)
  dp = planner.Point(1, 1, 1)
  rows = {}
  for fields in (("opt_state",), ("opt_state", "master")):
    for mode in ("bulk", "streamed", "host"):
      if mode == "host" and fields != ("opt_state", "master"):
        continue  # the host update needs both fields (`zerojax.engine.host_update.check_host_update`)
      pt = dp.with_(offload=fields, offload_update=mode)
      moved = cost.offload_bytes(pt, work)
      price = cost.offload_time(pt, work)
      key = f"{','.join(fields)} {mode}"
      rows[key] = {"gb_to_device": round((moved["before"] + moved["to_device"]) / 1e9, 3),
                   "gb_to_host": round(moved["to_host"] / 1e9, 3), "price_ms": round(price * 1e3, 1),
                   "step_ms": round(MEASURED_MS["none"] + price * 1e3, 1)}
      if key in MEASURED_MS:
        rows[key]["measured_ms"] = MEASURED_MS[key]
        rows[key]["predicted_over_measured"] = round(rows[key]["step_ms"] / MEASURED_MS[key], 3)
  goal = MEASURED_MS["none"] + 1.15 * 12 * work.numel / H2D * 1e3
  both = rows["opt_state,master streamed"]
  # the same update with the fp32 master weights fetched before the forward, as before the device kept their
  # bf16 rounding between steps (4 bytes per parameter more host->device)
  before_ms = 4 * work.numel / work.host_link_bytes_per_s * 1e3
  both["step_ms_with_the_fp32_fetch_before_the_forward"] = round(both["step_ms"] + before_ms, 1)
  out = {"case": {"plan": "dp", "mesh": "1x1", "d_model": 2048, "layers": 8, "seq": 1024, "vocab": 256,
                  "dtype": "bfloat16", "parameters": work.numel, "chunks": sum(c for _, c in work.units)},
         "workload": {"host_link_bytes_per_s": work.host_link_bytes_per_s, "update_s_per_param": work.update_s_per_param,
                      "host_update_params_per_s": work.host_update_params_per_s, "opt_bytes_per_param": work.opt_bytes_per_param},
         "measured_ms": MEASURED_MS, "goal_streamed_ms": round(goal, 1), "rows": rows}
  text = json.dumps(out, indent=2)
  print(text)
  if args.out:
    with open(args.out, "w") as f:
      f.write(text + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
