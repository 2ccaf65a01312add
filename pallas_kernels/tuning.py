"""Launch configurations of the quantization kernels, timed on the GPU they run on and cached on disk.

A configuration is the tile (elements a program handles: summed over its K slabs in the Pallas
kernels, of its output in the Triton ones; its rows are the largest power of two of blocks that fits
the tile and divides the row count), Triton's `num_warps` and `num_stages`. Each
Pallas and Triton kernel has the small space `space(slabs)`: tiles of 1K to 16K elements, 1 to 8
warps (one warp keeps a rotated kernel's butterflies and block reductions inside the warp: no
barriers, docs/quantization.md), 4 to 64 elements a thread, and 1 or 2 stages where the kernel sums K slabs. (Triton picks the
vector width of loads and stores from the tile's contiguity itself; it is no parameter of these
kernels.) No configuration changes a value: every program computes the format of `block_format`.

Where a program is traced for a GPU on a GPU and tuning is on, the first call for a key (device kind,
backend, op, shape class, dtype) compiles each candidate, times it on random inputs of the op's shapes
(median of `REPS` calls after a warmup), and keeps the fastest in a JSON file (`cache_path()`:
$ZEROJAX_KERNEL_TUNING_CACHE, else ~/.cache/zerojax/kernel_tuning.json), with every candidate's time
and every failure's error beside it; later calls, in this process or another, read the winner and time
nothing. A candidate that fails to compile or run is skipped and recorded. Like Triton's autotuner,
but the winner persists across processes. Several processes (one per GPU) each time their own GPU and
may keep different winners: programs differ in their tiles only, never in their values.

$ZEROJAX_KERNEL_TUNING: "1" on, "0" off; by default on where jax's default backend is a GPU. Off, or
where no GPU is here to time (a CPU host compiling for compile-only GPUs), kernels take `DEFAULTS`
for the device kind (else its "*" entry): the table to fill from the kit's output
(`benchmarks/bench_kernels.py` prints each op's winning configuration).

References:
  Triton's `triton.autotune` (configs timed on first call per key). ZeRO++: Wang et al. 2023, §4.2
  (kernels at memory bandwidth).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import statistics
import tempfile
import time
from typing import Callable

import jax
import numpy as np

ENV = "ZEROJAX_KERNEL_TUNING"
CACHE_ENV = "ZEROJAX_KERNEL_TUNING_CACHE"
REPS = 5


@dataclasses.dataclass(frozen=True)
class Config:
  """A launch configuration: `tile` elements a program, Triton's `num_warps` and `num_stages`."""
  tile: int = 4096
  num_warps: int = 4
  num_stages: int = 1

  def rows(self, m: int, row_elements: int) -> int:
    """Blocks a program: the largest power of two r with r * row_elements <= tile (at least 1) that
    divides m."""
    r = 1
    while r * 2 * row_elements <= self.tile and m % (r * 2) == 0:
      r *= 2
    return r

  @property
  def text(self) -> str:
    return f"tile={self.tile},warps={self.num_warps},stages={self.num_stages}"

  @classmethod
  def parse(cls, text: str) -> "Config":
    kv = dict(part.split("=") for part in text.split(","))
    return cls(int(kv["tile"]), int(kv["warps"]), int(kv["stages"]))


# Per device kind (`jax.Device.device_kind`), the configuration used where tuning is off; "*" for any
# other. The H100 entry is the configuration the kit measured on 2026-11-26 (`kernel_table`); replace it
# with the winners of a run of `benchmarks/gpu/run.sh` (kernels.json, "tuning").
DEFAULTS: dict[str, Config] = {
    "*": Config(),
    "NVIDIA H100 80GB HBM3": Config(),
}


def space(slabs: int = 1) -> list[Config]:
  """The candidates of a kernel that reads `slabs` slabs a row (the first is the default)."""
  out = [Config()]
  for tile in (1024, 2048, 4096, 8192, 16384):
    for warps in (1, 2, 4, 8):
      if not 4 <= tile // (32 * warps) <= 64:
        continue
      for stages in ((1, 2) if slabs > 1 else (1,)):
        c = Config(tile, warps, stages)
        if c not in out:
          out.append(c)
  return out


def enabled() -> bool:
  """$ZEROJAX_KERNEL_TUNING ("0" or "1"), else whether jax's default backend is a GPU."""
  value = os.environ.get(ENV, "").strip()
  if value not in ("", "0", "1"):
    raise ValueError(f"{ENV}={value!r}; expected 1 (time launch configurations) or 0 (use the defaults)")
  return value == "1" if value else jax.default_backend() == "gpu"


def gpu_here() -> bool:
  """Whether a GPU is here to time candidates on."""
  return jax.default_backend() == "gpu"


def device_kind() -> str:
  return str(jax.devices()[0].device_kind) if gpu_here() else "*"


def default(kind: str | None = None) -> Config:
  return DEFAULTS.get(device_kind() if kind is None else kind, DEFAULTS["*"])


def cache_path() -> pathlib.Path:
  env = os.environ.get(CACHE_ENV, "").strip()
  return pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "zerojax" / "kernel_tuning.json"


