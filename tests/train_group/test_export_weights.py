"""The weight export gives the driver a reference it never fetches (gigabytes a step for a real model): the driver
waits on the export's small success return alone, and a failed export still raises there. What the reference holds
is what an engine loads."""

import pytest
import ray
from transformers import AutoModelForCausalLM

from rlfw.model.hf_convert import hf_config
from rlfw.rollout.manager import padded_vocab_size
from rlfw.rollout.tasks import CopyTask
from rlfw.train_group.worker import model_shape


@pytest.mark.parametrize("dp", [("dp=classic", "dp.size=1"), ("dp=cells", "dp.num_cells=2")])
def test_the_driver_never_fetches_the_exported_weights(make_group, monkeypatch, dp):
    group, cfg = make_group(*dp)
    fetched = []
    real_get = ray.get

    def spying_get(refs, *args, **kwargs):
        fetched.extend(refs if isinstance(refs, list) else [refs])
        return real_get(refs, *args, **kwargs)

    monkeypatch.setattr(ray, "get", spying_get)
    weights = group.export_weights()
    monkeypatch.undo()
    assert isinstance(weights, ray.ObjectRef)
    assert weights.hex() not in {ref.hex() for ref in fetched if isinstance(ref, ray.ObjectRef)}
    state = ray.get(weights, timeout=120)
    vocab_size = padded_vocab_size(len(CopyTask().tokenizer), cfg.dp.tp)
    engine_model = AutoModelForCausalLM.from_config(hf_config(model_shape(cfg, vocab_size)))
    engine_model.load_state_dict(state, strict=True)  # what an engine loads: every weight, HF names
