"""Structured outputs in the engine, through the offline LLM: every kind of constraint holds, a constrained
request changes nothing for the free ones beside it, and the engine's hard cases (chunked prefill, prefix
hits, preemption, seeds, the pipelined step, ignore_eos) give the same tokens as a plain run."""

import json
import re
import threading

import jsonschema
import pytest

from nanostream import LLM, InvalidRequestError, SamplingParams
from nanostream.engine import grammar as grammar_module
from nanostream.structured_outputs import StructuredOutputsParams as SO

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
    },
    "required": ["name", "age", "pets"],
}
PROMPTS = ["Once upon a time", "The engine keeps a pool", "Seven small boats"]


def constrained(so: SO, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 80, "structured_outputs": so, **kw})


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    return LLM(str(qwen3_dir), device="cpu", kvcache_block_size=16)


def texts(llm, prompts, params):
    return [o.text for o in llm.generate(prompts, params, use_tqdm=False)]


def test_json_schema_output_validates_and_is_compact(llm):
    for out in llm.generate(PROMPTS, constrained(SO(json=PERSON)), use_tqdm=False):
        assert out.finish_reason == "stop"
        value = json.loads(out.text)
        jsonschema.validate(value, PERSON)
        assert out.text == json.dumps(value, ensure_ascii=False)  # one layout: no whitespace to spend tokens on


def test_any_json_regex_choice_and_grammar(llm):
    sampled = dict(temperature=1.0, seed=7)
    obj = llm.generate(PROMPTS[0], constrained(SO(json_object=True), max_tokens=200, logit_bias={}), use_tqdm=False)
    assert obj[0].text.startswith("{")
    for text in texts(llm, PROMPTS, constrained(SO(regex=r"[a-z]{2,5}-\d{2}"), **sampled)):
        assert re.fullmatch(r"[a-z]{2,5}-\d{2}", text), text
    choices = ["yes", "no", 'a "quoted"\nanswer', "émoji 🎉"]
    got = texts(llm, PROMPTS * 3, [constrained(SO(choice=choices), temperature=1.0, seed=s) for s in range(9)])
    assert set(got) <= set(choices) and len(set(got)) > 1
    for text in texts(llm, PROMPTS, constrained(SO(grammar='root ::= "(" [0-9]+ ("," [0-9]+)* ")"'), **sampled)):
        assert re.fullmatch(r"\(\d+(,\d+)*\)", text), text


# Latin-1 letters before a hex digit: xgrammar 0.2.9 read its own printed "\xe9e" back as one character.
WORDS = ["née", "fiancée", "Ça va", "Ä1"]


@pytest.mark.parametrize(
    "so, expected",
    [
        (SO(choice=WORDS[1:2]), WORDS[1]),
        (SO(regex="née|Ça va"), None),
        (SO(grammar='root ::= "Ä1" | "fiancée"'), None),
        (SO(json={"enum": WORDS}), None),
        (SO(json={"type": "object", "properties": {"w": {"const": "Ça va"}}, "required": ["w"]}), '{"w": "Ça va"}'),
    ],
    ids=["choice", "regex", "grammar", "json enum", "json const"],
)
def test_latin1_letters_before_hex_digits_are_matched_as_written(llm, so, expected):
    (text,) = texts(llm, ["Once upon"], [constrained(so)])
    if expected is not None:
        assert text == expected
    elif so.json is not None:
        assert json.loads(text) in WORDS
    else:
        assert text in WORDS


def test_free_requests_beside_constrained_ones_are_unchanged(llm):
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, seed=3, max_tokens=24, ignore_eos=True)
    alone = texts(llm, PROMPTS, free) + texts(llm, PROMPTS, seeded)
    mixed = llm.generate(
        PROMPTS * 3,
        [free] * 3 + [seeded] * 3 + [constrained(SO(json=PERSON))] * 3,
        use_tqdm=False,
    )
    assert [o.text for o in mixed[:6]] == alone
    assert [o.text for o in mixed[6:]] == texts(llm, PROMPTS, constrained(SO(json=PERSON)))


def test_seeded_constrained_sampling_is_reproducible_and_batch_independent(llm):
    params = [constrained(SO(json=PERSON), temperature=1.0, seed=s) for s in (1, 2)]
    alone = [texts(llm, PROMPTS[0], p)[0] for p in params]
    together = texts(llm, [PROMPTS[0]] * 2 + PROMPTS[1:], params + [SamplingParams(max_tokens=8)] * 2)
    assert together[:2] == alone and alone[0] != alone[1]
    for text in alone:
        jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize(
    "engine",
    [
        dict(max_num_batched_tokens=8, max_num_seqs=4),  # chunked prefill
        dict(num_kvcache_blocks=7, max_model_len=96),  # preemption by recompute
        dict(enable_prefix_caching=False),
    ],
    ids=["chunked-prefill", "preemption", "no-prefix-cache"],
)
def test_engine_cases_give_the_same_constrained_tokens(qwen3_dir, llm, engine):
    long_prompt = " ".join(PROMPTS * 3)
    prompts = [long_prompt, long_prompt + " again", PROMPTS[0]]
    params = [constrained(SO(json=PERSON), max_tokens=40), constrained(SO(regex=r"\w+( \w+){6}"), max_tokens=40)]
    params.append(constrained(SO(json=PERSON), temperature=1.0, seed=11, max_tokens=40))
    reference = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    other = LLM(str(qwen3_dir), device="cpu", kvcache_block_size=16, **engine)
    outs = other.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == reference
    if "num_kvcache_blocks" in engine:
        assert other.engine.stats().preemptions > 0
    again = other.generate(prompts, params, use_tqdm=False)  # prefix-cache hits where enabled
    assert [o.token_ids for o in again] == reference
    assert other.engine.block_manager.num_free_blocks == other.engine.block_manager.num_blocks


