"""The tool-call and reasoning parsers on text cut into random pieces (as a stream delivers it) against the
same text whole, and the grammar that forces tool calls, checked with the engine's own compiler."""

import json
import random

import pytest

from nanostream.client.reasoning import Qwen3ReasoningParser
from nanostream.engine.grammar import GrammarCompiler, RequestGrammar
from nanostream.frontends.openai_server.tool_parsers import HermesToolParser, assemble
from nanostream.testing.tokenizer import build_tokenizer

CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}ris \\"x\\"", "days": [1, {"a": 2}]}}\n</tool_call>'
)
REPLIES = {
    "content then two calls": "Sure.\n" + CALL + '\n<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>',
    "only a call": "\n\n" + CALL,
    "arguments before the name": '<tool_call>\n{"arguments": {"x": 1}, "name": "f"}\n</tool_call>',
    "arguments not an object": '<tool_call>\n{"name": "f", "arguments": "str"}\n</tool_call>',
    "not a call": "<tool_call>\nnot json\n</tool_call> after",
    "cut off in the arguments": 'Hi <tool_call>\n{"name": "f", "arguments": {"x": 1',
    "a tag that never completes": "no calls <tool but not",
    "plain": "plain text",
    "whitespace": "  \n ",
}
EXPECTED = {
    "content then two calls": (
        "Sure.\n",
        [("get_weather", '{"city": "Pa}ris \\"x\\"", "days": [1, {"a": 2}]}'), ("noop", "{}")],
    ),
    "only a call": (None, [("get_weather", '{"city": "Pa}ris \\"x\\"", "days": [1, {"a": 2}]}')]),
    "arguments before the name": (None, [("f", '{"x": 1}')]),
    "arguments not an object": (None, [("f", '"str"')]),
    "not a call": ("<tool_call>\nnot json\n</tool_call> after", []),
    "cut off in the arguments": ("Hi ", [("f", '{"x": 1')]),
    "a tag that never completes": ("no calls <tool but not", []),
    "plain": ("plain text", []),
    "whitespace": ("  \n ", []),
}


def pieces(text: str, seed: int) -> list[str]:
    rng, out, i = random.Random(seed), [], 0
    while i < len(text):
        j = min(len(text), i + rng.randint(1, 7))
        out.append(text[i:j])
        i = j
    return out


@pytest.mark.parametrize("case", list(REPLIES))
def test_hermes_calls_streamed_in_pieces_equal_the_whole_reply(case):
    whole = HermesToolParser().parse(REPLIES[case])
    assert (whole.content, [(c.name, c.arguments) for c in whole.calls]) == EXPECTED[case]
    for seed in range(100):
        parser, events = HermesToolParser(), []
        for piece in pieces(REPLIES[case], seed):
            events += parser.feed(piece, final=False)
        events += parser.feed("", final=True)
        got = assemble(events)
        assert (got.content, [(c.name, c.arguments) for c in got.calls]) == EXPECTED[case], seed


def test_a_calls_name_goes_out_before_its_arguments_end():
    parser = HermesToolParser()
    events = parser.feed('<tool_call>\n{"name": "get_weather", "arguments": {"ci', final=False)
    assert [type(e).__name__ for e in events] == ["CallStart", "CallArguments"]
    assert events[0].name == "get_weather" and events[1].text == '{"ci'


@pytest.fixture(scope="module")
def compiler(qwen3_dir):
    tokenizer = build_tokenizer()
    return tokenizer, GrammarCompiler(qwen3_dir, len(tokenizer), frozenset({0}))


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
    {"type": "function", "function": {"name": "noop"}},
]


def accepts(compiler, spec, text: str) -> bool:
    tokenizer, grammars = compiler
    grammar = RequestGrammar(grammars.submit(spec).result(), frozenset({0}))
    return all(grammar.accept(t) for t in tokenizer(text).input_ids) and grammar.accept(0) and grammar.terminated


@pytest.mark.parametrize("parallel", [True, False])
def test_the_forcing_grammar_takes_calls_in_the_parsers_format(compiler, parallel):
    spec = HermesToolParser.constraint(TOOLS, parallel)
    one = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    two = one + '\n<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>'
    assert accepts(compiler, spec, one)
    assert accepts(compiler, spec, two) is parallel
    assert not accepts(compiler, spec, one.replace('"name": ', '"name":'))  # compact JSON: one layout only
    assert not accepts(compiler, spec, one.replace("get_weather", "get_time"))  # only the tools given
    assert not accepts(compiler, spec, "Sure. " + one)  # a call, nothing else
    assert json.loads(HermesToolParser().parse(two).calls[0].arguments) == {"city": "Paris"}


REASONING = {
    "think then answer": (
        "<think>\nThe user greets me.\n</think>\n\nHello!",
        "",
        ("\nThe user greets me.\n", "Hello!"),
    ),
    "no think block": ("Hello <think> there", "", ("", "Hello <think> there")),
    "the prompt opened it": ("pondering</think>\n\nHi", "<|im_start|>assistant\n<think>\n", ("pondering", "Hi")),
    "the prompt closed it": ("Hi", "<|im_start|>assistant\n<think>\n\n</think>\n\n", ("", "Hi")),
    "cut off while thinking": ("<think>\nstill </thi", "", ("\nstill </thi", "")),
    "only a partial start tag": ("<thi", "", ("", "<thi")),
}


@pytest.mark.parametrize("case", list(REASONING))
def test_reasoning_split_in_pieces_equals_the_whole(case):
    text, prompt, expected = REASONING[case]
    for seed in range(60):
        parser, reasoning, content = Qwen3ReasoningParser(prompt), [], []
        for piece in pieces(text, seed) if seed else [text]:
            r, c = parser.feed(piece)
            reasoning.append(r)
            content.append(c)
        r, c = parser.finish()
        assert ("".join(reasoning) + r, "".join(content) + c) == expected, seed
