"""IncrementalDetokenizer with the real SmolLM2 (byte-level BPE) tokenizer.

Contract: deltas joined (+ finish()) == tokenizer.decode(output ids, skip_special_tokens=True)
cut before the first stop-string occurrence; no delta holds half a UTF-8 character or a
prefix of a stop string that later completes.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from llmd.daemon.core.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="session")
def tok(smollm2_tokenizer):
    """The real SmolLM2 HF tokenizer (built once per session by conftest)."""
    return smollm2_tokenizer.hf


def expected_text(tok, ids, stop, chunk: int = 1):
    """What generation returns when tokens arrive ``chunk`` at a time: it stops after the first
    chunk whose text contains a stop string, cut where the earliest one present then starts (so
    with overlapping stops, ``"\n"`` and ``"a\na"`` on ``a, \n, a``, one token at a time stops at
    ``"\n"``: the rest is never generated); an incomplete character at the very end is left out."""
    for end in [*range(chunk, len(ids), chunk), len(ids)]:
        text = tok.decode(ids[:end], skip_special_tokens=True)
        cuts = [i for i in (text.find(s) for s in stop) if i != -1]
        if cuts:
            return text[:min(cuts)]
    return tok.decode(ids, skip_special_tokens=True).rstrip("\ufffd")  # a character cut at the end is left out


def stream(tok, ids, stop=(), prompt=()):
    """Feed ids one at a time; return (deltas, detokenizer). deltas includes finish()'s."""
    d = IncrementalDetokenizer(tok, list(prompt), list(stop))
    deltas = [d.update([t]) for t in ids]
    deltas.append(d.finish())
    assert "".join(deltas) == d.output_text
    return deltas, d


MULTIBYTE = "Hi 🙂 and 日本語 text, café é! 🙂🙂 done"


def test_multibyte_split_tokens_never_emit_half_chars(tok):
    ids = tok.encode(MULTIBYTE)
    # the test is only meaningful if some tokens carry partial UTF-8 sequences
    assert any("\ufffd" in tok.decode([t]) for t in ids)
    deltas, d = stream(tok, ids, prompt=tok.encode("Say: "))
    assert all("\ufffd" not in x for x in deltas)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True) == MULTIBYTE
    assert d.stop_matched is None


def test_special_tokens_skipped(tok):
    ids = [1] + tok.encode("hello 日本") + [2, 0, 5] + tok.encode(" world")
    deltas, _ = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True) == "hello 日本 world"
    d = IncrementalDetokenizer(tok, [], [], skip_special_tokens=False)
    text = "".join(d.update([t]) for t in ids) + d.finish()
    assert text == tok.decode(ids, skip_special_tokens=False)


def test_stop_string_split_across_tokens(tok):
    stop = "\nObservation"
    ids = tok.encode("Thought: I should look.\nAction: search\nObservation: found it\nmore")
    pieces = [tok.decode([t]) for t in ids]
    assert not any(stop in p for p in pieces)  # the stop string spans several tokens
    d = IncrementalDetokenizer(tok, [], [stop])
    for t in ids:
        d.update([t])
        # never release a prefix of the stop string that turns out to be part of it
        assert "\nObs" not in d.output_text and not d.output_text.endswith("\n")
        if d.stop_matched:
            break
    assert d.finish() == ""
    assert d.stop_matched == stop
    assert d.output_text == "Thought: I should look.\nAction: search"
    assert d.update(tok.encode(" anything")) == ""  # nothing after a stop, ever


def test_partial_stop_prefix_released_when_not_completed(tok):
    stop = "\nObservation"
    ids = tok.encode("line one\nObserve this\nObs")
    deltas, d = stream(tok, ids, [stop])
    assert d.stop_matched is None
    assert "".join(deltas) == "line one\nObserve this\nObs"
    # "\nObserve" was held while it could still become "\nObservation", then released
    joined = ""
    for x in deltas[:-1]:
        joined += x
        assert not joined.endswith(("\n", "\nObs"))
    assert "\nObserve" in joined
    assert deltas[-1] == "\nObs"  # the dangling prefix is released by finish()


def test_stop_at_first_token(tok):
    ids = tok.encode("Hello world")
    d = IncrementalDetokenizer(tok, tok.encode("Q: "), ["Hello"])
    assert d.update(ids[:1]) == ""
    assert d.stop_matched == "Hello" and d.output_text == ""
    assert d.update(ids[1:]) == "" and d.finish() == ""


