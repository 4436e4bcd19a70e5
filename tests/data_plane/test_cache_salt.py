"""A request's cache salt (GenerateRequest.cache_salt, a tenant's cache scope set by the router) keeps its
prompt's cached blocks apart: a request of another salt finds none of them, one of the same salt finds them,
and either way the tokens are those of a cold prefill."""

from __future__ import annotations

import asyncio

import pytest

from data_plane.engine.sequence import SamplingParams
from tests.data_plane.test_engine import engine_for

pytestmark = pytest.mark.slow


def test_another_salts_request_hits_none_of_a_cached_prompt_and_the_same_salts_does(demo_model_dir):
    async def go():
        engine = engine_for(demo_model_dir, max_loras=1, max_cpu_loras=1, num_kv_blocks=64)
        try:
            prompt = engine.tokenizer.encode("You are the accounts team's careful assistant. " * 12)

            async def run(salt: str) -> tuple[list[int], int]:
                before = engine.blocks.prefix.stats.hit_tokens
                out = []
                async for step in engine.generate(prompt, SamplingParams(max_tokens=4, ignore_eos=True),
                                                  cache_salt=salt):
                    out += [t.id for t in step.tokens]
                return out, engine.blocks.prefix.stats.hit_tokens - before

            return [await run(salt) for salt in ("tenant:a", "tenant:b", "tenant:a", "")]
        finally:
            await engine.stop()

    (cold, _), (other, other_hit), (same, same_hit), (unsalted, unsalted_hit) = asyncio.run(go())
    assert other_hit == 0 and unsalted_hit == 0  # B (and a request of no salt) reads none of A's blocks
    assert same_hit >= 16  # A again: its full blocks
    assert cold == other == same == unsalted  # the same tokens, cached or not
