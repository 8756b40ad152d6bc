"""Incremental detokenization equals decoding everything at once; stop strings are cut wherever they fall."""

import random

from eyas.server.detokenize import Detokenizer, StopMatcher


def stream(matcher: StopMatcher, pieces: list[str]) -> str:
    out = "".join(matcher.feed(p) for p in pieces)
    return out + matcher.flush()


def test_stop_string_split_across_pieces_is_cut_and_never_leaked():
    m = StopMatcher(["END"])
    emitted = [m.feed(p) for p in ["hello E", "N", "D and more"]]
    assert emitted == ["hello ", "", ""]  # "E" and "EN" were held back: they could have been the stop
    assert m.stopped and m.flush() == ""


def test_earliest_of_several_stops_wins():
    assert stream(StopMatcher(["xyz", "b"]), ["aaa", "bxyz"]) == "aaa"


def test_held_prefix_is_released_when_it_turns_out_not_to_be_a_stop():
    m = StopMatcher(["abc"])
    assert m.feed("xab") == "x"
    assert m.feed("d") == "abd"
    tail = StopMatcher(["abc"])
    assert stream(tail, ["xa", "b"]) == "xab" and not tail.stopped


def test_no_stops_passes_text_through():
    m = StopMatcher([])
    assert m.feed("abc") == "abc" and m.flush() == ""


def test_incremental_decode_equals_full_decode(tokenizer):
    text = "Grüße, 世界! naïve café 🙂 -- résumé"
    prompt = tokenizer.encode("Say:", add_special_tokens=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    one_by_one = Detokenizer(tokenizer, prompt)
    pieces = [one_by_one.add([t]) for t in ids]
    assert "".join(pieces) + one_by_one.flush() == text
    assert "" in pieces  # a character spanning tokens was held back until complete, not sent as U+FFFD
    rng = random.Random(0)
    for _ in range(5):
        d = Detokenizer(tokenizer, prompt)
        out, i = [], 0
        while i < len(ids):
            n = rng.randint(1, 3)  # speculation hands over several tokens per step
            out.append(d.add(ids[i:i + n]))
            i += n
        assert "".join(out) + d.flush() == text


def test_random_token_soup_decodes_like_the_whole(tokenizer):
    rng = random.Random(1)
    ids = [rng.randrange(len(tokenizer)) for _ in range(200)]
    d = Detokenizer(tokenizer, [5, 6, 7])
    got = "".join(d.add([t]) for t in ids) + d.flush()
    assert got == tokenizer.decode(ids, skip_special_tokens=True)


def test_the_fast_decoder_gives_the_tokenizers_own_decode(tokenizer):
    """The Rust backend's decode, used when the tokenizer does not clean up spaces, equals decode() with
    special tokens skipped, on random ids special tokens included; otherwise decode() itself is used."""
    from eyas.server.detokenize import fast_decoder

    assert not tokenizer.clean_up_tokenization_spaces
    decode = fast_decoder(tokenizer)
    assert decode is not None and "backend" in decode.__code__.co_names + decode.__code__.co_freevars
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(0, 12))]
        assert decode(ids) == tokenizer.decode(ids, skip_special_tokens=True)

    class Cleaning:
        clean_up_tokenization_spaces = True
        backend_tokenizer = tokenizer.backend_tokenizer

        def decode(self, ids, skip_special_tokens):
            return "wrapper"

    assert fast_decoder(Cleaning())([1, 2]) == "wrapper"
