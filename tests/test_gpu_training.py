"""The GPU training path: varlen flash attention, packed layout and FSDP2 under bf16 (H200; skipped in CI)."""

import math

import pytest
import torch
import torch.nn.functional as F

from trellis.engine.config.loading import load_config
from trellis.engine.data.prepare import IGNORE, PreparedBatch, TrainSequence
from trellis.engine.train.worker import TrainingWorker
from trellis.engine.train.varlen_attention import fa4_unavailable, varlen_attention, varlen_attention_fa4, vision_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _needs(options: dict) -> None:
    if options.get("attention_kernel") == "fa4" and (reason := fa4_unavailable(torch.device("cuda"))):
        pytest.skip(f"FlashAttention-4: {reason}")


@pytest.mark.parametrize("kernel", ["torch", "fa4"])
def test_flash_varlen_attention_equals_causal_attention_per_sequence(kernel):
    """Three sequences in one row, GQA 14:2 heads as in Qwen2-0.5B, bf16; each attends to itself only
    (PyTorch's flash kernel, or FlashAttention-4's)."""
    _needs({"attention_kernel": kernel})
    attention = varlen_attention_fa4 if kernel == "fa4" else varlen_attention
    torch.manual_seed(0)
    lengths = [5, 130, 61]
    query = torch.randn(1, 14, sum(lengths), 64, device="cuda", dtype=torch.bfloat16)
    key, value = (torch.randn(1, 2, sum(lengths), 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cu = torch.tensor([0, 5, 135, 196], device="cuda", dtype=torch.int32)
    out, _ = attention(None, query, key, value, None, scaling=0.125, cu_seq_lens_q=cu, max_length_q=130)
    start = 0
    for length in lengths:
        end = start + length
        expected = F.scaled_dot_product_attention(
            query[:, :, start:end], key[:, :, start:end], value[:, :, start:end], is_causal=True, scale=0.125, enable_gqa=True
        ).transpose(1, 2)
        assert (out[:, start:end].float() - expected.float()).abs().max() < 2e-2
        start = end


def test_the_vision_towers_flash_attention_equals_bidirectional_attention_per_window():
    """A Qwen2.5-VL-3B vision block's heads (16 x 80) over three windows of one row, bf16, forward and
    backward: no causal mask, nothing across windows."""
    torch.manual_seed(0)
    lengths = [64, 64, 256]
    query, key, value = (
        torch.randn(1, 16, sum(lengths), 80, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
    )
    cu = torch.tensor([0, 64, 128, 384], device="cuda", dtype=torch.int32)
    out, _ = vision_attention(None, query, key, value, None, scaling=80**-0.5, cu_seq_lens_q=cu, max_length_q=256)
    out.float().square().sum().backward()
    grad = query.grad.clone()
    query.grad = None
    parts = [
        F.scaled_dot_product_attention(*(t[:, :, a:b] for t in (query, key, value)), scale=80**-0.5).transpose(1, 2)
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())
    ]
    expected = torch.cat(parts, dim=1)
    expected.float().square().sum().backward()
    assert (out.float() - expected.float()).abs().max() < 2e-2
    assert (grad.float() - query.grad.float()).abs().max() / query.grad.float().abs().max() < 2e-2


def _sequences(vocab: int) -> list[TrainSequence]:
    generator = torch.Generator().manual_seed(0)
    sequences = []
    for length in (40, 75, 23, 90):
        ids = torch.randint(3, vocab, (length,), generator=generator).tolist()
        labels = [IGNORE] * 9 + ids[10:] + [ids[0]]
        sequences.append(TrainSequence(ids, labels, [0.0] * 9 + [1.0] * (length - 9), [-1.0] * length, prompt_length=10))
    return sequences


def _gpu_worker(tiny_model, reverse_data, rollout: dict | None = None, **worker_options) -> TrainingWorker:
    """A trainer of the tiny model on the GPU for three steps, 128-token packs, with these train_worker options."""
    config = load_config(
        None,
        load_from=str(tiny_model),
        train_dataset={"path": str(reverse_data["train"]), "max_prompt_length": 64},
        reward={"function": "trellis.engine.tiny.reverse_task:score"},
        total_train_steps=3,
        train_worker={"device": "cuda", "pack_max_length": 128, **worker_options},
        rollout=rollout or {},
    )
    return TrainingWorker(config, total_train_steps=3, pad_token_id=0)


@pytest.mark.parametrize(
    "options",
    [
        {"layout": "packed", "compile": False},
        {"layout": "packed"},  # compile: auto, which compiles the layers here
        {"layout": "packed", "fsdp": True},
        {"layout": "packed", "compile": True, "compile_scope": "decoder"},
        {"layout": "packed", "compile": True, "cuda_graphs": True},
        {"layout": "packed", "compile": True, "attention_kernel": "fa4", "logprob_keep_logits": False},
    ],
)
def test_packed_bf16_training_matches_the_padded_layout(tiny_model, reverse_data, options):
    """Same batch, same start, three steps of two micro-batches each (CUDA graphs are recorded by the
    second step and replayed by the second micro-batch and the third step): the packed GPU layout (with
    FSDP2's bf16 policy, the whole decoder compiled as one graph, or compiled layers replayed as CUDA
    graphs; or FlashAttention-4 between compiled layers, the head recomputing its logits) reports what
    padded rows do at every step."""
    _needs(options)
    metrics = {}
    for name, worker_options in (("padded", {"layout": "padded"}), ("tested", options)):
        worker = _gpu_worker(tiny_model, reverse_data, **worker_options)
        batch = PreparedBatch(_sequences(worker.model.config.vocab_size))
        metrics[name] = [worker.fit(batch, step).metrics for step in (1, 2, 3)]
    for step, (tested, padded) in enumerate(zip(metrics["tested"], metrics["padded"]), start=1):
        for key in ("pg_loss", "entropy", "mismatch/train_ppl"):
            assert tested[key] == pytest.approx(padded[key], rel=2e-2), (step, key)


def test_compiled_layers_train_alike_when_the_trainer_is_offloaded_between_steps(tiny_model, reverse_data):
    """The default compile (auto: compiled here) under the colocated default, offload_when_idle: weights and
    AdamW state go to the CPU and back between fits; three steps report what a resident trainer does."""
    metrics = {}
    for offload in (False, True):
        worker = _gpu_worker(tiny_model, reverse_data, offload_when_idle=offload)
        assert worker.compiled
        batch = PreparedBatch(_sequences(worker.model.config.vocab_size))
        metrics[offload] = []
        for step in (1, 2, 3):
            worker.onload()
            metrics[offload].append(worker.fit(batch, step).metrics)
            worker.offload()
        assert next(worker.model.parameters()).device.type == ("cpu" if offload else "cuda")
    for step, (offloaded, resident) in enumerate(zip(metrics[True], metrics[False]), start=1):
        for key in ("pg_loss", "entropy", "mismatch/train_ppl"):
            assert offloaded[key] == pytest.approx(resident[key], rel=1e-3), (step, key)


def test_auto_offload_keeps_the_trainer_on_the_gpu_where_the_engines_share_fits(tiny_model, reverse_data):
    """offload_when_idle: auto (the default) beside a vLLM engine taking 30% of the GPU: the tiny trainer keeps
    its weights and AdamW state there; beside one taking 99%, they go to the CPU and come back for the next fit."""
    for share, idle_device in ((0.3, "cuda"), (0.99, "cpu")):
        worker = _gpu_worker(tiny_model, reverse_data, rollout={"backend": "vllm", "gpu_memory_utilization": share})
        batch = PreparedBatch(_sequences(worker.model.config.vocab_size))
        worker.fit(batch, 1)
        worker.offload()
        assert next(worker.model.parameters()).device.type == idle_device, share
        assert {s.device.type for state in worker.optimizer.state.values() for k, s in state.items() if k != "step"} == {idle_device}
        worker.onload()
        assert next(worker.model.parameters()).device.type == "cuda"
        assert math.isfinite(worker.fit(batch, 2).metrics["pg_loss"])


def test_sleep_level_auto_keeps_the_engine_awake_once_a_fit_showed_it_fits(tiny_model, reverse_data):
    """rollout.sleep_level: auto (the default): the engine sleeps through the first fit (nothing measured yet),
    stays awake for the next where the GPU's free memory holds what the fit took, and sleeps again once memory
    held elsewhere (a stand-in for a larger engine) leaves less than the headroom free; each fit records it."""
    worker = _gpu_worker(tiny_model, reverse_data, rollout={"backend": "vllm", "gpu_memory_utilization": 0.3})
    batch = PreparedBatch(_sequences(worker.model.config.vocab_size))
    assert worker.engine_may_stay_awake() is False
    assert worker.fit(batch, 1).metrics["memory/engine_awake"] == 0.0
    worker.offload()
    assert worker.engine_may_stay_awake() is True
    worker.onload()
    assert worker.fit(batch, 2).metrics["memory/engine_awake"] == 1.0
    worker.offload()
    free, total = torch.cuda.mem_get_info()
    held = torch.empty(free - int(0.02 * total), dtype=torch.uint8, device="cuda")
    assert worker.engine_may_stay_awake() is False
    del held
    worker.onload()
    assert worker.fit(batch, 3).metrics["memory/engine_awake"] == 0.0


def test_compiled_head_equals_full_logits_autograd():
    """The chunked head (compiled on CUDA, bf16 under autocast, T=0.7, uneven last chunk) against
    log_softmax of the same bf16 logits with autograd: logprobs, entropies and both gradients."""
    from trellis.engine.train.logprob_head import label_logprobs

    torch.manual_seed(0)
    head = torch.nn.Linear(64, 5000, bias=False).cuda()
    hidden = torch.randn(300, 64, device="cuda", requires_grad=True)
    labels = torch.randint(0, 5000, (300,), device="cuda")
    weights = torch.randn(300, device="cuda")
    results = []
    for chunked in (True, False):
        hidden.grad = head.weight.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if chunked:
                logprob, entropy = label_logprobs(hidden, head, labels, temperature=0.7, chunk_tokens=128)
            else:
                logp = torch.log_softmax(head(hidden).float() / 0.7, dim=-1)
                logprob = logp.gather(-1, labels[:, None]).squeeze(-1)
                entropy = -(logp.exp() * logp).sum(-1)
        (logprob * weights).sum().backward()
        results.append((logprob.detach(), entropy.detach(), hidden.grad.clone(), head.weight.grad.clone()))
    for got, expected, name in zip(results[0], results[1], ("logprob", "entropy", "hidden grad", "weight grad")):
        scale = expected.abs().max().item()
        assert (got.float() - expected.float()).abs().max().item() <= 2e-2 * scale + 1e-3, name
