import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
# The CI box has 2 cores shared with other jobs: one intra-op thread avoids oversubscription.
torch.set_num_threads(1)
