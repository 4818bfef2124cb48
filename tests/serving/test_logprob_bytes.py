"""Chat logprobs' ``bytes`` are each token's raw bytes, also for a token that holds only part of
a character (OpenAI: joined over the tokens they give the reply's UTF-8, which is what the field
is for). They were the UTF-8 of the token's lone decode, U+FFFD's EF BF BD for such a token."""

from __future__ import annotations

from llmd.daemon.core.outputs import RequestOutput, TokenLogprobs
from llmd.daemon.serving.generation_routes import _byte_level_decoder, _token_bytes, _token_text
from llmd.daemon.serving.responses import ResponseBuilder

ENCODER = {b: c for c, b in _byte_level_decoder().items()}


class ByteLevelHF:
    """A byte-level BPE vocabulary (GPT-2's alphabet, as SmolLM2's) plus a byte-fallback piece."""

    def __init__(self, pieces: list[bytes]):
        self.pieces = ["".join(ENCODER[b] for b in p) for p in pieces] + ["<0xF0>"]

    def convert_ids_to_tokens(self, ids):
        return [self.pieces[i] for i in ids]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        raw = b"".join(bytes([int(p[3:5], 16)]) if p.startswith("<0x") else bytes(_byte_level_decoder()[c] for c in p)
                       for p in self.convert_ids_to_tokens(ids))
        return raw.decode("utf-8", errors="replace")


def test_chat_logprob_bytes_of_tokens_splitting_a_character_join_to_the_text():
    text = " 😀日本"
    raw = text.encode()
    pieces = [raw[:2], raw[2:4], raw[4:6], raw[6:9], raw[9:]]  # " \xf0", "\x9f\x98", "\x80\xe6", "\x97\xa5\xe6", ...
    hf = ByteLevelHF(pieces)
    text_of = _token_text(hf)
    builder = ResponseBuilder("chatcmpl-x", "m", chat=True, n=1, logprobs=1, token_text=text_of,
                              token_bytes=_token_bytes(hf, text_of))
    lps = [TokenLogprobs(token_id=i, logprob=-1.0, top=[(i, -1.0), (5, -2.0)]) for i in range(len(pieces))]
    builder.absorb(0, RequestOutput(request_id="r", new_token_ids=list(range(len(pieces))), new_text=text,
                                    finished=True, finish_reason="length", logprobs=lps, num_output_tokens=5))
    content = builder.final_body()["choices"][0]["logprobs"]["content"]
    assert [e["bytes"] for e in content] == [list(p) for p in pieces]
    assert b"".join(bytes(e["bytes"]) for e in content).decode() == text
    assert "\ufffd" in content[0]["token"]  # the token's text stays its lone decode, as vLLM's
    assert content[0]["top_logprobs"][1]["bytes"] == [0xF0]  # a byte-fallback piece: its byte
    assert _token_bytes(hf, text_of)(3) == list(raw[6:9])  # whole characters' UTF-8 as before
