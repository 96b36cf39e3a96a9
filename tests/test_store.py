"""A Store is a URI and the fsspec options that reach it: it joins, opens and lists like the pair it
replaces, travels to workers whole (pickled), and never prints its credentials."""

from __future__ import annotations

import pickle
import random
import signal
import subprocess
import sys
import time

from trellis.engine.secrets import REDACTED
from trellis.engine.storage.checkpoints import SaveStore, read_json, require_complete, write_json
from trellis.engine.storage.store import Store

OPTIONS = {"key": "AKIA-EXAMPLE-1234", "secret": "s3cr3t-example-5678", "client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}}


def test_a_store_never_shows_its_credentials():
    store = Store("s3://bucket/runs/a", OPTIONS)
    for shown in (repr(store), str(store), f"{store}", repr([store])):
        assert "s3cr3t-example-5678" not in shown and "AKIA-EXAMPLE-1234" not in shown
        assert REDACTED in shown and "s3://bucket/runs/a" in shown and "127.0.0.1:9000" in shown
    assert store.options["secret"] == "s3cr3t-example-5678"  # what it uses is the real value


def test_join_keeps_the_options_and_one_slash():
    store = Store("s3://bucket/runs/a/", OPTIONS)
    assert store.join("checkpoints", "step-000002/") == Store("s3://bucket/runs/a/checkpoints/step-000002", OPTIONS)
    assert Store("/tmp/x", None) == Store("/tmp/x") != Store("/tmp/x", {"anon": True})
    assert pickle.loads(pickle.dumps(store)) == store


def test_files_through_a_store_and_a_checkpoint_folder(tmp_path):
    run = Store(str(tmp_path / "run"))
    write_json({"step": 2}, run.join("nested", "state.json"))
    assert read_json(run.join("nested", "state.json")) == {"step": 2} and run.join("nested").exists()
    with run.join("notes.txt").open("w") as handle:
        handle.write("hello")
    fs, path = run.fs()
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(path)) == ["nested", "notes.txt"]

    checkpoints = SaveStore(run.join("checkpoints"))
    checkpoints.begin(2)
    write_json({"step": 2}, checkpoints.store(2).join("train_state.json"))
    checkpoints.seal(2)
    assert checkpoints.latest() == (2, f"{tmp_path}/run/checkpoints/step-000002")
    assert require_complete(checkpoints.store(2)) == {"step": 2}


WRITER = """
import sys
from trellis.engine.storage.checkpoints import write_json
from trellis.engine.storage.store import Store
target, i = Store(sys.argv[1]), 0
while True:
    write_json({"i": i, "pad": ["x" * 64] * 20000}, target)
    i += 1
"""


def test_a_json_record_killed_half_way_through_its_rewrite_is_the_old_one_whole(tmp_path):
    """A run plan or a record is rewritten whole again and again by a process killed (SIGKILL) at a random
    moment, five times: what is left always parses and is one whole version. Tried: writing into the file
    itself (truncated first) left it cut short (JSONDecodeError at the first kill)."""
    target = tmp_path / "logs" / "run_plan.json"
    rng = random.Random(0)
    for _ in range(5):
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(target)])
        try:
            deadline = time.monotonic() + 60
            while not target.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.3 + rng.random() * 0.5)
        finally:
            writer.send_signal(signal.SIGKILL)
            writer.wait()
        record = read_json(Store(str(target)))
        assert record["i"] >= 0 and len(record["pad"]) == 20000
