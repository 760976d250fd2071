"""Recipe refusals: each feature says what it cannot be combined with (its ``refusal``)."""

import dataclasses

import pytest

from fp4lab.features.delayed import DelayedScaling
from fp4lab.features.outcontrol import OutControl
from fp4lab.gemm.recipe import RECIPES, OperandQuant, SavedX, get_recipe


def _with(name, **kw):
    return dataclasses.replace(get_recipe(name), name="probe", **kw)


@pytest.mark.parametrize("base, change, error", [
    ("quartet", dict(delayed=DelayedScaling()), "hadamard_signs='random' is not supported"),
    ("tetrajet_v2", dict(hadamard_signs="te", delayed=DelayedScaling()),
     "requantizing the forward's operands and the trust mask are not supported"),
    ("nvfp4", dict(delayed=DelayedScaling()), "needs a per-tensor operand format"),
    ("tetrajet_v2", dict(saved_x=SavedX()), "saved_x stores the input X"),
    ("quartet", dict(outliers=OutControl()), "OutControl splits the forward's K"),
    ("nvfp4", dict(outliers=OutControl()), "OutControl splits the forward's K"),
    ("fp4_qat", dict(trust=True), "a QAT backward"),
    ("nvfp4", dict(fprop_x=OperandQuant(format="nvfp4", hadamard=16),
                   fprop_w=OperandQuant(format="nvfp4", hadamard=16, tile=(16, 16))),
     "a 2D weight tile"),
    ("nvfp4", dict(wgrad_dy=OperandQuant(format="nvfp4", source="forward")),
     "only dgrad_w and wgrad_x can requantize"),
    ("nvfp4", dict(wgrad_dy=OperandQuant(format="nvfp4")), "has to cancel in the wgrad GEMM"),
    ("nvfp4", dict(wgrad_x=OperandQuant(format="nvfp4", hadamard=32),
                   wgrad_dy=OperandQuant(format="nvfp4", hadamard=32)),
     "wgrad_x has hadamard=32 with TE's sign vector"),
])
def test_each_refusal_names_the_recipe_and_its_reason(base, change, error):
    with pytest.raises(ValueError, match=f"recipe probe: .*{error}"):
        _with(base, **change)


def test_features_are_listed_and_the_published_recipes_pass_their_checks():
    r = get_recipe("tetrajet_v2_outcontrol")
    assert r.features == (r.outliers,)
    assert get_recipe("fp8_delayed").features == (get_recipe("fp8_delayed").delayed,)
    for recipe in RECIPES.values():
        assert all(f.refusal(recipe) is None for f in recipe.features)


def test_outcontrols_two_gemms_keep_the_recipes_backward_for_dgrad():
    r = get_recipe("tetrajet_v2_outcontrol")
    rest, outliers = r.outliers.recipes(r)
    assert rest.outliers is None and rest.dgrad_w == outliers.dgrad_w == r.dgrad_w
    assert {outliers.fprop_x.format.name, outliers.wgrad_dy.format.name} == {"mxfp8"}
    assert outliers.wgrad_x.source == "forward" and outliers.dgrad_dy == r.dgrad_dy
