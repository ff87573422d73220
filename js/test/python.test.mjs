// JavaScript against Python: every fixture case replayed on onnxruntime-node
// (bit for bit: the same standard programs on the same onnxruntime kernels)
// and on onnxruntime-web's WASM build under Node (within float rounding).
// ONNXTRAIN_JS_EXACT=0 compares Node within rounding too: for an
// onnxruntime-node whose kernels differ from the Python onnxruntime's (an
// older release, when checking the declared peer range).

import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import path from 'node:path';
import { test } from 'node:test';

import { TrainingSession } from 'onnxtrain';

import { bytes, closeness, fixtures, readTensor, runtimes } from './helpers.mjs';

const { dir, cases } = fixtures();
const ort = await runtimes();

/** The state variables of a bundle's state.bin, by name. */
function stateOf(folder) {
  const manifest = JSON.parse(readFileSync(path.join(folder, 'manifest.json'), 'utf8'));
  const raw = readFileSync(path.join(folder, 'state.bin'));
  return { manifest, raw };
}

function compareState(sess, expectedFolder, exact, what) {
  const { manifest, raw } = stateOf(expectedFolder);
  const got = sess.stateBytes();
  if (exact) {
    for (const v of manifest.state) {
      assert.ok(bytes(got.subarray(v.offset, v.offset + v.length)).equals(raw.subarray(v.offset, v.offset + v.length)),
        `${what}: state variable '${v.name}' differs from Python's`);
    }
    assert.ok(Buffer.from(got).equals(raw), `${what}: state.bin differs from Python's`);
    return;
  }
  const state = sess.state;
  for (const v of manifest.state) {
    const Array = state[v.name].data.constructor;
    const want = new Array(raw.buffer.slice(raw.byteOffset + v.offset, raw.byteOffset + v.offset + v.length));
    const worst = closeness(state[v.name].data, want);
    assert.ok(worst <= 1, `${what}: state variable '${v.name}' is off by ${worst.toExponential(2)} tolerances`);
  }
}

function compareOutputs(got, expected, exact, what) {
  for (const [name, tensor] of Object.entries(expected)) {
    assert.ok(got[name], `${what}: output '${name}' missing`);
    assert.deepEqual(Array.from(got[name].dims), Array.from(tensor.dims), `${what}: '${name}' shape`);
    if (exact) assert.ok(bytes(got[name].data).equals(bytes(tensor.data)), `${what}: '${name}' differs from Python's`);
    else {
      const worst = closeness(got[name].data, tensor.data);
      assert.ok(worst <= 1, `${what}: '${name}' is off by ${worst.toExponential(2)} tolerances`);
    }
  }
}

/** a < b for versions "1.29.0". */
function older(a, b) {
  const [x, y] = [a, b].map((v) => v.split(/[.-]/).slice(0, 3).map(Number));
  for (let i = 0; i < 3; i++) if (x[i] !== y[i]) return x[i] < y[i];
  return false;
}

for (const [backend, runtime] of Object.entries(ort)) {
  for (const c of Object.values(cases).filter((k) => k.steps)) {
    test(`${c.name} on onnxruntime-${backend} matches Python`, async () => {
      const exact = backend === 'node' && c.exact && process.env.ONNXTRAIN_JS_EXACT !== '0';
      const min = c.min_onnxruntime;
      if (min && older(runtime.env.versions.common, min.version)) {
        // A known limit of the bundle (its record says why): this onnxruntime refuses it, clearly.
        await assert.rejects(TrainingSession.load(runtime, path.join(dir, c.bundle)),
          (err) => err.message.includes('onnxruntime could not load') && err.message.includes(min.refusal));
        return;
      }
      const sess = await TrainingSession.load(runtime, path.join(dir, c.bundle));
      if (c.initialize) await sess.initialize();
      for (const [i, step] of c.steps.entries()) {
        if (step.learning_rate !== undefined) sess.learningRate = step.learning_rate;
        const feeds = Object.fromEntries(Object.entries(step.feeds).map(([k, s]) => [k, readTensor(runtime, dir, s)]));
        const out = await sess.trainStep(feeds, step.algorithm === null ? {} : { algorithm: step.algorithm });
        assert.deepEqual(Object.keys(out).sort(), Object.keys(step.outputs).sort(), `step ${i}: returned outputs`);
        const expected = Object.fromEntries(Object.entries(step.outputs).map(([k, s]) => [k, readTensor(runtime, dir, s)]));
        compareOutputs(out, expected, exact, `${c.name} step ${i}`);
      }
      compareState(sess, path.join(dir, c.after), exact, c.name);
      const feeds = Object.fromEntries(Object.entries(c.run.feeds).map(([k, s]) => [k, readTensor(runtime, dir, s)]));
      const expected = Object.fromEntries(Object.entries(c.run.outputs).map(([k, s]) => [k, readTensor(runtime, dir, s)]));
      compareOutputs(await sess.run(feeds), expected, exact, `${c.name} run`);
      await sess.release();
    });
  }
}
