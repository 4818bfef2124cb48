"""The tokenizers-backed tokenizer of a warm start answers as transformers does, and loads without it."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import textwrap

import jinja2
import pytest

from llmd.models.chat_template import render_chat
from llmd.models.fast_tokenizer import META_FILE, FastTokenizer, read_meta
from llmd.models.gguf_loader import open_gguf
from llmd.models.tokenizer import load_tokenizer

TEXTS = ["Hello, wörld! 日本語 🙂", "", " leading space", "tabs\tand\nnewlines\r\n", "<|im_start|>user\nhi<|im_end|>",
         "a" * 300, "def f(x):\n    return x ** 2  # ok", "Ünïcödé ß ﬁ ½ \u200b zero-width", "<repo_name>x<filename>y"]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello! 🙂"}, {"role": "user", "content": "日本語で?"}],
    [{"role": "user", "content": "special <|im_end|> inside"}, {"role": "assistant", "content": "ok"}],
]
#: transformers' extras a template may use: raise_exception, namespace, tojson, loop controls, generation
TEMPLATE = (
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% if m['role'] == 'tool' %}"
    "{{ raise_exception('no tools: ' + m['content']) }}{% endif %}{% if loop.index > 5 %}{% break %}{% endif %}"
    "{% set ns.n = ns.n + 1 %}{{ bos_token }}{{ m['role'] | upper }}: {{ m | tojson(indent=1) }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}[{{ m['content'] }}]{% endgeneration %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}n={{ ns.n }} {{ dict(a=1) | tojson }}{% endif %}"
)


@pytest.fixture(scope="module")
def fast(smollm2_tokenizer):
    tok = smollm2_tokenizer.hf
    assert isinstance(tok, FastTokenizer)  # SmolLM2's cached tokenizer is described as exact
    return tok


def test_answers_equal_transformers(fast):
    hf = fast.transformers
    rng = random.Random(0)
    n = len(hf)
    for text in TEXTS:
        assert fast.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False), text
    for _ in range(50):
        ids = [rng.randrange(n) for _ in range(rng.randrange(1, 40))] + rng.sample(hf.all_special_ids, 2)
        for skip in (False, True):
            assert fast.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
            assert fast.convert_ids_to_tokens(ids, skip_special_tokens=skip) == hf.convert_ids_to_tokens(
                ids, skip_special_tokens=skip)
        tokens = hf.convert_ids_to_tokens(ids)
        assert fast.convert_tokens_to_string(tokens) == hf.convert_tokens_to_string(tokens)
    assert fast.decode(5) == hf.decode(5) and fast.convert_ids_to_tokens(5) == hf.convert_ids_to_tokens(5)
    assert fast.all_special_ids == hf.all_special_ids and fast.special_tokens_map == hf.special_tokens_map
    assert fast.chat_template == hf.chat_template
    assert {i: (t.content, t.special) for i, t in fast.added_tokens_decoder.items()} == {
        i: (t.content, t.special) for i, t in hf.added_tokens_decoder.items()}


def test_chat_templates_render_as_transformers(fast):
    hf = fast.transformers
    for chat in CHATS:
        for gen in (True, False):
            want = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            assert fast.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen) == want
            got = render_chat(TEMPLATE, chat, fast.special_tokens_map, gen)
            assert got == hf.apply_chat_template(chat, chat_template=TEMPLATE, tokenize=False,
                                                 add_generation_prompt=gen)
    with_none = [{"role": "user", "content": "x", "name": None, "reasoning": "because"}]
    assert render_chat(TEMPLATE, with_none, {}, False) == hf.apply_chat_template(
        with_none, chat_template=TEMPLATE, tokenize=False, bos_token="", eos_token="", unk_token="", pad_token="")
    with pytest.raises(jinja2.TemplateError, match="no tools: x"):
        render_chat(TEMPLATE, [{"role": "tool", "content": "x"}], {}, False)
    with pytest.raises(jinja2.TemplateError, match="no tools: x"):
        hf.apply_chat_template([{"role": "tool", "content": "x"}], chat_template=TEMPLATE, tokenize=False)
    with pytest.raises(jinja2.exceptions.SecurityError):
        render_chat("{% set ns = namespace(_x=1) %}", CHATS[0], {}, False)


WARM_LOAD = textwrap.dedent("""
    import json, sys
    for name in ("transformers", "torch", "gguf"):
        sys.modules[name] = None  # any import of these now raises
    from llmd.models.header_cache import header_info
    from llmd.models.tokenizer import load_tokenizer
    path, cache, texts, chats = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
    info = header_info(path, cache)
    tok = load_tokenizer(path, info.config, info.data_offset, cache_dir=cache)
    print(json.dumps({"encode": [tok.encode(t) for t in texts], "chat": [tok.apply_chat(c) for c in chats],
                      "decode": tok.decode(tok.apply_chat(chats[1]), skip_special_tokens=False)}))
