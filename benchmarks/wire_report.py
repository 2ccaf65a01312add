"""Wire report: every plan x link speed on an emulated cluster, measured bytes against the analysis.

For each plan, `python -m zerojax.cli.account` predicts the bytes each node sends to other nodes per step
(ring-order model); for each plan and link rate, `benchmarks/cluster.py` runs `train.py` on N namespaced
nodes x G CPU devices and measures step time and the bytes that crossed each node's link. Writes a
markdown table into `benchmarks/RESULTS.md` (between `<!-- wire-report -->` and `<!-- /wire-report -->`),
a chart `benchmarks/wire_report.png` and the raw numbers `benchmarks/wire_report.json`.

  python benchmarks/wire_report.py [--plans dp,zero1,zero2,zero3,mics,zeropp] [--rates 100mbit,1gbit,none]
      [--nodes 2 --devices 4] [--steps 12] [--gin_param=model_config.num_layers=2]
  python benchmarks/wire_report.py --from_json benchmarks/wire_report.json   # only re-render

Needs root (see cluster.py). Takes minutes per run on a small machine: plans x rates runs in all.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
BEGIN, END = "<!-- wire-report -->", "<!-- /wire-report -->"
PLANS = ("dp", "zero1", "zero2", "zero3", "mics", "zeropp")
RATES = ("100mbit", "1gbit", "none")


class _Child:
  """The running subprocess, so that SIGTERM reaches it (it cleans up its own namespaces)."""
  proc: subprocess.Popen | None = None


def _run_json(cmd: list[str], what: str) -> dict:
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  _Child.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  out, err = _Child.proc.communicate()
  code, _Child.proc = _Child.proc.returncode, None
  if code:
    raise RuntimeError(f"{what} failed (exit {code}):\n{err[-3000:]}")
  return json.loads(out)


def account(plan: str, args) -> dict:
  cmd = [sys.executable, "-m", "zerojax.cli.account", "--json", f"--gin_file=configs/{plan}.gin",
         f"--mesh={args.nodes}x{args.devices}", *[f"--gin_param={p}" for p in args.gin_param]]
  rep = _run_json(cmd, f"accounting of {plan}")
  return {"model_parameters": rep["model_parameters"], "model_bytes": rep["model_bytes"],
          "cross_node_bytes_per_node": rep["cross_node_bytes_per_node"], "table1": rep["table1"],
          "config": rep["config"]}


def measure(plan: str, rate: str, args) -> dict:
  cmd = [sys.executable, os.path.join(HERE, "cluster.py"), f"--gin_file=configs/{plan}.gin",
         f"--nodes={args.nodes}", f"--devices={args.devices}", f"--rate={rate}", f"--delay={args.delay}",
         f"--steps={args.steps}", *[f"--gin_param={p}" for p in args.gin_param]]
  return _run_json(cmd, f"cluster run of {plan} at {rate}")


def _mb(x: float | None) -> str:
  return "–" if x is None else f"{x / 1e6:.2f}"


def rows(report: dict) -> list[dict]:
  """One row per (rate, plan) with the table's derived columns."""
  runs = {(r["rate"], r["plan"]): r for r in report["runs"]}
  out = []
  for rate in report["rates"]:
    base = runs.get((rate, "zero3"))
    for plan in report["plans"]:
      r = runs.get((rate, plan))
      if r is None:
        continue
      acc = report["accounting"].get(plan, {})
      measured = r["cross_node_payload_bytes_per_step_per_node"]
      predicted = acc.get("cross_node_bytes_per_node")
      out.append({
          "rate": rate, "plan": plan, "step_time_s": r["median_step_time_s"], "tokens_per_s": r["tokens_per_s"],
          "speedup": base["median_step_time_s"] / r["median_step_time_s"] if base else None,
          "measured_bytes": measured, "accounted_bytes": predicted,
          "measured_over_accounted": measured / predicted if predicted else None,
          "measured_vs_zero3": measured / base["cross_node_payload_bytes_per_step_per_node"] if base else None,
          "accounted_vs_zero3": (predicted / report["accounting"]["zero3"]["cross_node_bytes_per_node"]
                                 if predicted and "zero3" in report["accounting"] else None),
      })
  return out


def _bits_per_s(rate: str) -> float | None:
  units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
  for u, f in units.items():
    if rate.lower().endswith(u):
      return float(rate[:-len(u)]) * f
  return None  # unshaped


