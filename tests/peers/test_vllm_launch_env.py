"""A real vLLM (the CPU build, in its cached venv) started by `eyas launch` with TP 3 and six NCCL variables:
recorded ok, with the environment of every process verified, the retitled ones included.

vLLM's EngineCore and workers call setproctitle, which overwrites the memory /proc/PID/environ shows; the launch
sets SPT_NOENV and reads each Python process's own interpreter-start snapshot, so none of them reads as unset.
SmolLM2 has 9 attention heads: TP 3 with the multiprocessing executor (2 would be refused).
One OpenMP thread per process: with three workers of two threads each on a 2-core machine, the 4-token
bench and the check took 48 s after the server was ready; with one thread each, 8 s.
"""

from eyas.cli import main
from eyas.dist.launch import free_port
from eyas.launch.launch_config import BenchConfig, LaunchConfig
from eyas.ledger.ledger import Ledger
from tests.peers.envs import peer_python

NCCL = {"NCCL_PROTO": "LL", "NCCL_ALGO": "Ring", "NCCL_P2P_LEVEL": "SYS", "NCCL_MAX_NCHANNELS": "16",
        "NCCL_BUFFSIZE": "16777216", "NCCL_NTHREADS": "512"}


def test_vllm_tp3_launch_verifies_every_process(tmp_path, capsys, demo_dir):
    python = peer_python("vllm")
    env = {**NCCL, "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    config = LaunchConfig(backend="vllm", model=str(demo_dir), tp=3, port=free_port(), python=python, env=env,
                        extra_args=["--dtype", "float32", "--max-model-len", "512", "--enforce-eager",
                                    "--distributed-executor-backend", "mp"],
                        bench=BenchConfig(dataset="mt-bench", num_prompts=1, max_tokens=4), startup_timeout_s=600.0)
    path = tmp_path / "vllm-tp3.toml"
    path.write_text(config.to_toml())
    code = main(["launch", str(path)])
    out, err = capsys.readouterr()
    assert code == 0, out + err[-3000:]
    run_id = next(ln for ln in out.splitlines() if ln.startswith("run ")).split()[1].rstrip(":")
    with Ledger() as ledger:
        run = ledger.get(run_id)
    assert run.status == "ok" and run.results["env_verified"] and run.results["completed"] == 1
    assert run.results["processes"] == len(run.workers)  # every process read: none unreadable, none left out
    assert all(w.env.get(k) == v for w in run.workers for k, v in env.items())
    titles = [w.info["cmdline"] for w in run.workers]
    assert sum(t.startswith("VLLM::Worker_TP") for t in titles) == 3 and "VLLM::EngineCore" in titles, titles
    retitled = [w for w in run.workers if w.info["cmdline"].startswith("VLLM::")]
    assert all(w.info["env_source"] == "snapshot" for w in retitled)
    assert all("--multiprocessing-fork" in w.info["argv"] for w in retitled)  # spawned; argv before the retitle
