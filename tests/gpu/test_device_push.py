"""The same-GPU weight push (``rollout.weight_transport=device``): a writer in another process packs its weights and
shares one CUDA IPC handle; the local engine opens it and holds the writer's weights bitwise, version after version;
once the writer's process is gone, an engine that opens its last handle says why it cannot, naming the key."""

import multiprocessing as mp

import pytest
import torch

from rlfw.model.shape import ModelShape
from rlfw.rollout.engines import LocalEngine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC: run on the device")

SHAPE = ModelShape(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                   vocab_size=16, max_seq_len=64)


def _writer(names_shapes, handles, loaded) -> None:
    """Another process on the GPU: three versions of random bf16 weights, each packed and shared once; the bytes
    of each version go along (as CPU tensors) for the engine to compare."""
    from rlfw.model.device_weights import pack

    torch.cuda.set_device(0)
    for version in range(3):
        g = torch.Generator(device="cuda").manual_seed(version)
        state = {name: torch.randn(shape, generator=g, device="cuda").to(torch.bfloat16)
                 for name, shape in names_shapes}
        packed = pack(state)
        torch.cuda.synchronize()
        handles.put((version, packed.share(), {k: v.cpu() for k, v in state.items()}))
        loaded.get(timeout=120)  # the engine holds them: the buffer may go at the next pack


def test_an_engine_loads_the_writers_weights_from_its_gpu_buffer_and_names_the_key_once_the_writer_is_gone():
    engine = LocalEngine(SHAPE, eos_token_id=2, pad_token_id=0, seed=0, device="cuda")
    names_shapes = [(k, tuple(v.shape)) for k, v in engine.model.state_dict().items()]
    ctx = mp.get_context("spawn")
    handles, loaded = ctx.Queue(), ctx.Queue()
    writer = ctx.Process(target=_writer, args=(names_shapes, handles, loaded))
    writer.start()
    for _ in range(3):
        version, shared, expected = handles.get(timeout=300)
        engine.update_weights(shared, version)
        assert engine.weight_version == version
        for name, tensor in engine.model.state_dict().items():  # the engine's bf16 model: bitwise the writer's
            assert torch.equal(tensor.cpu(), expected[name].to(tensor.dtype)), name
        loaded.put(True)
    writer.join(60)
    assert writer.exitcode == 0
    with pytest.raises(RuntimeError, match="rollout.weight_transport=host"):
        LocalEngine(SHAPE, eos_token_id=2, pad_token_id=0, seed=0, device="cuda").update_weights(shared, 9)
