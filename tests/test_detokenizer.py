"""Incremental detokenization: no half characters, stop strings never leak, hold-back flushed."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanostream.client.detokenizer import IncrementalDetokenizer, decode_output, decoder_of
from nanostream.testing import build_tokenizer

TEXT = "The river ran 世界 past 🚀🎉 the mill, naïve café — END of the tale 👋🏽 done"


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def stream(tok, ids, chunk=1, **kwargs):
    detok = IncrementalDetokenizer(tok, tok("Once upon").input_ids, **kwargs)
    deltas = [detok.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(detok.finish())
    return detok, deltas


def test_multibyte_characters_span_several_tokens(tok):
    ids = tok(TEXT).input_ids
    assert len(ids) > len(TEXT.encode()) // 2  # byte-level: CJK and emoji are several tokens each
    assert any("\ufffd" in tok.decode([i]) for i in ids)


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_no_replacement_character_and_deltas_concatenate(tok, chunk):
    ids = tok(TEXT).input_ids
    _, deltas = stream(tok, ids, chunk)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == TEXT


@pytest.mark.parametrize("chunk", [1, 4])
@pytest.mark.parametrize("stop", ["END", "mill, na", "🎉 the", "世"])
def test_stop_string_cut_and_never_leaked(tok, chunk, stop):
    ids = tok(TEXT).input_ids
    detok, deltas = stream(tok, ids, chunk, stop=(stop, "never-there"))
    text = "".join(deltas)
    assert text == TEXT[: TEXT.index(stop)]
    assert detok.stopped_by == stop
    # No delta ever carried any part of the stop string's own characters past the cut.
    emitted = ""
    for d in deltas:
        emitted += d
        assert TEXT.startswith(emitted) and len(emitted) <= TEXT.index(stop)


def test_earliest_of_several_stop_strings_wins(tok):
    _, deltas = stream(tok, tok(TEXT).input_ids, 1, stop=("done", "café"))
    assert "".join(deltas) == TEXT[: TEXT.index("café")]


def test_text_without_stop_string_is_flushed_in_full(tok):
    ids = tok(TEXT).input_ids
    detok = IncrementalDetokenizer(tok, [], stop=("a very long stop string",))
    out = "".join(detok.add([i]) for i in ids)
    assert len(out) <= len(TEXT) - len("a very long stop string") + 1  # the hold-back is held
    assert out + detok.finish() == TEXT
    assert detok.stopped_by is None


def test_stop_string_ignored_before_min_tokens(tok):
    ids = tok("ab END cd END ef").input_ids
    first_end = len(tok("ab END").input_ids)
    detok = IncrementalDetokenizer(tok, [], stop=("END",), min_tokens=first_end + 1)
    text = "".join(detok.add([i]) for i in ids) + detok.finish()
    assert text == "ab END cd "


def test_special_tokens_skipped(tok):
    ids = [*tok("hello").input_ids, tok.convert_tokens_to_ids("<|im_end|>")]
    detok = IncrementalDetokenizer(tok, [])
    assert detok.add(ids) + detok.finish() == "hello"
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    assert detok.add(ids) + detok.finish() == "hello<|im_end|>"


@pytest.mark.parametrize("seed", range(5))
def test_one_pass_decode_equals_the_incremental_text(tok, seed):
    # The offline API decodes outputs without stop strings once, at the end: same text as streaming,
    # also for arbitrary ids (cut multibyte characters, special tokens) after any prompt.
    import random

    rng = random.Random(seed)
    prompt = rng.choice([tok("Once upon").input_ids, tok(TEXT).input_ids[:7], [rng.randrange(len(tok))]])
    ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 60))]
    for skip in (True, False):
        detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
        text = "".join(detok.add([i]) for i in ids) + detok.finish()
        assert decode_output(tok, prompt, ids, skip_special_tokens=skip) == text


@pytest.mark.parametrize("skip", [True, False])
def test_ids_the_decode_leaves_out_neither_change_the_text_nor_pile_up(tok, skip):
    # A model's vocabulary can be larger than its tokenizer's (padded embeddings; a random model samples
    # such ids all the time), and skipped special tokens add no text either: the text is the one-pass
    # decode's, and the window decoded per token stays a few tokens long through thousands of them.
    import random

    rng = random.Random(0)
    specials = [tok.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>")]
    text_ids = tok(TEXT).input_ids
    ids = []
    for i in text_ids:
        ids += [rng.choice([len(tok) + rng.randrange(10**5), *specials]) for _ in range(rng.randrange(40))]
        ids.append(i)
    ids += [len(tok) + 7] * 3000
    detok = IncrementalDetokenizer(tok, tok("Once upon").input_ids, skip_special_tokens=skip)
    longest = 0
    text = ""
    for i in ids:
        text += detok.add([i])
        longest = max(longest, len(detok.ids) - detok.prefix_offset)
    text += detok.finish()
    assert text == decode_output(tok, tok("Once upon").input_ids, ids, skip_special_tokens=skip)
    assert detok.num_output_tokens == len(ids)
    assert longest <= 8  # a character's byte pieces and the context before them, never the run of ids
    assert (text == TEXT) if skip else ("<|im_end|>" in text)


def test_a_token_added_to_the_tokenizer_later_is_not_left_out():
    tok = build_tokenizer()
    IncrementalDetokenizer(tok, [])  # the tokenizer as it was: ids from len(tok) on are unknown to it
    tok.add_tokens(["<extra>"])
    detok = IncrementalDetokenizer(tok, [])
    assert detok.add([tok.convert_tokens_to_ids("<extra>")]) + detok.finish() == "<extra>"


# A prompt can end inside a character (its ids cut from an earlier output, a token budget that ran out):
# the output tokens that complete it must show the whole character, in the stream and offline alike.


def detokenize(tok, prompt, ids, chunks=(1,), **kwargs):
    """Streamed text, fed in chunks of the given sizes (cycled), and the offline one-pass text."""
    detok = IncrementalDetokenizer(tok, prompt, **kwargs)
    deltas, i, n = [], 0, 0
    while i < len(ids):
        size = chunks[n % len(chunks)]
        deltas.append(detok.add(ids[i : i + size]))
        i, n = i + size, n + 1
    deltas.append(detok.finish())
    assert detok.stopped_by is None
    skip = kwargs.get("skip_special_tokens", True)
    return "".join(deltas), decode_output(tok, prompt, ids, skip_special_tokens=skip)


@pytest.mark.parametrize("stop", [(), ("never-there",)])
@pytest.mark.parametrize("chunks", [(1,), (2,), (5,)])
@pytest.mark.parametrize("before", ["The river ran ", ""])  # "": the prompt is only partial pieces
@pytest.mark.parametrize("char", ["🚀", "世", "é"])  # 4, 3, 2 bytes: up to 3 leading pieces
def test_character_begun_by_the_prompt_is_completed_in_the_output(tok, char, before, chunks, stop):
    pieces = tok(char).input_ids
    assert len(pieces) > 1
    for k in range(1, len(pieces)):
        for after in [" past the mill", ""]:
            prompt = tok(before).input_ids + pieces[:k]
            ids = pieces[k:] + tok(after).input_ids
            assert tok.decode(prompt).endswith("\ufffd")
            for skip in (True, False):
                streamed, offline = detokenize(tok, prompt, ids, chunks, stop=stop, skip_special_tokens=skip)
                assert streamed == offline == char + after


def test_prompt_token_holding_text_and_a_character_start_is_not_repeated(tok):
    # GPT-2-style byte-level BPEs merge a space with an emoji's first bytes ("ĠðŁ"): the output shows
    # the emoji, and the space stays the prompt's.
    tok = build_tokenizer(264, [" 🚀 🎉 😀 🙂 👋"] * 50)
    ids = tok("a 🚀 b").input_ids
    assert tok.decode(ids[1:2]) == " \ufffd"
    for cut in (2, 3):
        for stop in [(), ("never-there",)]:
            assert detokenize(tok, ids[:cut], ids[cut:], stop=stop) == ("🚀 b", "🚀 b")


def test_character_never_completed_stays_a_replacement_character(tok):
    rocket = tok("🚀").input_ids
    past = tok(" past").input_ids
    for stop in [(), ("never-there",)]:
        # Begun by the output: U+FFFD at its end.
        assert detokenize(tok, tok("ran").input_ids, past + rocket[:2], stop=stop) == (" past\ufffd",) * 2
        # Begun by the prompt and broken off by the output: the U+FFFD is the prompt's text.
        assert detokenize(tok, rocket[:2], past, stop=stop) == (" past",) * 2
        assert detokenize(tok, rocket[:1], rocket[1:2], stop=stop) == ("",) * 2
        assert detokenize(tok, [], rocket[:3], stop=stop) == ("\ufffd",) * 2


_PIECES = ["a", "b", "e", " ", "\n", ",", "é", "ï", "—", "世", "界", "🚀", "🎉", "👋🏽", "<|im_end|>"]


@settings(max_examples=200, deadline=None)
@given(
    pieces=st.lists(st.sampled_from(_PIECES), max_size=20),
    cuts=st.tuples(st.floats(0, 1), st.floats(0, 1)),
    chunks=st.lists(st.integers(1, 6), min_size=1, max_size=4),
    stop=st.sampled_from([(), ("never-there",), ("#", "no such stop string")]),
    skip=st.booleans(),
)
def test_prompt_and_output_split_anywhere_in_text(tok, pieces, cuts, chunks, stop, skip):
    # Text with ASCII, accents, CJK, emoji and a special token, cut into prompt and output at any two
    # token positions (also inside characters, which byte-level BPE splits over several tokens).
    all_ids = tok("".join(pieces)).input_ids
    start, end = sorted(round(c * len(all_ids)) for c in cuts)
    prompt, ids = all_ids[:start], all_ids[start:end]
    streamed, offline = detokenize(tok, prompt, ids, tuple(chunks), stop=stop, skip_special_tokens=skip)
    assert streamed == offline
    before = tok.decode(prompt, skip_special_tokens=skip)
    full = tok.decode(prompt + ids, skip_special_tokens=skip)
    if skip or "<|im_end|>" not in pieces:  # else a special token may sit inside a character's pieces
        # The prompt's text, less a character it left incomplete, then the output's.
        assert offline == ("" if full == before else full[len(before.removesuffix("\ufffd")) :])


@settings(max_examples=200, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 511), max_size=8),
    ids=st.lists(st.integers(0, 511), max_size=30),
    chunks=st.lists(st.integers(1, 6), min_size=1, max_size=4),
    stop=st.sampled_from([(), ("never-there",)]),
    skip=st.booleans(),
)
def test_stream_equals_one_pass_decode_for_any_ids(tok, prompt, ids, chunks, stop, skip):
    # Arbitrary ids: stray continuation bytes, characters cut off, special tokens between pieces.
    assert len(tok) == 512
    streamed, offline = detokenize(tok, prompt, ids, tuple(chunks), stop=stop, skip_special_tokens=skip)
    assert streamed == offline


@settings(max_examples=100, deadline=None)
@given(ids=st.lists(st.integers(0, 511), max_size=12), skip=st.booleans())
def test_the_rust_decode_gives_the_tokenizers_text(tok, ids, skip):
    # The incremental path decodes straight through the Rust tokenizer when transformers adds nothing.
    decode = decoder_of(tok)
    assert decode.__code__.co_freevars == ("backend",)
    assert decode(ids, skip) == tok.decode(ids, skip_special_tokens=skip)


def test_a_tokenizer_that_cleans_up_spaces_decodes_through_transformers():
    tok = build_tokenizer()
    tok.clean_up_tokenization_spaces = True
    ids = tok("a , b .").input_ids
    assert decoder_of(tok)(ids, True) == tok.decode(ids, skip_special_tokens=True)
    assert decoder_of(tok).__code__.co_freevars == ("tokenizer",)


@settings(max_examples=200, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 511), min_size=1, max_size=8),
    ids=st.lists(st.integers(0, 511), max_size=30),
    chunk=st.integers(1, 4),
    skip=st.booleans(),
)
def test_the_tokenizers_stream_releases_what_the_python_path_does_chunk_for_chunk(tok, prompt, ids, chunk, skip):
    fast = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    slow = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    slow._stream = None
    if not tok.decode(prompt[-5:], skip_special_tokens=skip).endswith("\ufffd"):
        assert fast._stream is not None  # the test tokenizer is a fast one: its own stream does the work
    for i in range(0, len(ids), chunk):
        assert fast.add(ids[i : i + chunk]) == slow.add(ids[i : i + chunk])
    assert fast.finish() == slow.finish()


def test_a_prompt_ending_inside_a_character_is_left_to_the_python_path(tok):
    prompt = tok("once 世").input_ids
    prompt = prompt[:-1]  # the last character's final byte (byte-level BPE: its own token) cut off
    assert tok.decode(prompt[-5:]).endswith("\ufffd")
    detok = IncrementalDetokenizer(tok, prompt)
    assert detok._stream is None
    ids = tok("once 世界").input_ids[len(prompt) :]
    assert "".join(detok.add([i]) for i in ids) + detok.finish() == decode_output(tok, prompt, ids)


def test_a_stream_that_refuses_a_token_hands_over_to_the_python_path_without_a_gap(tok):
    class Refusing:  # the library's stream, refusing its fourth token as it does text it cannot follow
        def __init__(self, inner):
            self.inner, self.steps = inner, 0

        def step(self, tokenizer, token_id):
            self.steps += 1
            if self.steps == 4:
                raise Exception("Invalid prefix encountered")
            return self.inner.step(tokenizer, token_id)

    prompt, ids = tok("Once upon").input_ids, tok(TEXT).input_ids
    detok = IncrementalDetokenizer(tok, prompt)
    detok._stream = Refusing(detok._stream)
    text = "".join(detok.add([i]) for i in ids) + detok.finish()
    assert detok._stream is None and text == decode_output(tok, prompt, ids)


@pytest.fixture(scope="module")
def sentencepiece_style():
    """A Llama-style fast tokenizer (Metaspace, byte fallback, a leading space stripped), trained here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    inner = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    inner.pre_tokenizer = pre_tokenizers.Metaspace()
    inner.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    specials = ["<unk>", "<s>", "</s>", *(f"<0x{i:02X}>" for i in range(256))]
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=specials)
    inner.train_from_iterator([TEXT, "hello world " * 5] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=inner, clean_up_tokenization_spaces=False)


