"""Atomic-write bugs that slipped past the suite (issue 26, requirement 8).

``write_model`` (and so ``TrainingSession.export``) writes every file under
a temporary name, fsyncs it, and renames it into place; with external data
the data file is renamed before the model that refers to it, and tensors of
1 MiB or more start on a 4096-byte boundary of the data file.  These tests
watch ``os.replace`` and ``os.fsync`` (patched) and read the offsets back.

Each test was checked against the one-line bug it names: planted by hand,
the test fails; reverted, it passes.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.io.storage import write_model

MIB = 2**20


def model_with(tensors: dict[str, np.ndarray]) -> onnx.ModelProto:
    """A model whose initializers are ``tensors`` (in order), all summed into Y."""
    names = list(tensors)
    nodes = [helper.make_node("ReduceSum", [n], [f"{n}_sum"], keepdims=0) for n in names]
    nodes.append(helper.make_node("Sum", [f"{n}_sum" for n in names], ["Y"]))
    g = helper.make_graph(nodes, "g", [], [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [])],
                          [numpy_helper.from_array(v, k) for k, v in tensors.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def mixed_sizes() -> dict[str, np.ndarray]:
    """Small and large tensors, interleaved so no large one starts aligned by luck."""
    rng = np.random.default_rng(0)
    return {
        "small0": rng.standard_normal(300).astype(np.float32),            # 1200 bytes
        "large1": rng.standard_normal(MIB // 4 + 5).astype(np.float32),   # 1 MiB + 20
        "small2": rng.standard_normal(333).astype(np.float32),            # 1332 bytes
        "large3": rng.standard_normal(MIB // 4).astype(np.float32),       # exactly 1 MiB
        "inline": np.arange(4, dtype=np.float32),                         # stays in the model
    }


class FileOps:
    """Records os.fsync (the inode it synced) and os.replace calls, in order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[tuple] = []
        self.synced: set[tuple[int, int]] = set()
        real_fsync, real_replace = os.fsync, os.replace

        def fsync(fd: int) -> None:
            st = os.fstat(fd)
            real_fsync(fd)
            self.synced.add((st.st_dev, st.st_ino))
            self.events.append(("fsync", (st.st_dev, st.st_ino)))

        def replace(src, dst, *args, **kwargs) -> None:
            st = os.stat(src)
            self.events.append(("replace", Path(src), Path(dst), (st.st_dev, st.st_ino),
                                (st.st_dev, st.st_ino) in self.synced))
            real_replace(src, dst, *args, **kwargs)

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", replace)

    def replaces(self) -> list[tuple]:
        return [e for e in self.events if e[0] == "replace"]


# ------------------------------------------------------------------ rename order
def test_the_data_file_is_renamed_into_place_before_the_model(tmp_path, monkeypatch):
    """The model that refers to a data file may appear only once that file
    is complete under its final name.

    Bug caught: the two ``os.replace`` calls of ``write_model`` swapped (the
    model renamed before its data file)."""
    target = tmp_path / "m.onnx"
    write_model(model_with(mixed_sizes()), target, external_data=True)  # an older version
    ops = FileOps(monkeypatch)
    seen_at_model_rename: list[bool] = []
    real_replace = os.replace

    def checking(src, dst, *args, **kwargs):
        if Path(dst) == target:
            written = onnx.load(str(src), load_external_data=False)
            location = next(e.value for t in written.graph.initializer for e in t.external_data
                            if e.key == "location")
            seen_at_model_rename.append((tmp_path / location).is_file())
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", checking)
    write_model(model_with(mixed_sizes()), target, external_data=True)
    assert ops.replaces(), "os.replace was not used"
    dsts = [e[2].name for e in ops.replaces()]
    assert len(dsts) == 2 and dsts[0].startswith("m.onnx.") and dsts[0].endswith(".data"), dsts
    assert dsts[1] == "m.onnx", dsts
    assert seen_at_model_rename == [True]
    loaded = onnx.load(str(target))
    for t in loaded.graph.initializer:
        np.testing.assert_array_equal(numpy_helper.to_array(t), mixed_sizes()[t.name], err_msg=t.name)