def test_a_complete_grammar_ends_the_request_even_with_ignore_eos(llm):
    out = llm.generate(PROMPTS[0], constrained(SO(choice=["done"]), ignore_eos=True), use_tqdm=False)[0]
    assert (out.text, out.finish_reason) == ("done", "stop")


@pytest.mark.parametrize(
    ("so", "match"),
    [
        (SO(json={"type": "objekt"}), "structured_outputs.json is not a valid JSON schema: .*objekt"),
        (SO(regex="a(b"), "structured_outputs.regex is not a valid regular expression"),
        (SO(grammar="root ::= "), "structured_outputs.grammar is not a valid EBNF grammar"),
        (SO(structural_tag='{"format": 3}'), "structured_outputs.structural_tag is not a valid structural tag"),
    ],
)
def test_an_invalid_grammar_is_an_invalid_request(llm, so, match):
    with pytest.raises(InvalidRequestError, match=match):
        llm.generate(PROMPTS, [SamplingParams(max_tokens=4), constrained(so), SamplingParams()], use_tqdm=False)
    assert not llm.engine.has_unfinished()
    assert llm.generate(PROMPTS[0], SamplingParams(max_tokens=3), use_tqdm=False)[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(json={"type": "object"}, regex="a"), "exactly one of"),
        (dict(), "exactly one of .* got none"),
        (dict(choice=[]), "at least one string"),
        (dict(json="{not json"), "not valid JSON"),
        (dict(json="[1]"), "JSON schema object"),
    ],
)
def test_malformed_specs_are_refused_when_built(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SO(**kwargs)


def test_min_tokens_with_a_grammar_is_refused():
    with pytest.raises(ValueError, match="min_tokens cannot be combined with structured_outputs"):
        SamplingParams(min_tokens=2, structured_outputs=SO(choice=["a"]))


def test_a_compiling_grammar_does_not_hold_up_other_requests(llm, monkeypatch):
    """The engine serves the free request while the constrained one's grammar is still compiling."""
    release = threading.Event()
    compile_ = grammar_module.GrammarCompiler._compile
    monkeypatch.setattr(
        grammar_module.GrammarCompiler, "_compile", lambda self, s: release.wait(30) and compile_(self, s)
    )
    engine = llm.engine
    engine.add_request("slow", [5, 6, 7], constrained(SO(regex="[0-9]{5}")))
    engine.add_request("free", [5, 6, 7], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    finished = {}
    while "free" not in finished:
        for d in engine.step().deltas:
            finished.setdefault(d.request_id, d.finish_reason) if d.finish_reason else None
    assert "slow" not in finished and engine.has_unfinished()
    release.set()
    tokens = []
    while engine.has_unfinished():
        tokens += [t for d in engine.step().deltas if d.request_id == "slow" for t in d.token_ids]
    assert re.fullmatch("[0-9]{5}", llm.tokenizer.decode(tokens, skip_special_tokens=True))


def test_unconstrained_steps_stay_pipelined(llm, monkeypatch):
    """A step with no constrained row is launched as ever (sampling queued with the model); one with such
    a row defers its sampling until the step in flight has been read."""
    calls = []
    launch = type(llm.engine.runner).launch

    def spy(self, *args, **kwargs):
        calls.append(kwargs.get("defer_sampling", False))
        return launch(self, *args, **kwargs)

    monkeypatch.setattr(type(llm.engine.runner), "launch", spy)
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert calls and not any(calls)
    llm.generate(PROMPTS, [SamplingParams(max_tokens=5)] * 2 + [constrained(SO(choice=["x y z"]))], use_tqdm=False)
    assert any(calls)


def test_a_model_vocabulary_wider_than_the_tokenizer_never_samples_the_padding(tmp_path):
    from nanostream.testing import make_tiny_model

    padded = LLM(str(make_tiny_model(tmp_path, vocab_size=640, seed=2)), device="cpu", kvcache_block_size=16)
    assert padded.engine.vocab_size == 640 > len(padded.tokenizer)
    for out in padded.generate(PROMPTS, constrained(SO(json=PERSON), temperature=1.0, seed=5), use_tqdm=False):
        jsonschema.validate(json.loads(out.text), PERSON)
        assert max(out.token_ids) < len(padded.tokenizer)


@pytest.mark.slow
def test_tensor_parallel_constrained_requests_match_one_rank(qwen3_dir, llm):
    """At tp=2 rank 0 masks and samples a deferred step, then broadcasts its samples as ever."""
    params = [constrained(SO(json=PERSON)), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)]
    params.append(constrained(SO(regex=r"[a-z]+( [a-z]+){4}"), temperature=1.0, seed=4, logit_bias={300: 3.0}))
    reference = [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    with LLM(str(qwen3_dir), device="cpu", kvcache_block_size=16, tensor_parallel_size=2) as tp:
        assert [o.token_ids for o in tp.generate(PROMPTS, params, use_tqdm=False)] == reference
        with pytest.raises(InvalidRequestError, match="prompt_logprobs is not supported with tensor_parallel_size"):
            tp.generate(PROMPTS[0], SamplingParams(prompt_logprobs=1), use_tqdm=False)
