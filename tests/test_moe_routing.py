"""Routing capture and replay on a Qwen3-MoE policy (the tiny MoE's shape, untrained weights, which
route just as a trained model's do), in the trainer's packed and padded layouts, through the rollout
backend and the lake."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import torch
from trellis.engine.config.loading import load_config
from trellis.engine.data.prepare import IGNORE, TrainSequence, build_sequence
from trellis.engine.data.samples import RolloutSample
from trellis.engine.moe.checks import moe_mismatch
from trellis.engine.moe.routers import config_moe_shape, moe_shape
from trellis.engine.moe.routing import Replay, RouterHooks
from trellis.engine.moe.stats import expert_counts_LE, load_balancing_loss, load_entropy_and_max_share, same_topk_TL
from trellis.engine.rollout.agents.generate import extend
from trellis.engine.rollout.backends.base import Generation, SamplingParams
from trellis.engine.rollout.backends.transformers_backend import TransformersRollout
from trellis.engine.storage.lake import read_groups, write_samples
from trellis.engine.storage.store import Store
from trellis.engine.tiny.model import build_tokenizer
from trellis.engine.tiny.moe import EXPERTS, TOP_K, build_moe_model
from trellis.engine.train.packing import to_packed, to_padded

LAYERS = 4


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory, tokenizer):
    """The tiny MoE without its warm-up, saved and loaded back as an HF checkpoint."""
    folder = tmp_path_factory.mktemp("moe") / "model"
    build_moe_model(tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _sequences(count: int, generator: torch.Generator) -> list[TrainSequence]:
    """Sequences of different lengths, each with a random recorded routing over its response."""
    sequences = []
    for index in range(count):
        prompt, response = 5 + index, 3 + 2 * index
        ids = torch.randint(3, 200, (prompt + response - 1,), generator=generator).tolist()
        labels = [IGNORE] * (prompt - 1) + ids[prompt:] + [7]
        routing = torch.stack([torch.randperm(EXPERTS, generator=generator)[:TOP_K] for _ in range(response * LAYERS)])
        sequences.append(TrainSequence(
            input_ids=ids, labels=labels, advantages=[0.0] * len(ids), rollout_logprobs=[0.0] * len(ids),
            prompt_length=prompt, routed_experts=routing.view(response, LAYERS, TOP_K).to(torch.uint8),
        ))
    return sequences


def _forward(model, hooks, batch, replay):
    with hooks.session(replay) as session:
        batch.label_hidden(model.get_decoder())
    return session


@pytest.mark.parametrize("lay_out", [to_padded, to_packed], ids=["padded", "packed"])
def test_with_replay_every_replayed_token_goes_to_the_recorded_experts_and_without_it_not(lay_out, moe_checkpoint):
    """r3's contract: inside a replay, the experts each recorded token reaches are exactly the recorded
    top-k, in every MoE layer; prompt tokens keep the router's own. Without the replay the router's top-k
    differs from the (random) recorded one for some tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(moe_checkpoint, dtype=torch.float32)
    hooks = RouterHooks(model)
    batch = lay_out(_sequences(3, torch.Generator().manual_seed(0)), [0, 1, 2], pad_id=0)
    replay = Replay(batch.routed_experts_TLK, batch.routed_mask_T)
    replayed = _forward(model, hooks, batch, replay)
    plain = _forward(model, hooks, batch, None)
    mask = batch.routed_mask_T
    assert int(mask.sum()) == 3 + 5 + 7
    assert torch.equal(replayed.applied_TLK()[mask], batch.routed_experts_TLK[mask].long())
    assert torch.equal(replayed.applied_TLK()[~mask][:, 0], plain.applied_TLK()[~mask][:, 0])  # layer 0 sees the same inputs
    assert not same_topk_TL(plain.applied_TLK()[mask], batch.routed_experts_TLK[mask]).all()


