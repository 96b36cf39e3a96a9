"""Checkpoints, exact resume, HF export and debug replay, in-process (the flow versions are in
test_faults.py and test_s3.py)."""

from __future__ import annotations

import json

import fsspec
import pytest
import torch
from fsspec.implementations.local import LocalFileSystem
from transformers import AutoModelForCausalLM, AutoTokenizer

from trellis.engine.storage.checkpoints import MARKER, CheckpointError, SaveStore
from trellis.engine.storage.store import Store
from trellis.engine.storage.lake import LakeError
from trellis.engine.run.resume import RunExistsError, StartPlan, plan_start
from helpers import lake_rows, logged_metrics, run_local as run, tiny_config

FIT_METRICS = ("train/pg_loss", "train/grad_norm", "train/entropy", "train/clipfrac", "mismatch/k3_kl")


def test_an_interrupted_and_resumed_run_equals_an_uninterrupted_one(tiny_model, reverse_data, tmp_path):
    whole = tiny_config(tiny_model, reverse_data, tmp_path, experiment_name="whole")
    run(whole)
    broken = tiny_config(tiny_model, reverse_data, tmp_path, experiment_name="broken")
    run(broken, steps=3)  # dies after step 3: the latest checkpoint is step 2
    assert SaveStore(Store(broken.checkpoint_uri)).complete_steps() == [2]

    resumed = run(broken, resume=True)
    assert resumed.plan.start.action == "restore" and resumed.plan.start.step == 2

    assert logged_metrics(broken) == logged_metrics(whole)  # steps 0-4, step 3 re-done in place
    assert lake_rows(broken) == lake_rows(whole)
    assert lake_rows(broken, "eval") == lake_rows(whole, "eval")
    assert len(lake_rows(broken)) == 4 * 16 * 8


class FaultyFileSystem(LocalFileSystem):
    """The local disk, except that writes under ``fail_under`` fail once ``budget`` bytes are written."""

    protocol = ("faulty",)
    fail_under: str | None = None
    budget = 0

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(str(path).removeprefix("faulty://"))

    def _open(self, path, mode="rb", **kwargs):
        handle = super()._open(path, mode, **kwargs)
        if "w" in mode and self.fail_under and self.fail_under in str(path):
            write = handle.write

            def failing_write(data):
                FaultyFileSystem.budget -= len(data)
                if FaultyFileSystem.budget < 0:
                    raise OSError(28, "No space left on device (injected)")
                return write(data)

            handle.write = failing_write
        return handle


def test_a_checkpoint_write_that_crashes_half_way_leaves_the_previous_one_to_resume(tiny_model, reverse_data, tmp_path):
    fsspec.register_implementation("faulty", FaultyFileSystem, clobber=True)
    config = tiny_config(tiny_model, reverse_data, f"faulty://{tmp_path}", experiment_name="crash")
    FaultyFileSystem.fail_under, FaultyFileSystem.budget = "checkpoints/step-000004", 100_000  # inside model.safetensors
    with pytest.raises(OSError, match="injected"):
        run(config)
    store = SaveStore(Store(config.checkpoint_uri))
    assert store.steps_on_disk() == [2, 4] and store.complete_steps() == [2]
    half = tmp_path / "crash" / "checkpoints" / "step-000004"
    assert not (half / MARKER).exists() and (half / "model.safetensors").stat().st_size <= 100_000

    FaultyFileSystem.fail_under = None
    resumed = run(config, resume=True)
    assert resumed.plan.start.checkpoint == store.uri(2)
    assert store.complete_steps() == [2, 4]
    whole = tiny_config(tiny_model, reverse_data, tmp_path, experiment_name="whole")
    run(whole)
    assert logged_metrics(config) == logged_metrics(whole)


def test_pruning_keeps_the_newest_and_never_counts_an_incomplete_folder(tmp_path):
    store = SaveStore(Store(str(tmp_path / "checkpoints")))
    for step in (2, 4, 6):
        store.begin(step)
        store.seal(step)
    store.begin(8)  # being written (or crashed): not complete, newer than every complete one
    assert store.latest() == (6, store.uri(6))
    assert store.prune(keep=1) == [2, 4]
    assert store.steps_on_disk() == [6, 8]  # the newer incomplete folder may still be in progress
    meta = json.loads((tmp_path / "checkpoints" / "meta.json").read_text())
    assert meta["complete"] == [{"step": 6, "uri": store.uri(6)}]
    store.begin(10)
    store.seal(10)
    assert store.prune(keep=5) == [8]  # an incomplete folder older than the newest complete one is garbage


def test_max_keep_for_checkpoints_and_hf_exports(tiny_model, reverse_data, tmp_path):
    config = tiny_config(
        tiny_model, reverse_data, tmp_path, experiment_name="keep", total_train_steps=3,
        checkpoint_interval=1, checkpoint_maxkeep=2, hf_interval=1, hf_max_keep=1,
    )
    run(config)
    assert SaveStore(Store(config.checkpoint_uri)).steps_on_disk() == [2, 3]
    assert SaveStore(Store(config.hf_uri)).steps_on_disk() == [3]


def test_the_hf_export_loads_with_from_pretrained_and_generates(tiny_model, reverse_data, tmp_path):
    config = tiny_config(
        tiny_model, reverse_data, tmp_path, experiment_name="hf", total_train_steps=3, checkpoint_interval=-1, hf_interval=2,
    )
    local = run(config)
    store = SaveStore(Store(config.hf_uri))
    assert store.complete_steps() == [2, 3]  # on its interval, and at the last step
    folder = store.uri(3)
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    trained = local.worker.model.state_dict()
    assert all(torch.equal(tensor, trained[name]) for name, tensor in model.state_dict().items())
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "reverse: abc"}], add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > prompt["input_ids"].shape[1]


