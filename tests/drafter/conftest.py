"""Fixtures shared by the drafter tests."""

import pytest
import torch

from moa_serve.model.target import TargetModel
from moa_serve.model_files import load_state_dict, read_config


@pytest.fixture(scope="module")
def target(stories_path):
    return TargetModel.from_state_dict(read_config(stories_path), load_state_dict(stories_path), torch.float32)
