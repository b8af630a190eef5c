"""Short loss-regression runs against recorded values (tests/assets/losses_*.json): per-step losses and
gradient norms (before clipping; every step is clipped here, so the losses alone would not see a change in
the gradient's scale).

They catch silent changes to initialisation, data order, the LR schedule, the loss or its scaling. The
recorded values come from this suite's own single-process run; other CPUs' BLAS may differ in the last bits,
hence 1e-3 (absolute on losses, relative on gradient norms). Re-recorded when initial weights became a
function of (seed, parameter name) (megatron_lite/model/init.py). To re-record after an intended change, rerun the config
below and replace both lists in the JSON file. They train on the real corpus and its 8192-token vocabulary
(data order is part of what they guard), where the other trajectory tests fold it (tests/distributed/common.py).
"""

import json
import os

import pytest

from tests.distributed.common import max_abs_diff, max_relative_diff, real_corpus_overrides
from tests.distributed.launcher import ROOT, run_configs


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
def test_losses_match_recorded_values(preset, tmp_path):
    with open(os.path.join(ROOT, "tests", "assets", f"losses_{preset}.json")) as f:
        recorded = json.load(f)
    (result,) = run_configs(1, [real_corpus_overrides(tmp_path, preset, f"model={preset}")], tmp_path)
    gap = max_abs_diff(result["losses"], recorded["losses"])
    assert gap <= 1e-3, f"{preset}: losses moved by {gap:.2e} from the recorded run: {result['losses']}"
    norms = max_relative_diff(result["grad_norms"], recorded["grad_norms"])
    assert norms <= 1e-3, (
        f"{preset}: grad norms moved by {norms:.2e} (relative) from the recorded run: {result['grad_norms']}"
    )
