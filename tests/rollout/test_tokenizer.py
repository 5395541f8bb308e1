"""The built-in tasks' word-level tokenizer: what it encodes and decodes, the same as transformers' tokenizer loaded
from its saved directory (what vLLM and an exported checkpoint's users load), and a process of the built-in tasks
that never imports transformers."""

import subprocess
import sys

import numpy as np
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from rlfw.model.hf_checkpoint import load_tokenizer
from rlfw.rollout.envs.calc import CALL, DIGITS, ERROR, RESULT
from rlfw.rollout.tasks import CopyTask
from rlfw.rollout.tokenizer import build_tokenizer


def test_round_trip():
    tokenizer = build_tokenizer(["a", "b", "c"])
    text = "<bos> c a b = a"
    ids = tokenizer.encode(text)
    assert ids == [1, 6, 4, 5, 3, 4] and len(tokenizer) == 7
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode([*ids, 2], skip_special_tokens=True) == "c a b = a"
    assert tokenizer.convert_tokens_to_ids(["c", "zz"]) == [6, None] and tokenizer.convert_tokens_to_ids("a") == 4
    assert tokenizer.convert_ids_to_tokens([0, 6, 99]) == ["<pad>", "c", None]
    with pytest.raises(Exception):  # no unknown token: a word outside the vocabulary is a bug
        tokenizer.encode("<bos> d")


def test_clashing_symbols_are_refused():
    with pytest.raises(ValueError, match="distinct"):
        build_tokenizer(["a", "="])
    with pytest.raises(ValueError, match="whitespace"):
        build_tokenizer(["a b"])


@pytest.mark.parametrize("tokenizer", [CopyTask(num_symbols=12).tokenizer, build_tokenizer([*DIGITS, CALL, RESULT, ERROR])],
                         ids=["copy", "calc"])
@pytest.mark.parametrize("load", [AutoTokenizer.from_pretrained, PreTrainedTokenizerFast.from_pretrained,
                                  load_tokenizer], ids=["auto", "fast", "rlfw"])
def test_the_saved_directory_loads_as_the_same_tokenizer(tmp_path, tokenizer, load):
    tokenizer.save_pretrained(tmp_path)
    loaded = load(tmp_path)
    assert len(loaded) == len(tokenizer)
    for name in ("pad", "bos", "eos"):
        assert getattr(loaded, f"{name}_token") == getattr(tokenizer, f"{name}_token")
        assert getattr(loaded, f"{name}_token_id") == getattr(tokenizer, f"{name}_token_id")
    words = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    assert loaded.convert_ids_to_tokens(list(range(len(tokenizer)))) == words
    assert loaded.convert_tokens_to_ids(words) == tokenizer.convert_tokens_to_ids(words)
    rng = np.random.default_rng(0)
    for _ in range(50):
        ids = rng.integers(0, len(tokenizer), size=int(rng.integers(1, 20))).tolist()
        for skip in (False, True):
            assert loaded.decode(ids, skip_special_tokens=skip) == tokenizer.decode(ids, skip_special_tokens=skip)
        text = tokenizer.decode(ids)
        assert loaded(text, add_special_tokens=False)["input_ids"] == tokenizer.encode(text) == ids


def test_the_built_in_tasks_never_import_transformers():
    """The driver and the rollout manager of a built-in task run without transformers (two CPU-seconds a process,
    on the path to the first step); only an engine imports it."""
    code = ("import sys, numpy as np; import rlfw.rollout.manager, rlfw.train; "
            "from rlfw.rollout.tasks import CopyTask; import rlfw.rollout.envs.calc; "
            "task = CopyTask(); task.sample_prompts(4, 0, np.random.default_rng(0)); task.tokenizer.decode([1]); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]"