""")


def test_a_warm_load_imports_no_transformers(tmp_path, smollm2_path, smollm2, fast):
    """A tokenizer entry written before the description existed is described on its next load
    (through transformers, once); the load after that imports neither transformers nor torch and
    gives transformers' token ids."""
    cache = tmp_path / "cache"
    entry = cache / "tokenizers" / os.path.basename(fast.directory)
    shutil.copytree(fast.directory, entry)
    os.unlink(entry / META_FILE)  # as an entry of the previous llmd
    header = open_gguf(smollm2_path).data_offset
    upgraded = load_tokenizer(smollm2_path, smollm2[1], header, cache_dir=str(cache))
    assert isinstance(upgraded.hf, FastTokenizer) and read_meta(str(entry)) is not None
    r = subprocess.run([sys.executable, "-c", WARM_LOAD, smollm2_path, str(cache), json.dumps(TEXTS),
                        json.dumps(CHATS)], capture_output=True, text=True, timeout=120, cwd="/")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    hf = fast.transformers
    assert got["encode"] == [hf.encode(t, add_special_tokens=False) for t in TEXTS]  # SmolLM2 adds no BOS
    assert got["chat"] == [hf.encode(hf.apply_chat_template(c, tokenize=False, add_generation_prompt=True),
                                     add_special_tokens=False) for c in CHATS]
    assert got["decode"] == hf.decode(got["chat"][1], skip_special_tokens=False)


def test_an_inexact_description_keeps_transformers(tmp_path, smollm2_path, smollm2, fast):
    """A tokenizer the backend alone would not reproduce (here: marked inexact, as one with
    ``clean_up_tokenization_spaces``) is loaded through transformers, as before."""
    cache = tmp_path / "cache"
    entry = cache / "tokenizers" / os.path.basename(fast.directory)
    shutil.copytree(fast.directory, entry)
    meta = json.loads((entry / META_FILE).read_text())
    (entry / META_FILE).write_text(json.dumps({**meta, "exact": False}))
    assert FastTokenizer.from_directory(str(entry)) is None
    tok = load_tokenizer(smollm2_path, smollm2[1], open_gguf(smollm2_path).data_offset, cache_dir=str(cache))
    assert not isinstance(tok.hf, FastTokenizer) and tok.encode("Hi there") == fast.encode("Hi there")


def test_encode_releases_the_gil(fast):
    """A 500k-character prompt is tokenized with the GIL released (``encode_batch``; the
    backend's ``encode`` holds it ~0.2 s): a thread sleeping 1 ms at a time keeps running."""
    import threading
    import time

    ticks, stop = [0], threading.Event()

    def spin():
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0.001)

    t = threading.Thread(target=spin)
    t.start()
    t0 = time.perf_counter()
    fast.encode("word " * 100_000)
    elapsed = time.perf_counter() - t0
    stop.set()
    t.join()
    assert ticks[0] >= 0.2 * elapsed / 0.0015, (ticks[0], elapsed)
