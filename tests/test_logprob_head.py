"""The chunked logprob head's compiled kernels: one graph for every chunk of every micro-batch."""

import torch

from trellis.engine.train import logprob_head
from trellis.engine.train.logprob_head import label_logprobs


def test_the_heads_compiled_kernels_compile_once_for_every_chunk_and_give_the_eager_results(monkeypatch):
    """The kernels compiled on the CPU here (on the trainer's CUDA device in a run): a micro-batch of a full
    chunk and a shorter last one, then two micro-batches of one short chunk each. Before, each kernel
    compiled three times in a process (static rows, dynamic rows, then a slice starting at 0); now once.
    Tried: forward and backward of each, against the eager kernels' logprobs and gradients."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 300, bias=False)
    graphs = counters["stats"]["unique_graphs"]
    for rows in (64 + 17, 30, 10):
        hidden = torch.randn(rows, 16)
        labels = torch.randint(0, 300, (rows,))
        results = []
        for compiled in (False, True):
            with monkeypatch.context() as patch:
                if compiled:
                    patch.setattr(logprob_head, "_statistics", logprob_head._CompiledOn(logprob_head._chunk_statistics, "cpu"))
                    patch.setattr(logprob_head, "_softmax_grads", logprob_head._CompiledOn(logprob_head._chunk_softmax_grads, "cpu"))
                leaf = hidden.clone().requires_grad_()
                head.weight.grad = None
                logprobs, entropies = label_logprobs(leaf, head, labels, temperature=0.7, chunk_tokens=64)
                (logprobs * torch.linspace(-1, 1, rows)).sum().backward()
                results.append((logprobs.detach(), entropies, leaf.grad, head.weight.grad.clone()))
        for eager, compiled in zip(*results):
            torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] - graphs == 2  # _chunk_statistics and _chunk_softmax_grads
