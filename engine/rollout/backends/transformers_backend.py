"""Rollout on a transformers model: a lean batched sampling loop over a KV cache.

``model.generate`` costs several milliseconds of Python per decode step and does not return
logprobs of the sampled tokens by default; for RL we need exactly those, so this loop computes them
from the same logits it samples from.
"""

from __future__ import annotations

import threading
import time
import warnings
from typing import Iterator, Mapping, Sequence

import torch
from transformers import DynamicCache, PreTrainedTokenizerBase

from trellis.engine.data.token_rows import left_pad, unique_rows
from trellis.engine.moe.routers import find_routers
from trellis.engine.moe.routing import RouterHooks
from trellis.engine.rollout.backends.base import FinishReason, Generation, SamplingParams, StreamingBackend, prompt_images
from trellis.engine.vision.models import policy_auto_class
from trellis.engine.vision.processor import VisionProcessor

_NEG_INF = float("-inf")
# transformers 5.24 renames `past_key_values` to `cache`; 5.17 (the GPU image) knows only the old name.
warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated", category=FutureWarning)


class TransformersRollout(StreamingBackend):
    """A rollout backend over a local HF model (CPU, or one GPU for small checks)."""

    def __init__(
        self,
        model_path: str,
        tokenizer: PreTrainedTokenizerBase,
        *,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        capture_routing: bool = False,
    ) -> None:
        """``capture_routing``: hand back the experts an MoE policy routed each response token through
        (``Generation.routed_experts``); a dense model has none to hand back."""
        super().__init__()
        self._abort = threading.Event()
        self._tokenizer = tokenizer
        self._device = torch.device(device)
        self._model = policy_auto_class(model_path).from_pretrained(model_path, dtype=dtype).to(self._device).eval()
        self._vision = VisionProcessor.of_model(model_path)  # None for a text-only policy
        # A response is text: a vision-language policy may not sample its image placeholders.
        self._banned = torch.tensor(self._vision.special_token_ids, device=self._device) if self._vision is not None else None
        self._model.requires_grad_(False)
        self._routing = RouterHooks(self._model) if capture_routing and find_routers(self._model) else None
        self._generator = torch.Generator(device=self._device).manual_seed(seed)
        self._eos_ids = tuple(sorted(_eos_ids(tokenizer, self._model)))
        self._pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self._eos_ids[0]

    @torch.inference_mode()
    def stream(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, limits: Sequence[int] | None = None
    ) -> Iterator[tuple[int, Generation]]:
        self.intake.refuse_if_held()
        if not prompts:
            return
        generator = self._generator
        if params.seed is not None:
            generator = torch.Generator(device=self._device).manual_seed(params.seed)
        stop_ids = torch.tensor(sorted(set(self._eos_ids) | set(params.stop_token_ids)), device=self._device)

        cache = DynamicCache()
        logits, route_BLK, attention_mask, position_ids = self._prefill(prompts, cache)
        batch = len(prompts)
        limit_B = torch.tensor(limits if limits is not None else [params.max_new_tokens] * batch, device=self._device)
        finished = torch.zeros(batch, dtype=torch.bool, device=self._device)
        stopped = torch.zeros(batch, dtype=torch.bool, device=self._device)
        tokens_BT = torch.full((batch, params.max_new_tokens), self._pad_id, device=self._device)
        logprobs_BT = torch.zeros(batch, params.max_new_tokens, device=self._device)
        lengths_B = torch.zeros(batch, dtype=torch.long, device=self._device)
        # Entry t: the experts of the forward whose logits sampled token t (the prompt's last position first).
        routes_BTLK = None
        if self._routing is not None:
            shape = self._routing.shape
            routes_BTLK = torch.zeros(batch, params.max_new_tokens, shape.layers, shape.top_k, dtype=shape.id_dtype, device=self._device)

        for t in range(params.max_new_tokens):
            self.last_step_s = time.monotonic()
            if self._abort.is_set():  # a pause: what each sample has so far is kept (partial rollout)
                break
            token_B, logprob_B = sample_tokens(logits, params, generator, self._banned)
            alive = ~finished
            tokens_BT[:, t] = torch.where(alive, token_B, self._pad_id)
            logprobs_BT[:, t] = torch.where(alive, logprob_B, 0.0)
            lengths_B += alive.long()
            if routes_BTLK is not None:
                routes_BTLK[:, t] = route_BLK.to(routes_BTLK.dtype)
            stopped |= alive & torch.isin(token_B, stop_ids)
            finished |= stopped | (lengths_B >= limit_B)
            if t == params.max_new_tokens - 1:
                finished[:] = True
            for row in (alive & finished).nonzero().flatten().tolist():
                yield row, self._generation(tokens_BT, logprobs_BT, lengths_B, routes_BTLK, row, "stop" if stopped[row] else "length")
            if bool(finished.all()):
                return
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(batch, 1)], dim=1)
            position_ids = position_ids.amax(dim=-1, keepdim=True) + 1  # a multimodal prompt's last position is its largest
            logits, route_BLK = self._forward(tokens_BT[:, t : t + 1], attention_mask, position_ids, cache)
        for row in (~finished).nonzero().flatten().tolist():  # interrupted
            yield row, self._generation(tokens_BT, logprobs_BT, lengths_B, routes_BTLK, row, "abort")

    def abort(self) -> None:
        """Stop generating at the next token (from another thread) until ``resume_generation``:
        unfinished samples come back with what they have and ``finish_reason`` "abort"."""
        self._abort.set()

    def resume_generation(self) -> None:
        self._abort.clear()

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], policy_version: int) -> None:
        """Every weight, or some (a LoRA sync's merged layers); a name the model lacks is an error."""
        with torch.no_grad():
            unexpected = self._model.load_state_dict(state_dict, strict=False).unexpected_keys
        if unexpected:
            raise KeyError(f"The rollout model has no weights named {unexpected[:5]} ({len(unexpected)} names).")
        self._policy_version = policy_version

    @torch.inference_mode()
    def score_tokens(self, token_ids: Sequence[int]) -> list[float]:
        ids = torch.tensor([list(token_ids)], device=self._device)
        logprobs = torch.log_softmax(self._model(input_ids=ids).logits[0, :-1].float(), dim=-1)
        return logprobs.gather(-1, ids[0, 1:, None]).squeeze(-1).tolist()

    def served_weights(self) -> dict[str, torch.Tensor]:
        """A copy of the weights generation runs with, by name (on CPU)."""
        return {name: tensor.detach().cpu().clone() for name, tensor in self._model.state_dict().items()}

    def offload(self) -> None:
        """Weights stay put: on CPU there is no accelerator memory to give back."""

    def onload(self) -> None:
        """Nothing was offloaded; see ``offload``."""

    def _prefill(self, prompts, cache) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """The prompts' last logits (and routed experts), with the attention mask and positions decoding
        goes on from. Identical prompts (a GRPO group) are prefilled once; their KV cache is then copied
        per sample."""
        images = [prompt_images(prompt) for prompt in prompts]
        rows, row_index = unique_rows(prompts, [tuple(image.ref.sha256 for image in row) for row in images])
        row_of_sample = torch.tensor(row_index, device=self._device)
        input_ids, attention_mask = (t.to(self._device) for t in left_pad(rows, self._pad_id))
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        vision: dict[str, torch.Tensor] = {}
        if any(images):
            vision, position_ids = self._vision_prefill(rows, [images[row_index.index(r)] for r in range(len(rows))], input_ids.size(1))
        logits, route_BLK = self._forward(input_ids, attention_mask, position_ids, cache, **vision)
        if len(rows) < len(prompts):
            cache.reorder_cache(row_of_sample)
            logits, attention_mask = (t.index_select(0, row_of_sample) for t in (logits, attention_mask))
            position_ids = position_ids.index_select(-2, row_of_sample)
            route_BLK = route_BLK.index_select(0, row_of_sample) if route_BLK is not None else None
        return logits, route_BLK, attention_mask, position_ids

    def _vision_prefill(self, rows, row_images, width: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The vision tower's inputs for the distinct prompts' images, and their multimodal positions
        [3, rows, width] (left-padded as the ids are)."""
        if self._vision is None:
            raise ValueError("Prompts with images reached a rollout model without a vision tower.")
        inputs = self._vision.inputs([image.decode() for images in row_images for image in images])
        grids = iter(inputs.grids)
        position_ids = torch.zeros(3, len(rows), width, dtype=torch.long)
        for r, row in enumerate(rows):
            row_grids = [next(grids) for _ in row_images[r]]
            position_ids[:, r, width - len(row) :] = self._vision.positions(row, row_grids)
        vision = {"pixel_values": inputs.pixel_values.to(self._device, self._model.dtype), "image_grid_thw": inputs.image_grid_thw.to(self._device)}
        return vision, position_ids.to(self._device)

    def _forward(self, input_ids, attention_mask, position_ids, cache, **vision) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The last position's logits per row, and with routing capture that position's experts [B, L, K]."""
        arguments = dict(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
            **vision,
        )
        if self._routing is None:
            return self._model(**arguments).logits[:, -1, :].float(), None
        with self._routing.session() as session:
            logits = self._model(**arguments).logits[:, -1, :].float()
        experts_TLK = session.computed_TLK()
        return logits, experts_TLK.view(*input_ids.shape, *experts_TLK.shape[1:])[:, -1]

    def _generation(self, tokens_BT, logprobs_BT, lengths_B, routes_BTLK, row: int, reason: FinishReason) -> Generation:
        length = int(lengths_B[row])
        ids = tokens_BT[row, :length].tolist()
        text = self._tokenizer.decode(ids, skip_special_tokens=True)
        routed = routes_BTLK[row, :length].cpu().clone() if routes_BTLK is not None else None
        return Generation(
            response_ids=ids, logprobs=logprobs_BT[row, :length].float().tolist(), text=text, finish_reason=reason, routed_experts=routed
        )


def sample_tokens(
    logits_BV: torch.Tensor, params: SamplingParams, generator: torch.Generator, banned: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return it with its logprob under ``logits / temperature``.

    The logprob is taken before top-k / top-p truncation, which is what the trainer recomputes from
    the same logits; truncation only decides which tokens may be drawn, as ``banned`` does.
    """
    if params.temperature == 0.0:
        logprobs_BV = torch.log_softmax(logits_BV, dim=-1)
        allowed_BV = logprobs_BV.index_fill(-1, banned, _NEG_INF) if banned is not None else logprobs_BV
        token_B = allowed_BV.argmax(dim=-1)
        return token_B, logprobs_BV.gather(-1, token_B[:, None]).squeeze(-1)
    logprobs_BV = torch.log_softmax(logits_BV / params.temperature, dim=-1)
    masked_BV = _truncate(logprobs_BV, params.top_k, params.top_p)
    if banned is not None:
        masked_BV = masked_BV.index_fill(-1, banned, _NEG_INF)
    probs_BV = torch.softmax(masked_BV, dim=-1)
    token_B = torch.multinomial(probs_BV, 1, generator=generator).squeeze(-1)
    return token_B, logprobs_BV.gather(-1, token_B[:, None]).squeeze(-1)


def _truncate(logprobs_BV: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k > 0 and top_k < logprobs_BV.size(-1):
        kth_B1 = torch.topk(logprobs_BV, top_k, dim=-1).values[:, -1:]
        logprobs_BV = logprobs_BV.masked_fill(logprobs_BV < kth_B1, _NEG_INF)
    if top_p < 1.0:
        sorted_BV, order_BV = torch.sort(logprobs_BV, dim=-1, descending=True)
        cumulative_BV = sorted_BV.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted_BV = cumulative_BV - sorted_BV.softmax(dim=-1) >= top_p  # keep the token that crosses p
        drop_BV = torch.zeros_like(drop_sorted_BV).scatter(-1, order_BV, drop_sorted_BV)
        logprobs_BV = logprobs_BV.masked_fill(drop_BV, _NEG_INF)
    return logprobs_BV


def _eos_ids(tokenizer: PreTrainedTokenizerBase, model: torch.nn.Module) -> set[int]:
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    generation_eos = model.generation_config.eos_token_id
    if isinstance(generation_eos, int):
        ids.add(generation_eos)
    elif generation_eos:
        ids.update(int(i) for i in generation_eos)
    if not ids:
        raise ValueError("Neither the tokenizer nor the model's generation_config names an eos token.")
    return ids
