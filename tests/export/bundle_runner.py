"""A bundle trained from its manifest alone, with plain onnxruntime: the
steps docs/bundle.md ("A step, in any language") gives another language,
transcribed here so the tests check that the manifest says everything a
JavaScript trainer needs, and write a state.bin the way one would."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import onnxruntime as ort

DTYPES = {"float32": np.float32, "float64": np.float64, "float16": np.float16, "int8": np.int8,
          "uint8": np.uint8, "int16": np.int16, "uint16": np.uint16, "int32": np.int32,
          "uint32": np.uint32, "int64": np.int64, "uint64": np.uint64, "bool": np.bool_}


class ManifestRunner:
    """Trains the bundle in ``folder`` knowing only docs/bundle.md."""

    def __init__(self, folder) -> None:
        self.folder = Path(folder)
        self.manifest = json.loads((self.folder / "manifest.json").read_text())
        raw = (self.folder / self.manifest["state_file"]).read_bytes()
        assert len(raw) == self.manifest["state_bytes"]
        self.state = {e["name"]: self._value(raw, e) for e in self.manifest["state"]}
        self._sessions: dict[str, ort.InferenceSession] = {}

    @staticmethod
    def _value(raw: bytes, e: dict) -> np.ndarray:
        data = raw[e["offset"]:e["offset"] + e["length"]]
        return np.frombuffer(data, DTYPES[e["dtype"]]).reshape(e["shape"]).copy()

    def _run(self, program: dict, feeds: dict, pending: dict) -> dict[str, np.ndarray]:
        file = program["file"]
        if file not in self._sessions:
            # As many intra-op threads as the Python session it is compared
            # with (ONNXTRAIN_THREADS): some kernels (LSTM) split their sums by thread.
            so = ort.SessionOptions()
            so.intra_op_num_threads = int(os.environ.get("ONNXTRAIN_THREADS") or 0)
            self._sessions[file] = ort.InferenceSession(str(self.folder / file), so,
                                                        providers=["CPUExecutionProvider"])
        inputs = {f["name"]: feeds[f["name"]] for f in program.get("feeds", [])}
        inputs.update({f["name"]: feeds[f["name"]] for f in program.get("optional_feeds", [])
                       if f["name"] in feeds})
        for name in program.get("state_inputs", []):
            inputs[name] = pending.get(name, self.state[name])
        values = self._sessions[file].run(program["outputs"], inputs)
        return dict(zip(program["outputs"], values))

    def _stage(self, program: dict, results: dict, pending: dict) -> None:
        entries = {e["name"]: e for e in self.manifest["state"]}
        for b in program["bindings"]:
            new, e = results[b["value"]], entries[b["key"]]
            assert new.dtype == DTYPES[e["dtype"]] and list(new.shape) == e["shape"], (b, new.shape)
            pending[b["key"]] = new

    def initialize(self) -> None:
        pending: dict = {}
        for program in self.manifest["initializations"]:
            if program is not None:
                self._stage(program, self._run(program, {}, pending), pending)
        self.state.update(pending)

    def train_step(self, feeds: dict, algorithm: int | None = None) -> dict[str, np.ndarray]:
        algorithms = self.manifest["algorithms"]
        programs = algorithms if algorithm is None else [algorithms[algorithm]]
        pending: dict = {}
        returned: dict = {}
        for program in programs:
            results = self._run(program, feeds, pending)
            self._stage(program, results, pending)
            returned.update({n: results[n] for n in program["returned"]})
        self.state.update(pending)  # every binding at once, after every program ran
        return returned

    def run(self, feeds: dict) -> dict[str, np.ndarray]:
        return self._run(self.manifest["inference"], feeds, {})

    def state_bytes(self) -> bytes:
        """A state.bin of the current state, in the manifest's layout."""
        out = bytearray(self.manifest["state_bytes"])
        for e in self.manifest["state"]:
            data = np.ascontiguousarray(self.state[e["name"]]).tobytes()
            assert len(data) == e["length"]
            out[e["offset"]:e["offset"] + e["length"]] = data
        return bytes(out)
