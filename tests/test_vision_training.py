"""Training a vision-language policy (issue 34): the trainer recomputes the rollout's logprobs of
image prompts (pixels and multimodal positions the same on both sides) in the packed and the padded
layout; the vision tower is frozen by default and trains when asked; the HF export loads back whole,
with its image processor."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

from trellis.engine.config.loading import load_config
from trellis.engine.data.prepare import prepare_train_data
from trellis.engine.data.prompts import load_prompts
from trellis.engine.rollout.backends.transformers_backend import TransformersRollout
from trellis.engine.rollout.production.produce import rollout_groups, sampling_params
from trellis.engine.rollout.rewards.runner import RewardRunner
from trellis.engine.storage.store import Store
from trellis.engine.tiny import shapes_task
from trellis.engine.tiny.vlm import save_tiny_vlm
from trellis.engine.train.worker import TrainingWorker
from trellis.engine.vision.processor import VisionProcessor


def _config(path, data, max_prompt_length=1024, **changes):
    return load_config(
        None,
        load_from=path,
        train_dataset={"path": str(data), "max_prompt_length": max_prompt_length},
        reward={"function": "trellis.engine.tiny.shapes_task:score"},
        rollout={"max_new_tokens": 4},
        total_train_steps=4,
        train_batch_size=4,
        **changes,
    )


@pytest.fixture(scope="module")
def vlm_batch(tmp_path_factory):
    """Four pictures x 4 samples from the tiny random VL model; rewards set by hand (a random model
    rarely counts right), so every group has signal."""
    folder = tmp_path_factory.mktemp("vlm_train")
    path = str(save_tiny_vlm(folder / "model", seed=1))
    data = shapes_task.write_dataset(folder / "shapes.parquet", count=8, seed=2)
    config = _config(path, data)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts, _ = load_prompts(config.train_dataset, tokenizer, VisionProcessor.of_model(path))
    with RewardRunner(config.reward) as rewards:
        produced = rollout_groups(
            [(0, prompt) for prompt in prompts[:4]], repeat=4, backend=TransformersRollout(path, tokenizer), rewards=rewards,
            params=sampling_params(config.rollout, seed=0), train_step=1, id_prefix="v-",
        )
    for group in produced.groups:
        for k, sample in enumerate(group):
            sample.reward = float(k % 2)
    return path, data, produced.groups, tokenizer.pad_token_id


def _fit(config, groups, pad_id):
    worker = TrainingWorker(config, total_train_steps=4, pad_token_id=pad_id)
    before = {n: p.detach().clone() for n, p in worker.model.named_parameters()}
    result = worker.fit(prepare_train_data(groups, config.advantage, shuffle=False, seed=0), 1)
    return worker, before, result


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_the_trainer_recomputes_the_rollouts_logprobs_of_image_prompts(vlm_batch, layout):
    path, data, groups, pad_id = vlm_batch
    assert all(sample.images for group in groups for sample in group)
    _, _, result = _fit(_config(path, data, train_worker={"layout": layout}), groups, pad_id)
    # The same float32 weights on both sides: any gap would be pixels or positions that differ.
    assert result.metrics["mismatch/k3_kl"] < 1e-7
    assert result.metrics["grad_norm"] > 0


def test_the_vision_tower_is_frozen_by_default_and_trains_when_asked(vlm_batch):
    path, data, groups, pad_id = vlm_batch
    for freeze in (True, False):
        worker, before, _ = _fit(_config(path, data, train_worker={"freeze_vision": freeze, "layout": "padded"}), groups, pad_id)
        moved = {n for n, p in worker.model.named_parameters() if not torch.equal(p, before[n])}
        vision = {n for n in before if n.startswith("model.visual.")}
        assert vision and moved - vision, "the language model trains either way"
        assert (moved & vision == set()) if freeze else (moved & vision == vision)


def test_a_frozen_tower_runs_once_per_mini_batch_in_chunks_and_gives_the_rollouts_logprobs(vlm_batch, monkeypatch):
    """Micro-batches of 64 tokens (a picture's sequence is ~31): the trained tower runs in each one's
    forward; the frozen one ahead of them, once, or once per chunk of patches, to the same logprobs."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

    from trellis.engine.train.vision_batch import ImageTable, tower_output

    path, data, groups, pad_id = vlm_batch
    calls = []
    original = Qwen2VLModel.get_image_features
    monkeypatch.setattr(Qwen2VLModel, "get_image_features", lambda self, *a, **k: calls.append(len(a[1])) or original(self, *a, **k))
    counts = {}
    for freeze in (True, False):
        calls.clear()
        config = _config(path, data, max_prompt_length=60, train_worker={"freeze_vision": freeze, "layout": "packed", "pack_max_length": 64})
        worker, _, result = _fit(config, groups, pad_id)
        counts[freeze] = list(calls)
        assert result.metrics["mismatch/k3_kl"] < 1e-7
    assert counts[True] == [4], "the four pictures in one call"
    assert len(counts[False]) > 4 and sum(counts[False]) > 4, "each micro-batch's pictures again, with a graph"

    sequences = [seq for group in groups for seq in prepare_train_data([group], config.advantage, shuffle=False, seed=0).sequences]
    whole, chunked = ImageTable(sequences, worker.vision), ImageTable(sequences, worker.vision)
    calls.clear()
    with torch.no_grad():
        whole.compute_features(lambda inputs: tower_output(worker.model.model, inputs.pixel_values, inputs.image_grid_thw), 10**6)
        chunked.compute_features(lambda inputs: tower_output(worker.model.model, inputs.pixel_values, inputs.image_grid_thw), 1)
    assert calls == [4, 1, 1, 1, 1]
    assert all(torch.allclose(whole.features[key], chunked.features[key], atol=1e-6) for key in whole.keys)


def test_two_gloo_ranks_make_the_update_of_one_on_an_image_batch(vlm_batch, tmp_path, ray_cluster):
    """Two trainer ranks (FSDP2 over gloo, the tower in each micro-batch's forward where its weights are
    whole) against one rank (the frozen tower run ahead): the same loss, grad norm and k3 to 1e-5, the
    same weights to 5e-5, the tower's untouched on every rank."""
    from helpers import fit_on_trainer_ranks

    path, data, groups, pad_id = vlm_batch
    changes = dict(train_worker={"optimizer_steps": 2, "layout": "padded"}, experiment_name="vl-ranks", work_dir=str(tmp_path),
                   cluster={"address": ray_cluster["address"], "ray_get_timeout_s": 120})
    batch = prepare_train_data(groups, _config(path, data).advantage, shuffle=True, seed=0)
    one_rank = TrainingWorker(_config(path, data, **changes), total_train_steps=4, pad_token_id=pad_id)
    before = {n: p.detach().clone() for n, p in one_rank.model.named_parameters()}
    with fit_on_trainer_ranks(_config(path, data, train_resources={"num_workers": 2}, **changes), batch) as (sharded, workers):
        single = one_rank.fit(batch, 1)
        for name in ("pg_loss", "grad_norm", "mismatch/k3_kl"):
            assert sharded[0].metrics[name] == pytest.approx(single.metrics[name], rel=1e-5, abs=1e-5), name
        weights = workers.wait([rank.export_weights.remote() for rank in workers.actors("trainer")])[0]
    for name, tensor in one_rank.export_weights().items():
        assert torch.allclose(weights[name], tensor, atol=5e-5), name
    tower = [name for name in before if name.startswith("model.visual.")]
    assert tower and all(torch.equal(weights[name], before[name]) for name in tower)


def test_the_hf_export_loads_back_with_its_image_processor(vlm_batch, tmp_path):
    path, data, groups, pad_id = vlm_batch
    worker, _, _ = _fit(_config(path, data, train_worker={"layout": "padded"}), groups, pad_id)
    worker.export_hf(Store(str(tmp_path / "hf")), path)

    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "hf")
    trained = worker.model.state_dict()
    assert all(torch.equal(tensor, trained[name]) for name, tensor in loaded.state_dict().items())
    processor = AutoImageProcessor.from_pretrained(tmp_path / "hf")
    assert processor.merge_size == 2 and processor.patch_size == 14


