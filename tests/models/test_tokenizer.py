"""Tokenizer from the GGUF: disk cache, BOS policy, chat template."""

import dataclasses
import os

import pytest

from llmd.models.errors import LlmdError
from llmd.models.tokenizer import Tokenizer, load_tokenizer


def test_tokenizer_cache_is_built_once_and_reused(smollm2_path, smollm2, smollm2_reader, tmp_path):
    cfg = smollm2[1]
    header = smollm2_reader.data_offset  # llmd's open_gguf of the file, parsed once per session
    first = load_tokenizer(smollm2_path, cfg, header, cache_dir=str(tmp_path))
    entries = os.listdir(tmp_path / "tokenizers")
    assert len(entries) == 1 and not entries[0].startswith(".tmp")  # renamed into place, no leftovers
    second = load_tokenizer(smollm2_path, cfg, header, cache_dir=str(tmp_path))
    text = "Hello, wörld! 日本語 🙂"
    assert first.encode(text) == second.encode(text)
    assert second.hf.chat_template == first.hf.chat_template
    (tmp_path / "tokenizers" / entries[0] / "tokenizer.json").write_text("{broken")
    third = load_tokenizer(smollm2_path, cfg, header, cache_dir=str(tmp_path))  # corrupt entry is rebuilt
    assert third.encode(text) == first.encode(text)


def test_bos_policy(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert tok.config.add_bos_token is False
    assert tok.encode("Hi")[0] != tok.bos_token_id  # SmolLM2's GGUF says no BOS
    chat = tok.apply_chat([{"role": "user", "content": "Hi"}])
    assert chat.count(tok.bos_token_id) == 3  # the template's own <|im_start|> markers (id 1), no extra BOS
    with_bos = Tokenizer(tok.hf, dataclasses.replace(tok.config, add_bos_token=True))
    ids = with_bos.encode("Hi")
    assert ids[0] == tok.bos_token_id and ids[1] != tok.bos_token_id
    again = with_bos.encode("<|im_start|>Hi")  # text that already starts with BOS: never two
    assert again[0] == tok.bos_token_id and again[1] != tok.bos_token_id


def test_no_chat_template_is_a_clear_error(smollm2_tokenizer):
    tok = smollm2_tokenizer
    plain = Tokenizer(tok.hf, dataclasses.replace(tok.config, chat_template=None))
    with pytest.raises(LlmdError, match="has no chat template"):
        plain.apply_chat([{"role": "user", "content": "Hi"}])
    # through the engine's input processor: a request error naming `messages` (HTTP 400), worded
    # for any caller (no GGUF general.name, which is not the served name)
    from llmd.daemon.core.errors import RequestError
    from llmd.daemon.core.input_processor import InputProcessor

    with pytest.raises(RequestError) as e:
        InputProcessor(plain, 49152, 2048).tokenize([{"role": "user", "content": "Hi"}])
    assert e.value.param == "messages" and str(e.value).startswith("this model has no chat template"), e.value
    assert tok.config.name not in str(e.value)
