"""Weight sync between processes: flat bucketed buffers (CPU, in CI) and CUDA IPC handles (GPU only)."""

import multiprocessing
import pickle

import pytest
import torch

from engine.weight_transport import WeightSender, flatten, gpu_identity, receive


def _state_dict() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(3, 4, generator=generator),
        "norm.weight": torch.randn(5, generator=generator),
        "counter": torch.arange(3),
        "head.weight": torch.randn(2, 2, 2, generator=generator),
        "huge.weight": torch.randn(40, generator=generator),
    }


def test_flatten_keeps_every_tensor_and_splits_buckets_by_size_and_dtype():
    state = _state_dict()
    # 40 bytes per bucket: 12 + 5 bf16 values fit together; an int tensor starts its own bucket; a tensor
    # bigger than the limit (40 bf16 values) goes alone rather than being refused.
    buckets = flatten(state, float_dtype=torch.bfloat16, device=torch.device("cpu"), bucket_bytes=40)
    assert [[spec.name for spec in bucket.specs] for bucket in buckets] == [
        ["embed.weight", "norm.weight"], ["counter"], ["head.weight"], ["huge.weight"]
    ]
    received = dict(pair for bucket in buckets for pair in bucket.tensors())
    assert list(received) == list(state)
    for name, tensor in state.items():
        expected = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        assert received[name].dtype == expected.dtype and torch.equal(received[name], expected), name
    # The buffers are copies: changing the source afterwards changes nothing that was sent.
    state["norm.weight"].add_(1.0)
    assert not torch.equal(received["norm.weight"], state["norm.weight"].to(torch.bfloat16))


def _receiver(payload: bytes, results) -> None:
    weights = receive(pickle.loads(payload))  # a fresh process: only the pickled handles came across
    results.put({name: (tensor.float().sum().item(), str(tensor.dtype), gpu_identity()) for name, tensor in weights.items()})
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("offloaded", [False, True])
def test_cuda_ipc_hands_the_weights_to_another_process(offloaded):
    """The sender's weights on the GPU, or offloaded to host memory (they are staged onto the GPU)."""
    state = {name: (t if offloaded else t.cuda()) for name, t in _state_dict().items()}
    sender = WeightSender(state, float_dtype=torch.bfloat16)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    process = context.Process(target=_receiver, args=(pickle.dumps(sender.shared()), results))
    process.start()
    got = results.get(timeout=120)
    process.join(timeout=60)
    sender.release()
    assert process.exitcode == 0
    for name, tensor in state.items():
        expected = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        total, dtype, identity = got[name]
        assert dtype == str(expected.dtype) and total == pytest.approx(expected.float().sum().item(), rel=1e-6), name
        assert identity == gpu_identity()
