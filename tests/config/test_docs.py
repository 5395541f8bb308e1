"""Every command the docs show works: each ``python -m rlfw.train ...`` and ``make run ARGS="..."`` in a code block
of README.md, BENCHMARKS.md and docs/*.md is composed with Hydra's compose API and validated, so a renamed key,
group or option, or a value the rules refuse, fails here instead of in a reader's terminal. (Commands naming the
reader's own files, such as ``model.hf_path=/models/...``, are composed only.)"""

import itertools
import re
import shlex
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from rlfw.config import register_configs, validate

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
register_configs()


def code_lines(text: str):
    """Lines of indented and fenced code blocks, with backslash continuations joined."""
    fenced, lines, pending = False, [], ""
    for line in text.splitlines():
        if line.strip().startswith("```"):
            fenced = not fenced
            continue
        if not (fenced or line.startswith("    ")):
            continue
        pending += line.strip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        lines.append(pending)
        pending = ""
    return lines


def commands():
    """(doc, line, overrides) of every train command in a code block."""
    for doc in DOCS:
        for line in code_lines(doc.read_text()):
            line = line.split("  #", 1)[0].split(" # ", 1)[0]
            make = re.search(r'make run ARGS="([^"]*)"', line)
            if make:
                yield doc.name, line, shlex.split(make.group(1)), False
            elif "-m rlfw.train" in line:
                words = shlex.split(line.split("-m rlfw.train", 1)[1])
                multirun = "-m" in words or "--multirun" in words
                yield doc.name, line, [w for w in words if w not in ("-m", "--multirun")], multirun


LIST_COMMA = re.compile(r",(?![^\[]*\])")  # a comma outside brackets separates sweep values


def expand(overrides, multirun):
    """A multirun line is one composition per combination of its comma lists."""
    if not multirun:
        return [overrides]
    choices = []
    for override in overrides:
        key, values = override.split("=", 1)
        choices.append([f"{key}={value}" for value in LIST_COMMA.split(values)])
    return [list(combination) for combination in itertools.product(*choices)]


COMMANDS = list(commands())


def test_the_docs_show_commands():
    assert len(COMMANDS) >= 25 and {doc for doc, *_ in COMMANDS} >= {"README.md", "ARCHITECTURE.md"}


# Keys whose values name the reader's own files or servers: such a command composes, but is not validated here.
READERS_FILES = ("model.hf_path=", "task.tokenizer_path=", "task.data_path=", "resume=outputs", "rollout.sglang.urls=")


@pytest.mark.parametrize("doc,line,overrides,multirun", COMMANDS, ids=[f"{c[0]}:{c[1][:60]}" for c in COMMANDS])
def test_documented_command_composes_and_validates(doc, line, overrides, multirun):
    user = [o for o in overrides if not o.startswith(("hydra/", "hydra.", "..."))]  # Hydra's own options, elisions
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        for combination in expand(user, multirun):
            cfg = compose(config_name="config", overrides=combination)
            if not any(o.startswith(READERS_FILES) for o in combination):
                validate(cfg)