@settings(max_examples=200, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 319), min_size=1, max_size=8),
    ids=st.lists(st.integers(0, 319), max_size=30),
    chunk=st.integers(1, 4),
)
def test_a_sentencepiece_style_tokenizer_streams_the_same_text_either_way(sentencepiece_style, prompt, ids, chunk):
    tok = sentencepiece_style
    fast = IncrementalDetokenizer(tok, prompt)
    slow = IncrementalDetokenizer(tok, prompt)
    slow._stream = None
    if not tok.decode(prompt[-5:]).endswith("\ufffd"):
        assert fast._stream is not None
    texts = []
    for detok in (fast, slow):
        texts.append("".join(detok.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)) + detok.finish())
    assert texts[0] == texts[1] == decode_output(tok, prompt, ids)


def test_a_long_output_keeps_only_the_hold_back_between_tokens(tok):
    # Released text is not kept: a stream of any length holds at most max(len(stop)) - 1 characters.
    ids = tok("The river ran past the mill, naïve café. " * 500).input_ids
    detok = IncrementalDetokenizer(tok, tok("Once upon").input_ids, stop=("never-there",))
    out = []
    for i in ids:
        out.append(detok.add([i]))
        assert len(detok.held) <= detok.holdback
    assert "".join(out) + detok.finish() == decode_output(tok, tok("Once upon").input_ids, ids)
