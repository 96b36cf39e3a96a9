"""Reward functions that misbehave fail their own sample, with the reason, and never the step."""

import fcntl
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from trellis.engine.config import RewardConfig
from trellis.engine.rollout.rewards import exact_match, math_answer
from trellis.engine.rollout.rewards.runner import RewardRunner


# Reward functions a user might write; referenced by `module:function` like real ones.
def sleeps_forever(sample):
    time.sleep(3600)


def raises_on_b(sample):
    if sample["response"] == "b":
        raise RuntimeError("judge unavailable")
    return {"score": 1.0, "judge": "ok"}


def returns_garbage(sample):
    return "high" if sample["response"] == "a" else float("nan")


def _samples(*responses):
    return [{"response": r, "label": "a", "prompt": [], "data_source": "d", "task_name": "t"} for r in responses]


def test_a_raising_function_fails_only_its_sample():
    with RewardRunner(RewardConfig(function=f"{__name__}:raises_on_b")) as runner:
        ok, bad = runner.score(_samples("a", "b"))
    assert ok.score == 1.0 and ok.payload == {"score": 1.0, "judge": "ok"}
    assert bad.score is None and bad.error == "reward function raised RuntimeError: judge unavailable"


def test_a_function_that_sleeps_forever_times_out_and_the_pool_recovers():
    config = RewardConfig(function=f"{__name__}:sleeps_forever", timeout_s=0.5, by_data_source={"fast": "trellis.engine.rollout.rewards:exact_match"})
    with RewardRunner(config) as runner:
        started = time.perf_counter()
        (stuck,) = runner.score(_samples("a"))
        assert time.perf_counter() - started < 10
        assert stuck.error == "reward function timed out after 0.5s"
        (after,) = runner.score([{**_samples("a")[0], "data_source": "fast"}])  # the killed worker was replaced
        assert after.score == 1.0


def test_non_numeric_results_fail_with_what_was_returned():
    with RewardRunner(RewardConfig(function=f"{__name__}:returns_garbage")) as runner:
        text, nan = runner.score(_samples("a", "z"))
    assert "returned 'high'" in text.error and "returned nan" in nan.error


def test_unknown_function_is_refused_at_start():
    with pytest.raises(ValueError, match="defines no 'nope'"):
        RewardRunner(RewardConfig(function="trellis.engine.rollout.rewards:nope"))
    with pytest.raises(ValueError, match="must look like 'package.module:function'"):
        RewardRunner(RewardConfig(function="trellis.engine.rollout.rewards"))


def test_a_spec_from_before_the_trellis_namespace_is_told_its_new_name(tmp_path):
    """In a process of its own, launched from a project folder: this session's sys.path may hold the
    checkout, where a bare ``engine`` imports (Prefect leaves the folder it loads a flow file from there)."""
    check = "from trellis.engine.rollout.rewards.runner import resolve_function; resolve_function('engine.rollout.rewards:exact_match')"
    result = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert "no module 'engine.rollout.rewards'" in result.stderr, result.stderr
    assert "trellis's own is 'trellis.engine.rollout.rewards'" in result.stderr


def test_builtin_exact_match_and_math_verifier():
    assert exact_match({"response": " ZYX \n", "label": "ZYX"}) == 1.0
    assert exact_match({"response": "ZY", "label": "ZYX"}) == 0.0
    assert math_answer({"response": "so \\boxed{1,000}", "label": "1000.0"})["score"] == 1.0
    assert math_answer({"response": "it is 3/4", "label": "0.75"})["score"] == 1.0
    assert math_answer({"response": "\\boxed{\\frac{1}{2}} or 7", "label": "\\frac{1}{2}"})["score"] == 1.0
    assert math_answer({"response": "the answer is 41", "label": "42"}) == {"score": 0.0, "extracted": "41"}
    assert math_answer({"response": "no idea", "label": "42"})["score"] == 0.0


def hangs_on_h(sample):
    """Hangs on responses starting with "h", after writing down how many other hung calls are alive
    then: each holds an exclusive lock on a file of its own for as long as its process lives (the
    kernel drops it when the process is killed), and the lock file appears already locked."""
    if sample["response"].startswith("h"):
        folder = Path(sample["locks"])
        with tempfile.NamedTemporaryFile("w", dir=folder, suffix=".tmp", delete=False) as mine:
            fcntl.flock(mine, fcntl.LOCK_EX)
            Path(mine.name).rename(Path(mine.name).with_suffix(".lock"))
            alive = 0
            for path in folder.glob("*.lock"):
                with open(path) as other:
                    try:
                        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # its process is gone
                    except BlockingIOError:
                        alive += path.stem != Path(mine.name).stem
            with open(folder / "alive-at-start", "a") as record:
                record.write(f"{alive}\n")
            time.sleep(3600)
    return 1.0 if sample["response"] == sample["label"] else 0.0


def test_hung_calls_of_a_batch_run_out_their_timeouts_together_not_one_after_another(tmp_path):
    """5 of 128 samples hang, on one worker. A pool that runs the calls in order starts each hung call
    only when the one before it was killed (five timeouts in all); here all five run at once (the last
    to start finds the four others alive: counted through locks that die with their processes, not
    from a clock), every other sample is scored, and the runner is as good as new for the next batch
    (bench/reward_timeouts.py measures the wall time). The timeout leaves room for the 4 extra pools
    to fork on a loaded machine. Tried: BoundedCalls with max_pools=1 (in order) and max_pools=4 (one
    hung call waits for a kill) both fail here."""
    responses = ["a"] * 123 + ["h"] * 5
    responses = responses[::2] + responses[1::2]  # the hung ones are spread through the batch
    samples = [{**sample, "locks": str(tmp_path)} for sample in _samples(*responses)]
    with RewardRunner(RewardConfig(function=f"{__name__}:hangs_on_h", timeout_s=5.0, num_workers=1)) as runner:
        results = runner.score(samples)
        timed_out = [r for r in results if r.error is not None]
        assert len(timed_out) == 5 and {r.error for r in timed_out} == {"reward function timed out after 5s"}
        assert [r.score for r in results if r.error is None] == [1.0] * 123
        alive_at_start = [int(line) for line in (tmp_path / "alive-at-start").read_text().split()]
        assert len(alive_at_start) == 5 and max(alive_at_start) == 4, alive_at_start  # in order, always 0
        (again,) = runner.score(_samples("a"))
        assert again.score == 1.0
