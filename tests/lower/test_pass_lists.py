"""Every pass list (onnxtrain.lower.pipeline.PASS_LISTS, lower.executed.EXECUTED)
with its postconditions checked after every step (lower.checks): SSA,
topological order, the step's own postcondition and onnx.checker with strict
shape inference, over a representative set of models: builder models (plain,
BatchNormalization and Dropout, accumulation, clipping and a schedule,
recompute, LoRA), hand-written spec-op models (Adam, Momentum, Adagrad, SGD),
the exporter corpus, data-parallel cuts and lean memory's executed lists.

And that the checks catch what they are for: a step planted with each kind
of bug is named by ``PassError``.
"""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from models import inference_mlp, linear_regression, mlp_classifier
from onnx import helper

from onnxtrain import build
from onnxtrain.io.metadata import model_metadata
from onnxtrain.io.model import validate
from onnxtrain.lower import executed, pipeline
from onnxtrain.lower.checks import CHECK_ENV, PassError, checking
from onnxtrain.lower.executed import EXECUTED, ExecOptions, execute
from onnxtrain.lower.lowering import ALGORITHM, INFERENCE, Request
from onnxtrain.lower.programs import ProgramSet

DATA = Path(__file__).resolve().parents[1] / "data"

def exporter(stem: str) -> onnx.ModelProto:
    return onnx.load(str(DATA / "exporters" / f"{stem}.onnx"))


#: name -> a training model (made on use: the builder runs in the test).
MODELS = {
    "builder-adamw": lambda: build.training_model(inference_mlp(), optimizer=build.AdamW(lr=1e-2)),
    "builder-bn-dropout-accumulate": lambda: build.training_model(
        inference_mlp(batch_norm=True, dropout=True), optimizer=build.SGD(lr=0.1, momentum=0.9), accumulate=3),
    "builder-clip-schedule": lambda: build.training_model(
        inference_mlp(), loss="mse", optimizer=build.Adagrad(lr=0.1), clip_grad_norm=0.5,
        schedule=build.cosine(100)),
    "builder-recompute": lambda: build.training_model(
        inference_mlp(), optimizer=build.Adam(lr=1e-2), recompute="blocks"),
    "spec-adam": lambda: mlp_classifier("adam"),
    "spec-momentum": lambda: mlp_classifier("nesterov", groups=[["W1", "b1"], ["W2", "b2"]]),
    "spec-adagrad": lambda: linear_regression("adagrad"),
    "spec-sgd": lambda: linear_regression("sgd"),
    "exporter-resnet": lambda: build.training_model(exporter("resnet_tiny__dynamo"), loss="cross_entropy"),
    "exporter-gpt2": lambda: build.training_model(exporter("gpt2_lm__dynamo"), loss="cross_entropy"),
    "exporter-skl2onnx": lambda: build.training_model(exporter("logreg_digits__skl2onnx")),
    "exporter-llama-lora": lambda: build.training_model(
        onnx.load(str(DATA / "llm" / "llama__dynamo.onnx")), loss="cross_entropy",
        optimizer=build.AdamW(lr=1e-3), lora=build.LoRA(rank=4)),
}


def all_programs(progs: ProgramSet) -> list:
    """Every program of the set, the lazily built ones included."""
    out = [progs.inference, *progs.algorithms, *[p for p in progs.initializations if p is not None]]
    for split in progs.splits:
        out += [split.a] + ([split.b] if split.b is not None else [])
    for index, program in enumerate(progs.algorithms):
        loss = program.returned[0]
        out.append(progs.loss(index, loss))
    return out


#: What ran, per case (model, data-parallel): the kinds whose pass lists and the
#: roles whose executed lists ran.  The last test completes it with the cases
#: this process has not run (xdist may have given them to another worker).
SEEN: dict[tuple[str, bool], dict[str, set[str]]] = {}