def test_gradients_reach_the_router_through_replayed_routing(moe_checkpoint):
    """The replay picks the experts; their gate weights stay the router's probabilities, so a loss on
    the output gives every router a gradient."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(moe_checkpoint, dtype=torch.float32)
    hooks = RouterHooks(model)
    batch = to_padded(_sequences(2, torch.Generator().manual_seed(1)), [0, 1], pad_id=0)
    replay = Replay(batch.routed_experts_TLK, batch.routed_mask_T)
    with hooks.session(replay):
        batch.label_hidden(model.get_decoder()).square().mean().backward()
    routers = [module for name, module in model.named_modules() if name.endswith("mlp.gate")]
    assert len(routers) == LAYERS
    for router in routers:
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_the_rollout_backend_records_what_the_trainer_computes_for_each_response_token(moe_checkpoint, tokenizer):
    """Entry j of a response's routing is the forward that predicted token j. A full forward of prompt +
    response over the same weights routes those positions the same way (the KV cache changes rounding
    only); a continued response keeps its first part's routing."""
    from transformers import AutoModelForCausalLM

    rollout = TransformersRollout(str(moe_checkpoint), tokenizer, capture_routing=True)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "reverse ABCD"}], add_generation_prompt=True, tokenize=True, return_dict=False)
    generations = rollout.generate([prompt, prompt], SamplingParams(max_new_tokens=6, seed=3))
    model = AutoModelForCausalLM.from_pretrained(moe_checkpoint, dtype=torch.float32)
    hooks = RouterHooks(model)
    for generation in generations:
        routing = generation.routed_experts
        assert routing.shape == (len(generation.response_ids), LAYERS, TOP_K) and routing.dtype == torch.uint8
        ids = torch.tensor([prompt + generation.response_ids[:-1]])
        with torch.no_grad(), hooks.session() as session:
            model(input_ids=ids)
        trainer_TLK = session.computed_TLK()[len(prompt) - 1 :]
        assert same_topk_TL(trainer_TLK, routing).float().mean() >= 0.95
    sample = RolloutSample("r", "g", "s", 0, [], prompt, None, "d", "t")
    first = Generation(generations[0].response_ids[:2], generations[0].logprobs[:2], "", "abort", routed_experts=generations[0].routed_experts[:2])
    extend(sample, first, 6, 0, None)
    extend(sample, generations[1], 4, 1, None)
    assert torch.equal(sample.routed_experts, torch.cat([generations[0].routed_experts[:2], generations[1].routed_experts[:4]]))


def test_routing_lands_in_the_lake_compactly_and_reads_back(tmp_path):
    """The routed_experts column holds layers x K bytes per response token (uint8 ids), reads back as the
    same tensor, and is left out when the run says not to store it."""
    routing = torch.randint(0, EXPERTS, (6, LAYERS, TOP_K), dtype=torch.uint8)
    sample = RolloutSample("r0", "g0", "s0", 0, [{"role": "user", "content": "x"}], [1, 2, 3], "y", "d", "t",
                           response_ids=[4, 5, 6, 7, 8, 9], logprobs=[-0.1] * 6, reward=1.0, routed_experts=routing)
    uri = write_samples([sample], root=Store(str(tmp_path / "run")), run="run", split="train", step=1)
    table = pq.read_table(uri)
    assert len(table.column("routed_experts")[0].as_py()) == 6 * LAYERS * TOP_K
    assert torch.equal(read_groups(Store(str(tmp_path / "run")), "train", 1)[0][0].routed_experts, routing)
    write_samples([sample], root=Store(str(tmp_path / "bare")), run="run", split="train", step=1, routing=False)
    assert read_groups(Store(str(tmp_path / "bare")), "train", 1)[0][0].routed_experts is None
    assert build_sequence(sample, 1.0).routed_experts is routing
    sample.routed_experts = routing[:5]  # a truncated capture is not replayed
    assert build_sequence(sample, 1.0).routed_experts is None


