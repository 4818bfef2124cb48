"""A ``--kv-cache-memory`` under 2 KV blocks is refused before the weights load
(:func:`llmd.daemon.core.prompt_check.check_options_before_load`, from the model's header or a
``random:`` preset's config), in the engine's words: ``llmd serve --kv-cache-memory 1KiB`` used
to print ``llmd: loading ...`` and ``llmd: stopped`` first. ``llmd generate`` and ``llmd chat
--no-daemon`` build their engine through the same check."""

from __future__ import annotations

import os

import pytest
from click.testing import CliRunner
from serve_cli import one_error_line

from llmd.daemon.cli.main import main
from llmd.daemon.core.config import EngineConfig
from llmd.daemon.core.errors import LlmdError
from llmd.daemon.core.prompt_check import check_options_before_load

MODEL = "random:qwen3-0.6b:layers=1"
# one block: 16 tokens x 1 layer x 8 KV heads x 128 x 2 (K, V) x 2 B (bfloat16) or 4 B (float32)
TOO_SMALL = "--kv-cache-memory 1024 B holds fewer than 2 KV blocks of {block} B (16 tokens x 1 layers, auto); " \
            "give at least {need} B"


def expected(dtype: str) -> str:
    block = 16 * 8 * 128 * 2 * (2 if dtype == "bfloat16" else 4)
    return TOO_SMALL.format(block=block, need=2 * block)


def test_serve_refuses_it_before_loading_and_leaves_no_lock(tmp_path):
    path = str(tmp_path / "d.sock")
    result = CliRunner().invoke(main, ["serve", "--socket", path, "--model", MODEL, "--dtype", "float32",
                                       "--kv-cache-memory", "1KiB"])
    assert result.exit_code == 1, result.output
    one_error_line(result.output, expected("float32"))
    assert "llmd: loading" not in result.output and "llmd: stopped" not in result.output, result.output
    assert not os.path.exists(path) and not os.path.exists(path + ".lock")


@pytest.mark.parametrize("command", [["generate", "hello"], ["chat", "--no-daemon"]])
def test_generate_and_chat_refuse_it_before_loading(command):
    result = CliRunner().invoke(main, [*command, "--model", MODEL, "--dtype", "bfloat16", "--kv-cache-memory", "1KiB"],
                                input="hello\n")
    assert result.exit_code == 1, result.output
    one_error_line(result.output, expected("bfloat16"))
    assert "llmd: loading" not in result.output, result.output


@pytest.mark.parametrize("options", [dict(kv_cache_memory=1024), dict(kv_cache_memory=1024, kv_cache_dtype="int8"),
                                     dict(kv_cache_memory=1024, kv_cache_dtype="int4", attention_backend="cpu"),
                                     dict(kv_cache_memory=20000, block_size=32)])
def test_the_header_check_says_what_the_engine_says(tmp_path, options):
    """From the GGUF header alone, the same line (block bytes, least memory) as the engine built
    from the loaded model; a pool the engine takes passes."""
    from tiny_engine import tiny_engine

    gguf = tmp_path / "t.gguf"
    with pytest.raises(LlmdError) as engine_error:
        tiny_engine(gguf, **options)
    kw = dict(model=str(gguf), device="cpu", dtype="float32", attention_backend="torch", threads=1)
    with pytest.raises(LlmdError) as header_error:
        check_options_before_load(EngineConfig(**{**kw, **options}).resolve())
    assert str(header_error.value) == str(engine_error.value)
    tiny_engine(gguf, kv_cache_memory=2**20)  # the tiny model's default pool fits
    check_options_before_load(EngineConfig(**kw, kv_cache_memory=2**20).resolve())


def test_a_layout_the_format_cannot_take_is_named_before_the_size():
    """The engine checks the KV layout first (``engine_setup.check_kv_layout``); so does the early
    check: qwen3's head_dim 128 is no multiple of a 256-wide scale group, and that is what is said,
    not a block size computed for a layout the engine would refuse anyway."""
    cfg = EngineConfig(model=MODEL, kv_cache_memory=1024, kv_cache_dtype="int8", kv_scale_group_size=256).resolve()
    with pytest.raises(LlmdError, match="--kv-scale-group-size 256 needs head_dim a multiple of 256"):
        check_options_before_load(cfg)
