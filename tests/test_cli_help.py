"""Every command's options, as `spanllm COMMAND --help` shows them: each has help, each says its default once
(never `(default: None)`), `--pg-timeout` only where ranks run collectives, vLLM's `-tp` beside every `--tp`.
The parsers are built from `spanllm.cli.COMMANDS`, as the command line builds them."""

from __future__ import annotations

import argparse
import importlib
import re

import pytest

from spanllm import cli

WITH_COLLECTIVES = {
    "demo",
    "generate",
    "serve",
    "tune",
    "bench allreduce",
    "bench attention",
    "bench batch",
    "bench study",
    "bench throughput",
}


def _parser(words: str, module: str) -> cli.ArgumentParser:
    return cli.build_parser(words, importlib.import_module(module))


def _shown(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)]


def _help_text(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The action's help as --help prints it (defaults expanded)."""
    return parser._get_formatter()._expand_help(action)


@pytest.mark.parametrize("words,module", [(w, m) for w, m, _ in cli.COMMANDS], ids=[w for w, _, _ in cli.COMMANDS])
def test_every_option_has_help_and_one_default(words, module):
    parser = _parser(words, module)
    assert len(_shown(parser)) >= 2
    for action in _shown(parser):
        name = "/".join(action.option_strings) or action.dest
        assert action.help and action.help.strip(), f"spanllm {words} {name}: no help text"
        text = _help_text(parser, action)
        defaults = re.findall(r"\bdefault", text, re.IGNORECASE)
        assert len(defaults) <= 1, f"spanllm {words} {name}: the default said {len(defaults)} times: {text!r}"
        assert "(default: None)" not in text and "(default: False)" not in text, f"{words} {name}: {text!r}"
        informative = action.default not in (None, False, "", [], argparse.SUPPRESS)
        if informative and action.option_strings:
            assert len(defaults) == 1, f"spanllm {words} {name}: default {action.default!r} not shown: {text!r}"


@pytest.mark.parametrize("words,module", [(w, m) for w, m, _ in cli.COMMANDS], ids=[w for w, _, _ in cli.COMMANDS])
def test_pg_timeout_offered_only_with_collectives(words, module):
    parser = _parser(words, module)
    action = parser._option_string_actions["--pg-timeout"]  # parsed everywhere, so it can be refused by name
    assert (action.help != argparse.SUPPRESS) == (words in WITH_COLLECTIVES)
    assert cli.uses_collectives(importlib.import_module(module)) == (words in WITH_COLLECTIVES)


@pytest.mark.parametrize("words,module", [(w, m) for w, m, _ in cli.COMMANDS], ids=[w for w, _, _ in cli.COMMANDS])
def test_tp_has_vllm_aliases(words, module):
    actions = _parser(words, module)._option_string_actions
    if "--tp" not in actions:
        assert "-tp" not in actions and "--tensor-parallel-size" not in actions
        return
    assert actions["-tp"] is actions["--tp"] is actions["--tensor-parallel-size"]


def test_tp_aliases_parse_alike():
    parser = _parser("serve", "spanllm.commands.serve")
    for flag in ("--tp", "--tensor-parallel-size", "-tp"):
        assert parser.parse_args(["tiny", flag, "4"]).tp == 4


def test_commands_with_tp():
    """The aliases are checked on the commands that have a tensor-parallel degree (a test that cannot skip)."""
    have = {w for w, m, _ in cli.COMMANDS if "--tp" in _parser(w, m)._option_string_actions}
    assert have == {"generate", "serve", "bench batch", "bench throughput", "bench gemm"}


def test_help_formatter_rule():
    p = argparse.ArgumentParser(formatter_class=cli.HelpFormatter)
    p.add_argument("--a", type=int, default=3, help="plain")
    p.add_argument("--b", default=None, help="nothing to add")
    p.add_argument("--c", type=int, default=None, help="its own words (default: the world size)")
    p.add_argument("--d", default="x", help="already says it; default: x")
    p.add_argument("--e", action="store_true", help="a switch")
    p.add_argument("--f", action=argparse.BooleanOptionalAction, default=True, help="on or off")
    p.add_argument("--g", action=argparse.BooleanOptionalAction, default=True, help="on (the default) or off")
    got = {a.dest: _help_text(p, a) for a in p._actions if a.dest != "help"}
    assert got == {
        "a": "plain (default: 3)",
        "b": "nothing to add",
        "c": "its own words (default: the world size)",
        "d": "already says it; default: x",
        "e": "a switch",
        "f": "on or off (default: True)",
        "g": "on (the default) or off",
    }


@pytest.mark.parametrize("words", ["serve", "bench throughput", "bench serve", "plan"])
def test_help_prints_once_per_default(words, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([*words.split(), "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: spanllm {words} ")
    assert "(default: None)" not in out and "(default: False)" not in out


def test_top_level_help_names_the_commands_that_take_pg_timeout():
    """`spanllm -h` lists them without importing every command: the list must agree with USES_COLLECTIVES."""
    text = " ".join(cli.GLOBAL_OPTIONS.split("--pg-timeout S", 1)[1].split(":", 1)[0].split())
    named = set()
    for part in text.removeprefix("commands that start ranks (").removesuffix(")").split(", "):
        first, *rest = part.split(" / ")
        group = first.split()[0] if len(first.split()) == 2 else None
        named.add(first)
        named.update(f"{group} {r}" for r in rest)
    assert named == WITH_COLLECTIVES
