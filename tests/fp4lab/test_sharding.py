"""What quantization adds to a sharded GEMM's communication: the collectives XLA compiles for
``qdot_general``'s forward and backward on an 8-device mesh (data 4 x model 2), against the
same program in BF16. Blocks that lie whole on one device move no data; a per-tensor amax
(NVFP4's FP32 scale, FP8 current scaling) is one scalar all-reduce per sharded operand; a
block axis cut inside a block makes XLA move data (docs/sharding.md)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hlo import collectives, moving, scalar
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from fp4lab.gemm.qdot import qdot_general
from fp4lab import GemmState

DIMS = (((1,), (0,)), ((), ()))


def compiled(recipe, k, x_spec, w_spec):
    """The collectives of one GEMM's forward and backward, ``x [512, k] @ w [k, 256]``: each
    device holds 128 rows of x and of dy (the wgrad GEMM's reduction axis) and 128 columns
    of w, whole blocks of every recipe (DeepSeek's 128 x 128 included)."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    x = jax.ShapeDtypeStruct((512, k), jnp.bfloat16, sharding=NamedSharding(mesh, x_spec))
    w = jax.ShapeDtypeStruct((k, 256), jnp.bfloat16, sharding=NamedSharding(mesh, w_spec))

    def loss(x, w):
        y = qdot_general(x, w, DIMS, recipe, GemmState(key=jax.random.key(0)))
        return jnp.sum(jnp.square(y.astype(jnp.float32)))

    return collectives(jax.jit(jax.grad(loss, (0, 1))).lower(x, w).compile().as_text())


# (x's spec, w's spec, K): the reduction axis K unsharded, then split in whole blocks
WHOLE_BLOCKS = {"K unsharded": (P("data", None), P(None, "model"), 256),
                "K split, 128 a device": (P("data", "model"), P("model", None), 256)}


@pytest.mark.parametrize("layout", WHOLE_BLOCKS)
def test_whole_blocks_on_each_device_move_no_data(layout):
    x_spec, w_spec, k = WHOLE_BLOCKS[layout]
    base = compiled("bf16", k, x_spec, w_spec)
    assert scalar(base) == {} and moving(base)["all-reduce"] >= 1  # the wgrad's sum
    for recipe in ("mxfp8", "mxfp4", "fp8_blockwise"):  # no per-tensor scale: nothing added
        assert compiled(recipe, k, x_spec, w_spec) == base, recipe
    for recipe in ("nvfp4", "fp8_hybrid"):  # a per-tensor amax: scalar all-reduces only
        got = compiled(recipe, k, x_spec, w_spec)
        assert moving(got) == moving(base), recipe
        assert set(scalar(got)) == {"all-reduce"}, recipe


def test_a_block_cut_between_devices_moves_data():
    """K = 48 split over 2 devices: 24 values a device, not a whole number of NVFP4's 16 or
    MXFP8's 32 (padded to 64): XLA gathers or permutes the operands to form the blocks."""
    layout = (P("data", "model"), P("model", None), 48)
    base = moving(compiled("bf16", *layout[2:], *layout[:2]))
    for recipe in ("nvfp4", "mxfp8"):
        got = moving(compiled(recipe, *layout[2:], *layout[:2]))
        assert got != base and sum(got.values()) > sum(base.values()), (recipe, got, base)


def test_an_operand_the_gemm_gathers_is_gathered_at_most_once_more():
    """x's reduction axis sharded where w's is not: the GEMM gathers x (FSDP gathers weights
    the same way). A recipe quantizes x along K for the forward and along the tokens for the
    wgrad GEMM, two copies, each gathered where BF16 may keep one gathered x for both: at most
    one all-gather more, nothing else (docs/sharding.md)."""
    layout = (256, P("data", "model"), P(None, "model"))
    base = moving(compiled("bf16", *layout))
    assert base["all-gather"] >= 1
    for recipe in ("mxfp8", "nvfp4"):
        got = moving(compiled(recipe, *layout))
        assert (got - base)["all-gather"] <= 1 and set(got - base) <= {"all-gather"}
        assert base - got == {}, (recipe, got, base)
