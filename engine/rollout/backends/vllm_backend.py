"""Rollout on vLLM (accelerators only), behind the same contract as the transformers backend.

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so weights from a colocated
trainer reach vLLM's model as tensor references, with no serialization and no disk round trip:
``load_weights`` hands them to the model's own ``load_weights`` in buckets. ``offload`` puts the
engine to sleep (weights and KV cache leave the GPU, level 1 keeps a CPU copy of the weights),
``onload`` wakes it up.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Iterator, Mapping, Sequence

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from trellis.engine.errors import SettingError
from trellis.engine.rollout.backends.base import FinishReason, Generation, SamplingParams, StreamingBackend, prompt_images
from trellis.engine.rollout.backends.vllm_logprob_tap import SampledLogprobTap
from trellis.engine.vision.positions import collapse_image_placeholders
from trellis.engine.vision.processor import VisionProcessor

# Set before vLLM is imported: one process, so weight hand-over needs no IPC.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

_BUCKET_BYTES = 512 << 20
_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


class VllmRollout(StreamingBackend):
    def __init__(
        self,
        model_path: str,
        tokenizer: PreTrainedTokenizerBase,
        *,
        dtype: str = "bfloat16",
        gpu_memory_utilization: float = 0.5,
        max_model_len: int | None = None,
        sleep_level: int | str = 1,
        seed: int = 0,
        capture_routing: bool = False,
        quantization: str = "none",
        logprob_tap: bool = True,
    ) -> None:
        """``capture_routing``: ask vLLM (0.26+) for each request's routed experts
        (``enable_return_routed_experts``) and hand them back per response token (run on an H200: bench/RESULTS.md section 7).
        ``quantization``: "fp8" quantizes the checkpoint's weights at load, and every
        ``load_weights`` again (``_reload_quantized``).
        ``sleep_level`` 0: an engine that never leaves the GPU, built without vLLM's sleep mode
        (whose allocator allows one engine per process); ``offload`` is then a no-op. "auto" sleeps as 1 when
        asked: the hand-over asks only where the trainer's fit needs the memory (``engine.train.idle_memory``).
        ``logprob_tap``: read the sampled tokens' logprobs at vLLM's sampler (``SampledLogprobTap``)
        where this vLLM allows it, instead of asking for them per request (False: always ask)."""
        if quantization != "none" and (reason := fp8_unavailable()) is not None:
            raise SettingError(f"rollout.quantization: {quantization} cannot run here: {reason}. Set quantization: none.")
        from vllm import LLM

        super().__init__()
        self._abort = threading.Event()
        self._tokenizer = tokenizer
        self._sleep_level = 1 if sleep_level == "auto" else sleep_level
        self._asleep = False
        self._calls = 0
        self._weights_awake = True
        self._seed = seed
        self._capture_routing = capture_routing
        self._quantized = quantization != "none"
        routing = {"enable_return_routed_experts": True} if capture_routing else {}
        routing |= {"quantization": quantization} if self._quantized else {}
        # A vision-language policy: vLLM's multimodal processor reads the images (and needs the
        # model folder's tokenizer for that); a response may never hold an image placeholder.
        self._vision = VisionProcessor.of_model(model_path)
        self._banned = {token: -100.0 for token in self._vision.special_token_ids} if self._vision is not None else None
        self._llm = LLM(
            model=model_path,
            skip_tokenizer_init=self._vision is None,
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            enable_sleep_mode=self._sleep_level > 0,
            seed=seed,
            # The contract: logprobs of the sampled token under logits / temperature.
            logprobs_mode="processed_logprobs",
            **routing,
        )
        # Positions of a vision prompt shift as vLLM expands its images: those ask vLLM for logprobs.
        tap_allowed = logprob_tap and self._vision is None and os.environ.get("TRELLIS_VLLM_LOGPROB_TAP", "1") != "0"
        self._tap = _sampled_logprob_tap(self._llm) if tap_allowed else None

    def stream(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, limits: Sequence[int] | None = None
    ) -> Iterator[tuple[int, Generation]]:
        """Drives the engine a step at a time (as ``LLM.generate`` does inside): each sample comes out
        when it ends, and ``abort`` from another thread takes effect at the next step, the partial
        responses kept.

        Requests ask for their output only when they end (``FINAL_ONLY``, as ``LLM.generate`` does): an
        output per running request per engine step, looped over here, cost the rollout 17-24% on an
        H200; the sampled tokens' logprobs are read at vLLM's sampler where it allows
        (``_response_logprobs``), as asking for them per request cost another third. An aborted
        request's tokens so far are read from vLLM's own record of it before the abort drops that
        record (``_partial``)."""
        self.intake.refuse_if_held()
        if not prompts:
            return
        if self._abort.is_set():
            for index in range(len(prompts)):
                yield index, Generation(response_ids=[], logprobs=[], text="", finish_reason="abort")
            return
        self.onload()
        engine = self._llm.llm_engine
        self._calls += 1
        request_ids = [f"c{self._calls}-{i}" for i in range(len(prompts))]
        index_of = {request_id: i for i, request_id in enumerate(request_ids)}
        internal_ids = {}
        for i, (request_id, prompt) in enumerate(zip(request_ids, prompts)):
            limit = params.max_new_tokens if limits is None else limits[i]
            sampling = self._sampling(params, i, limit)
            internal_ids[request_id] = engine.add_request(request_id, self._request_prompt(prompt), sampling)
        if self._tap is not None:
            self._tap.register(internal_ids.values())
        partial: dict[str, tuple[list[int], list[float], np.ndarray | None]] = {}  # aborted: tokens, logprobs, routing
        try:
            while index_of and engine.has_unfinished_requests():
                self.last_step_s = time.monotonic()
                if self._abort.is_set():  # a pause: what each sample has so far is kept (partial rollout)
                    break
                for output in engine.step():  # only the requests that ended in this step
                    completion = output.outputs[0]
                    ids = list(completion.token_ids)
                    reason = _FINISH.get(completion.finish_reason or "", "length")
                    index = index_of.pop(output.request_id)
                    logprobs = self._response_logprobs(internal_ids[output.request_id], prompts[index], ids, completion.logprobs)
                    routed = self._response_routing(completion.routed_experts, len(prompts[index]), len(ids))
                    yield index, self._generation(ids, logprobs, reason, routed)
        finally:  # an abort, or a caller that stopped listening: the engine keeps nothing of this call
            for request_id, index in index_of.items():
                ids, logprobs, routed = _partial(engine, internal_ids[request_id])
                partial[request_id] = ids, self._response_logprobs(internal_ids[request_id], prompts[index], ids, logprobs), routed
            engine.abort_request(list(index_of))
            if self._tap is not None:
                self._tap.forget(internal_ids.values())
        for request_id, index in index_of.items():
            ids, logprobs, routed = partial[request_id]
            yield index, self._generation(ids, logprobs, "abort", self._response_routing(routed, len(prompts[index]), len(ids)))

    def _response_logprobs(self, internal_id: str, prompt: Sequence[int], ids: list[int], from_vllm) -> list[float]:
        """The response's logprobs from the tap where it runs, else from vLLM's per-position entries."""
        if self._tap is not None:
            return self._tap.take(internal_id, len(prompt) - 1, len(ids))
        return _sampled_logprobs(ids, from_vllm)

    def score_tokens(self, token_ids: Sequence[int]) -> list[float]:
        """vLLM's prompt logprobs at temperature 1 (raw and processed logprobs agree there)."""
        from vllm import SamplingParams as VllmSamplingParams

        self.onload()
        sampling = VllmSamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        (output,) = self._llm.generate([{"prompt_token_ids": list(token_ids)}], sampling, use_tqdm=False)
        return [entry[token].logprob for token, entry in zip(token_ids[1:], output.prompt_logprobs[1:])]

    def _request_prompt(self, prompt: Sequence[int]) -> dict:
        images = prompt_images(prompt)
        if not images:
            return {"prompt_token_ids": list(prompt)}
        if self._vision is None:
            raise ValueError("Prompts with images reached a rollout model without a vision tower.")
        ids = collapse_image_placeholders(prompt, image_token_id=self._vision.image_token_id)
        return {"prompt_token_ids": ids, "multi_modal_data": {"image": [image.decode() for image in images]}}

    def _generation(self, ids: list[int], logprobs: list[float], reason: FinishReason, routed: torch.Tensor | None = None) -> Generation:
        text = self._tokenizer.decode(ids, skip_special_tokens=True)
        return Generation(response_ids=ids, logprobs=logprobs, text=text, finish_reason=reason, routed_experts=routed)

    def _response_routing(self, routed, prompt_length: int, response_length: int) -> torch.Tensor | None:
        """vLLM's routing covers every position it ran ([prompt + response - 1, layers, K]); response token
        j was predicted at position prompt_length - 1 + j. A shorter record is a truncated capture: None,
        and training routes that response itself."""
        if not self._capture_routing or routed is None:
            return None
        start = prompt_length - 1
        if len(routed) < start + response_length:
            return None
        ids = torch.as_tensor(routed[start : start + response_length]).long()
        return ids.to(torch.uint8 if ids.numel() == 0 or int(ids.max()) < 256 else torch.int16)

    def abort(self) -> None:
        """Stop generating at the next engine step (from another thread) until ``resume_generation``:
        unfinished samples come back with what they have and ``finish_reason`` "abort"."""
        self._abort.set()

    def resume_generation(self) -> None:
        self._abort.clear()

    def _sampling(self, params: SamplingParams, index: int, limit: int):
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.sampling_params import RequestOutputKind

        greedy = params.temperature <= 0.0
        return VllmSamplingParams(
            max_tokens=limit,
            temperature=0.0 if greedy else params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1,
            stop_token_ids=list(params.stop_token_ids),
            # One seed per request: the samples of a group must differ, and repeat on a retry.
            seed=None if params.seed is None else (params.seed * 1_000_003 + index) % (2**31 - 1),
            logprobs=None if self._tap is not None else 0,
            logit_bias=self._banned,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], policy_version: int) -> None:
        """Copy the trainer's tensors into vLLM's model, bucket by bucket (no disk, no serialization), then
        forget what the old weights computed (``_forget_old_activations``). Only between generations: a
        request running now would go on with the old weights' KV cache."""
        engine = self._llm.llm_engine
        if engine.has_unfinished_requests():
            raise RuntimeError("load_weights was called while the engine still generates; pause or abort the rollout "
                               "first (the weight sync does), so that no request mixes the old and new weights.")
        if self._asleep and not self._weights_awake:
            self._llm.wake_up(tags=["weights"])  # the KV cache stays asleep until onload
            self._weights_awake = True
        model = self._model()
        if self._quantized:
            self._reload_quantized(model, state_dict)
        else:
            for bucket in _buckets(state_dict, _BUCKET_BYTES):
                model.load_weights(bucket)
        if not self._asleep:  # asleep, it dropped them when it went to sleep (offload)
            self._forget_old_activations()
        self._policy_version = policy_version

    def _forget_old_activations(self) -> None:
        """vLLM keeps the KV blocks of earlier prompts and responses (prefix caching) and, for images, the
        vision encoder's outputs, and hands them to any later request that shares the prefix or the image:
        after new weights they would be the old policy's activations inside a new-policy sample (a shared
        chat template, a prompt drawn again, a partial response continued after a sync). An engine that sleeps
        drops them with its KV cache; one that stays awake through the fit or runs beside the trainer
        (``sleep_level`` auto or 0, disaggregated) must drop them here, as TRL and verl do after their syncs."""
        if not self._llm.reset_prefix_cache():
            raise RuntimeError("vLLM kept KV blocks in use after the rollout ended, so its prefix cache (the old "
                               "weights' activations) could not be dropped; no generation may run across a weight sync.")
        reset_encoder_cache = getattr(self._llm.llm_engine, "reset_encoder_cache", None)  # vLLM 0.26+
        if self._vision is not None and reset_encoder_cache is not None:
            reset_encoder_cache()

    def _reload_quantized(self, model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
        """FP8 weights are vLLM's own layout (transposed, with scales): its layerwise reload puts each layer's
        bf16 parameters back, re-quantizes a layer once all its weights have arrived, and copies the result
        into the FP8 storage the CUDA graphs read. Every weight of a layer must arrive in one reload (a full
        sync); the trainer's tensors must stay unchanged until it returns."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        config = self._llm.llm_engine.vllm_config
        with torch.no_grad(), torch.device(next(model.parameters()).device), set_current_vllm_config(config):
            initialize_layerwise_reload(model)
            for bucket in _buckets(state_dict, _BUCKET_BYTES):
                model.load_weights(bucket)
            finalize_layerwise_reload(model, config.model_config)
        torch.cuda.empty_cache()  # the reload's bf16 layers, before the KV cache wakes up

    def offload(self) -> None:
        if not self._asleep and self._sleep_level > 0:
            self._forget_old_activations()
            self._llm.sleep(level=self._sleep_level)
            self._asleep, self._weights_awake = True, False

    def onload(self) -> None:
        if self._asleep:
            self._llm.wake_up(tags=["kv_cache"] if self._weights_awake else None)
            self._asleep, self._weights_awake = False, True

    def _model(self) -> torch.nn.Module:
        executor = self._llm.llm_engine.model_executor
        return executor.driver_worker.worker.model_runner.get_model()


def _sampled_logprob_tap(llm) -> SampledLogprobTap | None:
    try:
        from vllm.v1.worker.gpu.sample.logprob import compute_token_logprobs
    except ImportError:  # a vLLM without the V2 model runner: ask for logprobs per request
        return None
    return SampledLogprobTap.install(llm, compute_token_logprobs)


def _sampled_logprobs(token_ids: list[int], logprobs) -> list[float]:
    """The sampled tokens' logprobs out of vLLM's per-position {token: Logprob} entries."""
    return [entry[token].logprob for token, entry in zip(token_ids, logprobs or [])]


def _partial(engine, internal_id: str) -> tuple[list[int], list | None, np.ndarray | None]:
    """An unfinished request's tokens, vLLM's logprob entries and its routed experts so far, from the output
    processor's state of it (accumulated every step, whatever the output kind; read in vLLM 0.20, 0.26
    and 0.34, where an in-process ``abort_request`` returns no output). The routing (vLLM 0.26's
    ``routed_experts_chunks``, one chunk per engine step, as a finished request's output joins them) is
    None where this vLLM keeps none: that response then trains with computed routing."""
    state = engine.output_processor.request_states.get(internal_id)
    if state is None:
        return [], [], None
    ids = list(state.detokenizer.output_token_ids)
    logprobs = state.logprobs_processor.logprobs if state.logprobs_processor is not None else None
    chunks = getattr(state, "routed_experts_chunks", None)
    routed = np.concatenate([np.asarray(chunk) for chunk in chunks], axis=0) if chunks else None
    return ids, logprobs, routed


def fp8_unavailable() -> str | None:
    """Why this machine cannot generate in FP8, or None: W8A8 FP8 needs compute capability 8.9+ (below it
    vLLM would fall back to weight-only FP8, with none of the speed)."""
    if not torch.cuda.is_available():
        return "there is no GPU"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        return f"{torch.cuda.get_device_name()} (sm{major}{minor}) has no FP8 compute; it needs sm89+ (Ada, Hopper, Blackwell)"
    return None


def _buckets(state_dict: Mapping[str, torch.Tensor], limit: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in state_dict.items():
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= limit:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket
