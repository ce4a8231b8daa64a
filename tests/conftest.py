"""Suite-wide test settings.

The tiny presets are dominated by per-op overhead: intra-op threads only add contention on
CI's 2 cores (measured: tiny convolutions ran ~20x slower with the default thread count while
other work shared the cores). Tests that compare outputs bit for bit always do so within one
process, so the thread count is the same on both sides.
"""

import torch

torch.set_num_threads(1)
