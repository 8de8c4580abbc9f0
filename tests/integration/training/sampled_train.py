"""lmsys.train on data opened as if too large to check in full: the integrity limits
(lmsys.data.integrity) lowered to nothing and the sample to two blocks of 64 ids per shard, so a
test corpus stands for one of gigabytes. Every process of a launch runs it:
`launch.torchrun --module tests.integration.training.sampled_train`."""

from __future__ import annotations

import sys

from lmsys.data import integrity
from lmsys.train import main

integrity.FULL_CHECK_BYTES = 0
integrity.ID_CHECK_BYTES = 0
integrity.SAMPLE_BYTES = 0
integrity.BLOCK_TOKENS = 64

if __name__ == "__main__":
    sys.exit(main())
