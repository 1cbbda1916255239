"""The one-line refusal of a job whose model states cannot fit on its GPUs, on a real 8B config."""

from __future__ import annotations

import pytest

from jobgen.job.models import Training
from jobgen.errors import UserError
from jobgen.train.memory import check_fits, count_parameters

H100_BYTES = 80 * 2**30  # an H100 80GB shows about this much to torch


@pytest.fixture(scope="module")
def llama3_8b(tmp_path_factory):
    """Llama-3-8B's config (no weights): the shape the parameter count is read from."""
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("llama3-8b")
    LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
    ).save_pretrained(folder)
    return str(folder)


def _training(model: str, **fields) -> Training:
    return Training(model=model, data="data.json", **fields)


def test_parameters_are_counted_from_the_config_without_weights(llama3_8b):
    assert count_parameters(llama3_8b) == 8_030_261_248  # Meta-Llama-3-8B's published count


def test_a_full_fine_tune_of_8b_on_one_gpu_is_refused_naming_the_fixes(llama3_8b):
    with pytest.raises(UserError) as refused:
        check_fits(_training(llama3_8b, method="full"), "bf16", 1, H100_BYTES, count_parameters(llama3_8b))
    message = str(refused.value)
    assert message.startswith("training.model: a full fine-tune of")
    assert "(8.03B parameters) needs about 128 GB per GPU" in message and "this GPU has 86 GB" in message
    assert "more GPUs" in message and "training.zero_stage: 3" in message and "training.method: lora" in message
    assert "\n" not in message


@pytest.mark.parametrize(
    "fields, world_size, expected_gb",
    [
        ({"method": "full"}, 8, 30),  # 16 GB of bf16 weights + (2 + 12) bytes x 8B / 8 ranks
        ({"method": "full", "zero_stage": 3}, 8, 16),
        ({"method": "lora"}, 1, 16),
        ({"method": "qlora"}, 1, 4.5),
    ],
)
def test_what_fits_an_h100_passes_with_its_estimate(llama3_8b, fields, world_size, expected_gb):
    found = check_fits(_training(llama3_8b, **fields), "bf16", world_size, H100_BYTES, count_parameters(llama3_8b))
    assert found.bytes_per_rank / 1e9 == pytest.approx(expected_gb, rel=0.03)
