"""kit.json of `benchmarks/gpu/device_kit.sh`: per part its limit, seconds and exit status, and what the
outputs under OUT say of the goals they measure (no jax import: it runs after every part).

  python benchmarks/gpu/kit_summary.py --out OUT --parts parts.tsv [--versions versions.txt]
      [--tests_log tests.log] [--deadline 540] [--elapsed S] [--dry 0] [--print]

The goals:
  issue 42 (step.json): every plan's model TFLOP/s >= 400 and its step <= 1.02x the plain jitted step's;
  issue 44 (offload_cost.json): dp's step with opt_state and master offloaded, streamed update, <= 145 ms
    (249.1 ms with the bulk fetch on 2026-11-26);
  issue 46 (kernels.json): at its largest size (256M elements in the kit), the best backend equal to xla
    per op at >= 0.85 of the reference copy (3,009 GB/s) for int8, >= 0.70 for int4 and for the rotated forms.
A goal whose output is missing or incomplete is null, never met.
"""
import argparse
import json
import pathlib
import re

STEP_TFLOPS, STEP_RATIO = 400.0, 1.02
OFFLOAD_MS, OFFLOAD_BEFORE_MS = 145.0, 249.1


def load(path: pathlib.Path):
  try:
    return json.loads(path.read_text())
  except (OSError, ValueError):
    return None


def step_goal(systems: dict | None) -> dict | None:
  """Issue 42 from one block of bench_gpu_step.py's JSON (its `systems`): per plan TFLOP/s and ratio to
  plain, and whether both hold."""
  if not systems or "plain" not in systems:
    return None
  rows = {k: r for k, r in systems.items() if k != "plain"}
  plans = {k: {"model_tflops": r.get("model_tflops"), "ratio_to_plain": (r.get("ratio_to_plain") or {}).get("median"),
               "remat": r.get("remat"), "error": r.get("error")} for k, r in rows.items()}
  complete = bool(plans) and all(p["model_tflops"] is not None and p["ratio_to_plain"] is not None
                                 for p in plans.values())
  return {"plain_model_tflops": systems["plain"].get("model_tflops"), "remat": systems["plain"].get("remat"),
          "plans": plans,
          "goal": f"model TFLOP/s >= {STEP_TFLOPS:g} and <= {STEP_RATIO}x plain for every plan",
          "met": complete and all(p["model_tflops"] >= STEP_TFLOPS and p["ratio_to_plain"] <= STEP_RATIO
                                  for p in plans.values()) if complete else None}


def offload_goal(cost: dict | None) -> dict | None:
  """Issue 44 from bench_offload.py's cost JSON: ms per step of each row, and the streamed update's goal."""
  if not cost or "rows" not in cost:
    return None
  ms = {k: (r.get("ms_per_step") or {}).get("median") for k, r in cost["rows"].items()}
  row = lambda update: next((v for k, v in ms.items() if "opt_state,master" in k and k.endswith(f"update={update}")),
                            None)
  streamed = row("streamed")
  return {"ms_per_step": ms, "streamed_ms": streamed, "streamed_serial_ms": row("streamed_serial"),
          "goal": f"streamed <= {OFFLOAD_MS:g} ms "
          f"(bulk was {OFFLOAD_BEFORE_MS} ms)", "met": None if streamed is None else streamed <= OFFLOAD_MS,
          "errors": {k: r["error"] for k, r in cost["rows"].items() if "error" in r}}


def kernel_target(op: str, bits: int) -> float:
  return 0.70 if bits == 4 or "rotate" in op else 0.85


def kernel_goal(kernels: dict | None) -> dict | None:
  """Issue 46 from bench_kernels.py's JSON: per op and bits the best backend's ratio to the reference copy."""
  if not kernels or "best" not in kernels:
    return None
  elements = max(kernels.get("sizes") or [0])
  rows = [{"op": b["op"], "bits": b["bits"], "backend": b["backend"], "gbps": b["gbps"],
           "ratio": b["ratio_to_reference_copy"], "target": kernel_target(b["op"], b["bits"]),
           "launch_config": b.get("launch_config")} for b in kernels["best"] if b["elements"] == elements]
  for r in rows:
    r["met"] = r["ratio"] >= r["target"]
  return {"platform": kernels.get("platform"), "elements": elements, "backends": kernels.get("backends"),
          "tuning": (kernels.get("tuning") or {}).get("enabled"), "rows": rows,
          "met": sum(r["met"] for r in rows), "of": len(rows),
          "differing_from_xla": kernels.get("summary", {}).get("rows_differing_from_xla")}


