"""Token logprobs and entropies from the last hidden states, a chunk of tokens at a time.

The logits of a packed 8k-token micro-batch over a 152k vocabulary take 5 GB in float32. Here only
the positions that carry a label go through the output layer, ``chunk_tokens`` at a time, so no
float32 logits exist for more than one chunk. For the backward pass each chunk's logits are either
kept in the compute dtype (``keep_logits``; the trainer's default) or recomputed there, which costs
one more head matmul but holds no more than one chunk of logits whatever the micro-batch size.
Micro-batch layouts hand over precomputed label indices, so nothing here waits for the GPU.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F

from trellis.engine.train.vision_batch import policy_body


class Policy(torch.nn.Module):
    """A micro-batch in, its labels' logprobs and entropies out.

    Decoder and output layer run in one ``forward`` so that FSDP's hooks (gather and cast the
    weights, reduce the gradients) wrap the whole computation, chunked head included.
    """

    def __init__(self, model: torch.nn.Module, *, temperature: float, chunk_tokens: int, keep_logits: bool = False) -> None:
        super().__init__()
        self.model = model
        self._temperature = temperature
        self._chunk_tokens = chunk_tokens
        self._keep_logits = keep_logits

    @contextmanager
    def at_temperature(self, temperature: float) -> Iterator[None]:
        """Logprobs at another temperature meanwhile (the weight attestation's canary scores at 1)."""
        kept, self._temperature = self._temperature, temperature
        try:
            yield
        finally:
            self._temperature = kept

    def forward(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        return batch_logprobs(
            self.model, batch, temperature=self._temperature, chunk_tokens=self._chunk_tokens, keep_logits=self._keep_logits
        )


def batch_logprobs(
    model: torch.nn.Module, batch, *, temperature: float, chunk_tokens: int, keep_logits: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs (differentiable when grad is on) and entropies of a micro-batch's labels, as [N, L] float32 rows.

    ``batch`` is any layout of ``engine.train.packing``: it has ``labels_NL``, ``label_index_K`` and
    ``label_hidden(decoder)``.
    """
    index_K = batch.label_index_K  # row-major positions of the labels in the [N, L] rows
    logprobs_K, entropy_K = label_logprobs(
        batch.label_hidden(policy_body(model)),
        model.get_output_embeddings(),
        batch.labels_NL.flatten().index_select(0, index_K),
        temperature=temperature,
        chunk_tokens=chunk_tokens,
        keep_logits=keep_logits,
    )
    width = batch.labels_NL.size(1)
    rows_cols = (index_K // width, index_K % width)
    zeros = torch.zeros(batch.labels_NL.shape, dtype=torch.float32, device=index_K.device)
    return zeros.index_put(rows_cols, logprobs_K), zeros.index_put(rows_cols, entropy_K)


def label_logprobs(
    hidden_KH: torch.Tensor,
    head: torch.nn.Module,
    labels_K: torch.Tensor,
    *,
    temperature: float,
    chunk_tokens: int,
    keep_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(label) of K labelled positions (float32, differentiable) and the entropy there (no grad).
    ``keep_logits``: hold each chunk's logits for the backward pass instead of recomputing them."""
    logprobs, entropies = [], []
    for start in range(0, hidden_KH.size(0), chunk_tokens):
        end = start + chunk_tokens
        logprob, entropy = _ChunkLogprobs.apply(
            hidden_KH[start:end], head.weight, head.bias, labels_K[start:end], temperature, keep_logits
        )
        logprobs.append(logprob)
        entropies.append(entropy)
    if not logprobs:
        empty = hidden_KH.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(logprobs), torch.cat(entropies)


def _chunk_statistics(logits: torch.Tensor, labels: torch.Tensor, temperature: float):
    """Logprob of each label, entropy and log-normalizer of one chunk's logits, in float32."""
    logits = logits.float() / temperature
    log_normalizer = torch.logsumexp(logits, dim=-1)
    logprob = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - log_normalizer
    probs = torch.exp(logits - log_normalizer.unsqueeze(-1))
    entropy = log_normalizer - (probs * logits).sum(-1)
    return logprob, entropy, log_normalizer


def _chunk_softmax_grads(logits: torch.Tensor, log_normalizer, grad_logprob, temperature: float) -> torch.Tensor:
    """The softmax part of d loss / d logits, -grad * softmax / temperature, in the logits' dtype.
    The one-hot part (+grad / temperature at each label) never becomes a [chunk, vocab] tensor: the
    backward pass adds it to the matmul results as gathered rows."""
    probs = torch.exp(logits.float() / temperature - log_normalizer.unsqueeze(-1))
    return (probs * (-grad_logprob / temperature).unsqueeze(-1)).to(logits.dtype)


class _CompiledOn:
    """``fn`` compiled on ``device_type`` tensors (CUDA), eager elsewhere. Compiled, the chunk's float32
    intermediates (softmax, products) stay in registers: the 152k-wide logits are read a couple of times
    instead of being copied to float32 and rewritten several times. On an H200 this cut the head's
    elementwise GPU time per 64k-token step of a 0.5B model from ~250 ms to ~60 ms; the step's wall time
    did not change, as it waits on kernel launches there.

    One graph serves every chunk: rows are dynamic from the first call, while the vocabulary stays static
    so that the reductions over it are tuned for it; and row vectors that are slices of longer ones
    (labels, incoming gradients) are copied, as the graph would otherwise guard on where a slice starts.
    Before, a process compiled each function three times (a full chunk, a shorter last one, and a
    micro-batch whose only chunk starts at 0; TORCH_LOGS=recompiles on an H100).
    """

    def __init__(self, fn, device_type: str = "cuda") -> None:
        self._fn = fn
        self._device_type = device_type
        self._compiled = None

    def __call__(self, logits: torch.Tensor, *args):
        if logits.device.type != self._device_type:
            return self._fn(logits, *args)
        if self._compiled is None:
            self._compiled = torch.compile(self._fn)
        args = tuple(a.clone() if isinstance(a, torch.Tensor) and a.storage_offset() else a for a in args)
        for tensor in (logits, *args):
            if isinstance(tensor, torch.Tensor):
                torch._dynamo.maybe_mark_dynamic(tensor, 0)
        return self._compiled(logits, *args)


_statistics = _CompiledOn(_chunk_statistics)
_softmax_grads = _CompiledOn(_chunk_softmax_grads)


class _ChunkLogprobs(torch.autograd.Function):
    """One chunk through the output layer. The log-normalizer is kept for the backward pass (and
    the logits with ``keep_logits``; else it recomputes them), which forms d logprob / d logits =
    onehot(label) - softmax itself (the one-hot part as gathered rows of the weight and scattered
    rows of the hidden states)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, hidden, weight, bias, labels, temperature: float, keep_logits: bool = False):
        logits = F.linear(hidden, weight, bias)  # the compute dtype: bf16 on GPU, float32 on CPU
        logprob, entropy, log_normalizer = _statistics(logits, labels, temperature)
        ctx.save_for_backward(hidden, weight, bias, labels, log_normalizer, logits if keep_logits else None)
        ctx.temperature = temperature
        ctx.mark_non_differentiable(entropy)
        return logprob, entropy

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad_logprob, _grad_entropy):
        hidden, weight, bias, labels, log_normalizer, logits = ctx.saved_tensors
        if logits is None:
            logits = F.linear(hidden, weight, bias)
        grad_logprob = grad_logprob.float()
        grad_logits = _softmax_grads(logits, log_normalizer, grad_logprob, ctx.temperature)
        label_scale = (grad_logprob / ctx.temperature).unsqueeze(-1)  # the one-hot part, per label
        grad_hidden = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_hidden = (grad_logits @ weight.to(grad_logits.dtype)).float()
            grad_hidden += weight.index_select(0, labels).float() * label_scale
            grad_hidden = grad_hidden.to(hidden.dtype)
        if ctx.needs_input_grad[1]:
            grad_weight = (grad_logits.t() @ hidden.to(grad_logits.dtype)).to(weight.dtype)
            grad_weight.index_add_(0, labels, (hidden.float() * label_scale).to(weight.dtype))
        if bias is not None and ctx.needs_input_grad[2]:
            grad_bias = grad_logits.float().sum(0).index_add_(0, labels, label_scale.squeeze(-1)).to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None


def output_head(model: torch.nn.Module) -> torch.nn.Module:
    """The output layer, after checking that the model's logits are exactly ``head(last hidden state)``.

    Models that post-process logits (soft-capping, logit scales) would be trained on the wrong
    distribution by the chunked head, so they are refused here rather than silently mis-trained.
    """
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"{type(model).__name__} has no linear output layer; trellis needs one to compute logprobs.")
    probe = torch.tensor([[1, 2, 3]], device=head.weight.device)
    with torch.no_grad():
        logits = model(input_ids=probe).logits
        recomputed = head(model.get_decoder()(input_ids=probe).last_hidden_state)
    if not torch.allclose(logits.float(), recomputed.float(), atol=1e-4, rtol=1e-4):
        raise ValueError(
            f"{type(model).__name__} changes its logits after the output layer (e.g. soft-capping or a logit "
            "scale); trellis's chunked logprob head does not support such models yet."
        )
    return head