# ------------------------------------------------------------------ fsync before rename
@pytest.mark.parametrize("external", [False, True], ids=["self-contained", "external-data"])
def test_every_temporary_file_is_fsynced_before_its_rename(tmp_path, monkeypatch, external):
    """Power loss after a rename must not leave a renamed but empty file: each
    file renamed into place was fsynced (the same inode) before the rename,
    and the folder is fsynced after the last rename.

    Bug caught: ``os.fsync(f.fileno())`` dropped from the temporary-file
    writer of ``storage`` (flush alone leaves the data in the page cache)."""
    ops = FileOps(monkeypatch)
    target = tmp_path / "m.onnx"
    write_model(model_with(mixed_sizes()), target, external_data=external)
    replaces = ops.replaces()
    assert len(replaces) == (2 if external else 1)
    for _, src, dst, _inode, synced in replaces:
        assert synced, f"{dst.name} was renamed into place from {src.name} without an fsync"
    folder = os.stat(tmp_path)
    last_replace = max(i for i, e in enumerate(ops.events) if e[0] == "replace")
    assert ("fsync", (folder.st_dev, folder.st_ino)) in ops.events[last_replace:], \
        "the folder was not fsynced after the renames"


def test_an_adapter_file_is_fsynced_before_its_rename(tmp_path, monkeypatch):
    """The same for onnxruntime's LoRA adapter files (``write_adapter``, which
    ``onnxtrain.genai`` uses): the file renamed into place is the inode that
    was fsynced, and it holds the parameters.

    Bug caught: the ``os.fsync`` of the temporary adapter file dropped from
    ``runtime/adapters.py`` (onnxruntime's exporter does not sync it)."""
    import onnxruntime as ort

    from onnxtrain.runtime.adapters import write_adapter

    params = {"lora_A": np.arange(6, dtype=np.float32).reshape(2, 3),
              "lora_B": np.ones((3, 2), np.float32)}
    ops = FileOps(monkeypatch)
    target = tmp_path / "a.onnx_adapter"
    write_adapter(target, params)
    replaces = ops.replaces()
    assert [e[2] for e in replaces] == [target]
    _, src, _, _inode, synced = replaces[0]
    assert synced, f"{target.name} was renamed into place from {src.name} without an fsync"
    loaded = ort.AdapterFormat.read_adapter(str(target)).get_parameters()
    assert sorted(loaded) == sorted(params)
    for name, value in params.items():
        np.testing.assert_array_equal(loaded[name].numpy(), value, err_msg=name)


# ------------------------------------------------------------------ alignment
def test_large_tensors_start_on_a_page_boundary_of_the_data_file(tmp_path):
    """Tensors of at least 1 MiB at offsets divisible by 4096 (runtimes map
    them), smaller external ones by 64; every range holds its tensor.

    Bug caught: the sign of the padding flipped in ``_DataSink._align``
    (``pad = -self.offset % align`` written as ``pad = self.offset % align``)."""
    tensors = mixed_sizes()
    target = tmp_path / "m.onnx"
    write_model(model_with(tensors), target, external_data=True)
    skeleton = onnx.load(str(target), load_external_data=False)
    checked = 0
    for t in skeleton.graph.initializer:
        info = {e.key: e.value for e in t.external_data}
        if t.name == "inline":
            assert t.data_location != TensorProto.EXTERNAL
            continue
        offset, length = int(info["offset"]), int(info["length"])
        expected = tensors[t.name].tobytes()
        assert length == len(expected), t.name
        align = 4096 if length >= MIB else 64
        assert offset % align == 0, f"{t.name}: {length} bytes at offset {offset}, not a multiple of {align}"
        with open(tmp_path / info["location"], "rb") as f:
            f.seek(offset)
            assert f.read(length) == expected, t.name
        checked += 1
    assert checked == 4
