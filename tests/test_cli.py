"""The command lines (pyproject.toml's [project.scripts]): where flags may go, and bad
arguments as one line naming the bad value, exit code 2."""

import argparse
import importlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import tomllib

import numpy as np
import pytest
import tokenizers
import yaml
from flax import nnx
from test_runs import SMALL, write_run

from jaxpar.models import Transformer, to_hf
from jaxpar.commands.common import CommandParser
from jaxpar.train.config import load_config, to_dict
from jaxpar.train.data import EOS
from jaxpar.train.runs import context_length, load_model, load_run

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def command(name: str) -> str:
    """The module of console script ``name``."""
    return SCRIPTS[name].split(":")[0]


def run(monkeypatch, capfd, name: str, *args) -> subprocess.CompletedProcess:
    """Console script ``name`` (its ``module:function``, as the installed script calls it,
    ``sys.argv`` its arguments) in this process: its exit code, stdout and stderr (file
    descriptors 1 and 2). A subprocess spent its time importing JAX; what these tests
    read is the command's own lines and exit code, not the process's."""
    module, function = SCRIPTS[name].split(":")
    monkeypatch.setattr(sys, "argv", [name, *map(str, args)])
    capfd.readouterr()
    with pytest.raises(SystemExit) as exit_:
        getattr(importlib.import_module(module), function)()
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(sys.argv, exit_.value.code, out, err)


def generate(capsys, *args) -> tuple[int, str, str]:
    """``jaxpar-generate ARGS`` in this process: ``(exit code, stdout, stderr)``."""
    from jaxpar.commands.generate import main

    try:
        code = main([*map(str, args)])
    except SystemExit as e:  # parser.error
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def flag_among_positionals(parser: argparse.ArgumentParser) -> tuple[list[str], list[str]]:
    """Two argvs for ``parser`` that differ only in where its first flag (an option that
    takes no value) goes: after the first positional value, and last."""
    values, options, flag = [], [], None
    for action in parser._actions:
        value = str(action.choices[0]) if action.choices else "1"
        if not action.option_strings:
            values.append(value)
            if action.nargs in ("*", "+"):
                values.append(value)
        elif action.required:
            options += [action.option_strings[0], value]
        elif action.nargs == 0 and flag is None and not isinstance(action, argparse._HelpAction):
            flag = action.option_strings[0]
    assert flag is not None and values, "a command with a flag and a positional"
    return values[:1] + [flag] + values[1:] + options, values + options + [flag]


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_every_command_takes_flags_among_its_positionals(name, capsys):
    """``jaxpar-train tiny --no-progress steps=3`` parses as with the flag last (argparse's
    parse_args ends the positionals at the first flag: "unrecognized arguments:
    steps=3"), for every console script: each builds its parser (``_parser()``) as a
    CommandParser. Argparse's own errors are one line, as the commands' checks are."""
    parser = importlib.import_module(command(name))._parser()
    assert isinstance(parser, CommandParser) and parser.prog == name
    among, last = flag_among_positionals(parser)
    assert parser.parse_args(among) == parser.parse_args(last)

    required = any(a.nargs in (None, "+") for a in parser._actions if not a.option_strings)
    with pytest.raises(SystemExit) as e:  # jaxpar-plan --calibrate needs no positional
        parser.parse_args([] if required else ["--no-such-flag"])
    err = capsys.readouterr().err.splitlines()
    assert e.value.code == 2 and len(err) == 1
    assert err[0].startswith(f"{name}: error: " + ("the following arguments are required" if required
                                                   else "unrecognized arguments: --no-such-flag"))


@pytest.mark.slow
def test_train_reads_overrides_after_a_flag(monkeypatch, capfd):
    out = run(monkeypatch, capfd, "jaxpar-train", "tiny", "--no-progress", "steps=ten")
    assert out.returncode == 2
    assert out.stderr.splitlines() == ["jaxpar-train: error: steps='ten' must be an integer"]


# jaxpar-generate's bad arguments ------------------------------------------------------


@pytest.mark.slow
def test_generate_says_a_missing_run_dir_does_not_exist(tmp_path, monkeypatch, capfd):
    out = run(monkeypatch, capfd, "jaxpar-generate", tmp_path / "nope", "--prompt", "hi")
    assert out.returncode == 2
    assert out.stderr.splitlines() == [f"jaxpar-generate: error: {tmp_path / 'nope'} does not exist"]


