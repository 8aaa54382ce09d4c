"""One intra-op thread: the tensors here are tiny and the machine is shared."""

import torch

torch.set_num_threads(1)