def test_the_packed_layouts_vision_attention_equals_the_towers_own_per_window_attention():
    """A Qwen2.5-VL tower with windowed and full-attention blocks: the packed layout's one-call vision
    attention (per window on CPU, flash varlen on GPU) gives the tower's own output and gradients."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from trellis.engine.train.varlen_attention import use_varlen_attention

    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                vocab_size=64, rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]})
    vision = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])
    torch.manual_seed(0)
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=5, video_token_id=6)
    towers = [Qwen2_5_VLForConditionalGeneration(config).float() for _ in range(2)]
    towers[1].load_state_dict(towers[0].state_dict())
    use_varlen_attention(towers[1])
    assert towers[1].config.vision_config._attn_implementation == "trellis_flash_vision"
    grids = torch.tensor([[1, 8, 12], [1, 12, 4]])  # 2x3 and 3x1 windows of 4x4 patches
    pixels = torch.randn(int(grids.prod(-1).sum()), 3 * 2 * 14 * 14)
    outputs = []
    for model in towers:
        features = model.model.get_image_features(pixels, grids, return_dict=True).pooler_output
        torch.cat(features).square().sum().backward()
        outputs.append((torch.cat(features), model.model.visual.blocks[0].attn.qkv.weight.grad))
    torch.testing.assert_close(outputs[1][0], outputs[0][0])
    torch.testing.assert_close(outputs[1][1], outputs[0][1])