CASES = [(name, dp) for name in MODELS for dp in (False, True)]


def run_case(name: str, data_parallel: bool) -> dict[str, set[str]]:
    seen: dict[str, set[str]] = {"lists": set(), "executed": set(), "fused": set(), "decoder": set(),
                                 "scratch": set()}
    tm = validate(MODELS[name]())
    progs = ProgramSet(tm, model_metadata(tm.proto), data_parallel=data_parallel, check=True)
    for program in all_programs(progs):
        role = progs.role(program)
        seen["lists"].add(role)
        for lean in (False, True):
            for fused in (None, False):
                ex = execute(program, role, ExecOptions(fused, lean=lean), check=True)
                seen["executed"].add(role)
                if ex.library is not None:
                    seen["fused"].add(role)
                if any(n.op_type == "RmsNormF32" for n in ex.model.graph.node):
                    seen["decoder"].add(role)
                if ex.scratch:
                    seen["scratch"].add(role)
                if lean and EXECUTED[role][-1:] == (executed.inplace_plan,):
                    assert ex.inplace <= set(program.bound_keys)
    SEEN[name, data_parallel] = seen
    return seen


@pytest.mark.parametrize("data_parallel", [False, True], ids=["plain", "data-parallel"])
@pytest.mark.parametrize("name", list(MODELS))
def test_every_pass_list_keeps_its_postconditions(name, data_parallel):
    run_case(name, data_parallel)


def test_the_representative_set_runs_every_list():
    """Every kind of program was made and executed, checked, over the cases."""
    for case in CASES:
        if case not in SEEN:
            run_case(*case)
    seen = {key: set().union(*(s[key] for s in SEEN.values())) for key in next(iter(SEEN.values()))}
    assert seen["lists"] == set(pipeline.PASS_LISTS)
    assert seen["executed"] == set(EXECUTED)
    # the fused kernels and lean memory's rewrite went through the checks too
    from onnxtrain.kernels import library
    if library.library() is not None:
        assert seen["fused"] == {"algorithm", "forward", "update"}
        # the decoder kernels: in the training algorithm and its forward half
        # (memory="lean", data-parallel); the update half has no decoder chain
        assert seen["decoder"] == {"algorithm", "forward"}
    assert seen["scratch"] == {"update"}


def test_a_result_is_checked_even_with_checks_off(monkeypatch):
    """SSA and order are checked at the end of every list, checks on or not."""
    def swap(low):  # the last two nodes exchanged: out of order
        nodes = list(low.graph.node)
        low.set_nodes(nodes[:-2] + nodes[-1:] + nodes[-2:-1])

    lists = dict(pipeline.PASS_LISTS)
    lists[INFERENCE] = lists[INFERENCE] + (swap,)
    monkeypatch.setattr(pipeline, "PASS_LISTS", lists)
    tm = validate(mlp_classifier("adam"))
    assert not checking(None)
    with pytest.raises(PassError, match="inference, after its pass list: the graph is no longer SSA and sorted"):
        pipeline.lower(tm, "inference", [INFERENCE])


# ------------------------------------------------------------- planted bugs
def _lists_with(monkeypatch, original, planted) -> None:
    lists = {kind: tuple(planted if step is original else step for step in steps)
             for kind, steps in pipeline.PASS_LISTS.items()}
    monkeypatch.setattr(pipeline, "PASS_LISTS", lists)


def _lower_algorithm(check=True):
    tm = validate(mlp_classifier("adam"))
    return pipeline.lower(tm, "training_info[0].algorithm", [ALGORITHM], Request(0), check)


def test_a_step_that_breaks_ssa_is_named(monkeypatch):
    def twice(low):
        pipeline.shield_batch_norm_inputs(low)
        node = low.graph.node[0]
        low.graph.node.append(node)  # its outputs defined twice

    _lists_with(monkeypatch, pipeline.shield_batch_norm_inputs, twice)
    with pytest.raises(PassError, match=r"algorithm, after twice: .*already defined"):
        _lower_algorithm()


