import pytest
import torch

from eyas.errors import EyasError
from eyas.models.tensor_file import save_tensors


def test_saves_and_reads_back(tmp_path):
    from safetensors.torch import load_file

    save_tensors({"a": torch.arange(6.0).view(2, 3)}, tmp_path / "x.safetensors", metadata={"format": "pt"})
    assert torch.equal(load_file(str(tmp_path / "x.safetensors"))["a"], torch.arange(6.0).view(2, 3))


def test_a_failed_write_is_an_eyas_error_naming_the_file_and_the_reason(tmp_path):
    path = tmp_path / "gone" / "x.safetensors"
    with pytest.raises(EyasError, match=r"could not write .*gone/x\.safetensors: I/O error: No such file"):
        save_tensors({"a": torch.zeros(3)}, path)
