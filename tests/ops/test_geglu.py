from __future__ import annotations

import pytest

from muser.ops import ref
from muser.ops.triton import geglu

from opcheck import DTYPES, check, rand


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,i", [(1, 96), (9, 1500)])
def test_geglu(gen, dtype, n, i):
    gate_up = rand(gen, n, 2 * i, dtype=dtype, scale=2.0)
    check(geglu(gate_up), ref.geglu(gate_up.double()), dtype, scale=4.0)
