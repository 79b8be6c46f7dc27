"""SlotDecoder against transformers' greedy generate, in process (no server):
prefill and batched decoding steps over requests at different positions,
slots reused after a request leaves."""

from __future__ import annotations

import pytest
import torch

from opara_core.models.gpt2 import SlotDecoder
from opara_core.serving.generation import small_gpt2

# small, so the file stays within seconds on a two-core CPU; a wide init so
# that a random model does not repeat one token (which would hide a wrong mask)
SMALL = {"n_layer": 2, "n_embd": 128, "n_head": 4, "initializer_range": 0.2}


def reference(lm: torch.nn.Module, prompt: list[int], count: int) -> list[int]:
    lm.generation_config.eos_token_id = None
    lm.generation_config.pad_token_id = 0
    with torch.inference_mode():
        out = lm.generate(torch.tensor([prompt], device=lm.device), max_new_tokens=count, do_sample=False)
    return out[0, len(prompt) :].tolist()


def decode_staggered(decoder: SlotDecoder, prompts: list[list[int]], counts: list[int], joins: list[int]) -> list[list[int]]:
    """Request i joins at step joins[i] or once a slot is free, and leaves after
    counts[i] tokens; it takes the lowest free slot, so later requests reuse
    the slots (and stale cache entries) of earlier ones. Requests joining at
    the same step are prefilled in one call."""
    free, active, out = list(range(decoder.slots)), {}, [[] for _ in prompts]
    for step in range(1000):
        joining = []
        for i, join in enumerate(joins):
            if join <= step and not out[i] and i not in active and free:
                free.sort()
                active[i] = free.pop(0)
                joining.append(i)
        if joining:  # those joining at one step are prefilled together
            for i, token in zip(joining, decoder.prefill_many([active[i] for i in joining], [prompts[i] for i in joining])):
                out[i].append(token)
        for i in [i for i in active if len(out[i]) >= counts[i]]:
            free.append(active.pop(i))
        if active:
            order = sorted(active)
            tokens = decoder.step(
                [active[i] for i in order], [out[i][-1] for i in order], [len(prompts[i]) + len(out[i]) - 1 for i in order]
            )
            for i, token in zip(order, tokens):
                out[i].append(token)
            for i in [i for i in active if len(out[i]) >= counts[i]]:
                free.append(active.pop(i))
        if all(out) and not active:
            break
    return out


def check(
    device: torch.device,
    buckets: tuple[int, ...] = (),
    capture: bool = False,
    prefill_tokens: int | None = None,
    prefill_shapes: tuple[tuple[int, int], ...] = (),
    spans: tuple[int, ...] = (),
) -> SlotDecoder:
    lm = small_gpt2(SMALL).lm.to(device)
    prompts = [[1, 2, 3], [50256] * 9, [7], [4, 5, 6, 7, 8, 9, 10, 11], [300, 301], [9, 9, 9, 9]]
    counts = [12, 5, 20, 3, 9, 14]
    joins = [0, 0, 0, 2, 4, 6]  # 6 requests through 3 slots: slots are reused; 3 prompts of 3, 9 and 1 tokens prefilled together
    decoder = SlotDecoder(lm, slots=3, max_context=40, device=device, buckets=buckets, capture=capture, prefill_shapes=prefill_shapes, spans=spans)
    if prefill_tokens is not None:
        decoder.PREFILL_TOKENS = prefill_tokens
    got = decode_staggered(decoder, prompts, counts, joins)
    assert got == [reference(lm, p, n) for p, n in zip(prompts, counts)]
    return decoder


def test_staggered_batched_decoding_equals_transformers_generate():
    check(torch.device("cpu"))


def test_prompts_prefilled_together_in_several_forwards_equal_transformers_generate():
    """A prefill budget of 9 padded positions: the three prompts joining
    together (1, 3 and 9 tokens, sorted by length) go in two forwards."""
    check(torch.device("cpu"), prefill_tokens=9)


