"""engine/admission.py: a request as the engine admits it."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.engine.admission import new_request
from pdserve.engine.protocol import EngineError, GenerateRequest
from pdserve.kernels.kv_cache import KVCacheConfig
from pdserve.model.tokenizer import Tokenizer
from pdserve.sampling_params import SamplingParams

KV = KVCacheConfig(num_layers=2, num_kv_heads=2, head_dim=16, num_pages=10, page_size=4)


@pytest.fixture(scope="module")
def tokenizer(demo_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(str(demo_dir))


def _request(num_prompt: int, max_tokens: int, seed: int | None = None) -> GenerateRequest:
    sp = SamplingParams(max_tokens=max_tokens, seed=seed)
    return GenerateRequest("r", list(range(5, 5 + num_prompt)), sp)


def test_a_request_without_a_seed_gets_one_and_keeps_a_given_one(tokenizer: Tokenizer) -> None:
    req = new_request(_request(6, 4), KV, 10, 64, tokenizer)
    assert req.seq.sampling.seed is not None  # fixed now: a migrated stream continues exactly
    assert req.seq.token_ids == list(range(5, 11)) and req.seq.num_prompt_tokens == 6
    assert req.out_state is not None and req.request_id == "r"
    assert new_request(_request(6, 4, seed=7), KV, 10, 64, tokenizer).seq.sampling.seed == 7


def test_a_request_that_could_never_fit_the_pool_is_a_400(tokenizer: Tokenizer) -> None:
    new_request(_request(30, 10), KV, 10, 64, tokenizer)  # 40 tokens: exactly 10 pages
    with pytest.raises(EngineError) as err:
        new_request(_request(30, 11), KV, 10, 64, tokenizer)
    assert (err.value.status, err.value.code) == (400, "context_length_exceeded")
    new_request(_request(30, 11), KV, 10, 40, tokenizer)  # max_model_len caps what it needs