def test_generate_names_what_is_wrong_with_a_run_dir(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    neither = "no config.yaml (a jaxpar run) or config.json (Hugging Face) in"
    for args, message in [
        ([tmp_path / "nope"], f"{tmp_path / 'nope'} does not exist"),
        ([tmp_path / "file"], f"{tmp_path / 'file'} is not a directory (nor a .gguf file)"),
        ([tmp_path / "empty"], f"{neither} {tmp_path / 'empty'}"),
        ([tmp_path / "hf", "--draft", tmp_path / "nope"], f"{tmp_path / 'nope'} does not exist"),
    ]:
        code, out, err = generate(capsys, *args, "--prompt", "hi")
        assert code == 2 and err.splitlines() == [f"jaxpar-generate: error: {message}"]


@pytest.mark.parametrize("option,value,message", [
    ("--max-new-tokens", "0", "--max-new-tokens 0 must be at least 1"),
    ("--temperature", "-0.5", "--temperature -0.5 must not be negative"),
    ("--top-p", "0", "--top-p 0.0 must be in (0, 1]"),
    ("--top-p", "1.5", "--top-p 1.5 must be in (0, 1]"),
])
def test_generate_names_the_bad_value(option, value, message, tmp_path, capsys):
    code, out, err = generate(capsys, tmp_path, "--prompt", "hi", option, value)
    assert code == 2 and err.splitlines() == [f"jaxpar-generate: error: {message}"]


# A directory that is a file ------------------------------------------------------------


def _main_of(name: str):
    module, function = SCRIPTS[name].split(":")
    return getattr(importlib.import_module(module), function.removesuffix("_entry"))


@pytest.mark.parametrize("name,args,message", [
    ("jaxpar-train", ["tiny", "run_dir={f}"], "run_dir='{f}': {f} is a file, not a directory"),
    ("jaxpar-train", ["tiny", "run_dir={f}/sub"], "run_dir='{f}/sub': {f} is a file, not a directory"),
    ("jaxpar-train", ["tiny", "run_dir={d}/run", "cache_dir={f}/cache"],
     "cache_dir='{f}/cache': {f} is a file, not a directory"),
    ("jaxpar-train", ["glide", "target_run_dir={d}", "run_dir={d}/run", "glide.teacher_cache={f}"],
     "glide.teacher_cache='{f}': {f} is a file, not a directory"),
    ("jaxpar-generate", ["{f}", "--prompt", "hi"], "{f} is not a directory (nor a .gguf file)"),
    ("jaxpar-generate", ["{f}/sub", "--prompt", "hi"], "{f}/sub does not exist"),
    ("jaxpar-generate", ["{d}", "--prompt", "hi", "--cache-dir", "{f}/c"],
     "--cache-dir {f}/c: {f} is a file, not a directory"),
    ("jaxpar-serve", ["{f}"], "{f} is not a directory (nor a .gguf file)"),
    ("jaxpar-serve", ["{f}/sub"], "{f}/sub does not exist"),
    ("jaxpar-serve", ["{d}", "--cache-dir", "{f}"], "--cache-dir {f}: {f} is a file, not a directory"),
])
def test_a_directory_that_is_a_file_is_one_line_exit_2_nothing_written(name, args, message, runs, tmp_path,
                                                                        capfd):
    """Every command, given a file where it reads or writes a directory (or a path under
    a file): one line naming it, exit 2, nothing written, the file untouched. (``{d}``:
    a run dir that works.)"""
    file = tmp_path / "afile"
    file.write_text("mine")
    fill = lambda text: text.format(f=file, d=runs[0])  # noqa: E731
    before = sorted(tmp_path.rglob("*")), sorted(runs[0].rglob("*"))
    capfd.readouterr()
    try:
        code = _main_of(name)([fill(a) for a in args])
    except SystemExit as e:  # parser.error
        code = e.code
    err = capfd.readouterr().err
    assert code == 2 and err.splitlines() == [f"{name}: error: {fill(message)}"], err
    assert (sorted(tmp_path.rglob("*")), sorted(runs[0].rglob("*"))) == before and file.read_text() == "mine"


# The compilation cache ----------------------------------------------------------------


def _generate_counting_compiles(run_dir, *flags) -> tuple[int, int]:
    """``jaxpar-generate RUN_DIR ...`` in a fresh process without the suite's own cache
    settings: ``(persistent cache hits, misses)``."""
    code = textwrap.dedent("""
        import sys
        import jax.monitoring
        counts = {}
        jax.monitoring.register_event_listener(lambda event, **_: counts.__setitem__(event, counts.get(event, 0) + 1))
        from jaxpar.commands.generate import main
        code = main(sys.argv[1:])
        print(counts.get("/jax/compilation_cache/cache_hits", 0), counts.get("/jax/compilation_cache/cache_misses", 0))
        sys.exit(code)
    """)
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")}
    out = subprocess.run([sys.executable, "-c", code, str(run_dir), "--prompt", "w1 w2", "--max-new-tokens", "4",
                          "--json", *map(str, flags)], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    hits, misses = map(int, out.stdout.splitlines()[-1].split())
    return hits, misses


@pytest.mark.slow
def test_a_second_start_loads_every_program_from_the_compilation_cache(runs, tmp_path):
    """``--cache-dir DIR``: the first start compiles and keeps its programs in DIR/xla,
    the second compiles none (every program a hit); ``--no-compile-cache`` keeps none."""
    cache = tmp_path / "cache"
    hits, misses = _generate_counting_compiles(runs[0], "--cache-dir", cache)
    assert hits == 0 and misses > 0 and len(list((cache / "xla").iterdir())) >= misses
    assert _generate_counting_compiles(runs[0], "--cache-dir", cache) == (misses, 0)
    assert _generate_counting_compiles(runs[0], "--cache-dir", tmp_path / "off", "--no-compile-cache") == (0, 0)
    assert not (tmp_path / "off").exists()


# The model's context ------------------------------------------------------------------


def words(*ids) -> str:
    return " ".join(f"w{i}" for i in ids)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A jaxpar run of a random small model, seq_len 24, and its Hugging Face export
    (max_position_embeddings 16), both with a 300-word tokenizer (``w0`` ... ``w299``,
    no end-of-text token: generation runs to --max-new-tokens)."""
    root = tmp_path_factory.mktemp("runs")
    run, hf = root / "run", root / "hf"
    write_run(run, np.random.default_rng(0), "seq_len=24", "model.max_position=16", opt_state=False)
    vocab = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"w{i}": i for i in range(300)}, "w0"))
    vocab.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    vocab.save(str(run / "tokenizer.json"))
    to_hf(load_run(run), hf)
    (hf / "tokenizer.json").write_text((run / "tokenizer.json").read_text())
    return run, hf


def test_context_length(runs, tmp_path):
    """A run's seq_len (RoPE: model.max_position is unused), an HF model's
    max_position_embeddings, and with learned positions the smaller of seq_len and the
    table's rows."""
    run, hf = runs
    assert context_length(run, load_model(run)) == 24 and context_length(hf, load_model(hf)) == 16
    cfg = load_config("tiny", [*SMALL, "seq_len=24", "model.position=learned", "model.max_position=20"])
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    model = nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0)))
    assert context_length(tmp_path, model) == 20


