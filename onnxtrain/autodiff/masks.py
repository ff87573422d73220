"""Apply an activation's gradient mask before a pooling gradient spreads it.

For ``r = Relu(x)`` read only by ``(y, i) = MaxPool(r)``, the rules give

    dr = place(dy at i)              (MaxUnpool [+ Reshape], or zeros + ScatterElements-add)
    dx = Where(r > 0, dr, 0)

on x's full size.  Every value ``place`` writes lands where ``r`` equals the
``y`` it came from (``r.flat[i[o]] = y[o]``), and it writes zeros elsewhere,
so masking first gives the same tensor, bit for bit:

    dx = place(Where(y > 0, dy, 0) at i)

(a scattered sum is masked whole or not at all, since every term of it comes
from a window whose maximum is that same element of r).  The mask then runs
on the pooled tensor: a quarter of the elements for 2x2 pooling, and the
Greater over r is gone.  ``fold_masks`` rewrites that pattern in a graph's
nodes, in place; anything else is left alone.
"""

from __future__ import annotations

import onnx

from ..core.graph import constant_values, is_zero
from ..core.names import NameGen


def _zero_fill(node: onnx.NodeProto) -> bool:
    """A ConstantOfShape that fills with zero (its default)."""
    for a in node.attribute:
        if a.name == "value":
            arr = onnx.numpy_helper.to_array(a.t)
            return arr.size == 1 and float(arr.reshape(-1)[0]) == 0.0
    return True


def fold_masks(nodes: list[onnx.NodeProto], graph: onnx.GraphProto, names: NameGen) -> int:
    """Rewrite ``Where(Greater(r, 0), place(dy), 0)`` as ``place(Where(Greater(y, 0), dy, 0))``
    among ``nodes`` (edited in place; their order is left to the caller's
    sort).  ``graph`` holds them too, with the initializers and outputs.
    Returns the number of rewrites."""
    producer = {o: n for n in nodes for o in n.output if o}
    readers: dict[str, int] = {}
    for n in nodes:
        for i in n.input:
            readers[i] = readers.get(i, 0) + 1
    for o in graph.output:
        readers[o.name] = readers.get(o.name, 0) + 1
    values = None
    done = 0
    for where in nodes:
        if where.op_type != "Where" or where.domain not in ("", "ai.onnx") or len(where.input) != 3:
            continue
        cond, dr, zero = where.input
        gt, placed = producer.get(cond), producer.get(dr)
        if gt is None or placed is None or gt.op_type != "Greater" or gt.domain not in ("", "ai.onnx"):
            continue
        r, zero_r = gt.input
        relu = producer.get(r)
        if relu is None or relu.op_type != "Relu" or readers.get(cond) != 1 or readers.get(dr) != 1:
            continue
        found = _placement(placed, producer, readers)
        if found is None:
            continue
        pool, dy_reader, dy_index = found
        if pool.op_type != "MaxPool" or pool.input[0] != r or len(pool.output) < 2:
            continue
        if values is None:
            values = constant_values(graph)
        if not (is_zero(values, zero, positive=True) and is_zero(values, zero_r)):
            continue
        dy = dy_reader.input[dy_index]
        masked = names.fresh(dy + "_masked")
        gt.input[0] = pool.output[0]
        where.input[1] = dy
        dx = where.output[0]
        where.output[0] = masked
        dy_reader.input[dy_index] = masked
        placed.output[0] = dx
        done += 1
    return done


def _placement(placed: onnx.NodeProto, producer: dict, readers: dict):
    """(MaxPool node, the node reading dy, dy's input index) when ``placed``
    puts the pooled gradient at the pool's Indices with nothing else added."""
    if placed.op_type == "MaxUnpool" and len(placed.input) >= 2:
        pool = producer.get(placed.input[1])
        if pool is not None and pool.op_type == "MaxPool" and placed.input[1] == pool.output[1]:
            return pool, placed, 0
        return None
    if placed.op_type != "Reshape":
        return None
    inner = producer.get(placed.input[0])
    if inner is not None and inner.op_type == "MaxUnpool" and readers.get(placed.input[0]) == 1:
        return _placement(inner, producer, readers)  # (a Reshape that keeps the static shape known)
    scatter = inner  # zeros + ScatterElements-add, then Reshape back to r's shape
    if (scatter is None or scatter.op_type != "ScatterElements" or readers.get(placed.input[0]) != 1
            or len(scatter.input) != 3):
        return None
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in scatter.attribute}
    if attrs.get("reduction", b"none") != b"add" or attrs.get("axis", 0) != 0:
        return None
    zeros, flat_i, flat_dy = (producer.get(n) for n in scatter.input)
    if zeros is None or zeros.op_type != "ConstantOfShape" or not _zero_fill(zeros):
        return None
    if flat_i is None or flat_dy is None or flat_i.op_type != "Reshape" or flat_dy.op_type != "Reshape":
        return None
    if readers.get(scatter.input[2]) != 1:
        return None
    pool = producer.get(flat_i.input[0])
    if pool is None or pool.op_type != "MaxPool" or flat_i.input[0] != pool.output[1]:
        return None
    return pool, flat_dy, 0
