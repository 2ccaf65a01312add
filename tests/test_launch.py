"""Launching as a cluster's launcher does: 4 processes x 2 CPU devices started with Slurm's environment
(2 nodes, 2 processes per node, as `srun --ntasks-per-node=2` starts them) form a {"node": 2, "gpu": 4}
mesh and train with the losses of 1 process x 8 devices; a job that names several processes but comes
up as one stops with one line; the GPUs a process drives."""
import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import free_port
from tests.train_helpers import ROOT, TINY, clean_env, error_line, outputs_of, records, train
from zerojax import mesh as mesh_lib

PARAMS = TINY + ["train.steps=4", "train.eval_every=0", "train.checkpoint_every=0"]


def slurm_env(i: int, port: int, tasks: int = 4, per_node: int = 2) -> dict:
  return {**clean_env(), "SLURM_JOB_ID": str(random.randint(1000, 9999)), "SLURM_STEP_NODELIST": "localhost",
          "SLURM_NTASKS": str(tasks), "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i % per_node),
          "SLURM_NODEID": str(i // per_node), "SLURM_NTASKS_PER_NODE": str(per_node),
          "JAX_COORDINATOR_PORT": str(port)}


@pytest.mark.multiprocess
def test_two_processes_per_node_form_the_nodes_and_train_as_one_process(tmp_path):
  r = train(tmp_path / "one", *PARAMS[len(TINY):])
  assert r.returncode == 0, r.stderr[-3000:]
  port, job = free_port(), str(random.randint(1000, 9999))
  cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--gin_file=configs/zero3.gin",
         f"--workdir={tmp_path / 'four'}", "--devices=2"] + [f"--gin_param={p}" for p in PARAMS]
  procs = [subprocess.Popen(cmd, cwd=ROOT, env={**slurm_env(i, port), "SLURM_JOB_ID": job}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for i in range(4)]
  outs = outputs_of(procs, timeout=400)
  assert all(p.returncode == 0 for p in procs), "\n".join(o[-2000:] for o in outs)
  summary = json.load(open(tmp_path / "four" / "summary.json"))
  assert summary["mesh"] == {"node": 2, "gpu": 4} and summary["nodes"] == 2
  one = {s: l for s, l, _ in records(tmp_path / "one")}
  four = {s: l for s, l, _ in records(tmp_path / "four")}
  assert sorted(one) == sorted(four) == [1, 2, 3, 4]
  np.testing.assert_allclose([four[s] for s in sorted(four)], [one[s] for s in sorted(one)], rtol=2e-5)


@pytest.mark.multiprocess
def test_jax_variables_as_a_kubernetes_jobset_sets_them_start_the_cluster(tmp_path):
  """examples/k8s/jobset.yaml's environment: JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID and
  no flags; on CPUs each process is a node."""
  port = free_port()
  cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--gin_file=configs/zero3.gin",
         f"--workdir={tmp_path}", "--devices=4"] + [f"--gin_param={p}" for p in PARAMS]
  env = lambda i: {**clean_env(), "JAX_COORDINATOR_ADDRESS": f"localhost:{port}", "JAX_NUM_PROCESSES": "2",
                   "JAX_PROCESS_ID": str(i)}
  procs = [subprocess.Popen(cmd, cwd=ROOT, env=env(i), text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
           for i in range(2)]
  outs = outputs_of(procs, timeout=400)
  assert all(p.returncode == 0 for p in procs), "\n".join(o[-2000:] for o in outs)
  summary = json.load(open(tmp_path / "summary.json"))
  assert summary["mesh"] == {"node": 2, "gpu": 4} and [s for s, _, _ in records(tmp_path)] == [1, 2, 3, 4]


def test_a_job_of_several_processes_that_comes_up_as_one_stops_in_one_line(tmp_path):
  env = {k: v for k, v in slurm_env(0, free_port()).items() if k != "SLURM_STEP_NODELIST"}  # python, not srun
  r = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--gin_file=configs/zero3.gin",
                      f"--workdir={tmp_path}", "--devices=2"] + [f"--gin_param={p}" for p in PARAMS],
                     cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  line = error_line(r)
  assert r.returncode == 2 and "4 processes" in line and "srun" in line, line


def test_the_gpus_a_process_drives(monkeypatch):
  for var in ("SLURM_NTASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS",
              "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "LOCAL_RANK"):
    monkeypatch.delenv(var, raising=False)
  assert mesh_lib.local_gpu_ids(8) == list(range(8))  # one process per node: every GPU (not JAX's [0])
  monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "8")
  monkeypatch.setenv("SLURM_LOCALID", "3")
  assert mesh_lib.local_gpu_ids(8) == [3]  # one per GPU, all visible: its local rank's
  assert mesh_lib.local_gpu_ids(1) == [0]  # one per GPU, the launcher bound one to each
  assert mesh_lib.local_gpu_ids(0) is None


def test_processes_on_one_node_share_it(monkeypatch):
  import jax
  devices = jax.devices()[:8]

  class Fake:
    def __init__(self, d, p):
      self.id, self.process_index, self.device_kind = d.id, p, d.device_kind

  fake = [Fake(d, i // 2) for i, d in enumerate(devices)]  # 4 processes of 2 devices
  mesh = mesh_lib.make_mesh(devices=fake, nodes_of=(0, 0, 1, 1))
  assert mesh.devices.shape == (2, 4)
  assert [[d.process_index for d in row] for row in mesh.devices] == [[0, 0, 1, 1], [2, 2, 3, 3]]
  with pytest.raises(ValueError, match="the 4 processes run on 2 nodes"):
    mesh_lib.make_mesh(4, devices=fake, nodes_of=(0, 0, 1, 1))
  with pytest.raises(ValueError, match="different numbers of devices"):
    mesh_lib.make_mesh(devices=fake, nodes_of=(0, 0, 0, 1))