def shape_class(elements: int, block: int, slabs: int = 1) -> str:
  """Shapes that share a winner: the block, the slabs, and the element count's order of magnitude
  (up to 2^18: 2^16; up to 2^22: 2^20; beyond: 2^24, where every candidate's grid fills the GPU)."""
  e = math.ceil(math.log2(max(1, elements)))
  return f"block={block},slabs={slabs},elements~2^{16 if e <= 18 else 20 if e <= 22 else 24}"


def key(backend: str, op: str, shape: str, dtype, kind: str | None = None) -> str:
  return "|".join([device_kind() if kind is None else kind, backend, op, shape, np.dtype(dtype).name])


def measure(thunk: Callable[[], object], reps: int = REPS) -> float:
  """Median ms of `reps` calls of `thunk` (which blocks until its result is ready), after one warmup."""
  thunk()
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    thunk()
    times.append(1e3 * (time.perf_counter() - t0))
  return statistics.median(times)


class Tuner:
  """Times candidates per key and keeps the winners in memory and in the JSON file at `path`.

  `choose(key, candidates, build)`: `build(config)` compiles a candidate and returns a thunk that runs
  it once and blocks; `timer(thunk)` gives its ms (default `measure`)."""

  def __init__(self, path: pathlib.Path | str, timer: Callable[[Callable], float] | None = None):
    self.path = pathlib.Path(path)
    self.timer = timer or measure
    self.entries: dict[str, dict] = {}
    self._loaded = False

  def _load(self) -> dict:
    try:
      return json.loads(self.path.read_text())
    except FileNotFoundError:
      return {}
    except (OSError, ValueError):  # an unreadable cache is timed again and rewritten
      return {}

  def _save(self) -> None:
    merged = {**self._load(), **self.entries}  # other processes' keys survive
    self.path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
      json.dump(merged, f, indent=1, sort_keys=True)
    os.replace(tmp, self.path)

  def cached(self, key: str) -> Config | None:
    if not self._loaded:
      self.entries = {**self._load(), **self.entries}
      self._loaded = True
    entry = self.entries.get(key)
    return Config.parse(entry["config"]) if entry else None

  def choose(self, key: str, candidates: list[Config], build: Callable[[Config], Callable[[], object]]) -> Config:
    hit = self.cached(key)
    if hit is not None:
      return hit
    ms, failed = {}, {}
    with jax.ensure_compile_time_eval():  # inside a trace: run the candidates now, do not stage them
      for c in candidates:
        try:
          ms[c.text] = float(self.timer(build(c)))
        except Exception as e:  # noqa: BLE001 - a candidate that cannot compile or run is skipped
          failed[c.text] = f"{type(e).__name__}: {str(e)[:300]}"
    best = min(ms, key=ms.get) if ms else candidates[0].text
    self.entries[key] = {"config": best, "ms": ms, "failed": failed, "jax": jax.__version__,
                         "timed": bool(ms)}
    self._save()
    return Config.parse(best)


_TUNERS: dict[str, Tuner] = {}
# Every `config` call's (key, configuration text, source: "tuned", "cached" or "default"), in order: what
# the kit's benchmark reports per op (it clears the list before each op).
CHOSEN: list[tuple[str, str, str]] = []


def tuner() -> Tuner:
  """The process's tuner for `cache_path()`."""
  path = str(cache_path())
  if path not in _TUNERS:
    _TUNERS[path] = Tuner(path)
  return _TUNERS[path]


def random_inputs(avals) -> list[jax.Array]:
  """Device arrays shaped like `avals` (ShapeDtypeStructs), made on the device: normal floats, random
  integers (for the bit patterns of stored codes)."""
  out = []
  for i, a in enumerate(avals):
    k = jax.random.key(i)
    if jax.numpy.issubdtype(a.dtype, jax.numpy.floating):
      out.append(jax.random.normal(k, a.shape, jax.numpy.float32).astype(a.dtype))
    else:
      out.append(jax.random.bits(k, a.shape, jax.numpy.uint8 if np.dtype(a.dtype).itemsize == 1
                                 else jax.numpy.uint32).astype(a.dtype))
  return out


def runner(make: Callable[[Config], Callable], avals) -> Callable[[Config], Callable[[], object]]:
  """`build` for `Tuner.choose`: `make(config)` is the kernel's function of arrays shaped like `avals`;
  a candidate is compiled once and its thunk runs it on random inputs made once for all candidates."""
  args = []

  def build(config: Config):
    if not args:
      args.extend(random_inputs(avals))
    compiled = jax.jit(make(config)).lower(*args).compile()
    return lambda: jax.block_until_ready(compiled(*args))
  return build


def config(backend: str, op: str, *, elements: int, block: int, dtype, slabs: int = 1,
           make: Callable[[Config], Callable] | None = None, avals=()) -> Config:
  """The launch configuration of `op` on `backend`: the tuned winner where tuning is on and a GPU is
  here (timing `make(config)` on inputs shaped like `avals` the first time), else `default()`."""
  k = key(backend, op, shape_class(elements, block, slabs), dtype)
  if make is None or not (enabled() and gpu_here()):
    CHOSEN.append((k, default().text, "default"))
    return default()
  t = tuner()
  source = "cached" if t.cached(k) is not None else "tuned"
  avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
  c = t.choose(k, space(slabs), runner(make, avals))
  CHOSEN.append((k, c.text, source))
  return c