def test_bucketed_steps_read_each_slot_in_place_and_fall_back_above_the_largest():
    """Buckets 1 and 2 of 3 slots, the padded, full-context steps a CUDA
    graph replays, run eagerly on the CPU: steps with only slot 0 active run
    on bucket 1; those reaching slot 2 fall back to the eager step."""
    decoder = check(torch.device("cpu"), buckets=(1, 2))
    assert decoder.buckets[0].out is not None


def test_a_free_slot_below_an_active_one_is_a_padding_row():
    """Only slot 1 active, on a bucket of 2 rows: row 0 (free slot 0) is
    padding, and slot 1's tokens stay transformers'."""
    lm = small_gpt2(SMALL).lm
    decoder = SlotDecoder(lm, slots=2, max_context=40, device=torch.device("cpu"), buckets=(2,))
    prompt = [5, 6, 7]
    tokens = [decoder.prefill(1, prompt)]
    for _ in range(7):
        tokens += decoder.step([1], [tokens[-1]], [len(prompt) + len(tokens) - 1])
    assert tokens == reference(lm, prompt, 8)
    assert decoder.buckets[0].out is not None


def test_a_bucket_of_every_slot_reads_the_cache_in_place():
    """Bucket 3 of 3 slots: each request sits in its slot's row, free slots'
    rows are padding (3 and 2 active requests take it)."""
    decoder = check(torch.device("cpu"), buckets=(1, 3))
    assert all(bucket.out is not None for bucket in decoder.buckets)


def test_steps_attend_over_the_shortest_span_that_holds_every_request():
    """Spans 12, 16 and 24 of a 40-position cache: the staggered requests
    (10 to 23 positions) step on all three; positions past the span are
    never read, so the tokens stay transformers' (check() compares every
    request)."""
    decoder = check(torch.device("cpu"), buckets=(1, 2, 3), spans=(12, 16, 24))
    ran = {bucket.shape for bucket in decoder.buckets if bucket.out is not None}
    assert {span for _, span in ran} == {12, 16, 24}, ran


def test_step_shapes_outside_the_cache_are_refused():
    lm = small_gpt2(SMALL).lm
    with pytest.raises(ValueError, match=r"step bucket 4: needs 1 <= rows <= slots \(3\)"):
        SlotDecoder(lm, slots=3, max_context=40, device=torch.device("cpu"), buckets=(1, 4))
    with pytest.raises(ValueError, match=r"step span 41: needs 1 <= span <= max_context \(40\)"):
        SlotDecoder(lm, slots=3, max_context=40, device=torch.device("cpu"), buckets=(1,), spans=(16, 41))


def test_prefill_shapes_pad_prompts_and_rows_to_static_buffers():
    """Shapes (1, 4), (2, 8) and (2, 16): the three prompts joining together
    (1, 3 and 9 tokens) go in two calls of at most 2 rows, padded in length
    and rows, as a captured prefill replays them; a prompt of 1 fits (1, 4)."""
    decoder = check(torch.device("cpu"), prefill_shapes=((1, 4), (2, 8), (2, 16)))
    assert all(bucket.out is not None for bucket in decoder.prefill_buckets)  # every shape ran


@pytest.mark.gpu
def test_staggered_batched_decoding_equals_transformers_generate_on_the_gpu():
    check(torch.device("cuda"))


@pytest.mark.gpu
def test_cuda_graph_buckets_equal_transformers_generate(strict_fp32):
    decoder = check(torch.device("cuda"), buckets=(1, 2, 3), capture=True, prefill_shapes=((1, 4), (2, 8), (2, 16)), spans=(12, 16, 24))
    assert all(bucket.graph is not None for bucket in [*decoder.buckets, *decoder.prefill_buckets])


def test_a_context_longer_than_the_model_is_refused():
    with pytest.raises(ValueError, match="exceeds"):
        SlotDecoder(small_gpt2(SMALL).lm, slots=1, max_context=2048, device=torch.device("cpu"))