@pytest.mark.slow
def test_generate_refuses_a_prompt_longer_than_the_context(runs, monkeypatch, capfd):
    out = run(monkeypatch, capfd, "jaxpar-generate", runs[0], "--prompt", words(*range(30)), "--max-new-tokens", "4")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.splitlines() == [
        "jaxpar-generate: error: --prompt is 30 tokens, more than the model's context of 24 tokens; "
        "shorten them, or pass --truncate-prompt to keep the prompt's end"]


def test_generate_fits_the_prompt_and_new_tokens_in_the_context(runs, capsys):
    """Prompt and --max-new-tokens past the context: refused naming both, or with
    --truncate-prompt the prompt's end, as if only that were given, and one warning."""
    run, hf = runs
    code, out, err = generate(capsys, run, "--prompt", words(*range(20)), "--max-new-tokens", "8")
    assert code == 2 and err.splitlines() == [
        "jaxpar-generate: error: --prompt's 20 tokens and --max-new-tokens 8 make 28, more than the "
        "model's context of 24 tokens; shorten them, or pass --truncate-prompt to keep the prompt's end"]
    code, out, err = generate(capsys, hf, "--prompt", "w1", "--max-new-tokens", "16", "--truncate-prompt")
    assert code == 2 and err.splitlines() == ["jaxpar-generate: error: --max-new-tokens 16 leaves no room "
                                              "for a prompt in the model's context of 16 tokens"]

    code, out, err = generate(capsys, hf, "--prompt", words(*range(3, 15)), "--max-new-tokens", "8",
                              "--truncate-prompt", "--json")
    assert code == 0 and err.splitlines() == [
        "jaxpar-generate: warning: --prompt truncated to its last 8 of 12 tokens "
        "(the model's context is 16 tokens, --max-new-tokens 8)"]
    code, end, err = generate(capsys, hf, "--prompt", words(*range(7, 15)), "--max-new-tokens", "8", "--json")
    assert code == 0 and err == ""
    assert json.loads(out)["tokens"] == json.loads(end)["tokens"] and len(json.loads(end)["tokens"]) == 8


@pytest.mark.slow
def test_generate_stops_at_a_runs_end_of_text_token(runs, tmp_path, capsys):
    """A jaxpar run ends a sequence at its tokenizer's end-of-text token (appended to
    every document it trained on), as an HF model stops at its eos_token_id
    (test_hf.py): the same run with one word renamed to it stops at that word's first
    place, which the tokens keep and the text leaves out."""
    prompt = [5, 17, 42, 9]
    code, out, err = generate(capsys, runs[0], "--prompt", words(*prompt), "--max-new-tokens", "12", "--json")
    assert code == 0, err
    free = json.loads(out)["tokens"]
    # Where each new word first comes, before the last place (0 is the unknown word).
    firsts = {t: free.index(t) for t in free if t not in prompt and t != 0 and free.index(t) < 11}
    assert len(free) == 12 and firsts, free
    end = max(firsts, key=firsts.get)
    stop = firsts[end]

    run = tmp_path / "run"
    shutil.copytree(runs[0], run)
    vocab = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {(EOS if i == end else f"w{i}"): i for i in range(300)}, "w0"))
    vocab.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    vocab.save(str(run / "tokenizer.json"))
    code, out, err = generate(capsys, run, "--prompt", words(*prompt), "--max-new-tokens", "12", "--json")
    assert code == 0, err
    assert json.loads(out)["tokens"] == free[: stop + 1]
    assert json.loads(out)["text"] == words(*free[:stop])
