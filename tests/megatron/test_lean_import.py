"""rlfw.megatron imports megatron-core without TorchDynamo, Inductor or W&B, and what it defers still works."""

import subprocess
import sys

import torch

from rlfw.megatron.lean_import import deferred_compile, lean_import


def run_python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_importing_rlfw_megatron_leaves_out_the_compiler_and_wandb_and_gives_wandb_back():
    out = run_python(
        "import sys, rlfw.megatron.policy, rlfw.megatron.model\n"
        "from megatron.core.models.gpt import GPTModel\n"
        "from megatron.core.optimizer import get_megatron_optimizer\n"
        "print(sorted(m for m in ('torch._dynamo', 'torch._inductor.compile_fx', 'wandb') if m in sys.modules))\n"
        "import torch, megatron.core.jit as jit\n"
        "print(jit.jit_fuser is torch.compile, torch.compile.__module__)\n"
        "import wandb\n"
        "print(wandb.__name__)\n"
    )
    assert out.splitlines() == ["[]", "False torch", "wandb"]


def test_a_deferred_compile_compiles_at_the_first_call_with_the_decorators_arguments():
    torch._dynamo.reset()
    calls = []

    def backend(graph, example_inputs):  # a backend that records what it was given and runs the graph as it is
        calls.append(len(example_inputs))
        return graph.forward

    with lean_import():
        @torch.compile(backend=backend, fullgraph=True)
        def scaled(x):
            return x * 2 + 1

    assert calls == []  # nothing compiled at decoration
    x = torch.arange(4.0)
    assert torch.equal(scaled(x), x * 2 + 1) and calls == [1]
    assert torch.equal(scaled(x), x * 2 + 1) and calls == [1]  # compiled once
    assert scaled.__name__ == "scaled"


def test_the_import_block_undoes_itself_even_when_the_import_fails():
    real = torch.compile
    try:
        with lean_import():
            assert torch.compile is not real
            raise ImportError("a module under the block failed")
    except ImportError:
        pass
    assert torch.compile is real
    assert sys.modules.get("wandb", "absent") is not None


def test_compile_as_a_function_call_is_deferred_too():
    compiled = deferred_compile(lambda fn, **kw: (lambda *a: ("compiled", kw, fn(*a))))(lambda v: v + 1, mode="x")
    assert compiled(1) == ("compiled", {"mode": "x"}, 2)


def test_a_cpu_trainers_attention_never_loads_the_compiler():
    """The packed-attention path asks whether flash varlen can run before each call: on the CPU (any dtype) the answer
    must come without importing the kernel's module, which imports TorchDynamo (over a second of every trainer's
    start)."""
    out = run_python(
        "import sys, torch\n"
        "from rlfw.megatron.attention import varlen_usable\n"
        "print([varlen_usable(torch.zeros(4, 2, 8, dtype=d), 0.0) for d in (torch.float32, torch.bfloat16)])\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    assert out.splitlines() == ["[False, False]", "False"]
