"""One seed for every random number generator a run touches (Python, numpy, torch), set before the model loads."""

from __future__ import annotations

import random


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
