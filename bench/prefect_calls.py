"""The Prefect API calls of the orchestrated CPU step (`make bench`'s trellis-flow), and what they cost.

Runs the flow step as bench/trellis_flow_step.py does (local Ray head, tiny model and reverse task, lean temporary
Prefect server, a 3-step warm-up run, then a second `rl_train` whose steps are measured) and records in the driver
every HTTP request to the Prefect API (method, route with ids as {id}, start/end, thread, calling Prefect function)
and every event sent over the /events/in websocket. A request is on the critical path when the main thread waited
for it: the sync client sends from the main thread itself; some sync calls (the subflow's tracking task run) run as
coroutines on Prefect's RunSyncEventLoopThread while the main thread blocks in `Call.result()`: such a request
carries its `Call` in Prefect's `current_call` context variable and counts if the main thread is blocked on that
very call. A step is the interval between consecutive `rl_step` flow-run starts, so it holds the calls that start
the next. "idle": the part of the waited time in which no worker ran a method (Ray's timeline, bench/_measure.py).

    cd /work/main && /tmp/ci/.venv/bin/python bench/prefect_calls.py [--steps 12] [--out bench/results/cpu_prefect_calls.txt]
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import collections
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import trellis_flow_step as flow_bench  # noqa: E402  (first: it sets the lean server's settings before Prefect loads)

import httpx  # noqa: E402
import psutil  # noqa: E402
import ray  # noqa: E402
from _measure import busy_spans, idle_seconds  # noqa: E402
from prefect._internal.concurrency.calls import Call, current_call  # noqa: E402
from prefect.events.clients import EventsClient, PrefectEventsClient  # noqa: E402
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings  # noqa: E402

from trellis.engine.tiny.model import build_tiny_checkpoint  # noqa: E402
from trellis.engine.tiny.reverse_task import write_dataset  # noqa: E402
from trellis.flows.rl_train import rl_train  # noqa: E402

MAIN = threading.main_thread()
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
REQUESTS: list[dict] = []  # one per HTTP request while recording
EVENTS: list[tuple[float, str]] = []  # (sent at, event name) over the websocket
RECORDING = threading.Event()
MAIN_BLOCKED_ON: list[Call] = []  # the Calls whose result the main thread waits for now

# What could take each group of routes off the critical path (Prefect 3.9: flow_engine.py, tasks.py, artifacts.py, ...).
REMEDIES = [
    (("POST /task_runs/", "POST /flow_runs/filter", "POST /flows/", "POST /flow_runs/"),
     "creating rl_step[N+1] (FlowRunEngine.create_flow_run, subflow path): Task.create_run's tracking task run, load_subflow_run's filter, then "
     "SyncPrefectClient.create_flow_run, which POSTs /flows/ by name before /flow_runs/ each time. All can be made ahead, without waiting, while "
     "step N's fit holds the main thread in ray.get: create_task_run + create_flow_run(rl_step, name=..., parameters=..., parent_task_run_id=...) "
     "on a background loop, then flow_engine.run_flow_sync(rl_step, flow_run=..., parameters=...): initialize_run creates nothing but sends an "
     "update_flow_run PATCH (the name PATCH goes if named at creation: net ~0); the server's UpdateSubflowParentTask keeps the tracking task "
     "run's state. Caveat: N+1's counters exist only after log_step[N], so its stored parameters would be stale."),
    (("POST /flow_runs/{id}/set_state", "GET /flow_runs/{id}"),
     "Running (begin_run) and Completed (handle_success) go through propose_state_sync, and setup_run_context always re-reads the run "
     "(read_flow_run): the engine waits on all three, no setting sends them without waiting. They leave the step's critical path only if the "
     "workers have work meanwhile (cluster.overlap_next_rollout=true launches rollout N+1 before log_step N; off on CPU by default: try "
     "--overlap-next-rollout), or get divided by k with k steps per flow run."),
    (("POST /artifacts/",),
     "log_step's metrics table and links: on trellis's temporary server posted by the trellis-artifact-posts thread since 7f196a6 "
     "(tasks.artifact_posts), so nobody waits for them; on a server of your own posted by the main thread while the step waits."),
]


def made_by(frame) -> str:  # the two innermost Prefect engine functions up the stack (a coroutine's: its awaits)
    names: list[str] = []
    while frame is not None and len(names) < 2:
        path = frame.f_code.co_filename.split("site-packages/")[-1]
        if path.startswith("prefect/") and not path.startswith(("prefect/client", "prefect/_internal", "prefect/utilities")):
            names.append(f"{path[8:-3]}.{frame.f_code.co_name}")
        frame = frame.f_back
    return " < ".join(names)


def _record(request: httpx.Request, start: float, waited: bool) -> None:
    if RECORDING.is_set():
        route = UUID.sub("{id}", request.url.path).removeprefix("/api")
        REQUESTS.append(dict(route=f"{request.method} {route}", start=start, end=time.time(), waited=waited,
                             thread=threading.current_thread().name, made_by=made_by(sys._getframe(2))))


def instrument() -> None:
    sync_send, async_send, result = httpx.Client.send, httpx.AsyncClient.send, Call.result

    def send(client, request, **kwargs):  # sync client: the calling thread waits
        start = time.time()
        try:
            return sync_send(client, request, **kwargs)
        finally:
            _record(request, start, threading.current_thread() is MAIN)

    async def asend(client, request, **kwargs):
        start, ref = time.time(), current_call.get(None)
        try:
            return await async_send(client, request, **kwargs)
        finally:  # checked at the end: the main thread is still blocked on the call if it waits for it
            _record(request, start, ref is not None and any(c is ref() for c in MAIN_BLOCKED_ON))

    def call_result(call, timeout=None):
        if threading.current_thread() is not MAIN:
            return result(call, timeout)
        MAIN_BLOCKED_ON.append(call)
        try:
            return result(call, timeout)
        finally:
            MAIN_BLOCKED_ON.pop()

    def counted(method, name_of):  # the events client runs on EventsWorkerThread: nobody waits for it
        async def wrapper(client, *args):
            if RECORDING.is_set():
                EVENTS.append((time.time(), name_of(*args)))
            return await method(client, *args)
        return wrapper

    httpx.Client.send, httpx.AsyncClient.send, Call.result = send, asend, call_result
    EventsClient.emit = counted(EventsClient.emit, lambda event: event.event)
    PrefectEventsClient._reconnect = counted(PrefectEventsClient._reconnect, lambda: "(websocket (re)connect)")


def sample_cpu(samples: list[tuple[float, float, float]]) -> None:  # (time, CPU-s of the driver, of the Prefect server)
    driver = psutil.Process()
    server = next(c for c in driver.children(recursive=True) if "uvicorn" in c.cmdline())  # the temporary Prefect server
    while RECORDING.wait() and not time.sleep(0.1):
        samples.append((time.time(), sum(driver.cpu_times()[:2]), sum(server.cpu_times()[:2])))


def measure(root: Path, steps: int, overlap: bool) -> dict:
    head, address = flow_bench.start_head()
    try:
        with tempfile.TemporaryDirectory() as tmp, temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
            config = flow_bench.flow_step_config(str(root / "tiny"), str(root / "train.parquet"), tmp, address, overlap=overlap or None)
            rl_train(config)
            cpu: list[tuple[float, float, float]] = []
            threading.Thread(target=sample_cpu, args=(cpu,), daemon=True).start()
            since_s = time.time()
            RECORDING.set()
            rl_train(config.model_copy(update={"total_train_steps": flow_bench.WARMUP_STEPS + steps + 2}))
            RECORDING.clear()
            starts = asyncio.run(flow_bench.step_starts(since_s))
            spans = busy_spans(ray.timeline(), flow_bench.WORKER_CALLS)
    finally:
        ray.shutdown()
        head.terminate()
        head.wait(timeout=60)
    first = flow_bench.WARMUP_STEPS + 2  # the second run's first step re-attaches (and has no rollout launched ahead)
    return dict(starts=starts, spans=spans, measured=range(first, first + steps), cpu=cpu)


def report(data: dict, machine: str) -> str:
    starts, spans, measured = data["starts"], data["spans"], data["measured"]
    per_step = collections.defaultdict(lambda: collections.defaultdict(list))  # route -> figure -> one value per step
    durations, threads, events = collections.defaultdict(list), collections.defaultdict(set), collections.defaultdict(list)
    totals = per_step["(all)"]

    def add(figures: dict, reqs: list[dict]) -> None:
        waited = [r for r in reqs if r["waited"]]
        figures["calls"].append(len(reqs))
        figures["waited_calls"].append(len(waited))
        figures["waited_s"].append(sum(r["end"] - r["start"] for r in waited))
        figures["idle_s"].append(sum(idle_seconds(spans, r["start"], r["end"]) for r in waited))

    window = [r for r in REQUESTS if starts[measured[0]] <= r["start"] < starts[measured[-1] + 1]]
    routes = sorted({r["route"] for r in window})
    for step in measured:
        begin, end = starts[step], starts[step + 1]
        reqs = [r for r in window if begin <= r["start"] < end]
        for route in routes:
            add(per_step[route], mine := [r for r in reqs if r["route"] == route])
            durations[route] += [r["end"] - r["start"] for r in mine]
            threads[route] |= {f"{r['thread']}: {r['made_by']}" for r in mine}
        add(totals, reqs)
        totals["wall"].append(end - begin)
        totals["workers idle"].append(idle_seconds(spans, begin, end))
        totals["idle outside"].append(totals["workers idle"][-1] - totals["idle_s"][-1])
        for name in {n for _, n in EVENTS}:
            events[name].append(sum(1 for t, n in EVENTS if n == name and begin <= t < end))
    med = statistics.median
    begin, end = (bisect.bisect(data["cpu"], (starts[s],)) for s in (measured[0], measured[-1] + 1))
    cpu = [(data["cpu"][end][i] - data["cpu"][begin][i]) / len(measured) for i in (1, 2)]
    lines = [f"Prefect API calls per rl_step of the CPU flow step: median over {len(measured)} measured steps (rl_step[{measured[0]}.."
             f"{measured[-1]}]) after a {flow_bench.WARMUP_STEPS}-step warm-up run and one more step.", f"machine: {machine}", "",
             f"{'route':34s} {'calls':>5s} {'med ms':>8s} {'waited':>6s} {'waited ms':>9s} {'idle ms':>8s}  thread: made by"]
    for route in sorted(routes, key=lambda r: -med(per_step[r]["waited_s"])):
        f = per_step[route]
        lines.append(f"{route:34s} {med(f['calls']):5g} {1000 * med(durations[route]):8.1f} {med(f['waited_calls']):6g} "
                     f"{1000 * med(f['waited_s']):9.1f} {1000 * med(f['idle_s']):8.1f}  {'; '.join(sorted(threads[route]))}")
    lines += ["(calls: requests per step; med ms: one request's median duration; waited: requests per step the main thread "
              "waited for; waited ms: their summed time per step; idle ms: of that, time no worker ran a method)", "",
              f"API requests per step                    {med(totals['calls']):g} (main thread waited for {med(totals['waited_calls']):g})",
              f"main thread waited on API requests       {med(totals['waited_s']):.3f} s/step   (critical path of the driver)",
              f"  of which workers idle meanwhile        {med(totals['idle_s']):.3f} s/step   (critical path of the step)",
              f"step wall time                           {med(totals['wall']):.3f} s/step   (min {min(totals['wall']):.3f}, max {max(totals['wall']):.3f})",
              f"workers idle (Ray timeline)              {med(totals['workers idle']):.3f} s/step",
              f"  workers idle outside waited requests   {med(totals['idle outside']):.3f} s/step   (Prefect engines' CPU, Ray calls)",
              f"CPU: driver process {cpu[0]:.3f} s/step, Prefect server {cpu[1]:.3f} s/step (mean over the measured steps)",
              "websocket events sent per step (fire-and-forget, EventsWorkerThread): "
              + ", ".join(f"{n} {med(v):g}" for n, v in sorted(events.items())),
              "", "What could leave the critical path (est. saving: the routes' 'idle ms' above; at most their 'waited ms'):"]
    for group, remedy in REMEDIES:  # a route not seen in the measured steps counts 0
        idle, waited = (sum(med(per_step[r][k]) for r in group if r in per_step) for k in ("idle_s", "waited_s"))
        lines.append(f"- {' + '.join(group)} (~{1000 * idle:.0f} ms/step, <= {1000 * waited:.0f}): {remedy}")
    lines.append("- websocket events (task-run Pending/Running/Completed per task run): already fire-and-forget, but each task "
                 "run costs the driver's task engine CPU on the main thread (in 'workers idle outside waited requests') and the "
                 "server's task-run recorder CPU: fewer, coarser task runs per step cut both.")
    return "\n".join(lines) + "\n"


def busy_machine() -> bool:  # the project's test suite, whose run shares the 2 cores
    return subprocess.run(["pgrep", "-f", "bin/pytest"], capture_output=True).returncode == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", default=str(HERE / "results" / "cpu_prefect_calls.txt"))
    parser.add_argument("--overlap-next-rollout", action="store_true", help="cluster.overlap_next_rollout=true (off on CPU by default)")
    args = parser.parse_args()
    busy, load = busy_machine(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        build_tiny_checkpoint(Path(tmp) / "tiny")
        write_dataset(Path(tmp) / "train.parquet", 4096, seed=0)
        instrument()
        data = measure(Path(tmp), args.steps, args.overlap_next_rollout)
    machine = (f"{os.cpu_count()} cores, " + ("BUSY: a test suite ran beside it (durations inflated, counts valid)" if busy or busy_machine()
               else "idle (no test suite running)") + f"; 1-min load average {load:.2f} before, {os.getloadavg()[0]:.2f} after")
    text = report(data, machine + (", cluster.overlap_next_rollout=true" if args.overlap_next_rollout else ""))
    print(text, end="")
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
