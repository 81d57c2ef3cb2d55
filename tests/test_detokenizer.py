"""Incremental detokenization: no half characters, stop strings never leak, hold-back flushed."""

import pytest

from nanostream.detokenizer import IncrementalDetokenizer, decode_output
from nanostream.tiny_model import build_tokenizer

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
