"""The GPU training path: varlen flash attention, packed layout and FSDP2 under bf16 (H200; skipped in CI)."""

import pytest
import torch
import torch.nn.functional as F

from engine.config_loading import load_config
from engine.prepare import IGNORE, PreparedBatch, TrainSequence
from engine.train_worker import TrainingWorker
from engine.varlen_attention import varlen_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_flash_varlen_attention_equals_causal_attention_per_sequence():
    """Three sequences in one row, GQA 14:2 heads as in Qwen2-0.5B, bf16; each attends to itself only."""
    torch.manual_seed(0)
    lengths = [5, 130, 61]
    query = torch.randn(1, 14, sum(lengths), 64, device="cuda", dtype=torch.bfloat16)
    key, value = (torch.randn(1, 2, sum(lengths), 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cu = torch.tensor([0, 5, 135, 196], device="cuda", dtype=torch.int32)
    out, _ = varlen_attention(None, query, key, value, None, scaling=0.125, cu_seq_lens_q=cu, max_length_q=130)
    start = 0
    for length in lengths:
        end = start + length
        expected = F.scaled_dot_product_attention(
            query[:, :, start:end], key[:, :, start:end], value[:, :, start:end], is_causal=True, scale=0.125, enable_gqa=True
        ).transpose(1, 2)
        assert (out[:, start:end].float() - expected.float()).abs().max() < 2e-2
        start = end


def _sequences(vocab: int) -> list[TrainSequence]:
    generator = torch.Generator().manual_seed(0)
    sequences = []
    for length in (40, 75, 23, 90):
        ids = torch.randint(3, vocab, (length,), generator=generator).tolist()
        labels = [IGNORE] * 9 + ids[10:] + [ids[0]]
        sequences.append(TrainSequence(ids, labels, [0.0] * 9 + [1.0] * (length - 9), [-1.0] * length, prompt_length=10))
    return sequences


@pytest.mark.parametrize("options", [{"layout": "packed"}, {"layout": "packed", "fsdp": True}])
def test_packed_bf16_training_matches_the_padded_layout(tiny_model, reverse_data, options):
    """Same batch, same start: the packed GPU layout (and FSDP2's bf16 policy) reports what padded rows do."""
    metrics = {}
    for name, worker_options in (("padded", {"layout": "padded"}), ("tested", options)):
        config = load_config(
            None,
            load_from=str(tiny_model),
            train_dataset={"path": str(reverse_data["train"])},
            total_train_steps=2,
            train_worker={"device": "cuda", **worker_options},
        )
        worker = TrainingWorker(config, total_train_steps=2, pad_token_id=0)
        metrics[name] = worker.fit(PreparedBatch(_sequences(worker.model.config.vocab_size)), 1).metrics
    for key in ("pg_loss", "entropy", "mismatch/train_ppl"):
        assert metrics["tested"][key] == pytest.approx(metrics["padded"][key], rel=2e-2), key
