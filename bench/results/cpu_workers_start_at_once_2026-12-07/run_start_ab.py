"""Three 2-step flow runs of the bundled tiny task, one after another, on a live private Ray head of
this script's own (2 CPUs) and one temporary Prefect server, as a test module runs them; prints each
run's seconds from rl_train's call to its return. Run once per side, alternating the sides by switching
the checkout (`git stash` / `git stash pop` of the change), two rounds:

    .venv/bin/python run_start_ab.py 0     # prints: PRELOAD False [s, s, s]

Argument 1 starts the head with RAY_preload_python_modules=trellis.engine.cluster.actors (Ray's
prestarted idle workers import trellis before any work): tried once, it helped only the first run on
the cluster (Ray prestarts workers when a cluster's first driver connects, not again), not kept.
Scratch files go to /tmp/pre; run from the repository root.
"""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path.cwd() / "tests"))

from helpers import tiny_config  # noqa: E402
from prefect.testing.utilities import prefect_test_harness  # noqa: E402

from trellis.engine.cluster.compat import use_private_ray_head  # noqa: E402
from trellis.engine.cluster.head import auth_token_file, head_command, head_environment, is_alive  # noqa: E402
from trellis.engine.config import ClusterConfig  # noqa: E402
from trellis.engine.tiny.model import build_tiny_checkpoint  # noqa: E402
from trellis.engine.tiny.reverse_task import write_dataset  # noqa: E402
from trellis.flows.rl_train import rl_train  # noqa: E402


def main(preload: bool) -> None:
    root = Path("/tmp/pre")
    model = root / "tiny"
    if not (model / "config.json").exists():
        build_tiny_checkpoint(model)
    data = {"train": root / "train.parquet", "eval": root / "eval.parquet"}
    if not data["train"].exists():
        write_dataset(data["train"], 256, seed=0)
        write_dataset(data["eval"], 64, seed=1)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    home = root / f"home{int(preload)}{port}"
    home.mkdir(parents=True)
    cluster = ClusterConfig(head_port=port, num_cpus=2, home=str(home))
    env = {**os.environ, **head_environment(cluster)}
    if preload:
        env["RAY_preload_python_modules"] = "trellis.engine.cluster.actors"
    head = subprocess.Popen(head_command(cluster, port), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    address = f"127.0.0.1:{port}"
    while not is_alive(address, cluster):
        time.sleep(0.5)
    use_private_ray_head(str(auth_token_file(cluster)))
    import ray

    ray.init(address=address, log_to_driver=False)
    times = []
    with prefect_test_harness(server_startup_timeout=120):
        for index in range(3):
            time.sleep(10)  # idle between runs, as a cluster is between a user's runs
            config = tiny_config(model, data, root / f"work{port}", experiment_name=f"r{index}", total_train_steps=2,
                                 evaluate_step=-1, checkpoint_interval=-1, enable_evaluate=False,
                                 cluster={"address": address, "home": str(home), "release_workers_at_end": True})
            started = time.perf_counter()
            rl_train(config)
            times.append(time.perf_counter() - started)
            print("run", index, round(times[-1], 1), flush=True)
    print("PRELOAD", preload, [round(t, 1) for t in times])
    ray.shutdown()
    head.send_signal(signal.SIGTERM)
    head.wait()


if __name__ == "__main__":
    main(sys.argv[1] == "1")
