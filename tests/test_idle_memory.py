"""train_worker.offload_when_idle: auto keeps a colocated trainer on its GPU while the rollout runs where the GPU
holds both (engine.train.idle_memory); true and false decide alone; a bad value is refused by name.
rollout.sleep_level: auto keeps the engine awake through a fit where the fits so far show it fits beside it."""

import math

import pytest
import torch

from trellis.engine.config.loading import ConfigError, load_config
from trellis.engine.train.idle_memory import FIT_MARGIN, HEADROOM, engine_stays_awake, rollout_share, stays_on_gpu
from trellis.engine.train.worker import TrainingWorker
from helpers import worker_config

GIB = 2**30


def test_auto_stays_where_the_engines_share_fits_in_the_free_memory():
    """An 80 GiB GPU, the engine taking 30% of it: the trainer stays with the share and the headroom free,
    and moves one byte short of that; a backend with no fixed share always gets the GPU alone."""
    total, needed = 80 * GIB, math.ceil((0.3 + HEADROOM) * 80 * GIB)
    assert stays_on_gpu("auto", free_bytes=needed, total_bytes=total, share=0.3)
    assert not stays_on_gpu("auto", free_bytes=needed - 1, total_bytes=total, share=0.3)
    assert not stays_on_gpu("auto", free_bytes=total, total_bytes=total, share=None)
    for setting, stays in ((True, False), (False, True)):  # an explicit setting, whatever the memory says
        assert stays_on_gpu(setting, free_bytes=total, total_bytes=total, share=0.3) is stays
        assert stays_on_gpu(setting, free_bytes=0, total_bytes=total, share=0.3) is stays


def test_only_a_colocated_engine_with_a_fixed_share_counts(tiny_model, reverse_data):
    """vLLM colocated: its gpu_memory_utilization (0 if it never sleeps); the transformers backend (its memory
    grows with what it generates) and a disaggregated run (the engine on devices of its own): none."""
    vllm = worker_config(tiny_model, reverse_data, rollout={"backend": "vllm", "gpu_memory_utilization": 0.35})
    assert vllm.train_worker.offload_when_idle == "auto"  # the default
    assert rollout_share(vllm) == 0.35
    assert rollout_share(worker_config(tiny_model, reverse_data)) is None
    # An engine that never sleeps holds its share already: the trainer stays wherever 4% of the card is free.
    awake = worker_config(tiny_model, reverse_data, rollout={"backend": "vllm", "gpu_memory_utilization": 0.35, "sleep_level": 0})
    assert rollout_share(awake) == 0.0
    assert stays_on_gpu("auto", free_bytes=math.ceil(HEADROOM * GIB), total_bytes=GIB, share=rollout_share(awake))
    assert rollout_share(worker_config(tiny_model, reverse_data, rollout={"backend": "vllm"}, trainer="disaggregated")) is None


def test_a_bad_value_is_refused_by_name_and_true_false_read_as_written(tiny_model, reverse_data):
    with pytest.raises(ConfigError, match=r"train_worker.offload_when_idle: 'sometimes': give auto, true or false"):
        worker_config(tiny_model, reverse_data, train_worker={"offload_when_idle": "sometimes"})
    for written, read in (("false", False), ("True", True), (False, False), ("auto", "auto")):
        assert worker_config(tiny_model, reverse_data, train_worker={"offload_when_idle": written}).train_worker.offload_when_idle == read


def test_offload_leaves_a_cpu_trainer_where_it_is(tiny_model, reverse_data):
    """On the CPU there is nothing to move, whatever the setting: a fit after offload and onload runs."""
    for setting in (True, "auto"):
        config = worker_config(tiny_model, reverse_data, train_worker={"device": "cpu", "offload_when_idle": setting})
        worker = TrainingWorker(config, total_train_steps=4, pad_token_id=0)
        worker.offload()
        assert next(worker.model.parameters()).device == torch.device("cpu")
        worker.onload()
        assert next(worker.model.parameters()).device == torch.device("cpu")


def test_load_config_names_the_field_in_a_yaml_typo(tmp_path, tiny_model, reverse_data):
    """The same refusal from a config file, where users write it."""
    path = tmp_path / "run.yaml"
    path.write_text(f"load_from: {tiny_model}\ntrain_dataset: {{path: {reverse_data['train']}}}\ntotal_train_steps: 2\n"
                    "reward: {function: 'trellis.engine.tiny.reverse_task:score'}\ntrain_worker: {offload_when_idle: yes please}\n")
    with pytest.raises(ConfigError, match="offload_when_idle"):
        load_config(path)


def test_the_engine_stays_awake_where_the_last_fits_need_fits_in_the_free_memory():
    """An 80 GiB GPU, fits that took 10 GiB beyond the trainer's memory: the engine stays awake with that, its
    margin and the headroom free, and sleeps one byte short; before any fit there is nothing to go by: it sleeps;
    after fits of quarter-full micro-batches it asks four times the room."""
    total, need = 80 * GIB, 10 * GIB
    enough = math.ceil(need * (1 + FIT_MARGIN) + HEADROOM * total)
    assert engine_stays_awake(free_bytes=enough, total_bytes=total, fit_need_bytes=need)
    assert not engine_stays_awake(free_bytes=enough - 1, total_bytes=total, fit_need_bytes=need)
    assert not engine_stays_awake(free_bytes=total, total_bytes=total, fit_need_bytes=None)
    # Fits whose micro-batches were a quarter full (short responses so far) may need four times as much later.
    assert not engine_stays_awake(free_bytes=enough, total_bytes=total, fit_need_bytes=need, packs_filled=0.25)
    four_times = math.ceil(4 * need * (1 + FIT_MARGIN) + HEADROOM * total)
    assert engine_stays_awake(free_bytes=four_times, total_bytes=total, fit_need_bytes=need, packs_filled=0.25)


def test_sleep_level_auto_is_the_default_and_a_bad_level_is_refused_by_name(tiny_model, reverse_data):
    vllm = worker_config(tiny_model, reverse_data, rollout={"backend": "vllm", "gpu_memory_utilization": 0.3})
    assert vllm.rollout.sleep_level == "auto"
    assert rollout_share(vllm) == 0.3  # counted at the trainer's hand-over, awake or not: the safe side
    with pytest.raises(ConfigError, match=r"rollout.sleep_level"):
        worker_config(tiny_model, reverse_data, rollout={"backend": "vllm", "sleep_level": "sometimes"})


def test_a_cpu_trainer_never_keeps_the_engine_awake_nor_records_it(tiny_model, reverse_data):
    """On the CPU the engine's offload moves nothing and is always asked for; a fit records no engine_awake."""
    config = worker_config(tiny_model, reverse_data, train_worker={"device": "cpu"}, rollout={"backend": "vllm"})
    worker = TrainingWorker(config, total_train_steps=4, pad_token_id=0)
    assert worker.engine_may_stay_awake() is False
    assert worker.idle.fit_ended(1.0) is None