def test_a_checkpoint_without_optimizer_state_needs_an_explicit_choice(tiny_model, reverse_data, tmp_path):
    config = tiny_config(tiny_model, reverse_data, tmp_path, experiment_name="no_optim", total_train_steps=2,
                         checkpoint_no_save_optimizer=True)
    run(config)
    folder = SaveStore(Store(config.checkpoint_uri)).uri(2)
    assert not fsspec.filesystem("file").exists(f"{folder}/optimizer.pt")
    longer = config.model_copy(update={"total_train_steps": 3})
    with pytest.raises(CheckpointError, match="load_optimizer_states=false"):
        run(longer, resume=True)
    fresh_moments = type(longer).model_validate({**longer.model_dump(), "load_checkpoint_cfg": {"load_optimizer_states": False}})
    assert run(fresh_moments, resume=True).step == 3


def test_a_fresh_start_refuses_to_overwrite_checkpoints_and_incomplete_ones_are_refused(tiny_model, reverse_data, tmp_path):
    config = tiny_config(tiny_model, reverse_data, tmp_path, experiment_name="exists", total_train_steps=2)
    run(config)
    with pytest.raises(RunExistsError, match="auto_resume=true"):
        run(config)
    half = SaveStore(Store(config.checkpoint_uri)).begin(4)
    explicit = type(config).model_validate({**config.model_dump(), "load_checkpoint_cfg": {"checkpoint_path": half}})
    with pytest.raises(CheckpointError, match="incomplete"):
        run(explicit)
    assert run(config.model_copy(update={"auto_resume": True})).plan.start.action == "restore"  # nothing left to do at 2


def test_debug_rollout_then_debug_train_reproduces_the_first_step(tiny_model, reverse_data, tmp_path):
    original = tiny_config(tiny_model, reverse_data, tmp_path, experiment_name="original", total_train_steps=1,
                           checkpoint_interval=-1, enable_initial_evaluate=False)
    run(original)
    lake = str(tmp_path / "rollouts")
    rollout_only = tiny_config(tiny_model, reverse_data, tmp_path, experiment_name="rollout_only", total_train_steps=2,
                               checkpoint_interval=-1, debug_rollout=True, debug_rollout_dir=lake)
    assert run(rollout_only).worker is None  # no trainer was built
    replay = tiny_config(tiny_model, reverse_data, tmp_path, experiment_name="replay", total_train_steps=None,
                         checkpoint_interval=-1, enable_evaluate=False, enable_initial_evaluate=False,
                         debug_train=True, debug_rollout_dir=lake)
    replayed = run(replay)
    assert replayed.backend is None and replayed.step == 2  # every stored batch, no rollout worker

    want, got = logged_metrics(original)[1], logged_metrics(replay)[1]
    for key in FIT_METRICS:
        assert got[key] == want[key], key
    missing = replay.model_copy(update={"debug_rollout_dir": str(tmp_path / "nothing-here")})
    with pytest.raises(LakeError, match="no stored batches"):
        run(missing)


def test_the_start_plan_rules(tmp_path):
    from trellis.engine.config import TrellisConfig

    def config(**changes):
        return TrellisConfig(load_from="m", train_dataset={"path": "d"}, reward={"function": "r:score"}, total_train_steps=9, work_dir=str(tmp_path),
                             experiment_name="plan", **changes)

    assert plan_start(config(), resume=False).action == "fresh"
    assert plan_start(config(), resume=True, workers_used=True).action == "restart"  # nothing to go back to
    assert plan_start(config(), resume=False, applied_step=3).action == "continue"
    store = SaveStore(Store(config().checkpoint_uri))
    for step in (2, 4):
        store.begin(step)
        (tmp_path / "plan" / "checkpoints" / f"step-00000{step}" / "train_state.json").write_text(json.dumps({"step": step}))
        store.seal(step)
    assert plan_start(config(), resume=True, applied_step=4).action == "reattach"
    assert plan_start(config(), resume=True, applied_step=5) == StartPlan(action="restore", step=4, checkpoint=store.uri(4))
    explicit = config(load_checkpoint_cfg={"checkpoint_path": store.uri(2)})
    assert plan_start(explicit, resume=False) == StartPlan(action="restore", step=2, checkpoint=store.uri(2))
    assert plan_start(explicit, resume=True).checkpoint == store.uri(4)  # a resume prefers the run's own progress
    with pytest.raises(RunExistsError):
        plan_start(config(), resume=False)



def test_a_resume_can_start_the_learning_rate_schedule_again(tiny_model, reverse_data, tmp_path):
    """Warm-up over 4 steps (lr x 1/4, 2/4, 3/4, 1 at steps 1-4): a resume at step 3 continues at 3/4, or
    with load_checkpoint_cfg.load_scheduler false starts again at 1/4."""
    def resumed_lr(name: str, load_scheduler: bool) -> list[float]:
        config = tiny_config(tiny_model, reverse_data, tmp_path / name, total_train_steps=3, enable_evaluate=False,
                             optim={"lr": 4e-4, "warmup_steps": 4}, load_checkpoint_cfg={"load_scheduler": load_scheduler})
        run(config, steps=2)  # checkpoint at step 2, then stopped
        run(config, resume=True)
        return [logged_metrics(config)[step]["train/lr"] for step in (1, 2, 3)]

    assert resumed_lr("continued", True) == pytest.approx([1e-4, 2e-4, 3e-4])
    assert resumed_lr("restarted", False) == pytest.approx([1e-4, 2e-4, 1e-4])
