import pytest

from hearth.engine.stopping import check_token_stop, find_stop_string, stream_safe_length
from hearth.sampling_params import SamplingParams

EOS = [2, 32000]


def stream(pieces, stop, include=False):
    """Feed pieces as a token stream would; return (text, matched stop string, streamed text)."""
    text, streamed = "", ""
    for piece in pieces:
        prev_len = len(text)
        text += piece
        match = find_stop_string(text, prev_len, stop, include)
        if match is not None:
            assert match[0].startswith(streamed), "streamed text was taken back"
            return match[0], match[1], streamed
        streamed = text[: stream_safe_length(text, stop, include)]
    return text, None, streamed


def test_stop_string_across_token_boundaries():
    assert stream(["Hello", " wo", "rl", "d! more"], ["world"]) == ("Hello ", "world", "Hello ")
    assert stream(["a", "<", "|", "end", "|", ">", "tail"], ["<|end|>"])[:2] == ("a", "<|end|>")
    # the stop string starts in the very first characters of the text
    assert stream(["<|e", "nd|>x"], ["<|end|>"])[:2] == ("", "<|end|>")
    # no stop string: the whole text comes through
    assert stream(["abc", "def"], ["xyz"]) == ("abcdef", None, "abcdef")


def test_stop_string_kept_when_asked():
    assert stream(["Hello", " wo", "rld! more"], ["world"], include=True)[:2] == ("Hello world", "world")


def test_earliest_match_wins():
    # both in one piece: the one that completes first in the stream
    assert find_stop_string("x STOP y END z", 0, ["END", "STOP"]) == ("x ", "STOP")
    # "b" completes at index 2, before "abc" does at 3
    assert find_stop_string("zabc", 0, ["abc", "b"]) == ("za", "b")
    # same end: the longer (earlier starting) one
    assert find_stop_string("zabc", 0, ["bc", "abc"]) == ("z", "abc")
    assert find_stop_string("zabc", 0, ["bc", "abc"], True) == ("zabc", "abc")
    # a stop string wholly inside the old text is not reported again
    assert find_stop_string("END and more", 7, ["END"]) is None
    # ... but one that ends in the new piece is, even if it starts long before it
    assert find_stop_string("say <|end|>", 10, ["<|end|>"]) == ("say ", "<|end|>")
    assert find_stop_string("abc", 3, ["c"]) is None  # nothing new


def test_stream_safe_length_holds_back_only_possible_starts():
    assert stream_safe_length("Hello wor", ["world"]) == len("Hello ")
    assert stream_safe_length("Hello", ["world"]) == 5
    assert stream_safe_length("ab", ["abc", "bcd"]) == 0  # "ab" may become "abc"
    assert stream_safe_length("xb", ["abc", "bcd"]) == 1
    assert stream_safe_length("Hello wor", ["world"], True) == 9
    assert stream_safe_length("Hello wor", []) == 9
    # never more than max_stop_len - 1 held back (vLLM's bound)
    assert stream_safe_length("aaaaaa", ["aaaa"]) == 3


def test_streamed_text_is_never_taken_back():
    text = "the cat sat on the mat, then the dog ENDED it"
    stops = ["ENDED", "dog END", "mat!"]
    for size in (1, 2, 3, 5):
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        out, stop, _ = stream(pieces, stops)
        assert (out, stop) == ("the cat sat on the mat, then the ", "dog END")


def test_token_stops():
    p = SamplingParams(max_tokens=5, stop_token_ids=[7])
    assert check_token_stop(2, 1, p, EOS) == "stop"
    assert check_token_stop(32000, 1, p, EOS) == "stop"
    assert check_token_stop(7, 1, p, EOS) == "stop"
    assert check_token_stop(9, 4, p, EOS) is None
    assert check_token_stop(9, 5, p, EOS) == "length"
    assert check_token_stop(2, 5, p, EOS) == "stop"  # EOS as the last allowed token is a stop
    ig = SamplingParams(max_tokens=5, ignore_eos=True, stop_token_ids=[7])
    assert check_token_stop(2, 1, ig, EOS) is None
    assert check_token_stop(7, 1, ig, EOS) == "stop"  # ignore_eos leaves stop_token_ids alone
    assert check_token_stop(2, 5, ig, EOS) == "length"
    mt = SamplingParams(max_tokens=5, min_tokens=3, stop_token_ids=[7])
    assert check_token_stop(2, 2, mt, EOS) is None
    assert check_token_stop(7, 2, mt, EOS) is None
    assert check_token_stop(2, 3, mt, EOS) == "stop"
    assert check_token_stop(9, 10**6, SamplingParams(max_tokens=None), EOS) is None


@pytest.mark.parametrize("include", [False, True])
def test_no_stop_strings(include):
    assert find_stop_string("abcdef", 3, [], include) is None
    assert stream_safe_length("abc", [], include) == 3