def tests_summary(text: str | None) -> dict | None:
  """pytest's counts from its last summary line, and the failing tests."""
  if not text:
    return None
  counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", text)}
  return {**counts, "failures": re.findall(r"^(?:FAILED|ERROR) (\S+)", text, re.M)}


def parts(path: pathlib.Path) -> list[dict]:
  out = []
  text = path.read_text() if path.exists() else ""
  for line in text.splitlines():
    name, est, lim, sec, rc, status = line.split("\t")
    out.append({"name": name, "estimate_s": int(est), "limit_s": int(lim), "seconds": int(sec),
                "rc": int(rc) if rc else None, "status": status})
  return out


def summarize(out: pathlib.Path, parts_tsv: pathlib.Path, versions: str, tests_log: str | None, deadline: int,
              elapsed: int, dry: bool) -> dict:
  return {"kit": "benchmarks/gpu/device_kit.sh", "dry": dry, "deadline_s": deadline, "elapsed_s": elapsed,
          "versions": versions.splitlines(), "parts": parts(parts_tsv),
          "goals": {"issue42_step": step_goal((load(out / "step.json") or {}).get("systems")),
                    "issue42_step_remat": {b["remat"]: step_goal(b["systems"])
                                           for b in (load(out / "step_remat.json") or {}).get("sweep", [])} or None,
                    "issue44_offload": offload_goal(load(out / "offload_cost.json")),
                    "issue46_kernels": kernel_goal(load(out / "kernels.json")),
                    "gpu_tests": tests_summary(tests_log)},
          "offload_fit": (load(out / "offload_fit.json") or {}).get("largest")}


def text(s: dict) -> str:
  lines = [f"{p['name']:13} {p['status']:8} {p['seconds']:>4}s of {p['limit_s']}s (estimate {p['estimate_s']}s)"
           for p in s["parts"]]
  g = s["goals"]
  steps = [("issue42_step", g["issue42_step"])] + [(f"issue42_step_remat {k}", v)
                                                   for k, v in (g["issue42_step_remat"] or {}).items()]
  for key, goal in steps:
    if goal:
      lines.append(f"{key}: plain {goal['plain_model_tflops']} TF/s (remat {goal['remat']}); " + ", ".join(
          f"{k} {p['model_tflops']} TF/s {p['ratio_to_plain']}x" for k, p in goal["plans"].items())
          + f"; met {goal['met']}")
  if g["issue44_offload"]:
    lines.append(f"issue44_offload: streamed {g['issue44_offload']['streamed_ms']} ms; met {g['issue44_offload']['met']}")
  if g["issue46_kernels"]:
    k = g["issue46_kernels"]
    lines.append(f"issue46_kernels: {k['met']} of {k['of']} ops at target; " + ", ".join(
        f"{r['op']}/{r['bits']} {r['ratio']:.2f}" for r in k["rows"]))
  if g["gpu_tests"]:
    lines.append(f"gpu_tests: {g['gpu_tests']}")
  return "\n".join(lines)


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out", required=True)
  ap.add_argument("--parts", required=True)
  ap.add_argument("--versions", default=None)
  ap.add_argument("--tests_log", default=None)
  ap.add_argument("--deadline", type=int, default=540)
  ap.add_argument("--elapsed", type=int, default=0)
  ap.add_argument("--dry", default="0")
  ap.add_argument("--print", action="store_true")
  args = ap.parse_args(argv)
  read = lambda p: pathlib.Path(p).read_text() if p and pathlib.Path(p).exists() else None  # noqa: E731
  out = pathlib.Path(args.out)
  s = summarize(out, pathlib.Path(args.parts), read(args.versions) or "", read(args.tests_log), args.deadline,
                args.elapsed, args.dry == "1")
  (out / "kit.json").write_text(json.dumps(s, indent=1) + "\n")
  if args.print:
    print(text(s))
  return s


if __name__ == "__main__":
  main()
