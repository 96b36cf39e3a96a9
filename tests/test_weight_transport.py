"""Weight sync between processes: flat bucketed buffers and a gloo broadcast (CPU, in CI), CUDA IPC
handles and an NCCL broadcast between two GPUs (GPU only)."""

import multiprocessing
import pickle

import pytest
import torch

from trellis.engine.weights.broadcast import RECEIVER, SENDER, GroupAddress, WeightGroup, free_address
from trellis.engine.weights.buckets import flatten, layouts
from trellis.engine.weights.cuda_ipc import WeightSender, gpu_identity, receive


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


def _broadcast_receiver(address: GroupAddress, device: str, layouts_: list, results, read) -> None:
    if device != "cpu":
        torch.cuda.set_device(torch.device(device))
    group = WeightGroup(address, RECEIVER, timeout_s=60)
    weights = group.receive(layouts_)
    results.put({name: (tensor.cpu(), str(tensor.device)) for name, tensor in weights.items()})
    # The tensors travel as file descriptors that this process hands over when the parent reads them:
    # it stays until then (on a busy machine it had exited first: FileNotFoundError in the parent).
    read.wait(timeout=120)
    group.close()


def _exchange(state, address: GroupAddress, sender_device: str, receiver_device: str, sender: WeightGroup | None):
    """One broadcast from this process to a fresh one; returns what arrived and the sender's group."""
    float_dtype = torch.bfloat16
    context = multiprocessing.get_context("spawn")
    results, read = context.Queue(), context.Event()
    bucket_layouts = layouts(state, float_dtype=float_dtype, bucket_bytes=40)
    process = context.Process(target=_broadcast_receiver, args=(address, receiver_device, bucket_layouts, results, read))
    process.start()
    if sender is not None:
        sender.close()
    sender = WeightGroup(address, SENDER, timeout_s=60)
    sender.send(flatten(state, float_dtype=float_dtype, device=torch.device(sender_device), bucket_bytes=40))
    got = results.get(timeout=120)
    read.set()
    process.join(timeout=60)
    assert process.exitcode == 0
    return got, sender


def _check_broadcast(sender_device: str, receiver_device: str, nccl: bool) -> None:
    state = _state_dict()
    sender = None
    # The same trainer pairs with a first rollout process, then with its replacement (a new key).
    for key in ("trellis-weights-1-2", "trellis-weights-1-3"):
        state["norm.weight"].add_(1.0)
        got, sender = _exchange(state, free_address("127.0.0.1", key, nccl=nccl), sender_device, receiver_device, sender)
        assert list(got) == list(state)
        for name, tensor in state.items():
            expected = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
            received, device = got[name]
            assert torch.equal(received, expected) and device == receiver_device, (key, name)
    sender.close()


def test_gloo_broadcast_hands_every_bucket_to_a_fresh_process_and_to_its_replacement():
    """Four buckets (bf16 and int64, one over the bucket limit), two receiving processes in turn."""
    _check_broadcast("cpu", "cpu", nccl=False)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_nccl_broadcast_hands_the_weights_to_another_gpu():
    torch.cuda.set_device(0)
    _check_broadcast("cuda:0", "cuda:1", nccl=True)
