"""The `llmd` command line: real generation in a fresh process, one-line errors, kv-size."""

import os
import subprocess
import sys

from click.testing import CliRunner
from daemon_harness import SESSION_WEIGHTS_CACHE
from tiny_gguf import write_tiny_llama

from llmd.daemon.cli.main import main

GENERATE_AND_LIST_MODULES = r"""
import re, sys
from llmd.daemon.cli.main import main
try:
    main(["generate", "What is the capital of France?", "--chat", "--max-tokens", "24", "--dtype", "float32"],
         standalone_mode=False)
finally:
    sys.stdout.flush()
    bad = sorted(m for m in sys.modules if re.match(r"transformers\.models\.[^.]+\.modeling_", m))
    print("BITSANDBYTES_IMPORTED=" + str("bitsandbytes" in sys.modules), file=sys.stderr)  # only nf4/fp4 need it
    print("MODELING_MODULES=" + ",".join(bad), file=sys.stderr)
"""


def test_generate_chat_answers_paris_without_transformers_modeling():
    """`llmd generate ... --chat` in a fresh process: the answer names Paris, and no
    transformers modeling module was imported (the tokens come from llmd's own model), nor
    bitsandbytes (imported only for a format that needs it)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", **SESSION_WEIGHTS_CACHE)  # the first start: converts and writes it
    proc = subprocess.run([sys.executable, "-c", GENERATE_AND_LIST_MODULES], capture_output=True, text=True, env=env,
                          timeout=300, cwd="/")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "BITSANDBYTES_IMPORTED=False\n" in proc.stderr  # the default (--weight-quant auto) start-up
    assert "MODELING_MODULES=\n" in proc.stderr or proc.stderr.rstrip().endswith("MODELING_MODULES=")
    assert "KV cache: 46080 B/token" in proc.stderr
    assert "; dtype float32, attention cpu (decodes: C kernel), " in proc.stderr  # dtype, backend, threads


def run_cli(args):
    return CliRunner().invoke(main, args)


def assert_one_line_error(result, text, exit_code=1):
    assert result.exit_code == exit_code, result.output
    lines = result.output.strip().splitlines()
    assert lines[-1].startswith("llmd: error: ") and text in lines[-1], result.output
    assert "Traceback" not in result.output


def test_missing_model_file_is_one_line(tmp_path):
    assert_one_line_error(run_cli(["generate", "hi", "--model", str(tmp_path / "nope.gguf")]), "model file not found")


def test_unknown_model_name_is_one_line():
    assert_one_line_error(run_cli(["generate", "hi", "--model", "llama-9000"]), "unknown model 'llama-9000'")


def test_unsupported_architecture_is_one_line(tmp_path):
    path = tmp_path / "mamba.gguf"
    write_tiny_llama(path, arch="mamba")
    assert_one_line_error(run_cli(["generate", "hi", "--model", str(path)]), "unsupported model architecture 'mamba'")


def test_prompt_longer_than_max_model_len_is_one_line():
    """Refused before the weights load (daemon/core/prompt_check.py): no "loading" line, and the
    prompt + max_tokens rule as well."""
    prompt = "word " * 40
    result = run_cli(["generate", prompt, "--max-model-len", "16", "--kv-cache-memory", "8MiB"])
    assert_one_line_error(result, "but the context is 16 tokens")
    assert "llmd: loading" not in result.output
    result = run_cli(["generate", "word " * 10, "--chat", "--max-tokens", "40", "--max-model-len", "48"])
    assert_one_line_error(result, "+ max_tokens (40) =")
    assert "llmd: loading" not in result.output


def test_bad_max_tokens_is_one_line():
    assert_one_line_error(run_cli(["generate", "hi", "--max-tokens", "0"]), "--max-tokens must be >= 1")


def test_kv_size_smollm2():
    result = run_cli(["kv-size", "--context", "8192", "--memory", "512MiB"])
    assert result.exit_code == 0, result.output
    rows = {line.split()[0]: line.split() for line in result.output.splitlines()[2:]}
    assert rows["bf16/fp16"][1] == "23,040"
    assert rows["float32"][1] == "46,080"
    assert rows["int8"][1] == "12,240"  # 1 byte per element + a float32 scale per (token, KV head)
    assert rows["bf16/fp16"][3] == str(512 * 2**20 // (16 * 23040))


def test_bad_sampling_values_fail_before_the_weights_load():
    for args, text in ((["generate", "hi", "--temperature", "-1"], "--temperature must be >= 0"),
                       (["generate", "hi", "--top-p", "2"], "--top-p must be in (0, 1]"),
                       (["generate", ""], "PROMPT is empty"),
                       (["bench", "kv-quality", "--kv-scales", "0,1"], "--kv-scales must be two positive")):
        r = run_cli(args)
        assert_one_line_error(r, text)
        assert "loading" not in r.output, r.output
    # click's usage errors: one line too, exit code 2
    for args, text in ((["generate", "hi", "--kv-cache-memory", "0"], "byte size must be > 0"),
                       (["generate", "hi", "--kv-cache-memory", "1e400"], "byte size must be a finite number"),
                       (["kv-size", "--memory", "nan"], "byte size must be a finite number, got 'nan'"),
                       (["kv-size", "--memory", "0.5"], "byte size must be at least 1 B, got '0.5'"),
                       (["generate", "hi", "--kv-cache-dtype", "int2"], "'int2' is not one of"),
                       (["generate", "hi", "--no-such-option"], "No such option '--no-such-option'")):
        assert_one_line_error(run_cli(args), text, exit_code=2)


def test_bench_options_fail_in_one_line_before_the_weights_load():
    """Counts of 0, a min above its max, unknown formats / dtypes / backends: one line each, no
    traceback, nothing loaded (they crashed with ZeroDivisionError, IndexError, ValueError or
    ran with a silent default before)."""
    for args, text, code in ((["bench", "throughput", "--num-requests", "0"], "'--num-requests': 0 is not in", 2),
                             (["bench", "throughput", "--min-output", "10", "--max-output", "5"],
                              "--min-output (10) must be <= --max-output (5)", 1),
                             (["bench", "single", "--repeats", "0"], "'--repeats': 0 is not in the range", 2),
                             (["bench", "single", "--decode", "0"], "'--decode': 0 is not in the range", 2),
                             (["bench", "single", "--formats", "foo"], "--formats foo: must be one of", 1),
                             (["bench", "single", "--prompt", "99999"],
                              "--prompt 99999 exceeds the token budget 512 (--max-num-batched-tokens)", 1),
                             (["bench", "prefix", "--users", "0"], "'--users': 0 is not in the range", 2),
                             (["bench", "cascade", "--system-tokens", "0"], "'--system-tokens': 0 is not in the", 2),
                             (["bench", "hybrid", "--num-requests", "0"], "'--num-requests': 0 is not in the range", 2),
                             (["bench", "step", "--attention-backend", "foo"], "foo is not one of cpu, torch", 2),
                             (["bench", "step", "--dtype", "foo"], "foo is not one of auto, float32", 2)):
        r = run_cli(args)
        assert_one_line_error(r, text, exit_code=code)
        assert "loading" not in r.output, r.output


def test_bench_counts_of_other_commands_fail_in_one_line_before_the_weights_load(monkeypatch):
    """The token / count options of prefix, beam, hybrid, chunked-prefill, context-shift,
    kv-quality and kv-transfer: 0 (or junk) is one line naming the option, before any weights
    load (they loaded the model, then crashed with ZeroDivisionError / ValueError / RuntimeError,
    failed naming the engine's max_tokens, or ran a meaningless benchmark for minutes)."""
    import llmd.daemon.cli.bench_kv as bench_kv
    import llmd.daemon.cli.bench_serving as bench_serving

    def no_load(**kw):
        raise AssertionError("the weights were about to load")
    for module in (bench_serving, bench_kv):  # prefix, chunked-prefill; the rest
        monkeypatch.setattr(module, "build_engine", no_load)
    for args, text, code in ((["bench", "prefix", "--system-tokens", "-5"], "'--system-tokens': -5 is not in", 2),
                             (["bench", "prefix", "--max-tokens", "0"], "'--max-tokens': 0 is not in", 2),
                             (["bench", "beam", "--output-tokens", "0"], "'--output-tokens': 0 is not in", 2),
                             (["bench", "beam", "--beam-width", "1"], "'--beam-width': 1 is not in", 2),
                             (["bench", "hybrid", "--seq-tokens", "0"], "'--seq-tokens': 0 is not in", 2),
                             (["bench", "hybrid", "--new-tokens", "0"], "'--new-tokens': 0 is not in", 2),
                             (["bench", "hybrid", "--seq-tokens", "16"],
                              "--new-tokens (16) must be < --seq-tokens (16)", 1),
                             (["bench", "chunked-prefill", "--period", "0"], "'--period': 0 is not in", 2),
                             (["bench", "chunked-prefill", "--num-decoders", "0"], "'--num-decoders': 0 is not", 2),
                             (["bench", "chunked-prefill", "--long-prompt", "0"], "'--long-prompt': 0 is not", 2),
                             (["bench", "context-shift", "--new-tokens", "-1"], "'--new-tokens': -1 is not in", 2),
                             (["bench", "kv-quality", "--chunk", "0"], "'--chunk': 0 is not in", 2),
                             (["bench", "kv-transfer", "--prompt-tokens", "x"], "comma-separated integers", 2),
                             (["bench", "kv-transfer", "--prompt-tokens", "256,0"], "positive integers", 2)):
        r = run_cli(args)
        assert_one_line_error(r, text, exit_code=code)
        assert "loading" not in r.output, r.output


def test_chat_options_fail_before_a_daemon_starts(tmp_path):
    """`llmd chat --max-tokens 0` (and other out-of-range sampling options) is a one-line error
    at once: no daemon is started for it (it used to load one, then fail on the first message)."""
    sock = str(tmp_path / "none.sock")
    for args, text in ((["--max-tokens", "0"], "--max-tokens must be >= 1, got 0"),
                       (["--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
                       (["--repetition-penalty", "0"], "--repetition-penalty must be > 0"),
                       (["--temperature", "5"], "--temperature must be in [0, 2] (the API's range), got 5.0")):
        r = run_cli(["chat", "--socket", sock, "-p", "hi", *args])
        assert_one_line_error(r, text)
        assert "starting a daemon" not in r.output and not os.path.exists(sock), r.output


def test_chat_on_a_template_less_model_fails_before_a_daemon_starts(tmp_path):
    """`llmd chat -m base.gguf` (no chat template): one line at once, from the GGUF header; no
    daemon is started (it used to load the model, then refuse every message)."""
    path, sock = tmp_path / "base.gguf", str(tmp_path / "none.sock")
    write_tiny_llama(path)
    for extra in ([], ["--no-daemon"]):
        r = run_cli(["chat", "--socket", sock, "-m", str(path), "-p", "hi", *extra])
        assert_one_line_error(r, f"model {path} has no chat template (a base model), so it cannot chat")
        assert "starting a daemon" not in r.output and "loading" not in r.output and not os.path.exists(sock)


def test_generate_chat_on_a_template_less_model_names_the_given_model(tmp_path):
    """A base model (no chat template) with --chat fails before the weights load, naming the
    --model given (not the GGUF's general.name)."""
    path = tmp_path / "base.gguf"
    write_tiny_llama(path)
    r = run_cli(["generate", "hi", "--chat", "--model", str(path)])
    assert_one_line_error(r, f"model {path} has no chat template")
    assert "loading" not in r.output, r.output


def test_a_prompt_of_dash_is_read_from_stdin(tmp_path):
    """`llmd generate -` takes the prompt from stdin (trailing newlines stripped, as `$(...)`):
    the prompt-length check before the weights load counts the same tokens as for the prompt
    given as an argument; an empty stdin or an empty prompt is one line, and so for `llmd chat
    -p`, before any daemon starts."""
    sock = str(tmp_path / "none.sock")
    prompt = "word " * 30 + "end"
    args = ["--max-model-len", "16", "--kv-cache-memory", "8MiB"]
    given = CliRunner().invoke(main, ["generate", prompt, *args])
    piped = CliRunner().invoke(main, ["generate", "-", *args], input=prompt + "\n\n")
    assert_one_line_error(given, "but the context is 16 tokens")
    assert piped.output == given.output
    for cmd, text in ((["generate", "-", *args], "PROMPT is - but stdin gave no text"),
                      (["generate", "", *args], "PROMPT is empty"),
                      (["chat", "--socket", sock, "-p", "-"], "--prompt is - but stdin gave no text"),
                      (["chat", "--socket", sock, "-p", ""], "--prompt is empty")):
        r = CliRunner().invoke(main, cmd, input="\n")
        assert_one_line_error(r, text)
        assert "loading" not in r.output and "starting a daemon" not in r.output and not os.path.exists(sock)


def test_a_prompt_that_is_not_utf8_is_one_line(tmp_path):
    """Undecodable bytes on stdin (`-`) or in the argument are one line naming the prompt, before
    any daemon starts; they reached the tokenizer as surrogates (a TypeError traceback)."""
    sock = str(tmp_path / "none.sock")
    for cmd, stdin, text in (
            (["generate", "-"], b"ok \xff", "PROMPT is - but stdin is not UTF-8 text (invalid start byte at byte 3)"),
            (["chat", "--socket", sock, "-p", "-"], b"\xff", "--prompt is - but stdin is not UTF-8 text"),
            (["generate", "ok \udcff"], b"", "PROMPT is not UTF-8 text (undecodable byte at character 3)")):
        r = CliRunner().invoke(main, cmd, input=stdin)
        assert_one_line_error(r, text)
        assert "starting a daemon" not in r.output and not os.path.exists(sock)


def test_serve_and_generate_refuse_bad_engine_options_before_the_socket_or_the_weights(tmp_path):
    """`llmd serve --block-size 0` and a `--keep` that leaves no block of the context to discard
    are one line before the socket is claimed (they printed "loading", "stopped", then the error,
    or were caught only after the load), with or without `--context-overflow shift` (`llmd chat`
    asks for a shift per request); `llmd generate` names `--keep`, not the request's n_keep."""
    sock = str(tmp_path / "s.sock")
    keep = ["--keep", "200", "--max-model-len", "128", "--context-overflow", "shift"]
    text = "--keep 200 leaves no whole block of the 128-token context to discard: at most 96 (or -1, the prompt)"
    no_shift = keep[:4]  # --keep counts without --context-overflow shift too: chat asks for a shift per request
    for args, words in ((["serve", "--socket", sock, "--block-size", "0"], "--block-size must be >= 1, got 0"),
                        (["serve", "--socket", sock, *keep], text), (["generate", "hi", *keep], text),
                        (["serve", "--socket", sock, *no_shift], text),
                        (["chat", "--no-daemon", "--socket", sock, "-p", "hi", *no_shift], text)):
        r = run_cli(args)
        assert r.output.strip().splitlines() == [f"llmd: error: {words}"], r.output
        assert r.exit_code == 1 and not os.path.exists(sock) and not os.path.exists(sock + ".lock")


def test_a_failed_generation_exits_1(monkeypatch):
    """``llmd generate`` whose request ends with finish_reason "error" (here: NaN logits, as a
    float16 overflow gives) printed the error and exited 0; it now ends with one error line, exit 1."""
    from llmd.daemon.core.model_runner import ModelRunner

    logits = ModelRunner.compute_logits
    monkeypatch.setattr(ModelRunner, "compute_logits", lambda self, out: logits(self, out) * float("nan"))
    result = run_cli(["generate", "hi", "--model", "random:qwen3-0.6b:layers=1", "--max-tokens", "3"])
    assert_one_line_error(result, "the generation failed: the model produced non-finite logits")