def test_a_step_that_breaks_the_order_is_named(monkeypatch):
    def reversed_nodes(low):
        low.set_nodes(list(reversed(low.graph.node)))

    _lists_with(monkeypatch, pipeline.elide_output_identities, reversed_nodes)
    with pytest.raises(PassError, match=r"after reversed_nodes: .*not defined before this node"):
        _lower_algorithm()


def test_a_step_that_breaks_its_own_postcondition_is_named(monkeypatch):
    def forgot(low):  # expand nothing: the Gradient node stays
        pass

    forgot.__name__ = "expand_gradient_nodes"
    _lists_with(monkeypatch, pipeline.expand_gradient_nodes, forgot)
    monkeypatch.setitem(pipeline.POSTCONDITIONS, forgot, pipeline.POSTCONDITIONS[pipeline.expand_gradient_nodes])
    with pytest.raises(PassError, match="after expand_gradient_nodes: Gradient node 'gradient0' is still there"):
        _lower_algorithm()


def test_onnx_checker_is_run_with_checks_on(monkeypatch):
    def bad_attribute(low):
        pipeline.refuse_preview_ops(low)
        relu = next(n for n in low.graph.node if n.op_type == "Relu")
        relu.attribute.append(helper.make_attribute("alpha", 0.5))  # Relu has no attribute

    _lists_with(monkeypatch, pipeline.refuse_preview_ops, bad_attribute)
    _lower_algorithm(check=False)  # order and SSA hold: only the checker sees it
    with pytest.raises(PassError, match="after bad_attribute: onnx.checker refuses the program"):
        _lower_algorithm()


def test_the_environment_turns_the_checks_on(monkeypatch):
    monkeypatch.setenv(CHECK_ENV, "1")
    assert checking(None) and not checking(False)


def test_an_executed_step_that_breaks_its_postcondition_is_named(monkeypatch):
    def claims_everything(ex):
        ex.inplace = frozenset(["not_a_state_variable"])

    lists = dict(EXECUTED)
    lists["update"] = lists["update"][:-1] + (claims_everything,)
    monkeypatch.setattr(executed, "EXECUTED", lists)
    monkeypatch.setitem(executed.POSTCONDITIONS, claims_everything, executed.POSTCONDITIONS[executed.inplace_plan])
    tm = validate(mlp_classifier("adam"))
    progs = ProgramSet(tm, {}, data_parallel=True)
    with pytest.raises(PassError, match="executed, after claims_everything: 'not_a_state_variable' is written"):
        execute(progs.splits[0].b, "update", ExecOptions(lean=True), check=True)


def test_a_kernel_rewrite_into_the_standard_program_is_named(monkeypatch):
    """The kernels go into a copy: ``sess.programs()`` stays standard ops."""
    from onnxtrain.kernels import llm
    from onnxtrain.kernels.fuse import KERNEL_DOMAIN

    def in_place(ex):  # the decoder rewrite without its copy
        llm.rewrite(ex.model.graph, list(ex.model.opset_import), KERNEL_DOMAIN)

    # (alone: after the optimizer kernels the model would be a copy already)
    monkeypatch.setattr(executed, "EXECUTED", dict(EXECUTED, algorithm=(in_place, executed.kernel_library)))
    monkeypatch.setattr(executed, "REWRITES", (in_place,))
    monkeypatch.setitem(executed.POSTCONDITIONS, in_place, executed.POSTCONDITIONS[executed.decoder_kernels])
    tm = validate(MODELS["exporter-llama-lora"]())
    program = ProgramSet(tm, model_metadata(tm.proto)).algorithms[0]
    with pytest.raises(PassError, match="executed, after in_place: library kernels were written into the standard"):
        execute(program, ALGORITHM, ExecOptions(fused_kernels=None), check=True)