def test_load_metrics_and_the_balancing_loss():
    """Balanced load has entropy 1 and max share 1/E; the balancing loss is K when routing is uniform."""
    ids_TLK = torch.arange(16).remainder(EXPERTS).view(8, 1, 2)
    counts = expert_counts_LE(ids_TLK, torch.ones(8, dtype=torch.bool), EXPERTS)
    entropy, max_share = load_entropy_and_max_share(counts)
    assert entropy[0] == pytest.approx(1.0) and max_share[0] == pytest.approx(1 / EXPERTS)
    loss = load_balancing_loss([torch.zeros(8, EXPERTS)], ids_TLK, torch.ones(8, dtype=torch.bool))
    assert float(loss) == pytest.approx(TOP_K)


def test_moe_shapes_and_checkpoint_mismatch(moe_checkpoint):
    from transformers import AutoModelForCausalLM

    shape = moe_shape(AutoModelForCausalLM.from_pretrained(moe_checkpoint))
    assert (shape.layers, shape.experts, shape.top_k) == (LAYERS, EXPERTS, TOP_K)
    assert config_moe_shape({"num_experts": 8, "num_experts_per_tok": 2}) == (8, 2)
    assert config_moe_shape({"hidden_size": 128}) is None
    assert moe_mismatch("ckpt", {"layers": 4, "experts": 8, "top_k": 2}, shape) is None
    message = moe_mismatch("ckpt", {"layers": 4, "experts": 4, "top_k": 2}, shape)
    assert "4 experts" in message and "8 experts" in message


def test_r3_needs_a_backend_that_returns_routing(tmp_path, monkeypatch):
    """Both named: the setting and the backend that cannot honour it."""
    from trellis.engine.config import backends

    monkeypatch.setitem(backends.ROLLOUT_BACKENDS, "vllm", backends.RolloutBackendTraits(
        needs_gpu=True, supports_abort=True, exports_served_weights=False, returns_routed_experts=False))
    with pytest.raises(Exception) as error:
        load_config("configs/tiny_reverse.yaml", load_from=str(tmp_path), rollout={"backend": "vllm"},
                    train_worker={"routing_replay": "r3"}, work_dir=str(tmp_path))
    assert "routing_replay: r3" in str(error.value) and "rollout.backend=vllm" in str(error.value)


def test_a_continued_response_keeps_each_tokens_routing_from_the_engine_that_made_it(tmp_path):
    """Partial rollout in the disaggregated producer: a pause interrupts the responses after 2 of their 4
    tokens; after the sync the new version finishes them. Each token's routing is the one its engine
    version handed back (here: experts (v, v + 1) for version v), and the replay buffer's checkpoint
    keeps it."""
    from test_producer import WAIT_S, ScriptedRollout, make_producer, wait_until

    class RoutedRollout(ScriptedRollout):
        def stream(self, prompts, params, limits=None):
            version = self.policy_version
            for index, generation in super().stream(prompts, params, limits):
                count = len(generation.response_ids)
                generation.routed_experts = torch.tensor([version, version + 1], dtype=torch.uint8).repeat(count, 1, 1)
                yield index, generation

    producer, rewards, _ = make_producer(tmp_path, max_staleness=1, enable_partial_rollout=True)
    backend = RoutedRollout(length=4, hold_at=2)
    try:
        producer.continue_produce(0, backend)
        wait_until(backend.held.is_set)
        producer.pause_produce(timeout_s=WAIT_S)
        restored, restored_rewards, _ = make_producer(tmp_path, max_staleness=1, enable_partial_rollout=True)
        restored.load_state_dict(producer.state_dict())
        kept = [s.routed_experts for group in restored.buffer.groups for s in group.samples]
        assert all(torch.equal(routing, torch.tensor([[[0, 1]]] * 2, dtype=torch.uint8)) for routing in kept)
        restored_rewards.close()
        backend.policy_version, backend.hold_at = 1, None
        producer.continue_produce(1, backend)
        batch = producer.get_batch(1, timeout_s=WAIT_S)
        for sample in (s for group in batch.groups for s in group):
            assert sample.response_versions == [0, 0, 1, 1]
            assert sample.routed_experts[:, 0].tolist() == [[0, 1], [0, 1], [1, 2], [1, 2]]
    finally:
        producer.shutdown()
        rewards.close()
