// Train a bundle on Node as a spec says, then save it: Python's tests drive
// this (tests/js/) to bring a bundle trained in JavaScript back to Python.
//
//   node js/test/train_bundle.mjs SPEC.json
//
// SPEC: { bundle, out, runtime: "node" | "web", initialize, steps: [{ feeds:
// { name: { file, dtype, shape } }, algorithm }], fit: { feeds, epochs,
// batchSize } | null, learningRate }.  File paths are relative to SPEC's
// folder.  Prints { losses, fitLoss, position } as JSON.

import { readFileSync } from 'node:fs';
import path from 'node:path';

import { TrainingSession } from 'onnxtrain';

const ARRAYS = { float32: Float32Array, float64: Float64Array, int64: BigInt64Array, int32: Int32Array };

const specFile = path.resolve(process.argv[2]);
const base = path.dirname(specFile);
const spec = JSON.parse(readFileSync(specFile, 'utf8'));
const ort = spec.runtime === 'web' ? await import('onnxruntime-web') : await import('onnxruntime-node');
if (spec.runtime === 'web') ort.env.wasm.numThreads = 1;

function tensor({ file, dtype, shape }) {
  const bytes = readFileSync(path.resolve(base, file));
  const copy = bytes.buffer.slice(bytes.byteOffset, bytes.byteOffset + bytes.byteLength);
  return new ort.Tensor(dtype, new ARRAYS[dtype](copy), shape);
}

const sess = await TrainingSession.load(ort, path.resolve(base, spec.bundle));
if (spec.initialize) await sess.initialize();
if (spec.learningRate !== undefined) sess.learningRate = spec.learningRate;
const losses = [];
for (const step of spec.steps ?? []) {
  const feeds = Object.fromEntries(Object.entries(step.feeds).map(([k, s]) => [k, tensor(s)]));
  const out = await sess.trainStep(feeds, step.algorithm === null || step.algorithm === undefined ? {} : { algorithm: step.algorithm });
  if (out.loss) losses.push(Number(out.loss.data[0]));
}
let fitLoss = null;
if (spec.fit) {
  const data = Object.fromEntries(Object.entries(spec.fit.feeds).map(([k, s]) => [k, tensor(s)]));
  fitLoss = (await sess.fit(data, { epochs: spec.fit.epochs, batchSize: spec.fit.batchSize, shuffle: false })).loss;
}
await sess.save(path.resolve(base, spec.out), { overwrite: true });
console.log(JSON.stringify({ losses, fitLoss, position: sess.fitPosition }));
