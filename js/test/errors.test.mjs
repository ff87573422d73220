// Bad input gets a clear message and loses nothing: wrong feeds, an unknown
// bundle version, a missing file, a failed step (the state stays as it was).

import assert from 'node:assert/strict';
import { cpSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { after, test } from 'node:test';

import * as ort from 'onnxruntime-node';
import { TrainingSession } from 'onnxtrain';

import { bytes, fixtures } from './helpers.mjs';

const { dir, cases } = fixtures();
const scratch = mkdtempSync(path.join(tmpdir(), 'onnxtrain-js-errors-'));
after(() => rmSync(scratch, { recursive: true, force: true }));

const mlp = path.join(dir, cases.mlp.bundle);
const faulty = path.join(dir, cases.faulty.bundle);
const f32 = (dims, fill = 0.5) => new ort.Tensor('float32', new Float32Array(dims.reduce((a, b) => a * b, 1)).fill(fill), dims);
const i64 = (n) => new ort.Tensor('int64', new BigInt64Array(n).fill(1n), [n]);

/** A copy of a fixture bundle, changed by `edit(folder)`. */
function copyOf(source, name, edit) {
  const folder = path.join(scratch, name);
  cpSync(source, folder, { recursive: true });
  edit(folder);
  return folder;
}

function editManifest(folder, change) {
  const file = path.join(folder, 'manifest.json');
  const m = JSON.parse(readFileSync(file, 'utf8'));
  change(m);
  writeFileSync(file, JSON.stringify(m));
}

async function unchanged(sess, action) {
  const before = Buffer.from(sess.stateBytes());
  await action();
  assert.ok(before.equals(Buffer.from(sess.stateBytes())), 'the state changed');
}

test('a wrong feed name, dtype or shape names the feed and what was expected', async () => {
  const sess = await TrainingSession.load(ort, mlp);
  await unchanged(sess, async () => {
    await assert.rejects(sess.trainStep({ X: f32([4, 64]), labels: i64(4) }),
      /trainStep: unknown feed 'labels'; the model's inputs are \['X', 'label'\]/);
    await assert.rejects(sess.trainStep({ X: f32([4, 64]) }),
      /trainStep: missing feed 'label' \(input of training_info\[0\]\.algorithm, expected int64\['N'\]\)/);
    await assert.rejects(sess.trainStep({ X: new ort.Tensor('float64', new Float64Array(256), [4, 64]), label: i64(4) }),
      /trainStep: feed 'X' has dtype float64, expected float32\['N', 64\]/);
    await assert.rejects(sess.trainStep({ X: f32([4, 8, 8]), label: i64(4) }),
      /trainStep: feed 'X' has shape \[4, 8, 8\], expected float32\['N', 64\]/);
    await assert.rejects(sess.trainStep({ X: f32([4, 63]), label: i64(4) }),
      /trainStep: feed 'X' has shape \[4, 63\], expected float32\['N', 64\]/);
    await assert.rejects(sess.trainStep({ X: f32([4, 64]), label: i64(3) }),
      /trainStep: feeds disagree on the symbolic dimension 'N': X\[0\]=4, label\[0\]=3/);
    await assert.rejects(sess.trainStep({ X: new Float32Array(256), label: i64(4) }),
      /trainStep: feed 'X' must be an onnxruntime Tensor .*got Float32Array; expected float32\['N', 64\]/);
    await assert.rejects(sess.trainStep({ X: f32([4, 64]), label: i64(4), W1: f32([64, 32]) }),
      /trainStep: 'W1' is a state variable/);
    await assert.rejects(sess.trainStep({ X: f32([4, 64]), label: i64(4) }, { algorithm: 1 }),
      /trainStep: algorithm must be undefined or an index in \[0, 1\), got 1/);
    await assert.rejects(sess.run({ X: f32([4, 60]) }), /run: feed 'X' has shape \[4, 60\], expected float32\['N', 64\]/);
    await assert.rejects(sess.run({ X: f32([4, 64]) }, { outputs: ['nope'] }), /run: 'nope' is not an output of the main graph/);
  });
  // A good step still goes through after the bad ones.
  const out = await sess.trainStep({ X: f32([4, 64]), label: i64(4) });
  assert.ok(Number.isFinite(out.loss.data[0]));
});

test('an unknown bundle version is refused in one message naming the version', async () => {
  const folder = copyOf(mlp, 'v99', (f) => editManifest(f, (m) => { m.version = 99; }));
  await assert.rejects(TrainingSession.load(ort, folder),
    (err) => /bundle version 99 is not one this onnxtrain reads \(it reads version 1\)/.test(err.message)
      && err.message.includes(folder));
  const other = copyOf(mlp, 'format', (f) => editManifest(f, (m) => { m.format = 'something-else'; }));
  await assert.rejects(TrainingSession.load(ort, other), /manifest.json has format "something-else", expected "onnxtrain-bundle"/);
});

test('a missing file is refused in one message naming the file', async () => {
  for (const name of ['state.bin', 'program_algorithm_0.onnx', 'inference.onnx', 'training_model.onnx']) {
    const folder = copyOf(mlp, `missing-${name}`, (f) => rmSync(path.join(f, name)));
    await assert.rejects(TrainingSession.load(ort, folder),
      (err) => err.message.startsWith(`bundle ${folder}: missing file ${name} (`), name);
  }
  const two = copyOf(mlp, 'missing-two', (f) => {
    rmSync(path.join(f, 'state.bin'));
    rmSync(path.join(f, 'program_inference.onnx'));
  });
  await assert.rejects(TrainingSession.load(ort, two), /missing files program_inference\.onnx \(inference\.file; no such file\), state\.bin \(state_file; no such file\)/);
  const none = copyOf(mlp, 'missing-manifest', (f) => rmSync(path.join(f, 'manifest.json')));
  await assert.rejects(TrainingSession.load(ort, none), /missing file manifest\.json/);
  await assert.rejects(TrainingSession.load(ort, path.join(scratch, 'no-such-folder')), /no such folder/);
  // The same from files given as bytes.
  const files = { 'manifest.json': readFileSync(path.join(mlp, 'manifest.json')) };
  await assert.rejects(TrainingSession.load(ort, files), /bundle \(files given as bytes\): missing files .*state\.bin \(state_file; not among the files given\)/);
});

test('a state.bin of the wrong size, or a file name that leaves the folder, is refused', async () => {
  const short = copyOf(mlp, 'short', (f) => writeFileSync(path.join(f, 'state.bin'), Buffer.alloc(10)));
  await assert.rejects(TrainingSession.load(ort, short), /state\.bin holds 10 bytes, but manifest\.json says state_bytes \d+/);
  const escape = copyOf(mlp, 'escape', (f) => editManifest(f, (m) => { m.training_model = '../x.onnx'; }));
  await assert.rejects(TrainingSession.load(ort, escape), /training_model must be a file name in the bundle's folder, got "\.\.\/x\.onnx"/);
  const scalar = copyOf(mlp, 'scalar', (f) => editManifest(f, (m) => {
    const step = m.state.find((v) => v.dtype === 'int64' && v.shape.length === 0);
    step.shape = [1, 1, 1];
    step.length = 8;
  }));
  const sess = await TrainingSession.load(ort, scalar); // the layout fits, the program disagrees
  await unchanged(sess, () => assert.rejects(sess.trainStep({ X: f32([2, 64]), label: i64(2) }),
    /trainStep: training_info\[0\]\.update_binding\[\d+\]: value '[^']+' is (float32|int64)\[[\d, ]*\], but state variable '[^']+' is (float32|int64)\[[\d, ]+\]/));
});

test('a failed step leaves the state unchanged: a bound value of the wrong shape after another algorithm ran', async () => {
  const sess = await TrainingSession.load(ort, faulty);
  const X = f32([2, 3]);
  await unchanged(sess, () => assert.rejects(sess.trainStep({ X, D: f32([2, 3]) }),
    /trainStep: training_info\[1\]\.update_binding\[0\]: value 'V_moved' is float32\[2, 3\], but state variable 'V' is float32\[3\]/));
  await unchanged(sess, () => assert.rejects(sess.trainStep({ X, D: f32([2]) }),
    (err) => err.message.startsWith('trainStep: onnxruntime failed in training_info[1].algorithm (program_algorithm_1.onnx): ')));
  // The good steps: both algorithms commit together.
  await sess.trainStep({ X, D: f32([3], 0.25) });
  assert.deepEqual(Array.from(sess.state.W.data), [2, 3, 4]);
  assert.deepEqual(Array.from(sess.state.V.data), [-0.75, -1.75, -2.75]);
  // { algorithm: 0 } ignores algorithm 1's feed (as Python).
  await sess.trainStep({ X }, { algorithm: 0 });
  assert.deepEqual(Array.from(sess.state.W.data), [3, 4, 5]);
});

test('state is a frozen snapshot of copies', async () => {
  const sess = await TrainingSession.load(ort, mlp);
  const before = Buffer.from(sess.stateBytes());
  const state = sess.state;
  assert.ok(Object.isFrozen(state));
  assert.throws(() => { state.W1 = null; }, TypeError);
  state.W1.data.fill(7);
  assert.ok(before.equals(Buffer.from(sess.stateBytes())));
  assert.notEqual(sess.state.W1.data[0], 7);
  const out = await sess.trainStep({ X: f32([2, 64]), label: i64(2) });
  out.loss.data[0] = 99; // returned outputs are the caller's
  assert.ok(!before.equals(Buffer.from(sess.stateBytes())));
  assert.equal(bytes(sess.getState('W1').data).length, 64 * 32 * 4);
});

test('learningRate: get and set where the bundle records it, a clear error where not', async () => {
  const sess = await TrainingSession.load(ort, mlp);
  const { state: lrName, base } = sess.manifest.training.learning_rate;
  const lrVar = sess.manifest.state.find((v) => v.name === lrName);
  assert.equal(sess.learningRate, lrVar.dtype === 'float32' ? Math.fround(base) : base);
  sess.learningRate = 0.5;
  assert.equal(sess.learningRate, 0.5);
  assert.equal(sess.state[sess.manifest.training.learning_rate.state].dims.length, 0, 'a scalar stays a scalar');
  assert.throws(() => { sess.learningRate = 'fast'; }, /learningRate: expected a finite number, got fast/);
  const hand = await TrainingSession.load(ort, path.join(dir, cases.linear.bundle));
  assert.throws(() => hand.learningRate, /learningRate: this bundle records no learning-rate state variable/);
  assert.throws(() => { hand.learningRate = 0.1; }, /learningRate: this bundle records no learning-rate state variable/);
});

test('load refuses something that is not an onnxruntime module', async () => {
  await assert.rejects(TrainingSession.load({}, mlp), /the first argument must be the onnxruntime module/);
});

test('setState checks dtype and shape and sets all or nothing; getState copies', async () => {
  const sess = await TrainingSession.load(ort, mlp);
  const before = Buffer.from(sess.stateBytes());
  assert.throws(() => sess.setState({ b1: new ort.Tensor('float32', new Float32Array(31), [31]) }),
    /setState: state variable 'b1' has shape \[31\], expected float32\[32\]/);
  assert.throws(() => sess.setState({ b1: new Float32Array(32), nope: new Float32Array(1) }),
    /setState: 'nope' is not a state variable/);
  assert.ok(before.equals(Buffer.from(sess.stateBytes())), 'nothing was set');
  const ones = new Float32Array(32).fill(1);
  await sess.setState({ b1: ones });
  ones[0] = 5; // the session holds its own copy
  assert.deepEqual(Array.from(sess.getState('b1').data), new Array(32).fill(1));
  assert.throws(() => sess.getState('nope'), /getState: 'nope' is not a state variable/);
  await sess.release();
});