def test_earliest_stop_wins_and_multitoken_updates(tok):
    ids = tok.encode("alpha beta gamma delta")
    d = IncrementalDetokenizer(tok, [], ["delta", "beta", "gamma"])
    text = d.update(ids) + d.finish()  # all tokens in one update
    assert text == "alpha " and d.stop_matched == "beta"


def test_prompt_ending_mid_character(tok):
    ids = tok.encode("日本語")
    split = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    prompt, out = ids[:split], ids[split:]
    deltas, _ = stream(tok, out, prompt=prompt)
    assert "".join(deltas) == tok.decode(out, skip_special_tokens=True)


def test_output_cut_inside_a_character_leaves_it_out(tok):
    """``max_tokens`` ending the output between the bytes of one character: the text stops
    before it (vLLM's), not with U+FFFD (found by a user: an emoji list cut mid-emoji)."""
    ids = tok.encode("ok 🙂🙂")
    cut = next(i for i in range(1, len(ids) + 1) if tok.decode(ids[:i]).endswith("\ufffd"))
    deltas, d = stream(tok, ids[:cut], prompt=tok.encode("Say: "))
    assert "".join(deltas) == tok.decode(ids[:cut]).rstrip("\ufffd") == d.output_text
    assert all("\ufffd" not in x for x in deltas)


def test_min_tokens_defers_stop_strings(tok):
    """With min_tokens, a stop string in the text of the first min_tokens tokens is released as
    text; the first one after them ends the output (vLLM's stop_check_offset)."""
    ids = tok.encode("a. b. c. d.")
    n = len(tok.encode("a. b."))
    deltas, d = [], IncrementalDetokenizer(tok, [], ["."], min_tokens=n)
    deltas = [d.update([t]) for t in ids] + [d.finish()]
    assert "".join(deltas) == d.output_text == "a. b. c" and d.stop_matched == "."
    d0 = IncrementalDetokenizer(tok, [], ["."])
    assert d0.update(ids) + d0.finish() == "a"
    # a stop that starts in the first min_tokens tokens' text and ends after it matches (vLLM)
    d1 = IncrementalDetokenizer(tok, [], [". c"], min_tokens=n)
    streamed = [d1.update([t]) for t in ids] + [d1.finish()]
    assert "".join(streamed) == "a. b" and d1.stop_matched == ". c"


def test_empty_stop_string_rejected(tok):
    with pytest.raises(ValueError):
        IncrementalDetokenizer(tok, [], [""])


ALPHABET = list("ab \nxyz.é") + ["🙂", "日", "本", "語", "Obs", "\nO"]
texts = st.lists(st.sampled_from(ALPHABET), min_size=0, max_size=30).map("".join)
stops = st.lists(st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=3).map("".join), max_size=3)
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FAST
@given(prompt=texts, text=texts, stop=stops, chunk=st.integers(1, 3))
@example(prompt="", text="a\na", stop=["\n", "a\na"], chunk=1)  # overlapping stops: the first to complete wins
@example(prompt="", text="a\na", stop=["\n", "a\na"], chunk=3)
def test_streamed_equals_non_streamed(tok, prompt, text, stop, chunk):
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, tok.encode(prompt), stop)
    deltas = [d.update(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(d.finish())
    exp = expected_text(tok, ids, stop, chunk)
    assert "".join(deltas) == exp == d.output_text
    assert all("\ufffd" not in x for x in deltas)
    full = tok.decode(ids, skip_special_tokens=True)
    assert (d.stop_matched is not None) == any(s in full for s in stop)


@FAST
@given(data=st.data())
def test_random_token_ids_including_broken_utf8(tok, data):
    """Arbitrary id sequences (orphan continuation bytes, truncated chars, specials)."""
    pool = sorted(set(tok.encode(MULTIBYTE + " Observation\n")) | {0, 1, 2, 3} | set(range(17, 300, 7)))
    ids = data.draw(st.lists(st.sampled_from(pool), max_size=25))
    prompt = data.draw(st.lists(st.sampled_from(pool), max_size=6))
    stop = data.draw(stops)
    deltas, d = stream(tok, ids, stop, prompt)
    assert "".join(deltas) == expected_text(tok, ids, stop)
