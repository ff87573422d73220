"""Gradient rules: ops whose outputs carry no gradient.

Their outputs are discrete (shapes, indices, booleans, integers), piecewise
constant in their inputs (Floor, Round, Sign), random draws, or constants.
The engine treats their outputs as constants: no gradient flows through them
into their inputs.  Registering an op here is a statement about the op's math,
never a fallback for an op without a rule: an unregistered op stays an error.
"""

from __future__ import annotations

from ..registry import no_grad

# Shapes and sizes: integer outputs.
no_grad("Shape", "Size")

# Comparisons and logic: boolean outputs.
no_grad("Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual")
no_grad("Not", "And", "Or", "Xor", "IsNaN", "IsInf")

# Index-valued outputs.
no_grad("ArgMax", "ArgMin", "NonZero", "OneHot")

# Piecewise constant: the derivative is 0 almost everywhere.
no_grad("Floor", "Ceil", "Round", "Sign")

# Random draws: the samples do not depend differentiably on their inputs
# (the *Like variants read only the shape and type of their input).
no_grad("RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike")
no_grad("Bernoulli", "Multinomial")

# Constants and index generators.
no_grad("ConstantOfShape", "Constant", "EyeLike", "Range")

# Integer bit manipulation.
no_grad("BitShift", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "BitwiseNot")
