// What the Node examples (node_finetune.mjs, federated/) share: the package
// and onnxruntime-node, the 8x8 digits that ship with the Python package
// (onnxtrain/data/digits.npz, read with no dependency: a .npz is a zip of
// .npy files), and the test accuracy of a classifier bundle.

import { readFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import { inflateRawSync } from 'node:zlib';

// In the repository the package and onnxruntime-node come from js/
// (cd js && ONNXRUNTIME_NODE_INSTALL=skip npm ci). In your own project write
//   import * as ort from 'onnxruntime-node';
//   import { TrainingSession, permutation } from 'onnxtrain';
export const ort = createRequire(new URL('../js/package.json', import.meta.url))('onnxruntime-node');
export const { TrainingSession, permutation } = await import(new URL('../js/src/node.js', import.meta.url));

const DIGITS = new URL('../onnxtrain/data/digits.npz', import.meta.url);

/** The arrays of a .npz file: { name: { data: TypedArray, shape: number[] } }. */
export function readNpz(file) {
  const zip = readFileSync(file);
  const end = zip.lastIndexOf(Buffer.from([0x50, 0x4b, 0x05, 0x06])); // end of central directory
  if (end < 0) throw new Error(`${file}: not a zip (.npz) file`);
  const count = zip.readUInt16LE(end + 10);
  let at = zip.readUInt32LE(end + 16);
  const arrays = {};
  for (let i = 0; i < count; i++) {
    const method = zip.readUInt16LE(at + 10);
    const size = zip.readUInt32LE(at + 20);
    const nameLength = zip.readUInt16LE(at + 28);
    const skip = zip.readUInt16LE(at + 30) + zip.readUInt16LE(at + 32);
    const name = zip.toString('utf8', at + 46, at + 46 + nameLength);
    const local = zip.readUInt32LE(at + 42);
    const start = local + 30 + zip.readUInt16LE(local + 26) + zip.readUInt16LE(local + 28);
    const stored = zip.subarray(start, start + size);
    const npy = method === 8 ? inflateRawSync(stored) : stored;
    arrays[name.replace(/\.npy$/, '')] = readNpy(npy, `${file}:${name}`);
    at += 46 + nameLength + skip;
  }
  return arrays;
}

const NPY_TYPES = { '|u1': Uint8Array, '<f4': Float32Array, '<f8': Float64Array, '<i8': BigInt64Array, '<i4': Int32Array };

/** One .npy array (little-endian, C order). */
function readNpy(bytes, where) {
  const version = bytes[6];
  const headerLength = version === 1 ? bytes.readUInt16LE(8) : bytes.readUInt32LE(8);
  const offset = version === 1 ? 10 : 12;
  const header = bytes.toString('latin1', offset, offset + headerLength);
  const descr = /'descr':\s*'([^']+)'/.exec(header)?.[1];
  const shape = /'shape':\s*\(([^)]*)\)/.exec(header)?.[1].split(',').filter((s) => s.trim()).map(Number);
  if (/'fortran_order':\s*True/.test(header) || !NPY_TYPES[descr]) throw new Error(`${where}: unsupported array (${header.trim()})`);
  const data = bytes.subarray(offset + headerLength);
  const copy = data.buffer.slice(data.byteOffset, data.byteOffset + data.byteLength);
  return { data: new NPY_TYPES[descr](copy), shape };
}

/**
 * The digits as Python's load_digits gives them: X float32 [1797, 64] in
 * [0, 1] (counts / 16), y int64 [1797].
 */
export function loadDigits() {
  const { X, y } = readNpz(DIGITS);
  return {
    X: { data: Float32Array.from(X.data, (v) => v / 16), shape: X.shape },
    y: { data: BigInt64Array.from(y.data, (v) => BigInt(v)), shape: y.shape },
  };
}

/** Rows `rows` (indices) of a { data, shape } array. */
export function takeRows(array, rows) {
  const width = array.shape.slice(1).reduce((a, b) => a * b, 1);
  const out = new array.data.constructor(rows.length * width);
  rows.forEach((r, i) => out.set(array.data.subarray(r * width, (r + 1) * width), i * width));
  return { data: out, shape: [rows.length, ...array.shape.slice(1)] };
}

/** The names a digits classifier bundle uses: { input, target, prediction, images (rank-4 input) }. */
export function namesOf(sess) {
  const { training, inference } = sess.manifest;
  const input = training?.inputs?.[0] ?? inference.feeds[0].name;
  const feed = inference.feeds.find((f) => f.name === input);
  return {
    input,
    dtype: feed.dtype,
    images: feed.shape.length === 4,
    target: training?.target ?? 'label',
    prediction: training?.prediction ?? inference.outputs[0],
  };
}

/** Pixels { data, shape: [n, 64] } as the bundle's input wants them (dtype, [n, 1, 8, 8] for images). */
export function asInput(sess, X) {
  const { dtype, images } = namesOf(sess);
  const data = dtype === 'float64' ? Float64Array.from(X.data) : X.data;
  return { data, shape: images ? [X.shape[0], 1, 8, 8] : X.shape };
}

/** The fraction of rows of X whose predicted class (argmax) is y's. */
export async function accuracy(sess, X, y) {
  const { input, dtype, prediction } = namesOf(sess);
  const { data, shape } = asInput(sess, X);
  const logits = (await sess.run({ [input]: new ort.Tensor(dtype, data, shape) }, { outputs: [prediction] }))[prediction];
  const classes = logits.dims[1];
  let right = 0;
  for (let i = 0; i < logits.dims[0]; i++) {
    let best = 0;
    for (let c = 1; c < classes; c++) if (logits.data[i * classes + c] > logits.data[i * classes + best]) best = c;
    if (BigInt(best) === y.data[i]) right += 1;
  }
  return right / logits.dims[0];
}
