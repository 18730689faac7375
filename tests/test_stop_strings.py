"""Stop strings: streaming in any split gives the same text as cutting the whole text."""

import pytest

from drvqwen.errors import DrvqwenError
from drvqwen.stop_strings import StopStrings, cut_at_stop


def _stream(pieces, stops):
    s = StopStrings(stops)
    out = []
    for p in pieces:
        text, done = s.push(p)
        out.append(text)
        if done:
            return "".join(out), s.matched
    return "".join(out) + s.flush(), s.matched


def _first_cut(text, stops):
    """Independent form: the text before the smallest index any stop string starts at."""
    hits = [text.find(s) for s in stops if s in text]
    return text[:min(hits)] if hits else text


def test_spans_tokens_and_holds_back_only_a_possible_prefix():
    s = StopStrings(["\ndef "])
    assert s.push("x = 1\n") == ("x = 1", False)     # "\n" may start "\ndef ": held
    assert s.push("d") == ("", False)
    assert s.push("ata") == ("\ndata", False)         # no longer a prefix: released
    assert s.push("\nde") == ("", False)
    assert s.push("f f") == ("", True)
    assert s.matched == "\ndef "
    assert s.push("more") == ("", True)


def test_no_stop_strings_passes_everything_through():
    s = StopStrings([])
    assert s.push("abc") == ("abc", False) and s.flush() == ""


@pytest.mark.parametrize("bad", ["", None, 3])
def test_bad_stop_string_is_refused(bad):
    with pytest.raises(DrvqwenError, match="stop string"):
        StopStrings(["ok", bad])


def test_random_splits_match_the_whole_text_cut(rng):
    alphabet = "ab\nc "
    for _ in range(2000):
        text = "".join(rng.choice(list(alphabet), size=int(rng.integers(0, 30))))
        stops = ["".join(rng.choice(list(alphabet), size=int(rng.integers(1, 4))))
                 for _ in range(int(rng.integers(1, 4)))]
        cuts = sorted(set(int(c) for c in rng.integers(0, len(text) + 1, size=int(rng.integers(0, 8)))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        expected = _first_cut(text, stops)
        for out, matched in (_stream(pieces, stops), cut_at_stop(text, stops)):
            assert out == expected, (text, stops, pieces)
            # matched names a stop string that starts where the text was cut (None: no cut)
            assert (matched is None) == (out == text and not any(s in text for s in stops))
            assert matched is None or text[len(out):].startswith(matched)