def crossover(report: dict, plan: str = "zeropp") -> dict | None:
  """Link speed at which `plan` and ZeRO-3 take equally long, from t = C + 8·B / rate per plan.

  C (the step's time without the wire) is fitted per plan as the mean of t - 8·B/rate over the measured
  rates, B being the measured cross-node bytes per step; unshaped runs count with an infinite rate.
  """
  fits = {}
  for p in ("zero3", plan):
    pts = [(r["median_step_time_s"], r["cross_node_payload_bytes_per_step_per_node"], _bits_per_s(r["rate"]))
           for r in report["runs"] if r["plan"] == p]
    if not pts:
      return None
    c = sum(t - (8 * b / bps if bps else 0.0) for t, b, bps in pts) / len(pts)
    fits[p] = (c, sum(b for _, b, _ in pts) / len(pts))
  (c3, b3), (cp, bp) = fits["zero3"], fits[plan]
  rate = 8 * (b3 - bp) / (cp - c3) if cp > c3 else float("inf")
  return {"plan": plan, "compute_s": {"zero3": c3, plan: cp}, "crossover_bits_per_s": rate}


def markdown(report: dict) -> str:
  fmt = lambda x, f: "–" if x is None else format(x, f)  # noqa: E731
  lines = [
      BEGIN, "", "### Measuring the wire: plans on an emulated cluster", "",
      "`" + " ".join(["python benchmarks/wire_report.py", *report["argv"]]) + "`", "",
      f"{report['nodes']} nodes x {report['devices']} CPU devices, one `train.py` process per node in its own "
      f"network namespace, veth links through a bridge shaped with `tc` (delay {report['delay']}); "
      f"{report['steps']} steps, bytes and median step time over steps {report['window']}. "
      f"Model: {report['model']}. Measured on {report['date']} on a machine with {report['cpus']} CPU cores "
      f"shared with other work (load average {report['load_before']} before, {report['load_after']} after), "
      "so step times are noisy; the bytes are not.", "",
      "Cross-node bytes are per node per step: *measured* = frames sent on the node's link minus 66 header "
      "bytes per frame; *accounted* = `python -m zerojax.cli.account` on the compiled step (ring-order "
      "model, `node_egress_bytes`). Ratios are to ZeRO-3 at the same rate.", "",
      "| link | plan | step time (s) | tokens/s | speedup vs ZeRO-3 | measured MB/step | accounted MB/step "
      "| measured / accounted | measured vs ZeRO-3 | accounted vs ZeRO-3 |",
      "|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in rows(report):
    lines.append(
        f"| {r['rate']} | {r['plan']} | {r['step_time_s']:.3f} | {r['tokens_per_s']:,.0f} | "
        f"{fmt(r['speedup'], '.2f')} | {_mb(r['measured_bytes'])} | {_mb(r['accounted_bytes'])} | "
        f"{fmt(r['measured_over_accounted'], '.2f')} | {fmt(r['measured_vs_zero3'], '.2f')} | "
        f"{fmt(r['accounted_vs_zero3'], '.2f')} |")
  acc = report["accounting"]
  if "zero3" in acc and "zeropp" in acc:
    lines += ["", "ZeRO++ Table 1 from the accounting (bytes a node sends to other nodes per step, in M = "
              f"{acc['zero3']['model_bytes'] / 1e6:.2f} MB = parameters x 2 bytes; the wire dtype is the "
              "config's):", "", "| plan | forward all-gather | backward all-gather | gradient reduction | total |",
              "|---|---|---|---|---|"]
    for plan in ("zero3", "zeropp"):
      t = acc[plan]["table1"]
      cells = " | ".join(f"{t[k]['over_model']:.3f} M" for k in
                         ("forward all-gather", "backward all-gather", "gradient reduction", "total"))
      lines.append(f"| {plan} | {cells} |")
  x = crossover(report)
  if x:
    rate = x["crossover_bits_per_s"]
    lines += ["", f"Fitting t = C + 8·B/rate per plan: C = {x['compute_s']['zero3']:.3f} s (ZeRO-3) and "
              f"{x['compute_s']['zeropp']:.3f} s (ZeRO++); "
              + ("ZeRO++ is faster at every link speed: its C is not larger, so there is no crossover."
                 if rate == float("inf") else
                 f"ZeRO++ is faster below a link speed of about {rate / 1e9:.2f} Gbit/s (the crossover).")]
  lines += ["", f"![wire report]({os.path.basename(report['png'])})", "", END]
  return "\n".join(lines)


def write_section(path: str, section: str) -> None:
  """Replaces the marked section of `path` (creating the file or appending the section if missing)."""
  text = open(path).read() if os.path.exists(path) else "# Benchmark results\n"
  if BEGIN in text and END in text:
    head, rest = text.split(BEGIN, 1)
    text = head + section + rest.split(END, 1)[1]
  else:
    text = text.rstrip("\n") + "\n\n" + section + "\n"
  with open(path, "w") as f:
    f.write(text)


def chart(report: dict, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np

  table = rows(report)
  plans, rates = report["plans"], report["rates"]
  fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(12, 4.2))
  width = 0.8 / max(len(rates), 1)
  x = np.arange(len(plans))
  for i, rate in enumerate(rates):
    t = [next((r["step_time_s"] for r in table if r["rate"] == rate and r["plan"] == p), np.nan) for p in plans]
    ax_t.bar(x + (i - (len(rates) - 1) / 2) * width, t, width, label=f"link {rate}")
  ax_t.set_xticks(x, plans)
  ax_t.set_ylabel("median step time (s)")
  ax_t.set_title(f"{report['nodes']} nodes x {report['devices']} CPU devices")
  ax_t.legend()
  measured = [np.nanmedian([r["measured_bytes"] for r in table if r["plan"] == p] or [np.nan]) / 1e6 for p in plans]
  accounted = [(report["accounting"].get(p, {}).get("cross_node_bytes_per_node") or np.nan) / 1e6 for p in plans]
  ax_b.bar(x - 0.2, measured, 0.4, label="measured (median over link rates)")
  ax_b.bar(x + 0.2, accounted, 0.4, label="accounting (ring-order model)")
  ax_b.set_xticks(x, plans)
  ax_b.set_ylabel("MB sent across nodes per node per step")
  ax_b.set_title("cross-node bytes per step")
  ax_b.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _load() -> str:
  return ", ".join(f"{v:.1f}" for v in os.getloadavg())


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--plans", default=",".join(PLANS), help="comma-separated config names in configs/")
  ap.add_argument("--rates", default=",".join(RATES), help="comma-separated link rates (tc syntax or none)")
  ap.add_argument("--delay", default="0", help="link delay (needs netem in the kernel)")
  ap.add_argument("--nodes", type=int, default=2)
  ap.add_argument("--devices", type=int, default=4)
  ap.add_argument("--steps", type=int, default=12)
  ap.add_argument("--gin_param", action="append", default=[], help="gin binding for every run (repeatable)")
  ap.add_argument("--results", default=os.path.join(HERE, "RESULTS.md"))
  ap.add_argument("--png", default=os.path.join(HERE, "wire_report.png"))
  ap.add_argument("--json", default=os.path.join(HERE, "wire_report.json"))
  ap.add_argument("--from_json", default=None, help="re-render a saved report without running anything")
  args = ap.parse_args(argv)

  if args.from_json:
    with open(args.from_json) as f:
      report = json.load(f)
    report["png"] = args.png
  else:
    plans = [p for p in args.plans.split(",") if p]
    rates = [r for r in args.rates.split(",") if r]
    missing = [p for p in plans if not os.path.exists(os.path.join(REPO, "configs", f"{p}.gin"))]
    if missing:
      ap.error(f"no configs/{missing[0]}.gin; plans are names of files in configs/")
    if os.geteuid() != 0:
      print("wire_report: the cluster emulator needs root (network namespaces and tc); run it as root",
            file=sys.stderr)
      return 1

    def stop(signum, _frame):
      if _Child.proc is not None and _Child.proc.poll() is None:
        _Child.proc.send_signal(signal.SIGTERM)  # the emulator removes its namespaces and processes
        _Child.proc.wait()
      raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    report = {"argv": sys.argv[1:] if argv is None else list(argv), "plans": plans, "rates": rates,
              "nodes": args.nodes, "devices": args.devices, "delay": args.delay, "steps": args.steps,
              "gin_params": args.gin_param, "cpus": os.cpu_count(), "load_before": _load(),
              "date": datetime.date.today().isoformat(), "png": args.png, "accounting": {}, "runs": []}
    for plan in plans:
      report["accounting"][plan] = account(plan, args)
      print(f"wire_report: accounted {plan}", file=sys.stderr, flush=True)
    for rate in rates:
      for plan in plans:
        run = measure(plan, rate, args)
        report["runs"].append(run)
        if "warning" in run:
          print(f"wire_report: {plan} at {rate}: {run['warning']}", file=sys.stderr, flush=True)
        print(f"wire_report: {plan} at {rate}: {run['median_step_time_s']:.3f} s/step, "
              f"{run['cross_node_payload_bytes_per_step_per_node'] / 1e6:.2f} MB/step", file=sys.stderr, flush=True)
    report["load_after"] = _load()
    first = report["runs"][0]
    report["window"] = f"{first['window']['from_step'] + 1}-{first['window']['to_step']}"
    cfg = report["accounting"][plans[0]]
    report["model"] = (f"GPT, {cfg['model_parameters']:,} parameters, batch {cfg['config']['batch_size']} x "
                       f"seq {cfg['config']['seq_len']}, wire dtype {cfg['config']['param_dtype']}"
                       + (f", gin {' '.join(args.gin_param)}" if args.gin_param else ""))
    with open(args.json, "w") as f:
      json.dump(report, f, indent=2)
  chart(report, args.png)
  write_section(args.results, markdown(report))
  print(json.dumps({"results": args.results, "png": args.png, "json": None if args.from_json else args.json,
                    "rows": rows(report)}, indent=2))
  return 0


if __name__ == "__main__":
  sys.exit(main())
