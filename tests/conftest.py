import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
# one thread: the test models are tiny, and on a shared machine extra threads spin and slow everything down
torch.set_num_threads(1)
