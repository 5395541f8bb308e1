import pytest
import torch
import torch.distributed as dist


@pytest.fixture(scope="session")
def megatron_world():
    """A one-rank Megatron world on CPU (Gloo, store on loopback), set up once per test process."""
    torch.set_num_threads(1)
    from rlfw.megatron.cpu_compat import apply_cpu_compat

    apply_cpu_compat()
    from megatron.core import parallel_state, tensor_parallel

    from rlfw.cluster.store import serve_store

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=serve_store("127.0.0.1"), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1, inference_rng_tracker=True)
